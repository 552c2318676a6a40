"""The launch plan of one layer call: which kernel runs every GEMM, on which tiles, decided here
and nowhere else.

The tiles come from the TileConfig (its measured table for the GPU's architecture and the dtype
first, then its own tiles, see mok.ops.tuning), at the problem's sizes, for how the rows of the
phase move (mok.exchange.Movement): a launch whose own programs pull rows takes the table's
Triton tiles, since the Gluon kernels cannot pull and wait at once. Where tiles ask for a
kernel that cannot take the launch (a Gluon kernel off sm_90 or on operands it cannot read,
torch._grouped_mm on a dtype it does not take), the plan hands the launchers the same tiles for
the Triton kernel and records the fallback (`fallbacks`, logged once). The launchers in mok.ops
run the kernel and tiles they are given.

Legend: H hidden, I intermediate (of the routed or of the shared expert).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from mok import _env
from mok.arch import arch_of
from mok.exchange.base import Movement
from mok.ops import DswigluTiles, RowTiles, TileConfig, WgradTiles, fp8_tiles
from mok.ops.experts import (
    gluon_reads_rows,
    gluon_reads_weights,
    gluon_takes,
    gluon_takes_wgrad,
    grouped_mm_takes,
)
from mok.ops.tuning import FP8_KINDS, FP8_WGRAD_GLUON_TILES, FP8_WGRAD_TILES


@dataclass(frozen=True)
class Operands:
    """What the plan reads of a call's tensors (host-known facts, never device values): their
    device and dtype, and whether the Gluon kernels can read each of them (mok.ops.experts.
    gluon_reads_rows, gluon_reads_weights): the token rows x and d_output (the backward's; rows
    that move arrive in buffers of mok's own) and the expert weights gate, up and down; the
    number of experts."""

    device: torch.device
    dtype: torch.dtype
    x: bool
    d_output: bool
    gate: bool
    up: bool
    down: bool
    experts: int = 1

    @classmethod
    def of(cls, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
           down: torch.Tensor | None, *, d_output: torch.Tensor | None = None,
           moved: bool = False) -> Operands:
        """The facts of token rows x and d_output (None in the forward; moved: both reach the
        experts in the exchange's buffers) and of the weights (down None: not read)."""
        rows = [moved or gluon_reads_rows(t) for t in (x, d_output if d_output is not None else x)]
        return cls(x.device, x.dtype, *rows,
                   *(w is not None and gluon_reads_weights(x.dtype, w) for w in (gate, up, down)),
                   experts=gate.shape[0])


@dataclass(frozen=True)
class ForwardPlan:
    """gate_up: the gate/up GEMM with SwiGLU (storing the pre-activations when kept); down."""

    gate_up: RowTiles
    down: RowTiles


@dataclass(frozen=True)
class BackwardPlan:
    """dswiglu: the backward's first launch (down's input gradient, then dSwiGLU); apart: instead
    of it, two launches (gate/up storing the pre-activations, then the kept dSwiGLU over them;
    DswigluTiles.apart); d_x; the weight gradients."""

    dswiglu: DswigluTiles
    apart: tuple[RowTiles, DswigluTiles] | None
    d_x: RowTiles
    wgrad_gate_up: WgradTiles
    wgrad_down: WgradTiles

    @property
    def first_block_m(self) -> int:
        """Rows of a row block of the launch that reads the moved rows first."""
        return (self.apart[0] if self.apart is not None else self.dswiglu).block_m


def forward_plan(tiles: TileConfig, operands: Operands, *, hidden: int, intermediate: int,
                 keep_gate_up: bool) -> ForwardPlan:
    """The forward's kernels and tiles; keep_gate_up: gate/up also stores its pre-activations
    (its tiles are the table's gate_up_saved ones). Remembered per arguments (`_remembered`)."""
    return _remembered(_forward_plan, tiles, operands, hidden, intermediate, keep_gate_up)


def _forward_plan(tiles: TileConfig, operands: Operands, hidden: int, intermediate: int,
                  keep_gate_up: bool) -> ForwardPlan:
    kind = "gate_up_saved" if keep_gate_up else "gate_up"
    sizes = dict(hidden=hidden, intermediate=intermediate)
    pick = _picker(tiles, operands.dtype, sizes)
    return ForwardPlan(
        _kernel(kind, pick(kind), operands, operands.x and operands.gate and operands.up, **sizes),
        _kernel("down", pick("down"), operands, operands.down, **sizes))


def backward_plan(tiles: TileConfig, operands: Operands, *, hidden: int, intermediate: int,
                  kept: bool, movement: Movement = Movement.HERE) -> BackwardPlan:
    """The backward's kernels and tiles; kept: the forward kept the pre-activations (the context
    holds them, not h); movement: how the rows its first launch reads arrive. Remembered per
    arguments (`_remembered`)."""
    return _remembered(_backward_plan, tiles, operands, hidden, intermediate, kept, movement)


def _backward_plan(tiles: TileConfig, operands: Operands, hidden: int, intermediate: int,
                   kept: bool, movement: Movement) -> BackwardPlan:
    kind = "down_bwd_saved" if kept else "down_bwd"
    sizes = dict(hidden=hidden, intermediate=intermediate)
    pick = _picker(tiles, operands.dtype, sizes)
    pulling = movement is Movement.PULLED
    dswiglu = pick(kind)
    apart = None
    if dswiglu.apart and not kept:
        gate_up, kept_tiles = tiles.pick_apart(intermediate, hidden, dtype=operands.dtype,
                                               pulling=pulling)
        apart = (_kernel("gate_up_saved", gate_up, operands,
                         operands.x and operands.gate and operands.up, pulls=pulling, **sizes),
                 _kernel("down_bwd_saved", kept_tiles, operands,
                         operands.d_output and operands.down, **sizes))
    else:
        if pulling:
            dswiglu = pick(kind, triton=True)
        readable = operands.d_output and operands.down and (
            kept or (operands.x and operands.gate and operands.up))
        dswiglu = _kernel(kind, dswiglu, operands, readable, pulls=pulling, **sizes)
    return BackwardPlan(dswiglu, apart,
                        _kernel("d_x", pick("d_x"), operands, operands.gate and operands.up,
                                **sizes),
                        *_wgrads(pick, operands, tiles.align, sizes))


@dataclass(frozen=True)
class Fp8Plan:
    """MoKConfig(precision="fp8"): the tiles of its row GEMMs on e4m3 operands (mok.ops.fp8):
    gate_up (with SwiGLU), gate_up_saved (the pre-activations, the forward's when kept and the
    recomputing backward's), down, dswiglu, d_x; the weight gradients, in the inputs' dtype, as
    the 16-bit plan's; wgrad_fp8, those of the weight gradients on e4m3 operands
    (MoKConfig.fp8_weight_gradients); dswiglu_apart: the dSwiGLU as two launches (its GEMM
    into fp32 on the dswiglu tiles, then the dSwiGLU over it; mok.ops.dswiglu_fp8's apart)."""

    gate_up: RowTiles
    gate_up_saved: RowTiles
    down: RowTiles
    dswiglu: RowTiles
    d_x: RowTiles
    wgrad_gate_up: WgradTiles
    wgrad_down: WgradTiles
    wgrad_fp8: RowTiles = FP8_WGRAD_TILES
    dswiglu_apart: bool = False


def fp8_plan(tiles: TileConfig, operands: Operands, *, hidden: int, intermediate: int,
             scatter: bool = False) -> Fp8Plan:
    """The FP8 path's kernels and tiles (the row GEMMs' tiles fit the schedule's alignment):
    with MOK_FP8_GLUON (the default) the Gluon kernels where the GPU runs them (their operands
    are mok's own buffers and e4m3 weight copies, which they can read whenever H and I are
    multiples of 16); the dSwiGLU apart, its GEMM on the Gluon kernel, where that takes it
    (_FP8_DSWIGLU_APART), else in one launch of the Triton kernel; the FP8 weight gradients on
    the Gluon kernel where the alignment is a multiple of 128 and H and I are multiples of 64;
    scatter: down and d_x write their rows to other ranks (the Triton kernel's epilogue); down,
    d_x and the dSwiGLU's GEMM with Gluon tiles of 128 rows at 128 x 256 where _FP8_WIDE_ROWS
    (the default), the FP8 weight gradients' Gluon tiles at 128 x 256 where _FP8_WIDE_WGRAD (the
    default). Remembered per arguments and switches (`_remembered`)."""
    return _remembered(_fp8_plan, tiles, operands, hidden, intermediate, scatter,
                       _env.FP8_GLUON, _FP8_DSWIGLU_APART, _FP8_WIDE_ROWS, _FP8_WIDE_WGRAD)


def _fp8_plan(tiles: TileConfig, operands: Operands, hidden: int, intermediate: int,
              scatter: bool, gluon_on: bool, apart_on: bool, wide_on: bool,
              wide_wgrad_on: bool) -> Fp8Plan:
    sizes = dict(hidden=hidden, intermediate=intermediate)
    pick = _picker(tiles, operands.dtype, sizes)
    # TMA: e4m3 rows of H (x, d_output) and of I (h) in 16-byte multiples.
    gluon = (gluon_on and arch_of(operands.device).warp_specialized and hidden % 16 == 0
             and intermediate % 16 == 0)
    triton = ("down", "d_x") if scatter else ()
    if not apart_on:
        triton += ("down_bwd_saved",)
    made = Fp8Plan(*(fp8_tiles(kind, tiles.align, gluon=gluon and kind not in triton)
                     for kind in FP8_KINDS),
                   *_wgrads(pick, operands, tiles.align, sizes))
    if gluon and tiles.align % 128 == 0 and hidden % 64 == 0 and intermediate % 64 == 0:
        made = dataclasses.replace(made, wgrad_fp8=dataclasses.replace(
            FP8_WGRAD_GLUON_TILES, block_n=256 if wide_wgrad_on else 128))
    if wide_on:
        made = dataclasses.replace(made, **{
            field: dataclasses.replace(getattr(made, field), block_n=256, num_stages=3)
            for field in ("down", "dswiglu", "d_x")
            if getattr(made, field).gluon and getattr(made, field).block_m == 128})
    # the dSwiGLU's Gluon kernel in one launch ran slower than the Triton one (181 against 242
    # TFLOP/s at qwen3-30b-a3b; docs/measurements.md, 2026-12-05): Gluon tiles mean apart
    return dataclasses.replace(made, dswiglu_apart=made.dswiglu.gluon)


# The dSwiGLU on sm_90: apart (its GEMM on the Gluon kernel, then the dSwiGLU), or False: in one
# launch of the Triton kernel.
_FP8_DSWIGLU_APART = True
# down, d_x and the dSwiGLU's GEMM at 128 x 256 on the Gluon kernels, 3 stages (False: 128 x
# 128). On one H100 (docs/measurements.md, 2026-12-06 evening) the launches ran 1.0-1.3x faster
# at four shapes from K = 256 to 28672, the layer 1-9% faster at eight shapes of nine; 4 stages
# lost 10-27% at mixtral-8x7b's d_x.
_FP8_WIDE_ROWS = True
# The FP8 weight gradients' Gluon kernel at 128 x 256 (two wgmmas of 128 columns a K step;
# False: 128 x 128, 5 stages; the same bits). On one H100 (docs/measurements.md, 2026-12-07)
# 4-18% faster for both weight gradients at qwen3-30b-a3b and kimi-ep64-slice.
_FP8_WIDE_WGRAD = True


# Each kind's (n, k) as the tile table keys it (mok.ops.tuning.KINDS).
_KEYS = {"gate_up": ("intermediate", "hidden"), "gate_up_saved": ("intermediate", "hidden"),
         "down": ("hidden", "intermediate"), "down_bwd": ("intermediate", "hidden"),
         "down_bwd_saved": ("intermediate", "hidden"), "d_x": ("hidden", "intermediate"),
         "wgrad_gate_up": ("intermediate", "hidden"), "wgrad_down": ("hidden", "intermediate")}


def _picker(tiles: TileConfig, dtype: torch.dtype, sizes: dict):
    def pick(kind: str, triton: bool = False, experts: int | None = None):
        n, k = (sizes[name] for name in _KEYS[kind])
        return tiles.pick(kind, n, k, dtype=dtype, triton=triton, experts=experts)
    return pick


def _kernel(kind: str, tiles: RowTiles, operands: Operands, readable: bool, *,
            hidden: int, intermediate: int, pulls: bool = False) -> RowTiles:
    """tiles where the kernel they name takes the launch; else the same tiles for the Triton
    kernel. readable: the launch's operands can be read by the Gluon kernel; pulls: the launch's
    own programs pull rows its tiles wait on (the Triton kernel runs such a launch)."""
    if not tiles.gluon:
        return tiles
    if pulls:
        return dataclasses.replace(tiles, gluon=False)
    arch = arch_of(operands.device)
    if not arch.warp_specialized:
        reason = f"{arch.name} does not run the Gluon kernels"
    elif not (readable and gluon_takes(kind, tiles, hidden=hidden, intermediate=intermediate,
                                       dtype=operands.dtype)):
        reason = "operands the Gluon kernel cannot take (dtype, layout, alignment or sizes)"
    else:
        return tiles
    _fallback(kind, f"the Triton kernel runs its Gluon tiles: {reason}")
    return dataclasses.replace(tiles, gluon=False)


def _wgrad(kind: str, tiles: WgradTiles, operands: Operands, *, fallback: WgradTiles | None,
           hidden: int, intermediate: int, align: int) -> WgradTiles:
    """tiles where the kernel they ask for takes the launch; else another's: where the Gluon
    kernel does not take it, `fallback` (the config's tiles without Gluon: TileConfig.pick's
    triton), or when that is Gluon too, the Triton kernel at block_m 128 at most (gate and up
    paired); where torch._grouped_mm does not, the Triton kernel at the same tiles (the widths:
    d_gate_up's 2I and x's H; d_output's H and h's I)."""
    if tiles.gluon:
        arch = arch_of(operands.device)
        readable = operands.x if kind == "wgrad_gate_up" else operands.d_output
        if not arch.warp_specialized:
            reason = f"{arch.name} does not run the Gluon kernels"
        elif not (readable and gluon_takes_wgrad(kind, tiles, operands.dtype, operands.dtype,
                                                 hidden=hidden, intermediate=intermediate,
                                                 align=align)):
            reason = "operands the Gluon kernel cannot take (dtype, layout or sizes)"
        else:
            return tiles
        _fallback(kind, f"another kernel runs instead of the Gluon one: {reason}")
        if fallback is None or fallback.gluon:
            fallback = dataclasses.replace(tiles, gluon=False, pair=kind == "wgrad_gate_up",
                                           block_m=min(tiles.block_m, 128))
        return _wgrad(kind, fallback, operands, fallback=None, hidden=hidden,
                      intermediate=intermediate, align=align)
    if not tiles.grouped_mm:
        return tiles
    widths = (2 * intermediate, hidden) if kind == "wgrad_gate_up" else (hidden, intermediate)
    if grouped_mm_takes(operands.device, operands.dtype, *widths):
        return tiles
    _fallback(kind, f"the Triton kernel runs instead of torch._grouped_mm, which does not take "
                    f"{operands.dtype} on {arch_of(operands.device).name} at these sizes")
    return dataclasses.replace(tiles, grouped_mm=False)


def _wgrads(pick, operands: Operands, align: int, sizes: dict) -> tuple[WgradTiles, WgradTiles]:
    """The weight gradients' tiles (wgrad_gate_up, wgrad_down) where their kernels take them."""
    return tuple(_wgrad(kind, pick(kind, experts=operands.experts), operands,
                        fallback=pick(kind, triton=True), align=align, **sizes)
                 for kind in ("wgrad_gate_up", "wgrad_down"))


# Plans made, by (maker, id(tiles), the other arguments): (tiles, plan, the fallbacks it
# recorded). A plan depends on host facts only, and a layer makes the same ones every call.
_PLANS: dict[tuple, tuple] = {}
_PLANS_KEPT = 256


def _remembered(make, tiles: TileConfig, *args):
    """make(tiles, *args), made once per arguments (the TileConfig by identity) and then looked
    up; a plan looked up counts its fallbacks again, as a plan made anew would."""
    key = (make, id(tiles), *args)
    known = _PLANS.get(key)
    if known is not None and known[0] is tiles:
        for kind, reason in known[2]:
            _fallback(kind, reason)
        return known[1]
    before = dict(_FALLBACKS)
    made = make(tiles, *args)
    recorded = tuple(fallback for fallback, count in _FALLBACKS.items()
                     for _ in range(count - before.get(fallback, 0)))
    if len(_PLANS) >= _PLANS_KEPT:
        _PLANS.clear()
    _PLANS[key] = (tiles, made, recorded)
    return made


_LOG = logging.getLogger("mok")
_FALLBACKS: dict[tuple[str, str], int] = {}


def fallbacks() -> dict[tuple[str, str], int]:
    """{(GEMM kind, what ran instead and why): plans that fell back so} since the process
    started: every launch whose tiles asked for a kernel that could not take it (each case is
    also logged once)."""
    return dict(sorted(_FALLBACKS.items()))


def _fallback(kind: str, reason: str) -> None:
    key = (kind, reason)
    if key not in _FALLBACKS:
        _LOG.warning("mok: %s: %s", kind, reason)
    _FALLBACKS[key] = _FALLBACKS.get(key, 0) + 1
