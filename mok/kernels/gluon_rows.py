"""Warp-specialized persistent grouped GEMMs over whole row tiles for Hopper (sm_90), in Gluon.

Two GEMMs whose A operand is read whole (rows in schedule order, no gather), so every operand
comes by TMA:

- down_proj_ws_kernel: out[r, n] = w[route(r)] * sum_k h[r, k] * w_down[e, n, k] (N = H,
  K = I), the down projection of mok.kernels.grouped_gemm.down_proj_kernel without SCATTER;
  w = router_weights[route] (HAS_WEIGHT; 0 on padding rows, route -1), e =
  block_expert[r // ALIGN].
- d_x_rows_ws_kernel: out[r, n] = sum_k dg[r, k] * w_gate[e, k, n] + du[r, k] * w_up[e, k, n]
  (N = H, K = I; dg and du the two halves of d_gate_up [R, 2K]), the GEMM of
  mok.kernels.grouped_gemm.d_x_rows_kernel without SCATTER or PULL. Its K loop takes, for each
  k0, the gate product and then the up product, as the Triton kernel does: two ring stages.

SCATTER (expert parallelism): each output row goes to its token's rank instead, row
g % routes_per_rank of that rank's `out` (its combine buffer), g = dest_route[r] (the group's
route; -1: padding, not written), as the Triton kernels' SCATTER does: the epilogue slice goes
through shared memory as for TMA, is read back a row's 16-byte pieces to a thread and stored by
pointer (TMA boxes cannot scatter rows).

PULL (d_x, expert parallelism with kept pre-activations): a third partition of PULL_WARPS warps
in every program pulls token rows from their ranks for a later kernel (the weight gradients'
x), mok.kernels.gluon_comm.pull_partition; no tile here waits on them.

Same rows, tiles and K order as the Triton kernels; GPUs only (mok.ops picks these kernels where
RowTiles.gluon asks for them and an sm_90 GPU runs them). The structure is that of
mok.kernels.gluon_gate_up: one CTA per SM strides over the [BLOCK_M, BLOCK_N] output tiles of
the used rows (GROUP_M row blocks at a time), two partitions share a ring of NUM_STAGES stages,
continuous across tiles:

- loader (worker, one warp): per K step, the A tile [BLOCK_M, BLOCK_K] and the weight tile by
  TMA into the stage's buffers (down: [BLOCK_N, BLOCK_K], K contiguous, permuted for wgmma;
  d_x: [BLOCK_K, BLOCK_N], N contiguous, as wgmma's B).
- MMA + epilogue (default partition, BLOCK_M // 16 warps, a warpgroup per 64 rows): wgmma of
  each stage, one K step in flight; after the K loop the router-weight scaling (down, the
  weights loaded at the tile's start), then through shared memory and a TMA store in EPI_SPLIT
  column slices of [BLOCK_M, BLOCK_N // EPI_SPLIT] (each store waited on only before the
  buffer's next use).

Barrier protocol (stage s = i % NUM_STAGES of the i-th K step counted over all of this CTA's
tiles, round = i // NUM_STAGES, phase parity = round & 1):
- ready[s] (count 1): the loader arrives with expect-tx (the two boxes' bytes, completed by
  TMA); the MMA partition waits on parity round & 1.
- empty[s] (count 1): the MMA partition arrives once the wgmma that read stage s has completed
  (warpgroup_mma_wait leaving only the next step's wgmma in flight); the loader waits on parity
  (round & 1) ^ 1 before refilling s, so the first round passes at once.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from mok.kernels.gluon_comm import pull_partition
from mok.kernels.gluon_gate_up import _put, _tile_corner, _tile_grid


@gluon.jit
def _scatter_rows(value, r0, c0, c_smem, dest_route_ptr, out_ptr, out_delta_ptr,
                  routes_per_rank, stride_out, N, BLOCK_M: gl.constexpr, WIDTH: gl.constexpr,
                  ROW_ALIGN: gl.constexpr):
    """value [BLOCK_M, WIDTH] (columns c0 ..) -> row g % routes_per_rank of `out` on rank
    g // routes_per_rank, g = dest_route[r0 + row] (>= 0), through c_smem."""
    num_warps: gl.constexpr = gl.num_warps()
    TPW_N: gl.constexpr = 32 if WIDTH // 8 >= 32 else WIDTH // 8
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_N, TPW_N], [num_warps, 1], [1, 0])
    gl.thread_barrier()  # every warp has read the previous slice
    c_smem.store(value.to(c_smem.dtype))
    gl.thread_barrier()
    tile = c_smem.load(layout)
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = c0 + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    route = gl.load(dest_route_ptr + r0 + rows)
    valid = route >= 0
    dst_rank = gl.where(valid, route // routes_per_rank, 0)
    delta = gl.load(out_delta_ptr + dst_rank, mask=valid, other=0)
    offsets = gl.multiple_of(delta + (route % routes_per_rank).to(gl.int64) * stride_out,
                             ROW_ALIGN)
    mask = valid[:, None] & (cols < N)[None, :]
    gl.store(out_ptr + offsets[:, None] + cols[None, :], tile, mask=mask)


@gluon.jit
def _out_slice(out_desc, value, r0, c0, c_smem, dest_route_ptr, out_ptr, out_delta_ptr,
               routes_per_rank, stride_out, N, BLOCK_M: gl.constexpr, WIDTH: gl.constexpr,
               SCATTER: gl.constexpr, ROW_ALIGN: gl.constexpr):
    """An epilogue slice [BLOCK_M, WIDTH] at (r0, c0): by TMA, or with SCATTER to its rows'
    ranks (_scatter_rows)."""
    if SCATTER:
        _scatter_rows(value, r0, c0, c_smem, dest_route_ptr, out_ptr, out_delta_ptr,
                      routes_per_rank, stride_out, N, BLOCK_M, WIDTH, ROW_ALIGN)
    else:
        _put(out_desc, value, r0, c0, c_smem)  # waited on only before c_smem's next use


@gluon.jit
def _load_step(a_desc, a_r, a_c, b_desc, b_r, b_c, a_bufs, b_bufs, ready_bars, empty_bars, i,
               NUM_STAGES: gl.constexpr):
    """K step i: its A box at (a_r, a_c) and weight box at (b_r, b_c) into stage i % NUM_STAGES,
    once the MMA partition has released it. Returns i + 1."""
    s = i % NUM_STAGES
    mbarrier.wait(empty_bars.index(s), ((i // NUM_STAGES) & 1) ^ 1)
    bar = ready_bars.index(s)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [a_r, a_c], bar, a_bufs.index(s))
    tma.async_copy_global_to_shared(b_desc, [b_r, b_c], bar, b_bufs.index(s))
    return i + 1


@gluon.jit
def _load_partition(a_desc, b_desc, b2_desc, block_expert_ptr, used_rows_ptr, a_bufs, b_bufs,
                    ready_bars, empty_bars, N, K,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                    GROUP_M: gl.constexpr, ALIGN: gl.constexpr, NUM_STAGES: gl.constexpr,
                    D_X: gl.constexpr):
    """Fills the ring, A and weight tiles by TMA (D_X: a gate step, then an up step per k0)."""
    num_pid_m, num_pid_n, num_tiles = _tile_grid(used_rows_ptr, N, BLOCK_M, BLOCK_N)
    i = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        r0, c0 = _tile_corner(tile, num_pid_m, num_pid_n, BLOCK_M, BLOCK_N, GROUP_M)
        expert = gl.load(block_expert_ptr + r0 // ALIGN)
        if D_X:
            # w viewed [E * K, N]: BLOCK_K divides K, so a box stays in its expert's rows
            for kk in range(K // BLOCK_K):
                k0 = kk * BLOCK_K
                w_row = expert * K + k0
                i = _load_step(a_desc, r0, k0, b_desc, w_row, c0, a_bufs, b_bufs, ready_bars,
                               empty_bars, i, NUM_STAGES)
                i = _load_step(a_desc, r0, K + k0, b2_desc, w_row, c0, a_bufs, b_bufs,
                               ready_bars, empty_bars, i, NUM_STAGES)
        else:
            # w viewed [E * N, K]: rows past the expert's N reach only columns >= N (clipped)
            w_row = expert * N + c0
            for kk in range(gl.cdiv(K, BLOCK_K)):
                k0 = kk * BLOCK_K
                i = _load_step(a_desc, r0, k0, b_desc, w_row, k0, a_bufs, b_bufs, ready_bars,
                               empty_bars, i, NUM_STAGES)


@gluon.jit
def _mma_partition(out_desc, a_bufs, b_bufs, ready_bars, empty_bars, c_smem, router_weights_ptr,
                   row_route_ptr, used_rows_ptr, N, K, out_ptr, out_delta_ptr, routes_per_rank,
                   stride_out,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                   GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr, EPI_SPLIT: gl.constexpr,
                   HAS_WEIGHT: gl.constexpr, D_X: gl.constexpr, SCATTER: gl.constexpr,
                   ROW_ALIGN: gl.constexpr):
    """wgmma over the ring, then the epilogue and the TMA stores (or SCATTER's)."""
    num_warps: gl.constexpr = gl.num_warps()
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    HALF: gl.constexpr = BLOCK_N // 2
    half_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HALF, 16])
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))

    num_pid_m, num_pid_n, num_tiles = _tile_grid(used_rows_ptr, N, BLOCK_M, BLOCK_N)
    if D_X:
        k_steps = 2 * (K // BLOCK_K)
    else:
        k_steps = gl.cdiv(K, BLOCK_K)
    i = 0
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        r0, c0 = _tile_corner(tile, num_pid_m, num_pid_n, BLOCK_M, BLOCK_N, GROUP_M)
        if HAS_WEIGHT:  # loaded now, used after the K loop
            route = gl.load(row_route_ptr + r0 + rows)
            weight = gl.load(router_weights_ptr + route, mask=route >= 0, other=0.0)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        for kk in range(k_steps):
            s = i % NUM_STAGES
            mbarrier.wait(ready_bars.index(s), (i // NUM_STAGES) & 1)
            if D_X:
                b = b_bufs.index(s)
            else:
                b = b_bufs.index(s).permute((1, 0))
            acc = warpgroup_mma(a_bufs.index(s), b, acc, is_async=True)
            # Leaves this step's wgmma in flight: the previous step's is done.
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            # Release the previous step's stage (none before a tile's first step: the last
            # step of the previous tile was released after its final wait).
            mbarrier.arrive(empty_bars.index((i + NUM_STAGES - 1) % NUM_STAGES), pred=kk > 0)
            i += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty_bars.index((i + NUM_STAGES - 1) % NUM_STAGES))

        if HAS_WEIGHT:
            acc = acc * weight[:, None]
        if EPI_SPLIT == 1:
            _out_slice(out_desc, acc, r0, c0, c_smem, row_route_ptr, out_ptr, out_delta_ptr,
                       routes_per_rank, stride_out, N, BLOCK_M, BLOCK_N, SCATTER, ROW_ALIGN)
        else:
            first, second = acc.reshape([BLOCK_M, 2, HALF]).permute((0, 2, 1)).split()
            _out_slice(out_desc, gl.convert_layout(first, half_layout), r0, c0, c_smem,
                       row_route_ptr, out_ptr, out_delta_ptr, routes_per_rank, stride_out, N,
                       BLOCK_M, HALF, SCATTER, ROW_ALIGN)
            _out_slice(out_desc, gl.convert_layout(second, half_layout), r0, c0 + HALF, c_smem,
                       row_route_ptr, out_ptr, out_delta_ptr, routes_per_rank, stride_out, N,
                       BLOCK_M, HALF, SCATTER, ROW_ALIGN)
    tma.store_wait(pendings=0)


@gluon.jit
def _rows_gemm(a_desc, b_desc, b2_desc, out_desc, router_weights_ptr, row_route_ptr,
               block_expert_ptr, used_rows_ptr, N, K, out_ptr, out_delta_ptr, routes_per_rank,
               stride_out,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
               GROUP_M: gl.constexpr, ALIGN: gl.constexpr, NUM_STAGES: gl.constexpr,
               EPI_SPLIT: gl.constexpr, LOAD_REGS: gl.constexpr, HAS_WEIGHT: gl.constexpr,
               D_X: gl.constexpr, SCATTER: gl.constexpr, ROW_ALIGN: gl.constexpr,
               pull_src_ptr=None, pull_src_delta_ptr=None, pulled_ptr=None, stride_pulled=0,
               pull_order_ptr=None, pull_moving_ptr=None, ready_ptr=None, seq_ptr=None,
               flags_ptr=None, flag_delta_ptr=None, error_ptr=None, pull_claim_ptr=None,
               phase=0, publish_slot=0,
               tokens_per_rank=0, world_size=0, timeout=0, stride_pull_src=0, pull_width=0,
               PULL: gl.constexpr = False, MINIBATCH: gl.constexpr = 1,
               PULL_BLOCK_R: gl.constexpr = 1, PULL_BLOCK_W: gl.constexpr = 8,
               PULL_ROW_ALIGN: gl.constexpr = 1, PULL_WARPS: gl.constexpr = 1,
               PULL_REGS: gl.constexpr = 24):
    """The ring, the epilogue buffer and the barriers; then the two partitions."""
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    if D_X:
        b_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_K, BLOCK_N], b_desc.layout)
    else:
        b_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, out_desc.block_type.shape, out_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready_bars.index(s), count=1)
        mbarrier.init(empty_bars.index(s), count=1)

    # The partitions' argument tuples are written out in each call: a tuple held in a variable
    # loses its constexprs.
    if PULL:
        gl.warp_specialize([
            (_mma_partition, (out_desc, a_bufs, b_bufs, ready_bars, empty_bars, c_smem,
                              router_weights_ptr, row_route_ptr, used_rows_ptr, N, K, out_ptr,
                              out_delta_ptr, routes_per_rank, stride_out, BLOCK_M, BLOCK_N,
                              BLOCK_K, GROUP_M, NUM_STAGES, EPI_SPLIT, HAS_WEIGHT, D_X, SCATTER,
                              ROW_ALIGN)),
            (_load_partition, (a_desc, b_desc, b2_desc, block_expert_ptr, used_rows_ptr, a_bufs,
                               b_bufs, ready_bars, empty_bars, N, K, BLOCK_M, BLOCK_N, BLOCK_K,
                               GROUP_M, ALIGN, NUM_STAGES, D_X)),
            (pull_partition, (pull_src_ptr, pull_src_delta_ptr, pull_src_ptr,
                              pull_src_delta_ptr, pulled_ptr, pulled_ptr, pull_order_ptr,
                              pull_moving_ptr, ready_ptr, flags_ptr, flag_delta_ptr, seq_ptr,
                              error_ptr, pull_claim_ptr, phase, publish_slot,
                              tokens_per_rank, 1, pull_width, world_size, timeout,
                              stride_pull_src, stride_pulled, False, MINIBATCH,
                              PULL_BLOCK_R, PULL_BLOCK_W, 1, PULL_ROW_ALIGN, PULL_WARPS)),
        ], [1, PULL_WARPS], [LOAD_REGS, PULL_REGS])
    else:
        gl.warp_specialize([
            (_mma_partition, (out_desc, a_bufs, b_bufs, ready_bars, empty_bars, c_smem,
                              router_weights_ptr, row_route_ptr, used_rows_ptr, N, K, out_ptr,
                              out_delta_ptr, routes_per_rank, stride_out, BLOCK_M, BLOCK_N,
                              BLOCK_K, GROUP_M, NUM_STAGES, EPI_SPLIT, HAS_WEIGHT, D_X, SCATTER,
                              ROW_ALIGN)),
            (_load_partition, (a_desc, b_desc, b2_desc, block_expert_ptr, used_rows_ptr, a_bufs,
                               b_bufs, ready_bars, empty_bars, N, K, BLOCK_M, BLOCK_N, BLOCK_K,
                               GROUP_M, ALIGN, NUM_STAGES, D_X)),
        ], [1], [LOAD_REGS])


