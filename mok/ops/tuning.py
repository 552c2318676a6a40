"""Tile shapes of the grouped GEMMs: fixed per GPU architecture, dtype and problem shape, never
tuned at run time.

A fixed choice per shape keeps results bitwise reproducible from one process to the next (a
run-time autotuner may pick another tile, and so another reduction order). `TileConfig.pick`
looks the problem up in the table measured by `python -m benchmarks.tune` (mok/ops/
tuned_tiles.json, or the file MOK_TILES_FILE names), which holds the tiles of one architecture
and the dtypes it names, and falls back to the config's own tiles. Each GEMM kind has a tile
record of its own type: `RowTiles` (the row GEMMs), `DswigluTiles` (the dSwiGLU backward),
`WgradTiles` (the weight gradients); `Tiles` holds what they share.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from functools import cache
from pathlib import Path

import torch

from mok import _env
from mok.arch import arch_of

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
class Tiles:
    """One GEMM's tile: block_m rows x block_n columns, block_k deep (wgrad: P x Q, R deep);
    group_m: row blocks walked together (L2 reuse of weight tiles); num_warps, num_stages: the
    Triton kernel's; persistent: one program per SM, a grid-stride loop of tiles."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    persistent: bool = False

    def __post_init__(self) -> None:
        blocks = (self.block_m, self.block_n, self.block_k)
        if min(blocks) < 16:
            raise ValueError(f"{type(self).__name__}: tl.dot needs tiles of at least 16 in every "
                             f"dimension, got {self.block_m}x{self.block_n}x{self.block_k}")
        if any(b & (b - 1) for b in blocks):
            raise ValueError(f"{type(self).__name__}: block sizes must be powers of two, got "
                             f"{self.block_m}x{self.block_n}x{self.block_k}")
        if self.group_m < 1 or self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"{type(self).__name__}: group_m must be at least 1 and num_warps "
                             f"a power of two, got group_m={self.group_m}, "
                             f"num_warps={self.num_warps}")


@dataclass(frozen=True)
class RowTiles(Tiles):
    """Tiles of a row GEMM (gate_up, gate_up_saved, down, d_x): rows of the schedule times one
    expert's weights.

    tma: the weight tiles through TMA. tma_rows: the row tiles read or written whole (not
    gathered by token, not scattered to other ranks) through TMA: the epilogues' outputs, the
    kept pre-activations, and the A operands of down and d_x. epilogue_split: the epilogue takes
    the output tile in this many column slices (1 or 2), one after the other: fewer live
    registers, half-width TMA boxes. flatten (with persistent): the tile loop and the K loop
    flattened into one, so the next tile's loads start during this tile's last K blocks and
    epilogue (a launch that pulls rows takes its tiles from a counter and ignores it).

    gluon: the warp-specialized Gluon kernel (one program per SM, a loader partition filling a
    ring of num_stages stages, wgmma and the epilogue in the other; mok.kernels.gluon_gate_up
    and mok.kernels.gluon_dswiglu: token rows gathered by cp.async, weight tiles by TMA;
    mok.kernels.gluon_rows: every tile by TMA) with this tile's block_m (64 or 128), block_n (at
    most 128 for gate/up, whose wgmma takes gate and up at once, and for down_bwd_saved; 64 for
    down_bwd, whose three accumulators must fit the registers; else 256), block_k, num_stages
    (d_x: K steps of both products, two ring stages each, as its Triton kernel's stages hold
    both), group_m and (down, down_bwd(_saved), d_x) epilogue_split, 2 where a whole-tile
    epilogue buffer would not fit (and for down_bwd_saved at block_n 128, whose whole-tile
    epilogue would spill registers) (num_warps unused: block_m // 16 warps multiply, the loader
    has its own; persistent implied). mok.plan decides where the Gluon kernel runs a launch
    whose tiles ask for it (an sm_90 GPU, operands and sizes it takes, a launch that does not
    pull rows in its own programs) and hands the launchers tiles without it elsewhere: the
    Triton kernel then runs the same tiles.
    """

    tma: bool = False
    tma_rows: bool = False
    epilogue_split: int = 1
    flatten: bool = False
    gluon: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.flatten and not self.persistent:
            raise ValueError(f"{type(self).__name__}(flatten=True) needs persistent=True")
        if self.epilogue_split not in (1, 2):
            raise ValueError(f"{type(self).__name__}: epilogue_split={self.epilogue_split} must "
                             f"be 1 or 2")
        if self.gluon and (self.block_m not in (64, 128) or self.block_n > 256
                           or self.block_k not in (32, 64, 128)):
            raise ValueError(f"{type(self).__name__}(gluon=True): block_m 64 or 128, block_n <= "
                             f"256, block_k 32, 64 or 128 (FP8); got "
                             f"{self.block_m}x{self.block_n}x{self.block_k}")


