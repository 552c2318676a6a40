"""The fused layer (forward and backward) against the reference, plus its properties."""

import dataclasses
from dataclasses import dataclass

import pytest
import torch

import mok.functional as F
from mok import ops, plan
from mok.errors import MoKInputError
from mok.testing import (
    GRAD_NAMES,
    RoutingPattern,
    assert_close,
    make_inputs,
    moe_reference_grads,
    programs_last_first,
)

from ..conftest import DEVICE, run_layer, tiles_for_tests, with_row_tiles, with_tma_rows

REF_DTYPE = torch.float32 if DEVICE.type == "cuda" else torch.float64


@dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    hidden: int
    intermediate: int
    experts: int
    topk: int
    shared: int = 0
    dtype: torch.dtype = torch.bfloat16
    routing: RoutingPattern = RoutingPattern.RANDOM
    limit: float | None = None
    block: int = 16
    align: int | None = None
    seed: int = 0

    def inputs(self):
        return make_inputs(self.tokens, self.hidden, self.intermediate, self.experts, self.topk,
                           shared_intermediate_size=self.shared, dtype=self.dtype,
                           device=DEVICE, seed=self.seed, routing=self.routing)

    def schedule(self, inputs, config, tiles):
        """A workspace for this case and the schedule of `inputs` in it."""
        workspace = F.create_workspace(config, None, device=DEVICE, num_local_tokens=self.tokens,
                                       hidden_size=self.hidden, topk=self.topk)
        return F.build_schedule(workspace, config, inputs.topk_experts,
                                num_local_experts=inputs.num_local_experts, tiles=tiles)


CASES = [
    Case("base", 40, 48, 32, 6, 3, seed=1),
    Case("shared_and_limit", 37, 64, 48, 5, 2, shared=24, limit=0.8, seed=2),
    Case("fp16_duplicate_experts", 33, 32, 16, 4, 4, shared=16, dtype=torch.float16,
         routing=RoutingPattern.DUPLICATES, seed=3),
    Case("skewed_block16_align32", 50, 40, 24, 8, 2, routing=RoutingPattern.SKEWED, align=32,
         seed=4),
    Case("expert_without_tokens", 24, 32, 32, 5, 2, routing=RoutingPattern.EMPTY_EXPERT, seed=5),
    Case("every_token_on_one_expert", 30, 32, 16, 4, 2, routing=RoutingPattern.ONE_EXPERT,
         seed=6),
    Case("topk_1", 29, 32, 32, 4, 1, shared=16, seed=7),
    Case("one_expert_in_all", 21, 32, 16, 1, 1, seed=8),
    Case("smallest_hidden_and_intermediate", 19, 8, 8, 3, 2, shared=8, limit=1.0, seed=9),
    Case("one_token", 1, 16, 16, 4, 2, shared=8, seed=10),
    Case("block32", 45, 72, 40, 3, 2, shared=24, block=32, seed=11),
]


def check_against_reference(case: Case, y, grads):
    inputs = case.inputs()
    y_ref, grads_ref = moe_reference_grads(inputs, swiglu_limit=case.limit,
                                           compute_dtype=REF_DTYPE)
    assert_close(y, y_ref, dtype=case.dtype, name="y")
    for name, actual, expected in zip(GRAD_NAMES, grads, grads_ref, strict=True):
        if expected is None:
            assert actual is None, name
            continue
        assert actual.dtype == (torch.float32 if name == "d_router_weights" else case.dtype)
        assert_close(actual, expected, dtype=case.dtype, name=name)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_layer_matches_reference(case):
    y, grads, schedule, _ = run_layer(case.inputs(), swiglu_limit=case.limit,
                                      tiles=tiles_for_tests(case.block, case.align))
    check_against_reference(case, y, grads)
    counts = torch.bincount(case.inputs().topk_experts.reshape(-1).cpu(),
                            minlength=case.experts)
    assert torch.equal(schedule.expert_counts.cpu().long(), counts)
    if case.routing is RoutingPattern.EMPTY_EXPERT:
        for grad in grads[2:5]:
            assert bool((grad[-1] == 0).all()), "an expert without tokens gets zero gradients"


def test_layer_is_bitwise_deterministic():
    case = Case("determinism", 64, 48, 32, 6, 3, shared=16, limit=1.5, seed=12)
    tiles = tiles_for_tests(16)
    first = run_layer(case.inputs(), swiglu_limit=case.limit, tiles=tiles)
    for _ in range(2):
        again = run_layer(case.inputs(), swiglu_limit=case.limit, tiles=tiles)
        assert torch.equal(first[0], again[0])
        for name, a, b in zip(GRAD_NAMES, first[1], again[1], strict=True):
            assert torch.equal(a, b), name
        assert torch.equal(first[2].routing.row_route, again[2].routing.row_route)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="orders the programs of Triton's interpreter")
