"""Expert parallelism: the symmetric-buffer protocol on several processes against the reference.

On CPU the ranks are gloo processes whose symmetric buffers are shared-memory files mapped by
every process, and the kernels (pulls, flags, GEMMs with waits and scattered outputs) run under
Triton's interpreter: the same kernels and flag logic as on GPUs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import pytest
import torch
import torch.distributed as dist

import mok.functional as F
from mok import ops
from mok import plan as mok_plan
from mok.errors import NUM_ERROR_FLAGS, MoKDataError, MoKInputError, MoKTimeoutError
from mok.exchange import CrossNodeExchange
from mok.ops import small_tiles
from mok.testing import (
    GRAD_NAMES,
    RoutingPattern,
    assert_close,
    distributed_test,
    eager_and_captured,
    make_inputs,
    moe_reference_grads,
    programs_last_first,
    rank_device,
)

from ..conftest import DEVICE, tiles_for_tests, with_row_tiles

REF_DTYPE = torch.float32 if DEVICE.type == "cuda" else torch.float64
pytestmark = pytest.mark.timeout(900)


def _device(rank: int) -> torch.device:
    return rank_device(rank)


def _rank_inputs(rank, world_size, *, tokens=24, hidden=32, intermediate=16, num_local=2, topk=3,
                 shared=0, pattern=RoutingPattern.RANDOM, seed=0):
    """This rank's tokens and its experts [rank * num_local, (rank + 1) * num_local)."""
    return make_inputs(tokens, hidden, intermediate, num_local * world_size, topk,
                       shared_intermediate_size=shared, num_local_experts=num_local,
                       device=_device(rank), seed=seed * 100 + rank, routing=pattern)


def _recomputed_grads(workspace, config, schedule, inputs, swiglu_limit):
    """Backward from a recomputed forward context (activation checkpointing)."""
    context = F.recompute_forward_context(
        config, workspace, schedule, inputs.x, inputs.w_shared_gate, inputs.w_shared_up,
        inputs.w_routed_gate, inputs.w_routed_up, swiglu_limit=swiglu_limit,
        router_weights=inputs.router_weights)
    return F.backward(config, workspace, schedule, context, inputs.d_output, *inputs.layer_args,
                      swiglu_limit=swiglu_limit)


def _assert_equal_grads(grads, others):
    for name, a, b in zip(GRAD_NAMES, grads, others, strict=True):
        assert (a is None and b is None) or torch.equal(a, b), name


def _run(workspace, config, inputs, *, swiglu_limit=None, tiles=None):
    schedule = F.build_schedule(workspace, config, inputs.topk_experts,
                                num_local_experts=inputs.num_local_experts, tiles=tiles)
    y, context = F.forward(config, workspace, schedule, *inputs.layer_args,
                           swiglu_limit=swiglu_limit)
    grads = F.backward(config, workspace, schedule, context, inputs.d_output, *inputs.layer_args,
                       swiglu_limit=swiglu_limit)
    return y, grads, schedule


def _check_against_reference(inputs, y, grads, swiglu_limit):
    y_ref, grads_ref = moe_reference_grads(inputs, swiglu_limit=swiglu_limit,
                                           group=dist.group.WORLD, compute_dtype=REF_DTYPE)
    assert_close(y, y_ref, dtype=inputs.x.dtype, name="y")
    for name, grad, grad_ref in zip(GRAD_NAMES, grads, grads_ref, strict=True):
        if grad_ref is None:
            assert grad is None, name
            continue
        assert grad.dtype == (torch.float32 if name == "d_router_weights" else inputs.x.dtype)
        assert_close(grad, grad_ref, dtype=inputs.x.dtype, name=name)


MAX_TOKENS = 24


def _uneven_tokens(rank):
    """Tokens of a rank when the ranks hold different counts: 24 - 5 (r % 4) (24, 19, 14, 9,
    24, ...; the workspace is sized for 24)."""
    return MAX_TOKENS - 5 * (rank % 4)


def _matches_reference_body(rank, world_size, *, shared, limit, pattern, config, uneven=False,
                            tiles=None):
    """uneven: ranks hold different token counts (_uneven_tokens)."""
    tokens = _uneven_tokens(rank) if uneven else MAX_TOKENS
    inputs = _rank_inputs(rank, world_size, tokens=tokens, shared=shared, pattern=pattern,
                          seed=1)
    workspace = F.create_workspace(config, dist.group.WORLD, device=inputs.x.device,
                                   num_local_tokens=MAX_TOKENS,
                                   hidden_size=inputs.x.shape[1], topk=inputs.topk_experts.shape[1])
    tiles = tiles or tiles_for_tests()
    y, grads, schedule = _run(workspace, config, inputs, swiglu_limit=limit, tiles=tiles)
    F.check_errors(workspace)
    _check_against_reference(inputs, y, grads, limit)
    # Per-expert counts of the local experts: the routes of the whole group that chose them.
    padded = torch.full((MAX_TOKENS, inputs.topk_experts.shape[1]), -1,
                        dtype=inputs.topk_experts.dtype, device=inputs.x.device)
    padded[:tokens] = inputs.topk_experts
    everyone = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(everyone, padded)
    group_ids = torch.cat(everyone).reshape(-1)
    group_ids = group_ids[group_ids >= 0]
    first = rank * inputs.num_local_experts
    expected = torch.bincount(group_ids, minlength=world_size * inputs.num_local_experts)
    assert torch.equal(schedule.expert_counts.cpu().long(),
                       expected[first:first + inputs.num_local_experts].cpu())
    # Bitwise deterministic, also through a second round of every phase (flags keep counting),
    # and from a recomputed forward context.
    y2, grads2, _ = _run(workspace, config, inputs, swiglu_limit=limit, tiles=tiles)
    assert torch.equal(y, y2)
    _assert_equal_grads(grads, grads2)
    _assert_equal_grads(grads, _recomputed_grads(workspace, config, schedule, inputs, limit))


def _few_tokens_body(rank, world_size):
    """A rank passing far fewer tokens than the workspace's bound still has room for the rows
    the others send its experts: its schedule is sized from the bound, not its own count."""
    inputs = _rank_inputs(rank, world_size, tokens=2 if rank == 1 else MAX_TOKENS, seed=2)
    if rank == 0:  # every route to rank 1's experts
        ids = inputs.topk_experts
        ids.copy_(inputs.num_local_experts + torch.arange(ids.numel(), device=ids.device)
                  .reshape(ids.shape) % inputs.num_local_experts)
    config = F.MoKConfig()
    workspace = F.create_workspace(config, dist.group.WORLD, device=inputs.x.device,
                                   num_local_tokens=MAX_TOKENS, hidden_size=inputs.x.shape[1],
                                   topk=inputs.topk_experts.shape[1])
    y, grads, schedule = _run(workspace, config, inputs, tiles=tiles_for_tests())
    F.check_errors(workspace)
    if rank == 1:  # 72 + its own routes, where 2 x its own 6 routes were the room
        assert int(schedule.expert_counts.sum()) >= MAX_TOKENS * 3
    _check_against_reference(inputs, y, grads, None)


@distributed_test(world_sizes=(2,))
def test_ep_rank_with_few_tokens_has_room_for_its_experts_rows(rank, world_size):
    _few_tokens_body(rank, world_size)


# The cases that also run with 4 and 8 ranks on GPUs (one a rank, skipped where fewer are
# present; or every rank on one GPU with MOK_RANKS_SHARE_GPU): 2 ranks on CPU processes, where
# 4 and 8 would take too long under the interpreter.
GPU_WORLD_SIZES = (2, 4, 8)

# The recomputing backward, which these tests were written for; the default (kept
# pre-activations) is the config of the tests that set recompute_gate_up=False.
SMALL_MINIBATCHES = F.MoKConfig(fwd_num_comm_sms=2, bwd_num_comm_sms=3, minibatch_size=8,
                                macrobatch_size=64, peer_timeout_s=300.0,
                                recompute_gate_up=True)


