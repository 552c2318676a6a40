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


def test_the_quantize_check_compares_what_the_kernel_writes(device):
    # quantize_row_blocks leaves its buffers past the rows in use (and, at alignments below
    # 128, the unused scale slots) as allocated: the benchmark's bit-for-bit check of the
    # Gluon kernel against the Triton one compares the rest, whatever those bytes hold.
    import torch

    from benchmarks.fp8 import _written
    from mok.ops.fp8_wgrad import quantize_row_blocks

    from ..ops.test_fp8_wgrad import schedule

    routing, _ = schedule(device, tokens=150, experts=3, topk=2, align=16, seed=1)
    src = torch.randn(150, 96, generator=torch.Generator().manual_seed(3)).bfloat16().to(device)
    first, second = (quantize_row_blocks(src, routing, gather=True) for _ in range(2))
    for quantized in (first, second):
        quantized.data.view(torch.uint8)[:, int(routing.expert_offsets[-1]):] = 7
    second.data.view(torch.uint8)[:, int(routing.expert_offsets[-1]):] = 9
    taken = torch.zeros(second.scales.shape[0], dtype=torch.bool)
    offsets = routing.expert_offsets.tolist()
    for start, end in zip(offsets[:-1], offsets[1:], strict=True):
        taken[start // 16:start // 16 + -(-(end - start) // 128)] = True
    assert not taken.all()  # at align 16 some slots take no block of 128 rows
    second.scales[~taken.to(device)] = float("nan")
    codes, scales = _written(first, routing)
    again = _written(second, routing)
    assert torch.equal(codes, again[0]) and torch.equal(scales, again[1])
    assert codes.shape == (96, int(routing.expert_offsets[-1]))
