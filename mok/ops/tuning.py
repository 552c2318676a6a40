"""Tile shapes of the grouped GEMMs, chosen per device once (no tuning inside a training step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GemmTiles:
    """One GEMM's tile: block_m rows x block_n columns, block_k deep (wgrad: P x Q, R deep)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class TileConfig:
    """Tiles of every GEMM of the layer and the schedule's row alignment.

    align: each expert's rows are padded to a multiple of align; every block_m of the row GEMMs
    must divide it, so a row tile never straddles two experts.
    """

    align: int
    gate_up: GemmTiles
    down: GemmTiles
    down_bwd: GemmTiles
    d_x: GemmTiles
    wgrad: GemmTiles

    def __post_init__(self) -> None:
        for name in ("gate_up", "down", "down_bwd", "d_x"):
            tiles = getattr(self, name)
            if self.align % tiles.block_m != 0:
                raise ValueError(f"{name}.block_m={tiles.block_m} must divide align={self.align}")
        for name in ("gate_up", "down", "down_bwd", "d_x", "wgrad"):
            tiles = getattr(self, name)
            if min(tiles.block_m, tiles.block_n, tiles.block_k) < 16:
                raise ValueError(f"{name}: tl.dot needs tiles of at least 16 in every dimension")


def _uniform(block: int, align: int) -> TileConfig:
    tiles = GemmTiles(block, block, block, group_m=4, num_warps=4, num_stages=1)
    return TileConfig(align, tiles, tiles, tiles, tiles, tiles)


# Hopper (H100/H200), bf16. Two or three fp32 accumulators in gate/up and its backward keep
# block_n at 64 there, so they fit the register file without spilling.
HOPPER_TILES = TileConfig(
    align=128,
    gate_up=GemmTiles(128, 64, 64, group_m=8, num_warps=8, num_stages=4),
    down=GemmTiles(128, 128, 64, group_m=8, num_warps=8, num_stages=4),
    down_bwd=GemmTiles(128, 64, 64, group_m=8, num_warps=8, num_stages=3),
    d_x=GemmTiles(128, 128, 64, group_m=8, num_warps=8, num_stages=3),
    wgrad=GemmTiles(128, 128, 64, group_m=1, num_warps=8, num_stages=3),
)

# Triton's CPU interpreter: one program is one numpy step, so fewer, larger tiles run faster.
INTERPRETER_TILES = _uniform(32, 32)


def small_tiles(block: int = 16, align: int | None = None) -> TileConfig:
    """Uniform tiles for tests (more tiles, more masking); align defaults to block."""
    return _uniform(block, align or block)


def default_tiles(device: torch.device) -> TileConfig:
    return HOPPER_TILES if device.type == "cuda" else INTERPRETER_TILES
