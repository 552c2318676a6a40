"""GPU-only properties: real shapes, no host sync, CUDA-graph capture, determinism at scale."""

import dataclasses

import pytest
import torch

import mok.functional as F
from mok import ops
from mok.arch import arch_of
from mok.ops.tuning import DswigluTiles, RowTiles, WgradTiles
from mok.testing import (
    GRAD_NAMES,
    SHAPES,
    SHAPES_BY_NAME,
    RoutingPattern,
    assert_close,
    eager_and_captured,
    make_inputs,
    make_shape_inputs,
    moe_reference_grads,
)
from mok.testing.tolerance import FP8_TOLERANCE

from ..conftest import run_layer, with_row_tiles

pytestmark = pytest.mark.gpu


def shape_inputs(shape, seed=0, routing=RoutingPattern.RANDOM):
    return make_shape_inputs(shape, device="cuda", seed=seed, routing=routing)


@pytest.mark.parametrize("shape", [*SHAPES, SHAPES_BY_NAME["mok-small"],
                                   SHAPES_BY_NAME["sonicmoe-7b"]], ids=lambda s: s.name)
def test_real_shape_matches_reference_and_is_deterministic(shape):
    # The tuned shapes, and two outside the table with small experts (the tile rule's tiles).
    inputs = shape_inputs(shape, seed=1)
    y, grads, _, context = run_layer(inputs)
    y2, grads2, _, _ = run_layer(inputs)
    assert torch.equal(y, y2)
    for name, a, b in zip(GRAD_NAMES, grads, grads2, strict=True):
        assert (a is None and b is None) or torch.equal(a, b), name
    y_ref, grads_ref = moe_reference_grads(inputs, compute_dtype=torch.float32)
    assert_close(y, y_ref, dtype=torch.bfloat16, name="y")
    for name, actual, expected in zip(GRAD_NAMES, grads, grads_ref, strict=True):
        if expected is not None:
            assert_close(actual, expected, dtype=torch.bfloat16, name=name)
    # Saved for backward: the pre-activations only (C x 2I), at most (T*k + E*align) rows.
    assert context.h is None
    rows, width = context.gate_up.shape
    assert width == 2 * shape.intermediate_size
    assert rows <= shape.num_tokens * shape.topk + shape.num_experts * 128


@pytest.mark.parametrize("kept", [False, True], ids=["recompute", "kept"])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3]], ids=lambda s: s.name)
def test_real_shape_weights_in_other_layouts(shape, kept):
    # The tuned tiles (Gluon and TMA where the table says so) with weights those kernels cannot
    # take: torchtitan's transposed gate, up as the second half of a fused gate_up, down and the
    # shared weights as rows of wider tensors; the Triton kernels take them in place.
    from mok.testing.layouts import Layout, relayout

    inputs = shape_inputs(shape, seed=4)
    layouts = dict(w_routed_gate=Layout.TRANSPOSED, w_routed_up=Layout.ROW_SLICE,
                   w_routed_down=Layout.PADDED_ROWS, w_shared_gate=Layout.PADDED_ROWS,
                   w_shared_up=Layout.TRANSPOSED, w_shared_down=Layout.OFFSET)
    laid_out = dataclasses.replace(inputs, **{
        name: relayout(getattr(inputs, name), layout, second_half=name.endswith("_up"))
        for name, layout in layouts.items() if getattr(inputs, name) is not None})
    config = F.MoKConfig(recompute_gate_up=not kept)
    y, grads, _, _ = run_layer(laid_out, config=config)
    y_ref, grads_ref = moe_reference_grads(inputs, compute_dtype=torch.float32)
    assert_close(y, y_ref, dtype=torch.bfloat16, name="y")
    for name, actual, expected in zip(GRAD_NAMES, grads, grads_ref, strict=True):
        if expected is not None:
            assert_close(actual, expected, dtype=torch.bfloat16, name=name)
    y_again, grads_again, _, _ = run_layer(laid_out, config=config)
    assert torch.equal(y, y_again)
    for name, a, b in zip(GRAD_NAMES, grads, grads_again, strict=True):
        assert (a is None and b is None) or torch.equal(a, b), name


def test_skewed_routing_at_scale():
    shape = SHAPES[0]
    inputs = shape_inputs(shape, seed=2, routing=RoutingPattern.SKEWED)
    y, grads, _, _ = run_layer(inputs)
    y_ref, grads_ref = moe_reference_grads(inputs, compute_dtype=torch.float32)
    assert_close(y, y_ref, dtype=torch.bfloat16, name="y")
    for name, actual, expected in zip(GRAD_NAMES[:5], grads[:5], grads_ref[:5], strict=True):
        assert_close(actual, expected, dtype=torch.bfloat16, name=name)


def _step(config, workspace, inputs, limit, tiles=None):
    schedule = F.build_schedule(workspace, config, inputs.topk_experts,
                                num_local_experts=inputs.num_local_experts, tiles=tiles)
    y, context = F.forward(config, workspace, schedule, *inputs.layer_args, swiglu_limit=limit)
    grads = F.backward(config, workspace, schedule, context, inputs.d_output,
                       *inputs.layer_args, swiglu_limit=limit)
    return (y, *grads)


