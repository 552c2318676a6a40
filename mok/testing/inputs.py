"""Seeded input generators for the MoE layer (never zeros)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import torch


class RoutingPattern(enum.Enum):
    """How `make_inputs` draws topk_experts."""

    RANDOM = "random"            # k distinct experts per token, uniformly
    DUPLICATES = "duplicates"    # k draws with replacement: a token may list an expert twice
    ONE_EXPERT = "one_expert"    # every route goes to expert 0
    SKEWED = "skewed"            # distinct experts, drawn with weights ~ 1 / (e + 1)
    EMPTY_EXPERT = "empty_expert"  # like RANDOM but the last expert gets no token


@dataclass
class MoEInputs:
    """One set of layer inputs (MoK's argument order) plus an output gradient.

    x [T, H]; topk_experts [T, k] int64 global ids; router_weights [T, k] fp32 (positive, rows
    summing to 1); w_shared_* [I_s, H], [I_s, H], [H, I_s] or None; w_routed_* [E_local, I, H],
    [E_local, I, H], [E_local, H, I]; d_output [T, H].
    """

    x: torch.Tensor
    topk_experts: torch.Tensor
    router_weights: torch.Tensor
    w_shared_gate: torch.Tensor | None
    w_shared_up: torch.Tensor | None
    w_shared_down: torch.Tensor | None
    w_routed_gate: torch.Tensor
    w_routed_up: torch.Tensor
    w_routed_down: torch.Tensor
    d_output: torch.Tensor

    @property
    def shared_weights(self) -> tuple[torch.Tensor | None, ...]:
        return (self.w_shared_gate, self.w_shared_up, self.w_shared_down)

    @property
    def routed_weights(self) -> tuple[torch.Tensor, ...]:
        return (self.w_routed_gate, self.w_routed_up, self.w_routed_down)

    @property
    def layer_args(self) -> tuple:
        """(x, router_weights, shared weights..., routed weights...) as functional.forward takes."""
        return (self.x, self.router_weights, *self.shared_weights, *self.routed_weights)

    @property
    def num_local_experts(self) -> int:
        return self.w_routed_gate.shape[0]


def make_topk(num_tokens: int, num_experts: int, topk: int, pattern: RoutingPattern,
              generator: torch.Generator) -> torch.Tensor:
    pattern = RoutingPattern(pattern)
    if pattern is RoutingPattern.ONE_EXPERT:
        return torch.zeros(num_tokens, topk, dtype=torch.int64)
    if pattern is RoutingPattern.DUPLICATES:
        return torch.randint(0, num_experts, (num_tokens, topk), generator=generator)
    weights = torch.ones(num_experts)
    if pattern is RoutingPattern.SKEWED:
        weights = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float32)
    if pattern is RoutingPattern.EMPTY_EXPERT:
        if num_experts - 1 < topk:
            raise ValueError("EMPTY_EXPERT needs more than topk experts")
        weights[-1] = 0.0
    if num_tokens == 0:
        return torch.zeros(0, topk, dtype=torch.int64)
    return torch.multinomial(weights.expand(num_tokens, -1), topk, replacement=False,
                             generator=generator)


def make_inputs(
    num_tokens: int,
    hidden_size: int,
    intermediate_size: int,
    num_experts: int,
    topk: int,
    *,
    shared_intermediate_size: int = 0,
    num_local_experts: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
    routing: RoutingPattern | str = RoutingPattern.RANDOM,
) -> MoEInputs:
    """Random inputs of unit-scale activations: weights ~ N(0, 1/fan_in), x and d_output ~ N(0, 1).

    Drawn on the CPU from `seed`, then moved, so a seed gives the same values on every device.
    num_local_experts (default num_experts) sizes the routed weights for expert parallelism.
    """
    gen = torch.Generator().manual_seed(seed)
    num_local = num_experts if num_local_experts is None else num_local_experts

    def normal(*shape, fan_in=1):
        return (torch.randn(*shape, generator=gen) / fan_in ** 0.5).to(dtype).to(device)

    x = normal(num_tokens, hidden_size)
    topk_experts = make_topk(num_tokens, num_experts, topk, RoutingPattern(routing), gen)
    logits = torch.randn(num_tokens, topk, generator=gen)
    router_weights = torch.softmax(logits, dim=-1).to(device)
    shared = (None, None, None)
    if shared_intermediate_size:
        shared = (normal(shared_intermediate_size, hidden_size, fan_in=hidden_size),
                  normal(shared_intermediate_size, hidden_size, fan_in=hidden_size),
                  normal(hidden_size, shared_intermediate_size, fan_in=shared_intermediate_size))
    routed = (normal(num_local, intermediate_size, hidden_size, fan_in=hidden_size),
              normal(num_local, intermediate_size, hidden_size, fan_in=hidden_size),
              normal(num_local, hidden_size, intermediate_size, fan_in=intermediate_size))
    d_output = normal(num_tokens, hidden_size)
    return MoEInputs(x, topk_experts.to(device), router_weights, *shared, *routed, d_output)


def pad_expert_widths(inputs: MoEInputs, multiple: int = 128) -> MoEInputs:
    """inputs with each expert's I (and I_s) padded with zero weights to a multiple of
    `multiple`: gate and up get zero rows, down zero columns. The layer's outputs are the
    same; its weight gradients are the padded ones'."""
    def pad(w: torch.Tensor | None, dim: int) -> torch.Tensor | None:
        if w is None:
            return None
        shape = list(w.shape)
        shape[dim] = -shape[dim] % multiple
        return torch.cat([w, w.new_zeros(shape)], dim=dim)

    return replace(inputs, **{name: pad(getattr(inputs, name), -1 if name.endswith("down")
                                        else -2)
                              for group in ("shared", "routed")
                              for name in (f"w_{group}_gate", f"w_{group}_up",
                                           f"w_{group}_down")})


def make_shape_inputs(shape, *, device: torch.device | str = "cuda", seed: int = 0,
                      routing: RoutingPattern | str = RoutingPattern.RANDOM) -> MoEInputs:
    """`make_inputs` at a benchmark shape (mok.testing.shapes.MoEShape), bf16."""
    return make_inputs(shape.num_tokens, shape.hidden_size, shape.intermediate_size,
                       shape.num_experts, shape.topk,
                       shared_intermediate_size=shape.shared_intermediate_size, device=device,
                       seed=seed, routing=routing)