@distributed_test(world_sizes=(2,), gpu_world_sizes=GPU_WORLD_SIZES)
def test_ep_matches_reference(rank, world_size):
    _matches_reference_body(rank, world_size, shared=0, limit=None,
                            pattern=RoutingPattern.RANDOM, config=SMALL_MINIBATCHES)


def _last_first_body(rank, world_size):
    """The programs of every launch started from the last program id to the first
    (mok.testing.programs_last_first): a GEMM's tiles start before the programs that pull their
    rows would by program id. The pulling roles go by a ticket taken at each program's start, so
    the launches still end with every row landed (with roles by program id the tiles would spin
    until their timeout: "waited on this rank's own pull"). Both backwards: the recomputing one
    pulls d_output and x in its dSwiGLU, the kept one x in d_x's launch."""
    for config in (SMALL_MINIBATCHES, dataclasses.replace(SMALL_MINIBATCHES,
                                                          recompute_gate_up=False)):
        with programs_last_first():
            _matches_reference_body(rank, world_size, shared=0, limit=None,
                                    pattern=RoutingPattern.RANDOM, config=config)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="orders the programs of Triton's interpreter")
@distributed_test(world_sizes=(2,))
def test_ep_pulls_land_whatever_order_the_programs_start_in(rank, world_size):
    _last_first_body(rank, world_size)


def _layouts_body(rank, world_size):
    """Every tensor argument in another memory layout (NaN outside the views): the reference's
    answer, bitwise the one of contiguous arguments."""
    from mok.testing.layouts import Layout, relayout

    inputs = _rank_inputs(rank, world_size, shared=16, seed=3)
    layouts = dict(x=Layout.PADDED_ROWS, topk_experts=Layout.TRANSPOSED,
                   router_weights=Layout.EVERY_OTHER, d_output=Layout.OFFSET,
                   w_routed_gate=Layout.TRANSPOSED, w_routed_up=Layout.ROW_SLICE,
                   w_routed_down=Layout.EVERY_OTHER, w_shared_gate=Layout.OFFSET,
                   w_shared_up=Layout.PADDED_ROWS, w_shared_down=Layout.TRANSPOSED)
    laid_out = dataclasses.replace(inputs, **{
        name: relayout(getattr(inputs, name), layout, second_half=name.endswith("_up"))
        for name, layout in layouts.items()})
    config = SMALL_MINIBATCHES
    workspace = F.create_workspace(config, dist.group.WORLD, device=inputs.x.device,
                                   num_local_tokens=MAX_TOKENS, hidden_size=inputs.x.shape[1],
                                   topk=inputs.topk_experts.shape[1])
    y, grads, _ = _run(workspace, config, laid_out, tiles=tiles_for_tests())
    F.check_errors(workspace)
    _check_against_reference(inputs, y, grads, None)
    y_plain, grads_plain, _ = _run(workspace, config, inputs, tiles=tiles_for_tests())
    if DEVICE.type == "cpu":  # on a GPU a layout may pick another kernel (Gluon's need TMA)
        assert torch.equal(y, y_plain)
        _assert_equal_grads(grads, grads_plain)


@distributed_test(world_sizes=(2,))
def test_ep_any_layout(rank, world_size):
    _layouts_body(rank, world_size)


@distributed_test(world_sizes=(2, 4))
def test_ep_ranks_with_different_token_counts(rank, world_size):
    _matches_reference_body(rank, world_size, shared=16, limit=None,
                            pattern=RoutingPattern.RANDOM, config=SMALL_MINIBATCHES, uneven=True)


@distributed_test(world_sizes=(2, 4, 8))
def test_ep_shared_expert_limit_skewed(rank, world_size):
    # A capacity of world_size * T * k routes: dropless however skewed.
    config = dataclasses.replace(SMALL_MINIBATCHES, schedule_capacity_multiplier=world_size)
    _matches_reference_body(rank, world_size, shared=16, limit=0.8,
                            pattern=RoutingPattern.SKEWED, config=config)


@distributed_test(world_sizes=(2,), gpu_world_sizes=GPU_WORLD_SIZES)
def test_ep_kept_gate_up(rank, world_size):
    # MoKConfig(recompute_gate_up=False): the backward reads the pre-activations of the pulled
    # rows instead of recomputing them (the x rows are still pulled, for the weight gradients).
    config = dataclasses.replace(SMALL_MINIBATCHES, recompute_gate_up=False)
    _matches_reference_body(rank, world_size, shared=16, limit=0.8,
                            pattern=RoutingPattern.RANDOM, config=config)


def _copy_rows_body(rank, world_size, *, kept):
    """MoKConfig.fwd_copy_rows and bwd_copy_rows: the rows come by copies of every rank's
    published x and router weights, d_output and x (on a side stream on a GPU), the first GEMMs'
    tiles waiting on a flag per rank, their row blocks local first; ranks with different token
    counts (the rows past a rank's count are copied, never read). Bitwise the layer whose GEMMs
    pull their rows, and against the reference."""
    inputs = _rank_inputs(rank, world_size, tokens=_uneven_tokens(rank), shared=16,
                          pattern=RoutingPattern.RANDOM, seed=6)
    workspace = F.create_workspace(SMALL_MINIBATCHES, dist.group.WORLD, device=inputs.x.device,
                                   num_local_tokens=MAX_TOKENS, hidden_size=inputs.x.shape[1],
                                   topk=inputs.topk_experts.shape[1])
    tiles = tiles_for_tests()
    pulling = dataclasses.replace(SMALL_MINIBATCHES, recompute_gate_up=not kept)
    copying = dataclasses.replace(pulling, fwd_copy_rows=True, bwd_copy_rows=True)
    y, grads, _ = _run(workspace, pulling, inputs, swiglu_limit=0.8, tiles=tiles)
    y_copied, grads_copied, schedule = _run(workspace, copying, inputs, swiglu_limit=0.8,
                                            tiles=tiles)
    F.check_errors(workspace)
    assert torch.equal(y, y_copied)
    _assert_equal_grads(grads, grads_copied)
    _check_against_reference(inputs, y_copied, grads_copied, 0.8)
    # The gate/up takes its row blocks in SymmetricExchange.local_first's order: a permutation,
    # blocks of this rank's rows only, then those with another rank's rows, then the unused
    # ones, each in schedule order.
    routing = schedule.exchange.group_routing
    block_m = schedule.tiles.pick("gate_up", inputs.w_routed_gate.shape[1],
                                  inputs.x.shape[1]).block_m  # the tiles the layer ran
    order = workspace.exchange.local_first(routing, block_m).tolist()
    blocks = routing.row_route.shape[0] // block_m
    assert sorted(order) == list(range(blocks))
    route = routing.row_route[:blocks * block_m].view(blocks, block_m).tolist()
    used = int(routing.used_rows.reshape(-1)[0]) // block_m
    routes_per_rank = MAX_TOKENS * inputs.topk_experts.shape[1]
    keys = [2 if b >= used else int(any(r >= 0 and r // routes_per_rank != rank
                                        for r in route[b])) for b in range(blocks)]
    assert [(keys[b], b) for b in order] == sorted((keys[b], b) for b in range(blocks))
    if tiles is not None and world_size == 2:  # small blocks, few ranks: some hold this
        assert 0 in keys and 1 in keys  # rank's rows only, so the order is not the schedule's
    # With both flags the schedule has no pull order: a pulling call on it is refused, on every
    # rank, before anything is published.
    assert schedule.exchange.pull_order is None
    with pytest.raises(RuntimeError, match="no pull order"):
        F.forward(pulling, workspace, schedule, *inputs.layer_args, swiglu_limit=0.8)
    y_again, _, _ = _run(workspace, copying, inputs, swiglu_limit=0.8, tiles=tiles)
    assert torch.equal(y_again, y_copied)  # the workspace went on as before


