"""The committed tile table: complete for the benchmark shapes, usable as it stands, stable."""

import dataclasses
import json

import pytest
import torch

import mok.functional as F
from mok import _env
from mok.ops.tuning import (
    HOPPER_TILES,
    KIND_TILES,
    KINDS,
    TRITON,
    TUNED_TILES_PATH,
    DswigluTiles,
    RowTiles,
    TileTable,
    _record,
    hopper_rule,
    small_tiles,
    table_to_json,
)
from mok.testing import SHAPES, make_inputs

from ..conftest import DEVICE

# (n, k) of each kind for the routed experts (mok.ops.tuning.KINDS).
KEYS = {"gate_up": "IH", "gate_up_saved": "IH", "down": "HI", "down_bwd": "IH",
        "down_bwd_saved": "IH", "d_x": "HI", "wgrad_gate_up": "IH", "wgrad_down": "HI"}


def committed() -> dict:
    return {(kind, int(key.split(",")[0]), int(key.split(",")[1])): _record(kind, fields)
            for kind, entries in json.loads(TUNED_TILES_PATH.read_text())["tiles"].items()
            for key, fields in entries.items()}


def test_every_kind_is_keyed():
    assert set(KEYS) == set(KINDS)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_every_benchmark_shape_has_measured_tiles_that_are_used(shape):
    table = committed()
    sizes = {"H": shape.hidden_size, "I": shape.intermediate_size}
    for kind, (n, k) in KEYS.items():
        key = (kind, sizes[n], sizes[k])
        assert key in table, f"{key} not tuned: the layer would fall back to the defaults"
        tiles = table[key]
        # pick() only takes a row tile that divides the schedule's alignment
        if not kind.startswith("wgrad"):
            assert HOPPER_TILES.align % tiles.block_m == 0, key
        assert min(tiles.block_m, tiles.block_n, tiles.block_k) >= 16, key
        if not _env.TILES_FILE:  # MOK_TILES_FILE names another table: this file alone counts
            assert HOPPER_TILES.pick(*key) == tiles


def test_table_file_is_what_table_to_json_writes():
    # So `benchmarks.tune` rewriting the table changes only the entries it measured.
    data = json.loads(TUNED_TILES_PATH.read_text())
    table = TileTable(data["arch"], tuple(data["dtypes"]), committed())
    assert table_to_json(table) == TUNED_TILES_PATH.read_text()


def test_a_table_written_before_retired_tile_fields_still_loads():
    # Tables that benchmarks.tune wrote before a kernel variant was removed hold its field as
    # False (the tiles every kernel runs now): left out; True: refused with what to do.
    fields = {**dataclasses.asdict(KIND_TILES["down"](128, 128, 128, gluon=True)),
              "staged_scales": False, "promote_first": False, "epilogue_partition": False}
    assert _record("down", fields) == KIND_TILES["down"](128, 128, 128, gluon=True)
    with pytest.raises(ValueError, match="staged_scales=True names a kernel variant"):
        _record("down", {**fields, "staged_scales": True})
    with pytest.raises(TypeError):  # a field no version had
        _record("down", {**fields, "stages": 3})


