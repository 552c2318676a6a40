"""Expert parallelism with the ring (MoKConfig.macrobatch_size): the symmetric buffer holds two
windows of tokens a rank, a call moves its tokens window by window, and every output and
gradient is bitwise the one of the path without the ring, on ranks passing several windows of
tokens, different counts, or none.

CPU: gloo processes, shared-memory files as the symmetric buffers, Triton's interpreter (as in
test_expert_parallel.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import mok.functional as F
from mok.exchange import CrossNodeExchange, SymmetricExchange
from mok.exchange.symmetric import RING_SLOTS
from mok.testing import (
    GRAD_NAMES,
    RoutingPattern,
    distributed_test,
    eager_and_captured,
)

from ..conftest import tiles_for_tests
from .test_expert_parallel import (
    SMALL_MINIBATCHES,
    _assert_equal_grads,
    _check_against_reference,
    _overflow_body,
    _rank_inputs,
    _run,
)

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 40  # the workspace's bound: five windows of 8
WINDOW = 8
UNBOUNDED = dataclasses.replace(SMALL_MINIBATCHES, macrobatch_size=None)
RING = dataclasses.replace(SMALL_MINIBATCHES, macrobatch_size=WINDOW)


def _tokens(rank: int, case: str) -> int:
    """Tokens of a rank: 'full' every rank MAX_TOKENS; 'uneven' 40, 21 (two windows and a
    part), 40, 21, ...; 'none' rank 1 none."""
    if case == "full":
        return MAX_TOKENS
    if case == "uneven":
        return MAX_TOKENS if rank % 2 == 0 else 21
    return 0 if rank == 1 else MAX_TOKENS


def _workspace(config, inputs, num_local_tokens=MAX_TOKENS):
    return F.create_workspace(config, dist.group.WORLD, device=inputs.x.device,
                              num_local_tokens=num_local_tokens,
                              hidden_size=inputs.x.shape[1], topk=inputs.topk_experts.shape[1])


def _bitwise_body(rank, world_size, *, case, recompute, precision="bf16", shared=16,
                  limit=0.8, fp8_wgrad=False):
    sizes = dict(hidden=64, intermediate=128) if precision == "fp8" else {}
    inputs = _rank_inputs(rank, world_size, tokens=_tokens(rank, case), shared=shared,
                          pattern=RoutingPattern.RANDOM, seed=7, **sizes)
    unbounded = dataclasses.replace(UNBOUNDED, recompute_gate_up=recompute, precision=precision,
                                    fp8_weight_gradients=fp8_wgrad)
    ring = dataclasses.replace(unbounded, macrobatch_size=WINDOW)
    plain, ringed = _workspace(unbounded, inputs), _workspace(ring, inputs)
    assert plain.exchange.window is None
    assert ringed.exchange.window == WINDOW and ringed.exchange.num_windows == 5
    tiles = tiles_for_tests(32) if precision == "fp8" else tiles_for_tests()
    y, grads, _ = _run(plain, unbounded, inputs, swiglu_limit=limit, tiles=tiles)
    y_ring, grads_ring, _ = _run(ringed, ring, inputs, swiglu_limit=limit, tiles=tiles)
    F.check_errors(plain)
    F.check_errors(ringed)
    assert torch.equal(y, y_ring)
    _assert_equal_grads(grads, grads_ring)
    if precision == "bf16":
        _check_against_reference(inputs, y_ring, grads_ring, limit)
    # A second call: the rounds keep counting, the slots are reused.
    y_again, grads_again, _ = _run(ringed, ring, inputs, swiglu_limit=limit, tiles=tiles)
    assert torch.equal(y_ring, y_again)
    _assert_equal_grads(grads_ring, grads_again)


@distributed_test(world_sizes=(2,), gpu_world_sizes=(2, 4, 8))
def test_ring_bitwise_the_unbounded_path(rank, world_size):
    # Five windows of 8 tokens a rank, every rank full; the recomputing backward.
    _bitwise_body(rank, world_size, case="full", recompute=True)


@distributed_test(world_sizes=(2,))
def test_ring_ranks_with_different_token_counts(rank, world_size):
    # 40 and 21 tokens: the second rank's last three windows are empty on its side; the kept
    # pre-activations.
    _bitwise_body(rank, world_size, case="uneven", recompute=False)


@distributed_test(world_sizes=(2, 4))
def test_ring_rank_without_tokens(rank, world_size):
    _bitwise_body(rank, world_size, case="none", recompute=False, shared=0, limit=None)


@distributed_test(world_sizes=(2,))
def test_ring_fp8_bitwise_the_unbounded_path(rank, world_size):
    # FP8: the forward's rows travel as packed e4m3 rows through the ring's slots.
    _bitwise_body(rank, world_size, case="uneven", recompute=False, precision="fp8",
                  shared=0)


@distributed_test(world_sizes=(2,))
def test_ring_fp8_weight_gradients_bitwise_the_unbounded_path(rank, world_size):
    # FP8 weight gradients: the backward's d_output and x rows travel as packed e4m3 rows
    # through the ring's slots too; the recomputing backward reads the pulled x's codes.
    _bitwise_body(rank, world_size, case="uneven", recompute=True, precision="fp8",
                  shared=0, fp8_wgrad=True)


def _across_nodes_body(rank, world_size):
    """Two nodes of two ranks: the ring inside each node, around the collectives between
    them."""
    inputs = _rank_inputs(rank, world_size, tokens=_tokens(rank, "uneven"), shared=16, seed=8)
    plain = F.create_workspace(UNBOUNDED, dist.group.WORLD, device=inputs.x.device,
                               num_local_tokens=MAX_TOKENS, hidden_size=inputs.x.shape[1],
                               topk=inputs.topk_experts.shape[1], ranks_per_node=2)
    ringed = F.create_workspace(RING, dist.group.WORLD, device=inputs.x.device,
                                num_local_tokens=MAX_TOKENS, hidden_size=inputs.x.shape[1],
                                topk=inputs.topk_experts.shape[1], ranks_per_node=2)
    assert isinstance(ringed.exchange, CrossNodeExchange)
    assert ringed.exchange.inner.window == 2 * WINDOW  # the node's tokens of two nodes
    tiles = tiles_for_tests()
    y, grads, _ = _run(plain, UNBOUNDED, inputs, swiglu_limit=0.8, tiles=tiles)
    y_ring, grads_ring, _ = _run(ringed, RING, inputs, swiglu_limit=0.8, tiles=tiles)
    F.check_errors(ringed)
    assert torch.equal(y, y_ring)
    _assert_equal_grads(grads, grads_ring)
    _check_against_reference(inputs, y_ring, grads_ring, 0.8)


@distributed_test(world_sizes=(4,))
def test_ring_across_nodes(rank, world_size):
    _across_nodes_body(rank, world_size)


@distributed_test(world_sizes=(2,))
def test_ring_capacity_overflow_leaves_the_routes_out(rank, world_size):
    # Routes the schedule has no row for are delivered as zeros in their window's round and
    # reported on their tokens' ranks (three windows of 8 of the 24 tokens).
    _overflow_body(rank, world_size, RoutingPattern.ONE_EXPERT, 0.25, macrobatch=WINDOW)
    _overflow_body(rank, world_size, RoutingPattern.SKEWED, 0.5, macrobatch=WINDOW)


def _footprint_body(rank, world_size):
    """The ring's symmetric buffer holds RING_SLOTS windows of rows whatever num_local_tokens
    is: only the ids and router-weight gradients (8 bytes a route) grow with it. A ring as large
    as the tokens is not made."""
    inputs = _rank_inputs(rank, world_size, tokens=4, seed=9)
    small = _workspace(RING, inputs, num_local_tokens=MAX_TOKENS).exchange
    large = _workspace(RING, inputs, num_local_tokens=10 * MAX_TOKENS).exchange
    unbounded = _workspace(UNBOUNDED, inputs, num_local_tokens=10 * MAX_TOKENS).exchange
    assert isinstance(small, SymmetricExchange)
    assert small.ring_tokens == large.ring_tokens == RING_SLOTS * WINDOW
    topk = inputs.topk_experts.shape[1]
    routes_bytes = 8 * topk * 9 * MAX_TOKENS
    assert large.buffer.nbytes - small.buffer.nbytes <= routes_bytes + 1024
    assert large.buffer.nbytes < unbounded.buffer.nbytes / 5
    whole = _workspace(dataclasses.replace(RING, macrobatch_size=24), inputs)
    assert whole.exchange.window is None  # two windows of 24 hold all 40 tokens


@distributed_test(world_sizes=(2,))
def test_ring_symmetric_footprint(rank, world_size):
    _footprint_body(rank, world_size)


def _refuses_copies_body(rank, world_size):
    inputs = _rank_inputs(rank, world_size, tokens=MAX_TOKENS, seed=10)
    workspace = _workspace(RING, inputs)
    copying = dataclasses.replace(RING, fwd_copy_rows=True)
    with pytest.raises(F.MoKInputError, match="macrobatch_size"):
        _run(workspace, copying, inputs, tiles=tiles_for_tests())


@distributed_test(world_sizes=(2,))
def test_ring_refuses_copied_rows(rank, world_size):
    _refuses_copies_body(rank, world_size)


def _ring_graph_body(rank, world_size):
    """GPU: no host sync in a step through the ring, and a CUDA graph of it replays bitwise
    like eager (the rounds are numbered on the device)."""
    config = F.MoKConfig(macrobatch_size=256)
    inputs = _rank_inputs(rank, world_size, tokens=1024, hidden=256, intermediate=128,
                          num_local=4, topk=4, shared=128, seed=4)
    workspace = F.create_workspace(config, dist.group.WORLD, device=inputs.x.device,
                                   num_local_tokens=1024, hidden_size=256, topk=4)
    assert workspace.exchange.num_windows == 4

    def step():
        y, grads, _ = _run(workspace, config, inputs, swiglu_limit=7.0)
        return (y, *grads)

    eager, graph, captured = eager_and_captured(step, before_capture=dist.barrier)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(("y", *GRAD_NAMES), eager, captured, strict=True):
        assert (a is None and b is None) or torch.equal(a, b), name
    F.check_errors(workspace)
    dist.barrier()


@pytest.mark.gpu
@distributed_test(world_sizes=(2,), gpu_world_sizes=(2, 4, 8))
def test_ring_no_host_sync_and_cuda_graph(rank, world_size):
    _ring_graph_body(rank, world_size)
