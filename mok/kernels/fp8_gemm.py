"""Grouped float8_e4m3fn GEMMs over the schedule's rows with blockwise scales (DeepSeek's
recipe), in Triton: the forward's gate/up with SwiGLU and down, the backward's gate/up
pre-activations, dSwiGLU and d_x.

    out[r, n] = sum over K blocks b of (sum_{k in b} a[src(r), k] * w[e, n, k])
                * a_scale[src(r), b] * w_scale[e, n // 128, b]

a: the token rows (GATHER: src(r) = row_route[r] // topk) or the schedule's rows (src(r) = r),
e4m3 with a scale per 1 x 128 block (mok.ops.quantize_rows); w [E, N, K] e4m3 with a scale per
128 x 128 block (mok.ops.quantize_weights); e = block_expert[r // ALIGN]. BLOCK_K is the scales'
block (128), so each K step's product (e4m3 wgmma on Hopper, whose accumulator keeps fewer bits
than fp32) is scaled and added to an fp32 accumulator. BLOCK_N divides 128 (one weight scale a
tile and K step) or is a multiple of it (a scale per 128 columns). Padding rows (route -1) read
zeros and write zeros.

EPILOGUE:
- "plain": out = the product (down, d_x), with WEIGHTED scaled by the route's router weight;
  with SCATTER each row goes to the rank owning its token instead (mok.kernels.grouped_gemm's
  SCATTER: row dest_route[r] % routes_per_rank of out on rank dest_route[r] // routes_per_rank,
  at out + out_delta[rank]).
- "swiglu": a second weight (up) and its accumulator; out = swiglu(gate, up) (with HAS_LIMIT
  the pre-activations clamped first, mok.kernels.activation); with KEEP_GATE_UP the
  pre-activations also stored into gate_up [C, 2N], as "gate_up" stores them.
- "gate_up": the same two products stored as the pre-activations gate_up [C, 2N] (out; with
  HAS_LIMIT a clamped value as +-inf, activation.kept), for the backward's dSwiGLU.
- "dswiglu": the product is d_out[token] @ w_down[e] (w the transposed w_down [E, I, H]); the
  dSwiGLU over the kept pre-activations (see _dswiglu_epilogue). fp8_dswiglu_rows_kernel runs
  the same epilogue on that product computed apart ("plain" with GATHER into fp32).
QUANTIZE_OUT (BLOCK_N = 128): the output stored as e4m3 with a scale per row of the tile (a
1 x 128 block, mok.kernels.quantize's rule) into out_scale[r, n // 128]; else rounded to
out's dtype. A program per tile, GROUP_M row blocks at a time; every output element
is summed in one fixed order, so results are bitwise reproducible. UPCAST: under Triton's CPU
interpreter (mok.kernels.common).
"""

import triton
import triton.language as tl

from mok.kernels import activation
from mok.kernels.common import cast_to, from_e4m3
from mok.kernels.grouped_gemm import _store_rows, _tile_coords, _tile_rows
from mok.kernels.quantize import quantize_tile


@triton.jit
def _dot_e4m3(a, b, UPCAST: tl.constexpr):
    """a @ b in fp32 from e4m3 tiles (products of e4m3 values are exact in fp32)."""
    if UPCAST:
        return tl.dot(from_e4m3(a, UPCAST), from_e4m3(b, UPCAST))
    return tl.dot(a, b)