def _persistent_grouped_mm(tiles):
    """Every row GEMM persistent with its rows and weights through TMA, the weight gradients by
    torch._grouped_mm (the tuned table picks these at the real shapes)."""
    tiles = with_row_tiles(tiles, persistent=True, tma=True, tma_rows=True)
    return dataclasses.replace(tiles, wgrad=dataclasses.replace(tiles.wgrad, grouped_mm=True))


def _gluon_gate_up(tiles):
    """gate/up (and gate/up storing its pre-activations) by the Gluon kernel."""
    return dataclasses.replace(tiles, use_tuned=False, gate_up=RowTiles(
        128, 128, 64, group_m=8, num_warps=8, num_stages=4, gluon=True))


def _gluon_rows(tiles, wide=True):
    """gate/up, down and d_x by the Gluon kernels: down and d_x at 128 x 256 x 64 (down at 4
    stages, d_x at 2, each a K step's gate and up tiles; epilogues in halves, as the Triton
    kernels need them at these tiles) or, not wide, 128 x 128 x 64."""
    def gluon(block_n, stages, split=1):
        return RowTiles(128, block_n, 64, group_m=8, num_warps=8, num_stages=stages,
                        persistent=True, tma=True, tma_rows=True, epilogue_split=split,
                        gluon=True)

    down, d_x = ((gluon(256, 4, 2), gluon(256, 2, 2)) if wide
                 else (gluon(128, 4), gluon(128, 3)))
    return dataclasses.replace(_gluon_gate_up(tiles), down=down, d_x=d_x)


def _gluon_dswiglu(tiles, pingpong=False):
    """The dSwiGLU backward by the Gluon kernel: recomputing at 128 x 64 x 64 (3 stages), kept
    at down's tiles, 128 x 128 x 64 (4 stages; down by its Gluon kernel too). pingpong: 64-row
    tiles, two MMA partitions taking turns (DswigluTiles.pingpong): recomputing 64 x 64 x 64 (4
    stages), kept 64 x 128 x 64 (5 stages)."""
    def gluon(block_n, stages):
        return DswigluTiles(64 if pingpong else 128, block_n, 64, group_m=8,
                            num_warps=4 if pingpong else 8, num_stages=stages, persistent=True,
                            tma=True, tma_rows=True, gluon=True, pingpong=pingpong)

    def as_down(tiles):  # down's Gluon tiles, of the kept dSwiGLU's sizes
        fields = dataclasses.asdict(tiles)
        del fields["pingpong"], fields["apart"]
        return RowTiles(**fields)

    recompute, kept = (gluon(64, 4), gluon(128, 5)) if pingpong else (gluon(64, 3),
                                                                        gluon(128, 4))
    return dataclasses.replace(tiles, use_tuned=False, down_bwd=recompute, down=as_down(kept),
                               down_bwd_saved=kept)


def _gluon_dswiglu_pingpong(tiles):
    return _gluon_dswiglu(tiles, pingpong=True)


def _repeatable_and_close_to_reference(inputs, config, limit, tiles):
    """The layer with `tiles`, twice: bitwise the same both times and within bf16 tolerance of
    the reference. Returns the first run's (y, grads, schedule, context)."""
    first = run_layer(inputs, config=config, swiglu_limit=limit, tiles=tiles)
    y, grads = first[:2]
    y2, grads2, _, _ = run_layer(inputs, config=config, swiglu_limit=limit, tiles=tiles)
    assert torch.equal(y, y2)
    for name, a, b in zip(GRAD_NAMES, grads, grads2, strict=True):
        assert (a is None and b is None) or torch.equal(a, b), name
    y_ref, grads_ref = moe_reference_grads(inputs, swiglu_limit=limit,
                                           compute_dtype=torch.float32)
    assert_close(y, y_ref, dtype=torch.bfloat16, name="y")
    for name, actual, expected in zip(GRAD_NAMES, grads, grads_ref, strict=True):
        if expected is not None:
            assert_close(actual, expected, dtype=torch.bfloat16, name=name)
    return first


@pytest.mark.parametrize("limit", [None, 7.0], ids=["no_limit", "limit"])
@pytest.mark.parametrize("kept", [False, True], ids=["recompute", "kept"])
def test_gluon_gate_up_matches_reference_and_is_deterministic(kept, limit):
    # The warp-specialized Gluon gate/up kernel (RowTiles.gluon) inside the layer: against the
    # reference, the Triton kernel's results, and itself run to run; experts of uneven sizes,
    # one without rows, N not a multiple of the tile (I = 320).

    assert arch_of(torch.device("cuda")).warp_specialized, "these GPU tests expect an sm_90 GPU"
    inputs = make_inputs(6000, 1024, 320, 16, 4, shared_intermediate_size=256, device="cuda",
                         seed=6, routing=RoutingPattern.SKEWED)
    config = F.MoKConfig(recompute_gate_up=not kept)
    base = dataclasses.replace(ops.default_tiles(torch.device("cuda")), use_tuned=False)
    y, _, _, context = _repeatable_and_close_to_reference(inputs, config, limit,
                                                          _gluon_gate_up(base))
    y_triton, _, schedule, context_triton = run_layer(inputs, config=config,
                                                      swiglu_limit=limit, tiles=base)
    assert_close(y, y_triton, dtype=torch.bfloat16, name="y against the Triton kernel")
    if kept:  # the pre-activations, clamped ones as +-inf, as the Triton kernel keeps them
        used = int(schedule.routing.expert_offsets[-1])  # rows past it are never written
        mine, theirs = context.gate_up[:used], context_triton.gate_up[:used]
        assert torch.equal(mine.isinf(), theirs.isinf())
        finite = mine.isfinite()
        assert_close(mine[finite].float(), theirs[finite].float(), dtype=torch.bfloat16,
                     name="gate_up")


