"""Warp-specialized persistent grouped GEMM with a SwiGLU epilogue for Hopper (sm_90), in Gluon.

h[r, n] = silu(g) * u, g = x[token(r)] . w_gate[e, n], u = x[token(r)] . w_up[e, n], with
e = block_expert[r // ALIGN], token(r) = row_route[r] // topk, h = 0 on padding rows (route -1):
the gate/up GEMM of mok.kernels.grouped_gemm.gate_up_swiglu_kernel (same rows, tiles and
K order), for GPUs only (Gluon kernels do not run under Triton's interpreter; mok.ops picks
this kernel where RowTiles.gluon asks for it and an sm_90 GPU runs it). HAS_LIMIT: gate
clamped from above and up on both sides at the swiglu limit first. SAVE_GATE_UP: the
pre-activations also go to gate_up (descriptors of its gate and up halves), a clamped value
stored as +-inf, as the Triton kernel does.

One CTA per SM strides over the [BLOCK_M, BLOCK_N] output tiles of the used rows (grouped by
GROUP_M row blocks so an expert's weight tiles stay in L2). Two partitions share a ring of
NUM_STAGES shared-memory stages, continuous across tiles (the loader runs ahead into the next
tile while the MMA partition is in its epilogue):

- loader (worker, LOAD_WARPS warps): per K step, the gate and up weight tiles by TMA into the
  two halves of the stage's B buffer [2 * BLOCK_N, BLOCK_K], and the gathered x rows by cp.async
  (16-byte copies, zero-filled on padding rows) into its A buffer [BLOCK_M, BLOCK_K].
- MMA + epilogue (default partition, num_warps = BLOCK_M // 16 warps, each warpgroup 64 rows):
  wgmma of each stage, one K step in flight; after the K loop silu(g) * u in fp32, bf16, through
  shared memory and a TMA store (waited on only before the next tile's store).

Barrier protocol (stage s = i % NUM_STAGES of the i-th K step counted over all of this CTA's
tiles, round = i // NUM_STAGES, phase parity = round & 1):
- ready[s] (count LOAD_WARPS * 32 + 1): the loader arrives once with expect-tx (the two weight
  boxes' bytes, completed by TMA) and every loader thread once more through
  cp.async.mbarrier.arrive.noinc when its own A copies have landed. The MMA partition waits on
  parity round & 1, then fences (cp.async writes through the generic proxy, wgmma reads through
  the async proxy).
- empty[s] (count 1): the MMA partition arrives (one thread, after a partition-wide bar.sync
  that the compiler puts before an arrive) once the wgmma that read stage s has completed
  (warpgroup_mma_wait leaving only the next step's wgmma in flight). The loader waits on parity
  (round & 1) ^ 1 before refilling s, so the first round passes at once.
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
from mok.kernels.gluon_comm import pull_partition, wait_ranks_landed, wait_rows_ready


@gluon.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """Tile index -> (row block, column block), GROUP_M row blocks at a time."""
    width = GROUP_M * num_pid_n
    first_m = (tile // width) * GROUP_M
    size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % width) % size_m
    pid_n = (tile % width) // size_m
    return pid_m, pid_n


@gluon.jit
def _ordered_coords(tile, num_pid_m, num_pid_n, block_order_ptr, GROUP_M: gl.constexpr,
                    BLOCK_ORDER: gl.constexpr):
    """_tile_coords, the row blocks taken in block_order's order with BLOCK_ORDER."""
    pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
    if BLOCK_ORDER:
        pid_m = gl.load(block_order_ptr + pid_m)
    return pid_m, pid_n


@gluon.jit
def _tile_corner(tile, num_pid_m, num_pid_n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 GROUP_M: gl.constexpr):
    """Tile index -> its first row and column (see _tile_coords)."""
    pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@gluon.jit
