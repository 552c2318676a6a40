"""Launchers of the layer's row GEMMs on float8_e4m3fn operands with blockwise scales
(mok.kernels.fp8_gemm): the forward's gate/up with SwiGLU and down; the backward's gate/up
pre-activations, dSwiGLU and d_x."""

from __future__ import annotations

import functools
import math
import weakref
from typing import NamedTuple

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from triton.experimental.gluon import language as gl

from mok import _env
from mok.arch import HOPPER, arch_of
from mok.errors import MoKInputError
from mok.kernels import fp8_gemm as kernels
from mok.kernels import gluon_fp8
from mok.ops import graphs
from mok.ops.checks import FLOATS, check_out_dtype, check_row_tiles, check_tokens
from mok.ops.comm import ScatterRows
from mok.ops.experts import _gluon_descriptor as _descriptor
from mok.ops.experts import _num_programs, _nvmma_layout, _scatter_args
from mok.ops.launch import cdiv, launch
from mok.ops.quantize import QUANT_BLOCK, Quantized, quantize_weights, quantize_weights_into
from mok.ops.routing import Routing, check_router_weights
from mok.ops.tuning import RowTiles, fp8_tiles

E4M3 = torch.float8_e4m3fn

FP8_TILES = fp8_tiles("gate_up", 128)  # the launchers' default: 64 x 128 x 128


class Fp8Experts(NamedTuple):
    """The expert weights in e4m3 as the FP8 launchers read them: gate, up [E, I, H] and down
    [E, H, I] for the forward; down_t [E, I, H] (w_down transposed) and gate_up_t [E, H, 2I']
    (w_gate and w_up transposed, side by side; I' is I rounded up to a multiple of 128, up's
    columns from I', zero codes between) for the backward's input gradients."""

    gate: Quantized
    up: Quantized
    down: Quantized
    down_t: Quantized
    gate_up_t: Quantized


def padded_width(inter: int) -> int:
    """I rounded up to a multiple of 128: where up's half starts in the backward's e4m3
    d_gate_up and gate_up_t, so that no scale block holds columns of both halves."""
    return cdiv(inter, QUANT_BLOCK) * QUANT_BLOCK


def quantize_experts(w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *,
                     pow2_scales: bool = False) -> Fp8Experts:
    """Fp8Experts of bf16 (or fp16, fp32) w_gate, w_up [E, I, H] and w_down [E, H, I], each
    matrix with a scale per 128 x 128 block (mok.ops.quantize_weights). A block's transpose has
    the same amax, so the transposed copies are the e4m3 codes and scales transposed: what
    quantizing the transposed weights gives, bit for bit (gate_up_t: gate's, then up's from
    column padded_width(I))."""
    if w_gate.shape != w_up.shape or w_down.shape != (*w_gate.shape[:1], *w_gate.shape[:0:-1]):
        raise MoKInputError(f"w_gate, w_up [E, I, H] and w_down [E, H, I] do not match: "
                            f"{tuple(w_gate.shape)}, {tuple(w_up.shape)}, {tuple(w_down.shape)}")
    with torch.autocast(w_gate.device.type, enabled=False):  # autocast cannot cat e4m3
        return _quantize_experts(w_gate, w_up, w_down, pow2_scales)


def _quantize_experts(w_gate, w_up, w_down, pow2_scales: bool) -> Fp8Experts:
    # Each launch writes its weight's transposed copy too (gate's and up's side by side).
    num, inter, hidden = w_gate.shape
    padded = padded_width(inter)
    blocks_i, blocks_h = padded // QUANT_BLOCK, cdiv(hidden, QUANT_BLOCK)
    device = w_gate.device
    empty = torch.empty if padded == inter else torch.zeros  # zero codes between the halves
    gate_up_t = Quantized(empty(num, hidden, 2 * padded, dtype=E4M3, device=device),
                          torch.empty(num, blocks_h, 2 * blocks_i, dtype=torch.float32,
                                      device=device))
    down_t = Quantized(torch.empty(num, inter, hidden, dtype=E4M3, device=device),
                       torch.empty(num, blocks_i, blocks_h, dtype=torch.float32, device=device))
    gate = quantize_weights_into(w_gate, Quantized(gate_up_t.data[..., :inter],
                                                   gate_up_t.scales[..., :blocks_i]),
                                 pow2_scales=pow2_scales)
    up = quantize_weights_into(w_up, Quantized(gate_up_t.data[..., padded:padded + inter],
                                               gate_up_t.scales[..., blocks_i:]),
                               pow2_scales=pow2_scales)
    down = quantize_weights_into(w_down, down_t, pow2_scales=pow2_scales)
    return Fp8Experts(gate, up, down, down_t, gate_up_t)


