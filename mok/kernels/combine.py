"""Row kernels outside the GEMMs: the combine (per-token sums over the token's routes in a fixed
order, no atomics), the router-weight gradient's sums, and row copies in schedule order."""

import triton
import triton.language as tl

from mok.kernels.common import cast_to


@triton.jit
def combine_kernel(
    rows_ptr, route_row_ptr, shared_ptr, out_ptr,
    num_tokens, N,
    stride_rm, stride_sm, stride_om,
    TOPK: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
):
    """out[t] = shared[t] + sum_{j < TOPK} rows[route_row[t * TOPK + j]], in fp32, in that order.

    Routes whose row is -1 (not scheduled) add nothing. TOPK is a compile-time constant so the
    slot loop unrolls and the TOPK gathered loads of a token are in flight together.
    """
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    token_mask = tokens < num_tokens
    col_mask = cols < N
    mask = token_mask[:, None] & col_mask[None, :]
    tokens64 = tokens.to(tl.int64)
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + tokens64[:, None] * stride_sm + cols[None, :], mask=mask,
                       other=0.0).to(tl.float32)
    for slot in tl.static_range(TOPK):
        row = tl.load(route_row_ptr + tokens64 * TOPK + slot, mask=token_mask, other=-1)
        row_mask = (row >= 0)[:, None] & col_mask[None, :]
        acc += tl.load(rows_ptr + row.to(tl.int64)[:, None] * stride_rm + cols[None, :],
                       mask=row_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + tokens64[:, None] * stride_om + cols[None, :],
             cast_to(acc, out_ptr.dtype.element_ty, UPCAST), mask=mask)


@triton.jit
def router_grad_kernel(
    partial_ptr, route_row_ptr, out_ptr,
    num_routes, num_parts, stride_pm,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """out[route] = sum_p partial[route_row[route], p]; 0 for routes that were not scheduled."""
    routes = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    route_mask = routes < num_routes
    row = tl.load(route_row_ptr + routes, mask=route_mask, other=-1)
    valid = row >= 0
    parts = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for p0 in range(0, num_parts, BLOCK_P):
        mask = valid[:, None] & ((p0 + parts) < num_parts)[None, :]
        offsets = row.to(tl.int64)[:, None] * stride_pm + (p0 + parts)[None, :]
        values = tl.load(partial_ptr + offsets,
                         mask=mask, other=0.0)
        acc += tl.sum(values, axis=1)
    tl.store(out_ptr + routes, acc, mask=route_mask)


@triton.jit
def copy_rows_kernel(
    src_ptr, row_route_ptr, weights_ptr, out_ptr, used_rows_ptr,
    N, topk, stride_sm, stride_om,
    GATHER: tl.constexpr, SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
):
    """out[row] = src[route // topk] (GATHER; else src[row]), times weights[route] (SCALE)
    rounded to out's dtype; 0 on padding rows (route -1).

    route = row_route[row]. Rows past the schedule's used rows (used_rows_ptr) are not written.
    """
    first = tl.program_id(0) * BLOCK_M
    used = tl.load(used_rows_ptr)
    if first >= used:
        return
    rows = first + tl.arange(0, BLOCK_M)
    in_use = rows < used
    route = tl.load(row_route_ptr + rows, mask=in_use, other=-1)
    valid = route >= 0
    if GATHER:
        src_rows = tl.where(valid, route // topk, 0).to(tl.int64)
    else:
        src_rows = rows.to(tl.int64)
    if SCALE:
        weight = tl.load(weights_ptr + route, mask=valid, other=0.0)
    cols = tl.arange(0, BLOCK_N)
    for c0 in range(0, N, BLOCK_N):
        col_mask = (c0 + cols) < N
        values = tl.load(src_ptr + src_rows[:, None] * stride_sm + (c0 + cols)[None, :],
                         mask=valid[:, None] & col_mask[None, :], other=0.0)
        if SCALE:
            values = values.to(tl.float32) * weight[:, None]
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + (c0 + cols)[None, :],
                 cast_to(values, out_ptr.dtype.element_ty, UPCAST),
                 mask=in_use[:, None] & col_mask[None, :])