@gluon.jit
def down_proj_ws_kernel(
    h_desc, w_desc, out_desc, router_weights_ptr, row_route_ptr, block_expert_ptr,
    used_rows_ptr, N, K, out_ptr, out_delta_ptr, routes_per_rank, stride_out,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    ALIGN: gl.constexpr, NUM_STAGES: gl.constexpr, EPI_SPLIT: gl.constexpr,
    LOAD_REGS: gl.constexpr, HAS_WEIGHT: gl.constexpr, SCATTER: gl.constexpr,
    ROW_ALIGN: gl.constexpr,
):
    """Launched with one program per SM and num_warps = BLOCK_M // 16. Descriptors: h [R, K]
    with [BLOCK_M, BLOCK_K] boxes, w_down viewed [E * N, K] with [BLOCK_N, BLOCK_K] boxes (TMA
    zero-fills both past K), out [R, N] with [BLOCK_M, BLOCK_N // EPI_SPLIT] boxes (with
    SCATTER a descriptor of the same box over the local `out`, for the epilogue buffer's shape).
    router_weights_ptr: fp32 [T * topk] by route (unused without HAS_WEIGHT). SCATTER: out_ptr
    (row stride stride_out), out_delta_ptr, routes_per_rank as the Triton kernels' (the
    destination routes are row_route's)."""
    _rows_gemm(h_desc, w_desc, w_desc, out_desc, router_weights_ptr, row_route_ptr,
               block_expert_ptr, used_rows_ptr, N, K, out_ptr, out_delta_ptr, routes_per_rank,
               stride_out, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, ALIGN, NUM_STAGES, EPI_SPLIT,
               LOAD_REGS, HAS_WEIGHT, False, SCATTER, ROW_ALIGN)


