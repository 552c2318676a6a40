"""The expert GEMMs compiled for Hopper (sm_90) with Triton's bundled ptxas, no GPU needed
(scripts/sm90_compile.py), the launches that pull rows under expert parallelism and the FP8
launches (the quantization kernel, whose runs have no product, included):
every tile variant compiles, the products are wgmma, TMA appears
exactly where asked, nothing spills, and the weight gradients keep the pipeline depth their
stages ask for (a load of the same iteration feeding a gathered address used to cost a stage)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "sm90_compile.py"), "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    return {f"{row['label']} #{i}": row for i, row in enumerate(rows)}


# Launches without a product: the FP8 dSwiGLU's second launch when it runs apart (the
# quantizing launches are labelled "quantize ...").
ELEMENTWISE = ("fp8_dswiglu_rows_kernel",)


def _has_product(name: str, row: dict) -> bool:
    return not name.startswith("quantize") and row["kernel"] not in ELEMENTWISE


def test_every_variant_compiles_to_wgmma_without_spills(compiled):
    assert len(compiled) >= 20
    for name, row in compiled.items():
        assert "error" not in row, (name, row.get("error"))
        assert row["wgmma"] == _has_product(name, row), name
        assert row["spills"] == 0, name
        if " fp8 gluon" in name:
            # The FP8 Gluon kernels keep a few registers on the stack: at most 24 bytes (the
            # pre-activations with a limit).
            assert row["stack"] <= 32, name
        elif " gluon" in name:  # spills to the stack frame too (some Triton tiles have a few)
            assert row["stack"] == 0, name
        assert row["shared_kb"] <= 227, name  # what one H100/H200 CTA may hold


def test_tma_where_asked(compiled):
    for name, row in compiled.items():
        assert row["tma"] == (" tma" in name and _has_product(name, row)), name


def test_weight_gradients_keep_a_buffer_per_stage(compiled):
    # The weight gradient of gate or up (x gathered, on one GPU as under expert parallelism):
    # A and B tiles of bf16 take (block_m + block_n) * block_k * 2 bytes a stage, and the
    # software pipeline must hold one set per stage.
    checked = 0
    for name, row in compiled.items():
        if name.split(" #")[0] in ("wgrad_gate_up", "wgrad_gate_up tuned"):
            per_stage = (row["block_m"] + row["block_n"]) * row["block_k"] * 2 / 1024
            assert row["shared_kb"] >= row["stages"] * per_stage, (name, row)
            checked += 1
    assert checked >= 2


def test_gluon_quantize_row_blocks_transposes_without_shared_memory(compiled):
    # mok.kernels.gluon_quantize: the codes leave each thread transposed, so shared memory
    # holds only the columns' amax and scales (a few hundred bytes), where the Triton kernel
    # moves its [128, 64] e4m3 tile through it (8 KB); fewer registers than the Triton kernel.
    rows = {name.split(" #")[0]: row for name, row in compiled.items()
            if name.startswith("quantize rows fp8 for weight gradients")}
    triton = rows["quantize rows fp8 for weight gradients"]
    assert triton["shared_kb"] >= 8
    gluon = [row for name, row in rows.items() if "gluon" in name]
    assert len(gluon) == 4  # by token, by row, from e4m3 codes by token and in halves
    for row in gluon:
        assert row["kernel"] == "quantize_row_blocks_kernel"
        assert row["shared_kb"] <= 1 and row["regs"] < triton["regs"], row
