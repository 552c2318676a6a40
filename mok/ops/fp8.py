"""Launchers of the forward's row GEMMs on float8_e4m3fn operands with blockwise scales
(mok.kernels.fp8_gemm): gate/up with SwiGLU, and down."""

from __future__ import annotations

import torch
import triton

from mok import _env
from mok.errors import MoKInputError
from mok.kernels import fp8_gemm as kernels
from mok.ops.quantize import QUANT_BLOCK, Quantized
from mok.ops.routing import Routing
from mok.ops.tuning import RowTiles

E4M3 = torch.float8_e4m3fn

# The Triton kernel's tiles: K steps of one scale block, 128 columns (h's scale block).
FP8_TILES = RowTiles(128, 128, QUANT_BLOCK, group_m=8, num_warps=8, num_stages=3)


def gate_up_swiglu_fp8(
    x: Quantized,
    w_gate: Quantized,
    w_up: Quantized,
    routing: Routing,
    tiles: RowTiles = FP8_TILES,
    swiglu_limit: float | None = None,
    *,
    quantize_h: bool = True,
    out_dtype: torch.dtype = torch.bfloat16,
) -> Quantized | torch.Tensor:
    """h [C, I] = swiglu(x[token] @ w_gate[e]^T, x[token] @ w_up[e]^T) of each schedule row,
    0 on padding rows: e4m3 with a scale per 1 x 128 block (quantize_h), else in out_dtype.
    x: [T, H] rows (mok.ops.quantize_rows); w_gate, w_up: [E, I, H] (mok.ops.quantize_weights)."""
    tokens, hidden = _rows_operand(x, "x")
    experts, inter, _ = _weights_operand(w_gate, "w_gate", hidden)
    if _weights_operand(w_up, "w_up", hidden) != (experts, inter, hidden):
        raise MoKInputError(f"w_up's shape {tuple(w_up.data.shape)} differs from w_gate's "
                            f"{tuple(w_gate.data.shape)}")
    if (w_up.data.stride() != w_gate.data.stride()
            or w_up.scales.stride() != w_gate.scales.stride()):
        raise MoKInputError("w_up and its scales must be laid out as w_gate's")
    _check_tiles(tiles, routing, quantize_out=quantize_h)
    rows = routing.capacity_rows
    device = x.data.device
    if quantize_h:
        out = torch.empty(rows, inter, dtype=E4M3, device=device)
        out_scales = torch.empty(rows, triton.cdiv(inter, QUANT_BLOCK), dtype=torch.float32,
                                 device=device)
    else:
        out = torch.empty(rows, inter, dtype=out_dtype, device=device)
        out_scales = out
    _launch(x, w_gate, w_up, out, out_scales, routing, tiles, None, swiglu_limit,
            gather=True, quantize_out=quantize_h)
    return Quantized(out, out_scales) if quantize_h else out


