"""Warp-specialized persistent grouped GEMMs on float8_e4m3fn operands with blockwise scales for
Hopper (sm_90), in Gluon: the FP8 path's row GEMMs of mok.kernels.fp8_gemm (same rows, products
and K order), for GPUs only (Gluon kernels do not run under Triton's interpreter).

    out[r, n] = sum over K blocks b of (sum_{k in b} a[src(r), k] * w[e, n, k])
                * a_scale[src(r), b] * w_scale[e, n // 128, b]

a e4m3 rows with a scale per 1 x 128 block; w [E, N, K] e4m3 with a scale per 128 x 128 block;
e = block_expert[r // ALIGN]; padding rows (route -1) give 0.
- fp8_rows_ws_kernel: a read whole (src(r) = r) by TMA: down (a = h, K = I, the router weight
  in the epilogue) and d_x (a = d_gate_up, w = the transposed gate and up side by side, K = 2I).
- fp8_gather_ws_kernel: a = d_output's token rows (src(r) = token(r)) gathered by cp.async,
  w the transposed w_down: the dSwiGLU's product dh0 alone, for a dSwiGLU run apart.
- fp8_gate_up_ws_kernel: a = x's token rows (src(r) = token(r)) gathered by cp.async, the gate
  and the up products, then SwiGLU with h quantized in the epilogue, or the pre-activations.

Each K step is one scale block (BLOCK_K = 128): its e4m3 wgmma (K-major operands, the only
layout fp8 wgmma takes) goes into a scratch accumulator, which is scaled and added to the fp32
accumulator once complete. A warpgroup cannot overlap the two itself (ptxas serializes wgmmas
whose neighbours read another wgmma's accumulator), so the tile's 64-row halves belong to
separate MMA partitions of one warpgroup each, which sync only through the ring: while one
scales, the other's wgmma runs.

One CTA per SM strides over the [BLOCK_M, BLOCK_N] output tiles of the used rows (GROUP_M row
blocks at a time). Partitions:
- loader (worker): per K step the A box [BLOCK_M, BLOCK_K] (by TMA, one warp; or gathered by
  16-byte cp.async, LOAD_WARPS warps) and the weight box(es) [BLOCK_N, BLOCK_K] by TMA into a
  ring of NUM_STAGES stages, continuous across tiles (the MMA partitions load the rows' and
  the weight block's scales from global memory a step ahead).
- MMA (BLOCK_M // 64 of them, the default partition and with BLOCK_M 128 a worker of MMA_REGS
  registers): its 64 rows of every tile's A and the whole weight box; then the epilogue through
  its own shared-memory buffers and TMA stores.

Barriers (stage s = i % NUM_STAGES of the i-th K step counted over all of this CTA's tiles,
round = i // NUM_STAGES, phase parity = round & 1): ready[s]: the loader arrives with
expect-tx (count 1; gathering, each loader thread once more through
cp.async.mbarrier.arrive.noinc: count LOAD_WARPS * 32 + 1), the MMA partitions wait on parity
round & 1 (gathering, then fence: cp.async writes through the generic proxy); empty[s] (count
BLOCK_M // 64): each MMA partition arrives once its wgmma of stage s has completed; the loader
waits on parity (round & 1) ^ 1 before refilling s, so the first round passes at once. A
partition cannot run more than a ring ahead of the other, so no barrier is two phases ahead of
a waiter.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mok.kernels import gluon_activation as activation
from mok.kernels.gluon_gate_up import _put, _tile_corner, _tile_grid
from mok.kernels.gluon_rows import _load_step

E4M3_MAX = gl.constexpr(448.0)  # the largest finite float8_e4m3fn
AMAX_FLOOR = gl.constexpr(448.0 * 2.0 ** -126)  # mok.kernels.quantize's


@gluon.jit
def _ring_barriers(NUM_STAGES: gl.constexpr, READY: gl.constexpr, EMPTY: gl.constexpr):
    """(ready, empty): a ring's NUM_STAGES barriers of each kind, initialized with those arrival
    counts."""
    ready_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready_bars.index(s), count=READY)
        mbarrier.init(empty_bars.index(s), count=EMPTY)
    return ready_bars, empty_bars


# -- down and d_x: every operand by TMA -------------------------------------------------------

@gluon.jit
def _load_partition(a_desc, w_desc, block_expert_ptr, used_rows_ptr, a_bufs, b_bufs,
                    ready_bars, empty_bars, N, K, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
                    ALIGN: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Fills the ring: A and weight boxes by TMA."""
    num_pid_m, num_pid_n, num_tiles = _tile_grid(used_rows_ptr, N, BLOCK_M, BLOCK_N)
    i = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        r0, c0 = _tile_corner(tile, num_pid_m, num_pid_n, BLOCK_M, BLOCK_N, GROUP_M)
        # w viewed [E * N, K]: rows past the expert's N reach only columns >= N (clipped)
        w_row = gl.load(block_expert_ptr + r0 // ALIGN) * N + c0
        for kk in range(gl.cdiv(K, BLOCK_K)):
            k0 = kk * BLOCK_K
            i = _load_step(a_desc, r0, k0, w_desc, w_row, k0, a_bufs, b_bufs, ready_bars,
                           empty_bars, i, NUM_STAGES)


@gluon.jit
def _step_scale(a_scale_ptrs, w_scale_ptr, kb, k_blocks, valid):
    """The scales of K block kb, a row's times the weight block's; 0 past the last block."""
    inside = kb < k_blocks
    a_scale = gl.load(a_scale_ptrs + kb, mask=valid & inside, other=0.0)
    return a_scale * gl.load(w_scale_ptr + kb, mask=inside, other=0.0)


@gluon.jit
def _mma_partition(out_desc, a_bufs, b_bufs, ready_bars, empty_bars, c_smem, a_scale_ptr,
                   w_scale_ptr, router_weights_ptr, row_route_ptr, block_expert_ptr,
                   used_rows_ptr, N, K, topk, stride_as, stride_wse, stride_wsn,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                   GROUP_M: gl.constexpr, ALIGN: gl.constexpr, NUM_STAGES: gl.constexpr,
                   HAS_WEIGHT: gl.constexpr, GATHER: gl.constexpr, HALF: gl.constexpr,
                   OUT_COPIES: gl.constexpr):
    """Rows HALF * 64 .. + 64 of every tile: the scaled K loop, then the epilogue. GATHER: the
    A rows are tokens' rows (their scales by token), landed by cp.async. Each K step's scales
    (the rows' and the weight block's) are loaded a step ahead. BLOCK_N 256: two products of
    128 columns a K step (two weight-scale blocks), one after the other through the one
    scratch accumulator, as gate/up's, the first added before the second is issued; the two
    halves are stored through c_smem's OUT_COPIES buffers (with 2 the second store does not
    wait for the first)."""
    WIDTH: gl.constexpr = BLOCK_N if BLOCK_N <= 128 else 128  # one wgmma's columns
    TWO: gl.constexpr = BLOCK_N > 128
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, WIDTH, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    rows = HALF * 64 + gl.arange(0, 64, layout=row_layout)

    num_pid_m, num_pid_n, num_tiles = _tile_grid(used_rows_ptr, N, BLOCK_M, BLOCK_N)
    k_blocks = gl.cdiv(K, BLOCK_K)
    w_blocks = gl.cdiv(N, 128)
    tmp = gl.zeros([64, WIDTH], gl.float32, acc_layout)
    i = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        r0, c0 = _tile_corner(tile, num_pid_m, num_pid_n, BLOCK_M, BLOCK_N, GROUP_M)
        route = gl.load(row_route_ptr + r0 + rows)
        valid = route >= 0
        if HAS_WEIGHT:  # loaded now, used after the K loop
            weight = gl.load(router_weights_ptr + route, mask=valid, other=0.0)
        expert = gl.load(block_expert_ptr + r0 // ALIGN).to(gl.int64)
        if GATHER:
            src = gl.where(valid, route // topk, 0).to(gl.int64)
        else:
            src = (r0 + rows).to(gl.int64)
        a_scale_ptrs = a_scale_ptr + src * stride_as
        w_tile_scale_ptr = w_scale_ptr + expert * stride_wse + (c0 // 128) * stride_wsn
        acc = gl.zeros([64, WIDTH], gl.float32, acc_layout)
        if TWO:  # the second 128 columns' weight block (past N the first's: stores clip them)
            w_hi_ptr = w_tile_scale_ptr + gl.where(c0 // 128 + 1 < w_blocks, stride_wsn, 0)
            acc_hi = gl.zeros([64, WIDTH], gl.float32, acc_layout)
        next_scale = _step_scale(a_scale_ptrs, w_tile_scale_ptr, 0, k_blocks, valid)
        if TWO:
            next_hi = _step_scale(a_scale_ptrs, w_hi_ptr, 0, k_blocks, valid)
        for kk in range(k_blocks):
            s = i % NUM_STAGES
            mbarrier.wait(ready_bars.index(s), (i // NUM_STAGES) & 1)
            if GATHER:
                fence_async_shared()  # cp.async (generic proxy) -> wgmma (async proxy)
            a = a_bufs.index(s).slice(HALF * 64, 64)
            b = b_bufs.index(s)
            if TWO:
                b = b.slice(0, WIDTH)
            tmp = warpgroup_mma(a, b.permute((1, 0)), tmp, use_acc=False, is_async=True)
            scale = next_scale
            next_scale = _step_scale(a_scale_ptrs, w_tile_scale_ptr, kk + 1, k_blocks, valid)
            if TWO:
                scale_hi = next_hi
                next_hi = _step_scale(a_scale_ptrs, w_hi_ptr, kk + 1, k_blocks, valid)
            tmp = warpgroup_mma_wait(num_outstanding=0, deps=(tmp, ))
            if TWO:
                acc += tmp * scale[:, None]
                # Nothing is pending: this only keeps the sums above ahead of the next wgmma,
                # which LLVM otherwise sinks below it (then both products live: spills).
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                tmp = warpgroup_mma(a, b_bufs.index(s).slice(WIDTH, WIDTH).permute((1, 0)), tmp,
                                    use_acc=False, is_async=True)
                tmp = warpgroup_mma_wait(num_outstanding=0, deps=(tmp, ))
                mbarrier.arrive(empty_bars.index(s))
                acc_hi += tmp * scale_hi[:, None]
            else:
                mbarrier.arrive(empty_bars.index(s))
                acc += tmp * scale[:, None]
            i += 1

        if not HAS_WEIGHT:
            weight = valid  # not read
        _put_rows(out_desc, acc, weight, valid, r0 + HALF * 64, c0, c_smem.index(0),
                  HAS_WEIGHT, True)
        if TWO:
            # with a second buffer: its last store (the previous tile's) was waited on above
            _put_rows(out_desc, acc_hi, weight, valid, r0 + HALF * 64, c0 + WIDTH,
                      c_smem.index(OUT_COPIES - 1), HAS_WEIGHT, OUT_COPIES == 1)
    tma.store_wait(pendings=0)


@gluon.jit
def _put_rows(out_desc, acc, weight, valid, r, c, c_smem, HAS_WEIGHT: gl.constexpr,
              WAIT: gl.constexpr):
    """acc (times the rows' router weights with HAS_WEIGHT; padding rows 0 whatever their
    codes) -> out_desc's box at (r, c) through c_smem; WAIT: once every store issued before
    has read its buffer."""
    if HAS_WEIGHT:
        acc = acc * weight[:, None]
    if WAIT:
        tma.store_wait(pendings=0)
    c_smem.store(gl.where(valid[:, None], acc, 0.0).to(out_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(out_desc, [r, c], c_smem)


@gluon.jit
def fp8_rows_ws_kernel(
    a_desc, w_desc, out_desc, a_scale_ptr, w_scale_ptr, router_weights_ptr, row_route_ptr,
    block_expert_ptr, used_rows_ptr, N, K, stride_as, stride_wse, stride_wsn,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    ALIGN: gl.constexpr, NUM_STAGES: gl.constexpr, LOAD_REGS: gl.constexpr,
    MMA_REGS: gl.constexpr, HAS_WEIGHT: gl.constexpr, OUT_COPIES: gl.constexpr,
):
    """Launched with one program per SM and num_warps = 4 (the first MMA partition).
    Descriptors: a [R, K] e4m3 with [BLOCK_M, BLOCK_K] boxes, w viewed [E * N, K] e4m3 with
    [BLOCK_N, BLOCK_K] boxes (TMA zero-fills both past K), out [R, N] with [64, min(BLOCK_N,
    128)] boxes. BLOCK_M 64 or 128, BLOCK_N 64, 128 or 256 (two products of 128 columns a K
    step), BLOCK_K 128. OUT_COPIES: each MMA partition's output buffers, 1, or 2 with BLOCK_N
    256 (one a half).
    router_weights_ptr: fp32 [T * topk] by route (unused without HAS_WEIGHT)."""
    NUM_MMA: gl.constexpr = BLOCK_M // 64
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K],
                                       a_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K],
                                       w_desc.layout)
    box: gl.constexpr = out_desc.block_type.shape
    c_smem = gl.allocate_shared_memory(out_desc.dtype, [OUT_COPIES, box[0], box[1]],
                                       out_desc.layout)
    ready_bars, empty_bars = _ring_barriers(NUM_STAGES, 1, NUM_MMA)

    # (The partitions' arguments stay literal tuples: a tuple held in a variable loses its
    # constexprs.)
    if NUM_MMA == 2:
        c_smem2 = gl.allocate_shared_memory(out_desc.dtype, [OUT_COPIES, box[0], box[1]],
                                            out_desc.layout)
        gl.warp_specialize([
            (_mma_partition, (out_desc, a_bufs, b_bufs, ready_bars, empty_bars, c_smem,
                              a_scale_ptr, w_scale_ptr, router_weights_ptr, row_route_ptr,
                              block_expert_ptr, used_rows_ptr, N, K, 1, stride_as, stride_wse,
                              stride_wsn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, ALIGN, NUM_STAGES,
                              HAS_WEIGHT, False, 0, OUT_COPIES)),
            (_mma_partition, (out_desc, a_bufs, b_bufs, ready_bars, empty_bars, c_smem2,
                              a_scale_ptr, w_scale_ptr, router_weights_ptr, row_route_ptr,
                              block_expert_ptr, used_rows_ptr, N, K, 1, stride_as, stride_wse,
                              stride_wsn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, ALIGN, NUM_STAGES,
                              HAS_WEIGHT, False, 1, OUT_COPIES)),
            (_load_partition, (a_desc, w_desc, block_expert_ptr, used_rows_ptr, a_bufs, b_bufs,
                               ready_bars, empty_bars, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                               ALIGN, NUM_STAGES)),
        ], [4, 1], [MMA_REGS, LOAD_REGS])
    else:
        gl.warp_specialize([
            (_mma_partition, (out_desc, a_bufs, b_bufs, ready_bars, empty_bars, c_smem,
                              a_scale_ptr, w_scale_ptr, router_weights_ptr, row_route_ptr,
                              block_expert_ptr, used_rows_ptr, N, K, 1, stride_as, stride_wse,
                              stride_wsn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, ALIGN, NUM_STAGES,
                              HAS_WEIGHT, False, 0, OUT_COPIES)),
            (_load_partition, (a_desc, w_desc, block_expert_ptr, used_rows_ptr, a_bufs, b_bufs,
                               ready_bars, empty_bars, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                               ALIGN, NUM_STAGES)),
        ], [1], [LOAD_REGS])


@gluon.jit
def fp8_gather_ws_kernel(
    a_ptr, w_desc, out_desc, a_scale_ptr, w_scale_ptr, row_route_ptr, block_expert_ptr,
    used_rows_ptr, N, K, topk, stride_am, stride_as, stride_wse, stride_wsn,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    ALIGN: gl.constexpr, NUM_STAGES: gl.constexpr, LOAD_WARPS: gl.constexpr,
    LOAD_REGS: gl.constexpr, MMA_REGS: gl.constexpr, A_LAYOUT: gl.constexpr,
):
    """out[r] = a[token(r)] . w[e]^T, the scaled products as fp8_rows_ws_kernel's, with the
    token rows gathered by cp.async (the dSwiGLU's product dh0 = d_out[token] . w_down_t[e],
    computed apart). BLOCK_M 128 (two MMA partitions of 64 rows), BLOCK_N 128 or 256, BLOCK_K
    128.
    Launched with one program per SM and num_warps = 4; a [T, K] e4m3 (row stride stride_am,
    K a multiple of 16) with scales [T, cdiv(K, 128)]; w viewed [E * N, K] e4m3 with [BLOCK_N,
    BLOCK_K] boxes, scales [E, N / 128, cdiv(K, 128)]; out [R, N] with [64, min(BLOCK_N, 128)]
    boxes;
    A_LAYOUT the A buffers' shared layout ([BLOCK_M, BLOCK_K] e4m3). Padding rows get 0."""
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, BLOCK_M, BLOCK_K], A_LAYOUT)
    b_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, BLOCK_N, BLOCK_K],
                                       w_desc.layout)
    box: gl.constexpr = out_desc.block_type.shape
    c_smem = gl.allocate_shared_memory(out_desc.dtype, [1, box[0], box[1]], out_desc.layout)
    c_smem2 = gl.allocate_shared_memory(out_desc.dtype, [1, box[0], box[1]], out_desc.layout)
    ready_bars, empty_bars = _ring_barriers(NUM_STAGES, LOAD_WARPS * 32 + 1, 2)

    gl.warp_specialize([
        (_mma_partition, (out_desc, a_bufs, b_bufs, ready_bars, empty_bars, c_smem,
                          a_scale_ptr, w_scale_ptr, a_scale_ptr, row_route_ptr,
                          block_expert_ptr, used_rows_ptr, N, K, topk, stride_as, stride_wse,
                          stride_wsn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, ALIGN, NUM_STAGES,
                          False, True, 0, 1)),
        (_mma_partition, (out_desc, a_bufs, b_bufs, ready_bars, empty_bars, c_smem2,
                          a_scale_ptr, w_scale_ptr, a_scale_ptr, row_route_ptr,
                          block_expert_ptr, used_rows_ptr, N, K, topk, stride_as, stride_wse,
                          stride_wsn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, ALIGN, NUM_STAGES,
                          False, True, 1, 1)),
        (_gather_load_partition, (a_ptr, w_desc, w_desc, row_route_ptr, block_expert_ptr,
                                  used_rows_ptr, a_bufs, b_bufs, ready_bars, empty_bars, N, K,
                                  topk, stride_am, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, ALIGN,
                                  NUM_STAGES, LOAD_WARPS, 1)),
    ], [4, LOAD_WARPS], [MMA_REGS, LOAD_REGS])


# -- gate/up: the token rows gathered, two products, SwiGLU and h quantized --------------------

@gluon.jit
def _gather_load_partition(x_ptr, w_gate_desc, w_up_desc, row_route_ptr, block_expert_ptr,
                           used_rows_ptr, a_bufs, b_bufs, ready_bars, empty_bars, N, K, topk,
                           stride_xm, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, ALIGN: gl.constexpr,
                           NUM_STAGES: gl.constexpr, LOAD_WARPS: gl.constexpr,
                           NUM_B: gl.constexpr):
    """Fills the ring: the weight boxes by TMA (NUM_B 2: gate's and up's, into the two halves
    of a stage's B buffer; 1: w_gate_desc's alone), the tile's token rows of x by cp.async
    (16-byte copies, zero-filled on padding rows and past K) into its A buffer."""
    w_bytes: gl.constexpr = NUM_B * w_gate_desc.block_type.nbytes
    TPW_K: gl.constexpr = BLOCK_K // 16
    gather: gl.constexpr = gl.BlockedLayout([1, 16], [32 // TPW_K, TPW_K], [LOAD_WARPS, 1],
                                            [1, 0])
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, gather))
    cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, gather))
    num_pid_m, num_pid_n, num_tiles = _tile_grid(used_rows_ptr, N, BLOCK_M, BLOCK_N)
    i = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        r0, c0 = _tile_corner(tile, num_pid_m, num_pid_n, BLOCK_M, BLOCK_N, GROUP_M)
        w_row = gl.load(block_expert_ptr + r0 // ALIGN) * N + c0  # rows of w viewed [E * N, K]
        route = gl.load(row_route_ptr + r0 + rows)
        valid = route >= 0
        token = gl.where(valid, route // topk, 0).to(gl.int64)
        a_ptrs = x_ptr + token[:, None] * stride_xm + cols[None, :]
        for kk in range(gl.cdiv(K, BLOCK_K)):
            s = i % NUM_STAGES
            mbarrier.wait(empty_bars.index(s), ((i // NUM_STAGES) & 1) ^ 1)
            bar = ready_bars.index(s)
            b_buf = b_bufs.index(s)
            k0 = kk * BLOCK_K
            mbarrier.expect(bar, w_bytes)
            tma.async_copy_global_to_shared(w_gate_desc, [w_row, k0], bar,
                                            b_buf.slice(0, BLOCK_N))
            if NUM_B == 2:
                tma.async_copy_global_to_shared(w_up_desc, [w_row, k0], bar,
                                                b_buf.slice(BLOCK_N, BLOCK_N))
            mask = valid[:, None] & ((k0 + cols) < K)[None, :]
            async_copy.async_copy_global_to_shared(a_bufs.index(s), a_ptrs + k0, mask=mask)
            async_copy.mbarrier_arrive(bar, increment_count=False)
            i += 1


@gluon.jit
def _row_amax(t):
    """max |t| of each row, NaN left out."""
    magnitude = gl.abs(t)
    return gl.max(gl.where(magnitude == magnitude, magnitude, 0.0), axis=1)


@gluon.jit
def _to_e4m3(t, inverse):
    """t times its row's 448 / amax as e4m3 (_quantize_rows): the cast (cvt.rn.satfinite)
    saturates at +-448 and keeps NaN, as mok.kernels.common.to_e4m3 does."""
    return (t * inverse[:, None]).to(gl.float8e4nv)


@gluon.jit
def _scales(amax):
    """(scale, 448 / amax) of rows with this amax (_quantize_rows's rule)."""
    amax = gl.where(amax == 0.0, E4M3_MAX, gl.maximum(amax, AMAX_FLOOR))
    full = gl.full(amax.shape, E4M3_MAX, gl.float32, amax.type.layout)
    return gl.div_rn(amax, full), gl.div_rn(full, amax)


@gluon.jit
def _quantize_rows(h):
    """(e4m3 q, scale per row) of an fp32 tile, mok.kernels.quantize's rule for 1 x 128
    blocks: amax with NaN left out, a block of zeros scale 1, amax at least AMAX_FLOOR,
    correctly rounded divisions, saturating at +-448."""
    scale, inverse = _scales(_row_amax(h))
    return _to_e4m3(h, inverse), scale


@gluon.jit
def _gate_up_mma_partition(h_desc, gate_desc, up_desc, a_bufs, b_bufs, ready_bars, empty_bars,
                           h_smem, kept_smem, x_scale_ptr, w_gate_scale_ptr, w_up_scale_ptr,
                           h_scale_ptr, row_route_ptr, block_expert_ptr, used_rows_ptr, N, K,
                           topk, swiglu_limit, stride_xs, stride_wse, stride_wsn, stride_hs,
                           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, ALIGN: gl.constexpr,
                           NUM_STAGES: gl.constexpr, HAS_LIMIT: gl.constexpr,
                           SWIGLU: gl.constexpr, QUANTIZE_H: gl.constexpr,
                           SAVE_GATE_UP: gl.constexpr, PARTIAL_N: gl.constexpr,
                           HALF: gl.constexpr):
    """Rows HALF * 64 .. + 64 of every tile: per K step the gate product, scaled and added,
    then the up product; then the epilogue."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    rows = HALF * 64 + gl.arange(0, 64, layout=row_layout)

    num_pid_m, num_pid_n, num_tiles = _tile_grid(used_rows_ptr, N, BLOCK_M, BLOCK_N)
    k_blocks = gl.cdiv(K, BLOCK_K)
    tmp = gl.zeros([64, BLOCK_N], gl.float32, acc_layout)
    i = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        r0, c0 = _tile_corner(tile, num_pid_m, num_pid_n, BLOCK_M, BLOCK_N, GROUP_M)
        route = gl.load(row_route_ptr + r0 + rows)
        valid = route >= 0
        token = gl.where(valid, route // topk, 0).to(gl.int64)
        x_scale_ptrs = x_scale_ptr + token * stride_xs
        expert = gl.load(block_expert_ptr + r0 // ALIGN).to(gl.int64)
        w_offset = expert * stride_wse + (c0 // 128) * stride_wsn
        acc_g = gl.zeros([64, BLOCK_N], gl.float32, acc_layout)
        acc_u = gl.zeros([64, BLOCK_N], gl.float32, acc_layout)
        next_g = _step_scale(x_scale_ptrs, w_gate_scale_ptr + w_offset, 0, k_blocks, valid)
        next_u = _step_scale(x_scale_ptrs, w_up_scale_ptr + w_offset, 0, k_blocks, valid)
        for kk in range(k_blocks):
            s = i % NUM_STAGES
            mbarrier.wait(ready_bars.index(s), (i // NUM_STAGES) & 1)
            fence_async_shared()  # cp.async (generic proxy) -> wgmma (async proxy)
            a = a_bufs.index(s).slice(HALF * 64, 64)
            b = b_bufs.index(s)
            tmp = warpgroup_mma(a, b.slice(0, BLOCK_N).permute((1, 0)), tmp, use_acc=False,
                                is_async=True)
            scale_g = next_g
            scale_u = next_u
            next_g = _step_scale(x_scale_ptrs, w_gate_scale_ptr + w_offset, kk + 1, k_blocks,
                                 valid)
            next_u = _step_scale(x_scale_ptrs, w_up_scale_ptr + w_offset, kk + 1, k_blocks,
                                 valid)
            tmp = warpgroup_mma_wait(num_outstanding=0, deps=(tmp, ))
            acc_g += tmp * scale_g[:, None]
            tmp = warpgroup_mma(a, b.slice(BLOCK_N, BLOCK_N).permute((1, 0)), tmp,
                                use_acc=False, is_async=True)
            tmp = warpgroup_mma_wait(num_outstanding=0, deps=(tmp, ))
            mbarrier.arrive(empty_bars.index(s))
            acc_u += tmp * scale_u[:, None]
            i += 1

        r = r0 + HALF * 64
        gate = gl.where(valid[:, None], acc_g, 0.0)  # padding rows: 0
        up = gl.where(valid[:, None], acc_u, 0.0)
        if SAVE_GATE_UP:
            # As gluon_gate_up keeps them: a value the limit clamps kept as +-inf.
            gate_kept = gate
            up_kept = up
            if HAS_LIMIT:
                gate_kept, up_kept = activation.kept(gate, up, swiglu_limit)
            _put(gate_desc, gate_kept, r, c0, kept_smem)
            _put(up_desc, up_kept, r, c0, kept_smem)
        if SWIGLU:
            if HAS_LIMIT:
                gate, up = activation.clamp(gate, up, swiglu_limit)
            h = activation.swiglu(gate, up)
            if QUANTIZE_H:
                if PARTIAL_N:  # columns past N (the next expert's weight rows) out of the scale
                    cols = c0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
                    h = gl.where((cols < N)[None, :], h, 0.0)
                q, scale = _quantize_rows(h)
                _put(h_desc, q, r, c0, h_smem)
                gl.store(h_scale_ptr + (r0 + rows).to(gl.int64) * stride_hs + c0 // 128, scale)
            else:
                _put(h_desc, h, r, c0, h_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def fp8_gate_up_ws_kernel(
    x_ptr, w_gate_desc, w_up_desc, h_desc, gate_desc, up_desc, x_scale_ptr, w_gate_scale_ptr,
    w_up_scale_ptr, h_scale_ptr, row_route_ptr, block_expert_ptr, used_rows_ptr, N, K, topk,
    swiglu_limit, stride_xm, stride_xs, stride_wse, stride_wsn, stride_hs,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    ALIGN: gl.constexpr, NUM_STAGES: gl.constexpr, LOAD_WARPS: gl.constexpr,
    LOAD_REGS: gl.constexpr, MMA_REGS: gl.constexpr, A_LAYOUT: gl.constexpr,
    HAS_LIMIT: gl.constexpr, SWIGLU: gl.constexpr, QUANTIZE_H: gl.constexpr,
    SAVE_GATE_UP: gl.constexpr, PARTIAL_N: gl.constexpr,
):
    """The FP8 gate/up of mok.kernels.fp8_gemm ("swiglu" and "gate_up" epilogues) with BLOCK_M
    128 (two MMA partitions of 64 rows) and BLOCK_N 128: g = x[token(r)] . w_gate[e, n], u =
    x[token(r)] . w_up[e, n], each K block's product scaled by x's row scale and the weight
    block's. SWIGLU: h = swiglu(g, u) (with HAS_LIMIT clamped first) into h_desc's [R, N], as
    e4m3 with a scale per row and 128 columns into h_scale [R, cdiv(N, 128)] (QUANTIZE_H; with
    PARTIAL_N, N no multiple of BLOCK_N, the last block's scale from its columns below N) or in
    h_desc's dtype. SAVE_GATE_UP: the pre-activations into gate_up's halves (gate_desc,
    up_desc: [R, N] with row stride 2N), a value the limit clamps as +-inf. Padding rows get 0
    (h's scale 1). Launched with one program per SM and num_warps = 4; x [T, K] e4m3 (row
    stride stride_xm, K a multiple of 16) with x_scale [T, cdiv(K, 128)]; w viewed [E * N, K]
    with [BLOCK_N, BLOCK_K] boxes, scales [E, cdiv(N, 128), cdiv(K, 128)]; the outputs' boxes
    [64, BLOCK_N]; A_LAYOUT the A buffers' shared layout ([BLOCK_M, BLOCK_K] e4m3)."""
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, BLOCK_M, BLOCK_K], A_LAYOUT)
    b_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, 2 * BLOCK_N, BLOCK_K],
                                       w_gate_desc.layout)
    # Each MMA partition's epilogue buffers (h's, the pre-activations'), unused ones stand-ins.
    if SWIGLU:
        h_smem = gl.allocate_shared_memory(h_desc.dtype, h_desc.block_type.shape,
                                           h_desc.layout)
        h_smem2 = gl.allocate_shared_memory(h_desc.dtype, h_desc.block_type.shape,
                                            h_desc.layout)
    if SAVE_GATE_UP:
        kept_smem = gl.allocate_shared_memory(gate_desc.dtype, gate_desc.block_type.shape,
                                              gate_desc.layout)
        kept_smem2 = gl.allocate_shared_memory(gate_desc.dtype, gate_desc.block_type.shape,
                                               gate_desc.layout)
    if not SWIGLU:
        h_smem = kept_smem
        h_smem2 = kept_smem2
    if not SAVE_GATE_UP:
        kept_smem = h_smem
        kept_smem2 = h_smem2
    ready_bars, empty_bars = _ring_barriers(NUM_STAGES, LOAD_WARPS * 32 + 1, 2)

    gl.warp_specialize([
        (_gate_up_mma_partition, (h_desc, gate_desc, up_desc, a_bufs, b_bufs, ready_bars,
                                  empty_bars, h_smem, kept_smem, x_scale_ptr, w_gate_scale_ptr,
                                  w_up_scale_ptr, h_scale_ptr, row_route_ptr, block_expert_ptr,
                                  used_rows_ptr, N, K, topk, swiglu_limit, stride_xs,
                                  stride_wse, stride_wsn, stride_hs, BLOCK_M, BLOCK_N, BLOCK_K,
                                  GROUP_M, ALIGN, NUM_STAGES, HAS_LIMIT, SWIGLU, QUANTIZE_H,
                                  SAVE_GATE_UP, PARTIAL_N, 0)),
        (_gate_up_mma_partition, (h_desc, gate_desc, up_desc, a_bufs, b_bufs, ready_bars,
                                  empty_bars, h_smem2, kept_smem2, x_scale_ptr,
                                  w_gate_scale_ptr, w_up_scale_ptr, h_scale_ptr, row_route_ptr,
                                  block_expert_ptr, used_rows_ptr, N, K, topk, swiglu_limit,
                                  stride_xs, stride_wse, stride_wsn, stride_hs, BLOCK_M,
                                  BLOCK_N, BLOCK_K, GROUP_M, ALIGN, NUM_STAGES, HAS_LIMIT,
                                  SWIGLU, QUANTIZE_H, SAVE_GATE_UP, PARTIAL_N, 1)),
        (_gather_load_partition, (x_ptr, w_gate_desc, w_up_desc, row_route_ptr,
                                  block_expert_ptr, used_rows_ptr, a_bufs, b_bufs, ready_bars,
                                  empty_bars, N, K, topk, stride_xm, BLOCK_M, BLOCK_N, BLOCK_K,
                                  GROUP_M, ALIGN, NUM_STAGES, LOAD_WARPS, 2)),
    ], [4, LOAD_WARPS], [MMA_REGS, LOAD_REGS])
