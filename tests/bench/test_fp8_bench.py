"""`python -m benchmarks.fp8` end to end on its small shape (under the interpreter on CPU)."""

import csv

from benchmarks import fp8

from ..conftest import DEVICE


def test_fp8_benchmark_checks_and_writes_its_rows(tmp_path, capsys):
    out = tmp_path / "fp8.csv"
    fp8.main(["--shapes", fp8.SMALL.name, "--repeats", "1", "--warmup", "0", "--csv", str(out)])
    rows = list(csv.DictReader(out.open()))
    stages = {(row["stage"], row["impl"]) for row in rows}
    assert {("quantize", "rows_x"), ("quantize", "weights"), ("gate_up", "mok_bf16"),
            ("gate_up", "mok_fp8"), ("down", "mok_bf16"), ("down", "mok_fp8"),
            ("d_x", "mok_fp8"), ("quantize", "experts"), ("wgrad_down", "mok_bf16"),
            ("wgrad_down", "mok_fp8"), ("wgrad_gate_up", "mok_fp8_gemm_only"),
            ("quantize_rows_x", "row_blocks"), ("quantize_rows_d_out", "row_blocks")} <= stages
    # Checked against the math on dequantized operands: fp32 sums under the interpreter; on a
    # GPU the tensor cores sum each K step's e4m3 products with fewer bits (up to 8.3e-4 of the
    # largest output measured, tests/gpu/test_fp8_gluon.py).
    bound = 2e-3 if DEVICE.type == "cuda" else 1e-5
    for row in rows:
        assert row["shape"] == fp8.SMALL.name and float(row["ms"]) > 0
        assert row["timing"] == "idle"
        if row["impl"] == "mok_fp8":
            assert float(row["max_rel_err"]) < bound, row
    assert "check against dequantized math" in capsys.readouterr().out
