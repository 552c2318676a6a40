"""The FP8 weight gradients' operands quantized along the rows, for Hopper (sm_90), in Gluon;
GPUs only (Gluon kernels do not run under Triton's interpreter).

- quantize_row_blocks_kernel: mok.kernels.fp8_wgrad's, the same codes and scales bit for bit:
  a program per block slot and BLOCK_N columns, codes stored transposed (qa [N, C], each
  column's rows contiguous).
- dswiglu_rows_kernel: the FP8 dSwiGLU's second launch with d_gate_up and h quantized along
  the rows in the same launch, instead of written in 16 bits for two launches of the first.

What differs from the Triton kernels is where the values sit (tile_layouts): a thread holds a
few consecutive rows of a few consecutive columns, the lanes of a warp run mostly along the
rows and the warps along the columns. A row's columns of a thread are read at a time, each
column's amax is reduced within the thread and across the warp's lanes (shuffles), the
scales' divisions run a column a thread, and each column's codes of a thread leave in one
vector store: the transpose costs no shared memory. mok.ops picks the threads (8 rows of 8
columns and 4 warps for quantize_row_blocks; 8 rows of one column and 8 warps over
dswiglu_rows_kernel's [128, 16] steps).
"""

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from mok.kernels import gluon_activation as activation
from mok.kernels.gluon_fp8 import _row_amax, _scales, _to_e4m3

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
    router_weights_ptr, N, topk: gl.constexpr, num_experts, stride_src, stride_q, stride_s,
    GATHER: gl.constexpr, WEIGHTED: gl.constexpr, ALIGN: gl.constexpr, SUB: gl.constexpr,
    BLOCK_N: gl.constexpr, BY_ROW: gl.constexpr, BY_COL: gl.constexpr,
):
    """q[n, r] and scale[slot, n] of block slot program_id(0), columns program_id(1) * BLOCK_N
    onward (mok.kernels.fp8_wgrad.quantize_row_blocks_kernel's; topk a constant, so that a
    token's row is found without a division instruction); the tile distributed as tile_layouts
    says."""
    row_of: gl.constexpr = gl.SliceLayout(1, BY_ROW)
    col_of: gl.constexpr = gl.SliceLayout(0, BY_ROW)
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
    cols = gl.program_id(1) * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_of)
    in_n = cols < N
    x = gl.load(src_ptr + src[:, None] * stride_src + cols[None, :],
                mask=valid[:, None] & in_n[None, :], other=0.0).to(gl.float32)
    if WEIGHTED:
        x *= gl.load(router_weights_ptr + route, mask=valid, other=0.0)[:, None]
    _along_rows(x, rows, cols, N, q_ptr, stride_q, scale_ptr + slot.to(gl.int64) * stride_s,
                rows < end, BY_ROW, BY_COL)


@gluon.jit
def _along_rows(x, rows, cols, N, q_ptr, stride_q, scale_ptr, store_rows, BY_ROW: gl.constexpr,
                BY_COL: gl.constexpr):
    """x [128, BLOCK_N] (BY_ROW; rows and cols its indices) in e4m3 with a scale per column
    (mok.kernels.quantize's rule over the 128 rows): the codes transposed, q[col, row] at
    q_ptr + col * stride_q + row for the rows in store_rows and the columns below N, the
    scales at scale_ptr + col."""
    col_of: gl.constexpr = gl.SliceLayout(0, BY_ROW)
    # a column a thread for the scales' divisions (after the reduction a column's amax is in
    # each of its lanes)
    one_col: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    largest = gl.convert_layout(gl.max(gl.abs(x), axis=0), one_col)
    # max.f32 leaves NaN out unless all are NaN
    scale, inverse = _scales(gl.where(largest == largest, largest, 0.0))
    # to e4m3 by column: a cast packs a thread's consecutive rows, as the stores take them
    q = gl.convert_layout(x * gl.convert_layout(inverse, col_of)[None, :], BY_COL)
    q = q.to(gl.float8e4nv)
    cols_s = gl.convert_layout(cols, one_col)
    gl.store(scale_ptr + cols_s, scale, mask=cols_s < N)
    rows_c = gl.convert_layout(rows, gl.SliceLayout(1, BY_COL))
    cols_c = gl.convert_layout(cols, gl.SliceLayout(0, BY_COL))
    keep = gl.convert_layout(store_rows, gl.SliceLayout(1, BY_COL))
    gl.store(q_ptr + cols_c.to(gl.int64)[None, :] * stride_q + rows_c[:, None], q,
             mask=keep[:, None] & (cols_c < N)[None, :])


