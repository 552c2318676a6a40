"""Whether work queued beside a kernel that holds every SM makes progress (GPUs only).

The expert-parallel GEMMs' tiles spin on flags that other work raises; that work must not need
an SM the spinning tiles hold. `flag_reaches_spinners` fills every SM with programs spinning on
a flag and runs, on a second stream, what should raise it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from mok.kernels.comm import _now

SPIN_WARPS = 32  # programs of 1024 threads: two fill an SM's 2048


@triton.jit
def spin_kernel(flag_ptr, out_ptr, timeout):
    """Each program spins until *flag_ptr >= 1 or `timeout` ns pass; out[pid] = ns waited,
    negative when the flag never came."""
    start = _now(True)
    value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    elapsed = tl.zeros([], dtype=tl.int64)
    while (value < 1) & (elapsed <= timeout):
        value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
        elapsed = _now(True) - start
    result = tl.where(value >= 1, elapsed, -elapsed - 1)
    tl.store(out_ptr + tl.program_id(0), result)


def spinners_per_sm(flag: torch.Tensor, out: torch.Tensor) -> int:
    """How many spin_kernel programs an SM holds at once (threads and registers)."""
    compiled = spin_kernel.warmup(flag, out, 1, num_warps=SPIN_WARPS, grid=(1,))
    compiled._init_handles()
    threads = 32 * SPIN_WARPS
    return min(2048 // threads, 65536 // max(1, compiled.n_regs * threads))


def flag_reaches_spinners(work: Callable[[torch.Tensor], None], flag: torch.Tensor,
                          out: torch.Tensor, *, timeout_s: float = 2.0,
                          race_priority: int | None = None) -> tuple[int, float]:
    """(programs that saw the flag, most ms any waited) of len(out) spin_kernel programs on the
    current stream and work(flag), which should set flag to 1, on a second stream.

    race_priority None: the spinners start first and work is queued once they hold the SMs.
    Else work is queued first, on a stream of that priority, and both wait for the same kernel
    (a 20 ms sleep), as copies queued before a GEMM both wait on a publish."""
    flag.zero_()
    out.zero_()
    torch.cuda.synchronize()
    timeout_ns = int(timeout_s * 1e9)
    grid = (out.numel(),)
    if race_priority is None:
        side = torch.cuda.Stream()
        spin_kernel[grid](flag, out, timeout_ns, num_warps=SPIN_WARPS)
        time.sleep(0.05)  # the spinners are resident before the work is queued
        with torch.cuda.stream(side):
            work(flag)
    else:
        side = torch.cuda.Stream(priority=race_priority)
        clock_khz = torch.cuda.get_device_properties(flag.device).clock_rate
        torch.cuda._sleep(int(0.02 * clock_khz * 1e3))
        ready = torch.cuda.Event()
        ready.record()
        side.wait_event(ready)
        with torch.cuda.stream(side):
            work(flag)
        spin_kernel[grid](flag, out, timeout_ns, num_warps=SPIN_WARPS)
    torch.cuda.synchronize()
    waited = out.cpu()
    return int((waited >= 0).sum()), round(waited.abs().max().item() / 1e6, 3)
