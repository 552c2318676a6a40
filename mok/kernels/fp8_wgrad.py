"""The weight gradients on float8_e4m3fn operands (DeepSeek's recipe for them), in Triton.

A weight gradient sums over an expert's rows: out[e, p, q] = sum over e's rows r of
a[r, p] * b[r, q]. Both operands are quantized along the rows, in blocks of 128 rows and one
column (a scale per column and block):

    out[e, p, q] = sum over e's blocks j of (sum_{r in j} qa[p, r] * qb[q, r])
                   * a_scale[g(e, j), p] * b_scale[g(e, j), q]

Expert e's rows [start_e, end_e) (the schedule's expert_offsets) split into blocks of 128 from
start_e, the last one cut at end_e (so no block spans two experts, whatever the alignment);
block j's scales sit at g(e, j) = start_e // SUB + j, SUB = gcd(ALIGN, 128) (an expert of n
rows, n a multiple of ALIGN and so of SUB, has n / SUB >= ceil(n / 128) slots, so the experts'
scales never meet).

quantize_row_blocks_kernel: the codes transposed, qa [P, C] (each column's rows contiguous, the
K-major operand an e4m3 MMA reads), and the scales [C / SUB, P], of a source read by row or,
GATHER, by token (src row = route // topk), WEIGHTED rows scaled by their route's router weight
first; padding rows are zeros. CODES: the source is e4m3 codes with a scale per row and block
of 128 columns (mok.kernels.quantize's 1 x 128 blocks), each value dequantized first; column
p >= half reads source column p + gap (the two halves of the backward's e4m3 d_gate_up). A
program per block slot and BLOCK_N columns.

fp8_wgrad_kernel: one [BLOCK_P, BLOCK_Q] tile of one expert's gradient; each block's e4m3
product is scaled by the outer product of the two scale vectors and added to an fp32
accumulator, the blocks in order, so results are bitwise reproducible. Rows p >= SPLIT go to
out2 (row p - SPLIT): d_w_gate and d_w_up from one [d_gate, d_up] operand. UPCAST: under Triton's
CPU interpreter (mok.kernels.common).
"""

import triton
import triton.language as tl

from mok.kernels.common import abs_max, cast_to, from_e4m3, to_e4m3
from mok.kernels.fp8_gemm import _dot_e4m3
from mok.kernels.quantize import _block_scale

ROWS = tl.constexpr(128)  # the scales' block along the rows


@triton.jit
def _expert_rows(expert_offsets_ptr, expert, num_experts, SUB: tl.constexpr):
    """(start, end) of a local expert's rows, cut at the rows in use (past the capacity the
    offsets run on, the rows in use stop at it); both multiples of SUB."""
    used = tl.load(expert_offsets_ptr + num_experts)
    end = tl.multiple_of(tl.minimum(tl.load(expert_offsets_ptr + expert + 1), used), SUB)
    return tl.multiple_of(tl.minimum(tl.load(expert_offsets_ptr + expert), end), SUB), end