@distributed_test(world_sizes=(2, 4), gpu_world_sizes=GPU_WORLD_SIZES)
def test_ep_copy_rows(rank, world_size):
    _copy_rows_body(rank, world_size, kept=False)


@distributed_test(world_sizes=(2,))
def test_ep_copy_rows_kept(rank, world_size):
    # Kept pre-activations: the backward's first GEMM waits on d_output's copies alone, x's
    # come after them, for the weight gradients.
    _copy_rows_body(rank, world_size, kept=True)


@distributed_test(world_sizes=(2, 4), gpu_world_sizes=GPU_WORLD_SIZES)
def test_ep_dswiglu_apart(rank, world_size):
    # DswigluTiles.apart under expert parallelism: the recomputing backward's gate/up launch
    # stores the pre-activations, then the kept dSwiGLU reads them. With copied rows the
    # gate/up launch waits on the copies (its row blocks local first); with pulled rows it
    # pulls x's and d_output's rows itself, its tiles waiting on them, and the dSwiGLU after it
    # pulls nothing. Either way bitwise the gradients of the same layer that kept its
    # pre-activations, but the down weights' (of the forward's h), all within tolerance of the
    # reference.
    inputs = _rank_inputs(rank, world_size, tokens=_uneven_tokens(rank), shared=16,
                          pattern=RoutingPattern.RANDOM, seed=6)
    workspace = F.create_workspace(SMALL_MINIBATCHES, dist.group.WORLD, device=inputs.x.device,
                                   num_local_tokens=MAX_TOKENS, hidden_size=inputs.x.shape[1],
                                   topk=inputs.topk_experts.shape[1])
    plain = dataclasses.replace(tiles_for_tests() or ops.default_tiles(inputs.x.device),
                                use_tuned=False)
    apart = dataclasses.replace(plain, down_bwd=dataclasses.replace(plain.down_bwd, apart=True))
    copying = dataclasses.replace(SMALL_MINIBATCHES, fwd_copy_rows=True, bwd_copy_rows=True)
    for config in (copying, SMALL_MINIBATCHES):
        y, grads, _ = _run(workspace, config, inputs, swiglu_limit=0.8, tiles=apart)
        _check_against_reference(inputs, y, grads, 0.8)
        kept = dataclasses.replace(config, recompute_gate_up=False)
        _, kept_grads, _ = _run(workspace, kept, inputs, swiglu_limit=0.8, tiles=apart)
        for name, a, b in zip(GRAD_NAMES, grads, kept_grads, strict=True):
            if not name.endswith("_down"):
                assert torch.equal(a, b), (config.bwd_copy_rows, name)
        _, again, _ = _run(workspace, config, inputs, swiglu_limit=0.8, tiles=apart)
        _assert_equal_grads(grads, again)
    F.check_errors(workspace)


@distributed_test(world_sizes=(2,), gpu_world_sizes=GPU_WORLD_SIZES)
def test_ep_kept_gate_up_tile_variants(rank, world_size):
    # The same with the row tiles and the weights through TMA (RowTiles.tma_rows, tma) while
    # rows are pulled and scattered (h and the pre-activations written so in the forward, read
    # and written so in the backward), with persistent tiles asked for every GEMM (the launches
    # that pull take their tiles from a shared counter: ops.experts._tile_counter).
    config = dataclasses.replace(SMALL_MINIBATCHES, recompute_gate_up=False)
    tiles = with_row_tiles(small_tiles(16), tma=True, tma_rows=True, persistent=True)
    tiles = dataclasses.replace(tiles, wgrad=dataclasses.replace(tiles.wgrad, persistent=True))
    _matches_reference_body(rank, world_size, shared=16, limit=0.8,
                            pattern=RoutingPattern.RANDOM, config=config, tiles=tiles)


@distributed_test(world_sizes=(2,), gpu_world_sizes=GPU_WORLD_SIZES)
def test_ep_persistent_rows_grouped_mm_wgrad(rank, world_size):
    # The row GEMMs as persistent loops (Tiles.persistent; those that pull rows take their
    # tiles from a shared counter) while rows are pulled and scattered, epilogues in halves
    # (RowTiles.epilogue_split), gate/up recomputed in the backward; the weight gradients of the
    # pulled rows by torch._grouped_mm (WgradTiles.grouped_mm: the rows copied with their padding
    # zeroed, d_out's scaled by the pulled router weights).
    tiles = with_row_tiles(small_tiles(16), persistent=True, epilogue_split=2)
    tiles = dataclasses.replace(tiles, wgrad=dataclasses.replace(tiles.wgrad, grouped_mm=True))
    _matches_reference_body(rank, world_size, shared=16, limit=0.8,
                            pattern=RoutingPattern.RANDOM, config=SMALL_MINIBATCHES, tiles=tiles)



@contextlib.contextmanager
def _gluon_stand_ins(kinds, **launches):
    """The plan takes the Gluon kernels of `kinds` as an sm_90 GPU would (mok.plan), and the
    launchers run `launches` (name in mok.ops.experts: stand-in) instead of them."""
    from mok import arch
    from mok.ops import experts

    saved_plan = mok_plan.arch_of, mok_plan.gluon_takes
    saved = {name: getattr(experts, name) for name in ("_check_gluon", *launches)}
    mok_plan.arch_of = lambda device: arch.HOPPER
    mok_plan.gluon_takes = lambda kind, *args, **kwargs: kind in kinds
    experts._check_gluon = lambda *args, **kwargs: None
    for name, stand_in in launches.items():
        setattr(experts, name, stand_in)
    try:
        yield
    finally:
        mok_plan.arch_of, mok_plan.gluon_takes = saved_plan
        for name, launch in saved.items():
            setattr(experts, name, launch)


@distributed_test(world_sizes=(2,))
def test_ep_gluon_rows_take_the_scatters(rank, world_size):
    # Where the Gluon down and d_x kernels take launches (RowTiles.gluon on an sm_90 GPU), they
    # also take the expert-parallel ones: the layer hands them the scatter of their rows to the
    # tokens' ranks and, with kept pre-activations, d_x the pull of x. The Triton kernel stands
    # in for the Gluon ones here (given the same scatter and pull): the layer is bitwise the
    # one run by the Triton kernels, and matches the reference.
    from mok.ops import experts

    tile = ops.RowTiles(64, 64, 32, group_m=4, num_warps=4, num_stages=1)
    plain = dataclasses.replace(small_tiles(16, 64), down=tile, d_x=tile)
    gluon = dataclasses.replace(plain, down=dataclasses.replace(tile, gluon=True),
                                d_x=dataclasses.replace(tile, gluon=True))
    inputs = _rank_inputs(rank, world_size, intermediate=32, shared=32, seed=6)
    launches = []

    def down_stand_in(h, w_down, routing, tiles, router_weights, out, scatter):
        launches.append(("down", scatter is not None, False))
        rows = experts.down_proj(h, w_down, routing, dataclasses.replace(tiles, gluon=False),
                                 router_weights, scatter=scatter)
        if scatter is None:
            out.copy_(rows)

    def d_x_stand_in(d_gate_up, w_gate, w_up, routing, tiles, out, scatter, pull, pulled):
        launches.append(("d_x", scatter is not None, pull is not None))
        rows = experts.d_x_rows(d_gate_up, w_gate, w_up, routing,
                                dataclasses.replace(tiles, gluon=False), scatter=scatter,
                                pull=pull, pulled=pulled)
        if scatter is None:
            out.copy_(rows)

    for kept in (False, True):
        config = dataclasses.replace(SMALL_MINIBATCHES, recompute_gate_up=not kept)
        workspace = F.create_workspace(config, dist.group.WORLD, device=inputs.x.device,
                                       num_local_tokens=MAX_TOKENS,
                                       hidden_size=inputs.x.shape[1],
                                       topk=inputs.topk_experts.shape[1])
        y, grads, _ = _run(workspace, config, inputs, swiglu_limit=0.8, tiles=plain)
        launches.clear()
        with _gluon_stand_ins(("down", "d_x"), _down_gluon=down_stand_in,
                              _d_x_gluon=d_x_stand_in):
            y_gluon, grads_gluon, _ = _run(workspace, config, inputs, swiglu_limit=0.8,
                                           tiles=gluon)
        F.check_errors(workspace)
        # the routed down (scattered), the shared expert's (local rows); the shared expert's
        # d_x, the routed one (scattered, pulling x when kept)
        assert launches == [("down", True, False), ("down", False, False),
                            ("d_x", False, False), ("d_x", True, kept)], launches
        assert torch.equal(y, y_gluon)
        _assert_equal_grads(grads, grads_gluon)
        _check_against_reference(inputs, y_gluon, grads_gluon, 0.8)


