"""Expert-parallel communication kernels: flags, waits with timeouts, pulls from peers.

Every rank of an expert-parallel group owns one symmetric buffer (the same layout on every rank,
mapped into every rank's address space: PyTorch symmetric memory on GPUs, shared-memory files on
CPU). A kernel reaches a peer's copy of a buffer at `local_ptr + delta[peer]`, delta being the
distance between the two mappings in elements. The kernels only ever move data and flags; every
GEMM stays in mok.kernels.grouped_gemm.

Flags are int64 sequence numbers that only grow: a phase (schedule, forward, backward) is numbered
on the device (`seq`), so the same code works when replayed by a CUDA graph. A waiter spins until
a flag reaches the phase's number. Every spin has a timeout: on GPU in nanoseconds of the global
timer, under the interpreter (no timer) in spins. A wait that times out records the peer in the
error flags and gives up, so a dead peer ends in an error naming it, never in a hang.

Memory order: a producer's stores, then a CTA barrier, then a release store of the flag (system
scope for peers); a consumer's acquire load of the flag, then a CTA barrier, then its loads.
"""

import triton
import triton.language as tl

# Slots of the error-flag vector (mok.errors.ErrorFlag).
FLAG_CAPACITY_OVERFLOW = tl.constexpr(1)
FLAG_PEER_TIMEOUT = tl.constexpr(2)
FLAG_PEER_RANK = tl.constexpr(3)  # 1 + the rank that did not answer


@triton.jit
def _now(HAS_TIMER: tl.constexpr):
    if HAS_TIMER:
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    else:
        return tl.zeros([], dtype=tl.int64)


@triton.jit
def wait_at_least(flag_ptr, target, peer, timeout, error_ptr, HAS_TIMER: tl.constexpr):
    """Spin until *flag_ptr >= target (acquire, system scope) or `timeout` passes.

    On timeout, sets the PEER_TIMEOUT error and records `peer`. Once any wait of this rank has
    timed out, later waits give up at once: a dead peer costs one timeout, not one per tile.
    Returns whether the flag came.
    """
    value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    start = _now(HAS_TIMER)
    elapsed = tl.zeros([], dtype=tl.int64)
    if tl.load(error_ptr + FLAG_PEER_TIMEOUT, volatile=True) != 0:
        elapsed += timeout + 1
    while (value < target) & (elapsed <= timeout):
        value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        if HAS_TIMER:
            elapsed = _now(HAS_TIMER) - start
        else:
            elapsed += 1
    arrived = value >= target
    if not arrived:
        tl.atomic_max(error_ptr + FLAG_PEER_TIMEOUT, 1)
        tl.atomic_max(error_ptr + FLAG_PEER_RANK, peer + 1)
    tl.debug_barrier()
    return arrived


@triton.jit
def _advance(seq_ptr, flags_ptr, phase, publish_slot, PUBLISH: tl.constexpr):
    """seq[phase] += 1; with PUBLISH, also release it into this rank's flag `publish_slot`.
    Returns the new number."""
    value = tl.load(seq_ptr + phase) + 1
    tl.store(seq_ptr + phase, value)
    if PUBLISH:
        tl.debug_barrier()
        tl.atomic_xchg(flags_ptr + publish_slot, value, sem="release", scope="sys")
    return value


@triton.jit
def _signal_peers(flags_ptr, delta_ptr, value, slot, rank, world_size, P_PAD: tl.constexpr):
    """Every peer's flags[slot + rank] = value (release, system scope), this rank included."""
    peers = tl.arange(0, P_PAD)
    mask = peers < world_size
    delta = tl.load(delta_ptr + peers, mask=mask, other=0)
    tl.debug_barrier()
    tl.atomic_xchg(flags_ptr + delta + slot + rank, tl.zeros([P_PAD], dtype=tl.int64) + value,
                   mask=mask, sem="release", scope="sys")


