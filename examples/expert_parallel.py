"""Training with expert parallelism: each rank holds E / P experts of every MoE layer.

    torchrun --nproc-per-node 2 examples/expert_parallel.py --steps 50      # one GPU per rank
    python examples/expert_parallel.py --processes 2 --steps 5               # CPU processes

A toy regression model (linear -> mok.nn.MoE -> linear) learns a fixed random teacher. Every rank
draws its own batch. The gradients follow data parallelism over the P ranks (the step's loss is
the mean of the ranks' losses):

- replicated parameters (router, shared expert, the linears): all-reduced and averaged, as DDP
  does;
- a rank's own experts: mok's backward already sums the contributions of every rank's tokens to
  them, so they are only divided by P; nothing is communicated for them.

`train` returns each step's mean loss and how much every parameter moved (experts gathered from
all ranks); tests/integrations/test_examples.py checks them against one process that holds every
expert and trains on the union of the ranks' batches.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

from mok.nn import MoE

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, TOKENS = 32, 16, 8, 2, 32


class ToyModel(nn.Module):
    def __init__(self, ep_group: dist.ProcessGroup | None, device: torch.device) -> None:
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN, device=device)
        self.moe = MoE(HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, shared_intermediate_size=16,
                       ep_group=ep_group, device=device)
        self.out = nn.Linear(HIDDEN, HIDDEN, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(h + self.moe(h))


EXPERT_PARAMETERS = ("moe.w_gate", "moe.w_up", "moe.w_down")


def build(ep_group, device, seed=0) -> ToyModel:
    """The same initial model on every rank; with ep_group, rank r keeps experts
    [r * E / P, (r + 1) * E / P) of the full model's."""
    torch.manual_seed(seed)
    full = ToyModel(None, device)
    if ep_group is None:
        return full
    model = ToyModel(ep_group, device)
    rank, ranks = dist.get_rank(ep_group), dist.get_world_size(ep_group)
    per_rank = EXPERTS // ranks
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            source = full.get_parameter(name)
            if name in EXPERT_PARAMETERS:
                source = source[rank * per_rank:(rank + 1) * per_rank]
            parameter.copy_(source)
    return model


def batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch of step `step`, and the teacher's targets."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=generator)
    teacher = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(7))
    teacher = teacher / HIDDEN ** 0.5
    return x.to(device), torch.tanh(x @ teacher).to(device)


def train(steps: int, *, ep_group=None, ranks: int = 1, device=None, lr: float = 0.05):
    """(mean loss of each step, final minus initial value of every parameter, experts of all
    ranks included) of SGD over `steps`.

    With ep_group: this rank's share of an expert-parallel run. Without: one process training on
    the batches of `ranks` ranks at once, the reference the expert-parallel run must match.
    """
    device = device or torch.device("cpu")
    model = build(ep_group, device)
    initial = _full_parameters(model, ep_group)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    rank = dist.get_rank(ep_group) if ep_group is not None else 0
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        if ep_group is None:  # the union of the ranks' batches, the mean of their losses
            loss = sum(nn.functional.mse_loss(model(x), y)
                       for x, y in (batch(step, r, device) for r in range(ranks))) / ranks
            loss.backward()
            losses.append(loss.item())
        else:
            x, y = batch(step, rank, device)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            world = dist.get_world_size(ep_group)
            for name, parameter in model.named_parameters():
                if name in EXPERT_PARAMETERS:
                    parameter.grad /= world       # already summed over every rank's tokens
                else:
                    dist.all_reduce(parameter.grad, group=ep_group)
                    parameter.grad /= world       # DDP's average
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=ep_group)
            losses.append(float(mean) / world)
        optimizer.step()
    final = _full_parameters(model, ep_group)
    return losses, {name: final[name] - initial[name] for name in final}


def _full_parameters(model: ToyModel, ep_group) -> dict[str, torch.Tensor]:
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    if ep_group is not None:
        for name in EXPERT_PARAMETERS:
            shards = [torch.empty_like(params[name]) for _ in range(dist.get_world_size(ep_group))]
            dist.all_gather(shards, params[name].contiguous(), group=ep_group)
            params[name] = torch.cat(shards)
    return {name: p.cpu() for name, p in params.items()}


def _rank_main(rank: int, world_size: int, steps: int):
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    losses, _moved = train(steps, ep_group=dist.group.WORLD, device=device)
    if rank == 0:
        print("\n".join(f"step {i:3d}  loss {loss:.4f}" for i, loss in enumerate(losses)))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--processes", type=int, default=2,
                        help="without torchrun: processes to start (gloo on CPU, NCCL on GPUs)")
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
        _rank_main(dist.get_rank(), dist.get_world_size(), args.steps)
        dist.destroy_process_group()
    else:
        from mok.testing import run_distributed

        run_distributed(_rank_main, args.processes, args.steps)


if __name__ == "__main__":
    main()
