"""The expert-parallel pull inside the warp-specialized Gluon GEMMs (Hopper, sm_90).

mok.kernels.comm.pull_tokens and wait_tokens_ready in Gluon, for a GEMM whose every program
(one per SM) gives a worker partition of PULL_WARPS warps to the dispatch: program p pulls
minibatches p, p + P, ... of the pull order (the group's tokens with a route scheduled here, by
first schedule row) while its loader partition gathers each row tile once its rows' tokens have
landed. The protocol is the Triton kernels' (the same ready flags, minibatches, order and
timeouts): a pulling partition waits for every rank's publish flag, copies each minibatch's rows
(and the tokens' router weights), then, after a partition-wide barrier, releases
ready[minibatch] = seq[phase]; a loader waits (acquire) on the minibatches of its tile's tokens,
then a barrier of the loader's warps orders its gathers after the flags.

No program waits on a minibatch that a program not yet running must deliver (as in the Triton
launches, where the pulling programs are the first to start): the pulling partitions claim the
minibatches in order from a counter, so the programs running pull them all, however many of
the launch's programs (one per SM) have an SM. The first tiles' rows come first in the order,
and every program pulls at once, so the tiles of the first wave wait on about their own rows'
share of the bytes, not on the whole pull.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# Slots of the error-flag vector (mok.errors.ErrorFlag), as in mok.kernels.comm.
FLAG_PEER_TIMEOUT = gl.constexpr(2)
FLAG_PEER_RANK = gl.constexpr(3)  # 1 + the rank that did not answer


@gluon.jit
def _now():
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64,
                                     is_pure=False, pack=1)


@gluon.jit
def _timed_out(error_ptr, peer):
    gl.atomic_max(error_ptr + FLAG_PEER_TIMEOUT, 1)
    gl.atomic_max(error_ptr + FLAG_PEER_RANK, peer + 1)


@gluon.jit
def wait_published(flags_ptr, flag_delta_ptr, publish_slot, target, world_size, timeout,
                   error_ptr):
    """Spin until every rank's flags[publish_slot] >= target (acquire, system scope) or
    `timeout` ns pass (then the PEER_TIMEOUT error names the rank; once set, later waits give
    up at once), as mok.kernels.comm.wait_at_least for each rank."""
    for peer in range(0, world_size):
        flag_ptr = flags_ptr + gl.load(flag_delta_ptr + peer) + publish_slot
        value = gl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        start = _now()
        elapsed = start - start
        if gl.load(error_ptr + FLAG_PEER_TIMEOUT, volatile=True) != 0:
            elapsed += timeout + 1
        while (value < target) & (elapsed <= timeout):
            value = gl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            elapsed = _now() - start
        if value < target:
            _timed_out(error_ptr, peer)


@gluon.jit
def pull_partition(
    src_ptr, src_delta_ptr, weights_ptr, weights_delta_ptr, dst_ptr, dst_weights_ptr,
    order_ptr, moving_ptr, ready_ptr, flags_ptr, flag_delta_ptr, seq_ptr, error_ptr, claim_ptr,
    phase, publish_slot, tokens_per_rank, topk, width, world_size, timeout,
    stride_src, stride_dst,
    HAS_WEIGHTS: gl.constexpr, MINIBATCH: gl.constexpr, BLOCK_R: gl.constexpr,
    BLOCK_W: gl.constexpr, K_PAD: gl.constexpr, ROW_ALIGN: gl.constexpr,
    PULL_WARPS: gl.constexpr,
):
    """The dispatch, as this program's share (mok.kernels.comm.pull_tokens): dst[u] = rank p's
    src[t] for the group tokens u = p * tokens_per_rank + t in order[:moving[0]], a minibatch of
    MINIBATCH of them at a time, each minibatch claimed from a counter the launch's programs
    share (claim_ptr, zero at launch), in order; with HAS_WEIGHTS also dst_weights[u * topk + j]
    = rank p's weights[t * topk + j]. Steps of [BLOCK_R, BLOCK_W] elements, 16-byte pieces, the
    warps stacking rows. Claiming rather than taking minibatches by program id, the programs
    running pull every minibatch even while others wait for an SM (another stream's kernels,
    another process's), so no loader waits on a program that has not started."""
    TPW_W: gl.constexpr = 32 if BLOCK_W // 8 >= 32 else BLOCK_W // 8
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_W, TPW_W], [PULL_WARPS, 1],
                                                 [1, 0])
    w_layout: gl.constexpr = gl.BlockedLayout([1, K_PAD], [32, 1], [PULL_WARPS, 1], [1, 0])
    target = gl.load(seq_ptr + phase)
    wait_published(flags_ptr, flag_delta_ptr, publish_slot, target, world_size, timeout,
                   error_ptr)
    gl.thread_barrier()
    moving = gl.load(moving_ptr)
    r_base = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, rows_layout))
    cols = gl.arange(0, BLOCK_W, layout=gl.SliceLayout(0, rows_layout))
    w_rows = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, w_layout))
    slots = gl.arange(0, K_PAD, layout=gl.SliceLayout(0, w_layout))
    minibatches = gl.cdiv(moving, MINIBATCH)
    minibatch = gl.atomic_add(claim_ptr, 1, sem="relaxed", scope="gpu")
    while minibatch < minibatches:
        for r0 in range(0, MINIBATCH, BLOCK_R):
            index = minibatch * MINIBATCH + r0 + r_base
            moves = (index < moving) & (r0 + r_base < MINIBATCH)
            token = gl.load(order_ptr + index, mask=moves, other=0).to(gl.int64)
            src_rank = token // tokens_per_rank
            src_rows = gl.multiple_of(
                gl.load(src_delta_ptr + src_rank, mask=moves, other=0)
                + (token % tokens_per_rank) * stride_src, ROW_ALIGN)
            dst_rows = token * stride_dst
            for c0 in range(0, width, BLOCK_W):
                mask = moves[:, None] & ((c0 + cols) < width)[None, :]
                values = gl.load(src_ptr + src_rows[:, None] + (c0 + cols)[None, :], mask=mask)
                gl.store(dst_ptr + dst_rows[:, None] + (c0 + cols)[None, :], values, mask=mask)
            if HAS_WEIGHTS:
                w_index = minibatch * MINIBATCH + r0 + w_rows
                w_moves = (w_index < moving) & (r0 + w_rows < MINIBATCH)
                w_token = gl.load(order_ptr + w_index, mask=w_moves, other=0).to(gl.int64)
                w_rank = w_token // tokens_per_rank
                w_delta = gl.load(weights_delta_ptr + w_rank, mask=w_moves, other=0)
                w_mask = w_moves[:, None] & (slots < topk)[None, :]
                weight = gl.load(weights_ptr + (w_delta + (w_token % tokens_per_rank) * topk)
                                 [:, None] + slots[None, :], mask=w_mask, other=0.0)
                gl.store(dst_weights_ptr + (w_token * topk)[:, None] + slots[None, :], weight,
                         mask=w_mask)
        gl.thread_barrier()
        gl.atomic_xchg(ready_ptr + minibatch, target, sem="release", scope="gpu")
        minibatch = gl.atomic_add(claim_ptr, 1, sem="relaxed", scope="gpu")


