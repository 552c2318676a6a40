"""The reference itself: its forward against the formula written per token, its gradients
against finite differences, and its expert-parallel form against the single-process one."""

import dataclasses

import pytest
import torch

from mok.testing import (
    RoutingPattern,
    assert_close,
    distributed_test,
    make_inputs,
    moe_reference,
    moe_reference_grads,
    swiglu,
)


def per_token_formula(inputs, limit):
    """y[t] = shared(x[t]) + sum_j w[t, j] * expert_e(x[t]), one token at a time, in fp64."""
    d = torch.float64
    x = inputs.x.to(d)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(inputs.topk_experts.shape[1]):
            e = int(inputs.topk_experts[t, j])
            g = inputs.w_routed_gate[e].to(d) @ x[t]
            u = inputs.w_routed_up[e].to(d) @ x[t]
            out[t] += inputs.router_weights[t, j].to(d) * (
                inputs.w_routed_down[e].to(d) @ swiglu(g, u, limit))
        if inputs.w_shared_gate is not None:
            g = inputs.w_shared_gate.to(d) @ x[t]
            u = inputs.w_shared_up.to(d) @ x[t]
            out[t] += inputs.w_shared_down.to(d) @ swiglu(g, u, limit)
    return out


@pytest.mark.parametrize("limit", [None, 0.75])
@pytest.mark.parametrize("pattern", [RoutingPattern.RANDOM, RoutingPattern.DUPLICATES])
def test_reference_matches_per_token_formula(limit, pattern):
    inputs = make_inputs(13, 16, 24, 5, 3, shared_intermediate_size=8, seed=3, routing=pattern)
    y = moe_reference(inputs.x, inputs.topk_experts, inputs.router_weights,
                      *inputs.shared_weights, *inputs.routed_weights, swiglu_limit=limit,
                      compute_dtype=torch.float64)
    assert_close(y, per_token_formula(inputs, limit), dtype=torch.float64, name="y")


@pytest.mark.parametrize("limit", [None, 0.75])
def test_reference_gradients_match_finite_differences(limit):
    inputs = make_inputs(6, 8, 8, 3, 2, shared_intermediate_size=8, dtype=torch.float64, seed=4)
    leaves = [t.to(torch.float64).clone().requires_grad_(True) for t in
              (inputs.x, inputs.router_weights, *inputs.routed_weights, *inputs.shared_weights)]

    def fn(x, rw, wg, wu, wd, sg, su, sd):
        return moe_reference(x, inputs.topk_experts, rw, sg, su, sd, wg, wu, wd,
                             swiglu_limit=limit, compute_dtype=torch.float64)

    # Gradients at the clamp's kinks are one-sided; random data never sits exactly on them.
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6)


def _ep_reference_body(rank, world_size):
    num_local = 3
    full = make_inputs(10, 16, 8, num_local * world_size, 2, shared_intermediate_size=8,
                       dtype=torch.float64, seed=11, routing=RoutingPattern.SKEWED)
    y_full, grads_full = moe_reference_grads(full, swiglu_limit=1.5,
                                             compute_dtype=torch.float64)
    # This rank's share: a slice of the tokens (rank 0 takes 6, rank 1 the other 4, ...) and
    # experts [rank * num_local, (rank + 1) * num_local).
    bounds = [0, 6, 10] if world_size == 2 else [0, 3, 6, 8, 10]
    tokens = slice(bounds[rank], bounds[rank + 1])
    experts = slice(rank * num_local, (rank + 1) * num_local)
    local = dataclasses.replace(
        full,
        **{name: getattr(full, name)[tokens]
           for name in ("x", "topk_experts", "router_weights", "d_output")},
        **{name: getattr(full, name)[experts]
           for name in ("w_routed_gate", "w_routed_up", "w_routed_down")},
    )
    import torch.distributed as dist

    y, grads = moe_reference_grads(local, swiglu_limit=1.5, group=dist.group.WORLD,
                                   compute_dtype=torch.float64)
    tol = dict(dtype=torch.float64)
    assert_close(y, y_full[tokens], name="y", **tol)
    assert_close(grads[0], grads_full[0][tokens], name="d_x", **tol)
    assert_close(grads[1], grads_full[1][tokens], name="d_router_weights", **tol)
    for i, name in ((2, "d_w_routed_gate"), (3, "d_w_routed_up"), (4, "d_w_routed_down")):
        assert_close(grads[i], grads_full[i][experts], name=name, **tol)
    # Each rank sees only its tokens' share of the shared-expert gradient; the sum is the whole.
    for i, name in ((5, "d_w_shared_gate"), (6, "d_w_shared_up"), (7, "d_w_shared_down")):
        total = grads[i].clone()
        dist.all_reduce(total)
        assert_close(total, grads_full[i], name=name, **tol)


@distributed_test(world_sizes=(2, 4), backend="gloo")
def test_reference_expert_parallel_matches_single_process(rank, world_size):
    _ep_reference_body(rank, world_size)


def test_distributed_test_picks_its_world_sizes_by_backend(monkeypatch):
    # gpu_world_sizes apply where the cases run on a GPU (NCCL, one GPU a rank; or every rank on
    # one GPU), world_sizes elsewhere.
    from mok.testing import distributed

    def sizes_of(test):
        (mark,) = [m for m in test.pytestmark if m.name == "parametrize"]
        return list(mark.args[1])

    def body(rank, world_size):
        return None

    for chosen, expected in (("gloo", [2]), ("nccl", [2, 4, 8])):
        monkeypatch.setattr(distributed, "default_backend", lambda chosen=chosen: chosen)
        test = distributed.distributed_test(world_sizes=(2,), gpu_world_sizes=(2, 4, 8))(body)
        assert sizes_of(test) == expected, chosen
    pinned = distributed.distributed_test(world_sizes=(2,), backend="gloo",
                                          gpu_world_sizes=(2, 4, 8))(body)
    assert sizes_of(pinned) == [2]  # gloo chosen explicitly: CPU processes
    plain = distributed.distributed_test(world_sizes=(2, 4))(body)
    assert sizes_of(plain) == [2, 4]  # no gpu_world_sizes: the same everywhere
    # Every rank on one GPU (MOK_RANKS_SHARE_GPU, gloo between them): the GPU cases too, unless
    # gloo is pinned; without a GPU that flag changes nothing.
    monkeypatch.setattr(distributed, "default_backend", lambda: "gloo")
    monkeypatch.setattr(distributed, "RANKS_SHARE_GPU", True)
    for cuda, expected in ((True, [2, 4, 8]), (False, [2])):
        monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda cuda=cuda: cuda)
        shared = distributed.distributed_test(world_sizes=(2,), gpu_world_sizes=(2, 4, 8))(body)
        assert sizes_of(shared) == expected, cuda
        pinned = distributed.distributed_test(world_sizes=(2,), backend="gloo",
                                              gpu_world_sizes=(2, 4, 8))(body)
        assert sizes_of(pinned) == [2], cuda


def _many_tensors(rank, world_size):
    return [torch.full((3,), float(rank + i)) for i in range(40)]


def test_run_distributed_returns_results_of_many_tensors():
    # Each rank's result travels serialized: tensors passed through the queue's shared memory
    # were gone once the rank exited (40 of them timed out where 5 worked).
    from mok.testing import run_distributed

    results = run_distributed(_many_tensors, 2, backend="gloo", timeout_s=120)
    for rank, tensors in enumerate(results):
        assert len(tensors) == 40 and float(tensors[5][0]) == rank + 5