@pytest.mark.parametrize("persistent", [False, True], ids=["tile_per_program", "persistent"])
def test_layer_does_not_depend_on_the_order_programs_start_in(persistent):
    # Every launch's programs run last-first (a GPU starts them in an order of its choosing):
    # the same results bitwise (routing, GEMMs, combine, weight gradients).
    case = Case("last_first", 40, 32, 32, 4, 2, shared=16, limit=1.5, seed=13)
    tiles = tiles_for_tests(16)
    if persistent:
        tiles = _persistent_wgrad(with_row_tiles(tiles, persistent=True))
    first = run_layer(case.inputs(), swiglu_limit=case.limit, tiles=tiles)
    with programs_last_first():
        again = run_layer(case.inputs(), swiglu_limit=case.limit, tiles=tiles)
    assert torch.equal(first[0], again[0])
    for name, a, b in zip(GRAD_NAMES, first[1], again[1], strict=True):
        assert (a is None and b is None) or torch.equal(a, b), name


def _persistent_wgrad(tiles):
    return dataclasses.replace(tiles, wgrad=dataclasses.replace(tiles.wgrad, persistent=True))


def _tma_weights(tiles):
    return with_row_tiles(tiles, tma=True)


def _paired_wgrad(tiles):
    return dataclasses.replace(tiles, wgrad=dataclasses.replace(tiles.wgrad, pair=True))


def _paired_persistent_wgrad(tiles):
    return _persistent_wgrad(_paired_wgrad(tiles))


def _persistent_rows(tiles):
    return with_row_tiles(tiles, persistent=True)


def _persistent_tma(tiles):
    return with_row_tiles(tiles, persistent=True, tma=True, tma_rows=True)


def _flattened(tiles):
    # (The interpreter runs the flattened loop nest as written: this checks the plumbing; the
    # compiled loop is compared on the GPU, tests/gpu/test_gpu.py.)
    return with_row_tiles(tiles, persistent=True, tma=True, tma_rows=True, flatten=True)


@pytest.mark.parametrize("variant",
                         [_persistent_wgrad, _tma_weights, with_tma_rows, _paired_wgrad,
                          _paired_persistent_wgrad, _persistent_rows, _persistent_tma,
                          _flattened],
                         ids=["persistent_wgrad", "tma_weights", "tma_rows", "paired_wgrad",
                              "paired_persistent_wgrad", "persistent_rows", "persistent_tma",
                              "flattened"])
@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[8]], ids=lambda c: c.name)
def test_tile_variants_equal_plain_tiles(case, variant):
    # The same tiles summed in the same order, only loaded or scheduled differently: bitwise
    # equal results. Covers an expert without rows (its tiles still write zeros) and
    # widths below one tile (rows past N of the TMA boxes belong to the next expert).
    base = tiles_for_tests(case.block) or ops.default_tiles(DEVICE)
    plain = dataclasses.replace(base, use_tuned=False)
    y, grads, _, _ = run_layer(case.inputs(), swiglu_limit=case.limit, tiles=plain)
    y_variant, grads_variant, _, _ = run_layer(case.inputs(), swiglu_limit=case.limit,
                                               tiles=variant(plain))
    assert torch.equal(y, y_variant)
    for name, a, b in zip(GRAD_NAMES, grads, grads_variant, strict=True):
        assert (a is None and b is None) or torch.equal(a, b), name
    check_against_reference(case, y_variant, grads_variant)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on an sm_90 GPU the Gluon kernel runs: "
                    "tests/gpu/test_gpu.py")
