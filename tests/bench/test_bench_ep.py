"""`python -m mok bench --ep N` end to end on CPU processes (the tiny shape, interpreter)."""

import csv

import pytest
import torch

from benchmarks import ep
from mok.testing.tolerance import TOLERANCES


@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the real benchmark")
@pytest.mark.parametrize(("world_size", "recompute", "copied"),
                         [(2, "", ""), (2, "_recompute", ""), (2, "", "_copy_bcopy"),
                          pytest.param(4, "", "", marks=pytest.mark.slow),
                          pytest.param(8, "", "", marks=pytest.mark.slow)],
                         ids=["ep2", "ep2_recompute_gate_up", "ep2_copied_rows", "ep4", "ep8"])
def test_ep_bench_runs_on_cpu_and_checks_before_timing(tmp_path, world_size, recompute, copied):
    # At 4 and 8 ranks the tiny shape has one expert a rank (top-2): its compute-only run takes
    # one route per token over twice the tokens.
    # copied: mok pulling and mok with copied rows (--also-copies) in the same run.
    path = tmp_path / "ep.csv"
    ep.main(["--ep", str(world_size), "--csv", str(path), "--iters", "1", "--warmup", "0",
             *(["--recompute-gate-up"] if recompute else []),
             *(["--also-copies"] if copied else [])])
    rows = list(csv.DictReader(path.open()))
    assert set(rows[0]) == set(ep.CSV_FIELDS)
    by_key = {(row["impl"], row["mode"]): row for row in rows}
    compute_name = f"compute_only{recompute}"
    mok_names = [f"mok{recompute}"] + ([f"mok{recompute}{copied}"] if copied else [])
    expected = {(compute_name, "forward"), (compute_name, "forward+backward")} | {
        (mok_name, mode) for mok_name in mok_names
        for mode in ("forward", "forward+backward", "dispatch", "down_scatter", "down_local")}
    assert expected <= set(by_key)
    for row in rows:
        assert row["ep"] == str(world_size) and row["shape"] == "tiny" and float(row["ms"]) > 0
    for mok_name in mok_names:
        for mode in ("forward", "forward+backward"):
            mok = by_key[(mok_name, mode)]
            # checked against the reference on the group before it was timed
            assert float(mok["max_rel_err"]) <= TOLERANCES[torch.bfloat16].max_rel
            ratio = float(mok["ms"]) / float(by_key[(compute_name, mode)]["ms"])
            assert float(mok["vs_compute_only"]) == pytest.approx(ratio, rel=1e-2)
    assert (tmp_path / "ep.png").stat().st_size > 0


def test_ep_shapes_and_compute_only_sizes_keep_the_routes_per_gpu():
    from benchmarks.layer import BENCH_SHAPES

    mixtral, qwen3 = BENCH_SHAPES["mixtral-8x7b"], BENCH_SHAPES["qwen3-30b-a3b"]
    for shape, world_size, expected in ((qwen3, 8, (16384, 8, 16)), (mixtral, 2, (8192, 2, 4)),
                                        (mixtral, 8, (16384, 1, 1))):
        sizes = ep.compute_only_sizes(ep.ep_shape(shape, world_size), world_size)
        assert sizes == expected
        assert sizes[0] * sizes[1] == shape.num_tokens * shape.topk  # T * k routes kept
    kimi = BENCH_SHAPES["kimi-ep64-slice"]
    assert ep.ep_shape(kimi, 4).num_experts == 4 * kimi.num_experts  # experts per GPU
    assert ep.ep_shape(BENCH_SHAPES["tiny"], 8).num_experts == 8
    with pytest.raises(SystemExit, match="do not split over 16 ranks"):
        ep.ep_shape(mixtral, 16)
    with pytest.raises(SystemExit, match="do not split"):
        ep.main(["--ep", "16", "--shapes", "mixtral-8x7b"])
    with pytest.raises(SystemExit, match="unknown shapes"):
        ep.main(["--ep", "2", "--shapes", "nope"])


def test_ep_redraw_charts_the_newest_gpu_rows(tmp_path, capsys):
    from benchmarks import append_rows

    def row(commit, shape, impl, mode, ms, gpu="NVIDIA H200"):
        return dict(gpu=gpu, commit=commit, date="2026-01-01T00:00:00", ep=2, shape=shape,
                    comm_sms=64, impl=impl, mode=mode, ms=ms, tflops=1.0,
                    vs_compute_only=1.1 if impl == "mok" else "", gb_s="", peak_mem_gb=1.0,
                    max_rel_err="1e-02")

    path = tmp_path / "ep.csv"
    append_rows(path, ep.CSV_FIELDS, [
        row("old", "qwen3-30b-a3b", "mok", "forward", 5.0),
        row("new", "qwen3-30b-a3b", "mok", "forward", 4.0),
        row("new", "qwen3-30b-a3b", "compute_only", "forward", 3.0),
        row("new", "qwen3-30b-a3b", "mok", "dispatch", 1.0),
        row("cpu", "tiny", "mok", "forward", 9.0, gpu="cpu (interpreter)")])
    newest = ep.newest_rows(path)
    assert [(r["impl"], r["commit"], r["ms"]) for r in newest] == [("mok", "new", "4.0"),
                                                                   ("compute_only", "new", "3.0")]
    ep.main(["--ep", "2", "--redraw", "--csv", str(path)])
    assert (tmp_path / "ep.png").stat().st_size > 0
    assert "from 2 rows" in capsys.readouterr().out
