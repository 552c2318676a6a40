"""MoKConfig(precision="fp8") under expert parallelism: the ranks' layer against the FP8 recipe
(mok.reference.moe_reference_fp8_grads) run in one process on the union of their tokens and
experts; determinism; the EP module path; what it refuses.

On CPU the ranks are gloo processes whose symmetric buffers are shared-memory files, the
kernels (the pulls of packed e4m3 rows, the FP8 GEMMs scattering their rows) run under
Triton's interpreter.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import mok.functional as F
from mok import nn as mok_nn
from mok.errors import MoKDataError, MoKInputError
from mok.exchange import CrossNodeExchange, SymmetricExchange
from mok.ops import small_tiles
from mok.reference import moe_reference_fp8_grads
from mok.testing import GRAD_NAMES, MoEInputs, RoutingPattern, assert_close, distributed_test
from mok.testing.tolerance import Tolerance

from ..conftest import tiles_for_tests
from ..layer.test_fp8 import RECIPE, RECIPE_WGRAD
from .test_expert_parallel import (
    GPU_WORLD_SIZES,
    MAX_TOKENS,
    _assert_equal_grads,
    _graph_body,
    _rank_inputs,
    _recomputed_grads,
    _run,
    _uneven_tokens,
)

pytestmark = pytest.mark.timeout(900)

HIDDEN, INTER, NUM_LOCAL, TOPK = 64, 128, 2, 3
# With a SwiGLU limit, on a GPU: the tensor cores' sums move a pre-activation's e4m3 rounding
# across the limit now and then, which switches its gradient (measured on one H200: one element
# of d_w_routed_up 0.139 off, rel_rms 5.7e-3).
RECIPE_LIMIT = Tolerance(rel_rms=RECIPE.rel_rms, max_rel=0.3)


def _config(recompute: bool, fp8_wgrad: bool = False) -> F.MoKConfig:
    return F.MoKConfig(precision="fp8", recompute_gate_up=recompute, fwd_num_comm_sms=2,
                       bwd_num_comm_sms=3, minibatch_size=8, peer_timeout_s=300.0,
                       fp8_weight_gradients=fp8_wgrad)


def _counts(world_size: int, uneven: bool) -> list[int]:
    """Each rank's token count."""
    return [_uneven_tokens(r) if uneven else MAX_TOKENS for r in range(world_size)]


def _inputs(rank, world_size, *, uneven, shared, inter=INTER) -> MoEInputs:
    return _shared_alike(_rank_inputs(
        rank, world_size, tokens=_counts(world_size, uneven)[rank], hidden=HIDDEN,
        intermediate=inter, num_local=NUM_LOCAL, topk=TOPK, shared=inter if shared else 0,
        pattern=RoutingPattern.SKEWED, seed=7))


def _shared_alike(inputs: MoEInputs) -> MoEInputs:
    """The shared expert's weights made rank 0's on every rank (so that the union's one shared
    expert is every rank's)."""
    for w in inputs.shared_weights:
        if w is not None:
            dist.broadcast(w.view(torch.uint8), 0)
    return inputs


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's t (the same shape on each), bits exact whatever the dtype."""
    bits = t.contiguous().view(torch.uint8)
    out = [torch.empty_like(bits) for _ in range(dist.get_world_size())]
    dist.all_gather(out, bits)
    return [o.view(t.dtype) for o in out]