def down_proj_fp8(
    h: Quantized,
    w_down: Quantized,
    routing: Routing,
    tiles: RowTiles = FP8_TILES,
    router_weights: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """rows [C, H] = router_weights[route] * h[r] @ w_down[e]^T in out_dtype (without
    router_weights [T * k] fp32, unweighted), 0 on padding rows. h: [C, I] e4m3 rows
    (gate_up_swiglu_fp8's); w_down: [E, H, I] (mok.ops.quantize_weights)."""
    capacity, inter = _rows_operand(h, "h")
    if capacity != routing.capacity_rows:
        raise MoKInputError(f"h has {capacity} rows, the schedule {routing.capacity_rows}")
    _, hidden, _ = _weights_operand(w_down, "w_down", inter)
    if router_weights is not None and (router_weights.dtype != torch.float32
                                       or router_weights.numel() != routing.num_tokens
                                       * routing.topk):
        raise MoKInputError("router_weights must be fp32 with a weight per route (T * k)")
    _check_tiles(tiles, routing, quantize_out=False)
    out = torch.empty(capacity, hidden, dtype=out_dtype, device=h.data.device)
    _launch(h, w_down, None, out, out, routing, tiles, router_weights, None, gather=False,
            quantize_out=False)
    return out


def _rows_operand(rows: Quantized, name: str) -> tuple[int, int]:
    data, scales = rows
    if data.dtype != E4M3 or scales.dtype != torch.float32:
        raise MoKInputError(f"{name} must be float8_e4m3fn rows with fp32 scales "
                            f"(mok.ops.quantize_rows), got {data.dtype} and {scales.dtype}")
    count, width = data.shape
    if scales.shape != (count, triton.cdiv(width, QUANT_BLOCK)):
        raise MoKInputError(f"{name}'s scales must be [{count}, {triton.cdiv(width, QUANT_BLOCK)}]"
                            f" (one per 1 x {QUANT_BLOCK} block), got {tuple(scales.shape)}")
    if data.stride(1) != 1 or scales.stride(1) != 1:
        raise MoKInputError(f"{name} and its scales need unit column strides")
    return count, width


def _weights_operand(w: Quantized, name: str, k: int) -> tuple[int, int, int]:
    data, scales = w
    if data.dtype != E4M3 or scales.dtype != torch.float32 or data.dim() != 3:
        raise MoKInputError(f"{name} must be [E, N, K] float8_e4m3fn weights with fp32 scales "
                            f"(mok.ops.quantize_weights)")
    experts, n, width = data.shape
    if width != k:
        raise MoKInputError(f"{name} is [E, N, {width}], the rows it multiplies are {k} wide")
    blocks = (experts, triton.cdiv(n, QUANT_BLOCK), triton.cdiv(k, QUANT_BLOCK))
    if scales.shape != blocks:
        raise MoKInputError(f"{name}'s scales must be {list(blocks)} (one per {QUANT_BLOCK} x "
                            f"{QUANT_BLOCK} block), got {tuple(scales.shape)}")
    if data.stride(2) != 1 or scales.stride(2) != 1:
        raise MoKInputError(f"{name} and its scales need a unit stride along K")
    return experts, n, width


def _check_tiles(tiles: RowTiles, routing: Routing, *, quantize_out: bool) -> None:
    if tiles.block_k != QUANT_BLOCK or QUANT_BLOCK % tiles.block_n != 0:
        raise ValueError(f"FP8 tiles take K steps of {QUANT_BLOCK} (the scales' block) and at "
                         f"most {QUANT_BLOCK} columns dividing it, got {tiles}")
    if quantize_out and tiles.block_n != QUANT_BLOCK:
        raise ValueError(f"an e4m3 output with 1 x {QUANT_BLOCK} scales needs block_n "
                         f"{QUANT_BLOCK}, got {tiles.block_n}")
    if routing.align % tiles.block_m != 0:
        raise ValueError(f"block_m {tiles.block_m} must divide the schedule's alignment "
                         f"{routing.align}")


def _launch(a, w, w2, out, out_scales, routing, tiles, router_weights, swiglu_limit, *,
            gather, quantize_out):
    rows = routing.capacity_rows
    n = w.data.shape[1]
    if rows == 0 or n == 0:
        return
    num_m_blocks = rows // tiles.block_m
    second = w2 if w2 is not None else w
    kernels.fp8_rows_kernel[(num_m_blocks * triton.cdiv(n, tiles.block_n),)](
        a.data, a.scales, w.data, w.scales, second.data, second.scales, out, out_scales,
        routing.row_route, routing.block_expert, routing.used_rows,
        router_weights if router_weights is not None else a.scales,
        n, a.data.shape[1], routing.topk, num_m_blocks,
        swiglu_limit if swiglu_limit is not None else 0.0,
        a.data.stride(0), a.scales.stride(0), w.data.stride(0), w.data.stride(1),
        w.scales.stride(0), w.scales.stride(1), out.stride(0), out_scales.stride(0),
        GATHER=gather, SWIGLU=w2 is not None, HAS_LIMIT=swiglu_limit is not None,
        WEIGHTED=router_weights is not None, QUANTIZE_OUT=quantize_out, ALIGN=routing.align,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m, UPCAST=_env.INTERPRET, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
