"""The weight gradients' operands quantized along the rows (mok.kernels.fp8_wgrad's
quantize_row_blocks_kernel) for Hopper (sm_90), in Gluon; GPUs only (Gluon kernels do not run
under Triton's interpreter).

The same codes and scales as the Triton kernel, bit for bit: a program per block slot and
BLOCK_N columns, codes stored transposed (qa [N, C], each column's rows contiguous). What
differs is where the values sit (tile_layouts): a thread holds a few consecutive rows of a few
consecutive columns, the lanes of a warp run mostly along the rows and the warps along the
columns. The source is read a row's columns of a thread at a time, each column's amax is
reduced within the thread and across the warp's lanes (shuffles), the scales' divisions run a
column a thread, and each column's codes of a thread leave in one vector store: the
transpose costs no shared memory. A source of e4m3 codes (CODES) is dequantized by one scale
a row: a program's columns lie in one block of 128 of the source. mok.ops.fp8_wgrad picks the
threads (8 rows of 8 columns, 4 warps).
"""

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from mok.kernels.gluon_fp8 import _scales

ROWS = gl.constexpr(128)  # the scales' block along the rows (mok.kernels.fp8_wgrad.ROWS)


@functools.cache
def tile_layouts(rows_per_thread: int, cols_per_thread: int, num_warps: int):
    """(by_row, by_col): the distribution of a [128, BLOCK_N] tile, BLOCK_N = cols_per_thread
    * lanes along the columns * num_warps: a thread holds rows_per_thread consecutive rows of
    cols_per_thread consecutive columns, 128 / rows_per_thread lanes along the rows, the rest of
    the warp's 32 along the columns, the warps along the columns. The two are the same threads
    and values, by_row with a thread's registers along its columns (the loads' vectors), by_col
    along its rows (the stores' vectors). Remembered per arguments."""
    def bits(n):
        return [1 << i for i in range(n.bit_length() - 1)]

    lanes_r = ROWS.value // rows_per_thread
    lanes_c = 32 // lanes_r
    regs_c = [[0, c] for c in bits(cols_per_thread)]
    regs_r = [[r, 0] for r in bits(rows_per_thread)]
    lanes = ([[0, cols_per_thread * c] for c in bits(lanes_c)]
             + [[rows_per_thread * r, 0] for r in bits(lanes_r)])
    warps = [[0, cols_per_thread * lanes_c * w] for w in bits(num_warps)]
    shape = [ROWS.value, cols_per_thread * lanes_c * num_warps]
    return (gl.DistributedLinearLayout(regs_c + regs_r, lanes, warps, [], shape),
            gl.DistributedLinearLayout(regs_r + regs_c, lanes, warps, [], shape))


@gluon.jit
def quantize_row_blocks_kernel(
    src_ptr, q_ptr, scale_ptr, row_route_ptr, block_expert_ptr, expert_offsets_ptr,
    router_weights_ptr, src_scale_ptr, N, half, gap, topk: gl.constexpr, num_experts,
    stride_src, stride_q, stride_s, stride_src_s,
    GATHER: gl.constexpr, WEIGHTED: gl.constexpr, CODES: gl.constexpr, ALIGN: gl.constexpr,
    SUB: gl.constexpr, BLOCK_N: gl.constexpr, BY_ROW: gl.constexpr, BY_COL: gl.constexpr,
):
    """q[n, r] and scale[slot, n] of block slot program_id(0), columns program_id(1) * BLOCK_N
    onward (mok.kernels.fp8_wgrad.quantize_row_blocks_kernel's; topk a constant, so that a
    token's row is found without a division instruction); the tile distributed as tile_layouts
    says. CODES: half a multiple of BLOCK_N, so that a program's columns share one source
    scale a row."""
    row_of: gl.constexpr = gl.SliceLayout(1, BY_ROW)
    col_of: gl.constexpr = gl.SliceLayout(0, BY_ROW)
    # a column a thread for the scales' divisions (after the reduction a column's amax is in
    # each of its lanes)
    one_col: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    slot = gl.program_id(0)
    expert = gl.load(block_expert_ptr + (slot * SUB) // ALIGN)
    safe = gl.maximum(expert, 0)
    used = gl.load(expert_offsets_ptr + num_experts)
    end = gl.multiple_of(gl.minimum(gl.load(expert_offsets_ptr + safe + 1), used), SUB)
    start = gl.multiple_of(gl.minimum(gl.load(expert_offsets_ptr + safe), end), SUB)
    first = start + (slot - start // SUB) * ROWS
    if (expert < 0) | (first >= end):
        return
    rows = first + gl.arange(0, ROWS, layout=row_of)
    mine = rows < end
    route = gl.load(row_route_ptr + rows, mask=mine, other=-1)
    valid = route >= 0
    if GATHER:
        src = (route // topk).to(gl.int64)
    else:
        src = rows.to(gl.int64)
    first_col = gl.program_id(1) * BLOCK_N
    cols = first_col + gl.arange(0, BLOCK_N, layout=col_of)
    in_n = cols < N
    load = valid[:, None] & in_n[None, :]
    if CODES:
        shift = 0
        if first_col >= half:
            shift = gap
        x = gl.load(src_ptr + src[:, None] * stride_src + (cols + shift)[None, :], mask=load,
                    other=0.0).to(gl.float32)
        x *= gl.load(src_scale_ptr + src * stride_src_s + (first_col + shift) // 128,
                     mask=valid, other=0.0)[:, None]
    else:
        x = gl.load(src_ptr + src[:, None] * stride_src + cols[None, :], mask=load,
                    other=0.0).to(gl.float32)
    if WEIGHTED:
        x *= gl.load(router_weights_ptr + route, mask=valid, other=0.0)[:, None]
    largest = gl.convert_layout(gl.max(gl.abs(x), axis=0), one_col)
    # max.f32 leaves NaN out unless all are NaN
    scale, inverse = _scales(gl.where(largest == largest, largest, 0.0))
    # to e4m3 by column: a cast packs a thread's consecutive rows, as the stores take them
    q = gl.convert_layout(x * gl.convert_layout(inverse, col_of)[None, :], BY_COL)
    q = q.to(gl.float8e4nv)
    cols_s = gl.convert_layout(cols, one_col)
    gl.store(scale_ptr + slot.to(gl.int64) * stride_s + cols_s, scale, mask=cols_s < N)
    rows_c = gl.convert_layout(rows, gl.SliceLayout(1, BY_COL))
    cols_c = gl.convert_layout(cols, gl.SliceLayout(0, BY_COL))
    gl.store(q_ptr + cols_c.to(gl.int64)[None, :] * stride_q + rows_c[:, None], q,
             mask=(rows_c < end)[:, None] & (cols_c < N)[None, :])
