"""Routing-schedule kernels: a stable counting sort of routes by local expert, on the device.

A route is one (token, slot) pair, route id r = token * topk + slot. The schedule orders the routes
of each local expert by route id (so by token, then slot), pads every expert's rows to a multiple
of ALIGN and records, per block of ALIGN rows, which expert owns it. Three launches, no atomics on
data, no host sync:

1. histogram: per chunk of routes, the count of each expert and each route's rank in its chunk
   (and a share of the rows set to -1, padding until the scatter places a route there); a
   program walks its chunk in sub-chunks of SUB routes (the one-hot tile [SUB, E_PAD] stays
   small however many experts), so there are few chunks for the next launch to sum;
2. offsets (one program): per-chunk bases, expert counts, padded expert offsets;
3. scatter: row_route[row] = route and route_row[route] = row, and the owner of each block of
   ALIGN rows (a share of the blocks a program).
"""

import triton
import triton.language as tl

# Slots of the error-flag vector (mok.errors.ErrorFlag).
FLAG_EXPERT_ID_OUT_OF_RANGE = tl.constexpr(0)
FLAG_CAPACITY_OVERFLOW = tl.constexpr(1)


@triton.jit
def _local_experts(
    topk_experts_ptr,
    routes,
    num_routes,
    num_experts_total,
    first_local_expert,
    num_local_experts,
):
    """Expert ids of `routes` -> (local expert id, is local and valid, is out of range)."""
    in_range = routes < num_routes
    expert = tl.load(topk_experts_ptr + routes, mask=in_range, other=0)
    # Compare in the loaded dtype (int64 ids must not wrap before the check).
    bad = in_range & ((expert < 0) | (expert >= num_experts_total))
    local_expert = (expert - first_local_expert).to(tl.int32)
    is_local = in_range & ~bad & (local_expert >= 0) & (local_expert < num_local_experts)
    return local_expert, is_local, bad


@triton.jit
def route_histogram_kernel(
    topk_experts_ptr,
    chunk_counts_ptr,
    route_rank_ptr,
    row_route_ptr,
    error_flags_ptr,
    num_routes,
    num_experts_total,
    first_local_expert,
    num_local_experts,
    capacity_rows,
    fill_rows,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    E_PAD: tl.constexpr,
):
    chunk = tl.program_id(0)
    # Every row starts as padding (-1), fill_rows (a multiple of SUB) a program; the scatter,
    # a later launch, places the routes.
    fill_end = tl.minimum((chunk + 1) * fill_rows, capacity_rows)
    for start in range(chunk * fill_rows, (chunk + 1) * fill_rows, SUB):
        rows = start + tl.arange(0, SUB)
        tl.store(row_route_ptr + rows, -1, mask=rows < fill_end)
    experts = tl.arange(0, E_PAD)
    running = tl.zeros([E_PAD], dtype=tl.int32)  # routes of each expert in earlier sub-chunks
    for sub in range(0, CHUNK, SUB):
        routes = chunk * CHUNK + sub + tl.arange(0, SUB)
        local_expert, is_local, bad = _local_experts(
            topk_experts_ptr, routes, num_routes, num_experts_total, first_local_expert,
            num_local_experts,
        )
        tl.store(
            error_flags_ptr + FLAG_EXPERT_ID_OUT_OF_RANGE, 1,
            mask=tl.max(bad.to(tl.int32), axis=0) > 0,
        )
        one_hot = ((local_expert[:, None] == experts[None, :]) & is_local[:, None]).to(tl.int32)
        # Exclusive rank of each route among the routes of its expert in this chunk.
        rank = tl.sum((tl.cumsum(one_hot, axis=0) - one_hot + running[None, :]) * one_hot,
                      axis=1)
        tl.store(route_rank_ptr + routes, rank, mask=routes < num_routes)
        running += tl.sum(one_hot, axis=0)
    tl.store(chunk_counts_ptr + chunk * E_PAD + experts, running)


