"""mok's FP8 kernels beside their bf16 counterparts and the dense ceilings, per shape.

    python -m benchmarks.fp8 [--shapes qwen3-30b-a3b kimi-ep64-slice] [--repeats 20]

Per shape, one process, the same inputs (bf16 x [T, H] and expert weights, the schedule of
random routes), stage by stage:

  quantize   quantize_rows(x), quantize_weights of the three expert weights, and
             quantize_experts (the three with their transposed copies, what the layer
             quantizes per optimizer step): ms and GB/s (bytes read and written);
  gate_up    mok's bf16 gate/up with SwiGLU (the layer's plan and tiles), and
             gate_up_swiglu_fp8 (h in e4m3 with its scales; Triton, and on an sm_90 GPU
             Gluon);
  down       mok's bf16 down, and down_proj_fp8 on that h (the Triton kernel, and on an sm_90
             GPU the Gluon one; on sm_90 down, d_x and the dSwiGLU's GEMM apart also at
             128 x 256, mok_fp8_gluon_256_*, checked bit for bit against it);
  dswiglu    dswiglu_fp8 on random e4m3 d_output rows over the kept pre-activations (one
             Triton launch, and on an sm_90 GPU apart: the Gluon GEMM into fp32, then the
             dSwiGLU; dswiglu_rows times that second launch alone, GB/s, with several blocks,
             and without d_gate_up in bf16, mok_fp8_not_in_place);
  d_x        d_x_rows_fp8 on random e4m3 d_gate_up rows (Triton, Gluon);
  wgrad_*    the weight gradients of down and of gate/up: mok's bf16 launches (the layer's
             plan), grouped_wgrad_fp8 (its operands quantized along the rows, then the GEMM),
             and that GEMM alone (mok_fp8_gemm_only; on a GPU also with other tiles,
             mok_fp8_gemm_only_<tile>); random d_output and d_gate_up;
  quantize_rows_*  quantize_row_blocks of each weight gradient's operand (d_output by token
             with router weights, h, d_gate_up, x by token), from bf16 and (_e4m3) from e4m3
             rows with 1 x 128 scales, as the layer quantizes d_output, d_gate_up and x: ms and
             GB/s (the source read, e4m3 written, per schedule row);
  dense      the ceilings at gate/up's and down's FLOPs, all T*k routes as one matrix: bf16
             torch.mm, and e4m3 torch._scaled_mm with one scale per tensor.

Each FP8 launch is first checked against the same math on its dequantized operands
(max relative error column); the bf16 ones are mok's tested kernels. Times are medians of
--repeats calls between CUDA events, the GPU idle before each (the timing column: idle), or
with --host-ahead held busy while the host queues the call (queued: the kernels alone, without
the launch's latency, which weighs on launches of a few hundred microseconds and less);
TFLOP/s count 2 * rows * N * K per GEMM (gate/up two of them). Rows go to --csv
(benchmarks/results/fp8.csv). On CPU it runs a small shape under Triton's interpreter and
writes under runs/bench/: a check of the pipeline, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import math
import statistics
import time
from pathlib import Path

import torch

import mok.functional as F
from benchmarks import append_rows, commit_id
from benchmarks.timing import hold_device
from mok import ops, plan
from mok.arch import arch_of
from mok.ops import fp8_wgrad
from mok.ops.fp8 import down_proj_fp8, gate_up_swiglu_fp8, padded_width
from mok.ops.fp8_wgrad import gluon_takes_fp8_wgrad
from mok.ops.fp8_wgrad import grouped_wgrad_fp8_quantized as wgrad_fp8_quantized
from mok.ops.quantize import QUANT_BLOCK, quantize_rows, quantize_weights
from mok.ops.tuning import FP8_WGRAD_GLUON_TILES, FP8_WGRAD_TILES
from mok.reference import dequantize_e4m3, swiglu
from mok.testing import SHAPES_BY_NAME, MoEShape, make_shape_inputs

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "fp8.csv"
CPU_RESULTS = ROOT / "runs" / "bench" / "fp8.csv"
FIELDS = ("gpu", "commit", "date", "shape", "stage", "impl", "ms", "tflops", "gbps",
          "max_rel_err", "timing")
SMALL = MoEShape("fp8-small", 4, 256, 256, 2, 64)  # CPU: every launch, in seconds
FP8_SHAPES = {shape.name: shape for shape in (*SHAPES_BY_NAME.values(), SMALL)}
# Other tiles of the FP8 weight-gradient GEMM timed on a GPU: (block_m, block_n, warps, stages).
# Blocks of the dSwiGLU run apart timed (rows, warps, a row block's column blocks next to each
# other); mok.ops.fp8's is the first.
DSWIGLU_APART_VARIANTS = ((16, 8, True), (16, 8, False), (16, 4, True), (32, 8, True))


def _dswiglu_rows_with(rows: int, warps: int, columns_first: bool, *args) -> None:
    """mok.ops.fp8's dSwiGLU over dh0 computed apart, with [rows, 128] blocks of `warps`, a row
    block's column blocks next to each other in the grid or not."""
    from mok.ops import fp8

    before = fp8._DSWIGLU_ROWS, fp8._DSWIGLU_WARPS, fp8._DSWIGLU_COLUMNS_FIRST
    fp8._DSWIGLU_ROWS, fp8._DSWIGLU_WARPS, fp8._DSWIGLU_COLUMNS_FIRST = (rows, warps,
                                                                        columns_first)
    try:
        fp8._dswiglu_rows(*args)
    finally:
        fp8._DSWIGLU_ROWS, fp8._DSWIGLU_WARPS, fp8._DSWIGLU_COLUMNS_FIRST = before


