"""Blockwise float8_e4m3fn quantization launchers (mok.kernels.quantize): activations with a
scale per 1 x 128 block of a row, weights with one per 128 x 128 block; rows can also be packed,
each row's codes and scales in one byte row (what expert parallelism moves)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from mok import _env
from mok.errors import MoKInputError
from mok.kernels import quantize as kernels
from mok.ops.launch import cdiv, launch

QUANT_BLOCK = 128  # the scales' block: 1 x 128 for rows, 128 x 128 for weights
_ROWS_PER_PROGRAM = 32
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Quantized(NamedTuple):
    """A float8_e4m3fn tensor and its fp32 scales, one per block (x = data * scale)."""

    data: torch.Tensor
    scales: torch.Tensor


def quantize_rows(x: torch.Tensor, *, pow2_scales: bool = False) -> Quantized:
    """(q [M, K] float8_e4m3fn, scales [M, ceil(K / 128)] fp32) of x [M, K]: a scale per 128
    columns of a row (mok.reference.quantize_e4m3 with block (1, 128)); pow2_scales: scales are
    powers of two."""
    _check(x, "x", dims=(2,))
    return _quantize(x.unsqueeze(0), rows=1, pow2_scales=pow2_scales, squeeze=True)


def packed_row_bytes(width: int) -> int:
    """Bytes of one packed row of `width` columns (unpack_rows): the e4m3 codes, then the fp32
    scales, each part starting at a multiple of 16 bytes."""
    return _round16(_round16(width) + 4 * cdiv(width, QUANT_BLOCK))


def unpack_rows(packed: torch.Tensor, width: int) -> Quantized:
    """The codes [M, width] float8_e4m3fn and scales [M, ceil(width / 128)] fp32 of packed
    rows, as views of `packed` [M, >= packed_row_bytes(width)] uint8 (rows 16-byte aligned):
    each row's codes, then from the next multiple of 16 bytes its scales."""
    start = _round16(width)
    if (packed.dtype != torch.uint8 or packed.dim() != 2 or packed.stride(1) != 1
            or packed.shape[1] < packed_row_bytes(width) or packed.stride(0) % 16
            or packed.storage_offset() % 16):
        raise MoKInputError(f"packed rows must be uint8 [M, >= {packed_row_bytes(width)}] with "
                            "rows starting at multiples of 16 bytes")
    blocks = cdiv(width, QUANT_BLOCK)
    return Quantized(packed[:, :width].view(torch.float8_e4m3fn),
                     packed[:, start:start + 4 * blocks].view(torch.float32))


def _round16(n: int) -> int:
    return cdiv(n, 16) * 16


def quantize_weights(w: torch.Tensor, *, pow2_scales: bool = False) -> Quantized:
    """(q [..., N, K] float8_e4m3fn, scales [..., ceil(N / 128), ceil(K / 128)] fp32) of w
    [E, N, K] or [N, K]: a scale per 128 x 128 block of each expert's matrix
    (mok.reference.quantize_e4m3 with block (128, 128))."""
    _check(w, "w", dims=(2, 3))
    batched = w if w.dim() == 3 else w.unsqueeze(0)
    return _quantize(batched, rows=QUANT_BLOCK, pow2_scales=pow2_scales, squeeze=w.dim() == 2)


def _check(x: torch.Tensor, name: str, *, dims: tuple[int, ...]) -> None:
    if x.dim() not in dims:
        raise MoKInputError(f"{name} must have {' or '.join(map(str, dims))} dimensions, got "
                            f"shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise MoKInputError(f"{name} must be bf16, fp16 or fp32 to quantize, got {x.dtype}")


def quantize_weights_into(w: torch.Tensor, transposed: Quantized, *,
                          pow2_scales: bool = False) -> Quantized:
    """quantize_weights of w [E, N, K], also writing the transpose of its codes and scales into
    `transposed` (data [E, K, >= N] e4m3 with unit column stride, scales [E, ceil(K / 128),
    >= ceil(N / 128)] fp32, views into larger buffers allowed): what quantize_weights of w
    transposed gives, from one read of w."""
    _check(w, "w", dims=(3,))
    e, n, k = w.shape
    data, scales = transposed
    if (data.dtype != torch.float8_e4m3fn or data.dim() != 3 or data.shape[:2] != (e, k)
            or data.shape[2] < n or data.stride(2) != 1 or scales.dtype != torch.float32
            or scales.dim() != 3 or scales.shape[:2] != (e, cdiv(k, QUANT_BLOCK))
            or scales.shape[2] < cdiv(n, QUANT_BLOCK)):
        raise MoKInputError(f"the transposed copy of w {tuple(w.shape)} must be e4m3 [E, K, >= N] "
                            "with unit column stride and fp32 scales [E, K / 128, >= N / 128]")
    return _quantize(w, rows=QUANT_BLOCK, pow2_scales=pow2_scales, squeeze=False,
                     transposed=transposed)


def _quantize(x: torch.Tensor, *, rows: int, pow2_scales: bool, squeeze: bool,
              transposed: Quantized | None = None) -> Quantized:
    batch, m, k = x.shape
    q = torch.empty(batch, m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale_rows = m if rows == 1 else cdiv(m, rows)
    scales = torch.empty(batch, scale_rows, cdiv(k, QUANT_BLOCK), dtype=torch.float32,
                         device=x.device)
    qt, scales_t = transposed if transposed is not None else (q, scales)
    block_m = _ROWS_PER_PROGRAM if rows == 1 else rows
    if x.numel() > 0:
        launch(kernels.quantize_e4m3_kernel, (cdiv(m, block_m), cdiv(k, QUANT_BLOCK),
                                              batch))(
            x, q, scales, qt, scales_t, m, k, x.stride(0), x.stride(1), x.stride(2),
            q.stride(0), q.stride(1), scales.stride(0), scales.stride(1), qt.stride(0),
            qt.stride(1), scales_t.stride(0), scales_t.stride(1), BLOCK_M=block_m,
            BLOCK_K=QUANT_BLOCK, ROW_SCALES=rows == 1, POW2=pow2_scales,
            TRANSPOSED=transposed is not None, UPCAST=_env.INTERPRET,
            num_warps=4 if rows == 1 else 8,
        )
    if squeeze:
        return Quantized(q[0], scales[0])
    return Quantized(q, scales)
