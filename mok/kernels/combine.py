"""Combine kernels: per-token sums over the token's routes in a fixed order (no atomics)."""

import triton
import triton.language as tl

from mok.kernels.common import cast_to


@triton.jit
def combine_kernel(
    rows_ptr, route_row_ptr, shared_ptr, out_ptr,
    num_tokens, N, topk,
    stride_rm, stride_sm, stride_om,
    HAS_SHARED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """out[t] = shared[t] + sum_{j < topk} rows[route_row[t * topk + j]], in fp32, in that order.

    Routes whose row is -1 (not scheduled) add nothing.
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
    for slot in range(0, topk):
        row = tl.load(route_row_ptr + tokens64 * topk + slot, mask=token_mask, other=-1)
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
