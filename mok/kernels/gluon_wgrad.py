"""Warp-specialized persistent weight gradients for Hopper (sm_90), in Gluon.

out[e] = sum over expert e's rows r, in row order, of a[r, :P]^T b'[token(r), :Q], with
token(r) = row_route[r] // topk and b' = b, or with SCALE_B b's row scaled by the route's router
weight and rounded to b's dtype: the weight gradients of mok.kernels.grouped_gemm.
grouped_wgrad_kernel, for GPUs only (Gluon kernels do not run under Triton's interpreter;
mok.plan gives WgradTiles.gluon only where an sm_90 GPU runs the launch):

- gate/up (NUM_OUT 2): a = d_gate_up [C, 2I] by row, b = x [T, H] by token; the P axis spans
  both halves of d_gate_up: a tile whose columns lie below P_OUT goes to out (d_w_gate), the
  others to out2 (d_w_up), P_OUT = I columns per expert in each, out[e, p, q].
- down (NUM_OUT 1, TRANSPOSE_OUT, SCALE_B): a = h [C, I] by row, b = d_output [T, H] by token,
  scaled by the route's weight; out = d_w_down [E, H, I] takes each tile transposed,
  out[e, q, p].

One CTA per SM strides over the [BLOCK_P, BLOCK_Q] output tiles, expert by expert (so the tiles
of one expert, which read the same rows, run at the same time and share them in L2). Expert
e's rows are [start, end), start = expert_offsets[e] (a multiple of the schedule's align),
end = min(start + expert_counts[e], num_rows); the K loop takes them BLOCK_R at a time (BLOCK_R
divides align, so a step never reaches the next expert's rows). Two partitions share a ring of
NUM_STAGES shared-memory stages, continuous across tiles:

- loader (worker, LOAD_WARPS warps): per K step, a's [BLOCK_R, BLOCK_P] box by TMA (rows past
  end are padding, zeros, or past the tensor, read as zeros) and the gathered b rows by
  cp.async (16-byte copies, zero-filled past end and on padding rows) into the stage's
  [BLOCK_R, BLOCK_Q] buffer; with SCALE_B also the rows' router weights (fp32, 0 past end) into
  the stage's weight buffer by plain stores. Routes are loaded two steps ahead, weights one.
- MMA + epilogue (default partition, num_warps warps): with SCALE_B first b's buffer times the
  weights, rounded, written back (all MMA warps, then a barrier among them); wgmma of each stage
  (a's box permuted: P-contiguous A, b's buffer as [K, N] with N contiguous), one K step in
  flight; after the tile's last step the accumulator (transposed with TRANSPOSE_OUT) in the
  output dtype through shared memory and a TMA store (waited on only before the buffer's next
  use). An expert without rows stores zeros.

Barrier protocol (stage s = i % NUM_STAGES of the i-th K step counted over all of this CTA's
tiles, round = i // NUM_STAGES, phase parity = round & 1), as in mok.kernels.gluon_gate_up:
- ready[s] (count LOAD_WARPS * 32 + 1, + 1 with SCALE_B): the loader arrives once with
  expect-tx (a's box), every loader thread once more through cp.async.mbarrier.arrive.noinc when
  its copies have landed, and with SCALE_B once after its weight stores (an arrive the compiler
  puts behind a barrier of the loader's warps); the MMA partition waits on parity round & 1,
  then fences.
- empty[s] (count 1): the MMA partition arrives once the wgmma that read stage s has completed;
  the loader waits on parity (round & 1) ^ 1 before refilling s.
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


@gluon.jit
def _tile_coords(tile, num_p, num_q):
    """Tile index -> (expert, P block, Q block): experts first, then P, then Q."""
    per_expert = num_p * num_q
    rest = tile % per_expert
    return tile // per_expert, rest // num_q, rest % num_q


@gluon.jit
def _expert_rows(expert_offsets_ptr, expert_counts_ptr, expert, num_rows):
    """[start, end) of the expert's rows (a capacity overflow leaves rows past num_rows out)."""
    start = gl.load(expert_offsets_ptr + expert)
    end = gl.minimum(start + gl.load(expert_counts_ptr + expert), num_rows)
    return start, end


@gluon.jit
def _routes(row_route_ptr, r0, end, offsets):
    """The routes of rows r0 + offsets, -1 past end."""
    rows = r0 + offsets
    return gl.load(row_route_ptr + rows, mask=rows < end, other=-1)


@gluon.jit
def _weights(router_weights_ptr, route, SCALE_B: gl.constexpr):
    """The routes' router weights (0 where route < 0); zeros without SCALE_B."""
    if SCALE_B:
        return gl.load(router_weights_ptr + route, mask=route >= 0, other=0.0)
    return (route * 0).to(gl.float32)


