"""Compile mok's expert GEMMs for Hopper (sm_90) on a machine without a GPU; print what the
compiler made of each tile variant: registers per thread, spills, shared memory, and whether the
products became wgmma (warp_group_dot) and the loads TMA.

    TRITON_INTERPRET=0 python scripts/sm90_compile.py [--shape qwen3-30b-a3b] [--dump-ttgir DIR]

Nothing runs: every launch is intercepted, specialized as the JIT would on a GPU (the same
binder, so the same divisibility and dtype specialization), compiled with Triton's bundled ptxas
and dropped. A tile that does not compile shows its error here instead of in a GPU session.
The inputs are CPU tensors of the shape's sizes (fewer experts: E only changes the grid).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET", "0") != "0":
    sys.exit("run with TRITON_INTERPRET=0: the kernels must be compiled, not interpreted")
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile, make_backend  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
RESULTS: list[dict] = []
DUMP_DIR: str | None = None
DUMP_SASS = False


def _compile_instead_of_launch(self, *args, grid, warmup, **kwargs):
    backend = make_backend(TARGET)
    binder = create_function_from_signature(self.signature, self.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound_args,
                                                            specialization, options)
    name = self.__name__
    source = GluonASTSource if self.is_gluon() else ASTSource
    try:
        kernel = compile(source(self, signature, constexprs, attrs), target=TARGET,
                         options=options.__dict__)
    except Exception as exc:  # report and go on: the point is to see which tiles fail
        text = str(exc)
        RESULTS.append(dict(kernel=name,
                            error=f"{type(exc).__name__}: {text[:300]} ... {text[-600:]}"))
        return None
    ttgir = kernel.asm.get("ttgir", "")
    regs, local, stack = _resource_usage(kernel.asm["cubin"])
    if DUMP_DIR is not None:
        path = os.path.join(DUMP_DIR, f"{len(os.listdir(DUMP_DIR)):02d}-{name}.ttgir")
        with open(path, "w") as handle:
            handle.write(ttgir)
        if DUMP_SASS:
            with open(path[:-len("ttgir")] + "sass", "w") as handle:
                handle.write(_sass(kernel.asm["cubin"]))
    RESULTS.append(dict(
        kernel=name, regs=regs, spills=local, stack=stack,
        shared_kb=round(kernel.metadata.shared / 1024, 1),
        warps=options.num_warps, stages=options.num_stages, wgmma="warp_group_dot" in ttgir,
        tma=bool(re.search(r"async_tma_copy|tma_load|descriptor_load", ttgir))))
    return None


def _tool(name: str) -> str:
    from triton.backends.nvidia import compiler as nvidia

    return os.path.join(os.path.dirname(nvidia.__file__), "bin", name)


def _sass(cubin: bytes) -> str:
    """The cubin's SASS (Triton's bundled cuobjdump)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        return subprocess.run([_tool("cuobjdump"), "-sass", handle.name], check=True,
                              capture_output=True, text=True).stdout