@pytest.mark.parametrize("kept", [False, True], ids=["recompute", "kept"])
def test_gluon_tiles_run_the_triton_kernel_off_sm90(kept):
    # RowTiles.gluon asks for the warp-specialized Gluon kernels of gate/up, down, the
    # dSwiGLU backward (recomputing, or kept: down's tiles) and d_x, which only an sm_90 GPU runs
    # (compiled for sm_90 by tests/ops/test_sm90_compile.py, checked on the GPU by
    # tests/gpu/test_gpu.py); elsewhere the Triton kernels run the same tiles: the same layer, the
    # shared expert's GEMMs included.
    case = CASES[1]
    sizes = dict(block_m=64, block_n=64, block_k=32, group_m=4, num_warps=4, num_stages=1)
    names = ("gate_up", "down", "down_bwd", "d_x")
    plain = dataclasses.replace(ops.small_tiles(16, 64), gate_up=ops.RowTiles(**sizes),
                                down=ops.RowTiles(**sizes), down_bwd=ops.DswigluTiles(**sizes),
                                d_x=ops.RowTiles(**sizes))
    gluon = dataclasses.replace(plain, **{
        name: dataclasses.replace(getattr(plain, name), gluon=True) for name in names})
    config = F.MoKConfig(recompute_gate_up=not kept)
    y, grads, _, _ = run_layer(case.inputs(), config=config, swiglu_limit=case.limit,
                               tiles=plain)
    y_gluon, grads_gluon, _, _ = run_layer(case.inputs(), config=config,
                                           swiglu_limit=case.limit, tiles=gluon)
    assert torch.equal(y, y_gluon)
    for name, a, b in zip(GRAD_NAMES, grads, grads_gluon, strict=True):
        assert (a is None and b is None) or torch.equal(a, b), name
    check_against_reference(case, y_gluon, grads_gluon)
    # the plan chose the Triton kernel and said why
    assert ("gate_up_saved" if kept else "gate_up",
            "the Triton kernel runs its Gluon tiles: interpreter does not run the Gluon kernels"
            ) in plan.fallbacks()


def test_tile_options_are_checked():
    with pytest.raises(ValueError, match="flatten=True"):
        ops.RowTiles(128, 128, 64, flatten=True)
    for block in ((32, 64, 64), (128, 512, 64), (128, 128, 256)):
        with pytest.raises(ValueError, match="gluon=True"):
            ops.RowTiles(*block, gluon=True)
    ops.RowTiles(64, 128, 32, gluon=True)  # a tile the Gluon kernels take
    fp8 = ops.RowTiles(128, 128, 128, gluon=True)  # the FP8 Gluon kernels' K steps
    with pytest.raises(ValueError, match="pingpong=True"):
        ops.DswigluTiles(128, 64, 64, pingpong=True)
    # each kind's record type: the dSwiGLU's tiles are not a row GEMM's
    with pytest.raises(TypeError, match="DswigluTiles"):
        dataclasses.replace(ops.small_tiles(16), down_bwd=ops.RowTiles(16, 16, 16))
    # block_n 256 is for down and d_x: the Gluon gate/up kernel does not take it
    from mok.ops import experts

    # K steps of 128 are the FP8 Gluon kernels': the 16-bit ones do not take them (the plan
    # gives those tiles to the Triton kernel)
    assert not experts.gluon_takes("down", fp8, hidden=256, intermediate=256,
                                   dtype=torch.bfloat16)

    def takes(kind, block_n):
        return experts.gluon_takes(kind, ops.RowTiles(128, block_n, 64, gluon=True), hidden=64,
                                   intermediate=32, dtype=torch.bfloat16)

    assert takes("gate_up", 128) and not takes("gate_up", 256)
    # the dSwiGLU backward: block_n up to 128 kept, 64 recomputing
    assert takes("down_bwd_saved", 128) and takes("down_bwd", 64)
    assert not takes("down_bwd_saved", 256) and not takes("down_bwd", 128)
    assert not experts.gluon_takes("down", ops.RowTiles(128, 128, 64, gluon=True), hidden=64,
                                   intermediate=32, dtype=torch.float32)


def test_launchers_run_the_kernel_their_tiles_name():
    # mok.plan decides the kernel; a launcher given Gluon tiles it cannot run raises instead of
    # running another kernel (here: off sm_90, and the kept form that does not write h).
    inputs = CASES[0].inputs()
    x, (w_gate, w_up, w_down) = inputs.x, inputs.routed_weights
    workspace = F.create_workspace(F.MoKConfig(), None, device=DEVICE,
                                   num_local_tokens=x.shape[0], hidden_size=x.shape[1],
                                   topk=inputs.topk_experts.shape[1])
    schedule = F.build_schedule(workspace, F.MoKConfig(), inputs.topk_experts,
                                num_local_experts=w_gate.shape[0],
                                tiles=ops.small_tiles(16, 64))
    gluon = ops.RowTiles(64, 64, 32, gluon=True)
    with pytest.raises(ValueError, match="Gluon kernel"):
        ops.gate_up_swiglu(x, w_gate, w_up, schedule.routing, gluon, None)
    gate_up = ops.gate_up_buffer(x, w_gate, schedule.routing)
    h = ops.gate_up_swiglu(x, w_gate, w_up, schedule.routing, ops.RowTiles(16, 16, 16), None,
                           gate_up=gate_up)
    with pytest.raises(ValueError, match="h_out=True"):
        ops.down_bwd_dswiglu(inputs.d_output, x, w_down, w_gate, w_up, h, schedule.routing,
                             ops.DswigluTiles(64, 64, 32, gluon=True), None, None,
                             gate_up=gate_up)