@dataclass(frozen=True)
class DswigluTiles(RowTiles):
    """Tiles of the dSwiGLU backward (down_bwd recomputing gate/up, down_bwd_saved reading the
    kept pre-activations): down's input gradient, then dSwiGLU.

    pingpong (with gluon, block_m 64): two MMA partitions (a warpgroup each, epilogue buffers of
    their own) take the CTA's tiles in turn, one's epilogue running during the other's K loop
    (mok.kernels.gluon_dswiglu's PINGPONG); the Triton kernel ignores it.
    apart (down_bwd only): the recomputing dSwiGLU as two launches instead of one, gate/up
    storing the pre-activations (the config's gate_up_saved tiles) into the d_gate_up buffer,
    then the kept dSwiGLU over them in place (down_bwd_saved's tiles): where one launch's three
    accumulators cost more than the second pass over the pre-activations (mok.ops.
    dswiglu_apart). The other fields are unused then. Under expert parallelism with rows pulled
    by kernels, the gate/up launch pulls them (x's and d_output's) on the table's Triton
    gate_up_saved tiles and the kept dSwiGLU after it pulls nothing.
    """

    pingpong: bool = False
    apart: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pingpong and self.block_m != 64:
            raise ValueError(f"DswigluTiles(pingpong=True) needs block_m 64, got {self.block_m}")