class _CacheEntry(NamedTuple):
    # the weights' storages: the entry lives while each does and is theirs (a weak reference to
    # a storage, not to the tensor, which would keep torch.utils.swap_tensors from swapping it)
    storages: tuple[weakref.ref, ...]
    versions: tuple[int, ...]
    experts: Fp8Experts


_CACHE: dict[tuple, _CacheEntry] = {}
_STEP_HOOK = None  # clears the cache after every torch.optim step, registered with the first entry


def cached_quantize_experts(w_gate: torch.Tensor, w_up: torch.Tensor,
                            w_down: torch.Tensor | None) -> Fp8Experts:
    """quantize_experts of these weights, reused while none of them was written: an entry per
    weight memory (address, shape, strides, dtype; views of one weight share their base's
    entries), valid while the same storages hold the weights, their version counters (bumped
    by in-place writes) are those it was made at and no torch.optim optimizer has stepped since
    (a step post hook clears the cache: fused optimizers write without bumping the counters).
    An entry is dropped with its weights' storages; its e4m3 copies take as many bytes as its
    weights (and gate_up_t's padding). Writes neither the counters nor an optimizer step
    announce (through `.data`, torch.distributed collectives, another process or another
    library's kernels) need `clear_fp8_cache`.
    While a CUDA graph is being captured only entries made in the same capture serve, so the
    graph quantizes the weights it reads once (a step's forward quantizes, its backward reuses
    that copy) and each replay quantizes them afresh; those entries serve nothing after the
    capture and go when the next capture makes one. Where the driver does not name the capture
    (mok.ops.graphs), every call in it quantizes afresh. Weights a capture quantized are
    quantized afresh by every eager call after it (the graph's replays may have written them,
    an optimizer step in the graph too, without a version bump or a step hook). w_down None:
    gate and up only, from a valid entry with any down weight, else quantized afresh (the other
    fields None)."""
    weights = (w_gate, w_up, w_down) if w_down is not None else (w_gate, w_up)
    tag = _capture_tag(w_gate)
    memories = tuple(_memory(w) for w in weights)
    storages = tuple(w.untyped_storage() for w in weights)
    if tag is not None:  # any capture, named or not
        for memory, storage in zip(memories, storages, strict=True):
            _GRAPHED[memory] = weakref.ref(storage, functools.partial(_drop_graphed, memory))
    # Never cached: inference tensors (no version counter), weights a CUDA graph quantizes in an
    # eager call (its replays may write them, optimizer steps included, and bump no counter).
    graphed = any(memory in _GRAPHED and _GRAPHED[memory]() is storage
                  for memory, storage in zip(memories, storages, strict=True))
    cached = (tag is not _UNNAMED and not any(w.is_inference() for w in weights)
              and (tag is not None or not graphed))
    if cached:
        key = (tag, *memories)
        versions = tuple(w._version for w in weights)
        exact = _CACHE.get(key)  # gate, up and down: one entry; gate and up: any with them
        for entry_key, entry in [(key, exact)] if exact is not None else _CACHE.items():
            if (entry_key[:len(key)] == key and entry.versions[:len(key) - 1] == versions
                    and all(ref() is storage
                            for ref, storage in zip(entry.storages, storages, strict=False))):
                return entry.experts
    if w_down is None:
        gate, up = (quantize_weights(w) for w in weights)
        return Fp8Experts(gate, up, None, None, None)
    experts = quantize_experts(*weights)
    if cached:
        _watch_optimizer_steps()
        if tag is not None:  # an earlier capture's entries serve no more
            for old in [k for k in _CACHE if k[0] is not None and k[0] != tag]:
                del _CACHE[old]
        refs = tuple(weakref.ref(storage, functools.partial(_drop, key)) for storage in storages)
        _CACHE[key] = _CacheEntry(refs, versions, experts)
    return experts


_UNNAMED = object()  # the tag of a capture the driver does not name: nothing is cached in it
# The weights a CUDA-graph capture quantized: their storages by memory, while they live.
_GRAPHED: dict[tuple, weakref.ref] = {}


