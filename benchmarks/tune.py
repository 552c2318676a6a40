"""Measure candidate tiles of every grouped GEMM at the docs/design.md shapes; write the best
per shape.

    python -m benchmarks.tune --out mok/ops/tuned_tiles.json

For each shape, expert group (the routed experts on the shape's real routing; the shared expert,
one expert over every token, where the shape has one) and GEMM kind (mok.ops.tuning.KINDS), each
candidate is compiled, run and timed (CUDA events, median); candidates that do not compile (shared
memory, registers) are skipped. The fallback tiles are always among the candidates, so the table
never picks a slower tile than the fallback as measured. Where Gluon tiles win, the best Triton
tiles are kept too (kind + mok.ops.tuning.TRITON), for the launches the Gluon kernels cannot
take. The table is keyed by (kind, n, k) and
read by TileConfig.pick; a fixed table keeps results reproducible across processes.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from benchmarks.breakdown import median_ms, shape_setup
from mok import ops
from mok.arch import arch_of
from mok.ops.tuning import (
    HOPPER_TILES,
    TRITON,
    DswigluTiles,
    RowTiles,
    Tiles,
    TileTable,
    WgradTiles,
    table_to_json,
    tuned_table,
)
from mok.testing import SHAPES, SHAPES_BY_NAME

R, D, W = RowTiles, DswigluTiles, WgradTiles
# Deeper pipelines for the weight gradients (shared memory per CTA from scripts/sm90_compile.py:
# 128x128x64 takes 96 KB at 3 stages, 128 at 4, 160 at 5; paired, 144 at 3 and 192 at 4).
PERSISTENT_WGRAD = [W(128, 128, 64, 1, 8, 3, persistent=True),
                    W(128, 128, 64, 1, 8, 4, persistent=True),
                    W(128, 256, 64, 1, 8, 3, persistent=True)]
DEEP_WGRAD = [W(128, 128, 64, 1, 8, 4), W(128, 128, 64, 1, 8, 5)]


def _persistent(*tiles: RowTiles, split: int = 1) -> list[RowTiles]:
    """The row-GEMM tiles as persistent loops (one program per SM), every row tile and weight
    through TMA, as Triton's persistent TMA GEMMs are fastest on Hopper; split: their
    epilogues in that many column slices."""
    return [dataclasses.replace(t, persistent=True, tma=True, tma_rows=True,
                                epilogue_split=split) for t in tiles]


CANDIDATES: dict[str, list[Tiles]] = {
    "gate_up": [R(128, 64, 64, 8, 8, 4), R(128, 128, 64, 8, 8, 3), R(64, 128, 64, 8, 4, 4),
                R(128, 64, 64, 8, 4, 4), R(128, 128, 32, 8, 8, 4),
                R(128, 128, 64, 8, 8, 3, tma=True), R(128, 128, 64, 8, 8, 4, tma=True),
                R(128, 128, 64, 8, 8, 3, tma_rows=True),
                R(128, 128, 64, 8, 8, 3, tma=True, tma_rows=True),
                R(128, 128, 64, 8, 8, 4, tma=True, tma_rows=True),
                *_persistent(R(128, 128, 64, 8, 8, 3), R(128, 128, 64, 8, 8, 4),
                             R(128, 64, 64, 8, 8, 4), R(128, 128, 32, 8, 8, 4)),
                R(128, 128, 64, 8, 8, 3, persistent=True),
                *_persistent(R(128, 128, 64, 8, 8, 3), split=2),
                R(128, 128, 64, 8, 8, 4, tma=True, tma_rows=True, epilogue_split=2)],
    "down": [R(128, 128, 64, 8, 8, 4), R(128, 256, 64, 8, 8, 3), R(128, 128, 64, 8, 4, 4),
             R(64, 256, 64, 8, 8, 3), R(128, 128, 128, 8, 8, 3),
             R(128, 256, 64, 8, 8, 3, tma=True), R(128, 128, 64, 8, 8, 4, tma=True),
             R(128, 256, 64, 8, 8, 3, tma_rows=True),
             R(128, 256, 64, 8, 8, 3, tma=True, tma_rows=True),
             R(128, 256, 64, 8, 8, 4, tma=True, tma_rows=True),
             R(128, 128, 64, 8, 8, 4, tma=True, tma_rows=True),
             *_persistent(R(128, 256, 64, 8, 8, 3), R(128, 256, 64, 8, 8, 4),
                          R(128, 128, 64, 8, 8, 4), R(128, 128, 64, 8, 4, 4)),
             R(128, 256, 64, 8, 8, 3, persistent=True),
             *_persistent(R(128, 256, 64, 8, 8, 3), R(128, 256, 64, 8, 8, 4), split=2)],
    "down_bwd": [D(128, 64, 64, 8, 8, 3), D(64, 128, 64, 8, 8, 3), D(128, 64, 32, 8, 8, 4),
                 D(64, 64, 64, 8, 4, 4), D(128, 128, 32, 8, 8, 3),
                 D(128, 128, 32, 8, 8, 3, tma=True), D(128, 128, 32, 8, 8, 4, tma=True),
                 D(128, 128, 32, 8, 8, 3, tma_rows=True),
                 D(128, 128, 32, 8, 8, 3, tma=True, tma_rows=True),
                 D(128, 64, 64, 8, 8, 3, tma_rows=True),
                 *_persistent(D(128, 128, 32, 8, 8, 3), D(128, 64, 64, 8, 8, 3),
                              D(128, 128, 32, 8, 8, 4)),
                 *_persistent(D(128, 128, 32, 8, 8, 3), split=2)],
    "down_bwd_saved": [D(128, 128, 64, 8, 8, 4), D(128, 128, 64, 8, 8, 3),
                       D(128, 256, 64, 8, 8, 3), D(128, 64, 64, 8, 4, 4),
                       D(64, 128, 64, 8, 4, 4), D(128, 128, 32, 8, 8, 4),
                       D(128, 128, 64, 8, 8, 4, tma_rows=True),
                       D(128, 128, 64, 8, 8, 3, tma_rows=True),
                       D(128, 256, 64, 8, 8, 3, tma_rows=True),
                       D(64, 128, 64, 8, 4, 4, tma_rows=True),
                       D(64, 128, 64, 8, 4, 4, tma=True),
                       D(64, 128, 64, 8, 4, 4, tma=True, tma_rows=True),
                       D(128, 128, 64, 8, 8, 4, tma=True, tma_rows=True),
                       *_persistent(D(64, 128, 64, 8, 4, 4), D(128, 128, 64, 8, 8, 4),
                                    D(128, 128, 64, 8, 8, 3), D(128, 256, 64, 8, 8, 3),
                                    D(128, 128, 64, 8, 4, 3)),
                       *_persistent(D(128, 256, 64, 8, 8, 3), D(128, 128, 64, 8, 8, 4),
                                    split=2),
                       D(64, 128, 64, 8, 4, 4, tma=True, tma_rows=True, epilogue_split=2),
                       # each gathered d_out row tile feeding 256 columns; 128 x 64 two to an SM
                       D(64, 256, 64, 8, 8, 3, tma=True, tma_rows=True),
                       D(128, 64, 64, 8, 4, 4, tma=True, tma_rows=True),
                       # 128 x 128 at 4 warps: half the weight-tile traffic from L2 of 64 x 128
                       # (512 KB a 64-row tile at qwen3, K = 2048), one warpgroup. Timed on one
                       # H200: 1.63 ms at qwen3 against 64 x 128's 1.43 (its whole-tile epilogue:
                       # 4.30); best only for deepseek's shared expert, by 2%.
                       D(128, 128, 64, 8, 4, 3, tma=True, tma_rows=True, epilogue_split=2)],
    "d_x": [R(128, 128, 64, 8, 8, 3), R(128, 256, 64, 8, 8, 2), R(128, 128, 32, 8, 8, 4),
            R(128, 128, 64, 8, 4, 3), R(64, 256, 32, 8, 8, 3),
            R(128, 128, 64, 8, 8, 3, tma_rows=True), R(128, 256, 64, 8, 8, 2, tma_rows=True),
            R(128, 128, 64, 8, 4, 3, tma_rows=True),
            R(128, 128, 64, 8, 8, 3, tma=True), R(128, 128, 64, 8, 4, 3, tma=True),
            R(128, 128, 64, 8, 4, 3, tma=True, tma_rows=True), R(128, 256, 64, 8, 8, 2, tma=True),
            *_persistent(R(128, 128, 64, 8, 4, 3), R(128, 128, 64, 8, 8, 3),
                         R(128, 256, 64, 8, 8, 2), R(128, 256, 64, 8, 8, 3),
                         R(128, 128, 64, 8, 8, 4)),
            *_persistent(R(128, 256, 64, 8, 8, 2), R(128, 128, 64, 8, 4, 3), split=2)],
    "wgrad_gate_up": [W(128, 128, 64, 1, 8, 3), W(128, 256, 64, 1, 8, 3),
                      W(128, 128, 128, 1, 8, 3), W(256, 128, 64, 1, 8, 3),
                      W(128, 128, 64, 1, 4, 4), *PERSISTENT_WGRAD, *DEEP_WGRAD,
                      W(128, 128, 64, 1, 8, 3, pair=True), W(128, 128, 64, 1, 8, 4, pair=True),
                      W(128, 128, 32, 1, 8, 4, pair=True),
                      W(128, 128, 64, 1, 8, 3, persistent=True, pair=True),
                      W(128, 128, 64, 1, 8, 3, grouped_mm=True),
                      # the warp-specialized Gluon kernel (block_m dividing I)
                      W(256, 128, 64, 1, 8, 3, gluon=True), W(128, 128, 64, 1, 8, 4, gluon=True),
                      W(128, 256, 64, 1, 8, 3, gluon=True)],
    "wgrad_down": [W(128, 128, 64, 1, 8, 3), W(128, 256, 64, 1, 8, 3),
                   W(128, 128, 128, 1, 8, 3), W(256, 128, 64, 1, 8, 3),
                   W(128, 128, 64, 1, 4, 4), *PERSISTENT_WGRAD, *DEEP_WGRAD,
                   W(128, 128, 64, 1, 8, 3, grouped_mm=True),
                   # the Gluon kernel (block_m along H, block_n along I, dividing I)
                   W(128, 256, 64, 1, 8, 3, gluon=True), W(128, 128, 64, 1, 8, 4, gluon=True)],
}
# gate/up also storing its pre-activations: the gate/up tiles, and epilogues in halves or
# through TMA (the tile stores three outputs: h, gate, up).
CANDIDATES["gate_up_saved"] = [
    *CANDIDATES["gate_up"], R(128, 128, 64, 8, 8, 4, tma_rows=True),
    R(64, 128, 64, 8, 4, 4, tma=True, tma_rows=True),
    R(128, 128, 64, 8, 8, 3, tma=True, tma_rows=True, epilogue_split=2),
    *_persistent(R(128, 128, 64, 8, 8, 4), split=2)]

# gate/up by the warp-specialized Gluon kernel (RowTiles.gluon; one program per SM, num_warps
# unused: block_m // 16 MMA warps and 4 loader warps). 128 x 128 x 64 at 4 stages takes 224 KB.
# Where the Triton kernel runs these tiles instead (a launch that pulls rows from other ranks)
# its weight tiles come through TMA.
GLUON = [R(128, 128, 64, g, 8, s, tma=True, gluon=True) for g, s in ((8, 4), (8, 3), (4, 4))]
GLUON.append(R(64, 128, 64, 8, 4, 5, tma=True, gluon=True))
CANDIDATES["gate_up"] += GLUON
CANDIDATES["gate_up_saved"] += GLUON
# down and d_x by the warp-specialized Gluon row kernels (every tile through TMA, one loader
# warp; down at 128 x 256 x 64 takes 208 KB at 3 stages, 224 at 4 with its epilogue in halves).
# A d_x stage holds a K step's gate and up tiles (two ring stages), as the Triton kernel's
# stages do: 224 KB at 128 x 256 x 64, 2 stages, and 128 x 128 x 64, 3 stages. Where the Triton
# kernel runs these tiles instead (a launch that scatters rows to other ranks, or d_x pulling
# them) it keeps TMA rows and persistent programs; the 128 x 256 tiles at 192 KB of stages
# have their epilogues in halves, which the Triton kernels need there.
def _gluon_rows(*shapes: tuple[int, int, int, int]) -> list[RowTiles]:
    return [R(128, n, 64, g, 8, s, persistent=True, tma=True, tma_rows=True, epilogue_split=split,
              gluon=True) for n, s, g, split in shapes]


CANDIDATES["down"] += _gluon_rows((256, 3, 8, 1), (256, 4, 8, 2), (256, 3, 4, 1), (256, 4, 4, 2),
                                  (128, 4, 8, 1), (128, 4, 4, 1))
CANDIDATES["d_x"] += _gluon_rows((256, 2, 8, 2), (256, 2, 4, 2), (128, 3, 8, 1), (128, 3, 4, 1),
                                 (128, 2, 8, 1))
# dSwiGLU by the warp-specialized Gluon kernel (d_out's rows, and x's recomputing, gathered by
# cp.async in 4 loader warps). Kept: 128 x 128 x 64 takes 208 KB at 4 stages (its epilogue in
# column halves: whole, it would spill registers); recomputing: three accumulators hold block_n
# to 64, 128 x 64 x 64 takes 200 KB at 3 stages, 128 x 64 x 32 as much at 6. Where the Triton
# kernel runs these tiles instead (a launch that pulls rows) it keeps persistent programs and
# TMA.
def _gluon_dswiglu(*shapes: tuple[int, int, int, int, int]) -> list[DswigluTiles]:
    return [D(m, n, k, g, m // 16, s, persistent=True, tma=True, tma_rows=True, gluon=True)
            for m, n, k, s, g in shapes]


CANDIDATES["down_bwd_saved"] += _gluon_dswiglu((128, 128, 64, 4, 8), (128, 128, 64, 3, 8),
                                               (128, 128, 64, 4, 4), (64, 128, 64, 5, 8),
                                               (128, 64, 64, 6, 8))
CANDIDATES["down_bwd"] += _gluon_dswiglu((128, 64, 64, 3, 8), (128, 64, 64, 3, 4),
                                         (128, 64, 32, 6, 8), (64, 64, 64, 4, 8))
# 64-row tiles with two MMA partitions taking turns (DswigluTiles.pingpong; each its own epilogue
# buffers: 200 KB kept at 64 x 128 x 64, 5 stages; 192 KB recomputing at 64 x 64 x 64, 4).
CANDIDATES["down_bwd_saved"] += [dataclasses.replace(t, pingpong=True) for t in _gluon_dswiglu(
    (64, 128, 64, 5, 8), (64, 128, 64, 4, 8), (64, 128, 64, 5, 4), (64, 64, 64, 6, 8))]
CANDIDATES["down_bwd"] += [dataclasses.replace(t, pingpong=True) for t in _gluon_dswiglu(
    (64, 64, 64, 4, 8), (64, 64, 64, 3, 8), (64, 64, 32, 6, 8))]
# Every persistent row-GEMM candidate also with its tile and K loops flattened (RowTiles.flatten).
for _kind in ("gate_up", "gate_up_saved", "down", "down_bwd", "down_bwd_saved", "d_x"):
    CANDIDATES[_kind] += [dataclasses.replace(t, flatten=True) for t in CANDIDATES[_kind]
                          if t.persistent and not t.gluon]
# The recomputing dSwiGLU as two launches (DswigluTiles.apart): gate/up storing the
# pre-activations, then the kept dSwiGLU over them, each on the table's tiles of its kind
# (gate_up_saved, down_bwd_saved) in use when the tuner starts; its own fields are the fallback's.
CANDIDATES["down_bwd"].append(dataclasses.replace(CANDIDATES["down_bwd"][0], apart=True))


def gemm_runners(x, w_g, w_u, w_d, routing, rw, d_out, setup=HOPPER_TILES) -> dict:
    """{kind: ((n, k), run(tiles))}: each GEMM of one group of experts on `routing` (rw: the
    router weights, None for the shared expert); `setup` makes their inputs."""
    inter, hid = w_g.shape[1:]
    h = ops.gate_up_swiglu(x, w_g, w_u, routing, setup.gate_up, None)
    dgu, _ = ops.down_bwd_dswiglu(d_out, x, w_d, w_g, w_u, h, routing, setup.down_bwd, rw, None)
    gate_up = ops.gate_up_buffer(x, w_g, routing)
    h_kept = torch.empty_like(h)  # written by the kept-gate/up backward
    ops.gate_up_swiglu(x, w_g, w_u, routing, setup.gate_up, None, gate_up=gate_up)
    return {
        "gate_up": ((inter, hid), lambda t: ops.gate_up_swiglu(x, w_g, w_u, routing, t, None)),
        "gate_up_saved": ((inter, hid), lambda t: ops.gate_up_swiglu(
            x, w_g, w_u, routing, t, None, gate_up=gate_up)),
        "down": ((hid, inter), lambda t: ops.down_proj(h, w_d, routing, t, rw)),
        "down_bwd": ((inter, hid), lambda t: ops.dswiglu_apart(
            d_out, x, w_d, w_g, w_u, routing, *setup.pick_apart(inter, hid), rw, None) if t.apart
            else ops.down_bwd_dswiglu(d_out, x, w_d, w_g, w_u, h, routing, t, rw, None)),
        "down_bwd_saved": ((inter, hid), lambda t: ops.down_bwd_dswiglu(
            d_out, x, w_d, w_g, w_u, h_kept, routing, t, rw, None, gate_up=gate_up,
            h_out=True)),
        "d_x": ((hid, inter), lambda t: ops.d_x_rows(dgu, w_g, w_u, routing, t)),
        "wgrad_gate_up": ((inter, hid), lambda t: ops.grouped_wgrad_gate_up(
            dgu, x, routing, t, gather_x=True, out_dtype=x.dtype)),
        "wgrad_down": ((hid, inter), lambda t: ops.grouped_wgrad(
            d_out, h, routing, t, gather_a=True, gather_b=False, router_weights=rw,
            out_dtype=x.dtype)),
    }


def stage_runners(shape) -> list[tuple[str, str, tuple[int, int], object]]:
    """[(expert group, kind, (n, k), run(tiles))]: the routed experts on the shape's real
    routing, and the shared expert (one expert over every token) where the shape has one."""
    inputs, _, _, schedule = shape_setup(shape, seed=7)
    x, rw, d_out = inputs.x, inputs.router_weights, inputs.d_output
    groups = [("routed", gemm_runners(x, *inputs.routed_weights, schedule.routing, rw, d_out))]
    shared = shape.shared_intermediate_size
    if shared:
        hid = shape.hidden_size
        generator = torch.Generator("cuda").manual_seed(8)
        weights = [torch.randn(1, *size, generator=generator, device="cuda",
                               dtype=x.dtype) / size[1] ** 0.5
                   for size in ((shared, hid), (shared, hid), (hid, shared))]
        groups.append(("shared", gemm_runners(x, *weights, schedule.shared_routing, None,
                                              d_out)))
    return [(group, kind, key, run) for group, runners in groups
            for kind, (key, run) in runners.items()]


# GemmTiles options (beyond the tile's sizes) that `--only` can ask for, with their defaults.
OPTIONS = {f.name: f.default for cls in (DswigluTiles, WgradTiles) for f in dataclasses.fields(cls)
           if f.name not in ("block_m", "block_n", "block_k", "group_m", "num_warps",
                             "num_stages")}


def candidates(kind: str, current: Tiles | None, only: tuple[str, ...] = (),
               current_triton: Tiles | None = None) -> list:
    """The fallback tiles first, then those of CANDIDATES[kind] with every option of `only`
    set (not its default), then the table's current entries, its best and its best Triton
    tiles (so tuning a subset never loses a faster earlier pick)."""
    fallback, *others = CANDIDATES[kind]
    chosen = [fallback] + [t for t in others if all(
        getattr(t, name, OPTIONS[name]) != OPTIONS[name] for name in only)]
    for tiles in (current, current_triton):
        if tiles is not None and tiles not in chosen:
            chosen.append(tiles)
    return chosen


# The dtypes a table measured in bf16 serves: those of the same element size.
TABLE_DTYPES = ("bfloat16", "float16")


def _not_triton(tiles: Tiles) -> bool:
    """Tiles of a Gluon kernel or of two launches (RowTiles.gluon, DswigluTiles.apart)."""
    return getattr(tiles, "gluon", False) or getattr(tiles, "apart", False)


def tune(shapes, table: dict | None = None, out: Path | None = None,
         kinds=tuple(CANDIDATES), verbose: bool = False, only: tuple[str, ...] = (),
         ahead_ms: float = 0.0) -> dict:
    """Tune `shapes` into `table` (entries of other shapes kept); with `out`, the table is
    written after each shape, so a run cut short keeps what it measured. verbose: print every
    candidate's time, not only the best. only: try just the candidates with these tile
    flags set (besides the fallback and the table's entry). ahead_ms: the GPU sleeps that long
    before each timed call, so a candidate is timed by the GPU's time alone
    (benchmarks.breakdown.median_ms)."""
    table = dict(table or {})
    for shape in shapes:
        print(f"== {shape.name}", flush=True)
        for group, kind, (n, k), run in stage_runners(shape):
            if kind not in kinds:
                continue
            results = []
            for tiles in candidates(kind, table.get((kind, n, k)), only,
                                    table.get((kind + TRITON, n, k))):
                try:
                    results.append((median_ms(lambda t=tiles, run=run: run(t), ahead_ms=ahead_ms),
                                    tiles))
                except Exception as exc:  # a tile that does not fit this GPU: skip it
                    print(f"   {group} {kind} {tiles}: skipped ({type(exc).__name__})",
                          flush=True)
            fallback = results[0][0]
            best_ms, best = min(results, key=lambda r: r[0])
            for ms, tiles in (results if verbose else []):
                print(f"     {ms:7.3f} ms {ms / best_ms:5.2f}x best  {tiles}", flush=True)
            table[(kind, n, k)] = best
            # Gluon (or apart) tiles win: keep the best Triton ones for the launches Gluon
            # cannot take (and those that pull rows: one launch).
            triton = min((r for r in results if not _not_triton(r[1])), key=lambda r: r[0])[1]
            table.pop((kind + TRITON, n, k), None)
            if _not_triton(best):
                table[(kind + TRITON, n, k)] = triton
            print(f"   {group:6s} {kind:14s} n={n:6d} k={k:6d} fallback {fallback:7.3f} ms -> best "
                  f"{best_ms:7.3f} ms ({fallback / best_ms:4.2f}x) {best}", flush=True)
        if out is not None:
            out.write_text(table_to_json(TileTable(arch_of(torch.device("cuda")).name,
                                                   TABLE_DTYPES, table)))
            print(f"wrote {out}", flush=True)
    return table


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=[s.name for s in SHAPES])
    parser.add_argument("--out", default="tuned_tiles.json")
    parser.add_argument("--kinds", nargs="+", choices=list(CANDIDATES), default=list(CANDIDATES))
    parser.add_argument("--fresh", action="store_true",
                        help="start from an empty table (default: keep the entries of the "
                             "table in use for shapes not tuned now)")
    parser.add_argument("--verbose", action="store_true",
                        help="print every candidate's time, not only the best")
    parser.add_argument("--only", nargs="+", choices=list(OPTIONS), default=[],
                        help="try only the candidates with these options set (and the fallback "
                             "and the table's entry)")
    parser.add_argument("--ahead-ms", type=float, default=0.0,
                        help="the GPU sleeps this long before each timed call: candidates timed "
                             "by the GPU alone, not the host issuing them (default: idle GPU)")
    args = parser.parse_args(argv)
    tune([SHAPES_BY_NAME[name] for name in args.shapes],
         {} if args.fresh else tuned_table().entries, Path(args.out), kinds=args.kinds,
         verbose=args.verbose, only=tuple(args.only), ahead_ms=args.ahead_ms)


if __name__ == "__main__":
    main()