@triton.jit
def fp8_rows_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, w2_ptr, w2_scale_ptr, out_ptr, out_scale_ptr,
    row_route_ptr, block_expert_ptr, used_rows_ptr, router_weights_ptr, gate_up_ptr, h_ptr,
    partial_ptr, dest_route_ptr, out_delta_ptr, N, K, topk, num_m_blocks, swiglu_limit,
    routes_per_rank, stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn,
    stride_om, stride_osm, stride_gum, stride_hm, stride_pm,
    GATHER: tl.constexpr, EPILOGUE: tl.constexpr, HAS_LIMIT: tl.constexpr,
    WEIGHTED: tl.constexpr, QUANTIZE_OUT: tl.constexpr, KEEP_GATE_UP: tl.constexpr,
    IN_PLACE: tl.constexpr, SCATTER: tl.constexpr, ROW_ALIGN: tl.constexpr, ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile (see the module's docstring for the product and EPILOGUE)."""
    TWO: tl.constexpr = EPILOGUE == "swiglu" or EPILOGUE == "gate_up"
    pid_m, pid_n = _tile_coords(tl.program_id(0), num_m_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(used_rows_ptr):
        return
    expert = tl.load(block_expert_ptr + (pid_m * BLOCK_M) // ALIGN).to(tl.int64)
    rows, route, valid, token = _tile_rows(row_route_ptr, pid_m, topk, BLOCK_M)
    src = token if GATHER else rows
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + src[:, None] * stride_am + ks[None, :]
    a_scale_ptrs = a_scale_ptr + src * stride_asm
    w_offsets = expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    if BLOCK_N > 128:  # a weight scale per column block of 128: a row of them
        w_scale_offset = (expert * stride_wse
                          + (tl.minimum(cols, N - 1) // 128)[None, :].to(tl.int64) * stride_wsn)
    else:
        w_scale_offset = expert * stride_wse + ((pid_n * BLOCK_N) // 128) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = (kb * BLOCK_K + ks) < K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        a_scale = tl.load(a_scale_ptrs + kb, mask=valid, other=0.0)
        w_mask = k_mask[:, None] & (cols < N)[None, :]
        b = tl.load(w_ptr + w_offsets, mask=w_mask, other=0.0)
        acc += _dot_e4m3(a, b, UPCAST) * (a_scale[:, None]
                                           * tl.load(w_scale_ptr + w_scale_offset + kb))
        if TWO:
            b2 = tl.load(w2_ptr + w_offsets, mask=w_mask, other=0.0)
            acc2 += _dot_e4m3(a, b2, UPCAST) * (a_scale[:, None]
                                                 * tl.load(w2_scale_ptr + w_scale_offset + kb))
        a_ptrs += BLOCK_K
        w_offsets += BLOCK_K
    in_n = cols < N
    keep = valid[:, None] & in_n[None, :]
    if EPILOGUE == "gate_up":
        _store_gate_up(acc, acc2, out_ptr + rows[:, None] * stride_om + cols[None, :], keep,
                       in_n, N, swiglu_limit, HAS_LIMIT, UPCAST)
    elif EPILOGUE == "dswiglu":
        _dswiglu_epilogue(acc, rows, route, valid, keep, cols, in_n, pid_n, N, out_ptr,
                          out_scale_ptr, router_weights_ptr, gate_up_ptr, h_ptr, partial_ptr,
                          stride_om, stride_osm, stride_gum, stride_hm, stride_pm, swiglu_limit,
                          HAS_LIMIT, WEIGHTED, QUANTIZE_OUT, IN_PLACE, UPCAST)
    else:
        out = acc
        if EPILOGUE == "swiglu":
            if KEEP_GATE_UP:
                _store_gate_up(acc, acc2, gate_up_ptr + rows[:, None] * stride_gum
                               + cols[None, :], keep, in_n, N, swiglu_limit, HAS_LIMIT, UPCAST)
            out = activation.swiglu(acc, acc2, swiglu_limit, HAS_LIMIT)
        if WEIGHTED:
            out *= tl.load(router_weights_ptr + route, mask=valid, other=0.0)[:, None]
        out = tl.where(keep, out, 0.0)
        if QUANTIZE_OUT:
            _store_e4m3(out, out_ptr + rows[:, None] * stride_om + cols[None, :],
                        out_scale_ptr + rows * stride_osm + pid_n, in_n, UPCAST)
        else:
            _store_rows(out_ptr, rows, cols, N, out, stride_om, dest_route_ptr, out_delta_ptr,
                        routes_per_rank, SCATTER, ROW_ALIGN, UPCAST)


@triton.jit
def fp8_dswiglu_rows_kernel(
    dh0_ptr, out_ptr, out_scale_ptr, row_route_ptr, used_rows_ptr, router_weights_ptr,
    gate_up_ptr, h_ptr, partial_ptr, N, topk, swiglu_limit, stride_dm, stride_om, stride_osm,
    stride_gum, stride_hm, stride_pm,
    HAS_LIMIT: tl.constexpr, WEIGHTED: tl.constexpr, IN_PLACE: tl.constexpr,
    BLOCK_M: tl.constexpr, COLUMNS_FIRST: tl.constexpr, UPCAST: tl.constexpr,
):
    """The "dswiglu" epilogue of fp8_rows_kernel (QUANTIZE_OUT) on dh0 [C, N] fp32 read from
    memory: one [BLOCK_M, 128] block a program (grid: row blocks times N / 128, a row block's
    column blocks next to each other with COLUMNS_FIRST, else a column block's row blocks), the
    one launch's arithmetic (compiled, the partial sums' order over the 128 columns follows the
    block's layout, so they may differ from the one launch's in the last bits)."""
    pid = tl.program_id(0)
    column_blocks = tl.cdiv(N, 128)
    if COLUMNS_FIRST:
        pid_m, pid_n = pid // column_blocks, pid % column_blocks
    else:
        row_blocks = tl.num_programs(0) // column_blocks
        pid_m, pid_n = pid % row_blocks, pid // row_blocks
    if pid_m * BLOCK_M >= tl.load(used_rows_ptr):
        return
    rows, route, valid, _ = _tile_rows(row_route_ptr, pid_m, topk, BLOCK_M)
    cols = pid_n * 128 + tl.arange(0, 128)
    in_n = cols < N
    keep = valid[:, None] & in_n[None, :]
    dh0 = tl.load(dh0_ptr + rows[:, None] * stride_dm + cols[None, :], mask=keep, other=0.0)
    _dswiglu_epilogue(dh0, rows, route, valid, keep, cols, in_n, pid_n, N, out_ptr,
                      out_scale_ptr, router_weights_ptr, gate_up_ptr, h_ptr, partial_ptr,
                      stride_om, stride_osm, stride_gum, stride_hm, stride_pm, swiglu_limit,
                      HAS_LIMIT, WEIGHTED, True, IN_PLACE, UPCAST)


@triton.jit
def _store_gate_up(gate, up, ptrs, keep, in_n, N, swiglu_limit, HAS_LIMIT: tl.constexpr,
                   UPCAST: tl.constexpr):
    """The pre-activations [gate, up] of a tile at ptrs (up N columns after gate), as the
    forward that keeps them stores them (with HAS_LIMIT a clamped value as +-inf), 0 outside
    keep."""
    if HAS_LIMIT:
        gate, up = activation.kept(gate, up, swiglu_limit)
    dtype = ptrs.dtype.element_ty
    tl.store(ptrs, cast_to(tl.where(keep, gate, 0.0), dtype, UPCAST), mask=in_n[None, :])
    tl.store(ptrs + N, cast_to(tl.where(keep, up, 0.0), dtype, UPCAST), mask=in_n[None, :])


@triton.jit
def _store_e4m3(value, ptrs, scale_ptrs, in_n, UPCAST: tl.constexpr):
    """value [BLOCK_M, 128] as e4m3 at ptrs with a scale per row at scale_ptrs (a 1 x 128
    block, mok.kernels.quantize's rule)."""
    q, scale = quantize_tile(value, True, False, UPCAST)
    tl.store(ptrs, q, mask=in_n[None, :])
    tl.store(scale_ptrs, scale)


@triton.jit
def _dswiglu_epilogue(dh0, rows, route, valid, keep, cols, in_n, pid_n, N, out_ptr,
                      out_scale_ptr, router_weights_ptr, gate_up_ptr, h_ptr, partial_ptr,
                      stride_om, stride_osm, stride_gum, stride_hm, stride_pm, swiglu_limit,
                      HAS_LIMIT: tl.constexpr, WEIGHTED: tl.constexpr,
                      QUANTIZE_OUT: tl.constexpr, IN_PLACE: tl.constexpr, UPCAST: tl.constexpr):
    """dSwiGLU of dh0 = d_out[token] @ w_down[e] over the kept pre-activations gate_up [C, 2N]:
    with IN_PLACE d_gate_up in gate_up's dtype over them, and with QUANTIZE_OUT in e4m3 into
    out [C, 2N']
    (N' = N rounded up to a multiple of 128: d_up from column N', zero codes between; scales
    [C, 2N' / 128]: d_gate's blocks, then d_up's); h into h_ptr; with WEIGHTED, d_h
    scaled by the route's router weight and the router-weight gradient's partial sums
    sum_n dh0 * h into partial[r, pid_n]."""
    gu_ptrs = gate_up_ptr + rows[:, None] * stride_gum + cols[None, :]
    gate = tl.load(gu_ptrs, mask=keep, other=0.0).to(tl.float32)
    up = tl.load(gu_ptrs + N, mask=keep, other=0.0).to(tl.float32)
    if HAS_LIMIT:
        gate_pass, up_pass = activation.passes(gate, up, swiglu_limit, True)
        gate, up = activation.clamp(gate, up, swiglu_limit)
    sig, silu = activation.silu(gate)
    h = silu * up
    tl.store(h_ptr + rows[:, None] * stride_hm + cols[None, :],
             cast_to(h, h_ptr.dtype.element_ty, UPCAST), mask=in_n[None, :])
    d_h = dh0
    if WEIGHTED:
        tl.store(partial_ptr + rows * stride_pm + pid_n, tl.sum(dh0 * h, axis=1))
        d_h = dh0 * tl.load(router_weights_ptr + route, mask=valid, other=0.0)[:, None]
    d_gate, d_up = activation.dswiglu(d_h, gate, up, sig, silu)
    if HAS_LIMIT:
        d_gate = tl.where(gate_pass, d_gate, 0.0)
        d_up = tl.where(up_pass, d_up, 0.0)
    d_gate = tl.where(keep, d_gate, 0.0)
    d_up = tl.where(keep, d_up, 0.0)
    if IN_PLACE:
        tl.store(gu_ptrs, cast_to(d_gate, gate_up_ptr.dtype.element_ty, UPCAST),
                 mask=in_n[None, :])
        tl.store(gu_ptrs + N, cast_to(d_up, gate_up_ptr.dtype.element_ty, UPCAST),
                 mask=in_n[None, :])
    if QUANTIZE_OUT:  # a tile is one 128-column block: its columns past N store zero codes
        blocks = tl.cdiv(N, 128)
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
        scale_ptrs = out_scale_ptr + rows * stride_osm + pid_n
        in_block = cols < blocks * 128
        _store_e4m3(d_gate, out_ptrs, scale_ptrs, in_block, UPCAST)
        _store_e4m3(d_up, out_ptrs + blocks * 128, scale_ptrs + blocks, in_block, UPCAST)