@gluon.jit
def d_x_rows_ws_kernel(
    d_gate_up_desc, w_gate_desc, w_up_desc, out_desc, block_expert_ptr, used_rows_ptr, N, K,
    row_route_ptr, out_ptr, out_delta_ptr, routes_per_rank, stride_out,
    pull_src_ptr, pull_src_delta_ptr, pulled_ptr, stride_pulled, pull_order_ptr,
    pull_moving_ptr, ready_ptr, seq_ptr, flags_ptr, flag_delta_ptr, error_ptr, pull_claim_ptr,
    phase, publish_slot, tokens_per_rank, world_size, timeout, stride_pull_src, pull_width,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    ALIGN: gl.constexpr, NUM_STAGES: gl.constexpr, EPI_SPLIT: gl.constexpr,
    LOAD_REGS: gl.constexpr, SCATTER: gl.constexpr, ROW_ALIGN: gl.constexpr,
    PULL: gl.constexpr, MINIBATCH: gl.constexpr, PULL_BLOCK_R: gl.constexpr,
    PULL_BLOCK_W: gl.constexpr, PULL_ROW_ALIGN: gl.constexpr, PULL_WARPS: gl.constexpr,
    PULL_REGS: gl.constexpr,
):
    """Launched with one program per SM and num_warps = BLOCK_M // 16. Descriptors: d_gate_up
    [R, 2K] with [BLOCK_M, BLOCK_K] boxes, w_gate and w_up viewed [E * K, N] with [BLOCK_K,
    BLOCK_N] boxes (BLOCK_K divides K), out [R, N] with [BLOCK_M, BLOCK_N // EPI_SPLIT] boxes.
    NUM_STAGES counts ring stages of one product each (a K step takes two). SCATTER: as
    down_proj_ws_kernel's, the destination routes row_route's. PULL: the pull_* arguments as
    the Triton kernels' pull (mok.ops.comm.Pull, no router weights), rows of pull_width
    elements into pulled_ptr."""
    _rows_gemm(d_gate_up_desc, w_gate_desc, w_up_desc, out_desc, block_expert_ptr,
               row_route_ptr, block_expert_ptr, used_rows_ptr, N, K, out_ptr, out_delta_ptr,
               routes_per_rank, stride_out, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, ALIGN,
               NUM_STAGES, EPI_SPLIT, LOAD_REGS, False, True, SCATTER, ROW_ALIGN,
               pull_src_ptr, pull_src_delta_ptr, pulled_ptr, stride_pulled, pull_order_ptr,
               pull_moving_ptr, ready_ptr, seq_ptr, flags_ptr, flag_delta_ptr, error_ptr,
               pull_claim_ptr, phase, publish_slot, tokens_per_rank, world_size, timeout,
               stride_pull_src, pull_width, PULL, MINIBATCH, PULL_BLOCK_R, PULL_BLOCK_W,
               PULL_ROW_ALIGN, PULL_WARPS, PULL_REGS)
