"""Warp-specialized persistent backward of the down projection and SwiGLU for Hopper (sm_90), in
Gluon.

The tiles of mok.kernels.grouped_gemm.down_bwd_dswiglu_kernel without PULL (same rows, tiles, K
order and epilogue math), N = I, K = H, for GPUs only (mok.ops picks this kernel where
RowTiles.gluon asks for it and an sm_90 GPU runs it): dh0 = d_out[token(r)] @ w_down[e]
(w_down [E, K, N]), token(r) = row_route[r] // topk, e = block_expert[r // ALIGN]; the dSwiGLU
epilogue writes d_gate_up[r] = [d_gate, d_up] for dh = w[route] * dh0 (w = router_weights, 0 on
padding rows) and, HAS_WEIGHT, d_weight_partial[r, pid_n] = sum over the tile's columns of
dh0 * h (fp32). Two forms:

- SAVED_GATE_UP: gate and up are the forward's kept pre-activations gate_up[r] = [gate, up] (a
  value the swiglu limit clamps kept as +-inf), the K loop is dh0's alone, and h = swiglu(gate,
  up) is written (the Triton kernel's H_OUT), in fp32 for the partial sums.
- recomputing: the same K loop also takes gate = x[token] @ w_gate[e].T and up = x[token] @
  w_up[e].T (w [E, N, K]), as mok.kernels.gluon_gate_up does; the partial sums use the h the
  forward stored (bf16), read here.

One CTA per SM strides over the [BLOCK_M, BLOCK_N] tiles of the used rows (GROUP_M row blocks
at a time). Two partitions share a ring of NUM_STAGES stages, continuous across tiles:

- loader (worker, LOAD_WARPS warps): per K step, the w_down tile [BLOCK_K, BLOCK_N] by TMA (w_down
  viewed [E * K, N]: N contiguous, wgmma's B as it is) and the d_out rows gathered by cp.async
  (16-byte copies, zero-filled on padding rows) into the stage's A buffer; recomputing, also the
  gate and up weight tiles into the two halves of a [2 * BLOCK_N, BLOCK_K] buffer (w viewed
  [E * N, K], K contiguous, permuted for wgmma) and the gathered x rows into a second A buffer.
- MMA + epilogue (default partition, BLOCK_M // 16 warps, each warpgroup 64 rows): at a tile's
  start it issues the TMA loads of the epilogue's inputs (the kept gate and up, or h) into
  buffers of their own, which land while the K loop runs; wgmma of each stage (dh0; recomputing
  also gate and up as one wgmma of N = 2 * BLOCK_N, as gate/up), one K step in flight; then the
  epilogue in EPI_SPLIT column slices, each output through shared memory and a TMA store waited
  on only before the buffer's next use, the partial sums by plain stores.

Registers: an accumulator [BLOCK_M, BLOCK_N] takes BLOCK_N / 2 fp32 registers a thread (a
warpgroup's 64 rows over its 128 threads), and the MMA warps have 224 after setmaxnreg (at 48 or
56 for the 4 loader warps). Kept at BLOCK_N = 128, dh0 takes 64 and a whole-tile epilogue, with
gate, up and what they make besides, would spill: the launcher takes its epilogue in column
halves. Recomputing, the three accumulators take 96 at BLOCK_N = 64 and 192 at 128, which leaves
the epilogue too few: the launcher takes BLOCK_N <= 64. (One stacked accumulator for all three
is not possible: dh0's A operand is d_out, gate's and up's is x; and w_down's tile is N
contiguous where w_gate's and w_up's are K contiguous.)

Barrier protocol (stage s = i % NUM_STAGES of the i-th K step counted over all of this CTA's
tiles, round = i // NUM_STAGES, phase parity = round & 1), as in mok.kernels.gluon_gate_up:
- ready[s] (count LOAD_WARPS * 32 + 1): the loader arrives once with expect-tx (the weight
  boxes' bytes) and every loader thread once more through cp.async.mbarrier.arrive.noinc when
  its own gathered copies have landed. The MMA partition waits on parity round & 1, then fences
  (cp.async writes through the generic proxy, wgmma reads through the async proxy).
- empty[s] (count 1): the MMA partition arrives once the wgmmas that read stage s have completed
  (warpgroup_mma_wait leaving only the next step's in flight); the loader waits on parity
  (round & 1) ^ 1 before refilling s, so the first round passes at once.
- epi (count 1): the MMA partition's own loads of a tile's epilogue inputs, expect-tx; waited on
  with parity t & 1 for the CTA's t-th tile. The buffers are refilled only at the next tile's
  start, after every warp has read them (the epilogue's last TMA store waits at a
  partition-wide barrier, behind each thread's proxy fence).
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
from mok.kernels.gluon_comm import wait_ranks_landed
from mok.kernels.gluon_gate_up import (
    _ordered_coords,
    _put,
    _tile_grid,
    _tile_tokens,
)


@gluon.jit
def _load_partition(d_out_ptr, x_ptr, w_down_desc, w_gate_desc, w_up_desc, row_route_ptr,
                    block_expert_ptr, used_rows_ptr, a_bufs, x_bufs, bd_bufs, bgu_bufs,
                    ready_bars, empty_bars, N, K, topk, stride_dm, stride_xm, block_order_ptr,
                    ready_ptr, seq_ptr, phase, timeout, error_ptr, world_size,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                    GROUP_M: gl.constexpr, ALIGN: gl.constexpr, NUM_STAGES: gl.constexpr,
                    LOAD_WARPS: gl.constexpr, SAVED_GATE_UP: gl.constexpr,
                    WAIT_ROWS: gl.constexpr, TOKENS_PER_RANK: gl.constexpr):
    """Fills the ring: weight tiles by TMA, gathered d_out (and x) rows by cp.async (with
    WAIT_ROWS once the copies of its rows' ranks have landed, the row blocks in block_order's
    order: see mok.kernels.gluon_gate_up)."""
    if SAVED_GATE_UP:
        w_bytes: gl.constexpr = w_down_desc.block_type.nbytes
    else:
        w_bytes: gl.constexpr = (w_down_desc.block_type.nbytes
                                 + 2 * w_gate_desc.block_type.nbytes)
    num_pid_m, num_pid_n, num_tiles = _tile_grid(used_rows_ptr, N, BLOCK_M, BLOCK_N)
    k_steps = K // BLOCK_K
    i = 0
    landed = num_tiles - num_tiles  # WAIT_ROWS: a bit per rank whose rows were seen landed
    for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        pid_m, pid_n = _ordered_coords(tile, num_pid_m, num_pid_n, block_order_ptr, GROUP_M,
                                       WAIT_ROWS)
        r0 = pid_m * BLOCK_M
        c0 = pid_n * BLOCK_N
        expert = gl.load(block_expert_ptr + r0 // ALIGN)
        token, a_mask, cols = _tile_tokens(row_route_ptr, r0, topk, BLOCK_M, BLOCK_K,
                                           LOAD_WARPS)
        a_ptrs = d_out_ptr + token * stride_dm + cols
        if not SAVED_GATE_UP:
            x_ptrs = x_ptr + token * stride_xm + cols
        # w_down viewed [E * K, N]: BLOCK_K divides K, so a box stays in its expert's rows;
        # w_gate and w_up viewed [E * N, K]: rows past the expert's N reach only columns >= N
        wd_row = expert * K
        w_row = expert * N + c0
        if WAIT_ROWS:
            landed = wait_ranks_landed(row_route_ptr, r0, topk, ready_ptr, seq_ptr, phase,
                                       timeout, error_ptr, landed, world_size, BLOCK_M,
                                       TOKENS_PER_RANK, LOAD_WARPS)
        for kk in range(k_steps):
            s = i % NUM_STAGES
            mbarrier.wait(empty_bars.index(s), ((i // NUM_STAGES) & 1) ^ 1)
            bar = ready_bars.index(s)
            k0 = kk * BLOCK_K
            mbarrier.expect(bar, w_bytes)
            tma.async_copy_global_to_shared(w_down_desc, [wd_row + k0, c0], bar, bd_bufs.index(s))
            if not SAVED_GATE_UP:
                b_buf = bgu_bufs.index(s)
                tma.async_copy_global_to_shared(w_gate_desc, [w_row, k0], bar,
                                                b_buf.slice(0, BLOCK_N))
                tma.async_copy_global_to_shared(w_up_desc, [w_row, k0], bar,
                                                b_buf.slice(BLOCK_N, BLOCK_N))
            async_copy.async_copy_global_to_shared(a_bufs.index(s), a_ptrs + k0, mask=a_mask)
            if not SAVED_GATE_UP:
                async_copy.async_copy_global_to_shared(x_bufs.index(s), x_ptrs + k0,
                                                       mask=a_mask)
            async_copy.mbarrier_arrive(bar, increment_count=False)
            i += 1


@gluon.jit
def _column_halves(t, layout: gl.constexpr):
    """t [M, W] -> t[:, :W // 2], t[:, W // 2:] in `layout`."""
    M: gl.constexpr = t.shape[0]
    W: gl.constexpr = t.shape[1]
    first, second = t.reshape([M, 2, W // 2]).permute((0, 2, 1)).split()
    return gl.convert_layout(first, layout), gl.convert_layout(second, layout)


@gluon.jit
def _dswiglu_slice(dh0, gate, up, weight, in_smem, j, r0, c0, h_desc, d_gate_desc, d_up_desc,
                   c_smem, swiglu_limit, layout: gl.constexpr, EPI_SPLIT: gl.constexpr,
                   HAS_LIMIT: gl.constexpr, HAS_WEIGHT: gl.constexpr,
                   SAVED_GATE_UP: gl.constexpr):
    """The epilogue on a tile's j-th column slice, at column c0 (dh0 there, and recomputing gate
    and up; the kept gate and up, or h, in in_smem): writes d_gate and d_up (and the kept form's
    h) and returns the slice's router-weight partial sums per row (HAS_WEIGHT), as
    mok.kernels.grouped_gemm._dswiglu_slice."""
    if SAVED_GATE_UP:
        gate = in_smem.index(j).load(layout).to(gl.float32)
        up = in_smem.index(EPI_SPLIT + j).load(layout).to(gl.float32)
    if HAS_LIMIT:
        gate_pass, up_pass = activation.passes(gate, up, swiglu_limit, SAVED_GATE_UP)
        gate, up = activation.clamp(gate, up, swiglu_limit)
    sig, silu = activation.silu(gate)
    if SAVED_GATE_UP:  # h of the kept pre-activations, for the down projection's weight grad
        h = silu * up
        _put(h_desc, h, r0, c0, c_smem)
    partial = gl.zeros([dh0.shape[0]], gl.float32, gl.SliceLayout(1, layout))
    if HAS_WEIGHT:
        # sum_n dh0 * h: the kept form's h in fp32, else the h the forward stored (bf16)
        if not SAVED_GATE_UP:
            h = in_smem.index(j).load(layout).to(gl.float32)
        partial = gl.sum(dh0 * h, axis=1)
        dh0 = dh0 * weight[:, None]
    d_gate, d_up = activation.dswiglu(dh0, gate, up, sig, silu)
    if HAS_LIMIT:
        d_gate = gl.where(gate_pass, d_gate, 0.0)
        d_up = gl.where(up_pass, d_up, 0.0)
    _put(d_gate_desc, d_gate, r0, c0, c_smem)
    _put(d_up_desc, d_up, r0, c0, c_smem)
    return partial


@gluon.jit
def _mma_partition(h_desc, gate_desc, up_desc, d_gate_desc, d_up_desc, a_bufs, x_bufs, bd_bufs,
                   bgu_bufs, in_smem, c_smem, ready_bars, empty_bars, epi_bar, turn_bars,
                   router_weights_ptr, d_weight_partial_ptr, row_route_ptr, used_rows_ptr,
                   block_order_ptr, N, K, stride_pm, swiglu_limit,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                   GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr, EPI_SPLIT: gl.constexpr,
                   HAS_LIMIT: gl.constexpr, HAS_WEIGHT: gl.constexpr,
                   SAVED_GATE_UP: gl.constexpr, CONSUMER: gl.constexpr,
                   NUM_CONSUMERS: gl.constexpr, BLOCK_ORDER: gl.constexpr):
    """wgmma over the ring, then the dSwiGLU epilogue, the TMA stores and the partial sums, for
    the CTA's tiles CONSUMER, CONSUMER + NUM_CONSUMERS, ... (its own epilogue buffers)."""
    num_warps: gl.constexpr = BLOCK_M // 16  # a warpgroup per 64 rows
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    # gate and up: one [BLOCK_M, 2 * BLOCK_N] accumulator, one wgmma a step (gate/up's)
    gu_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 2 * BLOCK_N, 16])
    WIDTH: gl.constexpr = BLOCK_N // EPI_SPLIT
    slice_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, WIDTH, 16])
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, slice_layout))
    # the epilogue's inputs: the kept gate and up, or h for the partial sums, EPI_SPLIT boxes each
    if SAVED_GATE_UP:
        NUM_IN: gl.constexpr = 2 * EPI_SPLIT
    elif HAS_WEIGHT:
        NUM_IN: gl.constexpr = EPI_SPLIT
    else:
        NUM_IN: gl.constexpr = 0
    in_bytes: gl.constexpr = NUM_IN * h_desc.block_type.nbytes

    num_pid_m, num_pid_n, num_tiles = _tile_grid(used_rows_ptr, N, BLOCK_M, BLOCK_N)
    k_steps = K // BLOCK_K
    i = CONSUMER * k_steps  # ring steps of the CTA's earlier tiles, every consumer's
    t = 0
    first = gl.program_id(0) + CONSUMER * gl.num_programs(0)
    for tile in range(first, num_tiles, NUM_CONSUMERS * gl.num_programs(0)):
        pid_m, pid_n = _ordered_coords(tile, num_pid_m, num_pid_n, block_order_ptr, GROUP_M,
                                       BLOCK_ORDER)
        r0 = pid_m * BLOCK_M
        c0 = pid_n * BLOCK_N
        if NUM_IN > 0:  # land during the K loop
            mbarrier.expect(epi_bar, in_bytes)
            for j in gl.static_range(EPI_SPLIT):
                if SAVED_GATE_UP:
                    tma.async_copy_global_to_shared(gate_desc, [r0, c0 + j * WIDTH], epi_bar,
                                                    in_smem.index(j))
                    tma.async_copy_global_to_shared(up_desc, [r0, c0 + j * WIDTH], epi_bar,
                                                    in_smem.index(EPI_SPLIT + j))
                else:
                    tma.async_copy_global_to_shared(h_desc, [r0, c0 + j * WIDTH], epi_bar,
                                                    in_smem.index(j))
        if HAS_WEIGHT:  # loaded now, used after the K loop
            route = gl.load(row_route_ptr + r0 + rows)
            weight = gl.load(router_weights_ptr + route, mask=route >= 0, other=0.0)
        else:
            weight = rows.to(gl.float32)  # unused
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        if NUM_CONSUMERS > 1:  # the other consumer's K loop (of the CTA's previous tile) is done
            mbarrier.wait(turn_bars.index(CONSUMER), (t - 1 + CONSUMER) & 1,
                          pred=(CONSUMER > 0) | (t > 0))
        if SAVED_GATE_UP:
            for kk in range(k_steps):
                s = i % NUM_STAGES
                mbarrier.wait(ready_bars.index(s), (i // NUM_STAGES) & 1)
                fence_async_shared()  # cp.async (generic proxy) -> wgmma (async proxy)
                acc = warpgroup_mma(a_bufs.index(s), bd_bufs.index(s), acc, is_async=True)
                # Leaves this step's wgmma in flight: the previous step's is done.
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                # Release the previous step's stage (none before a tile's first step: the last
                # step of the previous tile was released after its final wait).
                mbarrier.arrive(empty_bars.index((i + NUM_STAGES - 1) % NUM_STAGES),
                                pred=kk > 0)
                i += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            gu = acc  # unused: the epilogue reads the kept gate and up
        else:
            gu = gl.zeros([BLOCK_M, 2 * BLOCK_N], gl.float32, gu_layout)
            for kk in range(k_steps):
                s = i % NUM_STAGES
                mbarrier.wait(ready_bars.index(s), (i // NUM_STAGES) & 1)
                fence_async_shared()
                acc = warpgroup_mma(a_bufs.index(s), bd_bufs.index(s), acc, is_async=True)
                gu = warpgroup_mma(x_bufs.index(s), bgu_bufs.index(s).permute((1, 0)), gu,
                                   is_async=True)
                # Leaves this step's two wgmmas in flight: the previous step's are done.
                acc, gu = warpgroup_mma_wait(num_outstanding=2, deps=(acc, gu))
                mbarrier.arrive(empty_bars.index((i + NUM_STAGES - 1) % NUM_STAGES),
                                pred=kk > 0)
                i += 1
            acc, gu = warpgroup_mma_wait(num_outstanding=0, deps=(acc, gu))
        mbarrier.arrive(empty_bars.index((i + NUM_STAGES - 1) % NUM_STAGES))
        if NUM_CONSUMERS > 1:  # the next consumer's turn; skip its steps
            mbarrier.arrive(turn_bars.index((CONSUMER + 1) % NUM_CONSUMERS))
            i += (NUM_CONSUMERS - 1) * k_steps

        if SAVED_GATE_UP:
            gate = acc  # placeholders: read in the slices
            up = acc
        else:
            gate, up = gu.reshape([BLOCK_M, 2, BLOCK_N]).permute((0, 2, 1)).split()
            gate = gl.convert_layout(gate, acc_layout)
            up = gl.convert_layout(up, acc_layout)
        if NUM_IN > 0:
            mbarrier.wait(epi_bar, t & 1)
        if EPI_SPLIT == 1:
            partial = _dswiglu_slice(acc, gate, up, weight, in_smem, 0, r0, c0, h_desc,
                                     d_gate_desc, d_up_desc, c_smem, swiglu_limit, slice_layout,
                                     EPI_SPLIT, HAS_LIMIT, HAS_WEIGHT, SAVED_GATE_UP)
        else:  # two column halves, one after the other
            dh_a, dh_b = _column_halves(acc, slice_layout)
            if SAVED_GATE_UP:
                gate_a, gate_b, up_a, up_b = dh_a, dh_b, dh_a, dh_b
            else:
                gate_a, gate_b = _column_halves(gate, slice_layout)
                up_a, up_b = _column_halves(up, slice_layout)
            partial = _dswiglu_slice(dh_a, gate_a, up_a, weight, in_smem, 0, r0, c0, h_desc,
                                     d_gate_desc, d_up_desc, c_smem, swiglu_limit, slice_layout,
                                     EPI_SPLIT, HAS_LIMIT, HAS_WEIGHT, SAVED_GATE_UP)
            partial += _dswiglu_slice(dh_b, gate_b, up_b, weight, in_smem, 1, r0, c0 + WIDTH,
                                      h_desc, d_gate_desc, d_up_desc, c_smem, swiglu_limit,
                                      slice_layout, EPI_SPLIT, HAS_LIMIT, HAS_WEIGHT,
                                      SAVED_GATE_UP)
        if HAS_WEIGHT:  # int32 offsets: [R, cdiv(N, BLOCK_N)] fp32 stays far below 2^31
            gl.store(d_weight_partial_ptr + (r0 + rows) * stride_pm + pid_n, partial)
        t += 1
    tma.store_wait(pendings=0)


@gluon.jit
def down_bwd_dswiglu_ws_kernel(
    d_out_ptr, x_ptr, w_down_desc, w_gate_desc, w_up_desc, h_desc, gate_desc, up_desc,
    d_gate_desc, d_up_desc, router_weights_ptr, d_weight_partial_ptr, row_route_ptr,
    block_expert_ptr, used_rows_ptr, N, K, topk, stride_dm, stride_xm, stride_pm, swiglu_limit,
    block_order_ptr, ready_ptr, seq_ptr, phase, error_ptr, timeout, world_size,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    ALIGN: gl.constexpr, NUM_STAGES: gl.constexpr, EPI_SPLIT: gl.constexpr,
    LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr, HAS_LIMIT: gl.constexpr,
    HAS_WEIGHT: gl.constexpr, SAVED_GATE_UP: gl.constexpr, A_LAYOUT: gl.constexpr,
    PINGPONG: gl.constexpr, MMA_REGS: gl.constexpr, WAIT_ROWS: gl.constexpr,
    TOKENS_PER_RANK: gl.constexpr,
):
    """Launched with one program per SM and num_warps = BLOCK_M // 16 (a warpgroup per 64 rows)
    in the default partition, LOAD_WARPS more for the loader (LOAD_REGS registers each).
    Descriptors: w_down viewed [E * K, N] with [BLOCK_K, BLOCK_N] boxes (BLOCK_K divides K),
    w_gate and w_up viewed [E * N, K] with [BLOCK_N, BLOCK_K] boxes (recomputing; w_down_desc
    otherwise, unused); h [R, N], gate_up's halves (SAVED_GATE_UP; h_desc otherwise, unused) and
    d_gate_up's halves [R, N] (row strides 2N) with [BLOCK_M, BLOCK_N // EPI_SPLIT] boxes.
    router_weights_ptr: fp32 [T * topk] by route, d_weight_partial_ptr: fp32 [R, cdiv(N,
    BLOCK_N)] (both unused without HAS_WEIGHT). x_ptr is read only recomputing.
    PINGPONG: a second MMA partition (a worker of BLOCK_M // 16 warps, MMA_REGS registers each)
    with epilogue buffers of its own takes every other tile of the CTA; the two take turns at
    their K loops (turn barriers), so one's epilogue runs during the other's K loop.
    WAIT_ROWS (expert parallelism, mok.ops.comm.Pull.copied): d_out's (and x's) rows of the
    group's tokens [P * TOKENS_PER_RANK, K] land by copies beside the kernel, ready[p] >=
    seq[phase] once rank p's have; the loader waits on its tiles' ranks, and the row blocks are
    taken in block_order's order (mok.kernels.gluon_gate_up, WAIT_ROWS)."""
    dtype: gl.constexpr = w_down_desc.dtype
    WIDTH: gl.constexpr = BLOCK_N // EPI_SPLIT
    a_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], A_LAYOUT)
    bd_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_K, BLOCK_N],
                                        w_down_desc.layout)
    if SAVED_GATE_UP:  # placeholders, never used
        x_bufs = a_bufs
        bgu_bufs = bd_bufs
        in_smem = gl.allocate_shared_memory(dtype, [2 * EPI_SPLIT, BLOCK_M, WIDTH],
                                            h_desc.layout)
    else:
        x_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], A_LAYOUT)
        bgu_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, 2 * BLOCK_N, BLOCK_K],
                                             w_gate_desc.layout)
        if HAS_WEIGHT:
            in_smem = gl.allocate_shared_memory(dtype, [EPI_SPLIT, BLOCK_M, WIDTH],
                                                h_desc.layout)
        else:
            in_smem = bd_bufs  # placeholder, never used
    c_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, WIDTH], h_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    epi_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready_bars.index(s), count=LOAD_WARPS * 32 + 1)
        mbarrier.init(empty_bars.index(s), count=1)
    mbarrier.init(epi_bar, count=1)
    if PINGPONG:
        NUM_CONSUMERS: gl.constexpr = 2
        turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(2):
            mbarrier.init(turn_bars.index(c), count=1)
    else:
        NUM_CONSUMERS: gl.constexpr = 1
        turn_bars = epi_bar  # placeholder, never used

    # (The partitions' arguments stay literal tuples: a tuple held in a variable loses its
    # constexprs.)
    if PINGPONG:  # the second consumer's epilogue buffers
        if SAVED_GATE_UP or HAS_WEIGHT:
            in_smem2 = gl.allocate_shared_memory(dtype, in_smem.shape, in_smem.layout)
        else:
            in_smem2 = in_smem  # placeholder, never used
        c_smem2 = gl.allocate_shared_memory(dtype, [BLOCK_M, WIDTH], h_desc.layout)
        epi_bar2 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(epi_bar2, count=1)
        gl.warp_specialize([
            (_mma_partition, (h_desc, gate_desc, up_desc, d_gate_desc, d_up_desc, a_bufs,
                              x_bufs, bd_bufs, bgu_bufs, in_smem, c_smem, ready_bars,
                              empty_bars, epi_bar, turn_bars, router_weights_ptr,
                              d_weight_partial_ptr, row_route_ptr, used_rows_ptr,
                              block_order_ptr, N, K, stride_pm, swiglu_limit, BLOCK_M, BLOCK_N,
                              BLOCK_K, GROUP_M, NUM_STAGES, EPI_SPLIT, HAS_LIMIT, HAS_WEIGHT,
                              SAVED_GATE_UP, 0, NUM_CONSUMERS, WAIT_ROWS)),
            (_mma_partition, (h_desc, gate_desc, up_desc, d_gate_desc, d_up_desc, a_bufs,
                              x_bufs, bd_bufs, bgu_bufs, in_smem2, c_smem2, ready_bars,
                              empty_bars, epi_bar2, turn_bars, router_weights_ptr,
                              d_weight_partial_ptr, row_route_ptr, used_rows_ptr,
                              block_order_ptr, N, K, stride_pm, swiglu_limit, BLOCK_M, BLOCK_N,
                              BLOCK_K, GROUP_M, NUM_STAGES, EPI_SPLIT, HAS_LIMIT, HAS_WEIGHT,
                              SAVED_GATE_UP, 1, NUM_CONSUMERS, WAIT_ROWS)),
            (_load_partition, (d_out_ptr, x_ptr, w_down_desc, w_gate_desc, w_up_desc,
                               row_route_ptr, block_expert_ptr, used_rows_ptr, a_bufs, x_bufs,
                               bd_bufs, bgu_bufs, ready_bars, empty_bars, N, K, topk,
                               stride_dm, stride_xm, block_order_ptr, ready_ptr, seq_ptr, phase,
                               timeout, error_ptr, world_size, BLOCK_M, BLOCK_N, BLOCK_K,
                               GROUP_M, ALIGN, NUM_STAGES, LOAD_WARPS, SAVED_GATE_UP, WAIT_ROWS,
                               TOKENS_PER_RANK)),
        ], [BLOCK_M // 16, LOAD_WARPS], [MMA_REGS, LOAD_REGS])
    else:
        gl.warp_specialize([
            (_mma_partition, (h_desc, gate_desc, up_desc, d_gate_desc, d_up_desc, a_bufs,
                              x_bufs, bd_bufs, bgu_bufs, in_smem, c_smem, ready_bars,
                              empty_bars, epi_bar, turn_bars, router_weights_ptr,
                              d_weight_partial_ptr, row_route_ptr, used_rows_ptr,
                              block_order_ptr, N, K, stride_pm, swiglu_limit, BLOCK_M, BLOCK_N,
                              BLOCK_K, GROUP_M, NUM_STAGES, EPI_SPLIT, HAS_LIMIT, HAS_WEIGHT,
                              SAVED_GATE_UP, 0, NUM_CONSUMERS, WAIT_ROWS)),
            (_load_partition, (d_out_ptr, x_ptr, w_down_desc, w_gate_desc, w_up_desc,
                               row_route_ptr, block_expert_ptr, used_rows_ptr, a_bufs, x_bufs,
                               bd_bufs, bgu_bufs, ready_bars, empty_bars, N, K, topk,
                               stride_dm, stride_xm, block_order_ptr, ready_ptr, seq_ptr, phase,
                               timeout, error_ptr, world_size, BLOCK_M, BLOCK_N, BLOCK_K,
                               GROUP_M, ALIGN, NUM_STAGES, LOAD_WARPS, SAVED_GATE_UP, WAIT_ROWS,
                               TOKENS_PER_RANK)),
        ], [LOAD_WARPS], [LOAD_REGS])
