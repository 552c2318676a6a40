"""One layer call on the GPU's timeline: every kernel it ran, in order, and the idle gaps.

    python -m benchmarks.trace [--shapes ...] [--impls mok ...] [--modes forward+backward]

For each shape and implementation of benchmarks.implementations, a few calls warm up, then one
call runs under torch.profiler twice: from an idle GPU (the benchmark's way: the GPU waits for
whatever the host has not queued yet) and queued behind a GPU sleep (`ahead`: the kernels
alone). Prints each kernel's start (us after the first kernel), duration and name, then the
wall time (first start to last end), the kernels' busy time and the gaps between them. The sum
of stages in benchmarks.breakdown against the benchmark's time: this says where the rest goes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from benchmarks.implementations import IMPLEMENTATIONS, Settings
from benchmarks.layer import BENCH_SHAPES, Mode, hold_device, timed_call
from mok.testing import make_shape_inputs


def kernel_spans(call, ahead: bool, host: bool = False) -> list[tuple[float, float, str]]:
    """(start us, duration us, name) of every kernel and memset/memcpy one call ran; host: also
    the call itself, the torch operators it ran and the CUDA runtime and driver calls that issued
    the kernels (names prefixed "host:")."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        if ahead:
            hold_device(0.02)
        with torch.profiler.record_function("the call"):
            call()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    device_kinds = ("kernel", "gpu_memset", "gpu_memcpy")
    host_kinds = ("cuda_runtime", "cuda_driver", "cpu_op", "user_annotation") if host else ()
    spans = [(float(e["ts"]), float(e.get("dur", 0)),
              e["name"] if e["cat"] in device_kinds else f"host: {e['name']}")
             for e in events if e.get("ph") == "X" and e.get("cat") in device_kinds + host_kinds]
    spans = [span for span in spans if "spin_kernel" not in span[2]]  # hold_device's
    spans.sort()
    return spans


def report(spans: list[tuple[float, float, str]], min_gap_us: float) -> dict:
    """Print the spans in order (times in us after the first kernel's start); returns the
    kernels' wall, busy and idle totals in us. Host spans are printed, not counted."""
    device = [span for span in spans if not span[2].startswith("host: ")]
    if not device:
        print("    no kernels")
        return dict(wall=0.0, busy=0.0, gaps=0.0)
    t0 = device[0][0]
    end = t0
    busy = gaps = 0.0
    for start, dur, name in spans:
        if name.startswith("host: "):
            print(f"    {start - t0:9.1f} {dur:8.1f}    {name[:108]}")
            continue
        gap = start - end
        if gap > min_gap_us:
            print(f"    {'':>9s} {'':>8s}  -- idle {gap:.1f} us")
        if gap > 0:
            gaps += gap
        print(f"    {start - t0:9.1f} {dur:8.1f}  {name[:110]}")
        busy += dur
        end = max(end, start + dur)
    wall = end - t0
    print(f"    wall {wall:.1f} us, kernels {busy:.1f} us, idle {gaps:.1f} us, "
          f"{len(device)} kernels")
    return dict(wall=wall, busy=busy, gaps=gaps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trace", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(BENCH_SHAPES),
                        default=["qwen3-30b-a3b"], metavar="SHAPE")
    parser.add_argument("--impls", nargs="+", choices=list(IMPLEMENTATIONS), default=["mok"],
                        metavar="IMPL")
    parser.add_argument("--modes", nargs="+", choices=[mode.value for mode in Mode],
                        default=[Mode.FORWARD_BACKWARD.value])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--host", action="store_true",
                        help="also print the runtime and driver calls that issued the kernels")
    parser.add_argument("--min-gap-us", type=float, default=2.0,
                        help="print idle gaps longer than this")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the profiler's GPU timeline)")
    settings = Settings(torch.device("cuda"))
    for shape_name in args.shapes:
        shape = BENCH_SHAPES[shape_name]
        inputs = make_shape_inputs(shape, device="cuda", seed=100)
        for impl_name in args.impls:
            impl = IMPLEMENTATIONS[impl_name](shape, settings)
            for mode_name in args.modes:
                mode = Mode(mode_name)
                for _ in range(args.warmup):
                    timed_call(impl, mode, inputs)()
                for ahead in (False, True):
                    call = timed_call(impl, mode, inputs)
                    print(f"== {shape.name} {impl.name} {mode.value} "
                          f"{'queued ahead' if ahead else 'from an idle GPU'}", flush=True)
                    report(kernel_spans(call, ahead, args.host), args.min_gap_us)
        del inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