@pytest.mark.parametrize("kept", [False, True], ids=["recompute", "kept"])
@pytest.mark.parametrize("case", [CASES[0], CASES[8]], ids=lambda c: c.name)
def test_tiles_from_a_shared_counter_equal_plain_tiles(case, kept, monkeypatch):
    # The persistent gate/up, dSwiGLU and d_x launches that pull rows take their tiles from a
    # counter the programs share (DYNAMIC, mok.ops.experts._tile_counter). Forced here on one
    # device: bitwise what a program per tile gives, and the counter has handed out every tile.
    from mok.ops import experts

    base = tiles_for_tests(case.block) or ops.default_tiles(DEVICE)
    plain = dataclasses.replace(base, use_tuned=False)
    config = F.MoKConfig(recompute_gate_up=not kept)
    y, grads, _, _ = run_layer(case.inputs(), config=config, swiglu_limit=case.limit,
                               tiles=plain)
    counters = []

    def shared_counter(tiles, pull, routing):
        assert pull is None and tiles.persistent
        counters.append((torch.zeros(1, dtype=torch.int32, device=DEVICE), tiles, routing))
        return counters[-1][0], True

    monkeypatch.setattr(experts, "_tile_counter", shared_counter)
    y_dynamic, grads_dynamic, schedule, _ = run_layer(
        case.inputs(), config=config, swiglu_limit=case.limit,
        tiles=with_row_tiles(plain, persistent=True))
    # gate/up, dSwiGLU and d_x, of the routed experts and of the shared one
    assert len(counters) == (6 if case.shared else 3)
    for counter, tiles, routing in counters:
        # every program took tiles until one past the end: the end plus one per program (N is
        # I or H, which launch this was is not known here)
        ns = (case.intermediate if routing is schedule.routing else case.shared, case.hidden)
        num_tiles = [int(routing.used_rows) // tiles.block_m * -(-n // tiles.block_n)
                     for n in ns]
        assert any(count < int(counter) <= count + experts._num_programs(DEVICE)
                   for count in num_tiles)
    assert torch.equal(y, y_dynamic)
    for name, a, b in zip(GRAD_NAMES, grads, grads_dynamic, strict=True):
        assert (a is None and b is None) or torch.equal(a, b), name
    check_against_reference(case, y_dynamic, grads_dynamic)


@pytest.mark.parametrize("kept", [False, True], ids=["recompute", "kept"])
def test_kernels_waiting_on_copied_rows_equal_plain(kept):
    # The gate/up and dSwiGLU launches over rows moved by copies (MoKConfig.fwd_copy_rows /
    # bwd_copy_rows), here one device's tokens as if from two ranks (mok.testing.pull.
    # local_copied, every flag raised): their tiles wait on each rank's landed flag and take
    # the row blocks in the pull's order, local first or in schedule order; bitwise the
    # launches without.
    from mok.testing.pull import local_copied

    # 12 row blocks a GEMM over 3 experts, one route a token: ~4 blocks an expert, its first
    # half local, so blocks come of both kinds.
    tiles = dataclasses.replace(tiles_for_tests(16) or ops.default_tiles(DEVICE),
                                use_tuned=False)
    block = max(tiles.pick(kind, 32, 48).block_m for kind in ("gate_up", "down_bwd"))
    case = Case("copied", 12 * block, 48, 32, 3, 1, limit=0.8, seed=11)
    inputs = case.inputs()
    _, _, schedule, _ = run_layer(inputs, tiles=tiles)
    routing = schedule.routing
    used = int(routing.expert_offsets[-1])  # rows past it are never written
    x, w_gate, w_up, w_down = (inputs.x, inputs.w_routed_gate, inputs.w_routed_up,
                               inputs.w_routed_down)
    inter, hidden = w_gate.shape[1], w_gate.shape[2]
    h_tiles = tiles.pick("gate_up_saved" if kept else "gate_up", inter, hidden)
    bwd_tiles = tiles.pick("down_bwd_saved" if kept else "down_bwd", inter, hidden)
    kept_rows = ops.gate_up_buffer(x, w_gate, routing) if kept else None
    h = ops.gate_up_swiglu(x, w_gate, w_up, routing, h_tiles, case.limit, gate_up=kept_rows)

    def gate_up(pull=None):
        rows = ops.gate_up_buffer(x, w_gate, routing) if kept else None
        out = ops.gate_up_swiglu(x, w_gate, w_up, routing, h_tiles, case.limit, pull=pull,
                                 gate_up=rows)
        return [out[:used]] + ([rows[:used]] if kept else [])

    def dswiglu(pull=None):
        out = torch.zeros_like(h) if kept else h
        d_gate_up, partial = ops.down_bwd_dswiglu(
            inputs.d_output, x, w_down, w_gate, w_up, out, routing, bwd_tiles,
            inputs.router_weights, case.limit, pull=pull, gate_up=kept_rows, h_out=kept)
        return [d_gate_up[:used], partial[:used]] + ([out[:used]] if kept else [])

    for name, run, block_m in (("gate/up", gate_up, h_tiles.block_m),
                               ("dswiglu", dswiglu, bwd_tiles.block_m)):
        expected = run()
        blocks = routing.capacity_rows // block_m
        route = routing.row_route[:blocks * block_m].view(blocks, block_m).tolist()
        used_blocks = int(routing.used_rows) // block_m
        half = inputs.x.shape[0] // 2  # rank 1's tokens from here on; one route a token
        local = [all(r < half for r in route[b] if r >= 0) for b in range(blocks)]
        orders = []
        for lead in (1.0, 0.5, None):
            moved = local_copied(x, routing, block_m, lead=lead)
            moved.land()
            order = moved.pull.order.tolist()
            orders.append(order)
            # ops.local_first_blocks: the local blocks (among the first `lead` of the used ones)
            # first, then the other used ones, then the unused, each in schedule order
            first = [local[b] and b < used_blocks * (lead or 0) for b in range(blocks)]
            keys = [2 if b >= used_blocks else 0 if first[b] else 1 for b in range(blocks)]
            assert order == sorted(range(blocks), key=lambda b: (keys[b], b)), lead
            actual = run(moved.pull)
            assert int(moved.pull.peer.errors.abs().sum()) == 0
            for a, b in zip(actual, expected, strict=True):
                assert torch.equal(a, b), (name, lead)
        # the three orders differ here: blocks of both kinds, local ones past the lead
        assert len({tuple(order) for order in orders}) == 3, name