def _tile_grid(used_rows_ptr, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(row blocks, column blocks, tiles) of the used rows, their count read on the device."""
    num_pid_m = gl.load(used_rows_ptr) // BLOCK_M
    num_pid_n = gl.cdiv(N, BLOCK_N)
    return num_pid_m, num_pid_n, num_pid_m * num_pid_n


@gluon.jit
def _tile_tokens(row_route_ptr, r0, topk, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                 LOAD_WARPS: gl.constexpr):
    """(token [BLOCK_M, 1] int64 of a tile's rows, 0 on padding, whether each row is a route
    [BLOCK_M, 1], columns [1, BLOCK_K]) in the gathers' layout: 16-byte pieces, BLOCK_K // 8
    threads to a row, the warps stacking rows."""
    TPW_K: gl.constexpr = BLOCK_K // 8
    gather: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_K, TPW_K], [LOAD_WARPS, 1],
                                            [1, 0])
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, gather))
    cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, gather))
    route = gl.load(row_route_ptr + r0 + rows)
    valid = route >= 0
    token = gl.where(valid, route // topk, 0)
    return token.to(gl.int64)[:, None], valid[:, None], cols[None, :]


@gluon.jit
def _load_partition(x_ptr, w_gate_desc, w_up_desc, row_route_ptr, block_expert_ptr,
                    used_rows_ptr, block_order_ptr, a_bufs, b_bufs, ready_bars, empty_bars,
                    N, K, topk, stride_xm, position_ptr, ready_ptr, seq_ptr, phase, timeout,
                    error_ptr, world_size,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                    GROUP_M: gl.constexpr, ALIGN: gl.constexpr, NUM_STAGES: gl.constexpr,
                    LOAD_WARPS: gl.constexpr, PULL: gl.constexpr, MINIBATCH: gl.constexpr,
                    WAIT_ROWS: gl.constexpr, BLOCK_ORDER: gl.constexpr):
    """Fills the ring: weight tiles by TMA, gathered x rows by cp.async (with PULL once the
    tile's tokens have landed, with WAIT_ROWS once its rows' ranks' copies have, see
    mok.kernels.gluon_comm). BLOCK_ORDER: row blocks in block_order's order."""
    w_bytes: gl.constexpr = 2 * w_gate_desc.block_type.nbytes

    num_pid_m, num_pid_n, num_tiles = _tile_grid(used_rows_ptr, N, BLOCK_M, BLOCK_N)
    k_steps = K // BLOCK_K
    i = 0
    landed = num_tiles - num_tiles  # WAIT_ROWS: a bit per rank whose rows were seen landed
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pid_m, pid_n = _ordered_coords(tile, num_pid_m, num_pid_n, block_order_ptr, GROUP_M,
                                       BLOCK_ORDER)
        r0 = pid_m * BLOCK_M
        expert = gl.load(block_expert_ptr + r0 // ALIGN)
        token, a_mask, cols = _tile_tokens(row_route_ptr, r0, topk, BLOCK_M, BLOCK_K,
                                           LOAD_WARPS)
        a_ptrs = x_ptr + token * stride_xm + cols
        w_row = expert * N + pid_n * BLOCK_N  # rows of w viewed [E * N, K]
        if PULL:
            wait_rows_ready(row_route_ptr, r0, topk, position_ptr, ready_ptr, seq_ptr, phase,
                            timeout, error_ptr, BLOCK_M, MINIBATCH, LOAD_WARPS)
        if WAIT_ROWS:
            landed = wait_ranks_landed(row_route_ptr, r0, topk, ready_ptr, seq_ptr, phase,
                                       timeout, error_ptr, landed, world_size, BLOCK_M, MINIBATCH,
                                       LOAD_WARPS)
        for kk in range(k_steps):
            s = i % NUM_STAGES
            mbarrier.wait(empty_bars.index(s), ((i // NUM_STAGES) & 1) ^ 1)
            bar = ready_bars.index(s)
            b_buf = b_bufs.index(s)
            k0 = kk * BLOCK_K
            mbarrier.expect(bar, w_bytes)
            tma.async_copy_global_to_shared(w_gate_desc, [w_row, k0], bar,
                                            b_buf.slice(0, BLOCK_N))
            tma.async_copy_global_to_shared(w_up_desc, [w_row, k0], bar,
                                            b_buf.slice(BLOCK_N, BLOCK_N))
            async_copy.async_copy_global_to_shared(a_bufs.index(s), a_ptrs + k0, mask=a_mask)
            async_copy.mbarrier_arrive(bar, increment_count=False)
            i += 1


@gluon.jit
def _put(desc, value, r0, c0, c_smem):
    """value -> desc's box at (r0, c0) through c_smem, once the previous store has read it."""
    tma.store_wait(pendings=0)
    c_smem.store(value.to(desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc, [r0, c0], c_smem)


@gluon.jit
def _mma_partition(h_desc, gate_desc, up_desc, a_bufs, b_bufs, ready_bars, empty_bars, c_smem,
                   used_rows_ptr, block_order_ptr, N, K, swiglu_limit,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                   GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr, HAS_LIMIT: gl.constexpr,
                   SAVE_GATE_UP: gl.constexpr, BLOCK_ORDER: gl.constexpr):
    """wgmma over the ring, then the SwiGLU epilogue and the TMA stores."""
    num_warps: gl.constexpr = gl.num_warps()
    # One [BLOCK_M, 2 * BLOCK_N] accumulator (gate columns, then up): one wgmma of
    # N = 2 * BLOCK_N a step, so the A tile is read once.
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 2 * BLOCK_N, 16])
    half_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])

    num_pid_m, num_pid_n, num_tiles = _tile_grid(used_rows_ptr, N, BLOCK_M, BLOCK_N)
    k_steps = K // BLOCK_K
    i = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pid_m, pid_n = _ordered_coords(tile, num_pid_m, num_pid_n, block_order_ptr, GROUP_M,
                                       BLOCK_ORDER)
        acc = gl.zeros([BLOCK_M, 2 * BLOCK_N], gl.float32, acc_layout)
        for kk in range(k_steps):
            s = i % NUM_STAGES
            mbarrier.wait(ready_bars.index(s), (i // NUM_STAGES) & 1)
            fence_async_shared()  # cp.async (generic proxy) -> wgmma (async proxy)
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc,
                                is_async=True)
            # Leaves this step's wgmma in flight: the previous step's is done.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            # Release the previous step's stage (none before a tile's first step: the last
            # step of the previous tile was released after its final wait).
            mbarrier.arrive(empty_bars.index((i + NUM_STAGES - 1) % NUM_STAGES), pred=kk > 0)
            i += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty_bars.index((i + NUM_STAGES - 1) % NUM_STAGES))

        gate, up = acc.reshape([BLOCK_M, 2, BLOCK_N]).permute((0, 2, 1)).split()
        gate = gl.convert_layout(gate, half_layout)
        up = gl.convert_layout(up, half_layout)
        r0 = pid_m * BLOCK_M
        c0 = pid_n * BLOCK_N
        if SAVE_GATE_UP:
            # The backward computes from these rounded values, h below from the unrounded
            # ones; a value the limit clamps is kept as +-inf, so rounding cannot move it back
            # across the limit, which decides whether its gradient passes.
            gate_kept = gate
            up_kept = up
            if HAS_LIMIT:
                gate_kept, up_kept = activation.kept(gate, up, swiglu_limit)
            _put(gate_desc, gate_kept, r0, c0, c_smem)
            _put(up_desc, up_kept, r0, c0, c_smem)
        if HAS_LIMIT:
            gate, up = activation.clamp(gate, up, swiglu_limit)
        h = activation.swiglu(gate, up)
        _put(h_desc, h, r0, c0, c_smem)  # waited on only before c_smem's next use
    tma.store_wait(pendings=0)


@gluon.jit
def gate_up_swiglu_ws_kernel(
    x_ptr, w_gate_desc, w_up_desc, h_desc, gate_desc, up_desc, row_route_ptr, block_expert_ptr,
    used_rows_ptr, N, K, topk, stride_xm, swiglu_limit,
    pull_src_ptr, pull_src_delta_ptr, pull_w_ptr, pull_w_delta_ptr, pull_dst_w_ptr,
    pull_order_ptr, pull_position_ptr, pull_moving_ptr, ready_ptr, seq_ptr, flags_ptr,
    flag_delta_ptr, error_ptr, pull_claim_ptr, phase, publish_slot, tokens_per_rank,
    world_size, timeout, stride_pull_src,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    ALIGN: gl.constexpr, NUM_STAGES: gl.constexpr, LOAD_WARPS: gl.constexpr,
    LOAD_REGS: gl.constexpr, HAS_LIMIT: gl.constexpr, SAVE_GATE_UP: gl.constexpr,
    A_LAYOUT: gl.constexpr, PULL: gl.constexpr, PULL_WEIGHTS: gl.constexpr,
    MINIBATCH: gl.constexpr, PULL_BLOCK_R: gl.constexpr, PULL_BLOCK_W: gl.constexpr,
    PULL_K_PAD: gl.constexpr, PULL_ROW_ALIGN: gl.constexpr, PULL_WARPS: gl.constexpr,
    PULL_REGS: gl.constexpr, WAIT_ROWS: gl.constexpr,
):
    """Launched with one program per SM and num_warps = BLOCK_M // 16 (a warpgroup per 64 rows)
    in the default partition, LOAD_WARPS more for the loader (LOAD_REGS registers each). The
    descriptors: w viewed [E * N, K] with [BLOCK_N, BLOCK_K] boxes (a box's rows past its
    expert's N read the next expert's and reach only columns >= N, which the stores clip);
    h [R, N] and, with SAVE_GATE_UP, gate_up's halves [R, N] (row stride 2N), [BLOCK_M,
    BLOCK_N] boxes (gate_desc and up_desc are h_desc otherwise, unused).

    PULL (expert parallelism): x is the group's token rows [P * T, K], pulled from their ranks
    while the tiles run by a third partition of PULL_WARPS warps (PULL_REGS registers) in every
    program (mok.kernels.gluon_comm.pull_partition; the pull_* arguments as the Triton
    kernels' pull, mok.ops.comm.Pull), the loader gathering a tile's rows once they landed.
    WAIT_ROWS (without PULL): the rows land by copies outside the kernel (copy engines, see
    mok.exchange.SymmetricExchange.forward_copy), a flag per rank, which the loader waits on
    (mok.kernels.gluon_comm.wait_ranks_landed); the row blocks are taken in the order of
    pull_order_ptr (those of this rank's rows first, so the copies land while they run)."""
    dtype: gl.constexpr = w_gate_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], A_LAYOUT)
    b_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, 2 * BLOCK_N, BLOCK_K],
                                       w_gate_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, h_desc.block_type.shape, h_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready_bars.index(s), count=LOAD_WARPS * 32 + 1)
        mbarrier.init(empty_bars.index(s), count=1)

    # The partitions' argument tuples are written out in each call: a tuple held in a variable
    # loses its constexprs.
    if PULL:
        gl.warp_specialize([
            (_mma_partition, (h_desc, gate_desc, up_desc, a_bufs, b_bufs, ready_bars,
                              empty_bars, c_smem, used_rows_ptr, pull_order_ptr, N, K,
                              swiglu_limit, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_STAGES,
                              HAS_LIMIT, SAVE_GATE_UP, False)),
            (_load_partition, (x_ptr, w_gate_desc, w_up_desc, row_route_ptr, block_expert_ptr,
                               used_rows_ptr, pull_order_ptr, a_bufs, b_bufs, ready_bars,
                               empty_bars, N, K, topk, stride_xm, pull_position_ptr,
                               ready_ptr, seq_ptr, phase, timeout, error_ptr, world_size,
                               BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, ALIGN, NUM_STAGES,
                               LOAD_WARPS, True, MINIBATCH, False, False)),
            (pull_partition, (pull_src_ptr, pull_src_delta_ptr, pull_w_ptr, pull_w_delta_ptr,
                              x_ptr, pull_dst_w_ptr, pull_order_ptr, pull_moving_ptr,
                              ready_ptr, flags_ptr, flag_delta_ptr, seq_ptr, error_ptr,
                              pull_claim_ptr, phase, publish_slot, tokens_per_rank, topk, K,
                              world_size, timeout,
                              stride_pull_src, stride_xm, PULL_WEIGHTS, MINIBATCH, PULL_BLOCK_R,
                              PULL_BLOCK_W, PULL_K_PAD, PULL_ROW_ALIGN, PULL_WARPS)),
        ], [LOAD_WARPS, PULL_WARPS], [LOAD_REGS, PULL_REGS])
    else:
        gl.warp_specialize([
            (_mma_partition, (h_desc, gate_desc, up_desc, a_bufs, b_bufs, ready_bars,
                              empty_bars, c_smem, used_rows_ptr, pull_order_ptr, N, K,
                              swiglu_limit, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_STAGES,
                              HAS_LIMIT, SAVE_GATE_UP, WAIT_ROWS)),
            (_load_partition, (x_ptr, w_gate_desc, w_up_desc, row_route_ptr, block_expert_ptr,
                               used_rows_ptr, pull_order_ptr, a_bufs, b_bufs, ready_bars,
                               empty_bars, N, K, topk, stride_xm, pull_position_ptr,
                               ready_ptr, seq_ptr, phase, timeout, error_ptr, world_size,
                               BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, ALIGN, NUM_STAGES,
                               LOAD_WARPS, False, MINIBATCH, WAIT_ROWS, WAIT_ROWS)),
        ], [LOAD_WARPS], [LOAD_REGS])