WGRAD_FP8_VARIANTS = ((128, 128, 8, 4), (64, 128, 4, 6), (64, 128, 4, 4))


def median_ms(fn, device: torch.device, repeats: int, warmup: int,
              host_ahead: bool = False) -> float:
    """Median ms of `repeats` calls after `warmup`: CUDA events on a GPU (idle before each
    call; host_ahead: held busy while the call is queued), wall clock on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            if host_ahead:
                hold_device()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


def max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest |actual - expected| over the largest |expected|."""
    scale = expected.abs().max().clamp_min(1e-30)
    return float((actual.float() - expected).abs().max() / scale)


def fp8_checks(x_q, gate_q, up_q, down_q, h32, h_q, rows_out, routing, router_weights):
    """(gate/up's, down's) max relative error against the math on dequantized operands, over
    the schedule's rows in use (host syncs: this is a check, not the layer); h32: gate/up's
    output unquantized, h_q: quantized (down's input)."""
    row_route = routing.row_route.long()
    rows = (row_route >= 0).nonzero().flatten()
    routes = row_route[rows]
    experts = routing.block_expert.long()[rows // routing.align]
    x = dequantize_e4m3(x_q.data, x_q.scales, (1, QUANT_BLOCK))[routes // routing.topk]
    block = (QUANT_BLOCK, QUANT_BLOCK)
    gate, up, down = (dequantize_e4m3(w.data, w.scales, block) for w in (gate_q, up_q, down_q))
    h_expected = torch.empty(len(rows), gate.shape[1], device=x.device)
    y_expected = torch.empty(len(rows), down.shape[1], device=x.device)
    h = dequantize_e4m3(h_q.data, h_q.scales, (1, QUANT_BLOCK))[rows]
    for e in range(gate.shape[0]):  # an expert at a time: bounded memory at real shapes
        mine = experts == e
        h_expected[mine] = swiglu(x[mine] @ gate[e].T, x[mine] @ up[e].T)
        y_expected[mine] = (h[mine] @ down[e].T) * router_weights[routes[mine], None]
    h_err = max_rel_err(h32[rows], h_expected)
    y_err = max_rel_err(rows_out[rows], y_expected)
    return h_err, y_err


def d_x_checked(d_gate_up_q, gate_up_t, routing) -> torch.Tensor:
    """d_x's rows in use from the dequantized operands, an expert at a time."""
    row_route = routing.row_route.long()
    rows = (row_route >= 0).nonzero().flatten()
    experts = routing.block_expert.long()[rows // routing.align]
    d_gate_up = dequantize_e4m3(d_gate_up_q.data, d_gate_up_q.scales, (1, QUANT_BLOCK))[rows]
    w = dequantize_e4m3(gate_up_t.data, gate_up_t.scales, (QUANT_BLOCK, QUANT_BLOCK))
    out = torch.empty(len(rows), w.shape[1], device=w.device)
    for e in range(w.shape[0]):
        mine = experts == e
        out[mine] = d_gate_up[mine] @ w[e].T
    return out


def wgrad_checked(qa, qb, routing, out) -> float:
    """Max relative error of out [E, P, Q] (grouped_wgrad_fp8's) against the products of its
    dequantized operands (quantize_row_blocks': a scale per column and block of 128 of an
    expert's rows), an expert at a time."""
    offsets = routing.expert_offsets.long().tolist()
    sub = math.gcd(routing.align, QUANT_BLOCK)
    worst = 0.0
    for e in range(routing.num_local_experts):
        start, end = min(offsets[e], offsets[-1]), min(offsets[e + 1], offsets[-1])
        slots = start // sub + torch.arange(end - start, device=out.device) // QUANT_BLOCK
        a, b = (q.data[:, start:end].float() * q.scales[slots].T for q in (qa, qb))
        expected = a @ b.T
        worst = max(worst, max_rel_err(out[e], expected) if end > start else 0.0)
    return worst


def partial_checked(d_out_q, down_t, kept, routing) -> torch.Tensor:
    """dswiglu_fp8's router-weight partial sums (sum over each 128 columns of dh0 * h, dh0 =
    d_out[token] @ w_down[e] from the dequantized operands, h of the kept pre-activations) of
    the rows in use, an expert at a time."""
    row_route = routing.row_route.long()
    rows = (row_route >= 0).nonzero().flatten()
    experts = routing.block_expert.long()[rows // routing.align]
    d_out = dequantize_e4m3(d_out_q.data, d_out_q.scales, (1, QUANT_BLOCK))[
        row_route[rows] // routing.topk]
    w = dequantize_e4m3(down_t.data, down_t.scales, (QUANT_BLOCK, QUANT_BLOCK))
    inter = w.shape[1]
    h = swiglu(kept[rows, :inter].float(), kept[rows, inter:].float())
    out = torch.empty(len(rows), inter // QUANT_BLOCK, device=w.device)
    for e in range(w.shape[0]):
        mine = experts == e
        out[mine] = ((d_out[mine] @ w[e].T) * h[mine]).reshape(-1, inter // QUANT_BLOCK,
                                                              QUANT_BLOCK).sum(-1)
    return out


def quantize_stages(routing, operands: dict) -> list:
    """The quantize_rows_<name> stages: quantize_row_blocks of operands {name: (src, gather,
    router weights, halves)}, src a tensor or e4m3 rows (Quantized), bytes per schedule row
    (src read with its scales, e4m3 written): row_blocks the layer's kernel. Where the Gluon
    kernel can run, also the Triton kernel (row_blocks_triton) and the Gluon kernel with each
    of QUANTIZE_THREADS (for e4m3 sources too), each checked bit for bit against the Triton
    kernel first."""
    stages = []
    for name, (src, gather, weights, halves) in operands.items():
        data = src.data if isinstance(src, ops.Quantized) else src
        width = 2 * halves if halves else data.shape[1]
        read = data.element_size() + (4 / QUANT_BLOCK if data is not src else 0)
        bytes_ = routing.capacity_rows * width * (read + 1)
        run = functools.partial(ops.quantize_row_blocks, src, routing, gather=gather,
                                router_weights=weights, halves=halves)
        stages.append((f"quantize_rows_{name}", "row_blocks", run, 0, bytes_))
        if not _quantize_with(True, None, functools.partial(
                fp8_wgrad.gluon_takes_quantize_rows, data, halves)):
            continue
        triton_run = functools.partial(_quantize_with, False, None, run)
        theirs = triton_run()
        stages.append((f"quantize_rows_{name}", "row_blocks_triton", triton_run, 0, bytes_))
        for threads in (None, *QUANTIZE_THREADS):
            mine = _quantize_with(True, threads, run)
            same = all(torch.equal(a, b) for a, b in zip(_written(mine, routing),
                                                         _written(theirs, routing), strict=True))
            label = "row_blocks" if threads is None else "row_blocks_{}x{}_w{}".format(*threads)
            print(f"   quantize_rows_{name} {label} against the Triton kernel: bit for bit "
                  f"{same}", flush=True)
            if threads is not None:
                stages.append((f"quantize_rows_{name}", label,
                               functools.partial(_quantize_with, True, threads, run), 0, bytes_))
    return stages


# Other threads of the Gluon quantize_row_blocks (rows, columns a thread, warps)
QUANTIZE_THREADS = ((16, 4, 4), (8, 8, 4), (8, 4, 8), (4, 16, 4))


def _written(quantized, routing) -> tuple[torch.Tensor, torch.Tensor]:
    """What quantize_row_blocks writes (the rest of its buffers is left as allocated): the
    codes (as bytes) of the rows in use, the scales of each expert's blocks."""
    offsets = routing.expert_offsets.tolist()
    sub = math.gcd(routing.align, QUANT_BLOCK)
    slots = [quantized.scales[start // sub:start // sub + math.ceil((end - start) / QUANT_BLOCK)]
             for start, end in zip(offsets[:-1], offsets[1:], strict=True)]
    return quantized.data[:, :offsets[-1]].view(torch.uint8), torch.cat(slots)


def _quantize_with(gluon: bool, threads, run):
    """run() with the Gluon quantize_row_blocks on or off (for e4m3 sources too), with these
    threads."""
    saved = (fp8_wgrad._GLUON_QUANTIZE, fp8_wgrad._GLUON_QUANTIZE_CODES,
             fp8_wgrad._GLUON_QUANTIZE_THREADS)
    fp8_wgrad._GLUON_QUANTIZE = fp8_wgrad._GLUON_QUANTIZE_CODES = gluon
    fp8_wgrad._GLUON_QUANTIZE_THREADS = threads or saved[2]
    try:
        return run()
    finally:
        (fp8_wgrad._GLUON_QUANTIZE, fp8_wgrad._GLUON_QUANTIZE_CODES,
         fp8_wgrad._GLUON_QUANTIZE_THREADS) = saved


def shape_schedule(shape: MoEShape, device: torch.device):
    """(inputs, schedule) of a shape: mok.testing's inputs (seed 7) and the layer's schedule of
    their routes."""
    inputs = make_shape_inputs(shape, device=device, seed=7)
    config = F.MoKConfig()
    workspace = F.create_workspace(config, None, device=device, num_local_tokens=shape.num_tokens,
                                   hidden_size=shape.hidden_size, topk=shape.topk)
    schedule = F.build_schedule(workspace, config, inputs.topk_experts,
                                num_local_experts=shape.num_experts)
    return inputs, schedule


def bench_shape(shape: MoEShape, device: torch.device, repeats: int, warmup: int, *,
                only: tuple[str, ...] = (), host_ahead: bool = False) -> list[dict]:
    """The rows of one shape's stages (only: those whose names start so; default all;
    host_ahead: median_ms's)."""
    inputs, schedule = shape_schedule(shape, device)
    x, router_weights = inputs.x, inputs.router_weights.reshape(-1).float()
    w_gate, w_up, w_down = inputs.routed_weights
    routing = schedule.routing
    hidden, inter = shape.hidden_size, shape.intermediate_size
    forward = plan.forward_plan(schedule.tiles, plan.Operands.of(x, w_gate, w_up, w_down),
                                hidden=hidden, intermediate=inter, keep_gate_up=False)
    # The FP8 plan's tiles, within the schedule's alignment (32 under the interpreter).
    tiles, down_tiles, d_x_tiles = (ops.fp8_tiles(kind, routing.align)
                                    for kind in ("gate_up", "down", "d_x"))
    # The warp-specialized Gluon kernels' tiles where the GPU runs them (the plan's choice).
    gluon = arch_of(device).warp_specialized
    gluon_tiles = {kind: ops.fp8_tiles(kind, routing.align, gluon=True)
                   for kind in ("gate_up", "down", "down_bwd_saved", "d_x")} if gluon else {}
    dswiglu_tiles = ops.fp8_tiles("down_bwd_saved", routing.align)
    x_q = quantize_rows(x)
    gate_q, up_q, down_q = (quantize_weights(w) for w in (w_gate, w_up, w_down))
    h = ops.gate_up_swiglu(x, w_gate, w_up, routing, forward.gate_up, None)
    h_q = gate_up_swiglu_fp8(x_q, gate_q, up_q, routing, tiles)
    h32 = gate_up_swiglu_fp8(x_q, gate_q, up_q, routing, tiles, quantize_h=False,
                             out_dtype=torch.float32)
    rows_out = down_proj_fp8(h_q, down_q, routing, down_tiles, router_weights,
                             out_dtype=torch.float32)
    h_err, y_err = fp8_checks(x_q, gate_q, up_q, down_q, h32, h_q, rows_out, routing,
                              router_weights)
    print(f"== {shape.name}: check against dequantized math: gate/up max rel "
          f"{h_err:.2e}, down {y_err:.2e}", flush=True)
    # d_x: random e4m3 d_gate_up rows against the transposed gate and up weights.
    d_gate_up_q = quantize_rows(torch.randn(routing.capacity_rows, 2 * inter, device=device,
                                            dtype=torch.bfloat16))
    fp8_experts = ops.quantize_experts(w_gate, w_up, w_down)
    gate_up_t = fp8_experts.gate_up_t
    # dSwiGLU: random e4m3 d_output rows against the transposed w_down, over the kept
    # pre-activations (each call writes d_gate_up over its buffer: timed calls after the first
    # read earlier gradients, which costs the kernels the same)
    d_out_q = quantize_rows(torch.randn_like(x))
    kept = ops.gate_up_fp8(x_q, gate_q, up_q, routing, ops.fp8_tiles("gate_up_saved",
                                                                      routing.align))
    kept_buffers = {impl: kept.clone() for impl in ("mok_fp8", "mok_fp8_apart", "rows")}
    _, _, partial = ops.dswiglu_fp8(d_out_q, fp8_experts.down_t, kept.clone(), routing,
                                    dswiglu_tiles, router_weights)
    dswiglu_err = max_rel_err(partial[routing.row_route >= 0],
                              partial_checked(d_out_q, fp8_experts.down_t, kept, routing))
    used = routing.row_route >= 0
    d_x_rows = ops.d_x_rows_fp8(d_gate_up_q, gate_up_t, routing, d_x_tiles,
                                out_dtype=torch.float32)
    d_x_err = max_rel_err(d_x_rows[used], d_x_checked(d_gate_up_q, gate_up_t, routing))
    errors = {("gate_up", "mok_fp8"): h_err, ("down", "mok_fp8"): y_err,
              ("dswiglu", "mok_fp8"): dswiglu_err, ("d_x", "mok_fp8"): d_x_err}
    print(f"   dswiglu (its router-weight partial sums) max rel {dswiglu_err:.2e}, d_x "
          f"{d_x_err:.2e}", flush=True)
    if gluon:  # the Gluon launches against the Triton ones (same products and K order)
        mine = gate_up_swiglu_fp8(x_q, gate_q, up_q, routing, gluon_tiles["gate_up"],
                                  quantize_h=False, out_dtype=torch.float32)
        errors[("gate_up", "mok_fp8_gluon")] = max_rel_err(mine[used], h32[used])
        mine = down_proj_fp8(h_q, down_q, routing, gluon_tiles["down"], router_weights,
                             out_dtype=torch.float32)
        errors[("down", "mok_fp8_gluon")] = max_rel_err(mine[used], rows_out[used])
        mine = ops.d_x_rows_fp8(d_gate_up_q, gate_up_t, routing, gluon_tiles["d_x"],
                                out_dtype=torch.float32)
        errors[("d_x", "mok_fp8_gluon")] = max_rel_err(mine[used], d_x_rows[used])
        theirs = kept.clone()
        ops.dswiglu_fp8(d_out_q, fp8_experts.down_t, theirs, routing, dswiglu_tiles,
                        router_weights)
        # apart: the Gluon GEMM into fp32, then the dSwiGLU; against the one Triton launch
        mine = kept.clone()
        q_apart = ops.dswiglu_fp8(d_out_q, fp8_experts.down_t, mine, routing,
                                  gluon_tiles["down_bwd_saved"], router_weights, apart=True)[0]
        q_one = ops.dswiglu_fp8(d_out_q, fp8_experts.down_t, kept.clone(), routing,
                                dswiglu_tiles, router_weights)[0]
        errors[("dswiglu", "mok_fp8_apart")] = max_rel_err(mine[used], theirs[used].float())
        same = (torch.equal(mine[used], theirs[used])
                and torch.equal(q_apart.data[used].view(torch.uint8),
                                q_one.data[used].view(torch.uint8)))
        print(f"   dswiglu apart against one Triton launch: max rel "
              f"{errors[('dswiglu', 'mok_fp8_apart')]:.2e}, bit for bit: {same}", flush=True)
        print(f"   Gluon against Triton: gate/up max rel "
              f"{errors[('gate_up', 'mok_fp8_gluon')]:.2e}, down "
              f"{errors[('down', 'mok_fp8_gluon')]:.2e}, d_x "
              f"{errors[('d_x', 'mok_fp8_gluon')]:.2e}", flush=True)

    # The weight gradients: bf16 with the layer's plan, and on e4m3 operands (the four
    # quantizing launches included, and the GEMMs alone); random d_output and d_gate_up.
    backward = plan.backward_plan(schedule.tiles, plan.Operands.of(x, w_gate, w_up, w_down),
                                  hidden=hidden, intermediate=inter, kept=True)
    d_out = torch.randn_like(x)
    d_gate_up = torch.randn(routing.capacity_rows, 2 * inter, device=device, dtype=x.dtype)
    wgrad_ops = dict(
        down_bf16=lambda: ops.grouped_wgrad(d_out, h, routing, backward.wgrad_down,
                                            gather_a=True, gather_b=False,
                                            router_weights=router_weights, out_dtype=x.dtype),
        gate_up_bf16=lambda: ops.grouped_wgrad_gate_up(d_gate_up, x, routing,
                                                       backward.wgrad_gate_up, gather_x=True,
                                                       out_dtype=x.dtype),
        down_fp8=lambda: ops.grouped_wgrad_fp8(d_out, h, routing, gather_a=True, gather_b=False,
                                               router_weights=router_weights,
                                               out_dtype=x.dtype),
        gate_up_fp8=lambda: ops.grouped_wgrad_fp8(d_gate_up, x, routing, gather_a=False,
                                                  gather_b=True, out_dtype=x.dtype, split=inter))
    quantized = {name: ops.quantize_row_blocks(t, routing, gather=gather)
                 for name, t, gather in (("d_out", d_out, True), ("h", h, False),
                                         ("d_gate_up", d_gate_up, False), ("x", x, True))}
    wgrad_ops.update(
        down_fp8_gemm=lambda: wgrad_fp8_quantized(quantized["d_out"], quantized["h"], routing,
                                                  out_dtype=x.dtype),
        gate_up_fp8_gemm=lambda: wgrad_fp8_quantized(quantized["d_gate_up"], quantized["x"],
                                                     routing, out_dtype=x.dtype, split=inter))
    # Other tiles of the FP8 weight-gradient GEMM (FP8_WGRAD_TILES is the layer's).
    wgrad_variants = {"down": {}, "gate_up": {}}
    for block_m, block_n, warps, stages_ in WGRAD_FP8_VARIANTS if device.type == "cuda" else ():
        variant = dataclasses.replace(FP8_WGRAD_TILES, block_m=block_m, block_n=block_n,
                                      num_warps=warps, num_stages=stages_)
        label = f"{block_m}x{block_n}_w{warps}_s{stages_}"
        wgrad_variants["down"][label] = functools.partial(
            wgrad_fp8_quantized, quantized["d_out"], quantized["h"], routing, variant,
            out_dtype=x.dtype)
        wgrad_variants["gate_up"][label] = functools.partial(
            wgrad_fp8_quantized, quantized["d_gate_up"], quantized["x"], routing, variant,
            out_dtype=x.dtype, split=inter)
    # The Gluon kernel (sm_90, the schedule's alignment a multiple of 128), with 3 to 6 stages,
    # and at 128 x 256 (stages as they fit).
    for block_n, stages_ in ((128, 5), (128, 4), (128, 6), (128, 3), (256, 5)) if gluon else ():
        variant = dataclasses.replace(FP8_WGRAD_GLUON_TILES, block_n=block_n,
                                      num_stages=stages_)
        label = f"gluon_s{stages_}" if block_n == 128 else f"gluon_{block_n}"
        for kind, a, b, split in (("down", "d_out", "h", None),
                                  ("gate_up", "d_gate_up", "x", inter)):
            if gluon_takes_fp8_wgrad(quantized[a], quantized[b], routing, variant, x.dtype,
                                     split):
                wgrad_variants[kind][label] = functools.partial(
                    wgrad_fp8_quantized, quantized[a], quantized[b], routing, variant,
                    out_dtype=x.dtype, split=split)
    if "gluon_s5" in wgrad_variants["gate_up"]:  # against the Triton kernel (same blocks, order)
        for kind, a, b, split in (("down", "d_out", "h", None),
                                  ("gate_up", "d_gate_up", "x", inter)):
            mine, theirs = (wgrad_fp8_quantized(quantized[a], quantized[b], routing, t,
                                                out_dtype=torch.float32, split=split)
                            for t in (FP8_WGRAD_GLUON_TILES, FP8_WGRAD_TILES))
            mine, theirs = (torch.cat(o, 1) if split else o for o in (mine, theirs))
            errors[(f"wgrad_{kind}", "mok_fp8_gemm_only_gluon_s5")] = max_rel_err(mine, theirs)
            print(f"   wgrad_{kind}: Gluon against Triton max rel "
                  f"{errors[(f'wgrad_{kind}', 'mok_fp8_gemm_only_gluon_s5')]:.2e}, bit for bit "
                  f"{torch.equal(mine, theirs)}", flush=True)
            if "gluon_256" in wgrad_variants[kind]:  # the same products in the same order
                wide = wgrad_fp8_quantized(
                    quantized[a], quantized[b], routing,
                    dataclasses.replace(FP8_WGRAD_GLUON_TILES, block_n=256),
                    out_dtype=torch.float32, split=split)
                wide = torch.cat(wide, 1) if split else wide
                errors[(f"wgrad_{kind}", "mok_fp8_gemm_only_gluon_256")] = max_rel_err(wide,
                                                                                      mine)
                print(f"   wgrad_{kind}: Gluon 128 x 256 against 128 x 128 bit for bit "
                      f"{torch.equal(wide, mine)}", flush=True)
    for kind, a, b in (("down", "d_out", "h"), ("gate_up", "d_gate_up", "x")):
        out = wgrad_fp8_quantized(quantized[a], quantized[b], routing, out_dtype=torch.float32)
        errors[(f"wgrad_{kind}", "mok_fp8")] = wgrad_checked(quantized[a], quantized[b],
                                                             routing, out)
    print(f"   weight gradients on e4m3 operands: down max rel "
          f"{errors[('wgrad_down', 'mok_fp8')]:.2e}, gate/up "
          f"{errors[('wgrad_gate_up', 'mok_fp8')]:.2e}", flush=True)
    routes = shape.num_tokens * shape.topk
    gemm = 2.0 * routes * hidden * inter
    weights_bytes = sum(w.numel() for w in (w_gate, w_up, w_down)) * 3  # bf16 in, e4m3 out
    dense = {}

    def dense_mm(m, k, n, fp8):
        key = (m, k, n, fp8)
        if key not in dense:
            a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
            if fp8:
                one = torch.ones((), device=device)
                a, b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
                dense[key] = lambda: torch._scaled_mm(a, b.T, one, one, out_dtype=torch.bfloat16)
            else:
                dense[key] = lambda: torch.mm(a, b.T)
        return dense[key]()

    stages = [
        ("quantize", "rows_x", lambda: quantize_rows(x), 0, x.numel() * 3),
        ("quantize", "weights", lambda: [quantize_weights(w) for w in (w_gate, w_up, w_down)], 0,
         weights_bytes),
        # what the layer quantizes per optimizer step: the three and their transposed copies
        ("quantize", "experts", lambda: ops.quantize_experts(w_gate, w_up, w_down), 0,
         weights_bytes + sum(w.numel() for w in (w_gate, w_up, w_down))),
        ("gate_up", "mok_bf16", lambda: ops.gate_up_swiglu(x, w_gate, w_up, routing,
                                                           forward.gate_up, None), 2 * gemm, 0),
        ("gate_up", "mok_fp8", lambda: gate_up_swiglu_fp8(x_q, gate_q, up_q, routing, tiles),
         2 * gemm, 0),
        ("down", "mok_bf16", lambda: ops.down_proj(h, w_down, routing, forward.down,
                                                   router_weights), gemm, 0),
        ("down", "mok_fp8", lambda: down_proj_fp8(h_q, down_q, routing, down_tiles,
                                                  router_weights), gemm, 0),
        ("dswiglu", "mok_fp8", lambda: ops.dswiglu_fp8(
            d_out_q, fp8_experts.down_t, kept_buffers["mok_fp8"], routing, dswiglu_tiles,
            router_weights), gemm, 0),
        ("d_x", "mok_fp8", lambda: ops.d_x_rows_fp8(d_gate_up_q, gate_up_t, routing,
                                                     d_x_tiles), 2 * gemm, 0),
    ]
    for kind, flops in (("down", gemm), ("gate_up", 2 * gemm)):
        stages += [(f"wgrad_{kind}", "mok_bf16", wgrad_ops[f"{kind}_bf16"], flops, 0),
                   (f"wgrad_{kind}", "mok_fp8", wgrad_ops[f"{kind}_fp8"], flops, 0),
                   (f"wgrad_{kind}", "mok_fp8_gemm_only", wgrad_ops[f"{kind}_fp8_gemm"], flops,
                    0)]
        stages += [(f"wgrad_{kind}", f"mok_fp8_gemm_only_{label}", op, flops, 0)
                   for label, op in wgrad_variants[kind].items()]
    if gluon:
        stages += [
            ("gate_up", "mok_fp8_gluon", lambda: gate_up_swiglu_fp8(
                x_q, gate_q, up_q, routing, gluon_tiles["gate_up"]), 2 * gemm, 0),
            ("down", "mok_fp8_gluon", lambda: down_proj_fp8(h_q, down_q, routing,
                                                            gluon_tiles["down"], router_weights),
             gemm, 0),
            ("d_x", "mok_fp8_gluon", lambda: ops.d_x_rows_fp8(d_gate_up_q, gate_up_t, routing,
                                                               gluon_tiles["d_x"]), 2 * gemm, 0),
            ("dswiglu", "mok_fp8_apart", lambda: ops.dswiglu_fp8(
                d_out_q, fp8_experts.down_t, kept_buffers["mok_fp8_apart"], routing,
                gluon_tiles["down_bwd_saved"], router_weights, apart=True), gemm, 0),
        ]
        # other Gluon tiles against those above, the same bits expected (the dSwiGLU apart: its
        # fp32 output, compared through the bf16 d_gate_up it leaves in the buffer): 256
        # columns, two products of 128 a K step (not gate/up)
        variants = {  # implementation: (tiles' changes, the stages it runs)
            "mok_fp8_gluon_256_s3": (dict(block_n=256, num_stages=3), ("down", "d_x", "dswiglu")),
            "mok_fp8_gluon_256_s4": (dict(block_n=256, num_stages=4), ("down", "d_x", "dswiglu")),
        }

        def dswiglu_apart(t, buffer, **_):
            ops.dswiglu_fp8(d_out_q, fp8_experts.down_t, buffer, routing, t, router_weights,
                            apart=True)
            return buffer

        variant_ops = {  # stage: (tiles kind, op(tiles, **fp32 output), flops)
            "gate_up": ("gate_up", lambda t, **kw: gate_up_swiglu_fp8(
                x_q, gate_q, up_q, routing, t, quantize_h=not kw, **kw), 2 * gemm),
            "down": ("down", lambda t, **kw: down_proj_fp8(h_q, down_q, routing, t,
                                                           router_weights, **kw), gemm),
            "d_x": ("d_x", lambda t, **kw: ops.d_x_rows_fp8(d_gate_up_q, gate_up_t, routing, t,
                                                             **kw), 2 * gemm),
            "dswiglu": ("down_bwd_saved", lambda t, **kw: dswiglu_apart(
                t, kept.clone() if kw else kept_buffers["mok_fp8_apart"]), gemm),
        }
        for impl, (changes, impl_stages) in variants.items():
            for stage in impl_stages:
                if only and not stage.startswith(only):
                    continue
                kind, op, flops = variant_ops[stage]
                variant = dataclasses.replace(gluon_tiles[kind], **changes)
                mine = op(variant, out_dtype=torch.float32)
                theirs = op(gluon_tiles[kind], out_dtype=torch.float32)
                errors[(stage, impl)] = max_rel_err(mine[used], theirs[used])
                print(f"   {stage} {impl} against the Gluon launch: bit for bit "
                      f"{torch.equal(mine[used], theirs[used])}", flush=True)
                stages.append((stage, impl, functools.partial(op, variant), flops, 0))
        # the dSwiGLU apart, its second launch alone (bytes: dh0 fp32, the kept gate and up
        # read; h, d_gate_up in bf16 and in e4m3 written) and with other blocks
        dh0 = torch.randn(routing.capacity_rows, inter, device=device)
        d_gate_up_out = torch.empty(routing.capacity_rows, 2 * inter, dtype=torch.float8_e4m3fn,
                                    device=device)
        scales_out = torch.empty(routing.capacity_rows, 2 * inter // 128, device=device)
        h_out = torch.empty(routing.capacity_rows, inter, dtype=x.dtype, device=device)
        partial_out = torch.empty(routing.capacity_rows, inter // 128, device=device)
        for rows_, warps, columns_first in DSWIGLU_APART_VARIANTS:
            impl = f"mok_fp8_{rows_}x128_w{warps}" + ("_columns_first" if columns_first else "")
            stages.append(("dswiglu_rows", impl, functools.partial(
                _dswiglu_rows_with, rows_, warps, columns_first, dh0, kept_buffers["rows"],
                routing, router_weights, None, d_gate_up_out, scales_out, h_out, partial_out,
                True), 0, routes * inter * (4 + 4 + 2 + 4 + 2)))
        # without d_gate_up in the pre-activations' dtype (the FP8 weight gradients' backward)
        rows_, warps, columns_first = DSWIGLU_APART_VARIANTS[0]
        stages.append(("dswiglu_rows", "mok_fp8_not_in_place", functools.partial(
            _dswiglu_rows_with, rows_, warps, columns_first, dh0, kept_buffers["rows"],
            routing, router_weights, None, d_gate_up_out, scales_out, h_out, partial_out,
            False), 0, routes * inter * (4 + 4 + 2 + 2)))
    # from e4m3 rows (what the layer quantizes them from): d_output's and x's 1 x 128 codes,
    # and d_gate_up's halves as the dSwiGLU lays them out
    laid = torch.zeros(routing.capacity_rows, 2 * padded_width(inter), dtype=x.dtype,
                       device=device)
    laid[:, :inter] = d_gate_up[:, :inter]
    laid[:, padded_width(inter):padded_width(inter) + inter] = d_gate_up[:, inter:]
    stages += quantize_stages(routing, {
        "d_out": (d_out, True, router_weights, None), "h": (h, False, None, None),
        "d_gate_up": (d_gate_up, False, None, None), "x": (x, True, None, None),
        "d_out_e4m3": (quantize_rows(d_out), True, router_weights, None),
        "d_gate_up_e4m3": (quantize_rows(laid), False, None, inter),
        "x_e4m3": (x_q, True, None, None)})
    if device.type == "cuda":  # torch._scaled_mm needs a GPU
        stages += [
            ("dense_gate_up", "cublas_bf16", lambda: dense_mm(routes, hidden, 2 * inter, False),
             2 * gemm, 0),
            ("dense_gate_up", "scaled_mm_fp8", lambda: dense_mm(routes, hidden, 2 * inter, True),
             2 * gemm, 0),
            ("dense_down", "cublas_bf16", lambda: dense_mm(routes, inter, hidden, False), gemm, 0),
            ("dense_down", "scaled_mm_fp8", lambda: dense_mm(routes, inter, hidden, True), gemm,
             0),
            ("dense_d_x", "scaled_mm_fp8", lambda: dense_mm(routes, 2 * inter, hidden, True),
             2 * gemm, 0),
        ]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S")
    rows = []
    for stage, impl, fn, flops, nbytes in stages:
        if only and not any(stage.startswith(name) for name in only):
            continue
        ms = median_ms(fn, device, repeats, warmup, host_ahead)
        error = errors.get((stage, impl))
        rows.append(dict(gpu=gpu, commit=commit_id(), date=date, shape=shape.name, stage=stage,
                         impl=impl, ms=f"{ms:.4f}",
                         tflops=f"{flops / ms / 1e9:.1f}" if flops else "",
                         gbps=f"{nbytes / ms / 1e6:.0f}" if nbytes else "",
                         max_rel_err="" if error is None else f"{error:.2e}",
                         timing="queued" if host_ahead else "idle"))
        rate = f"{flops / ms / 1e9:7.1f} TFLOP/s" if flops else f"{nbytes / ms / 1e6:7.0f} GB/s"
        print(f"  {stage:14s} {impl:14s} {ms:8.3f} ms {rate}", flush=True)
    return rows


def main(argv=None) -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(FP8_SHAPES), metavar="SHAPE",
                        default=["qwen3-30b-a3b", "kimi-ep64-slice"] if cuda else [SMALL.name])
    parser.add_argument("--repeats", type=int, default=20 if cuda else 1)
    parser.add_argument("--warmup", type=int, default=3 if cuda else 1)
    parser.add_argument("--csv", type=Path, default=RESULTS if cuda else CPU_RESULTS)
    parser.add_argument("--stages", nargs="+", metavar="STAGE", default=(),
                        help="time only the stages whose names start so (default: all)")
    parser.add_argument("--host-ahead", action="store_true",
                        help="hold the GPU busy while each timed call is queued (its kernels "
                             "alone, without the launch's latency)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if cuda else "cpu")
    for name in args.shapes:
        shape = FP8_SHAPES[name]
        if shape.hidden_size % 128 or shape.intermediate_size % 128:
            print(f"skipped {name}: these stages time whole scale blocks (H and I multiples "
                  f"of 128), got ({shape.hidden_size}, {shape.intermediate_size})")
            continue
        append_rows(args.csv, FIELDS, bench_shape(shape, device, args.repeats, args.warmup,
                                                  only=tuple(args.stages),
                                                  host_ahead=args.host_ahead and cuda))
    print(f"rows appended to {args.csv}")


if __name__ == "__main__":
    main()
