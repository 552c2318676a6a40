"""The launch plan of one layer call: the tiles of every GEMM, decided here and nowhere else.

The tiles come from the TileConfig (its measured table first, then its own tiles, see
mok.ops.tuning), at the problem's sizes, for how the rows of the phase move (mok.exchange.
Movement): a launch whose own programs pull rows takes the table's Triton tiles, since the Gluon
kernels cannot pull and wait at once. The launchers in mok.ops run the tiles they are given.

Legend: H hidden, I intermediate (of the routed or of the shared expert).
"""

from __future__ import annotations

from dataclasses import dataclass

from mok.exchange.base import Movement
from mok.ops import GemmTiles, TileConfig


@dataclass(frozen=True)
class ForwardPlan:
    """gate_up: the gate/up GEMM with SwiGLU (storing the pre-activations when kept); down."""

    gate_up: GemmTiles
    down: GemmTiles


@dataclass(frozen=True)
class BackwardPlan:
    """dswiglu: the backward's first launch (down's input gradient, then dSwiGLU); apart: instead
    of it, two launches (gate/up storing the pre-activations, then the kept dSwiGLU over them;
    GemmTiles.apart); d_x; the weight gradients."""

    dswiglu: GemmTiles
    apart: tuple[GemmTiles, GemmTiles] | None
    d_x: GemmTiles
    wgrad_gate_up: GemmTiles
    wgrad_down: GemmTiles

    @property
    def first_block_m(self) -> int:
        """Rows of a row block of the launch that reads the moved rows first."""
        return (self.apart[0] if self.apart is not None else self.dswiglu).block_m


def forward_plan(tiles: TileConfig, *, hidden: int, intermediate: int,
                 keep_gate_up: bool) -> ForwardPlan:
    """The forward's tiles; keep_gate_up: gate/up also stores its pre-activations (its tiles are
    the table's gate_up_saved ones)."""
    kind = "gate_up_saved" if keep_gate_up else "gate_up"
    return ForwardPlan(tiles.pick(kind, intermediate, hidden),
                       tiles.pick("down", hidden, intermediate))


def backward_plan(tiles: TileConfig, *, hidden: int, intermediate: int, kept: bool,
                  movement: Movement = Movement.HERE) -> BackwardPlan:
    """The backward's tiles; kept: the forward kept the pre-activations; movement: how the rows
    its first launch reads arrive."""
    kind = "down_bwd_saved" if kept else "down_bwd"
    pulling = movement is Movement.PULLED
    dswiglu = tiles.pick(kind, intermediate, hidden)
    apart = None
    if dswiglu.apart and not kept:
        apart = tiles.pick_apart(intermediate, hidden, pulling=pulling)
    elif pulling:
        dswiglu = tiles.pick(kind, intermediate, hidden, triton=True)
    return BackwardPlan(dswiglu, apart, tiles.pick("d_x", hidden, intermediate),
                        tiles.pick("wgrad_gate_up", intermediate, hidden),
                        tiles.pick("wgrad_down", hidden, intermediate))