@pytest.mark.parametrize("limit", [None, 7.0], ids=["no_limit", "limit"])
@pytest.mark.parametrize("kept", [False, True], ids=["recompute", "kept"])
def test_gluon_gate_up_pulling_its_rows(kept, limit):
    # The Gluon gate/up pulling x's rows and router weights in a partition of its own (expert
    # parallelism), here a rank's own tokens from its own memory (mok.testing.pull): the rows
    # and weights land as they are at the source, and h (with the kept pre-activations) is
    # bitwise the kernel's reading x directly, in a second round too (new flags to wait on).
    # Experts of uneven sizes, one without rows, N not a multiple of the tile (I = 320).
    from mok.testing.pull import local_pull

    assert arch_of(torch.device("cuda")).warp_specialized, "these GPU tests expect an sm_90 GPU"
    inputs = make_inputs(6000, 1024, 320, 16, 4, device="cuda", seed=8,
                         routing=RoutingPattern.SKEWED)
    tiles = _gluon_gate_up(dataclasses.replace(ops.default_tiles(torch.device("cuda")),
                                               use_tuned=False))
    _, _, schedule, _ = run_layer(inputs, tiles=tiles)
    routing = schedule.routing
    x, w_gate, w_up = inputs.x, inputs.w_routed_gate, inputs.w_routed_up

    def gate_up(rows, pull=None):
        kept_rows = ops.gate_up_buffer(rows, w_gate, routing) if kept else None
        h = ops.gate_up_swiglu(rows, w_gate, w_up, routing, tiles.gate_up, limit, pull=pull,
                               gate_up=kept_rows)
        return h, kept_rows

    h, kept_rows = gate_up(x)
    used = int(routing.expert_offsets[-1])  # rows past it are never written
    pulled = local_pull(x, routing, inputs.router_weights)
    for round_ in range(2):
        if round_:
            pulled.rows.zero_()
            pulled.weights.zero_()
            pulled.next_round()
        h_pulled, kept_pulled = gate_up(pulled.rows, pulled.pull)
        torch.cuda.synchronize()
        assert int(pulled.pull.peer.errors.abs().sum()) == 0
        assert torch.equal(pulled.rows, x)  # every token has a route here
        assert torch.equal(pulled.weights, inputs.router_weights.reshape(-1))
        assert torch.equal(h_pulled[:used], h[:used]), round_
        if kept:
            assert torch.equal(kept_pulled[:used], kept_rows[:used]), round_


@pytest.mark.parametrize("kept", [False, True], ids=["recompute", "kept"])
def test_gluon_kernels_waiting_on_copied_rows(kept):
    # Rows moved by copies (MoKConfig.fwd_copy_rows / bwd_copy_rows), here one device's tokens
    # as if from two ranks (mok.testing.pull.local_copied): the Gluon gate/up and dSwiGLU wait on
    # each rank's landed flag and take their row blocks local first (of all used blocks or of
    # the first half) or in schedule order. The second rank's flag is raised before the launch
    # or by a side stream after a copy on the copy engines while the kernel runs, written by the
    # stream (cuStreamWriteValue32) or by a copy from pinned host memory (as the layer does);
    # every result is bitwise the kernel's with no waits, no wait times out. Experts of uneven
    # sizes, I = 352.
    from mok.testing.pull import local_copied

    assert arch_of(torch.device("cuda")).warp_specialized, "these GPU tests expect an sm_90 GPU"
    inputs = make_inputs(6000, 1344, 352, 16, 4, device="cuda", seed=10,
                         routing=RoutingPattern.SKEWED)
    base = dataclasses.replace(ops.default_tiles(torch.device("cuda")), use_tuned=False)
    tiles = _gluon_dswiglu(_gluon_gate_up(base))
    _, _, schedule, _ = run_layer(inputs, tiles=tiles)
    routing = schedule.routing
    used = int(routing.expert_offsets[-1])  # rows past it are never written
    x, d_out, rw = inputs.x, inputs.d_output, inputs.router_weights
    w_gate, w_up, w_down = inputs.routed_weights
    kept_rows = ops.gate_up_buffer(x, w_gate, routing) if kept else None
    h_tiles = tiles.pick("gate_up_saved" if kept else "gate_up", 352, 1344)
    bwd_tiles = tiles.pick("down_bwd_saved" if kept else "down_bwd", 352, 1344)
    assert h_tiles.gluon and bwd_tiles.gluon

    def gate_up(pull=None):
        rows = ops.gate_up_buffer(x, w_gate, routing) if kept else None
        h = ops.gate_up_swiglu(x, w_gate, w_up, routing, h_tiles, None, pull=pull,
                               gate_up=rows)
        return [h[:used]] + ([rows[:used]] if kept else [])

    h = ops.gate_up_swiglu(x, w_gate, w_up, routing, h_tiles, None, gate_up=kept_rows)

    def dswiglu(pull=None):
        out = torch.zeros_like(h) if kept else h
        d_gate_up, partial = ops.down_bwd_dswiglu(
            d_out, x, w_down, w_gate, w_up, out, routing, bwd_tiles, rw, None, pull=pull,
            gate_up=kept_rows, h_out=kept)
        return [d_gate_up[:used], partial[:used]] + ([out[:used]] if kept else [])

    late = torch.cuda.Stream()
    src = torch.randn(1 << 24, pin_memory=True)
    dst = torch.empty(1 << 24, device="cuda")
    for name, run, block_m in (("gate/up", gate_up, h_tiles.block_m),
                               ("dswiglu", dswiglu, bwd_tiles.block_m)):
        expected = run()
        for lead in (1.0, 0.5, None):
            moved = local_copied(x, routing, block_m, lead=lead)
            order = moved.pull.order.long()
            assert torch.equal(order.sort().values, torch.arange(order.numel(), device="cuda"))
            for landing in ("before", "late", "late, flag by a copy"):
                if landing == "before":
                    moved.land()
                else:
                    moved.land(late, (dst, src), flag_by_copy=landing.endswith("copy"))
                actual = run(moved.pull)
                torch.cuda.current_stream().wait_stream(late)
                torch.cuda.synchronize()
                assert int(moved.pull.peer.errors.abs().sum()) == 0, (name, landing)
                assert torch.equal(moved.landed, torch.ones_like(moved.landed))
                for a, b in zip(actual, expected, strict=True):
                    assert torch.equal(a, b), (name, lead, landing)