@distributed_test(world_sizes=(2,))
def test_ep_gluon_gate_up_pulls_apart(rank, world_size):
    # Where the Gluon gate/up kernel takes a launch that pulls rows (RowTiles.gluon on an sm_90
    # GPU), the rows land first, in a pull of its own over every SM (Pull.run_apart), and the
    # kernel then reads them without pulling. The Triton kernel stands in for the Gluon one
    # here (run without a pull): the layer is bitwise the one whose gate/up pulls in its own
    # launch, and matches the reference.
    from mok.ops import experts

    tile = ops.RowTiles(64, 64, 32, group_m=4, num_warps=4, num_stages=1)
    plain = dataclasses.replace(small_tiles(16, 64), gate_up=tile)
    gluon = dataclasses.replace(plain, gate_up=dataclasses.replace(tile, gluon=True))
    inputs = _rank_inputs(rank, world_size, shared=16, seed=4)
    workspace = F.create_workspace(SMALL_MINIBATCHES, dist.group.WORLD, device=inputs.x.device,
                                   num_local_tokens=MAX_TOKENS, hidden_size=inputs.x.shape[1],
                                   topk=inputs.topk_experts.shape[1])
    y, grads, _ = _run(workspace, SMALL_MINIBATCHES, inputs, swiglu_limit=0.8, tiles=plain)
    launches = []

    def triton_stand_in(x, w_gate, w_up, routing, tiles, swiglu_limit, h, gate_up, pull):
        assert pull is None  # pulled already, by Pull.run_apart
        launches.append(tuple(w_gate.shape))
        h.copy_(experts.gate_up_swiglu(x, w_gate, w_up, routing,
                                       dataclasses.replace(tiles, gluon=False), swiglu_limit,
                                       gate_up=gate_up))

    with _gluon_stand_ins(("gate_up",), _gate_up_gluon=triton_stand_in):
        y_apart, grads_apart, _ = _run(workspace, SMALL_MINIBATCHES, inputs, swiglu_limit=0.8,
                                       tiles=gluon)
    F.check_errors(workspace)
    assert launches == [(1, 16, 32), tuple(inputs.w_routed_gate.shape)]  # shared, then routed
    assert torch.equal(y, y_apart)
    _assert_equal_grads(grads, grads_apart)
    _check_against_reference(inputs, y_apart, grads_apart, 0.8)

@pytest.mark.parametrize("limit", [None, 0.8], ids=["no_limit", "limit"])
def test_gate_up_pulls_d_output_along_for_the_dswiglu_after_it(limit):
    # The pulling backward's first launch under DswigluTiles.apart: gate/up pulls x's rows and
    # d_output's (Pull.second_src into pulled_second), here a rank's own tokens from its own
    # memory (mok.testing.pull), its tiles waiting on both; both land as at the source, and
    # dswiglu_apart with that pull is bitwise dswiglu_apart reading them directly.
    from mok.testing.pull import local_pull

    inputs = make_inputs(40, 32, 24, 4, 2, device=DEVICE, seed=3, routing=RoutingPattern.SKEWED)
    tiles = dataclasses.replace(tiles_for_tests() or ops.default_tiles(DEVICE), use_tuned=False)
    schedule = F.build_schedule(
        F.create_workspace(F.MoKConfig(), None, device=DEVICE, num_local_tokens=40,
                           hidden_size=32, topk=2),
        F.MoKConfig(), inputs.topk_experts, num_local_experts=4, tiles=tiles)
    routing = schedule.routing
    x, d_out, rw = inputs.x, inputs.d_output, inputs.router_weights
    w_gate, w_up, w_down = inputs.w_routed_gate, inputs.w_routed_up, inputs.w_routed_down
    direct = ops.dswiglu_apart(d_out, x, w_down, w_gate, w_up, routing, tiles.gate_up,
                               tiles.down, rw, limit)
    pulled = local_pull(x, routing, minibatch=8, num_programs=2)
    pull = dataclasses.replace(pulled.pull, second_src=d_out)
    d_out_rows = torch.zeros_like(d_out)
    got = ops.dswiglu_apart(d_out_rows, pulled.rows, w_down, w_gate, w_up, routing,
                            tiles.gate_up, tiles.down, rw, limit, pull=pull)
    assert int(pull.peer.errors.abs().sum()) == 0
    assert torch.equal(pulled.rows, x) and torch.equal(d_out_rows, d_out)
    used = int(routing.expert_offsets[-1])  # rows past it are never written
    assert torch.equal(got[0][:used], direct[0][:used])
    assert torch.equal(got[1][:used], direct[1][:used])
    with pytest.raises(ValueError, match="second_src"):
        ops.dswiglu_apart(d_out_rows, pulled.rows, w_down, w_gate, w_up, routing,
                          tiles.gate_up, tiles.down, rw, limit, pull=pulled.pull)
    with pytest.raises(ValueError, match="pulled_second"):
        ops.gate_up_swiglu(x, w_gate, w_up, routing, tiles.gate_up, None, pull=pull)
    with pytest.raises(ValueError, match="pulled_second"):
        ops.gate_up_swiglu(x, w_gate, w_up, routing, tiles.gate_up, None, pulled_second=d_out)
    with pytest.raises(ValueError, match="pulled_second must be"):
        ops.gate_up_swiglu(x, w_gate, w_up, routing, tiles.gate_up, None, pull=pull,
                           pulled_second=d_out[:-1])


def test_persistent_pulling_launches_share_a_tile_counter():
    # A persistent launch whose first programs pull rows hands its tiles out from a counter
    # zeroed for it; any other launch strides over fixed shares (no counter).
    from mok.ops import experts

    routing = ops.dense_routing(8, 16, torch.device("cpu"))
    tiles = with_row_tiles(small_tiles(16), persistent=True, epilogue_split=2).gate_up
    plain = dataclasses.replace(tiles, persistent=False)
    for row_tiles, pull, dynamic in ((tiles, None, False), (plain, object(), False),
                                     (tiles, object(), True)):
        counter, is_dynamic = experts._tile_counter(row_tiles, pull, routing)
        assert is_dynamic is dynamic
        if dynamic:
            assert counter.data_ptr() != routing.used_rows.data_ptr()
            assert counter.dtype == torch.int32 and counter.tolist() == [0]
        else:
            # a placeholder the kernel never reads
            assert counter.data_ptr() == routing.used_rows.data_ptr()