@dataclass(frozen=True)
class WgradTiles(Tiles):
    """Tiles of a weight-gradient GEMM (wgrad_gate_up, wgrad_down): out [E, P, Q] in block_m x
    block_n tiles over R = the expert's rows in block_k steps.

    pair (wgrad_gate_up only): gate and up in one launch, x's tiles loaded once. grouped_mm:
    torch._grouped_mm (one K-split group per expert) over the rows copied into schedule order
    (mok.ops.copy_rows) where it takes the operands (mok.plan decides); the tile fields are
    unused then. gluon: the warp-specialized Gluon kernel (mok.kernels.gluon_wgrad: d_gate_up's
    or h's boxes by TMA, x's or d_output's rows gathered by cp.async; gate and up in one launch)
    with its side along I (gate/up: block_m, down: block_n) 128 or 256 and dividing I, the other
    dividing H, block_k (R) dividing the schedule's align, num_stages and num_warps; where it
    does not take the launch mok.plan runs the config's tiles without it.
    """

    pair: bool = False
    grouped_mm: bool = False
    gluon: bool = False

    def gluon_sides(self, kind: str) -> tuple[int, int]:
        """The Gluon kernel's tile sides (along I, along H) for `kind`: gate/up's block_m runs
        along I, down's block_n."""
        if kind == "wgrad_gate_up":
            return self.block_m, self.block_n
        return self.block_n, self.block_m

    def gluon_tiles(self, kind: str, *, hidden: int, intermediate: int) -> int:
        """The Gluon kernel's output tiles per expert (gate/up's span d_w_gate and d_w_up)."""
        along_i, along_h = self.gluon_sides(kind)
        outputs = 2 if kind == "wgrad_gate_up" else 1
        return outputs * -(-intermediate // along_i) * -(-hidden // along_h)


# The record type of each kind's tiles.
KIND_TILES: dict[str, type[Tiles]] = {
    "gate_up": RowTiles, "gate_up_saved": RowTiles, "down": RowTiles, "d_x": RowTiles,
    "down_bwd": DswigluTiles, "down_bwd_saved": DswigluTiles,
    "wgrad_gate_up": WgradTiles, "wgrad_down": WgradTiles,
}


@dataclass(frozen=True)
class TileConfig:
    """Tiles of every GEMM of the layer and the schedule's row alignment.

    align: each expert's rows are padded to a multiple of align; every block_m of the row GEMMs
    must divide it, so a row tile never straddles two experts.
    gate_up_saved, down_bwd_saved: the tiles of those kinds; None (the default): gate_up's, and
    down's as the dSwiGLU's record (the kept dSwiGLU is one accumulator over K = H, like down).
    use_tuned: consult the measured table first (the GPU defaults do; test tiles don't), where
    it was measured on this config's architecture `arch` and names the problem's dtype.
    """

    align: int
    gate_up: RowTiles
    down: RowTiles
    down_bwd: DswigluTiles
    d_x: RowTiles
    wgrad: WgradTiles
    gate_up_saved: RowTiles | None = None
    down_bwd_saved: DswigluTiles | None = None
    use_tuned: bool = False
    arch: str | None = None

    def __post_init__(self) -> None:
        for name in ("gate_up", "down", "down_bwd", "d_x", "wgrad", "gate_up_saved",
                     "down_bwd_saved"):
            wanted = KIND_TILES[name if name != "wgrad" else "wgrad_down"]
            tiles = getattr(self, name)
            if tiles is None and name.endswith("_saved"):
                continue
            if not isinstance(tiles, wanted):
                raise TypeError(f"TileConfig.{name} must be {wanted.__name__}, got "
                                f"{type(tiles).__name__}")
            if name != "wgrad" and self.align % tiles.block_m != 0:
                raise ValueError(f"{name}.block_m={tiles.block_m} must divide align={self.align}")

    def pick(self, kind: str, n: int, k: int, *, dtype: torch.dtype = torch.bfloat16,
             triton: bool = False, experts: int | None = None) -> Tiles:
        """Tiles for GEMM `kind` (see KINDS; a record of KIND_TILES[kind]) at problem size
        (n, k) in dtype: with use_tuned, the measured table's, else the rule of the config's
        architecture (RULES) for 16-bit dtypes; else the config's own. triton: for a launch the
        Gluon kernels cannot take (the expert-parallel dSwiGLU, whose tiles wait on rows its own
        programs pull): where the table's tiles are Gluon (or apart) ones, its best Triton tiles
        (TRITON), and the rule's Triton tiles. experts: the launch's expert count, where known
        (the rule's weight-gradient tiles depend on it)."""
        table = tuned_table() if self.use_tuned else None
        if table is not None and table.serves(self.arch, dtype):
            tuned = table.entries.get((kind, n, k))
            if triton and (getattr(tuned, "gluon", False) or getattr(tuned, "apart", False)):
                tuned = table.entries.get((kind + TRITON, n, k), tuned)
            if tuned is not None and self._fits(kind, tuned):
                return tuned
        rule = RULES.get(self.arch) if self.use_tuned and dtype.itemsize == 2 else None
        if rule is not None:
            ruled = rule(kind, n, k, triton, experts)
            if ruled is not None and self._fits(kind, ruled):
                return ruled
        if kind.startswith("wgrad"):
            return self.wgrad
        own = getattr(self, kind)
        if own is not None:
            return own
        if kind == "gate_up_saved":
            return self.gate_up
        return DswigluTiles(**asdict(self.down))

    def _fits(self, kind: str, tiles: Tiles) -> bool:
        """A row GEMM's tiles fit the schedule when their block_m divides align."""
        return kind.startswith("wgrad") or self.align % tiles.block_m == 0

    def pick_apart(self, n: int, k: int, *, dtype: torch.dtype = torch.bfloat16,
                   pulling: bool = False) -> tuple[RowTiles, DswigluTiles]:
        """The tiles of DswigluTiles.apart's two launches at (n, k) = (I, H): gate/up storing the
        pre-activations (pulling: it pulls rows its tiles wait on, the table's Triton tiles),
        then the kept dSwiGLU."""
        return (self.pick("gate_up_saved", n, k, dtype=dtype, triton=pulling),
                self.pick("down_bwd_saved", n, k, dtype=dtype))


# The table's key suffix of a kind's best Triton tiles, kept where its best are Gluon ones
# (RowTiles.gluon): the Triton kernel runs the launches the Gluon kernels cannot take, and the
# Gluon tiles need not suit it.
TRITON = "@triton"


@dataclass(frozen=True)
class TileTable:
    """Measured tiles of one architecture (arch, mok.arch's name) for the dtypes it names:
    {(kind, n, k): tiles} (kinds with TRITON's suffix: the best Triton tiles)."""

    arch: str
    dtypes: tuple[str, ...]
    entries: dict[tuple[str, int, int], Tiles]

    def serves(self, arch: str | None, dtype: torch.dtype) -> bool:
        return arch == self.arch and str(dtype).removeprefix("torch.") in self.dtypes


# Tile fields of removed kernel variants: a table written before them holds them as False, the
# tiles every kernel runs now; True names a variant that no longer exists.
_RETIRED_FIELDS = ("staged_scales", "promote_first", "epilogue_partition")


def _record(kind: str, fields: dict) -> Tiles:
    """kind's tile record (KIND_TILES; TRITON's suffix aside) from its fields (retired fields
    left out where False)."""
    for name in _RETIRED_FIELDS:
        if fields.get(name, False) is not False:
            raise ValueError(f"tile field {name}={fields[name]!r} names a kernel variant mok "
                             f"no longer has; tune the tiles again (python -m benchmarks.tune)")
    return KIND_TILES[kind.removesuffix(TRITON)](
        **{key: value for key, value in fields.items() if key not in _RETIRED_FIELDS})


@cache
def tuned_table() -> TileTable | None:
    """The tuned-tiles JSON ({"arch", "dtypes", "tiles": {kind: {"n,k": {tile fields}}}}), or
    None where the file is missing."""
    path = Path(_env.TILES_FILE) if _env.TILES_FILE else TUNED_TILES_PATH
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if "tiles" not in data:
        raise ValueError(f"{path}: a tile table holds 'arch', 'dtypes' and 'tiles' "
                         f"(as benchmarks.tune writes it)")
    entries = {}
    for kind, by_size in data["tiles"].items():
        for key, fields in by_size.items():
            n, k = (int(v) for v in key.split(","))
            entries[(kind, n, k)] = _record(kind, fields)
    return TileTable(data["arch"], tuple(data["dtypes"]), entries)


def table_to_json(table: TileTable) -> str:
    tiles: dict[str, dict[str, dict]] = {}
    for (kind, n, k), record in sorted(table.entries.items()):
        tiles.setdefault(kind, {})[f"{n},{k}"] = asdict(record)
    data = {"arch": table.arch, "dtypes": list(table.dtypes), "tiles": tiles}
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


# Experts at most this wide (I) take the Triton weight-gradient kernel in hopper_rule, wider
# ones torch._grouped_mm over copied rows (docs/measurements.md, 2026-12-03: I = 256 and 512).
SMALL_WGRAD_I = 256
# The weight gradients of experts up to this wide (I a multiple of 256) take the Gluon kernel in
# hopper_rule (docs/measurements.md, 2026-12-04: gate/up's won at I = 256-768, lost by 2% at
# 1536).
GLUON_WGRAD_MAX_I = 768
# The Gluon weight gradients' programs in one wave (the SMs of an H100 SXM or an H200): where a
# launch's 256-wide tiles number fewer, hopper_rule takes 128 x 128 tiles, twice as many
# (docs/measurements.md, 2026-12-04 (evening): the shared expert of qwen3-next-80b-a3b).
WGRAD_WAVE = 132
# The kept dSwiGLU of experts up to 768 wide takes 64-row pingpong tiles where H is at most
# this, 128-row tiles beyond (docs/measurements.md, 2026-12-03 (night): H = 768-2048 and 4096).
PINGPONG_MAX_H = 2048


def hopper_rule(kind: str, n: int, k: int, triton: bool = False,
                experts: int | None = None) -> Tiles | None:
    """sm_90, 16-bit dtypes: the tiles of `kind` at (n, k) where the table has none, and with
    triton the Triton kernel's (TileConfig.pick's triton). The measured table's choice at most
    of its shapes (mok/ops/tuned_tiles.json, six expert sizes from I = 768 to 14336): Gluon
    kernels for the row GEMMs, 128 rows a tile, 128 columns (gate/up's two products, the kept
    dSwiGLU) or 256 (down, d_x: epilogues in halves), 64 deep; the recomputing dSwiGLU as two
    launches (DswigluTiles.apart); the weight gradients by torch._grouped_mm, except for experts
    at most SMALL_WGRAD_I wide: there the Triton kernel gathers the rows itself (gate and up in
    one launch), which beat copying them for torch._grouped_mm; and both of experts at most
    GLUON_WGRAD_MAX_I wide (I a multiple of 256) by the Gluon kernel, tiles of 256 along I and
    128 along H, 64 deep, 3 stages (WgradTiles.gluon), or, where fewer such tiles than
    WGRAD_WAVE cover the launch's `experts`, 128 x 128 tiles, 4 stages. The kept dSwiGLU of
    experts up to 768 wide over H up to PINGPONG_MAX_H: 64-row tiles, two MMA partitions taking
    turns (pingpong); wider experts or longer H: 128-row tiles. Where a Gluon kernel does not take a
    launch, mok.plan runs the same tiles on the Triton kernel. Small experts take the same
    tiles: their launches cost the host more than the config's tiles do, but the GPU less, and a
    training step captured in a CUDA graph (`mok.app.train.GraphedStep`) pays only the GPU's
    time (docs/measurements.md, 2026-12-03)."""
    rows = dict(block_m=128, group_m=8, num_warps=8)
    persistent = dict(persistent=True, tma=True, tma_rows=True)
    if kind in ("gate_up", "gate_up_saved"):
        if triton:
            return RowTiles(block_n=128, block_k=64, num_stages=4, tma=True,
                            tma_rows=kind == "gate_up_saved", **rows)
        return RowTiles(block_n=128, block_k=64, num_stages=4, tma=True, gluon=True, **rows)
    if kind == "down":
        return RowTiles(block_n=256, block_k=64, num_stages=3 if triton else 4, epilogue_split=2,
                        flatten=triton, gluon=not triton, **persistent, **rows)
    if kind == "d_x":
        if triton:
            return RowTiles(block_n=128, block_k=64, num_stages=3, **persistent, **rows)
        return RowTiles(block_n=256, block_k=64, num_stages=2, epilogue_split=2, gluon=True,
                        **persistent, **rows)
    if kind == "down_bwd":
        if triton:
            return DswigluTiles(block_n=128, block_k=32, num_stages=3, epilogue_split=2,
                                **persistent, **rows)
        return DswigluTiles(block_n=64, block_k=64, num_stages=3, apart=True, **rows)
    if kind == "down_bwd_saved":
        if triton:
            return DswigluTiles(block_n=128, block_k=64, num_stages=4, **persistent, **rows)
        if n <= 768 and k <= PINGPONG_MAX_H:
            return DswigluTiles(64, 128, 64, group_m=8, num_warps=4, num_stages=5, gluon=True,
                                pingpong=True, **persistent)
        return DswigluTiles(block_n=128, block_k=64, num_stages=4, gluon=True, **persistent,
                            **{**rows, "group_m": 4})
    if kind in ("wgrad_gate_up", "wgrad_down"):
        intermediate = n if kind == "wgrad_gate_up" else k
        if not triton and intermediate <= GLUON_WGRAD_MAX_I and intermediate % 256 == 0:
            # 256 along I, 128 along H (down's out [E, H, I]: block_m along H)
            along = (256, 128) if kind == "wgrad_gate_up" else (128, 256)
            wide = WgradTiles(*along, 64, group_m=1, num_warps=8, num_stages=3, gluon=True)
            hidden = k if kind == "wgrad_gate_up" else n
            if experts is not None and experts * wide.gluon_tiles(
                    kind, hidden=hidden, intermediate=intermediate) < WGRAD_WAVE:
                return WgradTiles(128, 128, 64, group_m=1, num_warps=8, num_stages=4,
                                  gluon=True)
            return wide
        if intermediate <= SMALL_WGRAD_I:  # the Triton kernel, rows gathered in its loads
            if kind == "wgrad_gate_up":
                return WgradTiles(128, 128, 64, group_m=1, num_warps=8, num_stages=3, pair=True)
            return WgradTiles(128, 256, 64, group_m=1, num_warps=8, num_stages=3)
        return WgradTiles(128, 128, 64, group_m=1, num_warps=8, num_stages=3, grouped_mm=True)
    raise ValueError(f"no tiles for {kind!r}")


# The FP8 row GEMMs' kinds (mok.ops.fp8): the forward's gate/up with SwiGLU and down; the
# backward's gate/up pre-activations (gate_up_saved, also the forward's when kept), dSwiGLU and d_x.
FP8_KINDS = ("gate_up", "gate_up_saved", "down", "down_bwd_saved", "d_x")


# FP8 kinds with a warp-specialized Gluon kernel (mok.kernels.gluon_fp8).
FP8_GLUON_KINDS = ("gate_up", "gate_up_saved", "down", "down_bwd_saved", "d_x")


# The FP8 weight gradients' tiles (mok.kernels.fp8_wgrad): block_m along the gradient's rows,
# block_n along its columns, K steps of 128 rows (the scales' block). The fastest of the four
# `benchmarks.fp8` timed on an H200 (2026-12-05, 64508a1) at qwen3-30b-a3b and kimi-ep64-slice:
# 4-14% ahead of 64 x 128 x 128 at 4 warps and 4 stages, the tile before.
FP8_WGRAD_TILES = RowTiles(128, 128, 128, num_warps=8, num_stages=3)
# The Gluon kernel's (mok.kernels.gluon_fp8_wgrad; sm_90, alignment a multiple of 128): two MMA
# partitions of 64 rows, up to 5 stages. Not yet timed.
FP8_WGRAD_GLUON_TILES = RowTiles(128, 128, 128, num_warps=4, num_stages=5, gluon=True)


def fp8_tiles(kind: str, align: int, *, gluon: bool = False) -> RowTiles:
    """The tiles of an FP8 row GEMM (FP8_KINDS): K steps of one scale block (128), 128 columns
    (an e4m3 output's 1 x 128 blocks). The Triton kernel's (mok.kernels.fp8_gemm), as measured
    on one H200 at qwen3-30b-a3b and kimi-ep64-slice (docs/measurements.md, 2026-12-03, FP8):
    64 rows, except the pre-activations' 128 (the SwiGLU and dSwiGLU epilogues cost more at 128
    rows, and 256 columns spilled). With gluon, for FP8_GLUON_KINDS where align takes their
    rows (gate/up and dSwiGLU 128, down and d_x 64), the Gluon kernel's: 128 x 128, up to 4
    stages (mok.plan widens down's, d_x's and the dSwiGLU's to 128 x 256 at 3: _FP8_WIDE_ROWS).
    block_m at most the largest power of two dividing align."""
    if kind not in FP8_KINDS:
        raise ValueError(f"no FP8 tiles for {kind!r}")
    if gluon and kind in FP8_GLUON_KINDS and align % (64 if kind in ("down", "d_x")
                                                       else 128) == 0:
        # gate/up's and dSwiGLU's two MMA partitions take 64 rows each; their launchers fit
        # the stages to shared memory
        return RowTiles(min(128, align), 128, 128, group_m=8, num_warps=4, num_stages=4,
                        gluon=True)
    if kind == "gate_up_saved":
        tiles = RowTiles(128, 128, 128, group_m=8, num_warps=8, num_stages=3)
    elif kind in ("down", "d_x"):
        tiles = RowTiles(64, 128, 128, group_m=8, num_warps=4, num_stages=4)
    else:
        tiles = RowTiles(64, 128, 128, group_m=8, num_warps=8, num_stages=4)
    return replace(tiles, block_m=min(tiles.block_m, align & -align))


# The tile rule of each architecture (mok.arch's name): (kind, n, k, triton) -> tiles, for the
# problems its measured table does not hold.
RULES = {"sm_90": hopper_rule}


def _uniform(block: int, align: int) -> TileConfig:
    sizes = dict(block_m=block, block_n=block, block_k=block, group_m=4, num_warps=4,
                 num_stages=1)
    rows = RowTiles(**sizes)
    return TileConfig(align, rows, rows, DswigluTiles(**sizes), rows, WgradTiles(**sizes))


# Hopper (H100/H200), bf16: the fallback when the table has no entry. Two or three fp32
# accumulators in gate/up and its backward keep block_n at 64 there, so they fit the registers.
HOPPER_TILES = TileConfig(
    align=128,
    gate_up=RowTiles(128, 64, 64, group_m=8, num_warps=8, num_stages=4),
    down=RowTiles(128, 128, 64, group_m=8, num_warps=8, num_stages=4),
    down_bwd=DswigluTiles(128, 64, 64, group_m=8, num_warps=8, num_stages=3),
    d_x=RowTiles(128, 128, 64, group_m=8, num_warps=8, num_stages=3),
    wgrad=WgradTiles(128, 128, 64, group_m=1, num_warps=8, num_stages=3),
    use_tuned=True,
    arch="sm_90",
)

# Triton's CPU interpreter: one program is one numpy step, so fewer, larger tiles run faster.
INTERPRETER_TILES = _uniform(32, 32)


def small_tiles(block: int = 16, align: int | None = None) -> TileConfig:
    """Uniform tiles for tests (more tiles, more masking); align defaults to block."""
    return _uniform(block, align or block)


def default_tiles(device: torch.device) -> TileConfig:
    """The interpreter's tiles on CPU; on a GPU, Hopper's, whose measured table only a GPU of
    that architecture reads."""
    if device.type != "cuda":
        return INTERPRETER_TILES
    arch = arch_of(device).name
    return HOPPER_TILES if arch == HOPPER_TILES.arch else _other_gpu(arch)


@cache
def _other_gpu(arch: str) -> TileConfig:
    from dataclasses import replace

    return replace(HOPPER_TILES, arch=arch)