def _capture_tag(w: torch.Tensor) -> object:
    """The cache's tag for calls on w now: None outside a CUDA-graph capture; in one, the
    capture's id (mok.ops.graphs), or _UNNAMED."""
    if not (w.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    ident = graphs.capture_id()
    return ("capture", ident) if ident is not None else _UNNAMED


def _drop_graphed(memory: tuple, dead: weakref.ref) -> None:
    if _GRAPHED.get(memory) is dead:
        del _GRAPHED[memory]


def _drop(key: tuple, dead: weakref.ref) -> None:
    """A weight storage of the entry at key was freed: drop the entry if it is still the one
    that storage belonged to."""
    entry = _CACHE.get(key)
    if entry is not None and any(ref is dead for ref in entry.storages):
        del _CACHE[key]


def _watch_optimizer_steps() -> None:
    global _STEP_HOOK
    if _STEP_HOOK is None:
        _STEP_HOOK = register_optimizer_step_post_hook(
            lambda optimizer, args, kwargs: clear_fp8_cache())


def clear_fp8_cache() -> None:
    """Drop every cached e4m3 weight copy (cached_quantize_experts)."""
    _CACHE.clear()


def _memory(w: torch.Tensor) -> tuple:
    return w.data_ptr(), tuple(w.shape), w.stride(), w.dtype, w.device


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
    gate_up: torch.Tensor | None = None,
) -> Quantized | torch.Tensor:
    """h [C, I] = swiglu(x[token] @ w_gate[e]^T, x[token] @ w_up[e]^T) of each schedule row,
    0 on padding rows: e4m3 with a scale per 1 x 128 block (quantize_h), else in out_dtype.
    x: [T, H] rows (mok.ops.quantize_rows); w_gate, w_up: [E, I, H] (mok.ops.quantize_weights).
    gate_up [C, 2I]: the pre-activations are also stored there, as gate_up_fp8 stores them."""
    inter = _gate_up_operands(x, w_gate, w_up, routing)
    _check_tiles(tiles, routing, quantize_out=quantize_h)
    if not quantize_h:
        check_out_dtype(out_dtype)
    if gate_up is not None:
        _check_gate_up(gate_up, routing, inter)
    rows = routing.capacity_rows
    device = x.data.device
    if quantize_h:
        out = torch.empty(rows, inter, dtype=E4M3, device=device)
        out_scales = torch.empty(rows, cdiv(inter, QUANT_BLOCK), dtype=torch.float32,
                                 device=device)
    else:
        out = torch.empty(rows, inter, dtype=out_dtype, device=device)
        out_scales = out
    if tiles.gluon and rows > 0:
        _gate_up_gluon(x, w_gate, w_up, routing, tiles, swiglu_limit, h=out,
                       h_scales=out_scales if quantize_h else None, gate_up=gate_up)
    else:
        _launch(x, w_gate, w_up, out, out_scales, routing, tiles, None, swiglu_limit,
                gather=True, epilogue="swiglu", quantize_out=quantize_h, gate_up=gate_up)
    return Quantized(out, out_scales) if quantize_h else out