def _dispatch_body(rank, world_size):
    """The dispatch alone: every token of the group with a route scheduled here lands once, at
    its group row, with its router weights; no other row or weight is written."""
    from mok.exchange import Phase
    from mok.ops import comm

    config = SMALL_MINIBATCHES
    tokens = MAX_TOKENS - 7 * rank  # ranks with fewer tokens than the workspace holds
    inputs = _rank_inputs(rank, world_size, tokens=tokens, seed=4)
    topk = inputs.topk_experts.shape[1]
    workspace = F.create_workspace(config, dist.group.WORLD, device=inputs.x.device,
                                   num_local_tokens=MAX_TOKENS, hidden_size=inputs.x.shape[1],
                                   topk=topk)
    schedule = F.build_schedule(workspace, config, inputs.topk_experts,
                                num_local_experts=inputs.num_local_experts,
                                tiles=tiles_for_tests())
    ep = workspace.exchange
    peer = ep.peer_flags(workspace.error_flags)
    _, _, pull = ep.forward_pull(peer, schedule.exchange, inputs.x, inputs.router_weights,
                                 minibatch=config.minibatch_size, num_programs=3)
    group_tokens = world_size * MAX_TOKENS
    dst = torch.full((group_tokens, inputs.x.shape[1]), float("nan"), dtype=inputs.x.dtype,
                     device=inputs.x.device)
    dst_weights = torch.full((group_tokens * topk,), float("nan"), device=inputs.x.device)
    comm.pull_tokens(peer, src=pull.src, dst=dst, weights=pull.weights, dst_weights=dst_weights,
                     order=pull.order, moving=pull.moving, ready=pull.ready, phase=pull.phase,
                     publish_slot=pull.publish_slot, tokens_per_rank=pull.tokens_per_rank,
                     topk=topk, num_programs=pull.num_programs, minibatch=pull.minibatch,
                     src_deltas=pull.src_deltas, weights_deltas=pull.weights_deltas)
    ep.pulled(peer, Phase.FORWARD)
    F.check_errors(workspace)
    # What every rank holds, on every rank (sums of one rank's values and zeros: exact).
    mine = slice(rank * MAX_TOKENS, rank * MAX_TOKENS + tokens)

    def everyone(values, width):
        out = torch.zeros(group_tokens, width, dtype=torch.float64, device=inputs.x.device)
        out[mine] = values.double()
        dist.all_reduce(out)
        return out

    x_all = everyone(inputs.x, inputs.x.shape[1]).to(inputs.x.dtype)
    w_all = everyone(inputs.router_weights, topk).float()
    ids_all = everyone(inputs.topk_experts + 1, topk).long() - 1  # -1: no token there
    first = rank * inputs.num_local_experts
    local = (ids_all >= first) & (ids_all < first + inputs.num_local_experts)
    wanted = local.any(dim=1)
    assert wanted.any() and not wanted.all()
    assert torch.equal(dst[wanted], x_all[wanted])
    assert dst[~wanted].isnan().all()
    weights = dst_weights.view(group_tokens, topk)
    assert torch.equal(weights[wanted], w_all[wanted])
    assert weights[~wanted].isnan().all()
    # The pull's order: the moving tokens first, by first schedule row; every minibatch of them
    # announced, this round's number each.
    plan = schedule.exchange
    moving = int(plan.pull_moving)
    assert moving == int(wanted.sum())
    order = plan.pull_order.long()
    assert wanted[order[:moving]].all()
    first_row = torch.where(schedule.routing.route_row >= 0, schedule.routing.route_row,
                            2**31 - 1).view(group_tokens, topk).amin(dim=1)
    assert (first_row[order[:moving]].diff() > 0).all()
    assert torch.equal(plan.pull_position.long()[order], torch.arange(group_tokens,
                                                                       device=order.device))
    used = -(-moving // config.minibatch_size)
    assert (pull.ready[:used] == pull.ready[0]).all() and int(pull.ready[0]) > 0


@distributed_test(world_sizes=(2,))
def test_ep_gather_peers_takes_blocks_in_turn(rank, world_size):
    # The schedule's gather of every rank's top-k, with more blocks per rank than programs
    # (ops.comm._GATHER_PROGRAMS_PER_RANK): each program takes several, the last one partial.
    from mok.exchange import Phase, SymmetricExchange
    from mok.ops import comm

    device = _device(rank)
    block = 4096
    numel = (comm._GATHER_PROGRAMS_PER_RANK * 2 + 1) * block + 5
    ep = SymmetricExchange(dist.group.WORLD, device, num_tokens=numel, hidden_size=1, topk=1,
                        timeout_s=300.0)
    peer = ep.peer_flags(torch.zeros(NUM_ERROR_FLAGS, dtype=torch.int32, device=device))
    values = torch.randint(-2**30, 2**30, (world_size, numel), dtype=torch.int32,
                           generator=torch.Generator().manual_seed(5)).to(device)
    ep.publish(peer, Phase.SCHEDULE, [(ep.topk_pub, values[rank])])
    gathered = torch.full((world_size * numel,), -7, dtype=torch.int32, device=device)
    comm.gather_peers(peer, ep.topk_pub, gathered, ep.buffer.deltas(torch.int32),
                      Phase.SCHEDULE, ep.slots.pub(Phase.SCHEDULE))
    comm.signal_peers(peer, Phase.SCHEDULE, ep.slots.ack(Phase.SCHEDULE))
    assert torch.equal(gathered.view(world_size, numel), values)
    comm.wait_peers(peer, Phase.SCHEDULE, ep.slots.ack(Phase.SCHEDULE))  # none reads any more
    dist.barrier()


@distributed_test(world_sizes=(2,))
def test_ep_dispatch_pulls_each_needed_token_once(rank, world_size):
    _dispatch_body(rank, world_size)


def _errors_body(rank, world_size):
    config = SMALL_MINIBATCHES
    inputs = _rank_inputs(rank, world_size, seed=2)
    workspace = F.create_workspace(config, dist.group.WORLD, device=inputs.x.device,
                                   num_local_tokens=inputs.x.shape[0],
                                   hidden_size=inputs.x.shape[1], topk=inputs.topk_experts.shape[1])
    with pytest.raises(MoKInputError, match="num_local_tokens"):
        F.build_schedule(workspace, config, torch.cat([inputs.topk_experts] * 2),
                         num_local_experts=inputs.num_local_experts)
    schedule = F.build_schedule(workspace, config, inputs.topk_experts,
                                num_local_experts=inputs.num_local_experts,
                                tiles=tiles_for_tests())
    with pytest.raises(MoKInputError, match="router_weights"):
        F.recompute_forward_context(config, workspace, schedule, inputs.x, None, None,
                                    inputs.w_routed_gate, inputs.w_routed_up)
    # An expert id out of range on rank 0 is seen by every rank (each sorts the group's routes).
    topk = inputs.topk_experts.clone()
    if rank == 0:
        topk[3, 1] = world_size * inputs.num_local_experts
    F.build_schedule(workspace, config, topk, num_local_experts=inputs.num_local_experts,
                     tiles=tiles_for_tests())
    with pytest.raises(MoKDataError, match="EXPERT_ID_OUT_OF_RANGE"):
        F.check_errors(workspace)
    # A schedule capacity of a quarter of the T * k routes each rank receives on average:
    # every rank overflows and says so (no route is dropped silently). Small tiles on every
    # device: with the GPU's 128-row alignment the padding alone would hold every route.
    small = dataclasses.replace(config, schedule_capacity_multiplier=0.25)
    tight = F.create_workspace(small, dist.group.WORLD, device=inputs.x.device,
                               num_local_tokens=inputs.x.shape[0],
                               hidden_size=inputs.x.shape[1], topk=inputs.topk_experts.shape[1])
    F.build_schedule(tight, small, inputs.topk_experts,
                     num_local_experts=inputs.num_local_experts, tiles=small_tiles(16))
    with pytest.raises(MoKDataError, match="CAPACITY_OVERFLOW"):
        F.check_errors(tight)


@distributed_test(world_sizes=(2,))
def test_ep_errors(rank, world_size):
    _errors_body(rank, world_size)


def _overflow_body(rank, world_size, pattern, multiplier, tiles=None, macrobatch=None):
    # A schedule too small for the routes it receives: the routes without a row are reported
    # and left out on their tokens' ranks, as on one GPU: y and every gradient equal the
    # reference with those routes' router weights set to zero, and their router-weight
    # gradients are 0 (the kernels still run: on a GPU the error reaches the host later).
    # macrobatch: the same through the ring (MoKConfig.macrobatch_size).
    config = dataclasses.replace(SMALL_MINIBATCHES, schedule_capacity_multiplier=multiplier,
                                 macrobatch_size=macrobatch or SMALL_MINIBATCHES.macrobatch_size)
    inputs = _rank_inputs(rank, world_size, pattern=pattern, seed=4)
    tokens, topk = inputs.topk_experts.shape
    workspace = F.create_workspace(config, dist.group.WORLD, device=inputs.x.device,
                                   num_local_tokens=tokens, hidden_size=inputs.x.shape[1],
                                   topk=topk)
    assert (workspace.exchange.window is not None) == (macrobatch is not None)
    schedule = F.build_schedule(workspace, config, inputs.topk_experts,
                                num_local_experts=inputs.num_local_experts,
                                tiles=tiles or small_tiles(16))
    # Which routes found no row: each expert's rank knows its own and reports the overflow at
    # once; the tokens' ranks learn of it in the forward (below).
    plan = schedule.exchange
    experts = plan.group_topk.long()
    mine = ((experts >= plan.first_local_expert)
            & (experts < plan.first_local_expert + inputs.num_local_experts))
    dropped = (mine & (plan.group_routing.route_row < 0)).to(torch.int32)
    if bool(dropped.any()):
        with pytest.raises(MoKDataError, match="CAPACITY_OVERFLOW"):
            F.check_errors(workspace)
    else:
        F.check_errors(workspace)
    # What an earlier call left in the buffers the other ranks deliver into (rows are written
    # there only after this rank publishes in the forward, so filling them now races nothing).
    workspace.exchange.combine_buffer(inputs.x.dtype).fill_(1000.0)
    workspace.exchange.d_weights.fill_(1000.0)
    y, context = F.forward(config, workspace, schedule, *inputs.layer_args)
    dist.all_reduce(dropped, op=dist.ReduceOp.MAX)
    assert int(dropped.sum()) > 0, "the case must overflow"
    own = dropped[rank * tokens * topk:(rank + 1) * tokens * topk].view(tokens, topk).bool()
    # A rank some of whose routes were left out is told so by the forward: the error reaches
    # it too (checked here, before the backward, which would otherwise raise it: the forward
    # starts its flags' check when its kernels are launched).
    if bool(own.any()):
        with pytest.raises(MoKDataError, match="CAPACITY_OVERFLOW"):
            F.check_errors(workspace)
    else:
        F.check_errors(workspace)
    grads = F.backward(config, workspace, schedule, context, inputs.d_output, *inputs.layer_args)
    left_out = dataclasses.replace(
        inputs, router_weights=torch.where(own, 0.0, inputs.router_weights))
    y_ref, grads_ref = moe_reference_grads(left_out, group=dist.group.WORLD,
                                           compute_dtype=REF_DTYPE)
    assert_close(y, y_ref, dtype=inputs.x.dtype, name="y")
    for name, grad, grad_ref in zip(GRAD_NAMES, grads, grads_ref, strict=True):
        if grad_ref is None:
            continue
        if name == "d_router_weights":
            assert bool((grad[own] == 0).all()), "a route left out gets no gradient"
            grad, grad_ref = grad[~own], grad_ref[~own]
        assert_close(grad, grad_ref, dtype=inputs.x.dtype, name=name)


@distributed_test(world_sizes=(2,), gpu_world_sizes=GPU_WORLD_SIZES)
def test_ep_capacity_overflow_leaves_the_routes_out(rank, world_size):
    _overflow_body(rank, world_size, RoutingPattern.ONE_EXPERT, 0.25)
    _overflow_body(rank, world_size, RoutingPattern.SKEWED, 0.5)
    # The same with persistent row GEMMs (their tiles bounded by the rows in use, read on the
    # device) and the weight gradients by torch._grouped_mm (groups clamped to those rows).
    tiles = with_row_tiles(small_tiles(16), persistent=True, epilogue_split=2)
    tiles = dataclasses.replace(tiles, wgrad=dataclasses.replace(tiles.wgrad, grouped_mm=True))
    _overflow_body(rank, world_size, RoutingPattern.ONE_EXPERT, 0.25, tiles)


def _layout_body(rank, world_size):
    """One host: the whole group is one node; a group that does not split raises, and so do
    ranks passing different ranks_per_node (not a hang in the subgroups' creation)."""
    from mok.exchange import ranks_per_node_of

    assert ranks_per_node_of(dist.group.WORLD) == world_size
    with pytest.raises(MoKInputError, match="ranks_per_node=3"):
        F.create_workspace(F.MoKConfig(), dist.group.WORLD, device=_device(rank),
                           num_local_tokens=8, hidden_size=32, topk=2, ranks_per_node=3)
    with pytest.raises(MoKInputError, match="different values.*ranks_per_node"):
        F.create_workspace(F.MoKConfig(), dist.group.WORLD, device=_device(rank),
                           num_local_tokens=8, hidden_size=32, topk=2,
                           ranks_per_node=1 if rank == 0 else None)


@distributed_test(world_sizes=(2,))
def test_ep_node_layout(rank, world_size):
    _layout_body(rank, world_size)


def _formats_differ_body(rank, world_size):
    """Each rank reads the others' rows in its workspace's format: ranks creating workspaces of
    different dtypes, precisions or ring sizes raise MoKInputError on every rank, and so does a
    call whose x or config is not the workspace's, before any row moves; an fp16 workspace
    runs fp16 calls, exact."""
    def create(config=SMALL_MINIBATCHES, dtype=torch.bfloat16):
        return F.create_workspace(config, dist.group.WORLD, device=_device(rank),
                                  num_local_tokens=16, hidden_size=32, topk=3, dtype=dtype)

    fp8 = dataclasses.replace(SMALL_MINIBATCHES, precision="fp8")
    for kwargs, match in (
            (dict(config=dataclasses.replace(SMALL_MINIBATCHES, macrobatch_size=8 if rank == 0
                                             else None)), r"macrobatch_size: 8, 0"),
            (dict(config=fp8 if rank == 0 else SMALL_MINIBATCHES), r"precision: fp8, bf16"),
            (dict(dtype=torch.float16 if rank == 0 else torch.bfloat16),
             r"dtype: float16, bfloat16")):
        with pytest.raises(MoKInputError, match=r"different values \(" + match):
            create(**kwargs)
    workspace = create()
    for dtype, config, match in ((torch.float16, SMALL_MINIBATCHES, "x is torch.float16"),
                                 (torch.bfloat16, fp8, "precision 'fp8'")):
        inputs = make_inputs(16, 32, 16, 2 * world_size, 3, num_local_experts=2, dtype=dtype,
                             device=_device(rank), seed=80 + rank)
        schedule = F.build_schedule(workspace, config, inputs.topk_experts,
                                    num_local_experts=inputs.num_local_experts,
                                    tiles=tiles_for_tests())
        with pytest.raises(MoKInputError, match=match):
            F.forward(config, workspace, schedule, *inputs.layer_args)
    workspace = create(dtype=torch.float16)
    inputs = make_inputs(16, 32, 16, 2 * world_size, 3, num_local_experts=2,
                         dtype=torch.float16, device=_device(rank), seed=90 + rank)
    y, grads, _ = _run(workspace, SMALL_MINIBATCHES, inputs, tiles=tiles_for_tests())
    F.check_errors(workspace)
    _check_against_reference(inputs, y, grads, None)


@distributed_test(world_sizes=(2,))
def test_ep_ranks_with_different_formats_raise(rank, world_size):
    _formats_differ_body(rank, world_size)


def _creation_waits_bounded_body(rank, world_size):
    """The workspace's creation is a step of the whole group: a rank that never comes leaves
    the others a MoKTimeoutError naming it after peer_timeout_s (not the process group's
    timeout), and a rank coming after that raises too, rather than go on alone into the
    collectives that follow. Ranks that all come create it."""
    import time

    def create(timeout_s):
        return F.create_workspace(F.MoKConfig(peer_timeout_s=timeout_s), dist.group.WORLD,
                                  device=_device(rank), num_local_tokens=8, hidden_size=16,
                                  topk=2)

    if rank == 1:  # comes 3 s late, after rank 0 gave up
        time.sleep(3.0)
        with pytest.raises(MoKTimeoutError, match=r"rank 0 gave up waiting"):
            create(30.0)
    else:
        start = time.monotonic()
        with pytest.raises(MoKTimeoutError, match=re.escape("rank(s) [1] did not reach it")):
            create(1.0)
        assert time.monotonic() - start < 2.5
    dist.barrier()
    workspace = create(30.0)  # the next round: every rank comes
    assert workspace.ep_size == world_size
    dist.barrier()


@distributed_test(world_sizes=(2,))
def test_ep_workspace_creation_waits_are_bounded(rank, world_size):
    _creation_waits_bounded_body(rank, world_size)


def _local_experts_differ_body(rank, world_size):
    """Ranks passing different num_local_experts (2 and 3): every rank reports the routes it
    cannot place, in one node and across nodes, rather than leave experts no rank computes."""
    inputs = _rank_inputs(rank, world_size, tokens=8, num_local=2 + rank, seed=6)
    for per_node in (None, 1):
        workspace = F.create_workspace(F.MoKConfig(), dist.group.WORLD, device=inputs.x.device,
                                       num_local_tokens=8, hidden_size=inputs.x.shape[1],
                                       topk=inputs.topk_experts.shape[1], ranks_per_node=per_node)
        F.build_schedule(workspace, F.MoKConfig(), inputs.topk_experts,
                         num_local_experts=inputs.num_local_experts, tiles=tiles_for_tests())
        with pytest.raises(MoKDataError, match="EXPERT_ID_OUT_OF_RANGE.*num_local_experts"):
            F.check_errors(workspace)


@distributed_test(world_sizes=(2,))
def test_ep_ranks_with_different_local_experts_raise(rank, world_size):
    _local_experts_differ_body(rank, world_size)


def _timeout_body(rank, world_size, *, copies=False):
    """Rank 1 never builds its schedule: rank 0's wait for it times out with an error naming it.
    copies (rows moved by copies): rank 1 builds the schedule but never runs the forward, so
    rank 0's wait for its published x times out; the forward still ends (the copies and the
    landed flags do not wait on the peer) and the error names rank 1."""
    config = F.MoKConfig(peer_timeout_s=1.0, fwd_copy_rows=copies, bwd_copy_rows=copies)
    inputs = _rank_inputs(rank, world_size, seed=3)
    workspace = F.create_workspace(config, dist.group.WORLD, device=inputs.x.device,
                                   num_local_tokens=inputs.x.shape[0],
                                   hidden_size=inputs.x.shape[1], topk=inputs.topk_experts.shape[1])
    if rank == 0 or copies:
        schedule = F.build_schedule(workspace, config, inputs.topk_experts,
                                    num_local_experts=inputs.num_local_experts,
                                    tiles=tiles_for_tests())
    if copies:
        F.check_errors(workspace)
        if rank == 0:
            F.forward(config, workspace, schedule, *inputs.layer_args)
    if rank == 0:
        with pytest.raises(MoKDataError, match="PEER_TIMEOUT.*waited on rank 1"):
            F.check_errors(workspace)
        # The ranks are out of step from then on: every later call raises.
        with pytest.raises(MoKDataError, match="out of step"):
            F.build_schedule(workspace, config, inputs.topk_experts,
                             num_local_experts=inputs.num_local_experts, tiles=tiles_for_tests())
        with pytest.raises(MoKDataError, match="out of step"):
            F.check_errors(workspace)
    dist.barrier()


@distributed_test(world_sizes=(2,))
def test_ep_peer_timeout_names_the_rank(rank, world_size):
    _timeout_body(rank, world_size)


@distributed_test(world_sizes=(2,))
def test_ep_copy_rows_peer_timeout_names_the_rank(rank, world_size):
    _timeout_body(rank, world_size, copies=True)


def _graph_body(rank, world_size, tiles=None, config=None):
    """GPU: no host sync in the EP step, and a CUDA graph of it replays bitwise like eager."""
    config = config or F.MoKConfig()
    inputs = _rank_inputs(rank, world_size, tokens=1024, hidden=256, intermediate=128,
                          num_local=4, topk=4, shared=128, seed=4)
    workspace = F.create_workspace(config, dist.group.WORLD, device=inputs.x.device,
                                   num_local_tokens=1024, hidden_size=256, topk=4)

    def step():
        y, grads, _ = _run(workspace, config, inputs, swiglu_limit=7.0, tiles=tiles)
        return (y, *grads)

    eager, graph, captured = eager_and_captured(step, before_capture=dist.barrier)
    if tiles is not None:
        _check_against_reference(inputs, eager[0], eager[1:], 7.0)
    for _ in range(2):  # every replay is one more round of each phase on every rank
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    F.check_errors(workspace)
    dist.barrier()


@pytest.mark.gpu
@distributed_test(world_sizes=(2,), gpu_world_sizes=GPU_WORLD_SIZES)
def test_ep_no_host_sync_and_cuda_graph(rank, world_size):
    _graph_body(rank, world_size)


def _gluon_tiles():
    """Gluon tiles (RowTiles.gluon) for every row GEMM."""
    gluon = ops.RowTiles(128, 128, 64, group_m=8, num_warps=8, num_stages=4, persistent=True,
                         tma=True, tma_rows=True, gluon=True)
    down_bwd = dataclasses.replace(gluon, block_n=64, num_stages=3)
    return dataclasses.replace(ops.default_tiles(torch.device("cuda")), use_tuned=False,
                               gate_up=gluon, down=gluon,
                               d_x=dataclasses.replace(gluon, num_stages=3),
                               down_bwd=ops.DswigluTiles(**dataclasses.asdict(down_bwd)))


@pytest.mark.gpu
@distributed_test(world_sizes=(2,), gpu_world_sizes=GPU_WORLD_SIZES)
def test_ep_gluon_no_host_sync_and_cuda_graph(rank, world_size):
    # The same with the Gluon kernels' tiles for every row GEMM: on an sm_90 GPU gate/up's rows
    # are pulled by a launch of their own before the Gluon kernel (Pull.run_apart), down and
    # d_x scatter their rows by the Gluon kernels, the dSwiGLU (its tiles wait on the rows it
    # pulls) runs the Triton kernel on these tiles, and the shared expert's launches by Gluon;
    # against the reference too.
    _graph_body(rank, world_size, tiles=_gluon_tiles())


@pytest.mark.gpu
@distributed_test(world_sizes=(2,), gpu_world_sizes=GPU_WORLD_SIZES)
def test_ep_gluon_kept_no_host_sync_and_cuda_graph(rank, world_size):
    # The same with kept pre-activations: the Gluon d_x scatters its rows and pulls x for the
    # weight gradients in a partition of each program.
    _graph_body(rank, world_size, tiles=_gluon_tiles(),
                config=F.MoKConfig(recompute_gate_up=False))


@pytest.mark.gpu
@distributed_test(world_sizes=(2,), gpu_world_sizes=GPU_WORLD_SIZES)
def test_ep_gluon_apart_no_host_sync_and_cuda_graph(rank, world_size):
    # The same with DswigluTiles.apart: the recomputing backward's gate/up launch (the Triton
    # kernel on these tiles) pulls x's and d_output's rows, then the Gluon kept dSwiGLU.
    tiles = _gluon_tiles()
    _graph_body(rank, world_size, tiles=dataclasses.replace(
        tiles, down_bwd=dataclasses.replace(tiles.down_bwd, apart=True)))


@pytest.mark.gpu
@distributed_test(world_sizes=(2,), gpu_world_sizes=GPU_WORLD_SIZES)
def test_ep_gluon_pulling_no_host_sync_and_cuda_graph(rank, world_size):
    # The same with MoKConfig.fwd_pull_in_gluon: the Gluon gate/up pulls its rows in a
    # partition of each program (mok.kernels.gluon_comm) while its tiles wait on them.
    _graph_body(rank, world_size, tiles=_gluon_tiles(),
                config=F.MoKConfig(fwd_pull_in_gluon=True, minibatch_size=16))


@pytest.mark.gpu
@distributed_test(world_sizes=(2,), gpu_world_sizes=GPU_WORLD_SIZES)
def test_ep_gluon_copy_rows_no_host_sync_and_cuda_graph(rank, world_size):
    # The same with MoKConfig.fwd_copy_rows and bwd_copy_rows: the copies run on a side stream
    # (the copy engines), their flags raised by the stream (memsets under capture, where the
    # GEMMs wait for the copies), the Gluon gate/up's and dSwiGLU's loaders waiting on them.
    _graph_body(rank, world_size, tiles=_gluon_tiles(),
                config=F.MoKConfig(fwd_copy_rows=True, bwd_copy_rows=True))


@pytest.mark.gpu
@distributed_test(world_sizes=(2,), gpu_world_sizes=GPU_WORLD_SIZES)
def test_ep_gluon_kept_copy_rows_no_host_sync_and_cuda_graph(rank, world_size):
    _graph_body(rank, world_size, tiles=_gluon_tiles(),
                config=F.MoKConfig(fwd_copy_rows=True, bwd_copy_rows=True,
                                   recompute_gate_up=False))


def _cross_node_body(rank, world_size, uneven=False, config=SMALL_MINIBATCHES, apart=False):
    """Two "nodes" of world_size // 2 ranks: collectives between them, the one-node protocol
    (symmetric buffers when a node has 2 ranks, one device when 1) inside. uneven: rank r holds
    _uneven_tokens(rank) tokens. apart: the recomputing dSwiGLU as two launches
    (DswigluTiles.apart)."""
    tokens = _uneven_tokens(rank) if uneven else MAX_TOKENS
    inputs = _rank_inputs(rank, world_size, tokens=tokens, shared=16,
                          pattern=RoutingPattern.SKEWED, seed=5)
    workspace = F.create_workspace(config, dist.group.WORLD, device=inputs.x.device,
                                   num_local_tokens=MAX_TOKENS,
                                   hidden_size=inputs.x.shape[1], topk=inputs.topk_experts.shape[1],
                                   ranks_per_node=world_size // 2)
    assert isinstance(workspace.exchange, CrossNodeExchange) and workspace.exchange.num_nodes == 2
    tiles = tiles_for_tests()
    if apart:
        tiles = dataclasses.replace(tiles or ops.default_tiles(inputs.x.device), use_tuned=False)
        tiles = dataclasses.replace(tiles, down_bwd=dataclasses.replace(tiles.down_bwd,
                                                                        apart=True))
    y, grads, schedule = _run(workspace, config, inputs, swiglu_limit=1.5, tiles=tiles)
    F.check_errors(workspace)
    _check_against_reference(inputs, y, grads, 1.5)
    y2, grads2, _ = _run(workspace, config, inputs, swiglu_limit=1.5, tiles=tiles)
    assert torch.equal(y, y2)
    _assert_equal_grads(grads, grads2)
    _assert_equal_grads(grads, _recomputed_grads(workspace, config, schedule, inputs, 1.5))
    # An expert id out of range is reported on every rank, -2 too (the padding's id between
    # the nodes, which a caller's id must not pass for).
    for bad in (-3, -2):
        topk = inputs.topk_experts.clone()
        if rank == world_size - 1:
            topk[0, 0] = bad
        F.build_schedule(workspace, config, topk, num_local_experts=inputs.num_local_experts,
                         tiles=tiles)
        with pytest.raises(MoKDataError, match="EXPERT_ID_OUT_OF_RANGE"):
            F.check_errors(workspace)


@distributed_test(world_sizes=(2, 4, 8))
def test_ep_across_nodes_matches_reference(rank, world_size):
    _cross_node_body(rank, world_size)


def _cross_node_overflow_body(rank, world_size):
    """A schedule too small for its routes, across nodes: the overflow, flagged where the
    experts are, reaches every rank of their rail, whose routes it left out."""
    config = dataclasses.replace(SMALL_MINIBATCHES, schedule_capacity_multiplier=0.25)
    inputs = _rank_inputs(rank, world_size, pattern=RoutingPattern.ONE_EXPERT, seed=4)
    workspace = F.create_workspace(config, dist.group.WORLD, device=inputs.x.device,
                                   num_local_tokens=MAX_TOKENS, hidden_size=inputs.x.shape[1],
                                   topk=inputs.topk_experts.shape[1],
                                   ranks_per_node=world_size // 2)
    schedule = F.build_schedule(workspace, config, inputs.topk_experts,
                                num_local_experts=inputs.num_local_experts,
                                tiles=tiles_for_tests())
    F.forward(config, workspace, schedule, *inputs.layer_args)
    with pytest.raises(MoKDataError, match="CAPACITY_OVERFLOW"):
        F.check_errors(workspace)


@distributed_test(world_sizes=(2, 4))
def test_ep_across_nodes_capacity_overflow_reaches_every_rank(rank, world_size):
    _cross_node_overflow_body(rank, world_size)


@distributed_test(world_sizes=(4,))
def test_ep_across_nodes_with_different_token_counts(rank, world_size):
    _cross_node_body(rank, world_size, uneven=True)


@distributed_test(world_sizes=(2,))
def test_ep_across_nodes_kept_gate_up(rank, world_size):
    # The routed experts keep their pre-activations inside the node; the shared expert keeps h.
    _cross_node_body(rank, world_size,
                     config=dataclasses.replace(SMALL_MINIBATCHES, recompute_gate_up=False))


@distributed_test(world_sizes=(4,))
def test_ep_across_nodes_dswiglu_apart(rank, world_size):
    # Inside each node of two ranks the recomputing backward's gate/up launch pulls x's and
    # d_output's rows (DswigluTiles.apart), the kept dSwiGLU after it.
    _cross_node_body(rank, world_size, uneven=True, apart=True)


@distributed_test(world_sizes=(4,))
def test_ep_across_nodes_copy_rows(rank, world_size):
    # Two "nodes" of two ranks, the rows inside a node moved by copies (fwd_copy_rows,
    # bwd_copy_rows).
    _cross_node_body(rank, world_size, uneven=True,
                     config=dataclasses.replace(SMALL_MINIBATCHES, fwd_copy_rows=True,
                                                bwd_copy_rows=True))


def _empty_rank_body(rank, world_size):
    """fp16, top-1, and a rank that holds no token this step: the others' results are exact as
    ever, and the empty rank still serves its experts."""
    config = SMALL_MINIBATCHES
    tokens = (10, 0)[rank]
    inputs = make_inputs(tokens, 32, 16, 2 * world_size, 1, shared_intermediate_size=16,
                         num_local_experts=2, dtype=torch.float16, device=_device(rank),
                         seed=rank)
    workspace = F.create_workspace(config, dist.group.WORLD, device=inputs.x.device,
                                   num_local_tokens=10, hidden_size=32, topk=1,
                                   dtype=torch.float16)
    y, grads, schedule = _run(workspace, config, inputs, tiles=tiles_for_tests())
    F.check_errors(workspace)
    assert y.shape == (tokens, 32) and grads[0].shape == (tokens, 32)
    y_ref, grads_ref = moe_reference_grads(inputs, group=dist.group.WORLD,
                                           compute_dtype=REF_DTYPE)
    if tokens:
        assert_close(y, y_ref, dtype=torch.float16, name="y")
    for name, grad, grad_ref in zip(GRAD_NAMES, grads, grads_ref, strict=True):
        if grad_ref is not None and grad_ref.numel():
            assert_close(grad, grad_ref, dtype=torch.float16, name=name)
    # Rank 1's experts served rank 0's tokens: their gradients are not zero.
    assert grads[2].abs().max() > 0 or int(schedule.expert_counts.sum()) == 0


@distributed_test(world_sizes=(2,))
def test_ep_rank_without_tokens_fp16_top1(rank, world_size):
    _empty_rank_body(rank, world_size)