def _rows(t: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Every rank's rows of t [T_rank, ...] in rank order (counts: each rank's T)."""
    padded = t.new_zeros((max(counts), *t.shape[1:]))
    padded[:t.shape[0]] = t
    return torch.cat([g[:counts[r]] for r, g in enumerate(_gather(padded))])


def _union(inputs: MoEInputs, counts: list[int]) -> MoEInputs:
    """One process's inputs of the whole group: the ranks' tokens in rank order, their experts in
    rank order, the shared expert."""
    return MoEInputs(_rows(inputs.x, counts), _rows(inputs.topk_experts, counts),
                     _rows(inputs.router_weights, counts), *inputs.shared_weights,
                     *(torch.cat(_gather(w)) for w in inputs.routed_weights),
                     _rows(inputs.d_output, counts))


def _check_against_union(rank, inputs, y, grads, limit, counts, *, left_out=None,
                         fp8_wgrad=False):
    """left_out [T, k] bool: routes the schedule had no room for (their router weights count as
    0 and get no gradient); fp8_wgrad: the weight gradients on e4m3 operands."""
    union = _union(inputs, counts)
    if left_out is not None:
        union = dataclasses.replace(union, router_weights=torch.where(
            _rows(left_out, counts), 0.0, union.router_weights))
    y_ref, grads_ref = moe_reference_fp8_grads(union, swiglu_limit=limit,
                                               fp8_weight_gradients=fp8_wgrad)
    if fp8_wgrad and inputs.shared_weights[0] is not None:
        # Each rank's shared expert quantizes its own tokens' rows in blocks of 128: the
        # reference is the sum of each rank's recipe on its tokens.
        own = dataclasses.replace(union, x=inputs.x, topk_experts=inputs.topk_experts,
                                  router_weights=inputs.router_weights, d_output=inputs.d_output)
        shared = moe_reference_fp8_grads(own, swiglu_limit=limit, fp8_weight_gradients=True)[1]
        grads_ref = list(grads_ref)
        for i in range(5, 8):
            dist.all_reduce(shared[i])
            grads_ref[i] = shared[i]
    first = sum(counts[:rank])
    mine = slice(first, first + inputs.x.shape[0])
    experts = slice(rank * inputs.num_local_experts, (rank + 1) * inputs.num_local_experts)
    tolerance = RECIPE if limit is None else RECIPE_LIMIT
    assert_close(y, y_ref[mine], dtype=torch.bfloat16, name="y", tolerance=tolerance)
    for name, grad, expected in zip(GRAD_NAMES, grads, grads_ref, strict=True):
        assert (grad is None) == (expected is None), name
        if expected is None:
            continue
        if name in ("d_x", "d_router_weights"):
            expected = expected[mine]
            if name == "d_router_weights" and left_out is not None:
                assert bool((grad[left_out] == 0).all()), "a route left out gets no gradient"
                grad, expected = grad[~left_out], expected[~left_out]
        elif "routed" in name:
            expected = expected[experts]
        else:  # the shared expert's: each rank's holds its own tokens' part
            grad = grad.float()
            dist.all_reduce(grad)
        assert grad.shape == expected.shape, name
        wgrad = fp8_wgrad and name.startswith("d_w")
        assert_close(grad, expected, dtype=torch.bfloat16, name=name,
                     tolerance=RECIPE_WGRAD if wgrad else tolerance)


def _fp8_body(rank, world_size, *, shared, recompute, limit, uneven, ranks_per_node=None,
              fp8_wgrad=False, inter=INTER):
    inputs = _inputs(rank, world_size, uneven=uneven, shared=shared, inter=inter)
    config = _config(recompute, fp8_wgrad)
    workspace = F.create_workspace(config, dist.group.WORLD, device=inputs.x.device,
                                   num_local_tokens=MAX_TOKENS, hidden_size=HIDDEN, topk=TOPK,
                                   ranks_per_node=ranks_per_node)
    assert isinstance(workspace.exchange, CrossNodeExchange if ranks_per_node
                      else SymmetricExchange)
    tiles = tiles_for_tests(32)
    y, grads, schedule = _run(workspace, config, inputs, swiglu_limit=limit, tiles=tiles)
    F.check_errors(workspace)
    _check_against_union(rank, inputs, y, grads, limit, _counts(world_size, uneven),
                         fp8_wgrad=fp8_wgrad)
    # Bitwise deterministic through a second round of every phase, and from a recomputed
    # forward context (which pulls the rows again).
    y2, grads2, _ = _run(workspace, config, inputs, swiglu_limit=limit, tiles=tiles)
    assert torch.equal(y, y2)
    _assert_equal_grads(grads, grads2)
    _assert_equal_grads(grads, _recomputed_grads(workspace, config, schedule, inputs, limit))
    return inputs, y, grads


@distributed_test(world_sizes=(2,), gpu_world_sizes=GPU_WORLD_SIZES)
def test_ep_fp8_matches_the_recipe(rank, world_size):
    inputs, y, grads = _fp8_body(rank, world_size, shared=False, recompute=True, limit=None,
                                 uneven=False)
    # The module path (an autograd.Function over the group) gives the same bits.
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point())
              for t in (inputs.x, inputs.router_weights, *inputs.routed_weights)]
    x, router_weights, gate, up, down = leaves
    y_module = mok_nn.moe_experts(x, inputs.topk_experts, router_weights, None, None, None,
                                  gate, up, down, group=dist.group.WORLD, recompute_gate_up=True,
                                  precision="fp8")
    (y_module.float() * inputs.d_output.float()).sum().backward()
    assert torch.equal(y_module, y)
    for leaf, name in zip(leaves, ("d_x", "d_router_weights", "d_w_routed_gate",
                                   "d_w_routed_up", "d_w_routed_down"), strict=True):
        assert torch.equal(leaf.grad, grads[GRAD_NAMES.index(name)]), name


@distributed_test(world_sizes=(2, 4))
def test_ep_fp8_shared_kept_limit_uneven(rank, world_size):
    # A shared expert (run on the rank's own tokens while the rows move), kept pre-activations,
    # a SwiGLU limit, and ranks holding different token counts.
    _fp8_body(rank, world_size, shared=True, recompute=False, limit=2.5, uneven=True)


@distributed_test(world_sizes=(2,))
def test_ep_fp8_weight_gradients(rank, world_size):
    # MoKConfig(fp8_weight_gradients=True): the backward pulls d_output and x as packed e4m3
    # rows quantized on their tokens' ranks, then quantizes them along the rows like this
    # rank's own. Experts 96 wide: a partial scale block.
    _fp8_body(rank, world_size, shared=True, recompute=False, limit=None, uneven=True,
              fp8_wgrad=True, inter=96)


@distributed_test(world_sizes=(2,))
def test_ep_fp8_weight_gradients_recomputing(rank, world_size):
    # The recomputing backward's gate/up reads the pulled x's e4m3 rows.
    _fp8_body(rank, world_size, shared=False, recompute=True, limit=None, uneven=False,
              fp8_wgrad=True)


@distributed_test(world_sizes=(2,))
def test_ep_fp8_across_nodes(rank, world_size):
    # Two "nodes" of one rank: the tokens gathered between nodes in x's dtype, quantized on the
    # experts' node.
    _fp8_body(rank, world_size, shared=True, recompute=True, limit=None, uneven=True,
              ranks_per_node=1)


@distributed_test(world_sizes=(2,))
def test_ep_fp8_weight_gradients_across_nodes(rank, world_size):
    # The same with FP8 weight gradients: the experts' node quantizes the gathered tokens and
    # pulls them as packed e4m3 rows.
    _fp8_body(rank, world_size, shared=True, recompute=False, limit=None, uneven=True,
              ranks_per_node=1, fp8_wgrad=True)


def _refusals_body(rank, world_size):
    inputs = _rank_inputs(rank, world_size, tokens=8, hidden=HIDDEN, intermediate=INTER,
                          num_local=NUM_LOCAL, topk=TOPK)
    copies = F.MoKConfig(precision="fp8", fwd_copy_rows=True, peer_timeout_s=300.0)
    workspace = F.create_workspace(copies, dist.group.WORLD, device=inputs.x.device,
                                   num_local_tokens=8, hidden_size=HIDDEN, topk=TOPK)
    schedule = F.build_schedule(workspace, copies, inputs.topk_experts,
                                num_local_experts=NUM_LOCAL, tiles=tiles_for_tests(32))
    with pytest.raises(MoKInputError, match="fwd_copy_rows"):
        F.forward(copies, workspace, schedule, *inputs.layer_args)
    # Packed e4m3 rows of a hidden size under 16 do not fit in the published 16-bit rows.
    narrow = _rank_inputs(rank, world_size, tokens=8, hidden=8, intermediate=INTER,
                          num_local=NUM_LOCAL, topk=TOPK)
    config = _config(True)
    workspace = F.create_workspace(config, dist.group.WORLD, device=inputs.x.device,
                                   num_local_tokens=8, hidden_size=8, topk=TOPK)
    schedule = F.build_schedule(workspace, config, narrow.topk_experts,
                                num_local_experts=NUM_LOCAL, tiles=tiles_for_tests(32))
    with pytest.raises(MoKInputError, match="hidden size of at least 16"):
        F.forward(config, workspace, schedule, *narrow.layer_args)


@distributed_test(world_sizes=(2,))
def test_ep_fp8_refusals(rank, world_size):
    _refusals_body(rank, world_size)


@pytest.mark.gpu
@distributed_test(world_sizes=(2,), gpu_world_sizes=GPU_WORLD_SIZES)
def test_ep_fp8_no_host_sync_and_cuda_graph(rank, world_size):
    # The FP8 step under expert parallelism: no host sync, and a CUDA graph of it (the weights
    # quantized inside, the pulls and scatters captured) replays bitwise like eager.
    _graph_body(rank, world_size, config=F.MoKConfig(precision="fp8"))


def _empty_rank_body(rank, world_size):
    # fp16, top-1, and a rank without tokens this step: it still serves its experts.
    counts = [10, 0]
    inputs = _shared_alike(_rank_inputs(rank, world_size, tokens=counts[rank], hidden=HIDDEN,
                                        intermediate=INTER, num_local=NUM_LOCAL, topk=1,
                                        shared=INTER, seed=8))
    inputs = dataclasses.replace(inputs, **{name: getattr(inputs, name).half() for name in (
        "x", "d_output", "w_shared_gate", "w_shared_up", "w_shared_down", "w_routed_gate",
        "w_routed_up", "w_routed_down")})
    config = _config(True)
    workspace = F.create_workspace(config, dist.group.WORLD, device=inputs.x.device,
                                   num_local_tokens=10, hidden_size=HIDDEN, topk=1,
                                   dtype=torch.float16)
    y, grads, _ = _run(workspace, config, inputs, tiles=tiles_for_tests(32))
    F.check_errors(workspace)
    assert y.shape == (counts[rank], HIDDEN) and y.dtype == torch.float16
    _check_against_union(rank, inputs, y, grads, None, counts)
    assert grads[GRAD_NAMES.index("d_w_routed_gate")].abs().max() > 0 or rank == 0


@distributed_test(world_sizes=(2,))
def test_ep_fp8_rank_without_tokens_fp16_top1(rank, world_size):
    _empty_rank_body(rank, world_size)


def _overflow_body(rank, world_size):
    # A schedule too small for the routes it receives: the routes without a row are reported and
    # left out, as in 16-bit precision; what an earlier call left in the buffers the other ranks
    # deliver into is not read.
    config = dataclasses.replace(_config(True), schedule_capacity_multiplier=0.25)
    inputs = _shared_alike(_rank_inputs(rank, world_size, tokens=MAX_TOKENS, hidden=HIDDEN,
                                        intermediate=INTER, num_local=NUM_LOCAL, topk=TOPK,
                                        pattern=RoutingPattern.ONE_EXPERT, seed=9))
    workspace = F.create_workspace(config, dist.group.WORLD, device=inputs.x.device,
                                   num_local_tokens=MAX_TOKENS, hidden_size=HIDDEN, topk=TOPK)
    schedule = F.build_schedule(workspace, config, inputs.topk_experts,
                                num_local_experts=NUM_LOCAL, tiles=small_tiles(32))
    plan = schedule.exchange
    experts = plan.group_topk.long()
    mine = ((experts >= plan.first_local_expert)
            & (experts < plan.first_local_expert + NUM_LOCAL))
    dropped = (mine & (plan.group_routing.route_row < 0)).to(torch.int32)
    _check_overflow(workspace, bool(dropped.any()))  # reported by the experts' rank at once
    workspace.exchange.combine_buffer(inputs.x.dtype).fill_(1000.0)
    workspace.exchange.d_weights.fill_(1000.0)
    y, context = F.forward(config, workspace, schedule, *inputs.layer_args)
    dist.all_reduce(dropped, op=dist.ReduceOp.MAX)
    assert int(dropped.sum()) > 0, "the case must overflow"
    own = dropped[rank * MAX_TOKENS * TOPK:(rank + 1) * MAX_TOKENS * TOPK]
    own = own.view(MAX_TOKENS, TOPK).bool()
    _check_overflow(workspace, bool(own.any()))  # and to the tokens' ranks by the forward
    grads = F.backward(config, workspace, schedule, context, inputs.d_output, *inputs.layer_args)
    _check_against_union(rank, inputs, y, grads, None, [MAX_TOKENS] * world_size,
                         left_out=own)


def _check_overflow(workspace, expected: bool) -> None:
    if expected:
        with pytest.raises(MoKDataError, match="CAPACITY_OVERFLOW"):
            F.check_errors(workspace)
    else:
        F.check_errors(workspace)


@distributed_test(world_sizes=(2,))
def test_ep_fp8_capacity_overflow_leaves_the_routes_out(rank, world_size):
    _overflow_body(rank, world_size)