def test_pick_falls_back_to_the_rule_then_the_config_tiles():
    # Outside the table: the architecture's rule for 16-bit dtypes (a record of the kind's type,
    # fitting the schedule's alignment; Triton tiles where triton asks for them), else the
    # config's own tiles (other dtypes, or a config that does not consult the table).
    for kind in KINDS:
        for triton in (False, True):
            tiles = HOPPER_TILES.pick(kind, 12345, 678, dtype=torch.float16, triton=triton)
            small = HOPPER_TILES.pick(kind, 256, 768, dtype=torch.float16, triton=triton)
            assert small == hopper_rule(kind, 256, 768, triton), kind  # small experts too
            assert tiles == hopper_rule(kind, 12345, 678, triton), kind
            assert isinstance(tiles, KIND_TILES[kind]), kind
            if not kind.startswith("wgrad"):
                assert HOPPER_TILES.align % tiles.block_m == 0, kind
            if triton and not kind.startswith("wgrad"):
                assert not (tiles.gluon or getattr(tiles, "apart", False)), kind
    fp32 = dict(dtype=torch.float32)
    assert HOPPER_TILES.pick("d_x", 12345, 678, **fp32) == HOPPER_TILES.d_x
    assert HOPPER_TILES.pick("wgrad_down", 12345, 678, **fp32) == HOPPER_TILES.wgrad
    assert HOPPER_TILES.pick("down_bwd_saved", 12345, 678, **fp32) == DswigluTiles(
        **dataclasses.asdict(HOPPER_TILES.down))
    assert HOPPER_TILES.pick("gate_up_saved", 12345, 678, **fp32) == HOPPER_TILES.gate_up
    untuned = dataclasses.replace(HOPPER_TILES, use_tuned=False)
    shape = SHAPES[0]
    assert untuned.pick("gate_up", shape.intermediate_size, shape.hidden_size) == untuned.gate_up
    assert untuned.pick("d_x", 12345, 678) == untuned.d_x
    # another architecture reads neither the table nor sm_90's rule
    other = dataclasses.replace(HOPPER_TILES, arch="sm_100")
    assert other.pick("gate_up", shape.intermediate_size, shape.hidden_size) == other.gate_up


def test_rule_takes_pingpong_kept_dswiglu_tiles_only_for_narrow_experts_and_short_h():
    # Experts up to 768 wide over H up to PINGPONG_MAX_H: 64-row tiles, two MMA partitions;
    # longer H or wider experts: 128-row tiles, one partition.
    from mok.ops.tuning import PINGPONG_MAX_H

    for n, k, pingpong in ((256, 768, True), (512, PINGPONG_MAX_H, True),
                           (512, PINGPONG_MAX_H + 64, False), (512, 4096, False),
                           (1024, 1024, False)):
        tiles = hopper_rule("down_bwd_saved", n, k)
        assert tiles.gluon and tiles.pingpong == pingpong, (n, k)
        assert tiles.block_m == (64 if pingpong else 128), (n, k)


def test_rule_gathers_small_experts_weight_gradient_rows_in_the_triton_kernel():
    # Experts up to SMALL_WGRAD_I wide: the Triton kernel (gate and up paired), no row copies;
    # wider ones: torch._grouped_mm. gate/up's of experts up to GLUON_WGRAD_MAX_I wide, I a
    # multiple of 256: the Gluon kernel, and the above where it cannot run (triton). Keys are
    # (P, Q): (I, H) for gate/up, (H, I) for down.
    from mok.ops.tuning import GLUON_WGRAD_MAX_I, SMALL_WGRAD_I

    for inter in (128, SMALL_WGRAD_I):
        gate_up = hopper_rule("wgrad_gate_up", inter, 1536, triton=True)
        down = hopper_rule("wgrad_down", 1536, inter, triton=True)
        assert not gate_up.grouped_mm and gate_up.pair and not gate_up.gluon
        assert not down.grouped_mm and not down.pair and not down.gluon
    assert hopper_rule("wgrad_gate_up", 128, 1536).pair
    for inter in (SMALL_WGRAD_I + 128, 512, 4096):
        assert hopper_rule("wgrad_gate_up", inter, 1536, triton=True).grouped_mm
        assert hopper_rule("wgrad_down", 1536, inter, triton=True).grouped_mm
    for inter in range(256, GLUON_WGRAD_MAX_I + 1, 256):
        gate_up = hopper_rule("wgrad_gate_up", inter, 1536)
        down = hopper_rule("wgrad_down", 1536, inter)
        assert gate_up.gluon and down.gluon
        assert (gate_up.block_m, gate_up.block_n, gate_up.block_k) == (256, 128, 64)
        assert (down.block_m, down.block_n, down.block_k) == (128, 256, 64)
    for inter in (384, GLUON_WGRAD_MAX_I + 256):
        assert not hopper_rule("wgrad_gate_up", inter, 1536).gluon
        assert not hopper_rule("wgrad_down", 1536, inter).gluon