@pytest.mark.parametrize("wide", [True, False], ids=["128x256", "128x128"])
def test_gluon_rows_scatter_their_rows(wide):
    # The Gluon down and d_x writing each row into its token's rank's combine buffer (expert
    # parallelism; here one rank, every delta 0): each route's row lands at the route (out
    # starts as NaN), bitwise the row the kernel writes in schedule order. H = 1344 is no
    # multiple of the tiles.
    from mok.ops import comm
    from mok.testing.pull import local_pull

    assert arch_of(torch.device("cuda")).warp_specialized, "these GPU tests expect an sm_90 GPU"
    inputs = make_inputs(6000, 1344, 320, 16, 4, device="cuda", seed=9,
                         routing=RoutingPattern.SKEWED)
    tiles = _gluon_rows(dataclasses.replace(ops.default_tiles(torch.device("cuda")),
                                            use_tuned=False), wide)
    _, _, schedule, context = run_layer(inputs, config=F.MoKConfig(recompute_gate_up=True),
                                        tiles=tiles)
    routing = schedule.routing
    routes = inputs.x.shape[0] * inputs.topk_experts.shape[1]
    scheduled = routing.route_row >= 0
    assert scheduled.all()  # one rank, dropless: every route has its row
    d_gate_up = torch.randn(routing.capacity_rows, 2 * 320, device="cuda",
                            dtype=torch.bfloat16)
    weights = inputs.router_weights.reshape(-1)
    for name, run in (
        ("down", lambda scatter: ops.down_proj(context.h, inputs.w_routed_down, routing,
                                               tiles.down, weights, scatter=scatter)),
        ("d_x", lambda scatter: ops.d_x_rows(d_gate_up, inputs.w_routed_gate,
                                             inputs.w_routed_up, routing, tiles.d_x,
                                             scatter=scatter)),
    ):
        rows = run(None)
        out = torch.full((routes, 1344), float("nan"), device="cuda", dtype=torch.bfloat16)
        scatter = comm.ScatterRows(out, torch.zeros(1, dtype=torch.int64, device="cuda"),
                                   routing.row_route, routes)
        assert run(scatter) is out
        assert torch.equal(out, rows[routing.route_row.long()]), name
    # d_x also pulling token rows for a later kernel (x for the weight gradients, with kept
    # pre-activations) in a partition of its own: they land whole, d_x's rows unchanged.
    pulled = local_pull(inputs.x, routing)
    out.fill_(float("nan"))
    ops.d_x_rows(d_gate_up, inputs.w_routed_gate, inputs.w_routed_up, routing, tiles.d_x,
                 scatter=scatter, pull=pulled.pull, pulled=pulled.rows)
    torch.cuda.synchronize()
    assert int(pulled.pull.peer.errors.abs().sum()) == 0
    assert torch.equal(pulled.rows, inputs.x)
    assert torch.equal(out, rows[routing.route_row.long()])


