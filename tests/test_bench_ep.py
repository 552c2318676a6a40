"""`python -m mok bench --ep 2` end to end on CPU processes (the tiny shape, interpreter)."""

import csv

import pytest
import torch

from benchmarks import ep
from mok.testing.tolerance import TOLERANCES


@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the real benchmark")
@pytest.mark.parametrize("kept", ["", "_kept"], ids=["recompute", "kept_gate_up"])
def test_ep_bench_runs_on_cpu_and_checks_before_timing(tmp_path, kept):
    path = tmp_path / "ep.csv"
    ep.main(["--ep", "2", "--csv", str(path), "--iters", "1", "--warmup", "0",
             *(["--keep-gate-up"] if kept else [])])
    rows = list(csv.DictReader(path.open()))
    assert set(rows[0]) == set(ep.CSV_FIELDS)
    by_key = {(row["impl"], row["mode"]): row for row in rows}
    mok_name, compute_name = f"mok{kept}", f"compute_only{kept}"
    expected = {(compute_name, "forward"), (compute_name, "forward+backward"),
                (mok_name, "forward"), (mok_name, "forward+backward"), (mok_name, "dispatch"),
                (mok_name, "down_scatter"), (mok_name, "down_local")}
    assert expected <= set(by_key)
    for row in rows:
        assert row["ep"] == "2" and row["shape"] == "tiny" and float(row["ms"]) > 0
    for mode in ("forward", "forward+backward"):
        mok = by_key[(mok_name, mode)]
        # checked against the reference on the group before it was timed
        assert float(mok["max_rel_err"]) <= TOLERANCES[torch.bfloat16].max_rel
        ratio = float(mok["ms"]) / float(by_key[(compute_name, mode)]["ms"])
        assert float(mok["vs_compute_only"]) == pytest.approx(ratio, rel=1e-2)
    assert (tmp_path / "ep.png").stat().st_size > 0


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