@gluon.jit
def wait_rows_ready(row_route_ptr, r0, topk, position_ptr, ready_ptr, seq_ptr, phase,
                    timeout, error_ptr, BLOCK_M: gl.constexpr, MINIBATCH: gl.constexpr,
                    WARPS: gl.constexpr):
    """In a loader partition of WARPS warps, before gathering the rows r0 .. r0 + BLOCK_M:
    wait until their tokens have landed (mok.kernels.comm.wait_tokens_ready: the minibatches
    of their positions in the pull's order; a timeout is reported for peer -1)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    rows = gl.arange(0, BLOCK_M, layout=layout)
    route = gl.load(row_route_ptr + r0 + rows)
    valid = route >= 0
    token = gl.where(valid, route // topk, 0)
    index = gl.load(position_ptr + token, mask=valid, other=0) // MINIBATCH
    target = gl.load(seq_ptr + phase)
    zero = gl.zeros([BLOCK_M], gl.int64, layout)
    value = gl.atomic_add(ready_ptr + index, zero, mask=valid, sem="acquire", scope="sys")
    pending = valid & (value < target)
    if gl.max(pending.to(gl.int32), axis=0) > 0:
        start = _now()
        elapsed = start - start
        if gl.load(error_ptr + FLAG_PEER_TIMEOUT, volatile=True) != 0:
            elapsed += timeout + 1
        while (gl.max(pending.to(gl.int32), axis=0) > 0) & (elapsed <= timeout):
            value = gl.atomic_add(ready_ptr + index, zero, mask=pending, sem="acquire",
                                  scope="sys")
            pending = pending & (value < target)
            elapsed = _now() - start
        if gl.max(pending.to(gl.int32), axis=0) > 0:
            _timed_out(error_ptr, -1)
    gl.thread_barrier()


@gluon.jit
def wait_ranks_landed(row_route_ptr, r0, topk, ready_ptr, seq_ptr, phase, timeout, error_ptr,
                      landed, world_size, BLOCK_M: gl.constexpr, TOKENS_PER_RANK: gl.constexpr,
                      WARPS: gl.constexpr):
    """In a loader partition of WARPS warps, before gathering the rows r0 .. r0 + BLOCK_M of
    rows copied by rank (mok.exchange.SymmetricExchange.forward_copy: ready[p] >= seq[phase]
    once rank p's rows landed, group token u from rank u // TOKENS_PER_RANK): wait on the flags
    of the ranks of its rows not yet in `landed` (a bit per rank seen landed, carried over the
    loader's tiles, so each flag is waited on once per program); returns the new bits. Every
    thread acquires the flags itself (system scope), so its own gathers come after them."""
    if landed != (1 << world_size) - 1:
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        rows = gl.arange(0, BLOCK_M, layout=layout)
        route = gl.load(row_route_ptr + r0 + rows)
        valid = route >= 0
        src = gl.where(valid, (route // topk) // TOKENS_PER_RANK, 0)
        lo = gl.min(gl.where(valid, src, world_size), axis=0)
        hi = gl.max(gl.where(valid, src, -1), axis=0)
        target = gl.load(seq_ptr + phase)
        for p in range(lo, hi + 1):
            if ((landed >> p) & 1) == 0:
                value = gl.atomic_add(ready_ptr + p, target - target, sem="acquire", scope="sys")
                if value < target:
                    start = _now()
                    elapsed = start - start
                    if gl.load(error_ptr + FLAG_PEER_TIMEOUT, volatile=True) != 0:
                        elapsed += timeout + 1
                    while (value < target) & (elapsed <= timeout):
                        value = gl.atomic_add(ready_ptr + p, target - target, sem="acquire",
                                              scope="sys")
                        elapsed = _now() - start
                    if value < target:
                        _timed_out(error_ptr, -1)
                landed = landed | (1 << p)
    return landed
