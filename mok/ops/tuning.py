"""Tile shapes of the grouped GEMMs: fixed per device and problem shape, never tuned at run time.

A fixed choice per shape keeps results bitwise reproducible from one process to the next (a
run-time autotuner may pick another tile, and so another reduction order). `TileConfig.pick`
looks the problem up in the table measured by `python -m benchmarks.tune` (mok/ops/
tuned_tiles.json, or the file MOK_TILES_FILE names) and falls back to the config's own tiles.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import torch

from mok import _env

TUNED_TILES_PATH = Path(__file__).with_name("tuned_tiles.json")

# GEMM kinds and what their (n, k) key means. wgrad kinds: out [E, P, Q] keyed by (P, Q).
KINDS = {
    "gate_up": "n = I, k = H",
    "gate_up_saved": "n = I, k = H",
    "down": "n = H, k = I",
    "down_bwd": "n = I, k = H",
    "down_bwd_saved": "n = I, k = H",
    "d_x": "n = H, k = I",
    "wgrad_gate_up": "P = I, Q = H",
    "wgrad_down": "P = H, Q = I",
}


@dataclass(frozen=True)
class GemmTiles:
    """One GEMM's tile: block_m rows x block_n columns, block_k deep (wgrad: P x Q, R deep)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    persistent: bool = False  # one program per SM, a grid-stride loop of tiles
    tma: bool = False  # gate_up, down, down_bwd(_saved), d_x: weight tiles through TMA
    pair: bool = False  # wgrad_gate_up only: gate and up in one launch, x's tiles loaded once
    # gate_up, down, down_bwd(_saved), d_x: the row tiles read or written whole (not gathered by
    # token, not scattered to other ranks) through TMA: the epilogues' outputs, the kept
    # pre-activations, and the A operands of down and d_x.
    tma_rows: bool = False
    # wgrad only: torch._grouped_mm (one K-split group per expert) over the rows copied into
    # schedule order (mok.ops.copy_rows); the tile fields are unused then.
    grouped_mm: bool = False
    # gate_up, down, down_bwd(_saved), d_x: the epilogue takes the output tile in this many
    # column slices (1 or 2), one after the other: fewer live registers, half-width TMA boxes.
    epilogue_split: int = 1
    # gate_up, down, down_bwd(_saved), d_x with persistent: the tile loop and the K loop
    # flattened into one, so the next tile's loads start during this tile's last K blocks and
    # epilogue (a launch that pulls rows takes its tiles from a counter and ignores it).
    flatten: bool = False
    # gate_up, gate_up_saved, down, down_bwd, down_bwd_saved and d_x on an sm_90 GPU: a
    # warp-specialized Gluon kernel (one program per SM, a loader partition filling a ring of
    # num_stages stages, wgmma and the epilogue in the other; mok.kernels.gluon_gate_up and
    # mok.kernels.gluon_dswiglu: token rows gathered by cp.async, weight tiles by TMA;
    # mok.kernels.gluon_rows: every tile by TMA) with this tile's block_m (64 or 128), block_n
    # (at most 128 for gate/up, whose wgmma takes gate and up at once, and for down_bwd_saved;
    # 64 for down_bwd, whose three accumulators must fit the registers; else 256), block_k,
    # num_stages (d_x: K steps of both products, two ring stages each, as its Triton kernel's
    # stages hold both), group_m and (down, down_bwd(_saved), d_x) epilogue_split, 2 where a
    # whole-tile epilogue buffer would not fit (and for down_bwd_saved at block_n 128, whose
    # whole-tile epilogue would spill registers) (num_warps unused: block_m // 16 warps
    # multiply, the loader has its own; persistent implied). Elsewhere (no sm_90 GPU, a launch
    # that pulls or scatters rows, operands TMA cannot take, block_n above those limits,
    # down_bwd_saved reading h rather than writing it) the Triton kernel runs these tiles;
    # launches that pull or scatter rows ask the table for its Triton tiles (TileConfig.pick's
    # triton), except gate/up's, whose rows a launch of their own pulls before the Gluon kernel.
    gluon: bool = False
    # down_bwd and down_bwd_saved with gluon, block_m 64: two MMA partitions (a warpgroup each,
    # epilogue buffers of their own) take the CTA's tiles in turn, one's epilogue running during
    # the other's K loop (mok.kernels.gluon_dswiglu's PINGPONG). Where the Triton kernel runs
    # these tiles it is ignored.
    pingpong: bool = False
    # down_bwd only: the recomputing dSwiGLU as two launches instead of one, gate/up storing the
    # pre-activations (the config's gate_up_saved tiles) into the d_gate_up buffer, then the kept
    # dSwiGLU over them in place (down_bwd_saved's tiles): where one launch's three accumulators
    # cost more than the second pass over the pre-activations (mok.ops.dswiglu_apart). The
    # other fields are unused then. Under expert parallelism with rows pulled by kernels, the
    # gate/up launch pulls them (x's and d_output's) on the table's Triton gate_up_saved tiles
    # and the kept dSwiGLU after it pulls nothing.
    apart: bool = False

    def __post_init__(self) -> None:
        if self.flatten and not self.persistent:
            raise ValueError("GemmTiles(flatten=True) needs persistent=True")
        if self.gluon and (self.block_m not in (64, 128) or self.block_n > 256
                           or self.block_k not in (32, 64)):
            raise ValueError(f"GemmTiles(gluon=True): block_m 64 or 128, block_n <= 256, block_k "
                             f"32 or 64; got {self.block_m}x{self.block_n}x{self.block_k}")
        if self.pingpong and self.block_m != 64:
            raise ValueError(f"GemmTiles(pingpong=True) needs block_m 64, got {self.block_m}")