@triton.jit
def _wait_peers(flags_ptr, delta_ptr, error_ptr, target, slot, stride_peer, world_size, timeout,
                REMOTE: tl.constexpr, HAS_TIMER: tl.constexpr):
    """Wait until flag(p) >= target for every rank p, where flag(p) is this rank's
    flags[slot + p * stride_peer] or, with REMOTE, rank p's own flags[slot]."""
    for peer in range(0, world_size):
        if REMOTE:
            ptr = flags_ptr + tl.load(delta_ptr + peer) + slot
        else:
            ptr = flags_ptr + slot + peer * stride_peer
        wait_at_least(ptr, target, peer, timeout, error_ptr, HAS_TIMER)


@triton.jit
def _collect_reported_errors(flags_ptr, report_slot, error_ptr):
    """After the other ranks' "done" of a phase: a route of this rank's tokens that an expert's
    rank had no row for (see clear_dropped_routes_kernel) becomes this rank's CAPACITY_OVERFLOW
    error too; the report is cleared for the next phase."""
    reported = tl.atomic_xchg(flags_ptr + report_slot, 0, sem="acquire", scope="sys")
    tl.atomic_max(error_ptr + FLAG_CAPACITY_OVERFLOW, (reported != 0).to(tl.int32))


@triton.jit
def advance_kernel(seq_ptr, flags_ptr, phase, publish_slot, PUBLISH: tl.constexpr):
    """seq[phase] += 1; with PUBLISH, also release it into this rank's flag `publish_slot`."""
    _advance(seq_ptr, flags_ptr, phase, publish_slot, PUBLISH)


@triton.jit
def signal_peers_kernel(flags_ptr, delta_ptr, seq_ptr, phase, slot, rank, world_size,
                        P_PAD: tl.constexpr):
    """Every peer's flags[slot + rank] = seq[phase] (release, system scope), this rank included."""
    _signal_peers(flags_ptr, delta_ptr, tl.load(seq_ptr + phase), slot, rank, world_size, P_PAD)


@triton.jit
def wait_peers_kernel(flags_ptr, delta_ptr, seq_ptr, error_ptr, phase, slot, stride_peer,
                      world_size, timeout, lag, phase2, slot2, REMOTE: tl.constexpr,
                      SECOND: tl.constexpr, HAS_TIMER: tl.constexpr):
    """Wait until flag(p) >= seq[phase] - lag for every rank p, where flag(p) is this rank's
    flags[slot + p * stride_peer] or, with REMOTE, rank p's own flags[slot]; with SECOND, then
    until likewise flag(p) >= seq[phase2] for (phase2, slot2)."""
    _wait_peers(flags_ptr, delta_ptr, error_ptr, tl.load(seq_ptr + phase) - lag, slot,
                stride_peer, world_size, timeout, REMOTE, HAS_TIMER)
    if SECOND:
        _wait_peers(flags_ptr, delta_ptr, error_ptr, tl.load(seq_ptr + phase2), slot2,
                    stride_peer, world_size, timeout, REMOTE, HAS_TIMER)


@triton.jit
def publish_and_wait_kernel(flags_ptr, delta_ptr, seq_ptr, error_ptr, phase, publish_slot,
                            world_size, timeout, HAS_TIMER: tl.constexpr):
    """advance_kernel with PUBLISH, then wait until every rank published that round (rank p's
    own flags[publish_slot])."""
    value = _advance(seq_ptr, flags_ptr, phase, publish_slot, True)
    _wait_peers(flags_ptr, delta_ptr, error_ptr, value, publish_slot, 0, world_size, timeout,
                True, HAS_TIMER)


@triton.jit
def finish_kernel(flags_ptr, delta_ptr, seq_ptr, error_ptr, phase, done_slot, report_slot,
                  rank, world_size, timeout, SIGNAL: tl.constexpr, P_PAD: tl.constexpr,
                  HAS_TIMER: tl.constexpr):
    """The end of a phase's deliveries: signal "done" to every rank (flags[done_slot + rank];
    without SIGNAL that was done by an earlier launch), wait for every rank's, then collect the
    reports of this rank's dropped routes (_collect_reported_errors)."""
    value = tl.load(seq_ptr + phase)
    if SIGNAL:
        _signal_peers(flags_ptr, delta_ptr, value, done_slot, rank, world_size, P_PAD)
    _wait_peers(flags_ptr, delta_ptr, error_ptr, value, done_slot, 1, world_size, timeout,
                False, HAS_TIMER)
    _collect_reported_errors(flags_ptr, report_slot, error_ptr)