@pytest.mark.parametrize("wide", [True, False], ids=["128x256", "128x128"])
def test_gluon_rows_match_reference_and_are_deterministic(wide, monkeypatch):
    # The warp-specialized Gluon down and d_x kernels inside the layer: against the reference,
    # the Triton kernels' results at the same tiles, and themselves run to run. H = 1344 is no
    # multiple of the tiles (the stores clip); the shared expert's I = 288 is no multiple of
    # block_k: its down projection reads TMA's zero fill past K, its d_x runs the Triton kernel.
    from mok.ops import experts

    assert arch_of(torch.device("cuda")).warp_specialized, "these GPU tests expect an sm_90 GPU"
    launches = []

    def counted(name):
        launch = getattr(experts, name)

        def run(*args):
            launches.append(name)
            return launch(*args)
        return run

    for name in ("_down_gluon", "_d_x_gluon"):
        monkeypatch.setattr(experts, name, counted(name))
    inputs = make_inputs(6000, 1344, 320, 16, 4, shared_intermediate_size=288, device="cuda",
                         seed=7, routing=RoutingPattern.SKEWED)
    base = dataclasses.replace(ops.default_tiles(torch.device("cuda")), use_tuned=False)
    tiles = _gluon_rows(base, wide)
    y, grads, _, _ = _repeatable_and_close_to_reference(inputs, None, 7.0, tiles)
    # routed down, shared down, routed d_x (the shared one's I is no multiple of block_k), in
    # each of the two runs
    assert sorted(launches) == 2 * ["_d_x_gluon"] + 4 * ["_down_gluon"]
    triton_tiles = with_row_tiles(tiles, gluon=False)
    y_triton, grads_triton, _, _ = run_layer(inputs, swiglu_limit=7.0, tiles=triton_tiles)
    assert_close(y, y_triton, dtype=torch.bfloat16, name="y against the Triton kernels")
    for name, actual, expected in zip(GRAD_NAMES, grads, grads_triton, strict=True):
        if expected is not None:
            assert_close(actual, expected, dtype=torch.bfloat16,
                         name=f"{name} against the Triton kernels")


def _gluon_dswiglu_launches(monkeypatch) -> list:
    """The Gluon dSwiGLU kernel's launches from here on (their first operand's shape)."""
    from mok.ops import experts

    launches = []
    launch = experts._down_bwd_gluon

    def counted(*args):
        launches.append(args[0].shape)
        return launch(*args)

    monkeypatch.setattr(experts, "_down_bwd_gluon", counted)
    return launches


def _dswiglu_inputs(seed):
    """I = 352 and the shared expert's 288: no multiples of block_n; skewed routing."""
    return make_inputs(6000, 1344, 352, 16, 4, shared_intermediate_size=288, device="cuda",
                       seed=seed, routing=RoutingPattern.SKEWED)


@pytest.mark.parametrize("pingpong", [False, True], ids=["one_mma", "pingpong"])
@pytest.mark.parametrize("limit", [None, 7.0], ids=["no_limit", "limit"])
@pytest.mark.parametrize("kept", [False, True], ids=["recompute", "kept"])
def test_gluon_dswiglu_matches_reference_and_is_deterministic(kept, limit, pingpong,
                                                              monkeypatch):
    # The warp-specialized Gluon dSwiGLU kernel (recomputing, or reading the kept
    # pre-activations and writing h) inside the layer, the shared expert's launch included:
    # against the reference, itself run to run, and the Triton kernel at the same tiles (the
    # router-weight gradients among the layer's, then the routed experts' d_gate_up, partial
    # sums and kept h directly). I = 352 and the shared expert's 288 are no multiples of
    # block_n (the stores clip, TMA zero-fills the weight and pre-activation tiles past I).
    # pingpong: two MMA partitions take every other tile of a CTA, each CTA several.

    assert arch_of(torch.device("cuda")).warp_specialized, "these GPU tests expect an sm_90 GPU"
    launches = _gluon_dswiglu_launches(monkeypatch)
    inputs = _dswiglu_inputs(seed=8)
    config = F.MoKConfig(recompute_gate_up=not kept)
    base = dataclasses.replace(ops.default_tiles(torch.device("cuda")), use_tuned=False)
    tiles = _gluon_dswiglu(base, pingpong)
    y, grads, schedule, context = _repeatable_and_close_to_reference(inputs, config, limit,
                                                                     tiles)
    assert len(launches) == 4  # routed and shared experts, in each of the two runs
    triton_tiles = with_row_tiles(tiles, gluon=False)
    _, grads_triton, _, _ = run_layer(inputs, config=config, swiglu_limit=limit,
                                      tiles=triton_tiles)
    for name, actual, expected in zip(GRAD_NAMES, grads, grads_triton, strict=True):
        if expected is not None:
            assert_close(actual, expected, dtype=torch.bfloat16,
                         name=f"{name} against the Triton kernel")

    routing = schedule.routing
    used = int(routing.expert_offsets[-1])  # rows past it are never written
    w_gate, w_up, w_down = inputs.routed_weights
    kind = "down_bwd_saved" if kept else "down_bwd"

    def backward(tile_config):
        h = context.h
        if kept:  # written by the kernel
            h = torch.zeros(routing.capacity_rows, 352, dtype=torch.bfloat16, device="cuda")
        d_gate_up, partial = ops.down_bwd_dswiglu(
            inputs.d_output, inputs.x, w_down, w_gate, w_up, h, routing,
            tile_config.pick(kind, 352, 1344), inputs.router_weights, limit,
            gate_up=context.gate_up, h_out=kept)
        return d_gate_up[:used], partial[:used], h[:used]

    mine, theirs = backward(tiles), backward(triton_tiles)
    assert len(launches) == 5  # the two layers' four, then this one
    names = ("d_gate_up", "partial sums", "h") if kept else ("d_gate_up", "partial sums")
    for name, a, b in zip(names, mine, theirs, strict=False):  # h: the kept form's output
        assert torch.isfinite(a).all(), name
        assert_close(a.float(), b.float(), dtype=torch.bfloat16,
                     name=f"{name} against the Triton kernel")


