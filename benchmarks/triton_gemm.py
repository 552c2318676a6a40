"""A plain Triton GEMM for the `triton_dense` anchor: what Triton itself reaches on the layer's
dense-equivalent GEMMs (the `dense` anchor's, on cuBLAS), so that a gap between mok and cuBLAS
can be split into what the compiler leaves and what the MoE structure costs (gathered rows,
per-expert tiles, fused epilogues).

One tile loop per output tile, every operand through TMA descriptors, products on wgmma, a few
tile shapes autotuned per problem (an anchor, so run-to-run tile choice does not matter). Either
operand may be a transposed view: the descriptor is built over the row-major tensor underneath
and its tiles transposed in registers, as cuBLAS's transposed variants do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from mok import _env
from mok.kernels.common import cast_to, mma

UPCAST = _env.INTERPRET


def _set_boxes(nargs: dict) -> None:
    """Autotune pre-hook: each descriptor's box from the config's tile (transposed operands have
    their boxes the other way round)."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bk, bm] if nargs["A_T"] else [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk] if nargs["B_T"] else [bk, bn]
    nargs["c_desc"].block_shape = [bm, bn]


def _configs() -> list[triton.Config]:
    def config(bm, bn, bk, warps, stages):
        return triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8),
                             num_warps=warps, num_stages=stages, pre_hook=_set_boxes)

    if UPCAST:  # the interpreter: one small tile
        return [config(32, 32, 32, 4, 1)]
    return [config(128, 256, 64, 8, 3), config(256, 128, 64, 8, 3), config(128, 128, 64, 8, 4),
            config(128, 128, 64, 4, 4), config(128, 256, 64, 8, 4)]


@triton.autotune(configs=_configs(), key=["M", "N", "K", "A_T", "B_T"])
@triton.jit
def matmul_kernel(a_desc, b_desc, c_desc, M, N, K, A_T: tl.constexpr, B_T: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, UPCAST: tl.constexpr):
    """c [M, N] = a [M, K] @ b [K, N]; A_T: a_desc describes a.T ([K, M]), B_T: b_desc b.T."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    m0 = (first_m + (pid % group) % rows_in_group) * BLOCK_M
    n0 = ((pid % group) // rows_in_group) * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if A_T:
            a = a_desc.load([k0, m0]).T
        else:
            a = a_desc.load([m0, k0])
        if B_T:
            b = b_desc.load([n0, k0]).T
        else:
            b = b_desc.load([k0, n0])
        acc = mma(a, b, acc, UPCAST)
    c_desc.store([m0, n0], cast_to(acc, c_desc.dtype, UPCAST))


def _operand(t: torch.Tensor) -> tuple[TensorDescriptor, bool]:
    """A descriptor of t, or of t.T when t is a transposed view (then True); boxes set later."""
    transposed = t.stride(1) != 1
    base = t.T if transposed else t
    if base.stride(1) != 1:
        raise ValueError(f"an operand needs a unit stride, got strides {t.stride()}")
    return TensorDescriptor(base, list(base.shape), [base.stride(0), 1], [16, 16]), transposed


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] in a's dtype (fp32 accumulation); a, b row-major or transposed views
    of row-major tensors, rows 16-byte aligned."""
    (m, k), (k_b, n) = a.shape, b.shape
    if k != k_b:
        raise ValueError(f"inner sizes differ: {tuple(a.shape)} @ {tuple(b.shape)}")
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    a_desc, a_t = _operand(a)
    b_desc, b_t = _operand(b)
    c_desc = TensorDescriptor(c, [m, n], [n, 1], [16, 16])
    grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    matmul_kernel[grid](a_desc, b_desc, c_desc, m, n, k, A_T=a_t, B_T=b_t, UPCAST=UPCAST)
    return c