@triton.jit
def gather_peers_kernel(src_ptr, delta_ptr, dst_ptr, flags_ptr, flag_delta_ptr, seq_ptr,
                        error_ptr, phase, publish_slot, numel, world_size, timeout,
                        BLOCK: tl.constexpr, HAS_TIMER: tl.constexpr):
    """dst[p * numel + i] = rank p's src[i], once rank p has published the phase (grid: P, n;
    the n programs of rank p take its blocks in turn, each waiting on rank p's flag once, so a
    few programs poll a flag rather than one per block)."""
    peer = tl.program_id(0)
    target = tl.load(seq_ptr + phase)
    wait_at_least(flags_ptr + tl.load(flag_delta_ptr + peer) + publish_slot, target, peer,
                  timeout, error_ptr, HAS_TIMER)
    src = src_ptr + tl.load(delta_ptr + peer)
    dst = dst_ptr + peer.to(tl.int64) * numel
    for start in range(tl.program_id(1) * BLOCK, numel, tl.num_programs(1) * BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < numel
        tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)


@triton.jit
def pull_tokens(
    pid, num_programs,
    src_ptr, src_delta_ptr, weights_ptr, weights_delta_ptr, dst_ptr, dst_weights_ptr,
    src2_ptr, dst2_ptr, order_ptr, moving_ptr, ready_ptr,
    flags_ptr, flag_delta_ptr, seq_ptr, error_ptr,
    phase, publish_slot, tokens_per_rank, ring_rows, topk, width, world_size, timeout,
    stride_src, stride_dst, stride_dst2,
    HAS_WEIGHTS: tl.constexpr, HAS_SECOND: tl.constexpr, MINIBATCH: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, K_PAD: tl.constexpr, ROW_ALIGN: tl.constexpr,
    HAS_TIMER: tl.constexpr,
):
    """The dispatch, as program `pid` of `num_programs`: dst[u] = rank p's src[t] for every group
    token u = p * tokens_per_rank + t with a route scheduled here, once however many of its
    routes come here (tokens without one are not read).

    order[i] (i < moving[0]) lists those tokens by their first schedule row (the schedule's
    rows are in expert order: a token's first row is its earliest; see
    mok.exchange.ExchangePlan). Programs take minibatches of MINIBATCH of them in turn,
    in that order, and set ready[minibatch] = seq[phase] once one has landed; GEMM tiles wait
    on the minibatches of their rows' tokens (`wait_tokens_ready`), which come no later than
    the tiles' own rows in the order, so the first tiles start while later tokens are in
    flight. With HAS_WEIGHTS the token's router weights come along: dst_weights[u * topk + j]
    = rank p's weights[t * topk + j]. With HAS_SECOND a second buffer of the same symmetric
    allocation and row layout comes along too: dst2[u] = rank p's src2[t] (the backward pulls
    d_output and x together). Rank p's token t sits at row t % ring_rows of src (and of
    weights): ring_rows = tokens_per_rank where a rank publishes all its tokens at once, the
    ring's rows where it publishes them a window at a time (mok.exchange.symmetric).

    The GEMMs that wait on these rows run the pull in their own launch, in its first programs
    to start (a ticket each, see mok.kernels.grouped_gemm._pull_programs): whatever order the
    hardware starts programs in, the pull runs, and a GEMM tile never spins on rows that no
    running program will deliver.
    """
    target = tl.load(seq_ptr + phase)
    for peer in range(0, world_size):
        wait_at_least(flags_ptr + tl.load(flag_delta_ptr + peer) + publish_slot, target, peer,
                      timeout, error_ptr, HAS_TIMER)
    moving = tl.load(moving_ptr)
    cols = tl.arange(0, BLOCK_W)
    slots = tl.arange(0, K_PAD)
    for minibatch in range(pid, tl.cdiv(moving, MINIBATCH), num_programs):
        for r0 in range(0, MINIBATCH, BLOCK_R):
            index = minibatch * MINIBATCH + r0 + tl.arange(0, BLOCK_R)
            moves = (index < moving) & (r0 + tl.arange(0, BLOCK_R) < MINIBATCH)
            token = tl.load(order_ptr + index, mask=moves, other=0).to(tl.int64)
            src_rank = token // tokens_per_rank
            local_token = token % tokens_per_rank % ring_rows
            src_rows = tl.multiple_of(
                tl.load(src_delta_ptr + src_rank, mask=moves, other=0) + local_token * stride_src,
                ROW_ALIGN)
            dst_rows = token * stride_dst
            dst2_rows = token * stride_dst2
            for c0 in range(0, width, BLOCK_W):
                mask = moves[:, None] & ((c0 + cols) < width)[None, :]
                # Both buffers' loads go out before either store: twice the bytes in flight.
                values = tl.load(src_ptr + src_rows[:, None] + (c0 + cols)[None, :], mask=mask)
                if HAS_SECOND:
                    values2 = tl.load(src2_ptr + src_rows[:, None] + (c0 + cols)[None, :],
                                      mask=mask)
                tl.store(dst_ptr + dst_rows[:, None] + (c0 + cols)[None, :], values, mask=mask)
                if HAS_SECOND:
                    tl.store(dst2_ptr + dst2_rows[:, None] + (c0 + cols)[None, :], values2,
                             mask=mask)
            if HAS_WEIGHTS:
                w_delta = tl.load(weights_delta_ptr + src_rank, mask=moves, other=0)
                w_mask = moves[:, None] & (slots < topk)[None, :]
                weight = tl.load(weights_ptr + (w_delta + local_token * topk)[:, None]
                                 + slots[None, :], mask=w_mask, other=0.0)
                tl.store(dst_weights_ptr + token[:, None] * topk + slots[None, :], weight,
                         mask=w_mask)
        tl.debug_barrier()
        tl.atomic_xchg(ready_ptr + minibatch, target, sem="release", scope="gpu")


