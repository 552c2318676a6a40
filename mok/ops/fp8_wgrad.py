"""Launchers of the weight gradients on float8_e4m3fn operands (mok.kernels.fp8_wgrad): each
operand quantized along the schedule's rows in blocks of 128 rows and one column, then one
grouped GEMM over the experts' rows."""

from __future__ import annotations

import math

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

from mok import _env
from mok.arch import arch_of
from mok.errors import MoKInputError
from mok.kernels import fp8_wgrad as kernels
from mok.kernels import gluon_fp8_wgrad, gluon_quantize
from mok.ops.checks import check_out_dtype, check_rows
from mok.ops.experts import _gluon_descriptor, _num_programs
from mok.ops.fp8 import _GLUON_LOAD_REGS, _GLUON_MMA_REGS, _SMEM, _rows_operand, padded_width
from mok.ops.launch import cdiv, launch
from mok.ops.quantize import QUANT_BLOCK, Quantized
from mok.ops.routing import Routing, check_router_weights
from mok.ops.tuning import FP8_WGRAD_TILES, RowTiles

E4M3 = torch.float8_e4m3fn
_QUANTIZE_COLUMNS = 64


def quantize_row_blocks(src: torch.Tensor | Quantized, routing: Routing, *, gather: bool,
                        router_weights: torch.Tensor | None = None,
                        halves: int | None = None) -> Quantized:
    """src's schedule rows in e4m3, quantized along the rows: (codes [N, C] transposed, each
    column's rows contiguous; scales [C // gcd(align, 128), N] fp32), a scale per column and
    block of 128 of an expert's rows (mok.kernels.fp8_wgrad). src [T, N] by token (gather: row
    r reads token row_route[r] // topk) or [C, N] by row, in a float dtype or as e4m3 codes
    with 1 x 128 scales (mok.ops.quantize_rows'; each value dequantized first);
    router_weights (a value per route, [T, k] or [T * k]): each row is first scaled by its
    route's weight. halves (codes only): src holds two halves of `halves` columns, the second
    from column padded_width(halves) on (mok.ops.dswiglu_fp8's d_gate_up); the result has
    2 * halves columns. Padding rows are zeros."""
    rows, topk = routing.capacity_rows, routing.topk
    codes_in = isinstance(src, Quantized)
    if codes_in:
        count, width = _rows_operand(src, "the rows to quantize")
        gap = 0
        if halves is not None:
            if width != 2 * padded_width(halves):
                raise MoKInputError(f"the rows to quantize must hold two halves of {halves} "
                                    f"columns {padded_width(halves)} apart, got {width}")
            width, gap = 2 * halves, padded_width(halves) - halves
        half = halves if halves is not None else width
        data, src_scales = src
    else:
        if halves is not None:
            raise ValueError("halves applies to e4m3 rows (a Quantized source)")
        check_rows(src, "the rows to quantize")
        count, width = src.shape
        data = src_scales = src
        half, gap = width, 0
    expected = routing.num_tokens if gather else rows
    if count != expected:
        raise MoKInputError(f"the rows to quantize must be [{expected}, N] "
                            f"({'by token' if gather else 'by schedule row'}), got "
                            f"{(count, width)}")
    check_router_weights(router_weights, routing)
    sub = _rows_per_slot(routing)
    codes = torch.empty(width, rows, dtype=E4M3, device=data.device)
    scales = torch.empty(rows // sub, width, dtype=torch.float32, device=data.device)
    if rows and width:
        grid = (rows // sub, cdiv(width, _QUANTIZE_COLUMNS))
        args = (data, codes, scales, routing.row_route, routing.block_expert,
                routing.expert_offsets, router_weights if router_weights is not None else scales,
                src_scales, width, half, gap, topk, routing.num_local_experts, data.stride(0),
                codes.stride(0), scales.stride(0), src_scales.stride(0))
        flags = dict(GATHER=gather, WEIGHTED=router_weights is not None, CODES=codes_in,
                     ALIGN=routing.align, SUB=sub, BLOCK_N=_QUANTIZE_COLUMNS)
        if gluon_takes_quantize_rows(data, halves):
            rows_t, cols_t, warps = _GLUON_QUANTIZE_THREADS
            by_row, by_col = gluon_quantize.tile_layouts(rows_t, cols_t, warps)
            launch(gluon_quantize.quantize_row_blocks_kernel, grid)(
                *args, **flags, BY_ROW=by_row, BY_COL=by_col, num_warps=warps)
        else:
            launch(kernels.quantize_row_blocks_kernel, grid)(
                *args, **flags, WHOLE=half % _QUANTIZE_COLUMNS == 0, UPCAST=_env.INTERPRET,
                num_warps=4)
    return Quantized(codes, scales)


def gluon_takes_quantize_rows(src: torch.Tensor, halves: int | None = None) -> bool:
    """Whether the Gluon kernel (mok.kernels.gluon_quantize) quantizes these rows: an sm_90
    GPU, with _GLUON_QUANTIZE on; e4m3 rows with _GLUON_QUANTIZE_CODES on too and, with
    halves, each half a multiple of the kernel's columns."""
    return (_GLUON_QUANTIZE and src.is_cuda and arch_of(src.device).warp_specialized
            and (src.dtype != E4M3 or (_GLUON_QUANTIZE_CODES and (
                halves is None or halves % _QUANTIZE_COLUMNS == 0))))


# The weight gradients' operands quantized by the Gluon kernel on sm_90 (False: the Triton
# kernel everywhere).
_GLUON_QUANTIZE = True
# e4m3 rows too: off until the Gluon kernel's e4m3 source has run on a GPU (its test against
# the Triton kernel, tests/gpu/test_fp8_gluon.py, is written; only compiled so far).
_GLUON_QUANTIZE_CODES = False
# The Gluon kernel's threads: (rows, columns) a thread, warps (gluon_quantize.tile_layouts).
_GLUON_QUANTIZE_THREADS = (8, 8, 4)


def _rows_per_slot(routing: Routing) -> int:
    """Rows per scale slot (mok.kernels.fp8_wgrad's SUB): gcd(align, 128), so that an expert
    of n rows (a multiple of align) has n / SUB >= ceil(n / 128) slots of its own."""
    return math.gcd(routing.align, QUANT_BLOCK)


def grouped_wgrad_fp8(
    a: torch.Tensor | Quantized,
    b: torch.Tensor | Quantized,
    routing: Routing,
    tiles: RowTiles = FP8_WGRAD_TILES,
    *,
    gather_a: bool,
    gather_b: bool,
    router_weights: torch.Tensor | None = None,
    out_dtype: torch.dtype,
    split: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """out [E, P, Q] = sum over expert e's rows of a[row, :P]^T b[row, :Q] on e4m3 operands
    (quantize_row_blocks of each, a's rows scaled by their route's router weight when given),
    fp32 sums, in out_dtype. a and b: by token (gather_*) or by schedule row, in a float dtype
    or as e4m3 rows with 1 x 128 scales. split: rows [0, split) of the gradient in one tensor
    and [split, P) in another (d_w_gate and d_w_up from [d_gate, d_up]; a in e4m3 then holds
    its halves as mok.ops.dswiglu_fp8's d_gate_up, quantize_row_blocks' halves)."""
    if tiles.block_k != QUANT_BLOCK:
        raise ValueError(f"the FP8 weight gradients take K steps of {QUANT_BLOCK} rows, got "
                         f"block_k={tiles.block_k}")
    halves = split if isinstance(a, Quantized) else None
    qa = quantize_row_blocks(a, routing, gather=gather_a, router_weights=router_weights,
                             halves=halves)
    qb = quantize_row_blocks(b, routing, gather=gather_b)
    return grouped_wgrad_fp8_quantized(qa, qb, routing, tiles, out_dtype=out_dtype, split=split)


def grouped_wgrad_fp8_quantized(
    qa: Quantized,
    qb: Quantized,
    routing: Routing,
    tiles: RowTiles = FP8_WGRAD_TILES,
    *,
    out_dtype: torch.dtype,
    split: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """grouped_wgrad_fp8 on operands quantize_row_blocks already gave."""
    check_out_dtype(out_dtype)
    (width_a, rows), (width_b, rows_b) = qa.data.shape, qb.data.shape
    if rows != routing.capacity_rows or rows_b != rows:
        raise MoKInputError(f"the quantized operands must hold the schedule's "
                            f"{routing.capacity_rows} rows, got {rows} and {rows_b}")
    num = routing.num_local_experts
    device = qa.data.device
    if split is None:
        outs = [torch.empty(num, width_a, width_b, dtype=out_dtype, device=device)]
    else:
        if not 0 < split < width_a:
            raise ValueError(f"split={split} must lie inside the gradient's {width_a} rows")
        outs = [torch.empty(num, split, width_b, dtype=out_dtype, device=device),
                torch.empty(num, width_a - split, width_b, dtype=out_dtype, device=device)]
    num_p, num_q = cdiv(width_a, tiles.block_m), cdiv(width_b, tiles.block_n)
    if tiles.gluon:
        if not gluon_takes_fp8_wgrad(qa, qb, routing, tiles, out_dtype, split):
            raise ValueError("the tiles ask for the Gluon FP8 weight-gradient kernel, which does "
                             "not take this launch (GPU, alignment, sizes or tiles)")
        if num and width_a and width_b:
            _wgrad_gluon(qa, qb, outs, routing, tiles, split if split is not None else width_a)
    elif num and width_a and width_b:
        launch(kernels.fp8_wgrad_kernel, (num * num_p * num_q,))(
            qa.data, qa.scales, qb.data, qb.scales, outs[0], outs[-1], routing.expert_offsets,
            width_a, width_b, split if split is not None else width_a, num, num_p, num_q,
            qa.data.stride(0), qa.scales.stride(0), qb.data.stride(0), qb.scales.stride(0),
            outs[0].stride(0), outs[-1].stride(0), outs[0].stride(1),
            SUB=_rows_per_slot(routing), BLOCK_P=tiles.block_m, BLOCK_Q=tiles.block_n,
            UPCAST=_env.INTERPRET, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
    return outs[0] if split is None else (outs[0], outs[1])


def gluon_takes_fp8_wgrad(qa: Quantized, qb: Quantized, routing: Routing, tiles: RowTiles,
                          out_dtype: torch.dtype, split: int | None) -> bool:
    """Whether the Gluon kernel (mok.kernels.gluon_fp8_wgrad) runs this weight gradient: an
    sm_90 GPU, the schedule's alignment a multiple of 128 (whole blocks of rows per expert),
    128-row tiles, the gradient's rows on each side of the split multiples of 64, 64, 128 or 256
    columns, an output TMA can store (16-bit or fp32 rows of 16-byte multiples), scales TMA
    can load (contiguous, rows of 16-byte multiples)."""
    width_a, width_b = qa.data.shape[0], qb.data.shape[0]
    cut = split if split is not None else width_a
    return (qa.data.is_cuda and arch_of(qa.data.device).warp_specialized
            and routing.align % QUANT_BLOCK == 0 and tiles.block_k == QUANT_BLOCK
            and tiles.block_m == 128 and tiles.block_n in (64, 128, 256)
            and cut % 64 == 0 and (width_a - cut) % 64 == 0
            and out_dtype in _GLUON_OUT and (width_b * out_dtype.itemsize) % 16 == 0
            and all(q.scales.is_contiguous() and q.scales.stride(0) % 4 == 0 for q in (qa, qb)))


_GLUON_OUT = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


def _wgrad_gluon(qa: Quantized, qb: Quantized, outs: list[torch.Tensor], routing: Routing,
                 tiles: RowTiles, split: int) -> None:
    """grouped_wgrad_fp8_quantized by the warp-specialized Gluon kernel."""
    (width_a, _), width_b = qa.data.shape, qb.data.shape[0]
    num = routing.num_local_experts
    bp, bq = tiles.block_m, tiles.block_n
    out_dtype = _GLUON_OUT[outs[0].dtype]
    views = [out.view(-1, width_b) for out in outs]
    box = min(bq, 128)  # the output's boxes: a 256-column tile stores two
    epilogue = 2 * 64 * box * outs[0].element_size()  # each MMA partition's output buffer
    stage = (bp + bq) * (QUANT_BLOCK + 4)  # the codes' boxes and their fp32 scales
    stages = min(tiles.num_stages, (_SMEM - epilogue) // stage)
    launch(gluon_fp8_wgrad.fp8_wgrad_ws_kernel, (_num_programs(qa.data.device),))(
        a_desc=_gluon_descriptor(qa.data, [bp, QUANT_BLOCK], gl.float8e4nv),
        b_desc=_gluon_descriptor(qb.data, [bq, QUANT_BLOCK], gl.float8e4nv),
        a_scale_desc=_scale_descriptor(qa.scales, bp),
        b_scale_desc=_scale_descriptor(qb.scales, bq),
        out_desc=_gluon_descriptor(views[0], [64, box], out_dtype),
        out2_desc=_gluon_descriptor(views[-1], [64, box], out_dtype),
        expert_offsets_ptr=routing.expert_offsets, num_experts=num, num_p=cdiv(width_a, bp),
        num_q=cdiv(width_b, bq), P=width_a, SPLIT=split, stride_as=qa.scales.stride(0),
        stride_bs=qb.scales.stride(0), BLOCK_P=bp, BLOCK_Q=bq, NUM_STAGES=stages,
        LOAD_REGS=_GLUON_LOAD_REGS, MMA_REGS=_WIDE_MMA_REGS if bq > 128 else _GLUON_MMA_REGS,
        PARTIAL_P=split % bp != 0 or width_a % bp != 0, num_warps=4,
    )


# The second MMA partition's registers at 256 columns: two accumulators, the scratch one and a
# half's column scales (224 left 56-72 bytes of stack, sm90_compile; 240 none).
_WIDE_MMA_REGS = 240
_SCALE_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


def _scale_descriptor(scales: torch.Tensor, box: int) -> GluonDescriptor:
    """A TMA descriptor of scales [slots, N] fp32 (contiguous) flattened, with [box] boxes."""
    return GluonDescriptor.from_tensor(scales.view(-1), [box], _SCALE_LAYOUT)
