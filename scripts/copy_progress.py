"""Does a copy make progress while spinning programs hold every SM of the GPU?

The expert-parallel GEMMs' tiles spin on flags that other work raises. If that work needs an SM
(a kernel) and the tiles hold every SM, the tiles spin until their timeout. This runs, on one
GPU, a kernel whose programs fill every SM and spin on a flag (up to --timeout seconds), and on
a second stream a copy followed by the flag's write, for each kind of copy:

- d2d: a contiguous copy within the GPU, this process's memory (cudaMemcpyAsync);
- d2d_ipc: the same from another process's memory on the same GPU (CUDA IPC), as the copied
  rows of ranks sharing one GPU;
- strided: a copy of a transposed view (an elementwise kernel; the control that needs an SM);
- no copy, the flag written by fill_ (a kernel) instead of a copy from pinned host memory;
- no copy, the flag copied from pinned host memory alone (the control: the copy engines).

For each: whether the flag reached the spinners, and when (ms after they started); first with
the copy queued once the spinners hold the SMs, then (two of the copies) with the copy queued
first on a stream of low or high priority, both waiting for the same earlier kernel. Usage:
python scripts/copy_progress.py [--mib 64] [--timeout 2] [--csv OUT.csv]
"""

import argparse
import csv
import time

import torch
import torch.multiprocessing as mp

from mok.exchange.symmetric import HIGHEST_PRIORITY
from mok.provenance import commit_id
from mok.testing.progress import SPIN_WARPS, flag_reaches_spinners, spinners_per_sm


def _owner(queue, done, numel):
    """Another process: a tensor on the GPU, sent through CUDA IPC; kept until done is set."""
    src = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    queue.put(src)
    done.wait()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args(argv)
    props = torch.cuda.get_device_properties(0)
    numel = args.mib * 2**20 // 2
    flag = torch.zeros(1, device="cuda", dtype=torch.int64)
    ones = torch.ones(1, dtype=torch.int64).pin_memory()
    src = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    side = int(numel ** 0.5)
    square = src[:side * side].view(side, side)
    square_dst = torch.empty_like(square)

    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    owner = ctx.Process(target=_owner, args=(queue, done, numel))
    owner.start()
    peer_src = queue.get()

    out = torch.zeros(8 * props.multi_processor_count, device="cuda", dtype=torch.int64)
    per_sm = spinners_per_sm(flag, out)
    print(f"{props.name}: {props.multi_processor_count} SMs; {per_sm} spinning programs of "
          f"{32 * SPIN_WARPS} threads an SM")

    def from_host(flag):
        flag.copy_(ones, non_blocking=True)

    def by_kernel(flag):
        flag.fill_(1)

    cases = [
        ("d2d", lambda: dst.copy_(src), from_host),
        ("d2d_ipc", lambda: dst.copy_(peer_src), from_host),
        ("strided (kernel)", lambda: square_dst.copy_(square.t()), from_host),
        ("none, flag by fill_ (kernel)", lambda: None, by_kernel),
        ("none, flag from host memory (control)", lambda: None, from_host),
    ]
    rows = []
    low, high = 0, HIGHEST_PRIORITY  # the default and the highest
    for name, copy, set_flag in cases:  # alone first: how long each takes without spinners
        torch.cuda.synchronize()
        def work(flag, copy=copy, set_flag=set_flag):
            copy()
            set_flag(flag)

        start = time.perf_counter()
        work(flag)
        torch.cuda.synchronize()
        alone = (time.perf_counter() - start) * 1e3
        grids = (per_sm * props.multi_processor_count, 4 * per_sm * props.multi_processor_count)
        runs = [("spinners first", None, grid) for grid in grids]
        if name in ("d2d_ipc", "strided (kernel)"):
            runs += [(f"copy queued first, priority {priority}", priority, grids[0])
                     for priority in (low, high) for _ in range(3)]
        for order, priority, grid in runs:
            arrived, ms = flag_reaches_spinners(work, flag, out[:grid], timeout_s=args.timeout,
                                                race_priority=priority)
            row = {"case": name, "order": order, "spinners": grid, "arrived": arrived,
                   "max_wait_ms": ms, "alone_ms": round(alone, 3), "gpu": props.name,
                   "commit": commit_id()}
            rows.append(row)
            print(row)
    done.set()
    owner.join()
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
