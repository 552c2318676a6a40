"""Time each stage of the mok layer separately (CUDA events, median), per shape.

Prints ms, TFLOP/s (counted FLOPs of that stage) and GB/s (bytes it must move) so the bottleneck
of each stage can be read against the H200 ceilings (about 693 TFLOP/s bf16, 4.27 TB/s copy).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

import mok.functional as F
from mok import ops
from mok.testing import SHAPES, SHAPES_BY_NAME, make_shape_inputs


def median_ms(fn, repeats=20, warmup=3, profile=False, ahead_ms=0.0):
    """Median ms of `repeats` calls of fn after `warmup` untimed ones; profile: only the timed
    calls run between cudaProfilerStart and Stop (a profiler started with
    `--profile-from-start off`, as scripts/gpu_ncu.sh runs Nsight Compute, sees those).
    ahead_ms: the GPU sleeps that long before each timed call, so the host has queued the call
    before the GPU starts it (its time is the GPU's alone, not the host's issuing it)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if profile:
        torch.cuda.profiler.start()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if ahead_ms:
            from benchmarks.layer import hold_device

            hold_device(ahead_ms / 1e3)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    if profile:
        torch.cuda.profiler.stop()
    return statistics.median(times)


def shape_setup(shape, seed: int):
    """(inputs without a shared expert, config, workspace, schedule) at a benchmark shape."""
    inputs = make_shape_inputs(dataclasses.replace(shape, shared_intermediate_size=0),
                               device="cuda", seed=seed)
    config = F.MoKConfig()
    workspace = F.create_workspace(config, None, device="cuda", num_local_tokens=shape.num_tokens,
                                   hidden_size=shape.hidden_size, topk=shape.topk)
    schedule = F.build_schedule(workspace, config, inputs.topk_experts,
                                num_local_experts=shape.num_experts)
    return inputs, config, workspace, schedule


