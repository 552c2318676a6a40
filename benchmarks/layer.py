"""Layer benchmark: mok and the anchors on the same inputs, checked before timed.

For each shape of DESIGN.md section 4 and each mode (forward, forward+backward), every
implementation is first compared with the mok.testing reference, then timed with CUDA events
(median over repeats, several input sets rotated so the L2 holds none of them), and a row per
(shape, implementation, mode) is appended to benchmarks/results/layer.csv.

Implementations:
- mok: build_schedule + forward (+ backward) of mok.functional;
- grouped_mm: the torchtitan-style pipeline: device-side counts and offsets, permute, one
  torch._grouped_mm for gate and up, SwiGLU, torch._grouped_mm down, weighted unpermute; no host
  sync; backward through autograd.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as torch_f

import mok.functional as F
from mok import _env
from mok.testing import (
    GRAD_NAMES,
    SHAPES,
    SHAPES_BY_NAME,
    MoEInputs,
    MoEShape,
    error_report,
    make_shape_inputs,
    moe_reference_grads,
)
from mok.testing.tolerance import TOLERANCES

RESULTS = Path(__file__).resolve().parent / "results"
CSV_FIELDS = ("gpu", "commit", "date", "shape", "impl", "mode", "ms", "tflops", "peak_mem_gb",
              "max_rel_err")


@dataclass
class Implementation:
    """forward(inputs) -> y; step(inputs) -> (y, grads in MoK's order) for the correctness check;
    train(inputs) runs forward+backward as a training step would."""

    name: str
    forward: Callable[[MoEInputs], torch.Tensor]
    step: Callable[[MoEInputs], tuple]


def mok_implementation(shape: MoEShape) -> Implementation:
    config = F.MoKConfig()
    workspace = F.get_workspace(config, None, device="cuda" if torch.cuda.is_available() else "cpu",
                                num_local_tokens=shape.num_tokens, hidden_size=shape.hidden_size,
                                topk=shape.topk)

    def forward(inputs):
        schedule = F.build_schedule(workspace, config, inputs.topk_experts,
                                    num_local_experts=inputs.num_local_experts)
        return F.forward(config, workspace, schedule, *inputs.layer_args)[0]

    def step(inputs):
        schedule = F.build_schedule(workspace, config, inputs.topk_experts,
                                    num_local_experts=inputs.num_local_experts)
        y, context = F.forward(config, workspace, schedule, *inputs.layer_args)
        grads = F.backward(config, workspace, schedule, context, inputs.d_output,
                           *inputs.layer_args)
        return y, grads

    return Implementation("mok", forward, step)


def grouped_mm_moe(x, topk_experts, router_weights, w_shared, w_gate_up, w_down):
    """The torchtitan way. w_gate_up [E, 2I, H] (gate rows then up rows), w_down [E, H, I]."""
    num_tokens, topk = topk_experts.shape
    num_experts = w_gate_up.shape[0]
    flat = topk_experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.histc(flat.float(), bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    token = order // topk
    rows = x[token]
    gate_up = torch._grouped_mm(rows, w_gate_up.transpose(-2, -1), offs=offsets)
    gate, up = gate_up.chunk(2, dim=-1)
    h = torch_f.silu(gate) * up
    out_rows = torch._grouped_mm(h, w_down.transpose(-2, -1), offs=offsets)
    out_rows = (out_rows.float() * router_weights.reshape(-1)[order, None]).to(x.dtype)
    y = torch.zeros_like(x).index_add_(0, token, out_rows)
    if w_shared is not None:
        w_sg, w_su, w_sd = w_shared
        y = y + (torch_f.silu(x @ w_sg.T) * (x @ w_su.T)) @ w_sd.T
    return y


def grouped_mm_implementation(shape: MoEShape) -> Implementation:
    cache: dict[int, tuple] = {}

    def params(inputs):
        key = id(inputs)
        if key not in cache:  # one-time weight layout (gate and up fused), outside the timing
            w_gate_up = torch.cat([inputs.w_routed_gate, inputs.w_routed_up], dim=1)
            cache[key] = (w_gate_up.requires_grad_(True),
                          inputs.w_routed_down.detach().clone().requires_grad_(True),
                          inputs.x.detach().clone().requires_grad_(True),
                          inputs.router_weights.detach().clone().requires_grad_(True),
                          tuple(w.detach().clone().requires_grad_(True)
                                for w in inputs.shared_weights)
                          if inputs.w_shared_gate is not None else None)
        return cache[key]

    def forward(inputs):
        with torch.no_grad():
            w_gate_up, w_down, x, rw, shared = params(inputs)
            return grouped_mm_moe(x, inputs.topk_experts, rw, shared, w_gate_up, w_down)

    def step(inputs):
        w_gate_up, w_down, x, rw, shared = params(inputs)
        for leaf in (w_gate_up, w_down, x, rw, *(shared or ())):
            leaf.grad = None
        y = grouped_mm_moe(x, inputs.topk_experts, rw, shared, w_gate_up, w_down)
        y.backward(inputs.d_output)
        intermediate = inputs.w_routed_gate.shape[1]
        grads = (x.grad, rw.grad, w_gate_up.grad[:, :intermediate],
                 w_gate_up.grad[:, intermediate:], w_down.grad,
                 *((s.grad for s in shared) if shared else (None, None, None)))
        return y, grads

    return Implementation("grouped_mm", forward, step)


IMPLEMENTATIONS: dict[str, Callable[[MoEShape], Implementation]] = {
    "mok": mok_implementation,
    "grouped_mm": grouped_mm_implementation,
}


def check(impl: Implementation, inputs: MoEInputs, reference) -> float:
    """Worst max_rel over y and every gradient; raises if any exceeds the bf16 tolerance."""
    y_ref, grads_ref = reference
    y, grads = impl.step(inputs)
    tol = TOLERANCES[inputs.x.dtype]
    worst = 0.0
    for name, actual, expected in zip(("y", *GRAD_NAMES), (y, *grads), (y_ref, *grads_ref),
                                      strict=True):
        if expected is None:
            continue
        report = error_report(actual, expected, name)
        print(f"  check {impl.name}: {report}", flush=True)
        if report.nonfinite or report.rel_rms > tol.rel_rms or report.max_rel > tol.max_rel:
            raise AssertionError(f"{impl.name}: {report} exceeds {tol}")
        worst = max(worst, report.max_rel)
    return worst


def time_ms(fn: Callable[[int], object], repeats: int, warmup: int) -> float:
    """Median milliseconds of fn(i) over `repeats` calls, CUDA events around each call."""
    for i in range(warmup):
        fn(i)
    times = []
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _commit() -> str:
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                             capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, text=True, capture_output=True).stdout.strip()
        return out + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return _env.COMMIT  # a copy of the tree without .git


def run(shapes, impl_names, *, repeats=20, warmup=5, num_input_sets=3, csv_path=None,
        modes=("forward", "forward+backward")) -> list[dict]:
    if not torch.cuda.is_available():
        raise SystemExit("the layer benchmark needs a CUDA GPU")
    gpu = torch.cuda.get_device_name()
    commit, date = _commit(), datetime.datetime.now().isoformat(timespec="seconds")
    rows = []
    for shape in shapes:
        input_sets = [make_shape_inputs(shape, device="cuda", seed=100 + i)
                      for i in range(num_input_sets)]
        reference = moe_reference_grads(input_sets[0], compute_dtype=torch.float32)
        for impl_name in impl_names:
            impl = IMPLEMENTATIONS[impl_name](shape)
            max_rel = check(impl, input_sets[0], reference)
            for mode in modes:
                backward = mode == "forward+backward"
                call = impl.step if backward else impl.forward

                def run_one(i, call=call, sets=input_sets):
                    return call(sets[i % len(sets)])

                for i in range(warmup):  # compile, autotune, build caches outside the timing
                    run_one(i)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                ms = time_ms(run_one, repeats, warmup=0)
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30
                row = dict(gpu=gpu, commit=commit, date=date, shape=shape.name, impl=impl_name,
                           mode=mode, ms=round(ms, 4),
                           tflops=round(shape.flops(backward) / ms / 1e9, 1),
                           peak_mem_gb=round(peak, 3), max_rel_err=f"{max_rel:.2e}")
                rows.append(row)
                print(f"{shape.name:18s} {impl_name:11s} {mode:17s} {ms:9.3f} ms "
                      f"{row['tflops']:7.1f} TFLOP/s  peak {peak:6.2f} GiB  "
                      f"max_rel {max_rel:.1e}", flush=True)
        del input_sets, reference
        torch.cuda.empty_cache()
    if csv_path is not None:
        csv_path = Path(csv_path)
        csv_path.parent.mkdir(parents=True, exist_ok=True)
        new = not csv_path.exists()
        with csv_path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            if new:
                writer.writeheader()
            writer.writerows(rows)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mok bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=[s.name for s in SHAPES],
                        choices=[s.name for s in SHAPES])
    parser.add_argument("--impls", nargs="*", default=list(IMPLEMENTATIONS),
                        choices=list(IMPLEMENTATIONS))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--csv", default=str(RESULTS / "layer.csv"))
    args = parser.parse_args(argv)
    run([SHAPES_BY_NAME[name] for name in args.shapes], args.impls, repeats=args.repeats,
        csv_path=args.csv)


if __name__ == "__main__":
    main()