@dataclass(frozen=True)
class TileConfig:
    """Tiles of every GEMM of the layer and the schedule's row alignment.

    align: each expert's rows are padded to a multiple of align; every block_m of the row GEMMs
    must divide it, so a row tile never straddles two experts.
    use_tuned: consult the measured table first (the GPU defaults do; test tiles don't).
    """

    align: int
    gate_up: GemmTiles
    down: GemmTiles
    down_bwd: GemmTiles
    d_x: GemmTiles
    wgrad: GemmTiles
    use_tuned: bool = False

    def __post_init__(self) -> None:
        for name in ("gate_up", "down", "down_bwd", "d_x"):
            _check_row_tiles(name, getattr(self, name), self.align)
        for name in ("gate_up", "down", "down_bwd", "d_x", "wgrad"):
            _check_dot_tiles(name, getattr(self, name))

    def pick(self, kind: str, n: int, k: int, triton: bool = False) -> GemmTiles:
        """Tiles for GEMM `kind` (see KINDS) at problem size (n, k). triton: for a launch the
        Gluon kernels cannot take (the expert-parallel dSwiGLU, whose tiles wait on rows its
        own programs pull): where the table's tiles are Gluon (or apart) ones, its best Triton
        tiles (TRITON)."""
        if self.use_tuned:
            table = tuned_table()
            tuned = table.get((kind, n, k))
            if triton and tuned is not None and (tuned.gluon or tuned.apart):
                tuned = table.get((kind + TRITON, n, k), tuned)
            if tuned is not None and (kind.startswith("wgrad") or self.align % tuned.block_m == 0):
                return tuned
        if kind.startswith("wgrad"):
            return self.wgrad
        return getattr(self, _FALLBACK_KINDS.get(kind, kind))

    def pick_apart(self, n: int, k: int, pulling: bool = False) -> tuple[GemmTiles, GemmTiles]:
        """The tiles of GemmTiles.apart's two launches at (n, k) = (I, H): gate/up storing the
        pre-activations (pulling: it pulls rows its tiles wait on, the table's Triton tiles),
        then the kept dSwiGLU."""
        return (self.pick("gate_up_saved", n, k, triton=pulling),
                self.pick("down_bwd_saved", n, k))