@pytest.mark.parametrize("block_m", [256, 128])
def test_gluon_wgrad_matches_reference_and_the_triton_kernel(block_m, monkeypatch):
    # The warp-specialized Gluon weight gradients (WgradTiles.gluon: gate/up's, and down's with
    # the rows of d_output scaled by the router weights, its tiles transposed) inside the
    # layer, the shared expert's included: against the reference, themselves run to run, and the
    # Triton kernel; skewed routing (experts of uneven sizes, some without rows, whose tiles
    # write zeros). Then alone, over a d_gate_up and an h whose rows past the used ones are NaN:
    # no row past an expert's own is read into its sums.
    from mok.ops import experts

    assert arch_of(torch.device("cuda")).warp_specialized, "these GPU tests expect an sm_90 GPU"
    launches = []
    launch = experts._wgrad_gluon

    def counted(*args):
        launches.append("gate_up" if args[5] is not None else "down")
        return launch(*args)

    monkeypatch.setattr(experts, "_wgrad_gluon", counted)
    inputs = make_inputs(6000, 1536, 512, 16, 4, shared_intermediate_size=256, device="cuda",
                         seed=9, routing=RoutingPattern.SKEWED)
    base = dataclasses.replace(ops.default_tiles(torch.device("cuda")), use_tuned=False)
    # gate/up's tiles: block_m along I; down's (block_m along H, block_n along I) the same sizes
    gluon = WgradTiles(block_m, 128, 64, group_m=1, num_warps=8,
                       num_stages=3 if block_m == 256 else 4, gluon=True)
    triton = WgradTiles(128, 128, 64, group_m=1, num_warps=8, num_stages=3, pair=True)
    _, grads, schedule, _ = _repeatable_and_close_to_reference(
        inputs, None, None, dataclasses.replace(base, wgrad=gluon))
    # routed and shared experts, gate/up's and down's, in each of the two runs
    assert sorted(launches) == 4 * ["down"] + 4 * ["gate_up"]
    _, grads_triton, _, _ = run_layer(inputs, tiles=dataclasses.replace(base, wgrad=triton))
    for name, actual, expected in zip(GRAD_NAMES, grads, grads_triton, strict=True):
        if expected is not None:
            assert_close(actual, expected, dtype=torch.bfloat16,
                         name=f"{name} against the Triton kernel")

    routing = schedule.routing
    used = int(routing.expert_offsets[-1])
    padding = routing.row_route < 0

    def rows(width):  # padding rows hold zeros, as the kernels write them; past used: NaN
        t = torch.randn(routing.capacity_rows, width, device="cuda").to(torch.bfloat16)
        t[padding] = 0
        t[used:] = float("nan")
        return t

    d_gate_up, h = rows(1024), rows(512)
    route_weights = inputs.router_weights.reshape(-1)
    bf16 = dict(out_dtype=torch.bfloat16)
    for kind, run in (
            ("gate_up", lambda t: ops.grouped_wgrad_gate_up(d_gate_up, inputs.x, routing, t,
                                                            gather_x=True, **bf16)),
            ("down", lambda t: (ops.grouped_wgrad(inputs.d_output, h, routing, t,
                                                  gather_a=True, gather_b=False,
                                                  router_weights=route_weights, **bf16),))):
        mine, theirs = run(gluon), run(dataclasses.replace(triton, pair=kind == "gate_up"))
        assert launches[-1] == kind
        for a, b in zip(mine, theirs, strict=True):
            assert torch.isfinite(a).all(), kind
            assert_close(a.float(), b.float(), dtype=torch.bfloat16,
                         name=f"{kind} alone against the Triton kernel")


@pytest.mark.parametrize("limit", [None, 7.0], ids=["no_limit", "limit"])
def test_gluon_dswiglu_apart_equals_the_kept_backward(limit, monkeypatch):
    # DswigluTiles.apart by the Gluon kernels: gate/up storing the pre-activations into the
    # d_gate_up buffer, then the kept dSwiGLU reading them and writing their gradients in
    # place (each tile's pre-activations land by TMA before its gradients are stored there).
    # Bitwise the backward of a forward that kept its pre-activations, but the down weights'
    # gradients; repeatable and within tolerance of the reference.
    launches = _gluon_dswiglu_launches(monkeypatch)
    inputs = _dswiglu_inputs(seed=9)
    base = dataclasses.replace(ops.default_tiles(torch.device("cuda")), use_tuned=False)
    tiles = _gluon_dswiglu(_gluon_gate_up(base))
    tiles = dataclasses.replace(tiles, down_bwd=dataclasses.replace(tiles.down_bwd, apart=True))
    _, grads, _, context = _repeatable_and_close_to_reference(
        inputs, F.MoKConfig(recompute_gate_up=True), limit, tiles)
    assert context.gate_up is None
    assert len(launches) == 4  # the kept dSwiGLU by Gluon: routed and shared, twice
    kept = F.MoKConfig(recompute_gate_up=False)
    _, kept_grads, _, _ = run_layer(inputs, config=kept, swiglu_limit=limit, tiles=tiles)
    for name, a, b in zip(GRAD_NAMES, grads, kept_grads, strict=True):
        if not name.endswith("_down"):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("kept", [False, True], ids=["recompute", "kept"])