def gate_up_fp8(
    x: Quantized,
    w_gate: Quantized,
    w_up: Quantized,
    routing: Routing,
    tiles: RowTiles = FP8_TILES,
    swiglu_limit: float | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The pre-activations gate_up [C, 2I] (gate, then up) of gate_up_swiglu_fp8's products, in
    out_dtype, 0 on padding rows; with a limit a clamped value as +-inf, as the forward that
    keeps them stores it (the backward's dswiglu_fp8 reads them)."""
    inter = _gate_up_operands(x, w_gate, w_up, routing)
    _check_tiles(tiles, routing, quantize_out=False)
    check_out_dtype(out_dtype)
    out = torch.empty(routing.capacity_rows, 2 * inter, dtype=out_dtype, device=x.data.device)
    if tiles.gluon and routing.capacity_rows > 0:
        _gate_up_gluon(x, w_gate, w_up, routing, tiles, swiglu_limit, h=None, h_scales=None,
                       gate_up=out)
    else:
        _launch(x, w_gate, w_up, out, out, routing, tiles, None, swiglu_limit, gather=True,
                epilogue="gate_up", quantize_out=False)
    return out


def dswiglu_fp8(
    d_output: Quantized,
    w_down_t: Quantized,
    gate_up: torch.Tensor,
    routing: Routing,
    tiles: RowTiles = FP8_TILES,
    router_weights: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    *,
    apart: bool = False,
    in_place: bool = True,
) -> tuple[Quantized, torch.Tensor, torch.Tensor | None]:
    """The backward's first GEMM on e4m3 operands and the dSwiGLU after it: dh0 = d_output[token]
    @ w_down[e] (w_down_t [E, I, H], the transposed w_down quantized), d_h = router weight * dh0,
    (d_gate, d_up) from the kept pre-activations gate_up [C, 2I] (gate_up_fp8's). Returns
    (d_gate_up in e4m3 [C, 2I'] with 1 x 128 scales [C, 2I' / 128], I' = padded_width(I): d_up
    from column I', zero codes between; h [C, I] in gate_up's dtype; the router-weight
    gradient's partial sums [C, I' / 128] fp32 or None without router_weights); with in_place
    d_gate_up also replaces gate_up, in its dtype ([C, 2I]), else gate_up is left as it was.
    apart (Gluon tiles always run so): two launches, the GEMM (tiles) into an fp32 dh0 [C, I],
    then the dSwiGLU over it. The same results (on a GPU the partial sums up to their order over
    each 128 columns)."""
    _, hidden = _rows_operand(d_output, "d_output")
    check_tokens(d_output.data, "d_output", routing.num_tokens)
    _, inter, _ = _weights_operand(w_down_t, "w_down_t", hidden, routing)
    _check_gate_up(gate_up, routing, inter)
    check_router_weights(router_weights, routing, fp32=True)
    # apart, the GEMM writes fp32 dh0 and the second launch quantizes: any width the GEMM takes
    _check_tiles(tiles, routing, quantize_out=not (apart or tiles.gluon))
    device = gate_up.device
    rows, blocks = routing.capacity_rows, cdiv(inter, QUANT_BLOCK)
    out = torch.empty(rows, 2 * padded_width(inter), dtype=E4M3, device=device)
    out_scales = torch.empty(rows, 2 * blocks, dtype=torch.float32, device=device)
    h = torch.empty(rows, inter, dtype=gate_up.dtype, device=device)
    partial = (torch.empty(rows, blocks, dtype=torch.float32, device=device)
               if router_weights is not None else None)
    if apart or tiles.gluon:
        dh0 = torch.empty(rows, inter, dtype=torch.float32, device=device)
        if tiles.gluon and rows > 0:
            _gather_gluon(d_output, w_down_t, dh0, routing, tiles)
        else:
            _launch(d_output, w_down_t, None, dh0, dh0, routing, tiles, None, None, gather=True,
                    epilogue="plain", quantize_out=False)
        _dswiglu_rows(dh0, gate_up, routing, router_weights, swiglu_limit, out, out_scales, h,
                      partial, in_place)
    else:
        _launch(d_output, w_down_t, None, out, out_scales, routing, tiles, router_weights,
                swiglu_limit, gather=True, epilogue="dswiglu", quantize_out=True,
                gate_up=gate_up, h=h, partial=partial, in_place=in_place)
    return Quantized(out, out_scales), h, partial


def d_x_rows_fp8(
    d_gate_up: Quantized,
    w_gate_up_t: Quantized,
    routing: Routing,
    tiles: RowTiles = FP8_TILES,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    scatter: ScatterRows | None = None,
) -> torch.Tensor:
    """rows [C, H] = d_gate_up[r] @ w_gate_up_t[e]^T in out_dtype: d_gate @ w_gate[e] + d_up @
    w_up[e] as one GEMM over K = 2I', with d_gate_up [C, 2I'] in e4m3 (dswiglu_fp8's) and
    w_gate_up_t [E, H, 2I'] the transposed gate and up weights side by side, quantized
    (quantize_experts'; I' = padded_width(I)).
    scatter: each row goes to its token's rank's buffer instead (returns scatter.out)."""
    return _schedule_rows_gemm(d_gate_up, "d_gate_up", w_gate_up_t, "w_gate_up_t", routing,
                               tiles, None, out_dtype, scatter)


def down_proj_fp8(
    h: Quantized,
    w_down: Quantized,
    routing: Routing,
    tiles: RowTiles = FP8_TILES,
    router_weights: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    scatter: ScatterRows | None = None,
) -> torch.Tensor:
    """rows [C, H] = router_weights[route] * h[r] @ w_down[e]^T in out_dtype (without
    router_weights [T * k] fp32, unweighted), 0 on padding rows. h: [C, I] e4m3 rows
    (gate_up_swiglu_fp8's); w_down: [E, H, I] (mok.ops.quantize_weights). scatter: each row
    goes to its token's rank's buffer instead (returns scatter.out)."""
    return _schedule_rows_gemm(h, "h", w_down, "w_down", routing, tiles, router_weights,
                               out_dtype, scatter)


def _schedule_rows_gemm(a: Quantized, a_name: str, w: Quantized, w_name: str,
                        routing: Routing, tiles: RowTiles, router_weights, out_dtype,
                        scatter: ScatterRows | None):
    """rows [C, N] = (router weight *) a[r] @ w[e]^T over the schedule's rows a [C, K] (with
    scatter, into scatter.out on the rows' tokens' ranks; the Triton kernel)."""
    capacity, width = _rows_operand(a, a_name)
    if capacity != routing.capacity_rows:
        raise MoKInputError(f"{a_name} has {capacity} rows, the schedule "
                            f"{routing.capacity_rows}")
    _, n, _ = _weights_operand(w, w_name, width, routing)
    check_out_dtype(out_dtype)
    check_router_weights(router_weights, routing, fp32=True)
    _check_tiles(tiles, routing, quantize_out=False)
    if scatter is None:
        out = torch.empty(capacity, n, dtype=out_dtype, device=a.data.device)
    else:
        out = scatter.out
        if out.dtype != out_dtype or out.shape[1] != n or out.stride(1) != 1:
            raise MoKInputError(f"the scatter's buffer must be [*, {n}] {out_dtype} with unit "
                                f"column stride, got {tuple(out.shape)} {out.dtype}")
        if tiles.gluon:
            raise ValueError(_NOT_TAKEN)
    if tiles.gluon and capacity > 0 and n > 0:
        _rows_gluon(a, w, out, routing, tiles, router_weights)
    else:
        _launch(a, w, None, out, out, routing, tiles, router_weights, None, gather=False,
                epilogue="plain", quantize_out=False, scatter=scatter)
    return out


def gluon_takes_fp8(kind: str, a: Quantized, w: Quantized, out_dtype: torch.dtype,
                    tiles: RowTiles) -> bool:
    """Whether the Gluon FP8 kernel of `kind` (mok.kernels.gluon_fp8, FP8_GLUON_KINDS) can run
    a[r or token] @ w[e]^T into out_dtype with these tiles: an sm_90 GPU, operands TMA and
    16-byte copies can read (aligned starts and row strides, experts back to back), outputs
    in an e4m3 or 16- or 32-bit dtype, K steps of 128 and _GLUON_TILES' (columns, rows)."""
    data, experts, rows = a.data, w.data, w.data.shape[1]
    gathered = kind in ("gate_up", "gate_up_saved", "down_bwd_saved")
    return (data.is_cuda and arch_of(data.device).warp_specialized
            and out_dtype in _GLUON_OUT and tiles.block_k == QUANT_BLOCK
            and (tiles.block_n, tiles.block_m) in _GLUON_TILES[kind]
            and data.stride(0) % 16 == 0 and data.data_ptr() % 16 == 0
            and (not gathered or data.shape[1] % 16 == 0)
            and experts.stride(1) % 16 == 0 and experts.data_ptr() % 16 == 0
            and experts.stride(0) == rows * experts.stride(1))


def gluon_takes_fp8_rows(a: Quantized, w: Quantized, out_dtype: torch.dtype,
                         tiles: RowTiles) -> bool:
    """gluon_takes_fp8 of the row GEMMs (down, d_x)."""
    return gluon_takes_fp8("down", a, w, out_dtype, tiles)


# The (block_n, block_m) each Gluon FP8 kernel takes: 256 columns are two products of 128 a K
# step (down, d_x and the dSwiGLU's GEMM apart).
_GLUON_TILES = {"gate_up": {(128, 128)}, "gate_up_saved": {(128, 128)},
                "down_bwd_saved": {(128, 128), (256, 128)},
                **dict.fromkeys(("down", "d_x"), {(64, 64), (64, 128), (128, 64), (128, 128),
                                                  (256, 128)})}
_GLUON_OUT = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32,
              E4M3: gl.float8e4nv}
_GLUON_LOAD_REGS = 24  # the row GEMMs' loader: one warp issuing TMA copies
_GLUON_GATHER_WARPS = 4  # gate/up's loader: x's rows by cp.async, the weights by TMA
_GLUON_GATHER_REGS = 64
# The second MMA partition's registers (the first takes what is left), with 256 columns too:
# three accumulators of 64 registers fit (more for it leaves the first fewer with a gathering
# loader).
_GLUON_MMA_REGS = 224
_SMEM = HOPPER.shared_memory - 1024  # a program's shared memory, less the barriers'
_NOT_TAKEN = ("the tiles ask for the Gluon FP8 kernel (RowTiles.gluon), which does not take "
              "this launch (GPU, layout or tiles); mok.plan gives Gluon tiles only where it does")


def _fitted_stages(tiles: RowTiles, b_rows: int, epilogue: int) -> int:
    """The Gluon ring's stages within a program's shared memory beside `epilogue` bytes of
    output buffers: each stage an A box and b_rows weight rows; at most tiles.num_stages."""
    stage = (tiles.block_m + b_rows) * tiles.block_k
    return min(tiles.num_stages, (_SMEM - epilogue) // stage)


def _rows_gluon(a: Quantized, w: Quantized, out: torch.Tensor, routing: Routing,
                tiles: RowTiles, router_weights: torch.Tensor | None) -> None:
    """The schedule's row GEMM by the warp-specialized Gluon kernel (mok.kernels.gluon_fp8)."""
    if not gluon_takes_fp8_rows(a, w, out.dtype, tiles):
        raise ValueError(_NOT_TAKEN)
    experts, n, k = w.data.shape
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    # the MMA partitions' output buffers: their rows, at most 128 columns; at 256 columns a
    # second one each where it costs no stage, so that a tile's two stores do not queue
    box = bm * min(bn, 128) * out.element_size()
    stages = _fitted_stages(tiles, bn, box)
    copies = 2 if bn > 128 and _fitted_stages(tiles, bn, 2 * box) == stages else 1
    launch(gluon_fp8.fp8_rows_ws_kernel, (_num_programs(out.device),))(
        a_desc=_descriptor(a.data, [bm, bk], gl.float8e4nv),
        w_desc=_descriptor(w.data.view(experts * n, k), [bn, bk], gl.float8e4nv),
        out_desc=_descriptor(out, [64, min(bn, 128)], _GLUON_OUT[out.dtype]),
        a_scale_ptr=a.scales, w_scale_ptr=w.scales,
        router_weights_ptr=router_weights if router_weights is not None else a.scales,
        row_route_ptr=routing.row_route, block_expert_ptr=routing.block_expert,
        used_rows_ptr=routing.used_rows, N=n, K=k, stride_as=a.scales.stride(0),
        stride_wse=w.scales.stride(0), stride_wsn=w.scales.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=tiles.group_m, ALIGN=routing.align,
        NUM_STAGES=stages, LOAD_REGS=_GLUON_LOAD_REGS, MMA_REGS=_GLUON_MMA_REGS,
        HAS_WEIGHT=router_weights is not None, OUT_COPIES=copies, num_warps=4,
    )


def _gate_up_operands(x: Quantized, w_gate: Quantized, w_up: Quantized, routing: Routing) -> int:
    """I, after checking x [T, H] and the two weights [E, I, H] alike."""
    _, hidden = _rows_operand(x, "x")
    check_tokens(x.data, "x", routing.num_tokens)
    experts, inter, _ = _weights_operand(w_gate, "w_gate", hidden, routing)
    if _weights_operand(w_up, "w_up", hidden, routing) != (experts, inter, hidden):
        raise MoKInputError(f"w_up's shape {tuple(w_up.data.shape)} differs from w_gate's "
                            f"{tuple(w_gate.data.shape)}")
    if (w_up.data.stride() != w_gate.data.stride()
            or w_up.scales.stride() != w_gate.scales.stride()):
        raise MoKInputError("w_up and its scales must be laid out as w_gate's")
    return inter


def _check_gate_up(gate_up: torch.Tensor, routing: Routing, inter: int) -> None:
    if (gate_up.shape != (routing.capacity_rows, 2 * inter) or gate_up.stride(1) != 1
            or gate_up.dtype not in FLOATS):
        raise MoKInputError(f"gate_up must be [{routing.capacity_rows}, {2 * inter}] of a "
                            f"16- or 32-bit float with unit column stride, got "
                            f"{tuple(gate_up.shape)} {gate_up.dtype}")


def _rows_operand(rows: Quantized, name: str) -> tuple[int, int]:
    data, scales = rows
    if data.dtype != E4M3 or scales.dtype != torch.float32:
        raise MoKInputError(f"{name} must be float8_e4m3fn rows with fp32 scales "
                            f"(mok.ops.quantize_rows), got {data.dtype} and {scales.dtype}")
    count, width = data.shape
    if scales.shape != (count, cdiv(width, QUANT_BLOCK)):
        raise MoKInputError(f"{name}'s scales must be [{count}, {cdiv(width, QUANT_BLOCK)}]"
                            f" (one per 1 x {QUANT_BLOCK} block), got {tuple(scales.shape)}")
    if data.stride(1) != 1 or scales.stride(1) != 1:
        raise MoKInputError(f"{name} and its scales need unit column strides")
    return count, width


def _weights_operand(w: Quantized, name: str, k: int, routing: Routing) -> tuple[int, int, int]:
    data, scales = w
    if data.dtype != E4M3 or scales.dtype != torch.float32 or data.dim() != 3:
        raise MoKInputError(f"{name} must be [E, N, K] float8_e4m3fn weights with fp32 scales "
                            f"(mok.ops.quantize_weights)")
    experts, n, width = data.shape
    if experts != routing.num_local_experts:
        raise MoKInputError(f"{name} holds {experts} experts, the schedule "
                            f"{routing.num_local_experts} local ones")
    if width != k:
        raise MoKInputError(f"{name} is [E, N, {width}], the rows it multiplies are {k} wide")
    blocks = (experts, cdiv(n, QUANT_BLOCK), cdiv(k, QUANT_BLOCK))
    if scales.shape != blocks:
        raise MoKInputError(f"{name}'s scales must be {list(blocks)} (one per {QUANT_BLOCK} x "
                            f"{QUANT_BLOCK} block), got {tuple(scales.shape)}")
    if data.stride(2) != 1 or scales.stride(2) != 1:
        raise MoKInputError(f"{name} and its scales need a unit stride along K")
    return experts, n, width


def _check_tiles(tiles: RowTiles, routing: Routing, *, quantize_out: bool) -> None:
    if tiles.block_k != QUANT_BLOCK or (QUANT_BLOCK % tiles.block_n
                                        and tiles.block_n % QUANT_BLOCK):
        raise ValueError(f"FP8 tiles take K steps of {QUANT_BLOCK} (the scales' block) and "
                         f"columns dividing it or a multiple of it, got {tiles}")
    if quantize_out and tiles.block_n != QUANT_BLOCK:
        raise ValueError(f"an e4m3 output with 1 x {QUANT_BLOCK} scales needs block_n "
                         f"{QUANT_BLOCK}, got {tiles.block_n}")
    check_row_tiles(tiles.block_m, routing.align)


def _launch(a, w, w2, out, out_scales, routing, tiles, router_weights, swiglu_limit, *,
            gather, epilogue, quantize_out, gate_up=None, h=None, partial=None, scatter=None,
            in_place=True):
    rows = routing.capacity_rows
    n = w.data.shape[1]
    if rows == 0 or n == 0:
        return
    num_m_blocks = rows // tiles.block_m
    second = w2 if w2 is not None else w
    keep_gate_up = epilogue == "swiglu" and gate_up is not None
    gate_up = gate_up if gate_up is not None else out
    h = h if h is not None else out
    partial = partial if partial is not None else out_scales
    scatter_args = _scatter_args(scatter, out)
    launch(kernels.fp8_rows_kernel, (num_m_blocks * cdiv(n, tiles.block_n),))(
        a.data, a.scales, w.data, w.scales, second.data, second.scales, out, out_scales,
        routing.row_route, routing.block_expert, routing.used_rows,
        router_weights if router_weights is not None else a.scales, gate_up, h, partial,
        scatter_args["dest_route_ptr"], scatter_args["out_delta_ptr"],
        n, a.data.shape[1], routing.topk, num_m_blocks,
        swiglu_limit if swiglu_limit is not None else 0.0, scatter_args["routes_per_rank"],
        a.data.stride(0), a.scales.stride(0), w.data.stride(0), w.data.stride(1),
        w.scales.stride(0), w.scales.stride(1), out.stride(0), out_scales.stride(0),
        gate_up.stride(0), h.stride(0), partial.stride(0),
        GATHER=gather, EPILOGUE=epilogue, HAS_LIMIT=swiglu_limit is not None,
        WEIGHTED=router_weights is not None, QUANTIZE_OUT=quantize_out,
        KEEP_GATE_UP=keep_gate_up, IN_PLACE=in_place, SCATTER=scatter_args["SCATTER"],
        ROW_ALIGN=scatter_args["ROW_ALIGN"], ALIGN=routing.align,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m, UPCAST=_env.INTERPRET, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


# The dSwiGLU run apart: a program's [rows, 128] block and its warps (8 values a thread, 64
# registers on sm_90); whether a row block's column blocks are next to each other in the grid
# (9-10% faster on an H100 at qwen3-30b-a3b and kimi-ep64-slice, 2026-12-07).
_DSWIGLU_ROWS = 16
_DSWIGLU_WARPS = 8
_DSWIGLU_COLUMNS_FIRST = True


def _dswiglu_rows(dh0: torch.Tensor, gate_up: torch.Tensor, routing: Routing,
                  router_weights: torch.Tensor | None, swiglu_limit: float | None,
                  out: torch.Tensor, out_scales: torch.Tensor, h: torch.Tensor,
                  partial: torch.Tensor | None, in_place: bool) -> None:
    """The dSwiGLU over dh0 computed apart (mok.kernels.fp8_gemm.fp8_dswiglu_rows_kernel)."""
    rows, inter = dh0.shape
    if rows == 0 or inter == 0:
        return
    weighted = router_weights is not None
    partial = partial if weighted else out_scales
    block = math.gcd(_DSWIGLU_ROWS, routing.align)  # blocks within the schedule's rows
    launch(kernels.fp8_dswiglu_rows_kernel, (rows // block * cdiv(inter, QUANT_BLOCK),))(
        dh0, out, out_scales, routing.row_route, routing.used_rows,
        router_weights if weighted else out_scales, gate_up, h, partial, inter, routing.topk,
        swiglu_limit if swiglu_limit is not None else 0.0, dh0.stride(0), out.stride(0),
        out_scales.stride(0), gate_up.stride(0), h.stride(0), partial.stride(0),
        HAS_LIMIT=swiglu_limit is not None, WEIGHTED=weighted, IN_PLACE=in_place,
        BLOCK_M=block, COLUMNS_FIRST=_DSWIGLU_COLUMNS_FIRST, UPCAST=_env.INTERPRET,
        num_warps=_DSWIGLU_WARPS,
    )


def _gather_gluon(a: Quantized, w: Quantized, out: torch.Tensor, routing: Routing,
                  tiles: RowTiles) -> None:
    """out [C, N] = a[token(r)] @ w[e]^T by the warp-specialized Gluon kernel
    (mok.kernels.gluon_fp8.fp8_gather_ws_kernel)."""
    if not gluon_takes_fp8("down_bwd_saved", a, w, out.dtype, tiles):
        raise ValueError(_NOT_TAKEN)
    experts, n, k = w.data.shape
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    stages = _fitted_stages(tiles, bn, 2 * 64 * min(bn, 128) * out.element_size())
    launch(gluon_fp8.fp8_gather_ws_kernel, (_num_programs(out.device),))(
        a_ptr=a.data, w_desc=_descriptor(w.data.view(experts * n, k), [bn, bk], gl.float8e4nv),
        out_desc=_descriptor(out, [64, min(bn, 128)], _GLUON_OUT[out.dtype]),
        a_scale_ptr=a.scales,
        w_scale_ptr=w.scales, row_route_ptr=routing.row_route,
        block_expert_ptr=routing.block_expert, used_rows_ptr=routing.used_rows, N=n, K=k,
        topk=routing.topk, stride_am=a.data.stride(0), stride_as=a.scales.stride(0),
        stride_wse=w.scales.stride(0), stride_wsn=w.scales.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=tiles.group_m, ALIGN=routing.align,
        NUM_STAGES=stages, LOAD_WARPS=_GLUON_GATHER_WARPS, LOAD_REGS=_GLUON_GATHER_REGS,
        MMA_REGS=_GLUON_MMA_REGS,
        A_LAYOUT=_nvmma_layout((bm, bk), gl.float8e4nv),
        num_warps=4,
    )


def _gate_up_gluon(x: Quantized, w_gate: Quantized, w_up: Quantized, routing: Routing,
                   tiles: RowTiles, swiglu_limit: float | None, *, h: torch.Tensor | None,
                   h_scales: torch.Tensor | None, gate_up: torch.Tensor | None) -> None:
    """gate/up by the warp-specialized Gluon kernel (mok.kernels.gluon_fp8): h (e4m3 with
    h_scales, or unquantized; None: the pre-activations alone) and the pre-activations into
    gate_up (or None)."""
    kind = "gate_up" if h is not None else "gate_up_saved"
    out_dtype = h.dtype if h is not None else gate_up.dtype
    if not gluon_takes_fp8(kind, x, w_gate, out_dtype, tiles) or (
            gate_up is not None and gate_up.dtype not in _GLUON_OUT):
        raise ValueError(_NOT_TAKEN)
    experts, n, k = w_gate.data.shape
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    kept = gate_up is not None
    gate_desc = up_desc = None
    if kept:
        gate_desc, up_desc = (_descriptor(half, [64, bn], _GLUON_OUT[gate_up.dtype])
                              for half in (gate_up[:, :n], gate_up[:, n:]))
    h_desc = _descriptor(h, [64, bn], _GLUON_OUT[h.dtype]) if h is not None else gate_desc
    # the epilogue's buffers: two of each output
    stages = _fitted_stages(tiles, 2 * bn, 2 * 64 * bn * (
        (h.element_size() if h is not None else 0) + (gate_up.element_size() if kept else 0)))
    w_view = [experts * n, k]
    launch(gluon_fp8.fp8_gate_up_ws_kernel, (_num_programs(x.data.device),))(
        x_ptr=x.data,
        w_gate_desc=_descriptor(w_gate.data.view(w_view), [bn, bk], gl.float8e4nv),
        w_up_desc=_descriptor(w_up.data.view(w_view), [bn, bk], gl.float8e4nv),
        h_desc=h_desc, gate_desc=gate_desc if kept else h_desc,
        up_desc=up_desc if kept else h_desc, x_scale_ptr=x.scales,
        w_gate_scale_ptr=w_gate.scales, w_up_scale_ptr=w_up.scales,
        h_scale_ptr=h_scales if h_scales is not None else x.scales,
        row_route_ptr=routing.row_route, block_expert_ptr=routing.block_expert,
        used_rows_ptr=routing.used_rows, N=n, K=k, topk=routing.topk,
        swiglu_limit=swiglu_limit if swiglu_limit is not None else 0.0,
        stride_xm=x.data.stride(0), stride_xs=x.scales.stride(0),
        stride_wse=w_gate.scales.stride(0), stride_wsn=w_gate.scales.stride(1),
        stride_hs=h_scales.stride(0) if h_scales is not None else 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=tiles.group_m, ALIGN=routing.align,
        NUM_STAGES=stages, LOAD_WARPS=_GLUON_GATHER_WARPS, LOAD_REGS=_GLUON_GATHER_REGS,
        MMA_REGS=_GLUON_MMA_REGS, A_LAYOUT=_nvmma_layout((bm, bk), gl.float8e4nv),
        HAS_LIMIT=swiglu_limit is not None, SWIGLU=h is not None, PARTIAL_N=n % bn != 0,
        QUANTIZE_H=h_scales is not None, SAVE_GATE_UP=kept, num_warps=4,
    )
