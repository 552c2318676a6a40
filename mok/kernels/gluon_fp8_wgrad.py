"""The weight gradients on float8_e4m3fn operands (mok.kernels.fp8_wgrad's fp8_wgrad_kernel),
warp-specialized and persistent for Hopper (sm_90), in Gluon; GPUs only (Gluon kernels do not
run under Triton's interpreter).

    out[e, p, q] = sum over e's blocks j of (sum_{r in j} qa[p, r] * qb[q, r])
                   * a_scale[g(e, j), p] * b_scale[g(e, j), q]

qa [P, C] and qb [Q, C] are mok.ops.quantize_row_blocks' codes (each column's rows contiguous:
the K-major operands an e4m3 wgmma reads), scales [C / 128, P] and [C / 128, Q]. The schedule's
alignment is a multiple of 128, so expert e's rows [start, end) (expert_offsets, cut at the rows
in use) are whole blocks of 128 and block j's scales sit at g(e, j) = start / 128 + j: the
boxes never reach another expert's rows, no mask is needed. Rows p >= SPLIT go to out2 (row
p - SPLIT): d_w_gate and d_w_up from one [d_gate, d_up] operand. SPLIT and P are multiples of
64: where one is no multiple of BLOCK_P (PARTIAL_P), each MMA partition's 64 rows of a tile lie
on one side of SPLIT or past P (not stored), and each partition picks its output.

One CTA per SM strides over the [BLOCK_P, BLOCK_Q] output tiles, expert by expert (the tiles of
one expert read the same rows and share them in L2). Partitions, as mok.kernels.gluon_fp8's
fp8_rows_ws_kernel: a loader warp fills a ring of NUM_STAGES stages by TMA, continuous across
tiles, each stage with qa's [BLOCK_P, 128] and qb's [BLOCK_Q, 128] boxes and the block's
BLOCK_P and BLOCK_Q scales; two MMA partitions of one warpgroup take 64 rows of P each, wgmma
each block into a scratch accumulator, read the block's scales from the stage, wait for the
wgmma, and add it scaled by the outer product of the scales to the fp32 accumulator (the blocks
in order, so results are bitwise reproducible); then the tile through shared memory and a TMA
store. An expert without rows stores zeros. Barriers as fp8_rows_ws_kernel's (ready[s] count 1
with expect-tx; empty[s] count 2).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mok.kernels.gluon_fp8 import _ring_barriers
from mok.kernels.gluon_gate_up import _put

ROWS = gl.constexpr(128)  # the scales' block along the rows: one K step


@gluon.jit
def _tile(tile, num_p, num_q, expert_offsets_ptr, num_experts):
    """Tile index -> (expert, P block, Q block, the expert's first row, its blocks): experts
    first, then P, then Q."""
    per_expert = num_p * num_q
    expert = tile // per_expert
    rest = tile % per_expert
    used = gl.load(expert_offsets_ptr + num_experts)
    end = gl.minimum(gl.load(expert_offsets_ptr + expert + 1), used)
    start = gl.minimum(gl.load(expert_offsets_ptr + expert), end)
    return expert, rest // num_q, rest % num_q, start, (end - start) // ROWS


@gluon.jit
def _load_partition(a_desc, b_desc, a_scale_desc, b_scale_desc, expert_offsets_ptr, a_bufs,
                    b_bufs, a_scale_bufs, b_scale_bufs, ready_bars, empty_bars, num_experts,
                    num_p, num_q, stride_as, stride_bs,
                    BLOCK_P: gl.constexpr, BLOCK_Q: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Fills the ring: qa's and qb's boxes of each K step and their scales by TMA."""
    nbytes: gl.constexpr = (a_desc.block_type.nbytes + b_desc.block_type.nbytes
                            + a_scale_desc.block_type.nbytes + b_scale_desc.block_type.nbytes)
    i = 0
    for tile in range(gl.program_id(0), num_experts * num_p * num_q, gl.num_programs(0)):
        _, pid_p, pid_q, start, blocks = _tile(tile, num_p, num_q, expert_offsets_ptr,
                                               num_experts)
        for kk in range(blocks):
            s = i % NUM_STAGES
            mbarrier.wait(empty_bars.index(s), ((i // NUM_STAGES) & 1) ^ 1)
            bar = ready_bars.index(s)
            mbarrier.expect(bar, nbytes)
            k0 = start + kk * ROWS
            slot = k0 // ROWS
            tma.async_copy_global_to_shared(a_desc, [pid_p * BLOCK_P, k0], bar, a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [pid_q * BLOCK_Q, k0], bar, b_bufs.index(s))
            tma.async_copy_global_to_shared(a_scale_desc, [slot * stride_as + pid_p * BLOCK_P],
                                            bar, a_scale_bufs.index(s))
            tma.async_copy_global_to_shared(b_scale_desc, [slot * stride_bs + pid_q * BLOCK_Q],
                                            bar, b_scale_bufs.index(s))
            i += 1


@gluon.jit
def _mma_partition(out_desc, out2_desc, a_bufs, b_bufs, a_scale_bufs, b_scale_bufs, ready_bars,
                   empty_bars, c_smem, expert_offsets_ptr, num_experts, num_p, num_q, P, SPLIT,
                   BLOCK_P: gl.constexpr, BLOCK_Q: gl.constexpr, NUM_STAGES: gl.constexpr,
                   HALF: gl.constexpr, PARTIAL_P: gl.constexpr):
    """Rows HALF * 64 .. + 64 of P of every tile: the scaled K loop, then the store. Columns
    past Q read the next scales of the flat scale tensor (or TMA's zeros) against qb's
    zero-filled rows: never stored. BLOCK_Q 256: two wgmmas of 128 columns a K step through
    one scratch accumulator, each half scaled and added before the next."""
    TWO: gl.constexpr = BLOCK_Q > 128
    WIDTH: gl.constexpr = BLOCK_Q // 2 if TWO else BLOCK_Q
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, WIDTH, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    tmp = gl.zeros([64, WIDTH], gl.float32, acc_layout)
    i = 0
    for tile in range(gl.program_id(0), num_experts * num_p * num_q, gl.num_programs(0)):
        expert, pid_p, pid_q, start, blocks = _tile(tile, num_p, num_q, expert_offsets_ptr,
                                                    num_experts)
        acc = gl.zeros([64, WIDTH], gl.float32, acc_layout)
        if TWO:
            acc_hi = gl.zeros([64, WIDTH], gl.float32, acc_layout)
        else:
            acc_hi = acc  # not stored
        for _ in range(blocks):
            s = i % NUM_STAGES
            mbarrier.wait(ready_bars.index(s), (i // NUM_STAGES) & 1)
            a = a_bufs.index(s).slice(HALF * 64, 64)
            b_scales = b_scale_bufs.index(s)
            tmp = warpgroup_mma(a, b_bufs.index(s).slice(0, WIDTH).permute((1, 0)), tmp,
                                use_acc=False, is_async=True)
            a_scale = a_scale_bufs.index(s).slice(HALF * 64, 64).load(row_layout)
            b_scale = b_scales.slice(0, WIDTH).load(col_layout)
            tmp = warpgroup_mma_wait(num_outstanding=0, deps=(tmp, ))
            if TWO:
                acc += tmp * (a_scale[:, None] * b_scale[None, :])
                # Nothing is pending: this keeps the sums above ahead of the next wgmma (as in
                # mok.kernels.gluon_fp8's row tiles of 256 columns).
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                tmp = warpgroup_mma(a, b_bufs.index(s).slice(WIDTH, WIDTH).permute((1, 0)), tmp,
                                    use_acc=False, is_async=True)
                b_scale = b_scales.slice(WIDTH, WIDTH).load(col_layout)
                tmp = warpgroup_mma_wait(num_outstanding=0, deps=(tmp, ))
                mbarrier.arrive(empty_bars.index(s))
                acc_hi += tmp * (a_scale[:, None] * b_scale[None, :])
            else:
                mbarrier.arrive(empty_bars.index(s))
                acc += tmp * (a_scale[:, None] * b_scale[None, :])
            i += 1
        p0 = pid_p * BLOCK_P + HALF * 64
        q0 = pid_q * BLOCK_Q
        if PARTIAL_P:  # this partition's 64 rows: on one side of SPLIT, or past P
            if p0 < SPLIT:
                _put_tile(out_desc, acc, acc_hi, expert * SPLIT + p0, q0, c_smem, TWO, WIDTH)
            elif p0 < P:
                _put_tile(out2_desc, acc, acc_hi, expert * (P - SPLIT) + p0 - SPLIT, q0, c_smem,
                          TWO, WIDTH)
        elif pid_p * BLOCK_P < SPLIT:  # the tile lies on one side of SPLIT (BLOCK_P divides it)
            _put_tile(out_desc, acc, acc_hi, expert * SPLIT + p0, q0, c_smem, TWO, WIDTH)
        else:
            _put_tile(out2_desc, acc, acc_hi, expert * (P - SPLIT) + p0 - SPLIT, q0, c_smem,
                      TWO, WIDTH)
    tma.store_wait(pendings=0)


@gluon.jit
def _put_tile(desc, acc, acc_hi, row, q0, c_smem, TWO: gl.constexpr, WIDTH: gl.constexpr):
    """A partition's tile rows -> desc at (row, q0): acc, then with TWO acc_hi WIDTH columns on."""
    _put(desc, acc, row, q0, c_smem)
    if TWO:
        _put(desc, acc_hi, row, q0 + WIDTH, c_smem)


@gluon.jit
def fp8_wgrad_ws_kernel(
    a_desc, b_desc, a_scale_desc, b_scale_desc, out_desc, out2_desc, expert_offsets_ptr,
    num_experts, num_p, num_q, P, SPLIT, stride_as, stride_bs,
    BLOCK_P: gl.constexpr, BLOCK_Q: gl.constexpr, NUM_STAGES: gl.constexpr,
    LOAD_REGS: gl.constexpr, MMA_REGS: gl.constexpr, PARTIAL_P: gl.constexpr,
):
    """Launched with one program per SM and num_warps = 4 (the first MMA partition).
    Descriptors: a_desc qa [P, C] e4m3 with [BLOCK_P, 128] boxes, b_desc qb [Q, C] e4m3 with
    [BLOCK_Q, 128] boxes, a_scale_desc and b_scale_desc the scales flattened (row stride
    stride_as, stride_bs; multiples of 4) with [BLOCK_P] and [BLOCK_Q] boxes, out_desc out
    viewed [E * SPLIT, Q] and out2_desc out2 viewed [E * (P - SPLIT), Q] with [64,
    min(BLOCK_Q, 128)] boxes (without a split, SPLIT = P and out2 = out). BLOCK_P 128; SPLIT
    and P multiples of 64, PARTIAL_P where BLOCK_P does not divide both; BLOCK_Q 64, 128 or
    256."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_P, ROWS], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, BLOCK_Q, ROWS], b_desc.layout)
    a_scale_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_P],
                                             a_scale_desc.layout)
    b_scale_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_Q],
                                             b_scale_desc.layout)
    c_smem = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape,
                                       out_desc.layout)
    c_smem2 = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape,
                                        out_desc.layout)
    ready_bars, empty_bars = _ring_barriers(NUM_STAGES, 1, 2)

    gl.warp_specialize([
        (_mma_partition, (out_desc, out2_desc, a_bufs, b_bufs, a_scale_bufs, b_scale_bufs,
                          ready_bars, empty_bars, c_smem, expert_offsets_ptr, num_experts,
                          num_p, num_q, P, SPLIT, BLOCK_P, BLOCK_Q, NUM_STAGES, 0, PARTIAL_P)),
        (_mma_partition, (out_desc, out2_desc, a_bufs, b_bufs, a_scale_bufs, b_scale_bufs,
                          ready_bars, empty_bars, c_smem2, expert_offsets_ptr, num_experts,
                          num_p, num_q, P, SPLIT, BLOCK_P, BLOCK_Q, NUM_STAGES, 1, PARTIAL_P)),
        (_load_partition, (a_desc, b_desc, a_scale_desc, b_scale_desc, expert_offsets_ptr,
                           a_bufs, b_bufs, a_scale_bufs, b_scale_bufs, ready_bars, empty_bars,
                           num_experts, num_p, num_q, stride_as, stride_bs, BLOCK_P, BLOCK_Q,
                           NUM_STAGES)),
    ], [4, 1], [MMA_REGS, LOAD_REGS])