@triton.jit
def pull_tokens_kernel(
    src_ptr, src_delta_ptr, weights_ptr, weights_delta_ptr, dst_ptr, dst_weights_ptr,
    order_ptr, moving_ptr, ready_ptr, flags_ptr, flag_delta_ptr, seq_ptr, error_ptr,
    phase, publish_slot, tokens_per_rank, ring_rows, topk, width, world_size, timeout,
    stride_src, stride_dst,
    HAS_WEIGHTS: tl.constexpr, MINIBATCH: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr, K_PAD: tl.constexpr, ROW_ALIGN: tl.constexpr,
    HAS_TIMER: tl.constexpr,
):
    """pull_tokens on its own (to measure the dispatch alone)."""
    pull_tokens(tl.program_id(0), tl.num_programs(0),
                src_ptr, src_delta_ptr, weights_ptr, weights_delta_ptr, dst_ptr,
                dst_weights_ptr, src_ptr, dst_ptr, order_ptr, moving_ptr, ready_ptr, flags_ptr,
                flag_delta_ptr, seq_ptr, error_ptr, phase, publish_slot, tokens_per_rank,
                ring_rows, topk, width, world_size, timeout, stride_src, stride_dst,
                stride_dst, HAS_WEIGHTS, False, MINIBATCH, BLOCK_R, BLOCK_W, K_PAD, ROW_ALIGN,
                HAS_TIMER)


