"""The expert-parallel launches on one GPU: what pulling rows costs the gate/up GEMM and what
scattering rows costs down and d_x, a rank's own tokens from and to its own memory
(mok.testing.pull; a ScatterRows with every delta 0), through the same kernels, flags and waits
as between ranks.

    python -m benchmarks.ep_local [--shapes qwen3-30b-a3b ...] [--minibatch N] [--csv PATH]
                                  [--peer-gbs 360] [--rounds N] [--ahead-ms 1]

Per shape, the median ms (CUDA events; the GPU asleep --ahead-ms before each call, so the host
has queued it: GPU time alone) of:
- gate/up `gluon`: the Gluon kernel reading x directly (nothing pulled: the floor);
  `pull apart + gluon`: the pull in a launch of its own over every SM, then the Gluon kernel;
  `gluon pulling`: the Gluon kernel pulling in a partition of each program
  (MoKConfig.fwd_pull_in_gluon); `triton pulling`: the Triton kernel at the table's Triton
  tiles, its first MoKConfig.fwd_num_comm_sms programs pulling. Every gate/up call also numbers
  a new round (a small kernel).
- down and d_x: `gluon` writing rows in schedule order, `gluon scatter` writing each at its
  route (what goes to the tokens' ranks), `triton scatter` at the table's Triton tiles; d_x
  also `pulling x` (kept pre-activations: x's rows for the weight gradients, pulled by a
  partition of each program, or the Triton launch's first programs).
- the dSwiGLU (the backward's first GEMM, recomputing gate/up, and `kept` reading the forward's
  pre-activations): `gluon` reading d_output and x directly; `triton pulling` (the EP launch
  without MoKConfig.bwd_copy_rows: its first MoKConfig.bwd_num_comm_sms programs pull d_output,
  recomputing x too, the tiles waiting on them); recomputing, `apart, triton pulling`
  (DswigluTiles.apart as the EP backward runs it when rows are pulled: gate/up on the table's
  Triton tiles pulling x's and d_output's rows, then the kept dSwiGLU pulling nothing).
- rows moved by copies (MoKConfig.fwd_copy_rows and bwd_copy_rows, mok.testing.pull.
  local_copied), gate/up and both dSwiGLU, Gluon: the tokens split as if over two ranks, this
  being the first; `copied` with every flag raised before the launch (what the waits and the
  local-first block order cost); `copied late` with the second rank's flag raised by a side
  stream after a host-to-device copy (the copy engines, as a peer's copy) of the time a peer's
  copy of its rows would take at --peer-gbs GB/s (its x at gate/up, d_output and x recomputing,
  d_output kept), the row blocks local first (mok.ops.local_first_blocks; `lead
  0.5`: only those among the first half of the used blocks) or, `in schedule order`, not;
  gate/up also `flag late` (the side stream writes the flag alone, no copy before it) and
  `by a copy` (the flag written by a host-to-device copy instead of cuStreamWriteValue32).
Local memory answers and takes writes faster than a peer over NVLink: this measures what the
pull or scatter costs the GEMM, not the link. Each variant is checked against the Gluon kernel's
own results first (bitwise where the tiles are the same).
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
from mok.ops import comm
from mok.testing import SHAPES, SHAPES_BY_NAME
from mok.testing.pull import local_copied, local_pull

CSV_FIELDS = ("gpu", "commit", "date", "shape", "minibatch", "impl", "ms")


def _check(name, actual, expected, bitwise: bool) -> None:
    if bitwise:
        if not torch.equal(actual, expected):
            raise RuntimeError(f"{name}: differs from the Gluon kernel's")
    else:  # other tiles: another summation order
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-2, atol=2e-2)


class _Late:
    """A side stream and a host-to-device copy of about `ms` milliseconds (the copy engines)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        probe = 64 << 20
        src = torch.empty(probe, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(probe, dtype=torch.uint8, device=device)
        self.gbs = probe / 1e6 / median_ms(lambda: dst.copy_(src, non_blocking=True), 5, 2)
        print(f"host-to-device copy: {self.gbs:.0f} GB/s", flush=True)
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def delay(self, ms: float) -> tuple[torch.Tensor, torch.Tensor]:
        nbytes = max(int(ms * 1e6 * self.gbs), 1)  # ms * 1e-3 s at gbs * 1e9 B/s
        if nbytes not in self._buffers:
            self._buffers[nbytes] = (
                torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
                torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
        return self._buffers[nbytes]


def measure(shape, repeats: int, warmup: int, minibatch: int, only: str = "",
            peer_gbs: float = 360.0, rounds: int = 1,
            ahead_ms: float = 0.0) -> list[tuple[str, float]]:
    inputs, config, _, schedule = shape_setup(shape, seed=5)
    config = dataclasses.replace(config, minibatch_size=minibatch)
    routing = schedule.routing
    x, w_gate, w_up, w_down = (inputs.x, inputs.w_routed_gate, inputs.w_routed_up,
                               inputs.w_routed_down)
    inter, hidden = w_gate.shape[1], w_gate.shape[2]
    pick = schedule.tiles.pick
    pulled = local_pull(x, routing, inputs.router_weights,
                        minibatch=config.minibatch_size, num_programs=config.fwd_num_comm_sms)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    used = int(routing.expert_offsets[-1])
    routes = x.shape[0] * routing.topk
    order = routing.route_row.long()  # every route is scheduled: one rank, dropless
    weights = inputs.router_weights.reshape(-1)
    h = ops.gate_up_swiglu(x, w_gate, w_up, routing, pick("gate_up", inter, hidden), None)
    d_gate_up = torch.randn(routing.capacity_rows, 2 * inter, device=x.device, dtype=x.dtype)
    combine = torch.empty(routes, hidden, device=x.device, dtype=x.dtype)
    scatter = comm.ScatterRows(combine, torch.zeros(1, dtype=torch.int64, device=x.device),
                               routing.row_route, routes)

    def gate_up(rows, tiles, pull=None, apart=False):
        def run():
            pulled.next_round()
            if apart:
                pulled.pull.run_apart(pulled.rows, sms)
            return ops.gate_up_swiglu(rows, w_gate, w_up, routing, tiles, None, pull=pull)
        return run

    def down(tiles, to=None):
        return lambda: ops.down_proj(h, w_down, routing, tiles, weights, scatter=to)

    x_pull = local_pull(x, routing, minibatch=config.minibatch_size,
                        num_programs=config.bwd_num_comm_sms)

    def d_x(tiles, to=None, pull_x=False):
        if not pull_x:
            return lambda: ops.d_x_rows(d_gate_up, w_gate, w_up, routing, tiles, scatter=to)

        def run():
            x_pull.next_round()
            return ops.d_x_rows(d_gate_up, w_gate, w_up, routing, tiles, scatter=to,
                                pull=x_pull.pull, pulled=x_pull.rows)
        return run

    gate_up_tiles = pick("gate_up", inter, hidden)
    down_tiles, d_x_tiles = pick("down", hidden, inter), pick("d_x", hidden, inter)
    errors = [pulled.pull.peer.errors, x_pull.pull.peer.errors]  # every pull's, checked
    late = _Late(x.device)
    row_bytes = x.shape[0] * hidden * x.element_size()  # one rank's rows, a peer's copy of them

    def copied(rows, block_m, fn, copy_ms=None, lead=1.0, flag_by_copy=False):
        """fn(pull) with rows copied (local_copied); copy_ms: the second rank's land late (0:
        the flag alone written by the side stream)."""
        moved = local_copied(rows, routing, block_m, lead=lead)
        errors.append(moved.pull.peer.errors)

        def run():
            if copy_ms is None:
                moved.land()
                return fn(moved.pull)
            moved.land(late.stream, late.delay(copy_ms) if copy_ms else None, flag_by_copy)
            out = fn(moved.pull)
            torch.cuda.current_stream().wait_stream(late.stream)
            return out
        return run

    def gate_up_copied(**kw):
        return copied(x, gate_up_tiles.block_m, lambda pull: ops.gate_up_swiglu(
            x, w_gate, w_up, routing, gate_up_tiles, None, pull=pull), **kw)

    # the copied variants' orders: (name's suffix, local_first_blocks's lead)
    orders = [("", 1.0), (", lead 0.5", 0.5), (", in schedule order", None)]

    d_out, rw = inputs.d_output, inputs.router_weights
    kept_up = ops.gate_up_buffer(x, w_gate, routing)
    ops.gate_up_swiglu(x, w_gate, w_up, routing, gate_up_tiles, None, gate_up=kept_up)
    h_kept = torch.empty_like(h)  # written by the kept dSwiGLU (h_out)

    def dswiglu(kept, tiles, pull=None, rows=(d_out, x)):
        if kept:
            return ops.down_bwd_dswiglu(rows[0], rows[1], w_down, w_gate, w_up, h_kept, routing,
                                        tiles, rw, None, pull=pull, gate_up=kept_up,
                                        h_out=True)[0]
        if tiles.apart and (pull is None or pull.copied):  # two launches, as the layer runs
            return ops.dswiglu_apart(rows[0], rows[1], w_down, w_gate, w_up, routing,
                                     *apart_tiles, rw, None, pull=pull)[0]
        return ops.down_bwd_dswiglu(rows[0], rows[1], w_down, w_gate, w_up, h, routing, tiles,
                                    rw, None, pull=pull)[0]

    apart_tiles = schedule.tiles.pick_apart(inter, hidden)

    def first_block_m(kept):
        """Row blocks of the backward's first launch (DswigluTiles.apart: gate/up's)."""
        tiles = pick(_dswiglu_kind(kept), inter, hidden)
        return apart_tiles[0].block_m if tiles.apart and not kept else tiles.block_m

    def dswiglu_pulling(kept):
        pulled_dy = local_pull(d_out, routing, minibatch=config.minibatch_size,
                               num_programs=config.bwd_num_comm_sms)
        pull = pulled_dy.pull
        errors.append(pull.peer.errors)
        x_rows = torch.empty_like(x)
        if not kept:  # x's rows come with d_output's (kept: in d_x's launch, not timed here)
            pull = dataclasses.replace(pull, second_src=x)
        tiles = pick(_dswiglu_kind(kept), inter, hidden, triton=True)

        def run():
            pulled_dy.next_round()
            return dswiglu(kept, tiles, pull, (pulled_dy.rows, x_rows))
        return run

    def dswiglu_apart_pulling():
        """DswigluTiles.apart with rows pulled by kernels: gate/up (the table's Triton tiles)
        pulls x's rows and d_output's, the kept dSwiGLU after it pulls nothing."""
        pulled_x = local_pull(x, routing, minibatch=config.minibatch_size,
                              num_programs=config.bwd_num_comm_sms)
        pull = dataclasses.replace(pulled_x.pull, second_src=d_out)
        errors.append(pull.peer.errors)
        dy_rows = torch.empty_like(d_out)
        tiles = schedule.tiles.pick_apart(inter, hidden, pulling=True)

        def run():
            pulled_x.next_round()
            return ops.dswiglu_apart(dy_rows, pulled_x.rows, w_down, w_gate, w_up, routing,
                                     *tiles, rw, None, pull=pull)[0]
        return run

    def dswiglu_copied(kept, late_copy, lead):
        tiles = pick(_dswiglu_kind(kept), inter, hidden)
        # The flagged copies: d_output's rows, and x's recomputing.
        ms = (1 if kept else 2) * row_bytes / peer_gbs / 1e6 if late_copy else None
        return copied(d_out, first_block_m(kept), lambda pull: dswiglu(kept, tiles, pull),
                      copy_ms=ms, lead=lead)

    # (name, call, rows of its result to compare, whether bitwise)
    variants = [
        ("gate/up gluon", gate_up(x, gate_up_tiles), slice(0, used), True),
        ("gate/up pull apart + gluon", gate_up(pulled.rows, gate_up_tiles, apart=True),
         slice(0, used), True),
        ("gate/up gluon pulling", gate_up(pulled.rows, gate_up_tiles, pulled.pull),
         slice(0, used), True),
        ("gate/up triton pulling", gate_up(pulled.rows, pick("gate_up", inter, hidden,
                                                             triton=True), pulled.pull),
         slice(0, used), False),
    ] + [
        (f"gate/up gluon copied{late_copy and ' late' or ''}{suffix}",
         gate_up_copied(copy_ms=row_bytes / peer_gbs / 1e6 if late_copy else None, lead=lead),
         slice(0, used), True)
        for late_copy in (False, True) for suffix, lead in orders
    ] + [
        ("gate/up gluon copied, flag late", gate_up_copied(copy_ms=0), slice(0, used), True),
        ("gate/up gluon copied, flag late by a copy", gate_up_copied(copy_ms=0, flag_by_copy=True),
         slice(0, used), True),
        ("gate/up gluon copied late, flag by a copy",
         gate_up_copied(copy_ms=row_bytes / peer_gbs / 1e6, flag_by_copy=True), slice(0, used),
         True),
    ] + [
        ("down gluon", down(down_tiles), slice(0, used), True),
        ("down gluon scatter", down(down_tiles, scatter), order, True),
        ("down triton scatter", down(pick("down", hidden, inter, triton=True), scatter), order,
         False),
        ("d_x gluon", d_x(d_x_tiles), slice(0, used), True),
        ("d_x gluon scatter", d_x(d_x_tiles, scatter), order, True),
        ("d_x triton scatter", d_x(pick("d_x", hidden, inter, triton=True), scatter), order,
         False),
        ("d_x gluon scatter pulling x", d_x(d_x_tiles, scatter, True), order, True),
        ("d_x triton scatter pulling x", d_x(pick("d_x", hidden, inter, triton=True), scatter,
                                             True), order, False),
    ]
    for kept in (False, True):
        name = "dswiglu_kept" if kept else "dswiglu"
        tiles = pick(_dswiglu_kind(kept), inter, hidden)
        variants += [
            (f"{name} gluon", lambda kept=kept, tiles=tiles: dswiglu(kept, tiles),
             slice(0, used), True),
            (f"{name} triton pulling", dswiglu_pulling(kept), slice(0, used), False),
        ] + ([] if kept else [
            (f"{name} apart, triton pulling", dswiglu_apart_pulling(), slice(0, used), False),
        ]) + [
            (f"{name} gluon copied{late_copy and ' late' or ''}{suffix}",
             dswiglu_copied(kept, late_copy, lead), slice(0, used), True)
            for late_copy in (False, True) for suffix, lead in orders
        ]
    expected = {}
    timed = []
    for name, fn, rows, bitwise in variants:
        if only not in name and name.split()[1:] != ["gluon"]:  # each GEMM's first is kept
            continue
        pulled.rows.zero_()
        x_pull.rows.zero_()
        combine.zero_()
        out = fn()
        torch.cuda.synchronize()
        for flags in errors:
            if int(flags.abs().sum()) != 0:
                raise RuntimeError(f"{shape.name} {name}: error flags {flags}")
        if "pulling x" in name and not torch.equal(x_pull.rows, x):
            raise RuntimeError(f"{shape.name} {name}: x's rows did not land")
        gemm = name.split()[0]
        if gemm not in expected:  # the first of each GEMM: the Gluon kernel in schedule order
            expected[gemm] = out[rows].clone()
        else:
            got = out if out is combine else out[rows]
            want = expected[gemm] if out is not combine else expected[gemm][order]
            _check(f"{shape.name} {name}", got, want, bitwise)
        timed.append((name, fn))
    # Timed in turn, `rounds` times: a variant's times side by side show the run-to-run spread.
    results = []
    for _ in range(rounds):
        for name, fn in timed:
            results.append((name, median_ms(fn, repeats, warmup, ahead_ms=ahead_ms)))
            torch.cuda.synchronize()
            if any(int(flags.abs().sum()) != 0 for flags in errors):
                raise RuntimeError(f"{shape.name} {name}: a wait timed out while timed")
            print(f"{shape.name:24s} {name:48s} {results[-1][1]:7.3f} ms", flush=True)
    return results


def _dswiglu_kind(kept: bool) -> str:
    return "down_bwd_saved" if kept else "down_bwd"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=[s.name for s in SHAPES])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--minibatch", type=int, default=F.MoKConfig().minibatch_size,
                        help="tokens per ready flag (MoKConfig.minibatch_size)")
    parser.add_argument("--csv", type=Path, default=None, help="append a row per measurement")
    parser.add_argument("--peer-gbs", type=float, default=360.0,
                        help="a peer copy's rate, for the `copied late` variants' delay")
    parser.add_argument("--ahead-ms", type=float, default=1.0,
                        help="the GPU sleeps this long before each timed call, so the time is "
                        "the GPU's, not the host's issuing the call (0: no sleep)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every variant this many times in turn (a row each)")
    parser.add_argument("--only", default="", help="the variants whose name has this (and each "
                        "GEMM's Gluon kernel, the one the others are checked against)")
    args = parser.parse_args(argv)
    from benchmarks import append_rows, commit_id

    gpu = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    for name in args.shapes:
        rows = [dict(gpu=gpu, commit=commit_id(), date=date, shape=name,
                     minibatch=args.minibatch, impl=impl, ms=f"{ms:.4f}")
                for impl, ms in measure(SHAPES_BY_NAME[name], args.repeats, args.warmup,
                                        args.minibatch, args.only, args.peer_gbs,
                                        args.rounds, args.ahead_ms)]
        if args.csv is not None:
            append_rows(args.csv, CSV_FIELDS, rows)


if __name__ == "__main__":
    main()