@pytest.mark.parametrize("variant", [with_tma_rows, _tma_weights, _persistent_tma, _flattened],
                         ids=["tma_rows", "tma_weights", "persistent_tma", "flattened"])
@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=lambda c: c.name)
def test_tma_variants_equal_plain_tiles_with_kept_gate_up(case, variant):
    # The kept pre-activations read and h written through TMA in the backward, and written so
    # in the forward; or the backward's w_down tiles through TMA: bitwise what pointer loads and
    # stores give.
    base = tiles_for_tests(case.block) or ops.default_tiles(DEVICE)
    plain = dataclasses.replace(base, use_tuned=False)
    kept = F.MoKConfig(recompute_gate_up=False)
    y, grads, schedule, context = run_layer(case.inputs(), config=kept,
                                            swiglu_limit=case.limit, tiles=plain)
    y_tma, grads_tma, _, context_tma = run_layer(
        case.inputs(), config=kept, swiglu_limit=case.limit, tiles=variant(plain))
    assert torch.equal(y, y_tma)
    used = int(schedule.routing.expert_offsets[-1])  # rows past the last expert are never written
    assert torch.equal(context.gate_up[:used], context_tma.gate_up[:used])
    for name, a, b in zip(GRAD_NAMES, grads, grads_tma, strict=True):
        assert (a is None and b is None) or torch.equal(a, b), name
    check_against_reference(case, y_tma, grads_tma)


@pytest.mark.parametrize("variant", [
    lambda tiles: with_row_tiles(tiles, epilogue_split=2),
    lambda tiles: with_row_tiles(tiles, epilogue_split=2, tma=True, tma_rows=True,
                                 persistent=True),
], ids=["split", "split_tma_persistent"])
@pytest.mark.parametrize("kept", [False, True], ids=["recompute", "kept"])
@pytest.mark.parametrize("case", [CASES[1], CASES[8], CASES[10]], ids=lambda c: c.name)
def test_split_epilogue_equals_plain_tiles(case, kept, variant):
    # RowTiles.epilogue_split: every row GEMM's epilogue in two column halves. Elementwise, so
    # bitwise the same outputs; only the router-weight gradient adds its per-tile partial sums
    # as two half sums, so it is close rather than equal.
    base = tiles_for_tests(case.block, case.align) or ops.default_tiles(DEVICE)
    plain = dataclasses.replace(base, use_tuned=False)
    config = F.MoKConfig(recompute_gate_up=not kept)
    y, grads, schedule, context = run_layer(case.inputs(), config=config,
                                            swiglu_limit=case.limit, tiles=plain)
    y_split, grads_split, _, context_split = run_layer(
        case.inputs(), config=config, swiglu_limit=case.limit, tiles=variant(plain))
    assert torch.equal(y, y_split)
    if kept:
        used = int(schedule.routing.expert_offsets[-1])
        assert torch.equal(context.gate_up[:used], context_split.gate_up[:used])
    for name, a, b in zip(GRAD_NAMES, grads, grads_split, strict=True):
        if a is None:
            assert b is None, name
        elif name == "d_router_weights":
            assert_close(b, a, dtype=torch.float32, name=name)
        else:
            assert torch.equal(a, b), name
    check_against_reference(case, y_split, grads_split)


