"""`python -m mok bench --ep 2` end to end on CPU processes (the tiny shape, interpreter)."""

import csv

import pytest
import torch

from benchmarks import ep
from mok.testing.tolerance import TOLERANCES


@pytest.mark.timeout(600)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is the real benchmark")
def test_ep_bench_runs_on_cpu_and_checks_before_timing(tmp_path):
    path = tmp_path / "ep.csv"
    ep.main(["--ep", "2", "--csv", str(path), "--iters", "1", "--warmup", "0"])
    rows = list(csv.DictReader(path.open()))
    assert set(rows[0]) == set(ep.CSV_FIELDS)
    by_key = {(row["impl"], row["mode"]): row for row in rows}
    expected = {("compute_only", "forward"), ("compute_only", "forward+backward"),
                ("mok", "forward"), ("mok", "forward+backward"), ("mok", "dispatch"),
                ("mok", "down_scatter"), ("mok", "down_local")}
    assert expected <= set(by_key)
    for row in rows:
        assert row["ep"] == "2" and row["shape"] == "tiny" and float(row["ms"]) > 0
    for mode in ("forward", "forward+backward"):
        mok = by_key[("mok", mode)]
        # checked against the reference on the group before it was timed
        assert float(mok["max_rel_err"]) <= TOLERANCES[torch.bfloat16].max_rel
        ratio = float(mok["ms"]) / float(by_key[("compute_only", mode)]["ms"])
        assert float(mok["vs_compute_only"]) == pytest.approx(ratio, rel=1e-2)
