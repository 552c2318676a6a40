"""What pulling its rows costs the gate/up GEMM, on one GPU: a rank pulls its own tokens from its
own memory (mok.testing.pull), through the same kernels, flags and waits as between ranks.

    python -m benchmarks.pull_local [--shapes qwen3-30b-a3b ...] [--csv PATH]

Per shape, the median ms (CUDA events) of:
- `gluon`: the Gluon gate/up reading x directly (nothing pulled: the floor);
- `pull apart + gluon`: the pull in a launch of its own over every SM, then the Gluon kernel;
- `gluon pulling`: the Gluon kernel pulling in a partition of each program (mok.kernels.gluon_comm);
- `triton pulling`: the Triton kernel at the table's Triton tiles, its first
  MoKConfig.fwd_num_comm_sms programs pulling.
Every call also numbers a new round (a small kernel). Local memory answers faster than a peer over
NVLink, so the pulls here are faster than between GPUs: this measures what pulling inside the
launch costs the GEMM, not the link. h of each pulling variant is checked bitwise against `gluon`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
from pathlib import Path

import torch

import mok.functional as F
from benchmarks.breakdown import median_ms, shape_setup
from mok import ops
from mok.testing import SHAPES, SHAPES_BY_NAME
from mok.testing.pull import local_pull

CSV_FIELDS = ("gpu", "commit", "date", "shape", "minibatch", "impl", "ms")


def measure(shape, repeats: int, warmup: int, minibatch: int,
            check: bool = True) -> list[tuple[str, float]]:
    inputs, config, _, schedule = shape_setup(shape, seed=5)
    config = dataclasses.replace(config, minibatch_size=minibatch)
    routing = schedule.routing
    x, w_gate, w_up = inputs.x, inputs.w_routed_gate, inputs.w_routed_up
    n, k = w_gate.shape[1], w_gate.shape[2]
    tiles = schedule.tiles.pick("gate_up", n, k)
    triton_tiles = schedule.tiles.pick("gate_up", n, k, triton=True)
    pulled = local_pull(x, routing, inputs.router_weights,
                        minibatch=config.minibatch_size, num_programs=config.fwd_num_comm_sms)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    reference = ops.gate_up_swiglu(x, w_gate, w_up, routing, tiles, None)
    used = int(routing.expert_offsets[-1])

    def direct():
        pulled.next_round()
        return ops.gate_up_swiglu(x, w_gate, w_up, routing, tiles, None)

    def apart():
        pulled.next_round()
        pulled.pull.run_apart(pulled.rows, sms)
        return ops.gate_up_swiglu(pulled.rows, w_gate, w_up, routing, tiles, None)

    def gluon_pulling():
        pulled.next_round()
        return ops.gate_up_swiglu(pulled.rows, w_gate, w_up, routing, tiles, None,
                                  pull=pulled.pull)

    def triton_pulling():
        pulled.next_round()
        return ops.gate_up_swiglu(pulled.rows, w_gate, w_up, routing, triton_tiles, None,
                                  pull=pulled.pull)

    variants = [("gluon", direct, True), ("pull apart + gluon", apart, True),
                ("gluon pulling", gluon_pulling, True), ("triton pulling", triton_pulling, False)]
    results = []
    for name, fn, bitwise in variants:
        pulled.rows.zero_()
        h = fn()
        torch.cuda.synchronize()
        if int(pulled.pull.peer.errors.abs().sum()) != 0:
            raise RuntimeError(f"{shape.name} {name}: error flags set {pulled.pull.peer.errors}")
        if check and bitwise and not torch.equal(h[:used], reference[:used]):
            raise RuntimeError(f"{shape.name} {name}: h differs from the Gluon kernel's")
        if check and not bitwise:  # other tiles: another summation order
            torch.testing.assert_close(h[:used].float(), reference[:used].float(), rtol=2e-2,
                                       atol=2e-2)
        results.append((name, median_ms(fn, repeats, warmup)))
        print(f"{shape.name:24s} {name:22s} {results[-1][1]:7.3f} ms", flush=True)
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=[s.name for s in SHAPES])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--csv", type=Path, default=None, help="append a row per measurement")
    parser.add_argument("--minibatch", type=int, default=F.MoKConfig().minibatch_size,
                        help="tokens per ready flag (MoKConfig.minibatch_size)")
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args(argv)
    from benchmarks import append_rows, commit_id

    gpu = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    for name in args.shapes:
        rows = [dict(gpu=gpu, commit=commit_id(), date=date, shape=name,
                     minibatch=args.minibatch, impl=impl, ms=f"{ms:.4f}")
                for impl, ms in measure(SHAPES_BY_NAME[name], args.repeats, args.warmup,
                                       args.minibatch, not args.no_check)]
        if args.csv is not None:
            append_rows(args.csv, CSV_FIELDS, rows)


if __name__ == "__main__":
    main()