def _grouped_mm_wgrad(tiles):
    return dataclasses.replace(tiles, wgrad=dataclasses.replace(tiles.wgrad, grouped_mm=True))


@pytest.mark.parametrize("kept", [False, True], ids=["recompute", "kept"])
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[4], CASES[8], CASES[9], CASES[10]],
                         ids=lambda c: c.name)
def test_grouped_mm_weight_gradients(case, kept):
    # WgradTiles.grouped_mm: the weight gradients by torch._grouped_mm over rows copied into
    # schedule order. Another summation order than the Triton kernel's, so close rather than
    # equal to it; everything else is bitwise the same, and it is deterministic.
    base = tiles_for_tests(case.block, case.align) or ops.default_tiles(DEVICE)
    plain = dataclasses.replace(base, use_tuned=False)
    config = F.MoKConfig(recompute_gate_up=not kept)
    y, grads, _, _ = run_layer(case.inputs(), config=config, swiglu_limit=case.limit,
                               tiles=plain)
    runs = [run_layer(case.inputs(), config=config, swiglu_limit=case.limit,
                      tiles=_grouped_mm_wgrad(plain)) for _ in range(2)]
    (y_mm, grads_mm, _, _), (_, grads_again, _, _) = runs
    assert torch.equal(y, y_mm)
    for name, a, b, again in zip(GRAD_NAMES, grads, grads_mm, grads_again, strict=True):
        if a is None:
            assert b is None, name
        elif name.startswith(("d_w_routed", "d_w_shared")):
            assert torch.equal(b, again), name
            assert_close(b, a, dtype=case.dtype, name=name)
        else:
            assert torch.equal(a, b), name
    check_against_reference(case, y_mm, grads_mm)
    if case.routing is RoutingPattern.EMPTY_EXPERT:
        for grad in grads_mm[2:5]:
            assert bool((grad[-1] == 0).all()), "an expert without tokens gets zero gradients"


def test_copy_rows_gathers_scales_and_zeroes_padding():
    case = Case("copy_rows", 37, 40, 16, 5, 3, routing=RoutingPattern.SKEWED, seed=14)
    inputs = case.inputs()
    config = F.MoKConfig()
    routing = case.schedule(inputs, config, tiles_for_tests(16)).routing
    weights = inputs.router_weights.reshape(-1).float()
    rows = ops.copy_rows(inputs.x, routing, gather=True, router_weights=weights)
    used = int(routing.expert_offsets[-1])
    route = routing.row_route[:used].long()
    valid = route >= 0
    token = torch.where(valid, route // case.topk, 0)
    expected = (inputs.x[token].float() * torch.where(valid, weights[route.clamp(min=0)], 0.0)
                [:, None]).to(inputs.x.dtype)
    assert int(valid.sum()) == case.tokens * case.topk
    assert torch.equal(rows[:used], expected)
    by_row = ops.copy_rows(rows, routing, gather=False)  # row-indexed: a plain copy
    assert torch.equal(by_row[:used], rows[:used])


@pytest.mark.parametrize("recompute_gate_up", [True, False], ids=["recompute", "kept_gate_up"])
def test_recompute_forward_context_equals_forward_context(recompute_gate_up):
    case = Case("recompute", 30, 32, 16, 4, 2, shared=16, limit=2.0, seed=13)
    inputs = case.inputs()
    config = F.MoKConfig(recompute_gate_up=recompute_gate_up)
    schedule = case.schedule(inputs, config, tiles_for_tests(16))
    workspace = schedule.workspace
    _, context = F.forward(config, workspace, schedule, *inputs.layer_args,
                           swiglu_limit=case.limit)
    again = F.recompute_forward_context(
        config, workspace, schedule, inputs.x, inputs.w_shared_gate, inputs.w_shared_up,
        inputs.w_routed_gate, inputs.w_routed_up, swiglu_limit=case.limit)
    used = int(schedule.routing.expert_offsets[-1])  # rows past the last expert are never read
    name, shared_name = ("h", "h_shared") if recompute_gate_up else ("gate_up", "gate_up_shared")
    assert torch.equal(getattr(context, name)[:used], getattr(again, name)[:used])
    assert torch.equal(getattr(context, shared_name)[: case.tokens],
                       getattr(again, shared_name)[: case.tokens])
    # It keeps h (C x I + T_pad x I_s elements) or the pre-activations, twice as many.
    rows = schedule.routing.capacity_rows
    width = 1 if recompute_gate_up else 2
    assert context.nbytes == width * (rows * 16 + schedule.shared_routing.capacity_rows * 16) * 2


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[2], CASES[4]], ids=lambda c: c.name)
def test_recomputing_gate_up_matches_reference(case):
    # MoKConfig(recompute_gate_up=True): the forward keeps h only and the backward recomputes
    # the pre-activations. The forward is the default's computation; the backward is checked
    # against the reference and repeatable bit for bit; the context holds half the default's.
    inputs = case.inputs()
    tiles = tiles_for_tests(case.block, case.align)
    recomputing = F.MoKConfig(recompute_gate_up=True)
    y, grads, schedule, context = run_layer(inputs, config=recomputing,
                                            swiglu_limit=case.limit, tiles=tiles)
    check_against_reference(case, y, grads)
    y_kept, _, _, kept = run_layer(inputs, swiglu_limit=case.limit, tiles=tiles)
    assert torch.equal(y, y_kept)
    rows = schedule.routing.capacity_rows
    assert context.gate_up is None and context.h.shape == (rows, case.intermediate)
    assert (context.h_shared is None) == (case.shared == 0)
    assert kept.h is None and kept.h_shared is None
    assert kept.gate_up.shape == (rows, 2 * case.intermediate)
    assert kept.nbytes == 2 * context.nbytes
    again = run_layer(inputs, config=recomputing, swiglu_limit=case.limit, tiles=tiles)
    for name, a, b in zip(GRAD_NAMES, grads, again[1], strict=True):
        assert (a is None and b is None) or torch.equal(a, b), name