def _resource_usage(cubin: bytes) -> tuple[int, int, int]:
    """(registers per thread, local memory bytes per thread: spills, stack frame bytes per
    thread: where ptxas puts spills too, a kernel without calls having no other use for it)
    from cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        text = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", handle.name],
                              check=True,
                              capture_output=True, text=True).stdout
    return tuple(int(found.group(1)) if found else -1
                 for found in (re.search(rf"{key}:(\d+)", text)
                               for key in ("REG", "LOCAL", "STACK")))


def _gluon_quantize(fp8_wgrad, *args, **kwargs) -> None:
    """fp8_wgrad.quantize_row_blocks on the Gluon kernel, as an sm_90 GPU runs it."""
    takes = fp8_wgrad.gluon_takes_quantize_rows
    fp8_wgrad.gluon_takes_quantize_rows = lambda src, halves=None: True
    try:
        fp8_wgrad.quantize_row_blocks(*args, **kwargs)
    finally:
        fp8_wgrad.gluon_takes_quantize_rows = takes


def main(argv=None) -> None:
    from mok import ops
    from mok.ops import experts as experts_ops
    from mok.ops.tuning import HOPPER_TILES
    from mok.testing import SHAPES_BY_NAME

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES_BY_NAME))
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--dump-ttgir", metavar="DIR", help="also write each kernel's TTGIR here")
    parser.add_argument("--dump-sass", action="store_true",
                        help="with --dump-ttgir, also each kernel's SASS (cuobjdump -sass)")
    parser.add_argument("--json", action="store_true", help="one JSON list instead of the table")
    parser.add_argument("--match", default="", help="compile only the runs whose label has this")
    args = parser.parse_args(argv)
    global DUMP_DIR, DUMP_SASS
    DUMP_SASS = args.dump_sass
    if args.dump_ttgir:
        os.makedirs(args.dump_ttgir, exist_ok=True)
        DUMP_DIR = args.dump_ttgir
    JITFunction.run = _compile_instead_of_launch

    shape = SHAPES_BY_NAME[args.shape]
    hid, inter, k = shape.hidden_size, shape.intermediate_size, shape.topk
    tokens, experts = 1024, args.experts
    bf16 = dict(dtype=torch.bfloat16)
    x = torch.empty(tokens, hid, **bf16)
    rw = torch.empty(tokens, k, dtype=torch.float32)
    w_g = torch.empty(experts, inter, hid, **bf16)
    w_u = torch.empty(experts, inter, hid, **bf16)
    w_d = torch.empty(experts, hid, inter, **bf16)
    rows = triton_cdiv(tokens * k, 128) * 128 + experts * 128
    i32 = dict(dtype=torch.int32)
    routing = ops.Routing(
        row_route=torch.empty(rows, **i32), route_row=torch.empty(tokens * k, **i32),
        block_expert=torch.empty(rows // 128, **i32), expert_counts=torch.empty(experts, **i32),
        expert_offsets=torch.empty(experts + 1, **i32), num_tokens=tokens, topk=k,
        num_local_experts=experts, align=128)
    h = torch.empty(rows, inter, **bf16)
    dgu = torch.empty(rows, 2 * inter, **bf16)
    d_out = torch.empty(tokens, hid, **bf16)

    def tiles(kind, n, kk):  # the Triton kernels' tiles: the table's Triton ones (TRITON)
        return HOPPER_TILES.pick(kind, n, kk, triton=True)

    # The table's Triton tiles with pointer loads (the " tma" runs add TMA for the weights,
    # " tma rows" for the whole row tiles); the weight-gradient variants change the fallback
    # tile (128x128x64, 3 stages), the table's own runs as " tuned". Always the Triton kernels:
    # the Gluon ones (RowTiles.gluon) have runs of their own.
    plain = dict(tma=False, tma_rows=False, grouped_mm=False, epilogue_split=1, gluon=False)

    def plain_tiles(record):
        names = {field.name for field in dataclasses.fields(record)}
        return dataclasses.replace(record, **{k: v for k, v in plain.items() if k in names})

    t = {kind: plain_tiles(tiles(kind, *key)) for kind, key in (
        ("gate_up", (inter, hid)), ("gate_up_saved", (inter, hid)), ("down", (hid, inter)),
        ("down_bwd", (inter, hid)), ("down_bwd_saved", (inter, hid)), ("d_x", (hid, inter)),
        ("wgrad_gate_up", (inter, hid)), ("wgrad_down", (hid, inter)))}
    r = dataclasses.replace
    runs = [
        ("gate_up", t["gate_up"], lambda tt: ops.gate_up_swiglu(x, w_g, w_u, routing, tt, None)),
        ("gate_up tma", r(t["gate_up"], tma=True),
         lambda tt: ops.gate_up_swiglu(x, w_g, w_u, routing, tt, None)),
        ("down", t["down"], lambda tt: ops.down_proj(h, w_d, routing, tt, rw)),
        ("down tma", r(t["down"], tma=True, block_k=64),
         lambda tt: ops.down_proj(h, w_d, routing, tt, rw)),
        ("down_bwd", t["down_bwd"], lambda tt: ops.down_bwd_dswiglu(
            d_out, x, w_d, w_g, w_u, h, routing, tt, rw, None)),
        ("down_bwd tma", r(t["down_bwd"], tma=True), lambda tt: ops.down_bwd_dswiglu(
            d_out, x, w_d, w_g, w_u, h, routing, tt, rw, None)),
        ("gate_up saving", t["gate_up_saved"], lambda tt: ops.gate_up_swiglu(
            x, w_g, w_u, routing, tt, None, gate_up=dgu)),
        ("down_bwd saved", t["down_bwd_saved"], lambda tt: ops.down_bwd_dswiglu(
            d_out, x, w_d, w_g, w_u, h, routing, tt, rw, None, gate_up=dgu, h_out=True)),
        ("d_x", t["d_x"], lambda tt: ops.d_x_rows(dgu, w_g, w_u, routing, tt)),
        ("down_bwd saved tma", r(t["down_bwd_saved"], tma=True), lambda tt: ops.down_bwd_dswiglu(
            d_out, x, w_d, w_g, w_u, h, routing, tt, rw, None, gate_up=dgu, h_out=True)),
        ("d_x tma", r(t["d_x"], tma=True), lambda tt: ops.d_x_rows(dgu, w_g, w_u, routing, tt)),
    ]
    # The same GEMMs with their whole row tiles (outputs, kept pre-activations, the A operands
    # of down and d_x) through TMA.
    runs += [(f"{label} tma rows", r(tt, tma_rows=True), run) for label, tt, run in runs
             if " tma" not in label]
    # And as persistent loops over their tiles.
    runs += [(f"{label} persistent", r(tt, persistent=True), run) for label, tt, run in runs
             if label.endswith(" tma rows") or " " not in label]
    # Epilogues in two column halves (RowTiles.epilogue_split), at the table's tiles and at
    # 128 x 256 (the halves keep its epilogue's registers and TMA store boxes in bounds).
    # (d_x loads two A and two B tiles a stage: two stages at 128 x 256.)
    wide = {"down tma rows": 4, "down_bwd saved tma rows": 3, "d_x tma rows": 2}
    runs += [(f"{label} split", r(tt, epilogue_split=2), run) for label, tt, run in runs
             if label in ("gate_up tma rows", "down tma rows", "down_bwd tma rows",
                          "down_bwd saved tma rows", "d_x tma rows")]
    runs += [(f"{label} split 128x256", r(tt, epilogue_split=2, tma=True, persistent=True,
                                          block_m=128, block_n=256, block_k=64, num_warps=8,
                                          num_stages=wide[label]), run)
             for label, tt, run in runs if label in wide]
    # Persistent tiles with the tile and K loops flattened into one (RowTiles.flatten).
    runs += [(f"{label} flatten", r(tt, flatten=True), run) for label, tt, run in runs
             if label in ("gate_up tma rows persistent", "down tma rows split 128x256",
                          "down_bwd tma rows split 128x256", "d_x tma rows split 128x256",
                          "down_bwd saved tma rows persistent", "down_bwd tma rows persistent",
                          "gate_up saving tma rows persistent", "d_x tma rows persistent")]
    # gate/up by the warp-specialized Gluon kernel (RowTiles.gluon; its weights and outputs
    # always through TMA), as an sm_90 GPU would run it.
    experts_ops._check_gluon = lambda *args, **kwargs: None  # CPU tensors, compiled for sm_90
    gluon = r(t["gate_up"], block_m=128, block_n=128, block_k=64, num_stages=4, gluon=True)
    runs += [
        ("gate_up gluon tma", gluon,
         lambda tt: ops.gate_up_swiglu(x, w_g, w_u, routing, tt, None)),
        ("gate_up gluon tma s3 limit", r(gluon, num_stages=3),
         lambda tt: ops.gate_up_swiglu(x, w_g, w_u, routing, tt, 7.0)),
        ("gate_up saving gluon tma limit", gluon,
         lambda tt: ops.gate_up_swiglu(x, w_g, w_u, routing, tt, 7.0, gate_up=dgu)),
        ("gate_up gluon tma 64x128 s5", r(gluon, block_m=64, num_stages=5),
         lambda tt: ops.gate_up_swiglu(x, w_g, w_u, routing, tt, None)),
    ]
    # down and d_x by the warp-specialized Gluon row kernels (every tile through TMA; 128 x 256
    # x 64 stores its epilogue in two column halves where a whole tile's buffer does not fit).
    # A d_x stage holds a K step's gate and up tiles, as in the Triton kernel: two ring stages.
    wide_gluon = r(t["down"], block_m=128, block_n=256, block_k=64, num_stages=3, gluon=True)
    runs += [
        ("down gluon tma", wide_gluon, lambda tt: ops.down_proj(h, w_d, routing, tt, rw)),
        ("down gluon tma s4", r(wide_gluon, num_stages=4),
         lambda tt: ops.down_proj(h, w_d, routing, tt, rw)),
        ("down gluon tma 128x128", r(wide_gluon, block_n=128, num_stages=4),
         lambda tt: ops.down_proj(h, w_d, routing, tt, rw)),
        ("down shared gluon tma", wide_gluon,
         lambda tt: ops.down_proj(h, w_d, routing, tt, None)),
        ("down gluon tma 64x128 s5", r(wide_gluon, block_m=64, block_n=128, num_stages=5),
         lambda tt: ops.down_proj(h, w_d, routing, tt, rw)),
        ("d_x gluon tma", r(wide_gluon, num_stages=2),
         lambda tt: ops.d_x_rows(dgu, w_g, w_u, routing, tt)),
        ("d_x gluon tma 128x128", r(wide_gluon, block_n=128, num_stages=3),
         lambda tt: ops.d_x_rows(dgu, w_g, w_u, routing, tt)),
        ("d_x gluon tma 128x128 s2", r(wide_gluon, block_n=128, num_stages=2),
         lambda tt: ops.d_x_rows(dgu, w_g, w_u, routing, tt)),
        ("d_x gluon tma 64x128 s4", r(wide_gluon, block_m=64, block_n=128, num_stages=4),
         lambda tt: ops.d_x_rows(dgu, w_g, w_u, routing, tt)),
    ]
    # dSwiGLU by the warp-specialized Gluon kernel: kept (gate_up read, h written; at block_n
    # 128 its epilogue in column halves) and recomputing (three accumulators: block_n 64), the
    # shared expert's without router weights.
    kept_gluon = r(t["down_bwd_saved"], block_m=128, block_n=128, block_k=64, num_stages=4,
                   epilogue_split=1, gluon=True)
    recompute_gluon = r(t["down_bwd"], block_m=128, block_n=64, block_k=64, num_stages=3,
                        epilogue_split=1, gluon=True)

    def kept_bwd(limit, weights=rw):
        return lambda tt: ops.down_bwd_dswiglu(d_out, x, w_d, w_g, w_u, h, routing, tt, weights,
                                               limit, gate_up=dgu, h_out=True)

    def recompute_bwd(limit, weights=rw):
        return lambda tt: ops.down_bwd_dswiglu(d_out, x, w_d, w_g, w_u, h, routing, tt, weights,
                                               limit)

    runs += [
        ("down_bwd saved gluon tma", kept_gluon, kept_bwd(None)),
        ("down_bwd saved gluon tma limit", kept_gluon, kept_bwd(7.0)),
        ("down_bwd saved gluon tma 128x64 s6", r(kept_gluon, block_n=64, num_stages=6),
         kept_bwd(7.0)),
        ("down_bwd saved gluon tma s3", r(kept_gluon, num_stages=3), kept_bwd(7.0)),
        ("down_bwd saved shared gluon tma", kept_gluon, kept_bwd(None, None)),
        ("down_bwd saved gluon tma 64x128 s5", r(kept_gluon, block_m=64, num_stages=5),
         kept_bwd(7.0)),
        ("down_bwd saved gluon tma 64x128 s5 pingpong",
         r(kept_gluon, block_m=64, num_stages=5, pingpong=True), kept_bwd(7.0)),
        ("down_bwd saved gluon tma 64x128 s4 pingpong",
         r(kept_gluon, block_m=64, num_stages=4, pingpong=True), kept_bwd(None)),
        ("down_bwd gluon tma", recompute_gluon, recompute_bwd(None)),
        ("down_bwd gluon tma limit", recompute_gluon, recompute_bwd(7.0)),
        ("down_bwd shared gluon tma", recompute_gluon, recompute_bwd(7.0, None)),
        ("down_bwd gluon tma split", r(recompute_gluon, epilogue_split=2), recompute_bwd(7.0)),
        ("down_bwd gluon tma 128x64x32 s6", r(recompute_gluon, block_k=32, num_stages=6),
         recompute_bwd(7.0)),
        ("down_bwd gluon tma 64x64 s4", r(recompute_gluon, block_m=64, num_stages=4),
         recompute_bwd(7.0)),
        ("down_bwd gluon tma 64x64 s4 pingpong",
         r(recompute_gluon, block_m=64, num_stages=4, pingpong=True), recompute_bwd(7.0)),
    ]
    # Other shapes of the kept dSwiGLU tile (its 64 x 128 runs two to an SM at 290 TFLOP/s).
    saved = next(run for label, _, run in runs if label == "down_bwd saved tma rows")
    runs += [(f"down_bwd saved tma rows {label}", r(t["down_bwd_saved"], tma=True, tma_rows=True,
                                                    **shape), saved)
             for label, shape in (
                 ("64x256x64 w8 s3", dict(block_m=64, block_n=256, block_k=64, num_warps=8,
                                          num_stages=3)),
                 ("128x64x64 w4 s4", dict(block_m=128, block_n=64, block_k=64, num_warps=4,
                                          num_stages=4)),
                 ("128x128x64 w4 s3", dict(block_m=128, block_n=128, block_k=64, num_warps=4,
                                           num_stages=3)),
                 ("128x128x64 w4 s3 split", dict(block_m=128, block_n=128, block_k=64,
                                                 num_warps=4, num_stages=3, epilogue_split=2)))]
    def wgrad_gate_up(tt):
        return ops.grouped_wgrad_gate_up(dgu, x, routing, tt, gather_x=True, out_dtype=x.dtype)

    def wgrad_down(tt):
        return ops.grouped_wgrad(d_out, h, routing, tt, gather_a=True, gather_b=False,
                                 router_weights=rw, out_dtype=x.dtype)

    for label, variant in (("", {}), (" persistent", dict(persistent=True)),
                           (" s4", dict(num_stages=4)), (" s5", dict(num_stages=5)),
                           (" pair", dict(pair=True)), (" pair s4", dict(pair=True, num_stages=4)),
                           (" pair persistent", dict(pair=True, persistent=True)),
                           (" pair 128x128x32 s4", dict(pair=True, block_k=32, num_stages=4)),
                           (" 128x256", dict(block_n=256)),
                           (" 128x256 persistent", dict(block_n=256, persistent=True))):
        runs.append((f"wgrad_gate_up{label}", r(HOPPER_TILES.wgrad, **variant), wgrad_gate_up))
    for label, variant in (("", {}), (" persistent", dict(persistent=True)),
                           (" s4", dict(num_stages=4)), (" 128x256", dict(block_n=256))):
        runs.append((f"wgrad_down{label}", r(HOPPER_TILES.wgrad, **variant), wgrad_down))
    runs.append(("wgrad_gate_up tuned", t["wgrad_gate_up"], wgrad_gate_up))
    # The gate/up weight gradient by the warp-specialized Gluon kernel (WgradTiles.gluon).
    experts_ops._check_gluon_wgrad = lambda *args, **kwargs: None
    wgrad_gluon = r(HOPPER_TILES.wgrad, block_m=256, block_n=128, block_k=64, num_stages=3,
                    gluon=True)
    runs += [("wgrad_gate_up gluon tma 256x128", wgrad_gluon, wgrad_gate_up),
             ("wgrad_gate_up gluon tma 128x128 s4", r(wgrad_gluon, block_m=128, num_stages=4),
              wgrad_gate_up),
             # down's: block_m along H, block_n along I (its tiles transposed in the kernel)
             ("wgrad_down gluon tma 128x256", r(wgrad_gluon, block_m=128, block_n=256),
              wgrad_down),
             ("wgrad_down gluon tma 128x128 s4", r(wgrad_gluon, block_m=128, num_stages=4),
              wgrad_down)]
    # Expert parallelism: the launches that pull the group's tokens in their first programs (the
    # table's tiles with TMA weights; persistent ones take their tiles from a shared counter),
    # two ranks' tokens.
    from mok.ops import comm

    i64 = dict(dtype=torch.int64)
    peer = comm.PeerFlags(torch.empty(16, **i64), torch.empty(2, **i64), torch.empty(3, **i64),
                          torch.empty(4, **i32), 0, 2, 10**9)
    x_group = torch.empty(2 * tokens, hid, **bf16)

    def pull(second, weights=None):
        weights = not second if weights is None else weights
        return comm.Pull(peer, x, torch.empty(2, **i64), rw.view(-1) if weights else None,
                         torch.empty(2, **i64) if weights else None,
                         torch.empty(2 * tokens * k, dtype=torch.float32) if weights else None,
                         torch.empty(2 * tokens, **i32), torch.empty(2 * tokens, **i32),
                         torch.empty(1, **i32), torch.empty(16, **i64), 1, 1, tokens // 2, k,
                         64, 128, x if second else None)

    ep_tiles = {kind: r(tiles(kind, inter, hid), tma=True)
                for kind in ("gate_up", "gate_up_saved", "down_bwd", "down_bwd_saved", "d_x")}
    runs.append(("gate_up EP pull tma", ep_tiles["gate_up"], lambda tt: ops.gate_up_swiglu(
        x_group, w_g, w_u, routing, tt, None, pull=pull(False))))
    runs.append(("gate_up saving EP pull tma", ep_tiles["gate_up_saved"],
                 lambda tt: ops.gate_up_swiglu(x_group, w_g, w_u, routing, tt, None,
                                               pull=pull(False), gate_up=dgu)))
    runs.append(("down_bwd EP pull tma", ep_tiles["down_bwd"],
                 lambda tt: ops.down_bwd_dswiglu(d_out, x_group, w_d, w_g, w_u, h, routing, tt,
                                                 rw, None, pull=pull(True))))
    runs.append(("down_bwd saved EP pull tma", ep_tiles["down_bwd_saved"],
                 lambda tt: ops.down_bwd_dswiglu(d_out, x_group, w_d, w_g, w_u, h, routing, tt,
                                                 rw, None, pull=pull(True), gate_up=dgu,
                                                 h_out=True)))
    runs.append(("d_x EP pull x tma", ep_tiles["d_x"],  # x for the weight gradients, kept h
                 lambda tt: ops.d_x_rows(dgu, w_g, w_u, routing, tt, scatter=comm.ScatterRows(
                     torch.empty(rows, hid, **bf16), torch.empty(2, **i64), routing.row_route,
                     tokens * k), pull=pull(False, weights=False), pulled=x_group)))
    # The Gluon gate/up pulling in a partition of its own (expert parallelism).
    in_gluon = dataclasses.replace(pull(False), in_gluon=True)
    runs.append(("gate_up EP pull gluon tma", gluon, lambda tt: ops.gate_up_swiglu(
        x_group, w_g, w_u, routing, tt, None, pull=in_gluon)))
    runs.append(("gate_up saving EP pull gluon tma limit", gluon, lambda tt: ops.gate_up_swiglu(
        x_group, w_g, w_u, routing, tt, 7.0, pull=in_gluon, gate_up=dgu)))
    runs.append(("gate_up EP pull gluon tma 64x128 s5", r(gluon, block_m=64, num_stages=5),
                 lambda tt: ops.gate_up_swiglu(x_group, w_g, w_u, routing, tt, None,
                                               pull=in_gluon)))
    # The Gluon gate/up waiting on rows copied beside it (MoKConfig.fwd_copy_rows).
    copied = dataclasses.replace(
        pull(False), copied=True, num_programs=0, minibatch=tokens,
        order=torch.zeros(routing.capacity_rows // gluon.block_m, **i32))
    runs.append(("gate_up EP copied gluon tma", gluon, lambda tt: ops.gate_up_swiglu(
        x_group, w_g, w_u, routing, tt, None, pull=copied)))
    runs.append(("gate_up saving EP copied gluon tma limit", gluon,
                 lambda tt: ops.gate_up_swiglu(x_group, w_g, w_u, routing, tt, 7.0, pull=copied,
                                               gate_up=dgu)))
    # The Gluon dSwiGLU waiting on rows copied beside it (MoKConfig.bwd_copy_rows).
    for label, tt, kept in (("down_bwd EP copied gluon tma", recompute_gluon, False),
                            ("down_bwd saved EP copied gluon tma", kept_gluon, True)):
        copied_bwd = dataclasses.replace(
            pull(False, weights=False), copied=True, num_programs=0, minibatch=tokens,
            order=torch.zeros(routing.capacity_rows // tt.block_m, **i32))
        runs.append((label, tt, lambda tt, kept=kept, pull=copied_bwd: ops.down_bwd_dswiglu(
            d_out, x_group, w_d, w_g, w_u, h, routing, tt, rw, 7.0, pull=pull,
            gate_up=dgu if kept else None, h_out=kept)))
    # The Gluon down and d_x scattering their rows to the tokens' ranks (expert parallelism).
    scatter = comm.ScatterRows(torch.empty(tokens * k, hid, **bf16), torch.empty(2, **i64),
                               routing.row_route, tokens * k)
    runs.append(("down EP scatter gluon tma", wide_gluon, lambda tt: ops.down_proj(
        h, w_d, routing, tt, rw, scatter=scatter)))
    runs.append(("down EP scatter gluon tma 128x128", r(wide_gluon, block_n=128, num_stages=4),
                 lambda tt: ops.down_proj(h, w_d, routing, tt, rw, scatter=scatter)))
    runs.append(("d_x EP scatter gluon tma", r(wide_gluon, num_stages=2),
                 lambda tt: ops.d_x_rows(dgu, w_g, w_u, routing, tt, scatter=scatter)))
    runs.append(("d_x EP scatter gluon tma 128x128", r(wide_gluon, block_n=128, num_stages=3),
                 lambda tt: ops.d_x_rows(dgu, w_g, w_u, routing, tt, scatter=scatter)))
    runs.append(("d_x EP scatter pull x gluon tma", r(wide_gluon, num_stages=2),
                 lambda tt: ops.d_x_rows(dgu, w_g, w_u, routing, tt, scatter=scatter,
                                         pull=pull(False, weights=False), pulled=x_group)))
    runs.append(("d_x EP scatter pull x gluon tma 128x128", r(wide_gluon, block_n=128,
                                                               num_stages=3),
                 lambda tt: ops.d_x_rows(dgu, w_g, w_u, routing, tt, scatter=scatter,
                                         pull=pull(False, weights=False), pulled=x_group)))
    # The FP8 row GEMMs (mok.ops.fp8, e4m3 wgmma, K steps of the scales' 128-blocks).
    if hid % 128 == 0 and inter % 128 == 0:
        from mok.ops import fp8

        e4m3 = dict(dtype=torch.float8_e4m3fn)

        def quantized(*size):  # e4m3 data and a scale per 128-block of its last two dims
            blocks = [*size[:-2], *(triton_cdiv(n, 128) for n in size[-2:])]
            if len(size) == 2:
                blocks[0] = size[0]
            return ops.Quantized(torch.empty(*size, **e4m3), torch.empty(*blocks))

        x8, g8 = quantized(tokens, hid), quantized(experts, inter, hid)
        runs += [  # the quantization kernel has no product: its tiles only label the run
            ("quantize rows fp8", ops.fp8_tiles("gate_up", 128), lambda tt: ops.quantize_rows(x)),
            ("quantize weights fp8 pow2", ops.fp8_tiles("gate_up", 128),
             lambda tt: ops.quantize_weights(w_g, pow2_scales=True)),
            ("gate_up fp8", ops.fp8_tiles("gate_up", 128),
             lambda tt: fp8.gate_up_swiglu_fp8(x8, g8, g8, routing, tt)),
            ("gate_up fp8 limit h bf16", ops.fp8_tiles("gate_up", 128),
             lambda tt: fp8.gate_up_swiglu_fp8(x8, g8, g8, routing, tt, 7.0, quantize_h=False)),
            ("down fp8", ops.fp8_tiles("down", 128), lambda tt: fp8.down_proj_fp8(
                quantized(rows, inter), quantized(experts, hid, inter), routing, tt, rw.view(-1))),
            ("gate_up fp8 keeping limit", ops.fp8_tiles("gate_up", 128),
             lambda tt: fp8.gate_up_swiglu_fp8(x8, g8, g8, routing, tt, 7.0, gate_up=dgu)),
            ("gate_up saving fp8 limit", ops.fp8_tiles("gate_up_saved", 128),
             lambda tt: fp8.gate_up_fp8(x8, g8, g8, routing, tt, 7.0)),
            ("down_bwd saved fp8 limit", ops.fp8_tiles("down_bwd_saved", 128),
             lambda tt: fp8.dswiglu_fp8(
                x8, quantized(experts, inter, hid), dgu, routing, tt, rw.view(-1), 7.0)),
            ("down_bwd saved apart fp8 limit", ops.fp8_tiles("down_bwd_saved", 128),
             lambda tt: fp8.dswiglu_fp8(
                x8, quantized(experts, inter, hid), dgu, routing, tt, rw.view(-1), 7.0,
                apart=True)),
            ("d_x fp8", ops.fp8_tiles("d_x", 128), lambda tt: fp8.d_x_rows_fp8(
                quantized(rows, 2 * inter), quantized(experts, hid, 2 * inter), routing, tt)),
        ]
        # The FP8 weight gradients (mok.ops.fp8_wgrad): codes [N, rows], scales per 128 rows.
        from mok.ops import fp8_wgrad

        def by_rows(width):
            return ops.Quantized(torch.empty(width, rows, **e4m3),
                                 torch.empty(rows // fp8_wgrad._rows_per_slot(routing), width))

        from mok.ops.tuning import FP8_WGRAD_TILES as wgrad8
        runs += [
            ("wgrad_down fp8", wgrad8, lambda tt: fp8_wgrad.grouped_wgrad_fp8_quantized(
                by_rows(hid), by_rows(inter), routing, tt, out_dtype=torch.bfloat16)),
            ("wgrad_gate_up fp8", wgrad8, lambda tt: fp8_wgrad.grouped_wgrad_fp8_quantized(
                by_rows(2 * inter), by_rows(hid), routing, tt, out_dtype=torch.bfloat16,
                split=inter)),
            *((f"wgrad_gate_up fp8 {m}x{n} w{w} s{st}",
               dataclasses.replace(wgrad8, block_m=m, block_n=n, num_warps=w, num_stages=st),
               lambda tt: fp8_wgrad.grouped_wgrad_fp8_quantized(
                   by_rows(2 * inter), by_rows(hid), routing, tt, out_dtype=torch.bfloat16,
                   split=inter))
              for m, n, w, st in ((128, 128, 8, 4), (128, 128, 4, 4), (128, 256, 8, 3),
                                  (64, 256, 4, 3), (64, 128, 4, 6))),
            ("quantize rows fp8 for weight gradients", wgrad8,
             lambda tt: fp8_wgrad.quantize_row_blocks(x, routing, gather=True,
                                                      router_weights=rw)),
            ("quantize rows fp8 for weight gradients from codes", wgrad8,
             lambda tt: fp8_wgrad.quantize_row_blocks(x8, routing, gather=True,
                                                      router_weights=rw)),
            ("quantize rows fp8 for weight gradients from codes in halves", wgrad8,
             lambda tt: fp8_wgrad.quantize_row_blocks(quantized(rows, 2 * inter), routing,
                                                      gather=False, halves=inter)),
        ]
        # The Gluon FP8 kernels (mok.kernels.gluon_fp8, gluon_fp8_wgrad), as an sm_90 GPU would
        # run them.
        fp8.gluon_takes_fp8 = lambda *args, **kwargs: True
        fp8_wgrad.gluon_takes_fp8_wgrad = lambda *args, **kwargs: True
        from mok.ops.tuning import FP8_WGRAD_GLUON_TILES as wgrad8_gluon
        runs += [
            ("quantize rows fp8 for weight gradients gluon", wgrad8_gluon,
             lambda tt: _gluon_quantize(fp8_wgrad, x, routing, gather=True, router_weights=rw)),
            ("quantize rows fp8 for weight gradients gluon by row", wgrad8_gluon,
             lambda tt: _gluon_quantize(fp8_wgrad, h, routing, gather=False)),
            ("quantize rows fp8 for weight gradients gluon from codes", wgrad8_gluon,
             lambda tt: _gluon_quantize(fp8_wgrad, x8, routing, gather=True, router_weights=rw)),
            ("quantize rows fp8 for weight gradients gluon from codes in halves", wgrad8_gluon,
             lambda tt: _gluon_quantize(fp8_wgrad, quantized(rows, 2 * inter), routing,
                                        gather=False, halves=inter)),
            ("wgrad_down fp8 gluon tma", wgrad8_gluon,
             lambda tt: fp8_wgrad.grouped_wgrad_fp8_quantized(
                 by_rows(hid), by_rows(inter), routing, tt, out_dtype=torch.bfloat16)),
            ("wgrad_gate_up fp8 gluon tma", wgrad8_gluon,
             lambda tt: fp8_wgrad.grouped_wgrad_fp8_quantized(
                 by_rows(2 * inter), by_rows(hid), routing, tt, out_dtype=torch.bfloat16,
                 split=inter)),
            ("wgrad_down fp8 gluon tma 128x256", r(wgrad8_gluon, block_n=256),
             lambda tt: fp8_wgrad.grouped_wgrad_fp8_quantized(
                 by_rows(hid), by_rows(inter), routing, tt, out_dtype=torch.bfloat16)),
            ("wgrad_gate_up fp8 gluon tma 128x256 fp32", r(wgrad8_gluon, block_n=256),
             lambda tt: fp8_wgrad.grouped_wgrad_fp8_quantized(
                 by_rows(2 * inter), by_rows(hid), routing, tt, out_dtype=torch.float32,
                 split=inter)),
            # H and I 64 short of a multiple of 128: each MMA partition picks its output
            ("wgrad_down fp8 gluon tma 128x256 partial", r(wgrad8_gluon, block_n=256),
             lambda tt: fp8_wgrad.grouped_wgrad_fp8_quantized(
                 by_rows(hid - 64), by_rows(inter - 64), routing, tt, out_dtype=torch.bfloat16)),
            ("wgrad_gate_up fp8 gluon tma 128x256 partial", r(wgrad8_gluon, block_n=256),
             lambda tt: fp8_wgrad.grouped_wgrad_fp8_quantized(
                 by_rows(2 * inter - 128), by_rows(hid - 64), routing, tt,
                 out_dtype=torch.bfloat16, split=inter - 64)),
        ]
        gate_up_gluon = ops.fp8_tiles("gate_up", 128, gluon=True)
        runs += [
            ("gate_up fp8 gluon tma", gate_up_gluon,
             lambda tt: fp8.gate_up_swiglu_fp8(x8, g8, g8, routing, tt)),
            ("gate_up fp8 gluon tma keeping limit", gate_up_gluon,
             lambda tt: fp8.gate_up_swiglu_fp8(x8, g8, g8, routing, tt, 7.0, gate_up=dgu)),
            ("gate_up fp8 gluon tma h fp32", gate_up_gluon,
             lambda tt: fp8.gate_up_swiglu_fp8(x8, g8, g8, routing, tt, quantize_h=False,
                                               out_dtype=torch.float32)),
            ("gate_up saving fp8 gluon tma limit", ops.fp8_tiles("gate_up_saved", 128, gluon=True),
             lambda tt: fp8.gate_up_fp8(x8, g8, g8, routing, tt, 7.0)),
            ("down_bwd saved apart fp8 gluon tma limit",
             ops.fp8_tiles("down_bwd_saved", 128, gluon=True),
             lambda tt: fp8.dswiglu_fp8(
                x8, quantized(experts, inter, hid), dgu, routing, tt, rw.view(-1), 7.0,
                apart=True)),
            ("down_bwd saved apart fp8 gluon tma 128x256",
             r(ops.fp8_tiles("down_bwd_saved", 128, gluon=True), block_n=256),
             lambda tt: fp8.dswiglu_fp8(
                x8, quantized(experts, inter, hid), dgu, routing, tt, rw.view(-1), 7.0,
                apart=True)),
        ]
        fp8_gluon = dataclasses.replace(ops.fp8_tiles("down", 128), block_m=128, num_stages=4,
                                        gluon=True)
        for label, variant in (("", {}), (" s5", dict(num_stages=5)),
                               (" 64x128 s6", dict(block_m=64, num_stages=6)),
                               (" 128x256 s3", dict(block_n=256, num_stages=3)),
                               (" 128x256 s4", dict(block_n=256))):
            runs += [
                (f"down fp8 gluon tma{label}", r(fp8_gluon, **variant),
                 lambda tt: fp8.down_proj_fp8(quantized(rows, inter),
                                              quantized(experts, hid, inter), routing, tt,
                                              rw.view(-1))),
                (f"d_x fp8 gluon tma{label}", r(fp8_gluon, **variant),
                 lambda tt: fp8.d_x_rows_fp8(quantized(rows, 2 * inter),
                                             quantized(experts, hid, 2 * inter), routing, tt)),
            ]
    if not args.json:
        print(f"{args.shape}: H={hid} I={inter} k={k}; sm_90; tiles (m, n, k, warps, stages)")
    rows_out = []
    for label, tt, run in [run for run in runs if args.match in run[0]]:
        RESULTS.clear()
        run(tt)
        rows_out += [dict(label=label, block_m=tt.block_m, block_n=tt.block_n,
                          block_k=tt.block_k, **res) for res in RESULTS]
        for res in ([] if args.json else RESULTS):
            tile = f"{tt.block_m}x{tt.block_n}x{tt.block_k} w{tt.num_warps} s{tt.num_stages}"
            if "error" in res:
                print(f"  {label:28s} {tile:20s} FAILED {res['error']}")
            else:
                print(f"  {label:28s} {tile:20s} regs {res['regs']:3d}  local "
                      f"{res['spills']:4d} B  stack {res['stack']:4d} B  smem "
                      f"{res['shared_kb']:6.1f} KB  wgmma "
                      f"{'yes' if res['wgmma'] else 'no '}  tma {'yes' if res['tma'] else 'no'}",
                      flush=True)
    if args.json:
        print(json.dumps(rows_out))


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


if __name__ == "__main__":
    main()