def breakdown(shape, stages_wanted=(), repeats: int = 20, warmup: int = 3,
              profile: bool = False, ahead_ms: float = 0.0) -> None:
    """Time every stage (or those named in stages_wanted) at `shape`: the median of `repeats`
    calls after `warmup` (one of each under a profiler such as ncu, which replays every launch
    it profiles); profile, ahead_ms: see median_ms."""
    inputs, config, workspace, schedule = shape_setup(shape, seed=5)
    routing, tiles = schedule.routing, schedule.tiles
    x, rw, d_out = inputs.x, inputs.router_weights, inputs.d_output
    w_g, w_u, w_d = inputs.routed_weights
    routes = shape.num_tokens * shape.topk
    hid, inter = shape.hidden_size, shape.intermediate_size
    t_gate_up = tiles.pick("gate_up", inter, hid)
    t_gate_up_saved = tiles.pick("gate_up_saved", inter, hid)
    t_down_bwd = tiles.pick("down_bwd", inter, hid)
    t_down_bwd_saved = tiles.pick("down_bwd_saved", inter, hid)
    t_down = tiles.pick("down", hid, inter)
    t_d_x = tiles.pick("d_x", hid, inter)
    t_wgrad_gu = tiles.pick("wgrad_gate_up", inter, hid)
    t_wgrad_down = tiles.pick("wgrad_down", hid, inter)
    gemm = 2.0 * routes * hid * inter
    h = ops.gate_up_swiglu(x, w_g, w_u, routing, t_gate_up, None)
    rows = ops.down_proj(h, w_d, routing, t_down, rw)
    def down_bwd():  # DswigluTiles.apart: gate/up and the kept dSwiGLU, as the layer runs them
        if t_down_bwd.apart:
            return ops.dswiglu_apart(d_out, x, w_d, w_g, w_u, routing, t_gate_up_saved,
                                     t_down_bwd_saved, rw, None)
        return ops.down_bwd_dswiglu(d_out, x, w_d, w_g, w_u, h, routing, t_down_bwd, rw, None)

    dgu, partial = down_bwd()
    dxr = ops.d_x_rows(dgu, w_g, w_u, routing, t_d_x)
    gate_up = ops.gate_up_buffer(x, w_g, routing)
    h_kept = torch.empty_like(h)  # written by the kept-gate/up backward
    dense = {}  # cuBLAS GEMMs of gate/up's and down's sizes, made on first use

    def dense_mm(m: int, k: int, n: int) -> torch.Tensor:
        if (m, k, n) not in dense:
            dense[m, k, n] = (torch.randn(m, k, device=x.device, dtype=x.dtype),
                              torch.randn(k, n, device=x.device, dtype=x.dtype))
        return torch.mm(*dense[m, k, n])

    stages = [
        ("schedule", lambda: F.build_schedule(workspace, config, inputs.topk_experts,
                                              num_local_experts=shape.num_experts), 0, 0),
        ("gate_up_swiglu", lambda: ops.gate_up_swiglu(x, w_g, w_u, routing, t_gate_up, None),
         2 * gemm, 0),
        ("down_proj", lambda: ops.down_proj(h, w_d, routing, t_down, rw), gemm, 0),
        ("combine", lambda: ops.combine(rows, routing, None, x.dtype), 0,
         rows.numel() * 2 * routes / rows.shape[0] + x.numel() * 2),
        ("down_bwd_dswiglu", down_bwd, 3 * gemm, 0),
        ("gate_up_saving", lambda: ops.gate_up_swiglu(x, w_g, w_u, routing, t_gate_up_saved,
                                                      None, gate_up=gate_up), 2 * gemm, 0),
        ("down_bwd_saved", lambda: ops.down_bwd_dswiglu(d_out, x, w_d, w_g, w_u, h_kept, routing,
                                                        t_down_bwd_saved, rw, None,
                                                        gate_up=gate_up, h_out=True),
         gemm, 0),
        ("router_grad", lambda: ops.router_grad(partial, routing), 0, 0),
        ("d_x_rows", lambda: ops.d_x_rows(dgu, w_g, w_u, routing, t_d_x), 2 * gemm, 0),
        ("combine_dx", lambda: ops.combine(dxr, routing, None, x.dtype), 0,
         routes * hid * 2 + x.numel() * 2),
        ("wgrad_gate_up", lambda: ops.grouped_wgrad_gate_up(dgu, x, routing, t_wgrad_gu,
                                                           gather_x=True, out_dtype=x.dtype),
         2 * gemm, 0),
        # For scale (not part of the layer, not summed): dense cuBLAS GEMMs of the same sizes.
        ("dense_gate_up", lambda: dense_mm(routes, hid, 2 * inter), 2 * gemm, 0),
        ("dense_down", lambda: dense_mm(routes, inter, hid), gemm, 0),
        ("wgrad_down", lambda: ops.grouped_wgrad(d_out, h, routing,
                                                 t_wgrad_down, gather_a=True,
                                                 gather_b=False, router_weights=rw,
                                                 out_dtype=x.dtype), gemm, 0),
    ]
    print(f"== {shape.name}: rows {routing.capacity_rows}, routes {routes}")
    unknown = set(stages_wanted) - {stage[0] for stage in stages}
    if unknown:
        raise SystemExit(f"unknown stages {sorted(unknown)}; stages: {[s[0] for s in stages]}")
    if stages_wanted:
        stages = [stage for stage in stages if stage[0] in stages_wanted]
    times = {}
    for name, fn, flops, nbytes in stages:
        ms = times[name] = median_ms(fn, repeats, warmup, profile, ahead_ms)
        rate = f"{flops / ms / 1e9:7.1f} TFLOP/s" if flops else " " * 15
        bw = f"{nbytes / ms / 1e6:7.1f} GB/s" if nbytes else ""
        print(f"  {name:18s} {ms:8.3f} ms {rate} {bw}", flush=True)
    if stages_wanted:  # no sums of a part
        return
    # The two *_saving/_saved stages replace gate_up_swiglu and down_bwd_dswiglu when the
    # pre-activations are kept (MoKConfig(recompute_gate_up=False)).
    kept = {"gate_up_swiglu": "gate_up_saving", "down_bwd_dswiglu": "down_bwd_saved"}
    total = sum(ms for name, ms in times.items()
                if name not in kept.values() and not name.startswith("dense_"))
    total_kept = total + sum(times[new] - times[old] for old, new in kept.items())
    for label, ms in (("sum", total), ("sum, gate/up kept", total_kept)):
        print(f"  {label} {ms:.3f} ms; fwd+bwd {shape.flops() / ms / 1e9:.1f} TFLOP/s")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="*", default=[s.name for s in SHAPES])
    parser.add_argument("--stages", nargs="+", default=[], metavar="STAGE",
                        help="time only these stages (default: all)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profiler-range", action="store_true",
                        help="run each stage's timed calls between cudaProfilerStart and Stop")
    parser.add_argument("--ahead-ms", type=float, default=0.0,
                        help="the GPU sleeps this long before each timed call, so a stage's time "
                             "is the GPU's alone, not the host's issuing it (default: idle GPU)")
    args = parser.parse_args(argv)
    for name in args.shapes:
        breakdown(SHAPES_BY_NAME[name], args.stages, args.repeats, args.warmup,
                  args.profiler_range, args.ahead_ms)


if __name__ == "__main__":
    main()