# The table's key suffix of a kind's best Triton tiles, kept where its best are Gluon ones
# (GemmTiles.gluon): the Triton kernel runs the launches the Gluon kernels cannot take, and the
# Gluon tiles need not suit it.
TRITON = "@triton"

# Kinds without tiles of their own in a TileConfig: down_bwd reading saved gate/up
# pre-activations is one accumulator over K = H, like the down projection; gate/up also storing
# its pre-activations (MoKConfig(recompute_gate_up=False)) is the gate/up GEMM.
_FALLBACK_KINDS = {"down_bwd_saved": "down", "gate_up_saved": "gate_up"}


def _check_row_tiles(name: str, tiles: GemmTiles, align: int) -> None:
    if align % tiles.block_m != 0:
        raise ValueError(f"{name}.block_m={tiles.block_m} must divide align={align}")
    if tiles.epilogue_split not in (1, 2):
        raise ValueError(f"{name}.epilogue_split={tiles.epilogue_split} must be 1 or 2")


def _check_dot_tiles(name: str, tiles: GemmTiles) -> None:
    if min(tiles.block_m, tiles.block_n, tiles.block_k) < 16:
        raise ValueError(f"{name}: tl.dot needs tiles of at least 16 in every dimension")


@cache
def tuned_table() -> dict[tuple[str, int, int], GemmTiles]:
    """{(kind, n, k): tiles} from the tuned-tiles JSON ({kind: {"n,k": {tile fields}}})."""
    path = Path(_env.TILES_FILE) if _env.TILES_FILE else TUNED_TILES_PATH
    if not path.exists():
        return {}
    table = {}
    for kind, entries in json.loads(path.read_text()).items():
        for key, fields in entries.items():
            n, k = (int(v) for v in key.split(","))
            table[(kind, n, k)] = GemmTiles(**fields)
    return table


def table_to_json(table: dict[tuple[str, int, int], GemmTiles]) -> str:
    out: dict[str, dict[str, dict]] = {}
    for (kind, n, k), tiles in sorted(table.items()):
        out.setdefault(kind, {})[f"{n},{k}"] = asdict(tiles)
    return json.dumps(out, indent=1, sort_keys=True) + "\n"


def _uniform(block: int, align: int) -> TileConfig:
    tiles = GemmTiles(block, block, block, group_m=4, num_warps=4, num_stages=1)
    return TileConfig(align, tiles, tiles, tiles, tiles, tiles)


# Hopper (H100/H200), bf16: the fallback when the table has no entry. Two or three fp32
# accumulators in gate/up and its backward keep block_n at 64 there, so they fit the registers.
HOPPER_TILES = TileConfig(
    align=128,
    gate_up=GemmTiles(128, 64, 64, group_m=8, num_warps=8, num_stages=4),
    down=GemmTiles(128, 128, 64, group_m=8, num_warps=8, num_stages=4),
    down_bwd=GemmTiles(128, 64, 64, group_m=8, num_warps=8, num_stages=3),
    d_x=GemmTiles(128, 128, 64, group_m=8, num_warps=8, num_stages=3),
    wgrad=GemmTiles(128, 128, 64, group_m=1, num_warps=8, num_stages=3),
    use_tuned=True,
)

# Triton's CPU interpreter: one program is one numpy step, so fewer, larger tiles run faster.
INTERPRETER_TILES = _uniform(32, 32)


def small_tiles(block: int = 16, align: int | None = None) -> TileConfig:
    """Uniform tiles for tests (more tiles, more masking); align defaults to block."""
    return _uniform(block, align or block)


def default_tiles(device: torch.device) -> TileConfig:
    return HOPPER_TILES if device.type == "cuda" else INTERPRETER_TILES
