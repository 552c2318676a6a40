"""benchmarks.step: the kernel kinds its profile sums (the timing itself needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import step


def test_kernel_kinds():
    names = step.mok_kernel_names()
    assert {"gate_up_swiglu_kernel", "down_proj_kernel", "combine_kernel"} <= names
    assert step.kind_of("gate_up_swiglu_kernel", names) == "mok"
    assert step.kind_of("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", names) == "gemm"
    assert step.kind_of("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>", names) \
        == "attention"
    assert step.kind_of("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
                        names) == "optimizer"
    assert step.kind_of("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add>",
                        names) == "other"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a GPU")
def test_needs_a_gpu():
    with pytest.raises(SystemExit, match="no GPU"):
        step.main(["--no-csv"])