def test_tuner_runs_every_kind_for_routed_and_shared_experts():
    # What `python -m benchmarks.tune` times (on a GPU), run once here on a small problem:
    # every kind of both expert groups launches with the keys it is tuned under.
    from benchmarks.tune import CANDIDATES, gemm_runners

    inputs = make_inputs(40, 32, 16, 4, 2, shared_intermediate_size=24, device=DEVICE, seed=3)
    tiles = small_tiles(16)
    workspace = F.create_workspace(F.MoKConfig(), None, device=DEVICE, num_local_tokens=40,
                                   hidden_size=32, topk=2)
    schedule = F.build_schedule(workspace, F.MoKConfig(), inputs.topk_experts,
                                num_local_experts=4, tiles=tiles)
    shared = (inputs.w_shared_gate[None], inputs.w_shared_up[None], inputs.w_shared_down[None])
    groups = [
        (16, schedule.routing, gemm_runners(inputs.x, *inputs.routed_weights, schedule.routing,
                                            inputs.router_weights, inputs.d_output,
                                            setup=tiles)),
        (24, schedule.shared_routing, gemm_runners(inputs.x, *shared, schedule.shared_routing,
                                                   None, inputs.d_output, setup=tiles)),
    ]
    for inter, routing, runners in groups:
        assert set(runners) == set(CANDIDATES) == set(KINDS)
        used = int(routing.expert_offsets[-1])  # rows past these are never written
        for kind, ((n, k), run) in runners.items():
            assert (n, k) == ((inter, 32) if KEYS[kind] == "IH" else (32, inter)), kind
            out = run(tiles.pick(kind, n, k))
            first = out[0] if isinstance(out, tuple) else out
            if first.shape[0] == routing.capacity_rows:
                first = first[:used]
            assert bool(torch.isfinite(first.float()).all()) and first.abs().max() > 0, kind
        # down_bwd in two launches (DswigluTiles.apart), on the setup's gate_up_saved and
        # down_bwd_saved tiles
        d_gate_up, _ = runners["down_bwd"][1](dataclasses.replace(tiles.down_bwd, apart=True))
        assert bool(torch.isfinite(d_gate_up[:used].float()).all())
        assert d_gate_up[:used].abs().max() > 0


def _not_triton(tiles) -> bool:
    return getattr(tiles, "gluon", False) or getattr(tiles, "apart", False)


def test_triton_tiles_stand_beside_gluon_ones():
    # Where the table's tiles are Gluon ones (RowTiles.gluon) or two launches (apart), it
    # keeps the best Triton tiles too, for the launches the Gluon kernels cannot take (expert
    # parallelism's pulls and scatters ask for them: TileConfig.pick(triton=True)); elsewhere
    # triton changes nothing.
    table = committed()
    with_triton = [key for key in table if key[0].endswith(TRITON)]
    assert with_triton
    for kind, n, k in with_triton:
        base = kind.removesuffix(TRITON)
        assert base in KINDS and _not_triton(table[(base, n, k)]), (kind, n, k)
        assert not _not_triton(table[(kind, n, k)]), (kind, n, k)
    for (kind, n, k), tiles in table.items():
        if kind in KINDS and not _env.TILES_FILE:
            expected = table.get((kind + TRITON, n, k), tiles)
            assert HOPPER_TILES.pick(kind, n, k, triton=True) == expected, (kind, n, k)
            assert (kind + TRITON, n, k) in table or not _not_triton(tiles), (kind, n, k)