@triton.jit
def route_offsets_kernel(
    chunk_counts_ptr,
    chunk_base_ptr,
    expert_counts_ptr,
    expert_offsets_ptr,
    error_flags_ptr,
    num_chunks,
    num_local_experts,
    capacity_rows,
    ALIGN: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNKS_PER_STEP: tl.constexpr,
):
    experts = tl.arange(0, E_PAD)
    running = tl.zeros([E_PAD], dtype=tl.int32)
    for chunk0 in range(0, num_chunks, CHUNKS_PER_STEP):
        chunks = chunk0 + tl.arange(0, CHUNKS_PER_STEP)
        offsets = chunks[:, None] * E_PAD + experts[None, :]
        mask = chunks[:, None] < num_chunks
        counts = tl.load(chunk_counts_ptr + offsets, mask=mask, other=0)
        exclusive = tl.cumsum(counts, axis=0) - counts
        tl.store(chunk_base_ptr + offsets, running[None, :] + exclusive, mask=mask)
        running += tl.sum(counts, axis=0)

    padded = (running + ALIGN - 1) // ALIGN * ALIGN
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    is_expert = experts < num_local_experts
    tl.store(expert_counts_ptr + experts, running, mask=is_expert)
    tl.store(expert_offsets_ptr + experts, starts, mask=is_expert)
    # Past the capacity the schedule holds only the first rows: the rows used never exceed it
    # (the counts stay the experts' true route counts; consumers clamp to the rows).
    tl.store(expert_offsets_ptr + num_local_experts, tl.minimum(total, capacity_rows))
    tl.store(error_flags_ptr + FLAG_CAPACITY_OVERFLOW, 1, mask=total > capacity_rows)