@gluon.jit
def _load_partition(a_desc, b_ptr, row_route_ptr, router_weights_ptr, expert_offsets_ptr,
                    expert_counts_ptr, a_bufs, b_bufs, w_bufs, ready_bars, empty_bars,
                    num_tiles, num_p, num_q, num_rows, topk, stride_bm,
                    BLOCK_P: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_R: gl.constexpr,
                    NUM_STAGES: gl.constexpr, LOAD_WARPS: gl.constexpr, SCALE_B: gl.constexpr):
    """Fills the ring: a's boxes by TMA, b's rows gathered by token by cp.async, with SCALE_B
    the rows' router weights."""
    a_bytes: gl.constexpr = a_desc.block_type.nbytes
    TPW_Q: gl.constexpr = BLOCK_Q // 8 if BLOCK_Q // 8 < 32 else 32
    gather: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_Q, TPW_Q], [LOAD_WARPS, 1],
                                            [1, 0])
    offsets = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, gather))
    cols = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(0, gather))
    i = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        expert, pid_p, pid_q = _tile_coords(tile, num_p, num_q)
        start, end = _expert_rows(expert_offsets_ptr, expert_counts_ptr, expert, num_rows)
        p0 = pid_p * BLOCK_P
        col_ptrs = b_ptr + (pid_q * BLOCK_Q + cols)[None, :]
        route = _routes(row_route_ptr, start, end, offsets)
        route_next = _routes(row_route_ptr, start + BLOCK_R, end, offsets)
        weight = _weights(router_weights_ptr, route, SCALE_B)
        for r0 in range(start, end, BLOCK_R):
            route_after = _routes(row_route_ptr, r0 + 2 * BLOCK_R, end, offsets)
            weight_next = _weights(router_weights_ptr, route_next, SCALE_B)
            s = i % NUM_STAGES
            mbarrier.wait(empty_bars.index(s), ((i // NUM_STAGES) & 1) ^ 1)
            bar = ready_bars.index(s)
            mbarrier.expect(bar, a_bytes)
            tma.async_copy_global_to_shared(a_desc, [r0, p0], bar, a_bufs.index(s))
            valid = route >= 0
            token = gl.where(valid, route // topk, 0).to(gl.int64)
            async_copy.async_copy_global_to_shared(
                b_bufs.index(s), col_ptrs + token[:, None] * stride_bm, mask=valid[:, None])
            async_copy.mbarrier_arrive(bar, increment_count=False)
            if SCALE_B:
                w_bufs.index(s).store(weight)
                mbarrier.arrive(bar)
            route = route_next
            route_next = route_after
            weight = weight_next
            i += 1


@gluon.jit
def _scale_rows(b_buf, w_buf, BLOCK_R: gl.constexpr, BLOCK_Q: gl.constexpr):
    """b_buf's rows times w_buf's weights, rounded to b's dtype, written back by every warp of
    the partition, each fencing its writes for the async proxy, then a barrier among them (so
    no warpgroup's wgmma reads the tile before every warp's part is written)."""
    num_warps: gl.constexpr = gl.num_warps()
    TPW_Q: gl.constexpr = BLOCK_Q // 8 if BLOCK_Q // 8 < 32 else 32
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_Q, TPW_Q], [num_warps, 1],
                                            [1, 0])
    b = b_buf.load(layout)
    w = w_buf.load(gl.SliceLayout(1, layout))
    b_buf.store((b.to(gl.float32) * w[:, None]).to(b.dtype))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _mma_partition(out_desc, out2_desc, a_bufs, b_bufs, w_bufs, ready_bars, empty_bars,
                   c_smem, expert_offsets_ptr, expert_counts_ptr, num_tiles, num_p, num_q,
                   num_rows, P_OUT, Q, BLOCK_P: gl.constexpr, BLOCK_Q: gl.constexpr,
                   BLOCK_R: gl.constexpr, NUM_STAGES: gl.constexpr, SCALE_B: gl.constexpr,
                   TRANSPOSE_OUT: gl.constexpr):
    """wgmma over the ring, then each tile's store into out or out2."""
    num_warps: gl.constexpr = gl.num_warps()
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_Q, 16])
    i = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        expert, pid_p, pid_q = _tile_coords(tile, num_p, num_q)
        start, end = _expert_rows(expert_offsets_ptr, expert_counts_ptr, expert, num_rows)
        acc = gl.zeros([BLOCK_P, BLOCK_Q], gl.float32, acc_layout)
        for r0 in range(start, end, BLOCK_R):
            s = i % NUM_STAGES
            mbarrier.wait(ready_bars.index(s), (i // NUM_STAGES) & 1)
            if SCALE_B:
                _scale_rows(b_bufs.index(s), w_bufs.index(s), BLOCK_R, BLOCK_Q)
            fence_async_shared()  # cp.async and stores (generic proxy) -> wgmma (async proxy)
            acc = warpgroup_mma(a_bufs.index(s).permute((1, 0)), b_bufs.index(s), acc,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            # Release the previous step's stage (none before a tile's first step).
            mbarrier.arrive(empty_bars.index((i + NUM_STAGES - 1) % NUM_STAGES), pred=r0 > start)
            i += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty_bars.index((i + NUM_STAGES - 1) % NUM_STAGES), pred=end > start)

        p0 = pid_p * BLOCK_P
        q0 = pid_q * BLOCK_Q
        tma.store_wait(pendings=0)
        if TRANSPOSE_OUT:
            c_smem.store(acc.permute((1, 0)).to(out_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(out_desc, [expert * Q + q0, p0], c_smem)
        else:
            c_smem.store(acc.to(out_desc.dtype))
            fence_async_shared()
            if p0 < P_OUT:
                tma.async_copy_shared_to_global(out_desc, [expert * P_OUT + p0, q0], c_smem)
            else:
                tma.async_copy_shared_to_global(out2_desc, [expert * P_OUT + p0 - P_OUT, q0],
                                                c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def wgrad_ws_kernel(
    a_desc, b_ptr, out_desc, out2_desc, row_route_ptr, router_weights_ptr, expert_offsets_ptr,
    expert_counts_ptr, num_experts, P_OUT, Q, topk, num_rows, stride_bm,
    BLOCK_P: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_R: gl.constexpr,
    NUM_STAGES: gl.constexpr, LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr,
    B_LAYOUT: gl.constexpr, NUM_OUT: gl.constexpr, SCALE_B: gl.constexpr,
    TRANSPOSE_OUT: gl.constexpr,
):
    """Launched with one program per SM (at most one per tile) and num_warps (a multiple of 4)
    in the default partition, LOAD_WARPS more for the loader (LOAD_REGS registers each).
    Descriptors: a [C, NUM_OUT * P_OUT] with [BLOCK_R, BLOCK_P] boxes; out and out2 (NUM_OUT 2;
    else out again, unused) viewed [E * P_OUT, Q] with [BLOCK_P, BLOCK_Q] boxes, or with
    TRANSPOSE_OUT out viewed [E * Q, P_OUT] with [BLOCK_Q, BLOCK_P] boxes. BLOCK_P divides P_OUT
    and BLOCK_Q divides Q; b [T, Q] has unit column stride and 16-byte aligned rows;
    router_weights_ptr: fp32 by route (SCALE_B; else unused). B_LAYOUT: the shared layout of
    b's [BLOCK_R, BLOCK_Q] buffers."""
    dtype: gl.constexpr = a_desc.dtype
    num_p = NUM_OUT * P_OUT // BLOCK_P
    num_q = Q // BLOCK_Q
    num_tiles = num_experts * num_p * num_q
    a_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_R, BLOCK_P], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_R, BLOCK_Q], B_LAYOUT)
    w_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_R],
                                       gl.SwizzledSharedLayout(1, 1, 1, [0]))
    c_smem = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape,
                                       out_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    READY_COUNT: gl.constexpr = LOAD_WARPS * 32 + 2 if SCALE_B else LOAD_WARPS * 32 + 1
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready_bars.index(s), count=READY_COUNT)
        mbarrier.init(empty_bars.index(s), count=1)

    gl.warp_specialize([
        (_mma_partition, (out_desc, out2_desc, a_bufs, b_bufs, w_bufs, ready_bars, empty_bars,
                          c_smem, expert_offsets_ptr, expert_counts_ptr, num_tiles, num_p,
                          num_q, num_rows, P_OUT, Q, BLOCK_P, BLOCK_Q, BLOCK_R, NUM_STAGES,
                          SCALE_B, TRANSPOSE_OUT)),
        (_load_partition, (a_desc, b_ptr, row_route_ptr, router_weights_ptr,
                           expert_offsets_ptr, expert_counts_ptr, a_bufs, b_bufs, w_bufs,
                           ready_bars, empty_bars, num_tiles, num_p, num_q, num_rows, topk,
                           stride_bm, BLOCK_P, BLOCK_Q, BLOCK_R, NUM_STAGES, LOAD_WARPS,
                           SCALE_B)),
    ], [LOAD_WARPS], [LOAD_REGS])