@triton.jit
def wait_tokens_ready(ready_ptr, position_ptr, token, valid, target, timeout, error_ptr,
                      MINIBATCH: tl.constexpr, HAS_TIMER: tl.constexpr):
    """Inside a GEMM: wait until the group tokens `token` (where `valid`) have landed: the
    minibatches of their positions in the pull's order (see pull_tokens); like wait_at_least,
    with the timeout reported for peer -1 (this rank's pull)."""
    index = tl.load(position_ptr + token, mask=valid, other=0) // MINIBATCH
    zero = tl.zeros(token.shape, dtype=tl.int64)
    value = tl.atomic_add(ready_ptr + index, zero, mask=valid, sem="acquire", scope="sys")
    pending = valid & (value < target)
    start = _now(HAS_TIMER)
    elapsed = tl.zeros([], dtype=tl.int64)
    if tl.load(error_ptr + FLAG_PEER_TIMEOUT, volatile=True) != 0:
        elapsed += timeout + 1
    while (tl.max(pending.to(tl.int32), axis=0) > 0) & (elapsed <= timeout):
        value = tl.atomic_add(ready_ptr + index, zero, mask=pending, sem="acquire", scope="sys")
        pending = pending & (value < target)
        if HAS_TIMER:
            elapsed = _now(HAS_TIMER) - start
        else:
            elapsed += 1
    if tl.max(pending.to(tl.int32), axis=0) > 0:
        tl.atomic_max(error_ptr + FLAG_PEER_TIMEOUT, 1)
        tl.atomic_max(error_ptr + FLAG_PEER_RANK, 0)
    tl.debug_barrier()