def test_tuner_keeps_the_best_triton_tiles_where_gluon_ones_win(monkeypatch, capsys):
    # benchmarks.tune on made-up timings: Gluon tiles fastest for d_x, a Triton tile for down;
    # the table keeps d_x's fastest Triton tiles beside its Gluon ones and drops down's stale
    # Triton entry.
    import benchmarks.tune as tune

    def timing(run, **_):  # run() is (kind, tiles)
        kind, tiles = run()
        triton = 2.0 + tiles.num_stages / 10 + tiles.block_n / 1000
        if kind == "d_x":
            return 1.0 if tiles.gluon else triton
        return 9.0 if tiles.gluon else triton

    monkeypatch.setattr(tune, "stage_runners", lambda shape: [
        ("routed", kind, (7, 9), lambda tiles, kind=kind: (kind, tiles))
        for kind in ("d_x", "down")])
    monkeypatch.setattr(tune, "median_ms", timing)
    stale = RowTiles(64, 64, 32)
    table = tune.tune([SHAPES[0]], {("down" + TRITON, 7, 9): stale}, kinds=("d_x", "down"))
    capsys.readouterr()
    d_x = [t for t in tune.CANDIDATES["d_x"] if not t.gluon]
    assert table[("d_x", 7, 9)].gluon
    assert table[("d_x" + TRITON, 7, 9)] == min(
        d_x, key=lambda t: t.num_stages / 10 + t.block_n / 1000)
    assert not table[("down", 7, 9)].gluon
    assert ("down" + TRITON, 7, 9) not in table


def test_tuner_keeps_triton_tiles_where_the_two_launch_dswiglu_wins(monkeypatch, capsys):
    # benchmarks.tune on made-up timings where the recomputing dSwiGLU in two launches
    # (DswigluTiles.apart) is fastest: the table takes it, and its best one-launch Triton tiles
    # beside it (launches that pull rows run one launch).
    import benchmarks.tune as tune

    def timing(run, **_):
        tiles = run()
        return 1.0 if tiles.apart else (9.0 if tiles.gluon else 2.0 + tiles.num_stages / 10)

    monkeypatch.setattr(tune, "stage_runners", lambda shape: [
        ("routed", "down_bwd", (7, 9), lambda tiles: tiles)])
    monkeypatch.setattr(tune, "median_ms", timing)
    table = tune.tune([SHAPES[0]], {}, kinds=("down_bwd",))
    capsys.readouterr()
    assert table[("down_bwd", 7, 9)].apart
    triton = table[("down_bwd" + TRITON, 7, 9)]
    assert not (triton.apart or triton.gluon)
    assert triton == min((t for t in tune.CANDIDATES["down_bwd"] if not (t.apart or t.gluon)),
                         key=lambda t: t.num_stages)


def test_plans_are_remembered_and_count_their_fallbacks():
    # A layer asks for the same plans every call: they are made once per arguments (the tile
    # config by identity) and then looked up; a looked-up plan counts its fallbacks again.
    from mok import plan

    sizes = dict(block_m=64, block_n=64, block_k=32, group_m=4, num_warps=4, num_stages=1)
    gluon = dataclasses.replace(small_tiles(16, 64),
                                gate_up=RowTiles(**sizes, gluon=True),
                                down=RowTiles(**sizes, gluon=True))
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    w = torch.randn(2, 32, 64, dtype=torch.bfloat16)
    operands = plan.Operands.of(x, w, w, w.transpose(1, 2).contiguous())
    args = dict(hidden=64, intermediate=32, keep_gate_up=False)
    first = plan.forward_plan(gluon, operands, **args)
    if not first.gate_up.gluon:  # off sm_90 the plan falls back: counted on every call
        before = plan.fallbacks()
        assert plan.forward_plan(gluon, operands, **args) is first
        after = plan.fallbacks()
        assert sum(after.values()) - sum(before.values()) == 2  # gate_up and down
    assert plan.forward_plan(gluon, operands, **args) is first
    # another config (an equal one, by identity) and other arguments make their own plans
    copy = dataclasses.replace(gluon)
    assert plan.forward_plan(copy, operands, **args) is not first
    assert plan.forward_plan(copy, operands, **args) == first
    kept = plan.forward_plan(gluon, operands, **{**args, "keep_gate_up": True})
    assert kept is not first
    back = plan.backward_plan(gluon, operands, hidden=64, intermediate=32, kept=True)
    assert plan.backward_plan(gluon, operands, hidden=64, intermediate=32, kept=True) is back