@gluon.jit
def dswiglu_rows_kernel(
    dh0_ptr, gate_up_ptr, row_route_ptr, used_rows_ptr, router_weights_ptr, out_ptr,
    out_scale_ptr, partial_ptr, dgu_q_ptr, dgu_scale_ptr, h_q_ptr, h_scale_ptr, N, stride_dm,
    stride_gum, stride_om, stride_osm, stride_pm, stride_dq, stride_ds, stride_hq, stride_hs,
    WEIGHTED: gl.constexpr, BY_VALUE: gl.constexpr, BY_ROW: gl.constexpr,
    BY_COL: gl.constexpr,
):
    """The FP8 dSwiGLU's second launch (mok.kernels.fp8_gemm.fp8_dswiglu_rows_kernel, without
    a SwiGLU limit) over a [128, 128] block a program (the row block's column blocks next to
    each other), with the weight gradients' operands quantized along the rows in the same
    pass, for a schedule whose experts' rows start at multiples of 128 (a row block is a scale
    slot of one expert). From dh0 [C, N] fp32 and the kept pre-activations gate_up [C, 2N]:
    d_gate_up in e4m3 with 1 x 128 scales into out / out_scale (d_x's operand, as that kernel
    stores it), the router-weight gradient's partial sums (WEIGHTED), and d_gate_up and h as
    mok.ops.quantize_row_blocks makes them from the 16-bit d_gate_up and h that kernel stores
    (rounded to gate_up's dtype first): codes [2N, C] and [N, C] transposed, scales
    [C / 128, 2N] and [C / 128, N]. Nothing 16-bit is written.
    The block goes by BY_ROW's columns twice. The first pass quantizes d_gate, d_up and h
    along the rows and takes each row's amax of d_gate and d_up; the second computes d_gate
    and d_up again (the same instructions, the same values) and stores their 1 x 128 codes.
    BY_VALUE lays out the values as they are loaded and computed, BY_ROW / BY_COL as
    _along_rows quantizes them."""
    value_rows: gl.constexpr = gl.SliceLayout(1, BY_VALUE)
    value_cols: gl.constexpr = gl.SliceLayout(0, BY_VALUE)
    CHUNK: gl.constexpr = BY_ROW.shape[1]
    column_blocks = gl.cdiv(N, 128)
    pid = gl.program_id(0)
    pid_m, pid_n = pid // column_blocks, pid % column_blocks
    if pid_m * ROWS >= gl.load(used_rows_ptr):
        return
    rows = pid_m * ROWS + gl.arange(0, ROWS, layout=value_rows)
    route = gl.load(row_route_ptr + rows)
    valid = route >= 0
    rows64 = rows.to(gl.int64)
    weight = gl.full([ROWS], 1.0, gl.float32, value_rows)
    if WEIGHTED:
        weight = gl.load(router_weights_ptr + route, mask=valid, other=0.0)
    dtype: gl.constexpr = gate_up_ptr.dtype.element_ty
    rows_t = pid_m * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, BY_ROW))
    every = rows_t >= 0
    slot = pid_m.to(gl.int64)
    amax_gate = gl.zeros([ROWS], gl.float32, value_rows)
    amax_up = gl.zeros([ROWS], gl.float32, value_rows)
    products = gl.zeros([ROWS, CHUNK], gl.float32, BY_VALUE)  # summed over the chunks
    for chunk in range(128 // CHUNK):
        first = pid_n * 128 + chunk * CHUNK
        dh0, d_gate, d_up, h = _dswiglu_values(dh0_ptr, gate_up_ptr, rows64, valid, weight,
                                               first, N, stride_dm, stride_gum, WEIGHTED,
                                               BY_VALUE, CHUNK)
        if WEIGHTED:
            products += dh0 * h
        amax_gate = gl.maximum(amax_gate, _row_amax(d_gate))
        amax_up = gl.maximum(amax_up, _row_amax(d_up))
        cols_t = first + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, BY_ROW))
        _along_rows(gl.convert_layout(d_gate.to(dtype).to(gl.float32), BY_ROW), rows_t, cols_t,
                    N, dgu_q_ptr, stride_dq, dgu_scale_ptr + slot * stride_ds, every, BY_ROW,
                    BY_COL)
        _along_rows(gl.convert_layout(d_up.to(dtype).to(gl.float32), BY_ROW), rows_t, cols_t,
                    N, dgu_q_ptr + N * stride_dq, stride_dq,
                    dgu_scale_ptr + slot * stride_ds + N, every, BY_ROW, BY_COL)
        _along_rows(gl.convert_layout(h.to(dtype).to(gl.float32), BY_ROW), rows_t, cols_t, N,
                    h_q_ptr, stride_hq, h_scale_ptr + slot * stride_hs, every, BY_ROW, BY_COL)
    if WEIGHTED:
        gl.store(partial_ptr + rows64 * stride_pm + pid_n, gl.sum(products, axis=1))
    # d_x's operand: a scale per row and 128 columns (d_up's blocks after d_gate's, its codes
    # from column 128 * column_blocks)
    scale_gate, inverse_gate = _scales(amax_gate)
    scale_up, inverse_up = _scales(amax_up)
    scale_ptrs = out_scale_ptr + rows64 * stride_osm + pid_n
    gl.store(scale_ptrs, scale_gate)
    gl.store(scale_ptrs + column_blocks, scale_up)
    for chunk in range(128 // CHUNK):
        first = pid_n * 128 + chunk * CHUNK
        _, d_gate, d_up, _ = _dswiglu_values(dh0_ptr, gate_up_ptr, rows64, valid, weight, first,
                                             N, stride_dm, stride_gum, WEIGHTED, BY_VALUE,
                                             CHUNK)
        cols = first + gl.arange(0, CHUNK, layout=value_cols)
        out_ptrs = out_ptr + rows64[:, None] * stride_om + cols[None, :]
        gl.store(out_ptrs, _to_e4m3(d_gate, inverse_gate))
        gl.store(out_ptrs + column_blocks * 128, _to_e4m3(d_up, inverse_up))


@gluon.jit
def _dswiglu_values(dh0_ptr, gate_up_ptr, rows64, valid, weight, first, N, stride_dm,
                    stride_gum, WEIGHTED: gl.constexpr, BY_VALUE: gl.constexpr,
                    CHUNK: gl.constexpr):
    """(dh0, d_gate, d_up, h) of the rows' CHUNK columns from `first` on (BY_VALUE), 0 outside
    the valid rows and the N columns (h: silu(0) * 0 there)."""
    cols = first + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, BY_VALUE))
    keep = valid[:, None] & (cols < N)[None, :]
    dh0 = gl.load(dh0_ptr + rows64[:, None] * stride_dm + cols[None, :], mask=keep, other=0.0)
    ptrs = gate_up_ptr + rows64[:, None] * stride_gum + cols[None, :]
    gate = gl.load(ptrs, mask=keep, other=0.0).to(gl.float32)
    up = gl.load(ptrs + N, mask=keep, other=0.0).to(gl.float32)
    sig, silu = activation.silu(gate)
    h = silu * up
    d_h = dh0
    if WEIGHTED:
        d_h = dh0 * weight[:, None]
    d_gate, d_up = activation.dswiglu(d_h, gate, up, sig, silu)
    return dh0, gl.where(keep, d_gate, 0.0), gl.where(keep, d_up, 0.0), h
