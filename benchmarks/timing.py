"""Timing one call on a GPU (CUDA events) or on CPU (wall clock): what every benchmark measures
with. Imports torch only, so a process whose mok is another tree's (benchmarks.compare) can use
it."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

# host_ahead: the GPU sleeps this long before each timed call, so the host has queued the whole
# call before the GPU starts it (as in training, where the host runs ahead of the GPU).
HOST_AHEAD_S = 0.05


def hold_device(seconds: float = HOST_AHEAD_S) -> None:
    """Queue a kernel that keeps the current GPU busy for `seconds`: what the host queues after
    it starts only then, so the host gets that far ahead of the device."""
    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    torch.cuda._sleep(int(seconds * properties.clock_rate * 1e3))  # clock_rate in kHz


def measure(prepare: Callable[[int], Callable[[], object]], repeats: int, warmup: int,
            device: torch.device, host_ahead: bool = False) -> tuple[float, float | None, float]:
    """(median ms, peak GiB, median host ms) of the calls prepare(i) returns, i = 0, 1, ...;
    prepare's own work is not timed. CUDA events on a GPU (device idle before each call, so a
    call whose host work outlasts its kernels is timed at its host pace; with host_ahead the
    kernels alone), wall clock on CPU, where the peak is None (not measured). Host ms: the call's
    own wall time (on a GPU, the time to queue it)."""
    for i in range(warmup):  # compile, autotune, caches: outside the timing
        prepare(i)()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
    times, host_times, peak = [], [], 0
    for i in range(warmup, warmup + repeats):
        call = prepare(i)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            if host_ahead:
                hold_device()
            start.record()
            start_s = time.perf_counter()
            call()
            host_times.append((time.perf_counter() - start_s) * 1e3)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
        else:
            start_s = time.perf_counter()
            call()
            times.append((time.perf_counter() - start_s) * 1e3)
            host_times.append(times[-1])
        del call
    return statistics.median(times), peak / 2**30 if cuda else None, statistics.median(host_times)