def test_gluon_wgrad_tiles_fall_back_where_the_kernel_does_not_run():
    # WgradTiles.gluon asks for the warp-specialized Gluon weight gradients, which run on an
    # sm_90 GPU only (tests/gpu/test_gpu.py checks them there): elsewhere the plan hands the
    # Triton kernel tiles it takes (gate and up in one launch, at most 128 wide) and says why.
    # (The operands here are CPU tensors, so this holds on a GPU machine too.)
    from mok import plan
    from mok.ops.tuning import WgradTiles

    gluon = WgradTiles(256, 128, 64, group_m=1, num_warps=8, num_stages=3, gluon=True)
    config = dataclasses.replace(small_tiles(16, 128), wgrad=gluon)
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    w = torch.randn(2, 256, 256, dtype=torch.bfloat16)
    operands = plan.Operands.of(x, w, w, w)
    back = plan.backward_plan(config, operands, hidden=256, intermediate=256, kept=True)
    assert not back.wgrad_down.gluon and not back.wgrad_down.pair
    assert back.wgrad_gate_up == WgradTiles(128, 128, 64, group_m=1, num_warps=8,
                                            num_stages=3, pair=True)
    reasons = {reason for kind, reason in plan.fallbacks() if kind == "wgrad_gate_up"}
    assert any("does not run the Gluon kernels" in reason for reason in reasons)
    # sizes it does not take (I not a multiple of block_m) fall back on any device
    odd = plan.backward_plan(config, operands, hidden=256, intermediate=384, kept=True)
    assert not odd.wgrad_gate_up.gluon


def test_rule_takes_128_row_gluon_wgrad_tiles_where_256_row_ones_leave_sms_idle():
    # A launch whose 256-wide tiles number fewer than WGRAD_WAVE (one expert: a shared expert)
    # takes 128 x 128 tiles, twice as many; many experts keep the 256-wide ones.
    from mok import plan
    from mok.ops.tuning import WGRAD_WAVE

    for kind, key in (("wgrad_gate_up", (512, 2048)), ("wgrad_down", (2048, 512))):
        wide = hopper_rule(kind, *key)
        assert hopper_rule(kind, *key, experts=128) == wide
        narrow = hopper_rule(kind, *key, experts=1)
        assert narrow.gluon and (narrow.block_m, narrow.block_n, narrow.num_stages) == (128, 128, 4)
        assert HOPPER_TILES.pick(kind, *key, experts=1) == narrow
    # gate/up's tiles of I = 256, H = 768 per expert: 2 x 6 = 12 (d_w_gate and d_w_up)
    fewer = -(-WGRAD_WAVE // 12) - 1  # the most experts whose tiles number fewer
    assert hopper_rule("wgrad_gate_up", 256, 768, experts=fewer).block_m == 128
    assert hopper_rule("wgrad_gate_up", 256, 768, experts=fewer + 1).block_m == 256
    # the plan passes the launch's expert count: a shared expert is a group of one
    x = torch.randn(8, 2048, dtype=torch.bfloat16)
    for experts in (1, 4):
        w = torch.randn(experts, 512, 2048, dtype=torch.bfloat16)
        assert plan.Operands.of(x, w, w, w.transpose(1, 2)).experts == experts
    picked = []
    operands = plan.Operands.of(x, w[:1], w[:1], w[:1].transpose(1, 2))
    plan._wgrads(lambda kind, triton=False, experts=None: picked.append(experts) or
                 HOPPER_TILES.pick(kind, 512, 2048, triton=triton, experts=experts),
                 operands, 128, dict(hidden=2048, intermediate=512))
    assert picked[0::2] == [1, 1]
