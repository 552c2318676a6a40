"""Grouped GEMM kernels of the MoE layer, forward and backward.

Rows are the schedule's expert-ordered rows (mok.ops.routing): row_route[row] is the route id of a
row (token * topk + slot) or -1 for padding; block_expert[row // ALIGN] is the local expert owning
a block of ALIGN rows, or -1 past the last expert (such tiles exit at once). BLOCK_M divides ALIGN,
so every row tile belongs to one expert. Token rows are gathered inside these GEMMs: they need no
permuted copy of x or d_output (only the weight gradients by torch._grouped_mm, where the tile
table picks them, copy rows: mok.ops.copy_rows). Each output element is written by exactly one
program with a fixed reduction order, so every result is bitwise reproducible.

Legend: M rows, N output columns, K reduction; E local experts; H hidden, I intermediate.
UPCAST: under Triton's CPU interpreter (see mok.kernels.common).

W_TMA (gate/up, down, and the gate/up weights of down_bwd): the weight tiles come through TMA
descriptors of the weights viewed [E * N, K] instead of pointer loads. A tile's rows past its
expert's N read the next expert's rows (or TMA's zero fill past the end); they only reach
output columns >= N, which are never stored. K is the descriptor's last dimension, so TMA
zero-fills past K as the masks would. WK_TMA (w_down in down_bwd, w_gate and w_up in d_x, whose
weights are [E, K, N]): descriptors of the weights viewed [E * K, N] with [BLOCK_K, BLOCK_N]
boxes; BLOCK_K divides K (the host checks), so no box reaches the next expert's rows.

SPLIT (the row GEMMs' epilogues): 1, or 2 to take the output tile in two column halves one after
the other, so fewer values are live at once and a TMA store box is half as wide (the row
descriptors' boxes are then [BLOCK_M, BLOCK_N // 2]). Elementwise, so the outputs are the same;
the router-weight gradient's per-tile partial sums then add two half sums.

PERSISTENT (the row GEMMs; the weight gradients have their own): a program per SM rather than
per tile, each striding over the tiles of the rows in use (the schedule's expert_offsets[E], read
on the device), so no program starts on a tile without an expert and a program's next tile
starts without a launch. A tile is computed the same either way: the results are bitwise equal.
DYNAMIC (with PERSISTENT, in the launches that pull): a program takes its next tile from a
counter the launch's programs share (tile_counter, zero at launch) instead of striding, so a
program that starts late, its SM held by a pulling program, takes fewer tiles rather than
holding up the launch with its fixed share. Which program computes a tile does not change the
tile's result.
FLATTEN (with PERSISTENT, not DYNAMIC): the tile loop and each tile's K loop are flattened into
one loop (tl.range(flatten=True), Triton's fuse-nested-loops pass), so the software pipeline
loads the next tile's first K blocks while the current tile's last ones multiply and its
epilogue runs, instead of starting each tile on an empty pipeline. The same sums in the same
order: bitwise the same results.

Expert parallelism adds two switches. PULL: the launch's first programs to start (by a ticket
each takes at its start, not by program id) pull the token rows the GEMM reads from their ranks
(mok.kernels.comm.pull_tokens: the group's tokens, a row each, that row_route's routes gather
as on one GPU) and every tile, before its K loop, waits until its rows' tokens have landed
(mok.kernels.comm.wait_tokens_ready). SCATTER: a row's output
goes to the rank that owns its token, at `out + delta[g // routes_per_rank]`, row g %
routes_per_rank of that rank's combine buffer, g = dest_route[row] (a route of the whole group).
"""

import triton
import triton.language as tl

from mok.kernels import activation
from mok.kernels.comm import pull_tokens, wait_ranks_landed, wait_tokens_ready
from mok.kernels.common import cast_to, mma


@triton.jit
def _tile_coords(pid, num_m_blocks, num_n_blocks, GROUP_M: tl.constexpr):
    """Program id -> (m block, n block), GROUP_M row blocks at a time so weight tiles stay in L2."""
    width = GROUP_M * num_n_blocks
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _tile_span(pid, num_pull_programs, used_rows_ptr, num_m_blocks, num_n_blocks,
               BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr):
    """(first, end, step, grid_m): this program's tiles are range(first, end, step), each mapped
    to its (m block, n block) by _tile_coords(tile, grid_m, ...). The schedule's used rows
    (used_rows_ptr, a multiple of the row alignment) bound the tiles worth running: those past
    them have no expert. PERSISTENT: the GEMM programs (those after the pulling ones) stride over
    the used rows' tiles; otherwise a program's one tile, none if past the used rows."""
    num_used_m = tl.load(used_rows_ptr) // BLOCK_M
    if PERSISTENT:
        return pid, num_used_m * num_n_blocks, tl.num_programs(0) - num_pull_programs, num_used_m
    pid_m, _ = _tile_coords(pid, num_m_blocks, num_n_blocks, GROUP_M)
    return pid, pid + (pid_m < num_used_m).to(tl.int32), 1, num_m_blocks


@triton.jit
def _next_tile(tile, step, tile_counter_ptr, DYNAMIC: tl.constexpr):
    """A program's next tile after `tile`: tile + step, or with DYNAMIC the next one no
    program of the launch has taken (first call: tile_counter's value at launch, 0)."""
    if DYNAMIC:
        return tl.atomic_add(tile_counter_ptr, 1, sem="relaxed")
    return tile + step