@triton.jit
def route_scatter_kernel(
    topk_experts_ptr,
    route_rank_ptr,
    chunk_base_ptr,
    expert_offsets_ptr,
    row_route_ptr,
    route_row_ptr,
    block_expert_ptr,
    num_routes,
    num_experts_total,
    first_local_expert,
    num_local_experts,
    capacity_rows,
    num_blocks,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    E_PAD: tl.constexpr,
    ALIGN: tl.constexpr,
    OWNER_BLOCKS: tl.constexpr,
):
    # OWNER_BLOCKS blocks of ALIGN rows a program: the owner of each is the number of experts
    # whose rows end at or before its first row (expert e's end where expert e + 1 starts; the
    # last expert's at the rows used, past which blocks own none).
    blocks = tl.program_id(0) * OWNER_BLOCKS + tl.arange(0, OWNER_BLOCKS)
    experts = tl.arange(0, E_PAD)
    later = (experts >= 1) & (experts < num_local_experts)
    next_starts = tl.load(expert_offsets_ptr + experts, mask=later, other=0)
    used = tl.load(expert_offsets_ptr + num_local_experts)
    first_row = blocks * ALIGN
    done = (next_starts[None, :] <= first_row[:, None]) & later[None, :]
    owner = tl.where(first_row < used, tl.sum(done.to(tl.int32), axis=1), -1)
    tl.store(block_expert_ptr + blocks, owner, mask=blocks < num_blocks)

    # BLOCK routes a program, of the histogram's chunks of CHUNK routes.
    routes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    local_expert, is_local, _ = _local_experts(
        topk_experts_ptr, routes, num_routes, num_experts_total, first_local_expert,
        num_local_experts,
    )
    safe_expert = tl.where(is_local, local_expert, 0)
    rank = tl.load(route_rank_ptr + routes, mask=is_local, other=0)
    base = tl.load(chunk_base_ptr + (routes // CHUNK) * E_PAD + safe_expert, mask=is_local,
                   other=0)
    start = tl.load(expert_offsets_ptr + safe_expert, mask=is_local, other=0)
    row = start + base + rank
    placed = is_local & (row < capacity_rows)
    tl.store(row_route_ptr + row, routes, mask=placed)
    tl.store(route_row_ptr + routes, tl.where(placed, row, -1), mask=routes < num_routes)


# -- expert parallelism: the routes a rank publishes, and the order of its row blocks ----------

@triton.jit
def exchange_routes_kernel(
    topk_experts_ptr,
    published_ptr,
    source_route_row_ptr,
    num_routes,
    routes_per_rank,
    num_experts_total,
    GHOST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """What a rank publishes of its routes and where they come back (mok.exchange.symmetric):
    published[r] = the expert id of route r when in [0, E) (or E with GHOST), -1 when out of
    range, E (no rank's) past num_routes up to routes_per_rank; source_route_row[r] = r, or -1
    when the id is out of range (the ghost's routes included: no rank computes them)."""
    routes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    present = routes < num_routes
    expert = tl.load(topk_experts_ptr + routes, mask=present, other=0)
    # Compare in the loaded dtype (int64 ids must not wrap before the check).
    valid = (expert >= 0) & (expert < num_experts_total)
    passes = valid
    if GHOST:
        passes = passes | (expert == num_experts_total)
    published = tl.where(passes, expert, -1).to(tl.int32)
    published = tl.where(present, published, num_experts_total)
    tl.store(published_ptr + routes, published, mask=routes < routes_per_rank)
    tl.store(source_route_row_ptr + routes, tl.where(valid, routes, -1), mask=present)


@triton.jit
def _block_classes(row_route_ptr, blocks, num_blocks, used_blocks, rank, routes_per_rank,
                   lead_blocks, BLOCK_M: tl.constexpr, HAS_LEAD: tl.constexpr):
    """[len(blocks)] int32: 0 for a used row block whose rows all come from `rank` (and, with
    HAS_LEAD, that starts before lead_blocks), 1 for the other used blocks, 2 past the used
    ones, 3 past num_blocks."""
    rows = blocks[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    route = tl.load(row_route_ptr + rows, mask=blocks[:, None] < num_blocks, other=-1)
    remote = tl.max(((route >= 0) & (route // routes_per_rank != rank)).to(tl.int32), axis=1)
    first = remote == 0
    if HAS_LEAD:
        first = first & (blocks < lead_blocks)
    classes = tl.where(blocks < used_blocks, tl.where(first, 0, 1), 2)
    return tl.where(blocks < num_blocks, classes, 3)


@triton.jit
def local_first_kernel(
    row_route_ptr,
    used_rows_ptr,
    order_ptr,
    num_blocks,
    rank,
    routes_per_rank,
    lead,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    HAS_LEAD: tl.constexpr,
):
    """order = the row blocks of BLOCK_M rows by class (_block_classes: this rank's rows, the
    others, unused), in schedule order within a class: a stable partition, one program, two
    passes (counts, then places)."""
    used_blocks = tl.load(used_rows_ptr) // BLOCK_M
    lead_blocks = used_blocks
    if HAS_LEAD:  # block i leads when i < used * lead, i.e. i < ceil(used * lead)
        lead_blocks = tl.ceil(used_blocks.to(tl.float32) * lead).to(tl.int32)
    count0 = tl.zeros([], dtype=tl.int32)
    count1 = tl.zeros([], dtype=tl.int32)
    for start in range(0, num_blocks, CHUNK):
        classes = _block_classes(row_route_ptr, start + tl.arange(0, CHUNK), num_blocks,
                                 used_blocks, rank, routes_per_rank, lead_blocks, BLOCK_M,
                                 HAS_LEAD)
        count0 += tl.sum((classes == 0).to(tl.int32), axis=0)
        count1 += tl.sum((classes == 1).to(tl.int32), axis=0)
    next0 = tl.zeros([], dtype=tl.int32)
    next1 = count0
    next2 = count0 + count1
    for start in range(0, num_blocks, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        classes = _block_classes(row_route_ptr, blocks, num_blocks, used_blocks, rank,
                                 routes_per_rank, lead_blocks, BLOCK_M, HAS_LEAD)
        is0 = (classes == 0).to(tl.int32)
        is1 = (classes == 1).to(tl.int32)
        is2 = (classes == 2).to(tl.int32)
        place = tl.where(classes == 0, next0 + tl.cumsum(is0, axis=0) - is0,
                         tl.where(classes == 1, next1 + tl.cumsum(is1, axis=0) - is1,
                                  next2 + tl.cumsum(is2, axis=0) - is2))
        tl.store(order_ptr + place, blocks, mask=classes < 3)
        next0 += tl.sum(is0, axis=0)
        next1 += tl.sum(is1, axis=0)
        next2 += tl.sum(is2, axis=0)
