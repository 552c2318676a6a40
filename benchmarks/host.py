"""Host time of one mok training step, per launcher: where the host's share of a step goes.

    python -m benchmarks.host [--shapes SHAPE ...] [--repeats N] [--kept] [--profile N]

A call that starts on an idle GPU waits for the host to launch its first long kernel (the
benchmark's forward at qwen3-30b-a3b lost about 0.38 ms so against `bench --host-ahead`). This
times, with the host clock, each launcher of `mok.ops` that `mok.functional` calls in a step
(schedule, forward, backward), the time outside them (mok.functional's own Python: checks,
allocations, views) and the whole step. On a GPU the device sleeps before each step, so no
launch waits on it. Medians over --repeats steps, in microseconds; on CPU (Triton's
interpreter) the launchers' times are the interpreter running the kernels, not launch costs.
--profile N also prints the N Python functions with the most host time of their own (cProfile
over the same steps).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import statistics
import time
from collections import defaultdict

import torch

import mok.functional as F
from benchmarks.layer import BENCH_SHAPES, TINY, hold_device
from mok import ops
from mok.testing import make_shape_inputs

# mok.ops functions that launch nothing (tile tables, sizes).
_NOT_LAUNCHERS = {"default_tiles", "small_tiles", "capacity_rows"}


def _launchers() -> list[str]:
    return [name for name in ops.__all__ if name not in _NOT_LAUNCHERS
            and callable(getattr(ops, name)) and not isinstance(getattr(ops, name), type)]


def _timed(fn, totals: dict, name: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start
    return wrapper


def host_times(shape, *, kept: bool, repeats: int, device: torch.device,
               profile: int = 0) -> dict[str, float]:
    """{launcher or "outside launchers" or "step": median host microseconds per step}; profile:
    print that many functions of a cProfile of the steps, by their own time."""
    inputs = make_shape_inputs(shape, device=device, seed=0)
    config = F.MoKConfig(recompute_gate_up=not kept)
    workspace = F.create_workspace(config, None, device=device,
                                   num_local_tokens=shape.num_tokens,
                                   hidden_size=shape.hidden_size, topk=shape.topk)

    def step():
        schedule = F.build_schedule(workspace, config, inputs.topk_experts,
                                    num_local_experts=inputs.num_local_experts)
        _, context = F.forward(config, workspace, schedule, *inputs.layer_args)
        return F.backward(config, workspace, schedule, context, inputs.d_output,
                          *inputs.layer_args)

    step()  # compiles
    totals: dict[str, float] = defaultdict(float)
    originals = {name: getattr(ops, name) for name in _launchers()}
    samples: dict[str, list[float]] = defaultdict(list)
    profiler = cProfile.Profile() if profile else None
    try:
        for name, fn in originals.items():
            setattr(ops, name, _timed(fn, totals, name))
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
                hold_device()
            totals.clear()
            if profiler is not None:
                profiler.enable()
            start = time.perf_counter()
            step()
            whole = time.perf_counter() - start
            if profiler is not None:
                profiler.disable()
            for name in originals:
                samples[name].append(totals.get(name, 0.0))
            samples["outside launchers"].append(whole - sum(totals.values()))
            samples["step"].append(whole)
    finally:
        for name, fn in originals.items():
            setattr(ops, name, fn)
        if device.type == "cuda":
            torch.cuda.synchronize()
    if profiler is not None:
        print(f"-- cProfile of {repeats} steps (the timers above add their own share)")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(profile)
    return {name: statistics.median(values) * 1e6 for name, values in samples.items()
            if any(values)}


def main(argv=None) -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(BENCH_SHAPES),
                        default=["qwen3-30b-a3b"] if cuda else [TINY.name])
    parser.add_argument("--repeats", type=int, default=20 if cuda else 2)
    parser.add_argument("--kept", action="store_true",
                        help="MoKConfig(recompute_gate_up=False)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print the N functions with the most host time of their own")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if cuda else "cpu")
    for name in args.shapes:
        times = host_times(BENCH_SHAPES[name], kept=args.kept, repeats=args.repeats,
                           device=device, profile=args.profile)
        print(f"== {name} ({'kept gate/up' if args.kept else 'recompute'}): host us per step, "
              f"median of {args.repeats}")
        for label, us in sorted(times.items(), key=lambda item: -item[1]):
            print(f"  {label:24s} {us:10.1f}")


if __name__ == "__main__":
    main()