def test_kept_context_serves_one_backward():
    # The default keeps the pre-activations, and the backward writes their gradients over them
    # (no second [C, 2I] buffer). Their version counters say so: a second backward on the
    # context is refused; recompute_forward_context gives a fresh one with the same gradients.
    case = CASES[1]
    inputs = case.inputs()
    config = F.MoKConfig()
    schedule = case.schedule(inputs, config, tiles_for_tests(case.block, case.align))
    workspace = schedule.workspace
    _, context = F.forward(config, workspace, schedule, *inputs.layer_args,
                           swiglu_limit=case.limit)
    pre_activations = context.gate_up.clone()
    grads = F.backward(config, workspace, schedule, context, inputs.d_output,
                       *inputs.layer_args, swiglu_limit=case.limit)
    used = int(schedule.routing.expert_offsets[-1])
    assert not torch.equal(context.gate_up[:used], pre_activations[:used])  # overwritten
    with pytest.raises(MoKInputError, match="serves one backward"):
        F.backward(config, workspace, schedule, context, inputs.d_output, *inputs.layer_args,
                   swiglu_limit=case.limit)
    fresh = F.recompute_forward_context(
        config, workspace, schedule, inputs.x, inputs.w_shared_gate, inputs.w_shared_up,
        inputs.w_routed_gate, inputs.w_routed_up, swiglu_limit=case.limit)
    assert torch.equal(fresh.gate_up[:used], pre_activations[:used])
    again = F.backward(config, workspace, schedule, fresh, inputs.d_output, *inputs.layer_args,
                       swiglu_limit=case.limit)
    for name, a, b in zip(GRAD_NAMES, grads, again, strict=True):
        assert (a is None and b is None) or torch.equal(a, b), name


@pytest.mark.parametrize("recompute_gate_up", [True, False], ids=["recompute", "kept_gate_up"])
def test_backward_runs_with_the_forwards_swiglu_limit(recompute_gate_up):
    # The context records the forward's limit: a backward not given one uses it (a backward
    # without it had silently computed another layer's gradients, NaN with kept
    # pre-activations), and one given another limit is refused.
    case = CASES[1]
    inputs = case.inputs()
    config = F.MoKConfig(recompute_gate_up=recompute_gate_up)
    tiles = tiles_for_tests(case.block, case.align)
    _, expected, _, _ = run_layer(inputs, config=config, swiglu_limit=case.limit, tiles=tiles)
    schedule = case.schedule(inputs, config, tiles)
    workspace = schedule.workspace
    _, context = F.forward(config, workspace, schedule, *inputs.layer_args,
                           swiglu_limit=case.limit)
    assert context.swiglu_limit == case.limit
    for other in (None, 2 * case.limit):
        with pytest.raises(MoKInputError, match="differs from the forward's"):
            F.backward(config, workspace, schedule, context, inputs.d_output,
                       *inputs.layer_args, swiglu_limit=other)
    grads = F.backward(config, workspace, schedule, context, inputs.d_output,
                       *inputs.layer_args)
    for name, a, b in zip(GRAD_NAMES, expected, grads, strict=True):
        assert (a is None and b is None) or torch.equal(a, b), name
    rebuilt = F.recompute_forward_context(
        config, workspace, schedule, inputs.x, inputs.w_shared_gate, inputs.w_shared_up,
        inputs.w_routed_gate, inputs.w_routed_up, swiglu_limit=case.limit)
    assert rebuilt.swiglu_limit == case.limit
    again = F.backward(config, workspace, schedule, rebuilt, inputs.d_output,
                       *inputs.layer_args)
    for name, a, b in zip(GRAD_NAMES, expected, again, strict=True):
        assert (a is None and b is None) or torch.equal(a, b), name