@triton.jit
def _slot_rows(block_expert_ptr, expert_offsets_ptr, slot, num_experts, ALIGN: tl.constexpr,
               SUB: tl.constexpr):
    """(first row, end of its expert's rows, whether a block uses it) of the block at `slot`."""
    expert = tl.load(block_expert_ptr + (slot * SUB) // ALIGN)
    start, end = _expert_rows(expert_offsets_ptr, tl.maximum(expert, 0), num_experts, SUB)
    row = start + (slot - start // SUB) * ROWS
    return row, end, (expert >= 0) & (row < end)


@triton.jit
def quantize_row_blocks_kernel(
    src_ptr, q_ptr, scale_ptr, row_route_ptr, block_expert_ptr, expert_offsets_ptr,
    router_weights_ptr, src_scale_ptr, N, half, gap, topk, num_experts, stride_src, stride_q,
    stride_s, stride_src_s,
    GATHER: tl.constexpr, WEIGHTED: tl.constexpr, CODES: tl.constexpr, WHOLE: tl.constexpr,
    ALIGN: tl.constexpr, SUB: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
):
    """q[n, r] and scale[slot, n] of block slot program_id(0), columns program_id(1). WHOLE
    (CODES): half a multiple of BLOCK_N, so that a program's columns share one source scale a
    row."""
    slot = tl.program_id(0)
    first, end, used = _slot_rows(block_expert_ptr, expert_offsets_ptr, slot, num_experts, ALIGN,
                                  SUB)
    if not used:
        return
    rows = first + tl.arange(0, ROWS)
    mine = rows < end
    route = tl.load(row_route_ptr + rows, mask=mine, other=-1)
    valid = route >= 0
    src = (route // topk if GATHER else rows).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = cols < N
    load = valid[:, None] & in_n[None, :]
    if CODES:
        if WHOLE:
            first_col = tl.program_id(1) * BLOCK_N
            shift = tl.where(first_col >= half, gap, 0)
            cols_src = cols + shift
            scale_src = tl.load(src_scale_ptr + src * stride_src_s + (first_col + shift) // 128,
                                mask=valid, other=0.0)[:, None]
        else:
            cols_src = cols + tl.where(cols >= half, gap, 0)
            scale_src = tl.load(src_scale_ptr + src[:, None] * stride_src_s
                                + (cols_src // 128)[None, :], mask=load, other=0.0)
        x = from_e4m3(tl.load(src_ptr + src[:, None] * stride_src + cols_src[None, :],
                              mask=load, other=0.0), UPCAST) * scale_src
    else:
        x = tl.load(src_ptr + src[:, None] * stride_src + cols[None, :], mask=load,
                    other=0.0).to(tl.float32)
    if WEIGHTED:
        x *= tl.load(router_weights_ptr + route, mask=valid, other=0.0)[:, None]
    scale, inverse = _block_scale(abs_max(x, 0, UPCAST), False)
    q = to_e4m3(x * inverse[None, :], UPCAST)
    tl.store(scale_ptr + slot.to(tl.int64) * stride_s + cols, scale, mask=in_n)
    tl.store(q_ptr + cols.to(tl.int64)[:, None] * stride_q + rows[None, :], tl.trans(q),
             mask=in_n[:, None] & mine[None, :])


@triton.jit
def fp8_wgrad_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, out_ptr, out2_ptr, expert_offsets_ptr,
    P, Q, SPLIT, num_experts, num_p_blocks, num_q_blocks, stride_a, stride_as, stride_b, stride_bs,
    stride_oe, stride_oe2, stride_op,
    SUB: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, UPCAST: tl.constexpr,
):
    """out[e, p, q] (out2 for p >= SPLIT) of expert program_id(0) // (tiles a expert)."""
    pid = tl.program_id(0)
    tiles = num_p_blocks * num_q_blocks
    expert = pid // tiles
    pid_p = (pid % tiles) // num_q_blocks
    pid_q = pid % num_q_blocks
    start, end = _expert_rows(expert_offsets_ptr, expert, num_experts, SUB)
    ps = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    in_p, in_q = ps < P, qs < Q
    ks = tl.arange(0, ROWS)
    acc = tl.zeros([BLOCK_P, BLOCK_Q], dtype=tl.float32)
    slot = (start // SUB).to(tl.int64)
    a_ptrs = a_ptr + ps.to(tl.int64)[:, None] * stride_a + (start + ks)[None, :]
    b_ptrs = b_ptr + qs.to(tl.int64)[None, :] * stride_b + (start + ks)[:, None]
    a_scale_ptrs = a_scale_ptr + slot * stride_as + ps
    b_scale_ptrs = b_scale_ptr + slot * stride_bs + qs
    for block in range(0, tl.cdiv(end - start, ROWS)):  # the expert's blocks, in order
        mine = start + block * ROWS + ks < end
        a = tl.load(a_ptrs, mask=in_p[:, None] & mine[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mine[:, None] & in_q[None, :], other=0.0)
        a_scale = tl.load(a_scale_ptrs, mask=in_p, other=0.0)
        b_scale = tl.load(b_scale_ptrs, mask=in_q, other=0.0)
        acc += _dot_e4m3(a, b, UPCAST) * (a_scale[:, None] * b_scale[None, :])
        a_ptrs += ROWS
        b_ptrs += ROWS
        a_scale_ptrs += stride_as
        b_scale_ptrs += stride_bs
    value = cast_to(acc, out_ptr.dtype.element_ty, UPCAST)
    keep = in_p[:, None] & in_q[None, :]
    rows_out = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)  # rows from SPLIT on go to out2
    first = rows_out < SPLIT
    if pid_p * BLOCK_P + BLOCK_P <= SPLIT:
        tl.store(out_ptr + expert.to(tl.int64) * stride_oe
                 + rows_out.to(tl.int64)[:, None] * stride_op + qs[None, :], value, mask=keep)
    elif pid_p * BLOCK_P >= SPLIT:
        tl.store(out2_ptr + expert.to(tl.int64) * stride_oe2
                 + (rows_out - SPLIT).to(tl.int64)[:, None] * stride_op + qs[None, :], value,
                 mask=keep)
    else:  # a tile across SPLIT
        tl.store(out_ptr + expert.to(tl.int64) * stride_oe
                 + rows_out.to(tl.int64)[:, None] * stride_op + qs[None, :], value,
                 mask=keep & first[:, None])
        second = tl.where(first, 0, rows_out - SPLIT)
        tl.store(out2_ptr + expert.to(tl.int64) * stride_oe2
                 + second.to(tl.int64)[:, None] * stride_op + qs[None, :], value,
                 mask=keep & ~first[:, None])