@triton.jit
def wait_ranks_landed(ready_ptr, token, valid, target, landed, world_size, timeout, error_ptr,
                      TOKENS_PER_RANK: tl.constexpr, HAS_TIMER: tl.constexpr):
    """Inside a GEMM over rows copied by rank (mok.ops.comm.Pull.copied: ready[p] >= target
    once rank p's rows landed, group token u from rank u // TOKENS_PER_RANK): wait on the flags
    of the ranks of the tokens `token` (where `valid`) not yet in `landed` (a bit per rank seen
    landed, carried over a program's tiles, so each flag is waited on once per program);
    returns the new bits. Timeouts are reported as wait_tokens_ready's."""
    if landed != (1 << world_size) - 1:
        src = (token // TOKENS_PER_RANK).to(tl.int32)
        lo = tl.min(tl.where(valid, src, world_size), axis=0)
        hi = tl.max(tl.where(valid, src, -1), axis=0)
        for p in range(lo, hi + 1):
            if ((landed >> p) & 1) == 0:
                wait_at_least(ready_ptr + p, target, -1, timeout, error_ptr, HAS_TIMER)
                landed = landed | (1 << p)
    return landed


@triton.jit
def scatter_route_values_kernel(
    values_ptr, route_row_ptr, out_ptr, out_delta_ptr, num_routes, routes_per_rank,
    BLOCK: tl.constexpr,
):
    """out on rank g // routes_per_rank, at g % routes_per_rank = values[g] for every route g
    scheduled here (route_row[g] >= 0); the others are left to the ranks that own them."""
    routes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = routes < num_routes
    row = tl.load(route_row_ptr + routes, mask=in_range, other=-1)
    here = row >= 0
    value = tl.load(values_ptr + routes, mask=here, other=0.0)
    dst_rank = routes // routes_per_rank
    delta = tl.load(out_delta_ptr + dst_rank, mask=here, other=0)
    tl.store(out_ptr + delta + routes % routes_per_rank, value, mask=here)


@triton.jit
def clear_dropped_routes_kernel(
    topk_ptr, route_row_ptr, rows_ptr, rows_delta_ptr, values_ptr, values_delta_ptr,
    flags_ptr, flag_delta_ptr, report_slot,
    num_routes, routes_per_rank, first_local_expert, num_local_experts, width, stride_rows,
    CLEAR_ROWS: tl.constexpr, CLEAR_VALUES: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """For every route g of the group that chose one of this rank's experts but got no row of
    its schedule (the capacity overflowed), zero what its token's rank reads for it: row
    g % routes_per_rank of that rank's `rows` and/or its entry of `values`. The token's rank
    then adds nothing for the route, as on one GPU, and finds its flags[report_slot] set
    (finish_kernel's _collect_reported_errors turns that into its CAPACITY_OVERFLOW error)."""
    routes = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    in_range = routes < num_routes
    expert = tl.load(topk_ptr + routes, mask=in_range, other=-1)
    mine = (expert >= first_local_expert) & (expert < first_local_expert + num_local_experts)
    row = tl.load(route_row_ptr + routes, mask=in_range, other=0)
    dropped = in_range & mine & (row < 0)
    # Nothing dropped (the usual case): the block's routes are read and that is all; masked-off
    # stores over the row width would still cost their instructions.
    if tl.max(dropped.to(tl.int32), axis=0) > 0:
        dst_rank = routes // routes_per_rank
        local_route = (routes % routes_per_rank).to(tl.int64)
        if CLEAR_ROWS:
            delta = tl.load(rows_delta_ptr + dst_rank, mask=dropped, other=0)
            offsets = delta + local_route * stride_rows
            cols = tl.arange(0, BLOCK_W)
            zeros = tl.zeros([BLOCK_R, BLOCK_W], dtype=rows_ptr.dtype.element_ty)
            for c0 in range(0, width, BLOCK_W):
                mask = dropped[:, None] & ((c0 + cols) < width)[None, :]
                tl.store(rows_ptr + offsets[:, None] + (c0 + cols)[None, :], zeros, mask=mask)
        if CLEAR_VALUES:
            delta = tl.load(values_delta_ptr + dst_rank, mask=dropped, other=0)
            tl.store(values_ptr + delta + local_route, tl.zeros([BLOCK_R], dtype=tl.float32),
                     mask=dropped)
        flag_delta = tl.load(flag_delta_ptr + dst_rank, mask=dropped, other=0)
        tl.atomic_max(flags_ptr + flag_delta + report_slot, tl.full([BLOCK_R], 1, tl.int64),
                      mask=dropped, sem="relaxed", scope="sys")



@triton.jit
def deliver_rows_kernel(
    rows_ptr, route_row_ptr, topk_ptr, out_ptr, out_delta_ptr,
    window_start, window_tokens, tokens_per_rank, ring_rows, routes_per_rank, topk,
    first_local_expert, num_local_experts, width, stride_rows, stride_out,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Rows of the routes of one window of tokens into their tokens' ranks' ring
    (mok.exchange.symmetric's delivery round; grid: P, route blocks).

    Program (p, b) takes routes i of rank p's tokens t = window_start + i // topk (i <
    window_tokens * topk, t < tokens_per_rank); those that chose one of this rank's experts
    (topk[g] in its range, g = p * routes_per_rank + t * topk + i % topk) write rows[route_row[g]]
    to rank p's out[(t % ring_rows) * topk + i % topk], or zeros where the schedule had no row
    for the route (a capacity overflow, reported by clear_dropped_routes_kernel)."""
    peer = tl.program_id(0)
    index = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    token = window_start + index // topk
    route = peer.to(tl.int64) * routes_per_rank + token * topk + index % topk
    valid = (index < window_tokens * topk) & (token < tokens_per_rank)
    expert = tl.load(topk_ptr + route, mask=valid, other=-1)
    mine = valid & (expert >= first_local_expert) & (expert < first_local_expert
                                                      + num_local_experts)
    row = tl.load(route_row_ptr + route, mask=mine, other=-1).to(tl.int64)
    has_row = mine & (row >= 0)
    dst = (tl.load(out_delta_ptr + peer)
           + ((token % ring_rows) * topk + index % topk).to(tl.int64) * stride_out)
    cols = tl.arange(0, BLOCK_W)
    for c0 in range(0, width, BLOCK_W):
        in_width = ((c0 + cols) < width)[None, :]
        values = tl.load(rows_ptr + row[:, None] * stride_rows + (c0 + cols)[None, :],
                         mask=has_row[:, None] & in_width, other=0.0)
        tl.store(out_ptr + dst[:, None] + (c0 + cols)[None, :],
                 values.to(out_ptr.dtype.element_ty), mask=mine[:, None] & in_width)