def test_flattened_tile_loops_equal_persistent_tiles(kept):
    # RowTiles.flatten compiles each program's tile loop and K loop into one pipelined loop
    # (the interpreter runs them as written): the same sums in the same order, so bitwise what
    # the persistent tiles give, on several tiles per program.
    inputs = make_inputs(8192, 1024, 768, 32, 4, shared_intermediate_size=512, device="cuda",
                         seed=5)
    config = F.MoKConfig(recompute_gate_up=not kept)
    tiles = with_row_tiles(ops.default_tiles(torch.device("cuda")), persistent=True, tma=True,
                           tma_rows=True)
    tiles = dataclasses.replace(tiles, use_tuned=False)
    y, grads, _, _ = run_layer(inputs, config=config, swiglu_limit=7.0, tiles=tiles)
    y_flat, grads_flat, _, _ = run_layer(inputs, config=config, swiglu_limit=7.0,
                                         tiles=with_row_tiles(tiles, flatten=True))
    assert torch.equal(y, y_flat)
    for name, a, b in zip(GRAD_NAMES, grads, grads_flat, strict=True):
        assert (a is None and b is None) or torch.equal(a, b), name


@pytest.mark.parametrize(("recompute_gate_up", "variant"),
                         [(True, None), (False, None), (False, _persistent_grouped_mm),
                          (True, _gluon_gate_up), (False, _gluon_gate_up),
                          (True, _gluon_rows), (False, _gluon_rows),
                          (True, _gluon_dswiglu), (False, _gluon_dswiglu),
                          (False, _gluon_dswiglu_pingpong)],
                         ids=["recompute", "kept_gate_up", "kept_persistent_grouped_mm",
                              "gluon_gate_up", "kept_gluon_gate_up", "gluon_rows",
                              "kept_gluon_rows", "gluon_dswiglu", "kept_gluon_dswiglu",
                              "kept_gluon_dswiglu_pingpong"])
def test_no_host_sync_and_cuda_graph_replay_matches_eager(recompute_gate_up, variant):
    config = F.MoKConfig(recompute_gate_up=recompute_gate_up)
    tiles = variant(ops.default_tiles(torch.device("cuda"))) if variant else None
    _check_sync_free_and_graph_replay(config, tiles)


@pytest.mark.parametrize(("recompute_gate_up", "fp8_weight_gradients"),
                         [(True, False), (False, False), (False, True)],
                         ids=["recompute", "kept", "kept_fp8_weight_gradients"])
def test_fp8_no_host_sync_and_cuda_graph_replay_matches_eager(recompute_gate_up,
                                                              fp8_weight_gradients):
    # MoKConfig(precision="fp8"): the captured step quantizes the weights it reads, so a replay
    # after the weights changed follows them, and an eager call after the graph too.
    _check_sync_free_and_graph_replay(
        F.MoKConfig(recompute_gate_up=recompute_gate_up, precision="fp8",
                    fp8_weight_gradients=fp8_weight_gradients), None,
        changed=("w_routed_down", "w_shared_up"))


def test_fp8_captured_step_quantizes_each_weight_once(monkeypatch):
    # The driver names each capture (mok.ops.graphs), so a captured FP8 step quantizes each
    # group of experts' weights once: its backward reuses its forward's copy. The replay equals
    # the eager step.
    import mok.ops.fp8 as fp8
    from mok.ops import graphs

    config = F.MoKConfig(precision="fp8")
    inputs = make_inputs(3000, 512, 256, 16, 4, shared_intermediate_size=256, device="cuda",
                         seed=5)
    workspace = F.create_workspace(config, None, device="cuda", num_local_tokens=3000,
                                   hidden_size=512, topk=4)
    calls, ids = [], []
    quantize = fp8.quantize_experts
    monkeypatch.setattr(fp8, "quantize_experts", lambda *a, **k: calls.append(1) or
                        quantize(*a, **k))

    def step():
        ids.append(graphs.capture_id())
        return _step(config, workspace, inputs, 7.0)

    eager, graph, captured = eager_and_captured(step)
    assert ids[:3] == [None] * 3 and ids[3] is not None  # the eager calls, then the capture
    assert len(calls) == 2 + 2  # the first eager call's (then cached), the capture's
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured, strict=True):
        assert torch.equal(a, b)
    second = torch.cuda.CUDAGraph()
    with torch.cuda.graph(second):
        step()
    assert ids[4] not in (None, ids[3])