def with_dswiglu_apart(tiles):
    """`tiles` (the table left out) with the recomputing dSwiGLU in two launches
    (DswigluTiles.apart)."""
    return dataclasses.replace(tiles, use_tuned=False,
                               down_bwd=dataclasses.replace(tiles.down_bwd, apart=True))


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[2], CASES[3], CASES[4], CASES[9]],
                         ids=lambda c: c.name)
def test_dswiglu_apart_equals_the_kept_backward(case):
    # DswigluTiles.apart: the recomputing backward's gate/up in a launch of its own, storing the
    # pre-activations, then the kept dSwiGLU over them in place. The forward still keeps h
    # alone; d_x, the router-weight and the gate/up weight gradients are bitwise those of the
    # backward of a forward that kept its pre-activations (the same tiles compute them), the
    # down weight gradients (of the forward's h, not of h rebuilt from the kept bf16
    # pre-activations) within tolerance of the reference as everything else is.
    inputs = case.inputs()
    tiles = with_dswiglu_apart(tiles_for_tests(case.block, case.align)
                               or ops.default_tiles(DEVICE))
    y, grads, _, context = run_layer(inputs, config=F.MoKConfig(recompute_gate_up=True),
                                     swiglu_limit=case.limit, tiles=tiles)
    check_against_reference(case, y, grads)
    assert context.gate_up is None and context.h is not None
    _, kept_grads, _, _ = run_layer(inputs, swiglu_limit=case.limit, tiles=tiles)
    for name, a, b in zip(GRAD_NAMES, grads, kept_grads, strict=True):
        if not name.endswith("_down"):
            assert (a is None and b is None) or torch.equal(a, b), name


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize(("recompute_gate_up", "limit"), [(True, None), (False, None),
                                                          (True, 0.5), (False, 0.5)],
                         ids=["recompute", "kept_gate_up", "recompute_limit", "kept_limit"])
def test_nonfinite_inputs_stay_in_their_token(recompute_gate_up, limit):
    # With a SwiGLU limit too: the clamp keeps NaN (a GPU's min would return the limit).
    case = Case("nan", 24, 32, 16, 6, 2, shared=16, seed=14)
    inputs = case.inputs()
    inputs.x[3, 5] = float("nan")
    inputs.router_weights[7, 1] = float("inf")
    config = F.MoKConfig(recompute_gate_up=recompute_gate_up)
    y, grads, _, _ = run_layer(inputs, config=config, tiles=tiles_for_tests(16),
                               swiglu_limit=limit)
    finite = torch.ones(case.tokens, dtype=torch.bool)
    finite[[3, 7]] = False
    assert bool(torch.isnan(y[3]).all())
    assert not bool(torch.isfinite(y[7]).all())
    clean = case.inputs()
    y_ref, grads_ref = moe_reference_grads(clean, compute_dtype=REF_DTYPE, swiglu_limit=limit)
    assert_close(y[finite.to(y.device)], y_ref[finite.to(y_ref.device)], dtype=case.dtype,
                 name="y of other tokens")
    d_x = grads[0]
    assert bool(torch.isfinite(d_x[finite.to(d_x.device)]).all())
    # Experts reached by a non-finite route (any route of token 3, route (7, 1)) get non-finite
    # weight gradients; all others stay finite.
    touched = set(clean.topk_experts[3].tolist()) | {int(clean.topk_experts[7, 1])}
    for expert in range(case.experts):
        is_finite = bool(torch.isfinite(grads[2][expert]).all())
        assert is_finite == (expert not in touched), expert


def test_empty_batch():
    inputs = make_inputs(0, 16, 16, 4, 2, shared_intermediate_size=8, device=DEVICE)
    y, grads, _, _ = run_layer(inputs, tiles=tiles_for_tests(16))
    assert y.shape == (0, 16)
    assert grads[0].shape == (0, 16) and grads[1].shape == (0, 2)
    for grad in grads[2:]:
        assert bool((grad == 0).all())