@triton.jit
def _tile_rows(row_route_ptr, pid_m, topk, BLOCK_M: tl.constexpr):
    """Rows of a tile, their route ids, validity and source token."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    route = tl.load(row_route_ptr + rows)
    valid = route >= 0
    token = tl.where(valid, route // topk, 0)
    return rows.to(tl.int64), route, valid, token.to(tl.int64)


@triton.jit
def _pull_programs(
    dst_ptr, stride_dst, dst2_ptr, stride_dst2, width,
    pull_src_ptr, pull_src_delta_ptr, pull_w_ptr, pull_w_delta_ptr, pull_dst_w_ptr,
    pull_src2_ptr,
    pull_order_ptr, pull_moving_ptr, ready_ptr, seq_ptr, flags_ptr,
    flag_delta_ptr, error_ptr, ticket_ptr, num_pull_programs, phase, publish_slot,
    tokens_per_rank, pull_topk, world_size, timeout, stride_pull_src,
    PULL_WEIGHTS: tl.constexpr, PULL_SECOND: tl.constexpr, MINIBATCH: tl.constexpr,
    PULL_BLOCK_R: tl.constexpr, PULL_BLOCK_W: tl.constexpr, PULL_K_PAD: tl.constexpr,
    PULL_ROW_ALIGN: tl.constexpr, HAS_TIMER: tl.constexpr,
):
    """The first num_pull_programs programs to start pull dst's token rows (and dst2's,
    PULL_SECOND); returns the GEMM tile's program id of the others (negative for the pulling
    ones).

    A program's role comes from a ticket (ticket_ptr, zero at launch), taken in the order the
    programs start, not from its program id: the pulling programs are always among those
    running, whatever order the hardware starts them in, so a GEMM tile never spins on rows
    that no running program will deliver."""
    pid = tl.atomic_add(ticket_ptr, 1, sem="relaxed")
    if pid < num_pull_programs:
        pull_tokens(pid, num_pull_programs, pull_src_ptr, pull_src_delta_ptr, pull_w_ptr,
                    pull_w_delta_ptr, dst_ptr, pull_dst_w_ptr, pull_src2_ptr, dst2_ptr,
                    pull_order_ptr, pull_moving_ptr, ready_ptr,
                    flags_ptr, flag_delta_ptr, seq_ptr, error_ptr, phase, publish_slot,
                    tokens_per_rank, tokens_per_rank, pull_topk, width, world_size, timeout,
                    stride_pull_src, stride_dst, stride_dst2,
                    PULL_WEIGHTS, PULL_SECOND, MINIBATCH, PULL_BLOCK_R, PULL_BLOCK_W,
                    PULL_K_PAD, PULL_ROW_ALIGN, HAS_TIMER)
    return pid - num_pull_programs


@triton.jit
def _wait_tile(ready_ptr, position_ptr, seq_ptr, phase, timeout, error_ptr, token, valid,
               landed, world_size, MINIBATCH: tl.constexpr, COPIED: tl.constexpr,
               HAS_TIMER: tl.constexpr):
    """Wait for a tile's rows (a pull's minibatches, or COPIED their ranks' copies, each rank's
    once per program: `landed`, returned updated)."""
    target = tl.load(seq_ptr + phase)
    if COPIED:
        landed = wait_ranks_landed(ready_ptr, token, valid, target, landed, world_size, timeout,
                                   error_ptr, MINIBATCH, HAS_TIMER)
    else:
        wait_tokens_ready(ready_ptr, position_ptr, token, valid, target, timeout, error_ptr,
                          MINIBATCH, HAS_TIMER)
    return landed


@triton.jit
def _store_rows(out_ptr, rows, cols, N, acc, stride_om, dest_route_ptr, out_delta_ptr,
                routes_per_rank, SCATTER: tl.constexpr, ROW_ALIGN: tl.constexpr,
                UPCAST: tl.constexpr):
    """out[row, cols] = acc, or with SCATTER on the rank owning the row's token (see above).

    ROW_ALIGN: every scattered row starts at a multiple of ROW_ALIGN elements (16 bytes where the
    host checked it): without that hint the remote stores go out element by element, which
    NVLink pays for in bandwidth (the offsets come from loaded deltas, unknown to the compiler).
    """
    mask = cols[None, :] < N
    if SCATTER:
        route = tl.load(dest_route_ptr + rows)
        valid = route >= 0
        safe = tl.where(valid, route, 0)
        delta = tl.load(out_delta_ptr + safe // routes_per_rank, mask=valid, other=0)
        offsets = tl.multiple_of(delta + (safe % routes_per_rank).to(tl.int64) * stride_om,
                                 ROW_ALIGN)
        mask = mask & valid[:, None]
    else:
        offsets = rows * stride_om
    tl.store(out_ptr + offsets[:, None] + cols[None, :],
             cast_to(acc, out_ptr.dtype.element_ty, UPCAST), mask=mask)


@triton.jit
def _put_tile(dst, value, rows, cols, N, shift, stride, r0, c0, ROWS_TMA: tl.constexpr,
              UPCAST: tl.constexpr):
    """dst[rows, shift + cols] = value (columns < N): dst a pointer, or with ROWS_TMA a TMA
    descriptor whose box has its corner at (r0, shift + c0)."""
    if ROWS_TMA:
        dst.store([r0, shift + c0], cast_to(value, dst.dtype, UPCAST))
    else:
        tl.store(dst + shift + rows[:, None] * stride + cols[None, :],
                 cast_to(value, dst.dtype.element_ty, UPCAST), mask=cols[None, :] < N)


@triton.jit
def _get_tile(src, rows, cols, N, shift, stride, r0, c0, ROWS_TMA: tl.constexpr):
    """src[rows, shift + cols] in fp32 (0 at columns >= N); see _put_tile."""
    if ROWS_TMA:
        tile = src.load([r0, shift + c0])
    else:
        tile = tl.load(src + shift + rows[:, None] * stride + cols[None, :],
                       mask=cols[None, :] < N, other=0.0)
    return tile.to(tl.float32)


@triton.jit
def _halves(t, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """t [BLOCK_M, BLOCK_N] -> its column halves t[:, :BLOCK_N // 2], t[:, BLOCK_N // 2:]."""
    return tl.split(tl.permute(tl.reshape(t, [BLOCK_M, 2, BLOCK_N // 2]), [0, 2, 1]))


@triton.jit
def _store_slice(out_ptr, value, rows, r0, c0, N, stride_om, dest_route_ptr, out_delta_ptr,
                 routes_per_rank, WIDTH: tl.constexpr, ROWS_TMA: tl.constexpr,
                 SCATTER: tl.constexpr, ROW_ALIGN: tl.constexpr, UPCAST: tl.constexpr):
    """out[rows, c0:c0 + WIDTH] = value: through the TMA descriptor out_ptr (ROWS_TMA, box
    [BLOCK_M, WIDTH] at (r0, c0)) or _store_rows."""
    if ROWS_TMA:
        out_ptr.store([r0, c0], cast_to(value, out_ptr.dtype, UPCAST))
    else:
        _store_rows(out_ptr, rows, c0 + tl.arange(0, WIDTH), N, value, stride_om,
                    dest_route_ptr, out_delta_ptr, routes_per_rank, SCATTER, ROW_ALIGN, UPCAST)


@triton.jit
def _store_out(out_ptr, acc, rows, r0, c0, N, stride_om, dest_route_ptr, out_delta_ptr,
               routes_per_rank, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               SPLIT: tl.constexpr, ROWS_TMA: tl.constexpr, SCATTER: tl.constexpr,
               ROW_ALIGN: tl.constexpr, UPCAST: tl.constexpr):
    """The output tile acc [BLOCK_M, BLOCK_N] at (r0, c0), in SPLIT (1 or 2) column slices."""
    if SPLIT == 1:
        _store_slice(out_ptr, acc, rows, r0, c0, N, stride_om, dest_route_ptr, out_delta_ptr,
                     routes_per_rank, BLOCK_N, ROWS_TMA, SCATTER, ROW_ALIGN, UPCAST)
    else:
        HALF: tl.constexpr = BLOCK_N // 2
        first, second = _halves(acc, BLOCK_M, BLOCK_N)
        _store_slice(out_ptr, first, rows, r0, c0, N, stride_om, dest_route_ptr,
                     out_delta_ptr, routes_per_rank, HALF, ROWS_TMA, SCATTER, ROW_ALIGN, UPCAST)
        _store_slice(out_ptr, second, rows, r0, c0 + HALF, N, stride_om, dest_route_ptr,
                     out_delta_ptr, routes_per_rank, HALF, ROWS_TMA, SCATTER, ROW_ALIGN, UPCAST)


@triton.jit
def _up_offsets(w_offsets, expert, cols, ks, stride_ue, stride_un, stride_uk,
                UP_STRIDES: tl.constexpr):
    """The up weight's element offsets [BLOCK_K, BLOCK_N] of a tile whose gate offsets are
    w_offsets: its own (UP_STRIDES: w_up is laid out unlike w_gate), else w_offsets."""
    if UP_STRIDES:
        return (expert.to(tl.int64) * stride_ue + cols[None, :] * stride_un
                + ks[:, None] * stride_uk)
    return w_offsets


@triton.jit
def gate_up_swiglu_kernel(
    x_ptr, x2_ptr, w_gate_ptr, w_up_ptr, h_ptr, gate_up_ptr, row_route_ptr, block_expert_ptr,
    pull_src_ptr, pull_src_delta_ptr, pull_w_ptr, pull_w_delta_ptr, pull_dst_w_ptr,
    pull_src2_ptr,
    pull_order_ptr, pull_position_ptr, pull_moving_ptr, ready_ptr, seq_ptr, flags_ptr,
    flag_delta_ptr, error_ptr, pull_ticket_ptr, used_rows_ptr, tile_counter_ptr, num_m_blocks,
    N, K, topk,
    num_pull_programs, phase, publish_slot, tokens_per_rank, pull_topk,
    world_size, timeout, stride_pull_src,
    stride_xm, stride_x2m, stride_we, stride_wn, stride_wk, stride_ue, stride_un, stride_uk,
    stride_hm, stride_gum, swiglu_limit,
    HAS_LIMIT: tl.constexpr, ALIGN: tl.constexpr, W_TMA: tl.constexpr, UP_STRIDES: tl.constexpr,
    SAVE_GATE_UP: tl.constexpr, ROWS_TMA: tl.constexpr, PERSISTENT: tl.constexpr,
    FLATTEN: tl.constexpr, DYNAMIC: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PULL: tl.constexpr, PULL_WEIGHTS: tl.constexpr, PULL_SECOND: tl.constexpr,
    MINIBATCH: tl.constexpr, PULL_BLOCK_R: tl.constexpr, PULL_BLOCK_W: tl.constexpr,
    PULL_K_PAD: tl.constexpr, PULL_ROW_ALIGN: tl.constexpr, HAS_TIMER: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_ORDER: tl.constexpr,
):
    """h[row, n] = swiglu(x[token] @ w_gate[e].T, x[token] @ w_up[e].T); x [T, K], w [E, N, K].

    With PULL, x's rows are pulled from the other ranks by the launch's first programs (none
    when they are copied beside it, mok.ops.comm.Pull.copied); with PULL_SECOND the rows of a
    second buffer come with them into x2 (the backward's d_output, for a launch after this one),
    the tiles waiting on both. BLOCK_ORDER: the row blocks are taken in the order of
    pull_order_ptr (a copied pull's: this rank's rows first). W_TMA:
    w_gate_ptr and w_up_ptr are TMA descriptors of w viewed [E * N, K] (module docstring).
    SAVE_GATE_UP: the pre-activations go to gate_up[row] = [gate, up] too (columns [0, N) and
    [N, 2N)), for a backward that reads them instead of recomputing them. ROWS_TMA: h_ptr and
    gate_up_ptr are TMA descriptors of h and gate_up with [BLOCK_M, BLOCK_N // SPLIT] boxes
    (BLOCK_N divides N).
    """
    pid = tl.program_id(0)
    if PULL:
        pid = _pull_programs(
            x_ptr, stride_xm, x2_ptr, stride_x2m, K, pull_src_ptr, pull_src_delta_ptr,
            pull_w_ptr, pull_w_delta_ptr, pull_dst_w_ptr, pull_src2_ptr, pull_order_ptr,
            pull_moving_ptr, ready_ptr, seq_ptr, flags_ptr,
            flag_delta_ptr, error_ptr, pull_ticket_ptr, num_pull_programs, phase, publish_slot,
            tokens_per_rank, pull_topk, world_size, timeout,
            stride_pull_src, PULL_WEIGHTS, PULL_SECOND, MINIBATCH, PULL_BLOCK_R, PULL_BLOCK_W,
            PULL_K_PAD, PULL_ROW_ALIGN, HAS_TIMER)
        if pid < 0:
            return
    first, end, step, grid_m = _tile_span(pid, num_pull_programs, used_rows_ptr, num_m_blocks,
                                          tl.cdiv(N, BLOCK_N), BLOCK_M, GROUP_M, PERSISTENT)
    landed = tl.zeros([], dtype=tl.int32)  # BLOCK_ORDER: ranks seen landed, a bit each
    if DYNAMIC:
        tile = _next_tile(first - step, step, tile_counter_ptr, DYNAMIC)
        while tile < end:
            next_tile = _next_tile(tile, step, tile_counter_ptr, DYNAMIC)  # taken ahead
            pid_m, pid_n = _tile_coords(tile, grid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
            if BLOCK_ORDER:
                pid_m = tl.load(pull_order_ptr + pid_m)
            landed = _gate_up_tile(
                x_ptr, w_gate_ptr, w_up_ptr, h_ptr, gate_up_ptr, row_route_ptr, block_expert_ptr,
                ready_ptr, pull_position_ptr, seq_ptr, error_ptr, phase, timeout, pid_m, pid_n,
                landed, world_size, N, K, topk, stride_xm, stride_we, stride_wn, stride_wk,
                stride_ue, stride_un, stride_uk, stride_hm, stride_gum, swiglu_limit,
                HAS_LIMIT, ALIGN, W_TMA, UP_STRIDES, SAVE_GATE_UP, ROWS_TMA, BLOCK_M, BLOCK_N,
                BLOCK_K, SPLIT, PULL, MINIBATCH, HAS_TIMER, UPCAST, BLOCK_ORDER)
            tile = next_tile
    else:
        for tile in tl.range(first, end, step, flatten=FLATTEN):
            pid_m, pid_n = _tile_coords(tile, grid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
            if BLOCK_ORDER:
                pid_m = tl.load(pull_order_ptr + pid_m)
            landed = _gate_up_tile(
                x_ptr, w_gate_ptr, w_up_ptr, h_ptr, gate_up_ptr, row_route_ptr, block_expert_ptr,
                ready_ptr, pull_position_ptr, seq_ptr, error_ptr, phase, timeout, pid_m, pid_n,
                landed, world_size, N, K, topk, stride_xm, stride_we, stride_wn, stride_wk,
                stride_ue, stride_un, stride_uk, stride_hm, stride_gum, swiglu_limit,
                HAS_LIMIT, ALIGN, W_TMA, UP_STRIDES, SAVE_GATE_UP, ROWS_TMA, BLOCK_M, BLOCK_N,
                BLOCK_K, SPLIT, PULL, MINIBATCH, HAS_TIMER, UPCAST, BLOCK_ORDER)


@triton.jit
def _gate_up_tile(
    x_ptr, w_gate_ptr, w_up_ptr, h_ptr, gate_up_ptr, row_route_ptr, block_expert_ptr,
    ready_ptr, pull_position_ptr, seq_ptr, error_ptr, phase, timeout, pid_m, pid_n, landed,
    world_size, N, K, topk,
    stride_xm, stride_we, stride_wn, stride_wk, stride_ue, stride_un, stride_uk, stride_hm,
    stride_gum, swiglu_limit,
    HAS_LIMIT: tl.constexpr, ALIGN: tl.constexpr, W_TMA: tl.constexpr, UP_STRIDES: tl.constexpr,
    SAVE_GATE_UP: tl.constexpr, ROWS_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, PULL: tl.constexpr,
    MINIBATCH: tl.constexpr, HAS_TIMER: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_ORDER: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of gate_up_swiglu_kernel (an expert's rows); returns
    `landed` (see _wait_tile)."""
    expert = tl.load(block_expert_ptr + (pid_m * BLOCK_M) // ALIGN)
    rows, route, valid, token = _tile_rows(row_route_ptr, pid_m, topk, BLOCK_M)
    if PULL:
        landed = _wait_tile(ready_ptr, pull_position_ptr, seq_ptr, phase, timeout, error_ptr,
                            token, valid, landed, world_size, MINIBATCH, BLOCK_ORDER, HAS_TIMER)
    r0 = pid_m * BLOCK_M
    c0 = pid_n * BLOCK_N
    cols = c0 + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xm + ks[None, :]
    w_offsets = (expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn
                 + ks[:, None] * stride_wk)
    u_offsets = _up_offsets(w_offsets, expert, cols, ks, stride_ue, stride_un, stride_uk,
                            UP_STRIDES)
    w_row = expert * N + c0  # W_TMA: the tile's first row of w viewed [E * N, K]
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + ks) < K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        if W_TMA:
            b_gate = w_gate_ptr.load([w_row, k0]).T
            b_up = w_up_ptr.load([w_row, k0]).T
        else:
            w_mask = k_mask[:, None] & (cols[None, :] < N)
            b_gate = tl.load(w_gate_ptr + w_offsets, mask=w_mask, other=0.0)
            if UP_STRIDES:
                b_up = tl.load(w_up_ptr + u_offsets, mask=w_mask, other=0.0)
            else:
                b_up = tl.load(w_up_ptr + w_offsets, mask=w_mask, other=0.0)
        acc_gate = mma(a, b_gate, acc_gate, UPCAST)
        acc_up = mma(a, b_up, acc_up, UPCAST)
        a_ptrs += BLOCK_K
        w_offsets += BLOCK_K * stride_wk
        if UP_STRIDES:
            u_offsets += BLOCK_K * stride_uk
    if SPLIT == 1:
        _gate_up_slice(acc_gate, acc_up, rows, r0, c0, N, h_ptr, gate_up_ptr, stride_hm,
                       stride_gum, swiglu_limit, BLOCK_N, HAS_LIMIT, SAVE_GATE_UP, ROWS_TMA,
                       UPCAST)
    else:  # two column halves, one after the other
        HALF: tl.constexpr = BLOCK_N // 2
        gate_a, gate_b = _halves(acc_gate, BLOCK_M, BLOCK_N)
        up_a, up_b = _halves(acc_up, BLOCK_M, BLOCK_N)
        _gate_up_slice(gate_a, up_a, rows, r0, c0, N, h_ptr, gate_up_ptr, stride_hm,
                       stride_gum, swiglu_limit, HALF, HAS_LIMIT, SAVE_GATE_UP, ROWS_TMA, UPCAST)
        _gate_up_slice(gate_b, up_b, rows, r0, c0 + HALF, N, h_ptr, gate_up_ptr, stride_hm,
                       stride_gum, swiglu_limit, HALF, HAS_LIMIT, SAVE_GATE_UP, ROWS_TMA, UPCAST)
    return landed


@triton.jit
def _gate_up_slice(acc_gate, acc_up, rows, r0, c0, N, h_ptr, gate_up_ptr, stride_hm,
                   stride_gum, swiglu_limit, WIDTH: tl.constexpr, HAS_LIMIT: tl.constexpr,
                   SAVE_GATE_UP: tl.constexpr, ROWS_TMA: tl.constexpr, UPCAST: tl.constexpr):
    """gate_up_swiglu's epilogue on a tile's columns [c0, c0 + WIDTH): h, and with
    SAVE_GATE_UP the pre-activations."""
    cols = c0 + tl.arange(0, WIDTH)
    if SAVE_GATE_UP:
        # The backward computes from these rounded values; h below from the unrounded ones.
        # With a limit, a value the limit clamps is stored as +-inf: rounding must not move it
        # across the limit, which decides whether its gradient passes.
        gate_kept = acc_gate
        up_kept = acc_up
        if HAS_LIMIT:
            gate_kept, up_kept = activation.kept(acc_gate, acc_up, swiglu_limit)
        _put_tile(gate_up_ptr, gate_kept, rows, cols, N, 0, stride_gum, r0, c0, ROWS_TMA,
                  UPCAST)
        _put_tile(gate_up_ptr, up_kept, rows, cols, N, N, stride_gum, r0, c0, ROWS_TMA, UPCAST)
    h = activation.swiglu(acc_gate, acc_up, swiglu_limit, HAS_LIMIT)
    _put_tile(h_ptr, h, rows, cols, N, 0, stride_hm, r0, c0, ROWS_TMA, UPCAST)


@triton.jit
def down_proj_kernel(
    h_ptr, w_down_ptr, out_ptr, router_weights_ptr, row_route_ptr, block_expert_ptr,
    dest_route_ptr, out_delta_ptr,
    used_rows_ptr, num_m_blocks, N, K, routes_per_rank,
    stride_hm, stride_we, stride_wn, stride_wk, stride_om,
    HAS_WEIGHT: tl.constexpr, ALIGN: tl.constexpr, W_TMA: tl.constexpr, ROWS_TMA: tl.constexpr,
    PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SCATTER: tl.constexpr, ROW_ALIGN: tl.constexpr, UPCAST: tl.constexpr,
):
    """out[row, n] = w[route] * (h[row] @ w_down[e].T); h [rows, K], w_down [E, N, K].

    W_TMA: w_down_ptr is a TMA descriptor of w_down viewed [E * N, K] (module docstring).
    ROWS_TMA (not with SCATTER): h_ptr and out_ptr are TMA descriptors of h and out, with
    [BLOCK_M, BLOCK_K] and [BLOCK_M, BLOCK_N // SPLIT] boxes.
    """
    first, end, step, grid_m = _tile_span(tl.program_id(0), 0, used_rows_ptr, num_m_blocks,
                                          tl.cdiv(N, BLOCK_N), BLOCK_M, GROUP_M, PERSISTENT)
    for tile in tl.range(first, end, step, flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile, grid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
        _down_tile(h_ptr, w_down_ptr, out_ptr, router_weights_ptr, row_route_ptr,
                   block_expert_ptr, dest_route_ptr, out_delta_ptr, pid_m, pid_n, N, K,
                   routes_per_rank, stride_hm, stride_we, stride_wn, stride_wk, stride_om,
                   HAS_WEIGHT, ALIGN, W_TMA, ROWS_TMA, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, SCATTER,
                   ROW_ALIGN, UPCAST)


@triton.jit
def _down_tile(
    h_ptr, w_down_ptr, out_ptr, router_weights_ptr, row_route_ptr, block_expert_ptr,
    dest_route_ptr, out_delta_ptr, pid_m, pid_n, N, K, routes_per_rank,
    stride_hm, stride_we, stride_wn, stride_wk, stride_om,
    HAS_WEIGHT: tl.constexpr, ALIGN: tl.constexpr, W_TMA: tl.constexpr, ROWS_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    SCATTER: tl.constexpr, ROW_ALIGN: tl.constexpr, UPCAST: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of down_proj_kernel (an expert's rows)."""
    expert = tl.load(block_expert_ptr + (pid_m * BLOCK_M) // ALIGN)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_offsets = rows[:, None] * stride_hm + ks[None, :]
    w_offsets = (expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn
                 + ks[:, None] * stride_wk)
    w_row = expert * N + pid_n * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + ks) < K
        if ROWS_TMA:
            a = h_ptr.load([pid_m * BLOCK_M, k0])
        else:
            a = tl.load(h_ptr + a_offsets, mask=k_mask[None, :], other=0.0)
        if W_TMA:
            b = w_down_ptr.load([w_row, k0]).T
        else:
            b = tl.load(w_down_ptr + w_offsets, mask=k_mask[:, None] & (cols[None, :] < N),
                        other=0.0)
        acc = mma(a, b, acc, UPCAST)
        a_offsets += BLOCK_K
        w_offsets += BLOCK_K * stride_wk
    if HAS_WEIGHT:
        route = tl.load(row_route_ptr + rows)
        weight = tl.load(router_weights_ptr + route, mask=route >= 0, other=0.0)
        acc = acc * weight[:, None]
    _store_out(out_ptr, acc, rows, pid_m * BLOCK_M, pid_n * BLOCK_N, N, stride_om,
               dest_route_ptr, out_delta_ptr, routes_per_rank, BLOCK_M, BLOCK_N, SPLIT, ROWS_TMA,
               SCATTER, ROW_ALIGN, UPCAST)


@triton.jit
def down_bwd_dswiglu_kernel(
    d_out_ptr, x_ptr, w_down_ptr, w_gate_ptr, w_up_ptr, h_ptr, gate_up_ptr, router_weights_ptr,
    d_gate_up_ptr, d_weight_partial_ptr, row_route_ptr, block_expert_ptr,
    pull_src_ptr, pull_src_delta_ptr, pull_w_ptr, pull_w_delta_ptr, pull_dst_w_ptr,
    pull_src2_ptr,
    pull_order_ptr, pull_position_ptr, pull_moving_ptr, ready_ptr, seq_ptr, flags_ptr,
    flag_delta_ptr, error_ptr, pull_ticket_ptr, used_rows_ptr, tile_counter_ptr, num_m_blocks,
    N, K, topk,
    num_pull_programs, phase, publish_slot, tokens_per_rank, pull_topk,
    world_size, timeout, stride_pull_src,
    stride_dm, stride_xm, stride_wd_e, stride_wd_k, stride_wd_n,
    stride_we, stride_wn, stride_wk, stride_ue, stride_un, stride_uk, stride_hm, stride_gum,
    stride_gm, stride_pm, swiglu_limit,
    HAS_LIMIT: tl.constexpr, HAS_WEIGHT: tl.constexpr, ALIGN: tl.constexpr, W_TMA: tl.constexpr,
    UP_STRIDES: tl.constexpr,
    SAVED_GATE_UP: tl.constexpr, H_OUT: tl.constexpr, ROWS_TMA: tl.constexpr,
    WK_TMA: tl.constexpr, PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr,
    DYNAMIC: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PULL: tl.constexpr, PULL_WEIGHTS: tl.constexpr, PULL_SECOND: tl.constexpr,
    MINIBATCH: tl.constexpr, PULL_BLOCK_R: tl.constexpr, PULL_BLOCK_W: tl.constexpr,
    PULL_K_PAD: tl.constexpr, PULL_ROW_ALIGN: tl.constexpr, HAS_TIMER: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_ORDER: tl.constexpr,
):
    """Backward through the down projection and SwiGLU, gate/up recomputed in the same K loop.

    With N = I and K = H: dh0 = d_out[token] @ w_down[e] (w_down [E, K, N]); gate, up = x[token] @
    w_gate[e].T, x[token] @ w_up[e].T (w_gate, w_up [E, N, K]). Writes d_gate_up[row] = [d_gate,
    d_up] (columns [0, N) and [N, 2N)) for dh = w[route] * dh0, and the partial router-weight
    gradient sum_n dh0 * h over this tile's columns to d_weight_partial[row, pid_n]. With PULL,
    d_out's rows (and x's, PULL_SECOND) are pulled from the other ranks by the launch's first
    programs. W_TMA: w_gate_ptr and w_up_ptr are TMA descriptors of w viewed [E * N, K],
    WK_TMA: w_down_ptr one of w_down viewed [E * K, N] (module docstring). SAVED_GATE_UP: gate
    and up are read from gate_up[row] = [gate, up] (what the forward's SAVE_GATE_UP wrote); the
    K loop is dh0's alone and x, w_gate, w_up are not read. H_OUT (with SAVED_GATE_UP): h is
    written, swiglu of the kept pre-activations, rather than read. ROWS_TMA: h_ptr, gate_up_ptr
    and d_gate_up_ptr are TMA descriptors of h, gate_up and d_gate_up with
    [BLOCK_M, BLOCK_N // SPLIT] boxes (BLOCK_N divides N). BLOCK_ORDER: the row blocks are taken
    in the order of pull_order_ptr (a copied pull's, see gate_up_swiglu_kernel).
    """
    pid = tl.program_id(0)
    if PULL:
        pid = _pull_programs(
            d_out_ptr, stride_dm, x_ptr, stride_xm, K, pull_src_ptr, pull_src_delta_ptr,
            pull_w_ptr, pull_w_delta_ptr, pull_dst_w_ptr, pull_src2_ptr, pull_order_ptr,
            pull_moving_ptr, ready_ptr, seq_ptr, flags_ptr,
            flag_delta_ptr, error_ptr, pull_ticket_ptr, num_pull_programs, phase, publish_slot,
            tokens_per_rank, pull_topk,
            world_size, timeout, stride_pull_src, PULL_WEIGHTS, PULL_SECOND, MINIBATCH,
            PULL_BLOCK_R, PULL_BLOCK_W, PULL_K_PAD, PULL_ROW_ALIGN, HAS_TIMER)
        if pid < 0:
            return
    first, end, step, grid_m = _tile_span(pid, num_pull_programs, used_rows_ptr, num_m_blocks,
                                          tl.cdiv(N, BLOCK_N), BLOCK_M, GROUP_M, PERSISTENT)
    landed = tl.zeros([], dtype=tl.int32)  # BLOCK_ORDER: ranks seen landed, a bit each
    if DYNAMIC:
        tile = _next_tile(first - step, step, tile_counter_ptr, DYNAMIC)
        while tile < end:
            next_tile = _next_tile(tile, step, tile_counter_ptr, DYNAMIC)  # taken ahead
            pid_m, pid_n = _tile_coords(tile, grid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
            if BLOCK_ORDER:
                pid_m = tl.load(pull_order_ptr + pid_m)
            landed = _down_bwd_tile(
                d_out_ptr, x_ptr, w_down_ptr, w_gate_ptr, w_up_ptr, h_ptr, gate_up_ptr,
                router_weights_ptr, d_gate_up_ptr, d_weight_partial_ptr, row_route_ptr,
                block_expert_ptr, ready_ptr, pull_position_ptr, seq_ptr, error_ptr, phase, timeout,
                pid_m, pid_n, landed, world_size, N, K, topk, stride_dm, stride_xm, stride_wd_e,
                stride_wd_k, stride_wd_n, stride_we, stride_wn, stride_wk, stride_ue, stride_un,
                stride_uk, stride_hm, stride_gum, stride_gm, stride_pm, swiglu_limit,
                HAS_LIMIT, HAS_WEIGHT, ALIGN, W_TMA, UP_STRIDES, SAVED_GATE_UP, H_OUT, ROWS_TMA,
                WK_TMA, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, PULL, MINIBATCH, HAS_TIMER, UPCAST,
                BLOCK_ORDER)
            tile = next_tile
    else:
        for tile in tl.range(first, end, step, flatten=FLATTEN):
            pid_m, pid_n = _tile_coords(tile, grid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
            if BLOCK_ORDER:
                pid_m = tl.load(pull_order_ptr + pid_m)
            landed = _down_bwd_tile(
                d_out_ptr, x_ptr, w_down_ptr, w_gate_ptr, w_up_ptr, h_ptr, gate_up_ptr,
                router_weights_ptr, d_gate_up_ptr, d_weight_partial_ptr, row_route_ptr,
                block_expert_ptr, ready_ptr, pull_position_ptr, seq_ptr, error_ptr, phase, timeout,
                pid_m, pid_n, landed, world_size, N, K, topk, stride_dm, stride_xm, stride_wd_e,
                stride_wd_k, stride_wd_n, stride_we, stride_wn, stride_wk, stride_ue, stride_un,
                stride_uk, stride_hm, stride_gum, stride_gm, stride_pm, swiglu_limit,
                HAS_LIMIT, HAS_WEIGHT, ALIGN, W_TMA, UP_STRIDES, SAVED_GATE_UP, H_OUT, ROWS_TMA,
                WK_TMA, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, PULL, MINIBATCH, HAS_TIMER, UPCAST,
                BLOCK_ORDER)


@triton.jit
def _down_bwd_tile(
    d_out_ptr, x_ptr, w_down_ptr, w_gate_ptr, w_up_ptr, h_ptr, gate_up_ptr, router_weights_ptr,
    d_gate_up_ptr, d_weight_partial_ptr, row_route_ptr, block_expert_ptr,
    ready_ptr, pull_position_ptr, seq_ptr, error_ptr, phase, timeout, pid_m, pid_n, landed,
    world_size, N, K, topk, stride_dm, stride_xm, stride_wd_e, stride_wd_k, stride_wd_n,
    stride_we, stride_wn, stride_wk, stride_ue, stride_un, stride_uk, stride_hm, stride_gum,
    stride_gm, stride_pm, swiglu_limit,
    HAS_LIMIT: tl.constexpr, HAS_WEIGHT: tl.constexpr, ALIGN: tl.constexpr, W_TMA: tl.constexpr,
    UP_STRIDES: tl.constexpr,
    SAVED_GATE_UP: tl.constexpr, H_OUT: tl.constexpr, ROWS_TMA: tl.constexpr,
    WK_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, PULL: tl.constexpr, MINIBATCH: tl.constexpr, HAS_TIMER: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_ORDER: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of down_bwd_dswiglu_kernel (an expert's rows); returns
    `landed` (see _wait_tile)."""
    expert = tl.load(block_expert_ptr + (pid_m * BLOCK_M) // ALIGN)
    rows, route, valid, token = _tile_rows(row_route_ptr, pid_m, topk, BLOCK_M)
    if PULL:
        landed = _wait_tile(ready_ptr, pull_position_ptr, seq_ptr, phase, timeout, error_ptr,
                            token, valid, landed, world_size, MINIBATCH, BLOCK_ORDER, HAS_TIMER)
    r0 = pid_m * BLOCK_M
    c0 = pid_n * BLOCK_N
    cols = c0 + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    d_out_ptrs = d_out_ptr + token[:, None] * stride_dm + ks[None, :]
    x_ptrs = x_ptr + token[:, None] * stride_xm + ks[None, :]
    e64 = expert.to(tl.int64)
    wd_offsets = e64 * stride_wd_e + ks[:, None] * stride_wd_k + cols[None, :] * stride_wd_n
    w_offsets = e64 * stride_we + cols[None, :] * stride_wn + ks[:, None] * stride_wk
    w_row = expert * N + pid_n * BLOCK_N
    acc_dh = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SAVED_GATE_UP:
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + ks) < K
            a_dy = tl.load(d_out_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
            if WK_TMA:
                b_down = w_down_ptr.load([expert * K + k0, c0])
            else:
                b_down = tl.load(w_down_ptr + wd_offsets,
                                 mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc_dh = mma(a_dy, b_down, acc_dh, UPCAST)
            d_out_ptrs += BLOCK_K
            wd_offsets += BLOCK_K * stride_wd_k
        acc_gate = acc_dh  # unused: _dswiglu_slice reads the kept gate and up
        acc_up = acc_dh
    else:
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        u_offsets = _up_offsets(w_offsets, expert, cols, ks, stride_ue, stride_un, stride_uk,
                                UP_STRIDES)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + ks) < K
            a_mask = valid[:, None] & k_mask[None, :]
            w_mask = k_mask[:, None] & col_mask[None, :]
            a_dy = tl.load(d_out_ptrs, mask=a_mask, other=0.0)
            a_x = tl.load(x_ptrs, mask=a_mask, other=0.0)
            if WK_TMA:
                b_down = w_down_ptr.load([expert * K + k0, c0])
            else:
                b_down = tl.load(w_down_ptr + wd_offsets, mask=w_mask, other=0.0)
            if W_TMA:
                b_gate = w_gate_ptr.load([w_row, k0]).T
                b_up = w_up_ptr.load([w_row, k0]).T
            else:
                b_gate = tl.load(w_gate_ptr + w_offsets, mask=w_mask, other=0.0)
                if UP_STRIDES:
                    b_up = tl.load(w_up_ptr + u_offsets, mask=w_mask, other=0.0)
                else:
                    b_up = tl.load(w_up_ptr + w_offsets, mask=w_mask, other=0.0)
            acc_dh = mma(a_dy, b_down, acc_dh, UPCAST)
            acc_gate = mma(a_x, b_gate, acc_gate, UPCAST)
            acc_up = mma(a_x, b_up, acc_up, UPCAST)
            d_out_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            wd_offsets += BLOCK_K * stride_wd_k
            w_offsets += BLOCK_K * stride_wk
            if UP_STRIDES:
                u_offsets += BLOCK_K * stride_uk

    if SPLIT == 1:
        partial = _dswiglu_slice(
            acc_dh, acc_gate, acc_up, rows, route, valid, r0, c0, N, h_ptr, gate_up_ptr,
            router_weights_ptr, d_gate_up_ptr, stride_hm, stride_gum, stride_gm, swiglu_limit,
            BLOCK_M, BLOCK_N, HAS_LIMIT, HAS_WEIGHT, SAVED_GATE_UP, H_OUT, ROWS_TMA, UPCAST)
    else:  # two column halves, one after the other: half the epilogue's registers
        HALF: tl.constexpr = BLOCK_N // 2
        dh_a, dh_b = _halves(acc_dh, BLOCK_M, BLOCK_N)
        if SAVED_GATE_UP:  # _dswiglu_slice reads them: placeholders
            gate_a, gate_b, up_a, up_b = dh_a, dh_b, dh_a, dh_b
        else:
            gate_a, gate_b = _halves(acc_gate, BLOCK_M, BLOCK_N)
            up_a, up_b = _halves(acc_up, BLOCK_M, BLOCK_N)
        partial = _dswiglu_slice(
            dh_a, gate_a, up_a, rows, route, valid, r0, c0, N, h_ptr, gate_up_ptr,
            router_weights_ptr, d_gate_up_ptr, stride_hm, stride_gum, stride_gm, swiglu_limit,
            BLOCK_M, HALF, HAS_LIMIT, HAS_WEIGHT, SAVED_GATE_UP, H_OUT, ROWS_TMA, UPCAST)
        partial += _dswiglu_slice(
            dh_b, gate_b, up_b, rows, route, valid, r0, c0 + HALF, N, h_ptr, gate_up_ptr,
            router_weights_ptr, d_gate_up_ptr, stride_hm, stride_gum, stride_gm, swiglu_limit,
            BLOCK_M, HALF, HAS_LIMIT, HAS_WEIGHT, SAVED_GATE_UP, H_OUT, ROWS_TMA, UPCAST)
    if HAS_WEIGHT:
        tl.store(d_weight_partial_ptr + rows * stride_pm + pid_n, partial)
    return landed


@triton.jit
def _dswiglu_slice(
    acc_dh, acc_gate, acc_up, rows, route, valid, r0, c0, N, h_ptr, gate_up_ptr,
    router_weights_ptr, d_gate_up_ptr, stride_hm, stride_gum, stride_gm, swiglu_limit,
    BLOCK_M: tl.constexpr, WIDTH: tl.constexpr, HAS_LIMIT: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, SAVED_GATE_UP: tl.constexpr, H_OUT: tl.constexpr,
    ROWS_TMA: tl.constexpr, UPCAST: tl.constexpr,
):
    """dSwiGLU of a tile's columns [c0, c0 + WIDTH) (acc_dh = dh0 there; acc_gate, acc_up the
    recomputed pre-activations, or with SAVED_GATE_UP read here): writes d_gate and d_up (and
    h, H_OUT); returns the slice's part of the router-weight gradient per row (HAS_WEIGHT)."""
    cols = c0 + tl.arange(0, WIDTH)
    if SAVED_GATE_UP:
        gate = _get_tile(gate_up_ptr, rows, cols, N, 0, stride_gum, r0, c0, ROWS_TMA)
        up = _get_tile(gate_up_ptr, rows, cols, N, N, stride_gum, r0, c0, ROWS_TMA)
    else:
        gate = acc_gate
        up = acc_up
    if HAS_LIMIT:
        gate_pass, up_pass = activation.passes(gate, up, swiglu_limit, SAVED_GATE_UP)
        gate, up = activation.clamp(gate, up, swiglu_limit)
    sig, silu = activation.silu(gate)
    if H_OUT:  # h from the kept pre-activations, for the down projection's weight gradient
        h = silu * up
        _put_tile(h_ptr, h, rows, cols, N, 0, stride_hm, r0, c0, ROWS_TMA, UPCAST)
    partial = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_WEIGHT:
        # d w[route] = <d_out[token], w_down[e] h[row]> = sum_n dh0[row, n] * h[row, n], with the
        # h the forward stored (bf16), so the gradient matches the forward that ran (H_OUT: the
        # h of the kept pre-activations, in fp32).
        if not H_OUT:
            h = _get_tile(h_ptr, rows, cols, N, 0, stride_hm, r0, c0, ROWS_TMA)
        partial = tl.sum(acc_dh * h, axis=1)
        weight = tl.load(router_weights_ptr + route, mask=valid, other=0.0)
        acc_dh = acc_dh * weight[:, None]
    d_gate, d_up = activation.dswiglu(acc_dh, gate, up, sig, silu)
    if HAS_LIMIT:
        d_gate = tl.where(gate_pass, d_gate, 0.0)
        d_up = tl.where(up_pass, d_up, 0.0)
    _put_tile(d_gate_up_ptr, d_gate, rows, cols, N, 0, stride_gm, r0, c0, ROWS_TMA, UPCAST)
    _put_tile(d_gate_up_ptr, d_up, rows, cols, N, N, stride_gm, r0, c0, ROWS_TMA, UPCAST)
    return partial


@triton.jit
def d_x_rows_kernel(
    d_gate_up_ptr, w_gate_ptr, w_up_ptr, out_ptr, block_expert_ptr,
    dest_route_ptr, out_delta_ptr, pulled_ptr, stride_pulled,
    pull_src_ptr, pull_src_delta_ptr, pull_w_ptr, pull_w_delta_ptr, pull_dst_w_ptr,
    pull_src2_ptr,
    pull_order_ptr, pull_position_ptr, pull_moving_ptr, ready_ptr, seq_ptr, flags_ptr,
    flag_delta_ptr, error_ptr, pull_ticket_ptr, used_rows_ptr, tile_counter_ptr, num_m_blocks,
    N, K,
    routes_per_rank, num_pull_programs, phase, publish_slot, tokens_per_rank, pull_topk,
    world_size, timeout, stride_pull_src,
    stride_gm, stride_we, stride_wk, stride_wn, stride_ue, stride_uk, stride_un, stride_om,
    ALIGN: tl.constexpr, ROWS_TMA: tl.constexpr, WK_TMA: tl.constexpr,
    UP_STRIDES: tl.constexpr, PERSISTENT: tl.constexpr,
    FLATTEN: tl.constexpr, DYNAMIC: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SCATTER: tl.constexpr, ROW_ALIGN: tl.constexpr,
    PULL: tl.constexpr, PULL_WEIGHTS: tl.constexpr, PULL_SECOND: tl.constexpr,
    MINIBATCH: tl.constexpr, PULL_BLOCK_R: tl.constexpr, PULL_BLOCK_W: tl.constexpr,
    PULL_K_PAD: tl.constexpr, PULL_ROW_ALIGN: tl.constexpr, HAS_TIMER: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """out[row] = d_gate[row] @ w_gate[e] + d_up[row] @ w_up[e]; N = H, K = I, w [E, K, N].

    ROWS_TMA (not with SCATTER): d_gate_up_ptr and out_ptr are TMA descriptors of d_gate_up and
    out, with [BLOCK_M, BLOCK_K] (BLOCK_K divides K) and [BLOCK_M, BLOCK_N // SPLIT] boxes. WK_TMA:
    w_gate_ptr and w_up_ptr are TMA descriptors of w viewed [E * K, N] (module docstring).
    PULL: the launch's first programs pull token rows of width N into pulled_ptr for a later
    kernel (the weight gradients' x when the backward reads kept pre-activations); no tile
    reads them, so none waits.
    """
    pid = tl.program_id(0)
    if PULL:
        pid = _pull_programs(
            pulled_ptr, stride_pulled, pulled_ptr, stride_pulled, N, pull_src_ptr,
            pull_src_delta_ptr, pull_w_ptr, pull_w_delta_ptr, pull_dst_w_ptr, pull_src2_ptr,
            pull_order_ptr, pull_moving_ptr, ready_ptr, seq_ptr, flags_ptr, flag_delta_ptr,
            error_ptr, pull_ticket_ptr, num_pull_programs, phase, publish_slot, tokens_per_rank,
            pull_topk,
            world_size, timeout, stride_pull_src, PULL_WEIGHTS, PULL_SECOND, MINIBATCH,
            PULL_BLOCK_R, PULL_BLOCK_W, PULL_K_PAD, PULL_ROW_ALIGN, HAS_TIMER)
        if pid < 0:
            return
    first, end, step, grid_m = _tile_span(pid, num_pull_programs, used_rows_ptr, num_m_blocks,
                                          tl.cdiv(N, BLOCK_N), BLOCK_M, GROUP_M, PERSISTENT)
    if DYNAMIC:
        tile = _next_tile(first - step, step, tile_counter_ptr, DYNAMIC)
        while tile < end:
            next_tile = _next_tile(tile, step, tile_counter_ptr, DYNAMIC)  # taken ahead
            _d_x_tile(d_gate_up_ptr, w_gate_ptr, w_up_ptr, out_ptr, block_expert_ptr,
                      dest_route_ptr, out_delta_ptr, tile, grid_m, N, K, routes_per_rank,
                      stride_gm, stride_we, stride_wk, stride_wn, stride_ue, stride_uk,
                      stride_un, stride_om, ALIGN, ROWS_TMA, WK_TMA, UP_STRIDES, BLOCK_M, BLOCK_N,
                      BLOCK_K, GROUP_M, SPLIT, SCATTER, ROW_ALIGN, UPCAST)
            tile = next_tile
    else:  # a for loop: with the while loop, the TMA-row tiles' stores compile differently
        for tile in tl.range(first, end, step, flatten=FLATTEN):
            _d_x_tile(d_gate_up_ptr, w_gate_ptr, w_up_ptr, out_ptr, block_expert_ptr,
                      dest_route_ptr, out_delta_ptr, tile, grid_m, N, K, routes_per_rank,
                      stride_gm, stride_we, stride_wk, stride_wn, stride_ue, stride_uk,
                      stride_un, stride_om, ALIGN, ROWS_TMA, WK_TMA, UP_STRIDES, BLOCK_M, BLOCK_N,
                      BLOCK_K, GROUP_M, SPLIT, SCATTER, ROW_ALIGN, UPCAST)


@triton.jit
def _d_x_tile(
    d_gate_up_ptr, w_gate_ptr, w_up_ptr, out_ptr, block_expert_ptr, dest_route_ptr,
    out_delta_ptr, tile, grid_m, N, K, routes_per_rank,
    stride_gm, stride_we, stride_wk, stride_wn, stride_ue, stride_uk, stride_un, stride_om,
    ALIGN: tl.constexpr, ROWS_TMA: tl.constexpr, WK_TMA: tl.constexpr, UP_STRIDES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT: tl.constexpr, SCATTER: tl.constexpr, ROW_ALIGN: tl.constexpr, UPCAST: tl.constexpr,
):
    """Tile `tile` [BLOCK_M, BLOCK_N] of d_x_rows_kernel (an expert's rows)."""
    pid_m, pid_n = _tile_coords(tile, grid_m, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + (pid_m * BLOCK_M) // ALIGN)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_offsets = rows[:, None] * stride_gm + ks[None, :]
    w_offsets = (expert.to(tl.int64) * stride_we + ks[:, None] * stride_wk
                 + cols[None, :] * stride_wn)
    u_offsets = _up_offsets(w_offsets, expert, cols, ks, stride_ue, stride_un, stride_uk,
                            UP_STRIDES)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + ks) < K
        w_mask = k_mask[:, None] & (cols[None, :] < N)
        if ROWS_TMA:
            a_gate = d_gate_up_ptr.load([pid_m * BLOCK_M, k0])
            a_up = d_gate_up_ptr.load([pid_m * BLOCK_M, K + k0])
        else:
            a_gate = tl.load(d_gate_up_ptr + a_offsets, mask=k_mask[None, :], other=0.0)
            a_up = tl.load(d_gate_up_ptr + a_offsets + K, mask=k_mask[None, :], other=0.0)
        if WK_TMA:
            b_gate = w_gate_ptr.load([expert * K + k0, pid_n * BLOCK_N])
            b_up = w_up_ptr.load([expert * K + k0, pid_n * BLOCK_N])
        else:
            b_gate = tl.load(w_gate_ptr + w_offsets, mask=w_mask, other=0.0)
            if UP_STRIDES:
                b_up = tl.load(w_up_ptr + u_offsets, mask=w_mask, other=0.0)
            else:
                b_up = tl.load(w_up_ptr + w_offsets, mask=w_mask, other=0.0)
        acc = mma(a_gate, b_gate, acc, UPCAST)
        acc = mma(a_up, b_up, acc, UPCAST)
        a_offsets += BLOCK_K
        w_offsets += BLOCK_K * stride_wk
        if UP_STRIDES:
            u_offsets += BLOCK_K * stride_uk
    _store_out(out_ptr, acc, rows, pid_m * BLOCK_M, pid_n * BLOCK_N, N, stride_om,
               dest_route_ptr, out_delta_ptr, routes_per_rank, BLOCK_M, BLOCK_N, SPLIT, ROWS_TMA,
               SCATTER, ROW_ALIGN, UPCAST)


@triton.jit
def _wgrad_tile(
    tile, a_ptr, a2_ptr, b_ptr, out_ptr, out2_ptr, row_route_ptr, router_weights_ptr,
    expert_counts_ptr, expert_offsets_ptr, P, Q, topk, num_rows, stride_am, stride_bm, stride_oe,
    stride_op, stride_oq,
    GATHER_A: tl.constexpr, SCALE_A: tl.constexpr, GATHER_B: tl.constexpr, PAIR: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr, UPCAST: tl.constexpr,
):
    """One output tile of grouped_wgrad_kernel: tiles run expert by expert, then P, then Q."""
    num_p_blocks = tl.cdiv(P, BLOCK_P)
    num_q_blocks = tl.cdiv(Q, BLOCK_Q)
    expert = tile // (num_p_blocks * num_q_blocks)
    pid_pq = tile % (num_p_blocks * num_q_blocks)
    pid_p = pid_pq // num_q_blocks
    pid_q = pid_pq % num_q_blocks
    start = tl.load(expert_offsets_ptr + expert)
    # num_rows: on a capacity overflow an expert's rows may run past the schedule's rows
    end = tl.minimum(start + tl.load(expert_counts_ptr + expert), num_rows)
    ps = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    acc = tl.zeros([BLOCK_P, BLOCK_Q], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_P, BLOCK_Q], dtype=tl.float32)
    NEED_ROUTE: tl.constexpr = GATHER_A or GATHER_B or SCALE_A
    offsets = tl.arange(0, BLOCK_R)
    next_route = tl.zeros([BLOCK_R], dtype=tl.int32)
    if NEED_ROUTE:
        next_route = tl.load(row_route_ptr + start + offsets, mask=start + offsets < end,
                             other=0)
    for row0 in range(start, end, BLOCK_R):
        rows = row0 + offsets
        # An expert's rows [start, end) are all scheduled routes (its padding comes after), so
        # validity needs no route: only a gathered operand or a route's weight loads one. It
        # is loaded an iteration ahead: a load whose address comes from a load of the same
        # iteration costs the software pipeline a stage.
        valid = rows < end
        a_rows = rows.to(tl.int64)
        b_rows = rows.to(tl.int64)
        if NEED_ROUTE:
            route = next_route
            ahead = rows + BLOCK_R
            next_route = tl.load(row_route_ptr + ahead, mask=ahead < end, other=0)
            token = (route // topk).to(tl.int64)
            if GATHER_A:
                a_rows = token
            if GATHER_B:
                b_rows = token
        a_offsets = a_rows[None, :] * stride_am + ps[:, None]
        a_mask = valid[None, :] & (ps[:, None] < P)
        a = tl.load(a_ptr + a_offsets, mask=a_mask, other=0.0)
        if SCALE_A:
            weight = tl.load(router_weights_ptr + route, mask=valid, other=0.0)
            a = cast_to(a.to(tl.float32) * weight[None, :], a_ptr.dtype.element_ty, UPCAST)
        b = tl.load(b_ptr + b_rows[:, None] * stride_bm + qs[None, :],
                    mask=valid[:, None] & (qs[None, :] < Q), other=0.0)
        acc = mma(a, b, acc, UPCAST)
        if PAIR:  # a second A of the same rows and layout, sharing B's tile
            a2 = tl.load(a2_ptr + a_offsets, mask=a_mask, other=0.0)
            acc2 = mma(a2, b, acc2, UPCAST)
    out_offsets = (expert.to(tl.int64) * stride_oe + ps[:, None] * stride_op
                   + qs[None, :] * stride_oq)
    out_mask = (ps[:, None] < P) & (qs[None, :] < Q)
    tl.store(out_ptr + out_offsets, cast_to(acc, out_ptr.dtype.element_ty, UPCAST),
             mask=out_mask)
    if PAIR:
        tl.store(out2_ptr + out_offsets, cast_to(acc2, out_ptr.dtype.element_ty, UPCAST),
                 mask=out_mask)


@triton.jit
def grouped_wgrad_kernel(
    a_ptr, a2_ptr, b_ptr, out_ptr, out2_ptr, row_route_ptr, router_weights_ptr,
    expert_counts_ptr, expert_offsets_ptr,
    P, Q, topk, num_rows, num_tiles,
    stride_am, stride_bm, stride_oe, stride_op, stride_oq,
    GATHER_A: tl.constexpr, SCALE_A: tl.constexpr, GATHER_B: tl.constexpr, PAIR: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_R: tl.constexpr,
    PERSISTENT: tl.constexpr, UPCAST: tl.constexpr,
):
    """out[e] = sum over the rows of expert e of A[row, :P]^T B[row, :Q], out [E, P, Q].

    GATHER_A / GATHER_B: that operand is token-indexed (row -> route // topk) rather than
    row-indexed. SCALE_A: scale A's rows by router_weights[route], rounded to A's dtype, as a
    weighted copy would be. The rows are summed in order, so the result is deterministic.
    PERSISTENT: each program takes tiles num_programs apart. The loop asks the compiler to
    flatten the nest so it could pipeline across tiles; with a row loop whose bounds change from
    tile to tile, Triton 3.6 does not (scripts/sm90_compile.py --dump-ttgir shows the two
    loops), so this is a grid-stride loop. Either way a tile is summed in the same order. (The
    nest flattened by hand, each tile's store inside the one loop, was measured slower at qwen3:
    2.33 against 2.17 ms for wgrad_gate_up at 128x256.)
    PAIR: also out2[e] = sum of A2[row]^T B[row] (A2 laid out as A: the up half of d_gate_up
    beside the gate half), each B tile loaded once for both products.
    """
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
            _wgrad_tile(tile, a_ptr, a2_ptr, b_ptr, out_ptr, out2_ptr, row_route_ptr,
                        router_weights_ptr, expert_counts_ptr, expert_offsets_ptr, P, Q, topk,
                        num_rows, stride_am, stride_bm, stride_oe, stride_op, stride_oq,
                        GATHER_A, SCALE_A, GATHER_B, PAIR, BLOCK_P, BLOCK_Q, BLOCK_R, UPCAST)
    else:
        _wgrad_tile(tl.program_id(0), a_ptr, a2_ptr, b_ptr, out_ptr, out2_ptr, row_route_ptr,
                    router_weights_ptr, expert_counts_ptr, expert_offsets_ptr, P, Q, topk,
                    num_rows, stride_am, stride_bm, stride_oe, stride_op, stride_oq, GATHER_A,
                    SCALE_A, GATHER_B, PAIR, BLOCK_P, BLOCK_Q, BLOCK_R, UPCAST)
