"""Blockwise float8_e4m3fn quantization (DeepSeek's recipe): one fp32 scale per block.

Blocks are [BLOCK_M, BLOCK_K] tiles of a [M, K] matrix (batched over the grid's third axis).
ROW_SCALES: a scale per row of the tile (1 x BLOCK_K blocks, activations); else one per tile
(BLOCK_M x BLOCK_K blocks, weights). For a block with amax = max |x| (NaN ignored):

    scale = amax / 448, q = e4m3(x * (448 / amax))              (POW2 off)
    scale = 2 ** ceil(log2(amax / 448)), q = e4m3(x * (1 / scale))  (POW2)

with correctly rounded fp32 divisions, e4m3 rounding to nearest even and saturating at +-448; a
block of zeros has scale 1, and amax is taken at least AMAX_FLOOR = 448 * 2**-126 (the scale
then at least fp32's smallest normal, 448 / amax finite: below it the division would overflow
and turn the block's zeros into NaN). A NaN stays NaN; an inf makes its block's scale inf (the
block dequantizes to NaN). x = q * scale up to e4m3's rounding.
"""

import triton
import triton.language as tl

from mok.kernels.common import E4M3_MAX, abs_max, to_e4m3

AMAX_FLOOR = tl.constexpr(448.0 * 2.0 ** -126)  # the least amax a block's scale is taken from


@triton.jit
def _block_scale(amax, POW2: tl.constexpr):
    """(scale, 1 / scale as the quantization multiplies by it) of blocks with this amax."""
    amax = tl.where(amax == 0.0, E4M3_MAX, tl.maximum(amax, AMAX_FLOOR))  # zeros: scale 1
    if POW2:
        ratio = tl.math.div_rn(amax, E4M3_MAX).to(tl.uint32, bitcast=True)
        exponent = (ratio >> 23) + ((ratio & 0x7FFFFF) != 0).to(tl.uint32)
        scale = (exponent << 23).to(tl.float32, bitcast=True)
        return scale, tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), scale)
    return (tl.math.div_rn(amax, E4M3_MAX),
            tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax))


@triton.jit
def quantize_tile(x, ROW_SCALES: tl.constexpr, POW2: tl.constexpr, UPCAST: tl.constexpr):
    """(e4m3 q, scale) of an fp32 tile: a scale per row (ROW_SCALES) or one for the tile, from
    the amax with NaN left out (the module's rule)."""
    if ROW_SCALES:
        scale, inverse = _block_scale(abs_max(x, 1, UPCAST), POW2)
        scaled = x * inverse[:, None]
    else:
        scale, inverse = _block_scale(tl.max(abs_max(x, 1, UPCAST), axis=0), POW2)
        scaled = x * inverse
    return to_e4m3(scaled, UPCAST), scale


@triton.jit
def quantize_e4m3_kernel(
    x_ptr, q_ptr, scale_ptr, qt_ptr, scale_t_ptr, M, K,
    stride_xb, stride_xm, stride_xk, stride_qb, stride_qm, stride_sb, stride_sm,
    stride_qtb, stride_qtk, stride_stb, stride_stk,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ROW_SCALES: tl.constexpr,
    POW2: tl.constexpr, TRANSPOSED: tl.constexpr, UPCAST: tl.constexpr,
):
    """q[b, m, k] (unit column stride) and scale[b, m, k // BLOCK_K] (ROW_SCALES) or
    scale[b, m // BLOCK_M, k // BLOCK_K] from x[b, m, k]; a program per tile. TRANSPOSED (tile
    scales): also q's transpose qt[b, k, m] (unit column stride) and the scales' transpose
    scale_t[b, k // BLOCK_K, m // BLOCK_M]; the tile's codes are read back from q for it (a
    transpose of the quantized tile itself made the compiler quantize the tile twice, once in
    each layout)."""
    pid_m, pid_k, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x_base = x_ptr + batch.to(tl.int64) * stride_xb
    x = tl.load(x_base + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :] * stride_xk,
                mask=mask, other=0.0).to(tl.float32)
    q, scale = quantize_tile(x, ROW_SCALES, POW2, UPCAST)
    scale_base = scale_ptr + batch.to(tl.int64) * stride_sb
    if ROW_SCALES:
        tl.store(scale_base + rows * stride_sm + pid_k, scale, mask=rows < M)
    else:
        tl.store(scale_base + pid_m * stride_sm + pid_k, scale)
    q_base = q_ptr + batch.to(tl.int64) * stride_qb
    tl.store(q_base + rows.to(tl.int64)[:, None] * stride_qm + cols[None, :], q, mask=mask)
    if TRANSPOSED:
        tl.store(scale_t_ptr + batch.to(tl.int64) * stride_stb + pid_k * stride_stk + pid_m,
                 scale)
        tl.debug_barrier()  # the tile's codes stored by every thread, visible to all of them
        codes = tl.load(q_base + rows.to(tl.int64)[:, None] * stride_qm + cols[None, :],
                        mask=mask, cache_modifier=".cg")  # from L2, past any stale L1 line
        qt_base = qt_ptr + batch.to(tl.int64) * stride_qtb
        tl.store(qt_base + cols.to(tl.int64)[:, None] * stride_qtk + rows[None, :],
                 tl.trans(codes), mask=tl.trans(mask))