def _check_sync_free_and_graph_replay(config, tiles, changed=()):
    """A layer step without host sync, captured in a CUDA graph: the replay equals the eager
    step, and after new values and new routing are copied into the same buffers (x, routing,
    d_output, w_routed_gate and `changed`) it equals an eager step on them."""
    inputs = make_inputs(3000, 512, 256, 16, 4, shared_intermediate_size=256, device="cuda",
                         seed=3)
    workspace = F.create_workspace(config, None, device="cuda", num_local_tokens=3000,
                                   hidden_size=512, topk=4)
    eager, graph, captured = eager_and_captured(
        lambda: _step(config, workspace, inputs, 7.0, tiles))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured, strict=True):
        assert torch.equal(a, b)
    fresh = make_inputs(3000, 512, 256, 16, 4, shared_intermediate_size=256, device="cuda",
                        seed=4, routing=RoutingPattern.SKEWED)
    for name in ("x", "topk_experts", "router_weights", "d_output", "w_routed_gate", *changed):
        getattr(inputs, name).copy_(getattr(fresh, name))
    graph.replay()
    torch.cuda.synchronize()
    expected = _step(config, workspace, inputs, 7.0, tiles)
    for a, b in zip(expected, captured, strict=True):
        assert torch.equal(a, b)
    F.check_errors(workspace)


@pytest.mark.parametrize(("shape", "fp8_weight_gradients"),
                         [(SHAPES_BY_NAME["qwen3-30b-a3b"], False),
                          (SHAPES_BY_NAME["kimi-ep64-slice"], False),
                          (SHAPES_BY_NAME["deepseek-v2-lite"], False),
                          (SHAPES_BY_NAME["qwen3-30b-a3b"], True),
                          (SHAPES_BY_NAME["mixtral-8x7b"], True)],
                         ids=["qwen3-30b-a3b", "kimi-ep64-slice", "deepseek-v2-lite",
                              "qwen3-30b-a3b-fp8_weight_gradients",
                              "mixtral-8x7b-fp8_weight_gradients"])
def test_fp8_real_shape_is_deterministic_and_within_fp8_tolerance(shape, fp8_weight_gradients):
    inputs = shape_inputs(shape, seed=1)
    config = F.MoKConfig(precision="fp8", fp8_weight_gradients=fp8_weight_gradients)
    y, grads, _, context = run_layer(inputs, config=config)
    y2, grads2, _, _ = run_layer(inputs, config=config)
    assert torch.equal(y, y2)
    for name, a, b in zip(GRAD_NAMES, grads, grads2, strict=True):
        assert (a is None and b is None) or torch.equal(a, b), name
    assert context.h is None and context.gate_up is not None  # the default keeps gate/up
    y_ref, grads_ref = moe_reference_grads(inputs, compute_dtype=torch.float32)
    assert_close(y, y_ref, dtype=torch.bfloat16, name="y", tolerance=FP8_TOLERANCE)
    for name, actual, expected in zip(GRAD_NAMES, grads, grads_ref, strict=True):
        if expected is not None:
            assert_close(actual, expected, dtype=torch.bfloat16, name=name,
                         tolerance=FP8_TOLERANCE)


def test_landed_flags_reach_tiles_that_hold_every_sm():
    """The copied rows' landed flags are copies from pinned host memory (the copy engines): they
    reach programs spinning on every SM (a flag written by a kernel, or a copy within one GPU,
    waits for an SM: scripts/copy_progress.py)."""
    from mok.testing.progress import flag_reaches_spinners, spinners_per_sm

    flag = torch.zeros(1, device="cuda", dtype=torch.int64)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.zeros(2 * sms, device="cuda", dtype=torch.int64)  # at most 2 an SM
    every_sm = out[:spinners_per_sm(flag, out) * sms]
    ones = torch.ones(1, dtype=torch.int64).pin_memory()
    arrived, ms = flag_reaches_spinners(lambda f: f.copy_(ones, non_blocking=True), flag,
                                        every_sm, timeout_s=2.0)
    assert arrived == every_sm.numel() and ms < 1000.0, (arrived, ms)


def test_router_bias_history_never_waits_for_the_gpu():
    """mok.nn.MoE with the sigmoid router's bias update under activation checkpointing: two
    training forwards, then one backward that recomputes both (each finding its own bias on
    the device), with no host sync; the gradients equal the module run plainly."""
    from mok.nn import MoE, RouterConfig, RouterScoring

    torch.manual_seed(0)
    router = RouterConfig(scoring=RouterScoring.SIGMOID, bias_update_rate=5e-2)
    plain = MoE(256, 128, 8, 2, router=router, device="cuda", dtype=torch.bfloat16)
    checkpointed = MoE(256, 128, 8, 2, router=router, device="cuda", dtype=torch.bfloat16)
    checkpointed.load_state_dict(plain.state_dict())
    xs = [torch.randn(512, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2)]

    def step(module, checkpoint):
        module.zero_grad(set_to_none=True)
        ys = [torch.utils.checkpoint.checkpoint(module, x, use_reentrant=False) if checkpoint
              else module(x) for x in xs]
        sum(y.float().square().mean() for y in ys).backward()
        return [p.grad.clone() for p in module.parameters()]

    step(checkpointed, True)  # compiles the kernels
    step(plain, False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = step(checkpointed, True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    expected = step(plain, False)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
