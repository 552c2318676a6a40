"""Host time of one mok training step, per launcher: where the host's share of a step goes.

    python -m benchmarks.host [--shapes SHAPE ...] [--repeats N] [--recompute] [--profile N]
    python -m benchmarks.host --parts [--shapes SHAPE ...] [--repeats N] [--recompute]
    python -m benchmarks.host --ep P [--shapes ...] [--repeats N] [--recompute] [--profile N]

A call that starts on an idle GPU waits for the host to launch its first long kernel (the
benchmark's forward at qwen3-30b-a3b lost about 0.38 ms so against `bench --host-ahead`). This
times, with the host clock, each launcher of `mok.ops` that `mok.functional` calls in a step
(schedule, forward, backward), the time outside them (mok.functional's own Python: checks,
allocations, views) and the whole step. On a GPU the device sleeps before each step, so no
launch waits on it. Medians over --repeats steps, in microseconds; on CPU (Triton's
interpreter) the launchers' times are the interpreter running the kernels, not launch costs.
--profile N also prints the N Python functions with the most host time of their own (cProfile
over the same steps); cProfile inflates short calls, so it misranks what they cost.

--parts: the forward and the backward apart, each with the host time spent in named parts
(launches through mok.ops.launch and their keys, TMA descriptors, allocations, the error flags'
copy to the host and its poll, the CUDA calls under them: each part inclusive of what it
calls, so parts overlap), and when the forward had built its schedule and launched gate/up,
from its start. Each part is timed by clocks wrapped around its function, without a profiler.

--ep P: the same for expert parallelism over P processes (`mok.testing.run_distributed`; on a
machine with one GPU set MOK_RANKS_SHARE_GPU=1, the host's times do not depend on it), each rank
with its share of the `python -m mok bench --ep P` work: the host time of one forward and one
forward+backward (schedule included), the device asleep before each, and `in a row`: the
calls after the first of IN_A_ROW + 1 issued back to back, the device asleep meanwhile (a host
that keeps issuing, as in training, runs a call faster than one that starts after a sync). For
the rows pulled by kernels and moved by copies (MoKConfig.fwd_copy_rows / bwd_copy_rows), and
for scale the same
per-GPU work on one GPU without a group. Medians and least of --repeats calls, the slowest
rank's, in ms (on a machine whose ranks share one GPU the host times move by some 10% between
runs); then rank 0's host time per wrapped function (mok.ops' launchers, mok.ops.comm's functions,
SymmetricExchange's methods; each exclusive of the others it calls; "the rest of the step" is
mok.functional's own Python and the torch calls it makes itself);
--profile N: the N functions with the most host time of their own in one call, rank 0's.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import inspect
import io
import pstats
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist

import mok.functional as F
from benchmarks.layer import BENCH_SHAPES, HOST_AHEAD_S, TINY, hold_device
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


def host_times(shape, *, recompute: bool, repeats: int, device: torch.device,
               profile: int = 0, precision: str = "bf16") -> dict[str, float]:
    """{launcher or "outside launchers" or "step": median host microseconds per step}; profile:
    print that many functions of a cProfile of the steps, by their own time."""
    inputs = make_shape_inputs(shape, device=device, seed=0)
    config = F.MoKConfig(recompute_gate_up=recompute, precision=precision)
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


def _parts() -> list[tuple[str, object, str]]:
    """(label, owner, attribute) of each function --parts times."""
    from mok.ops import experts, fp8, launch

    parts = [("launches through mok.ops.launch", launch, "_launch"),
             ("their keys", launch, "_key"),
             ("Gluon descriptors", experts, "_gluon_descriptor"),
             ("Gluon descriptors", fp8, "_descriptor"),
             ("FP8 plans", F, "_fp8_plan"),
             ("FP8 weights (the cache's lookup)", F, "_fp8_weights"),
             ("FP8 rows quantized (quantize_rows)", ops, "quantize_rows"),
             ("allocations (torch.empty)", torch, "empty"),
             ("the flags' copy to the host", F.Workspace, "_publish_errors"),
             ("the flags' poll", F.Workspace, "_poll_errors"),
             ("plans", F, "forward_plan"), ("plans", F, "backward_plan"),
             ("Tensor.copy_", torch.Tensor, "copy_"),
             ("Event.record", torch.cuda.Event, "record"),
             ("Event.query", torch.cuda.Event, "query")]
    try:
        from triton.backends.nvidia import driver
    except ImportError:  # a Triton without the CUDA backend
        return parts
    return [*parts, ("TMA descriptors filled (Triton)", driver, "make_tensordesc_arg")]


def host_parts(shape, *, recompute: bool, repeats: int, device: torch.device,
               precision: str = "bf16") -> dict[str, float]:
    """{"forward" / "backward" / "forward: <part>" / "backward: <part>" / the forward's
    milestones: median host microseconds} (see --parts)."""
    inputs = make_shape_inputs(shape, device=device, seed=0)
    config = F.MoKConfig(recompute_gate_up=recompute, precision=precision)
    workspace = F.create_workspace(config, None, device=device,
                                   num_local_tokens=shape.num_tokens,
                                   hidden_size=shape.hidden_size, topk=shape.topk)
    totals: dict[str, float] = defaultdict(float)
    marks: dict[str, float] = {}

    def forward():
        schedule = F.build_schedule(workspace, config, inputs.topk_experts,
                                    num_local_experts=inputs.num_local_experts)
        marks.setdefault("schedule built", time.perf_counter())
        return schedule, F.forward(config, workspace, schedule, *inputs.layer_args)[1]

    def backward(schedule, context):
        return F.backward(config, workspace, schedule, context, inputs.d_output,
                          *inputs.layer_args)

    backward(*forward())  # compiles
    gate_up_name = "gate_up_swiglu_fp8" if precision == "fp8" else "gate_up_swiglu"
    gate_up = getattr(ops, gate_up_name)

    def gate_up_marked(*args, **kwargs):
        done = gate_up(*args, **kwargs)
        marks.setdefault("gate/up launched", time.perf_counter())
        return done

    parts = _parts()
    labels = list(dict.fromkeys(label for label, _, _ in parts))
    originals = [(owner, attribute, getattr(owner, attribute)) for _, owner, attribute in parts]
    samples: dict[str, list[float]] = defaultdict(list)
    try:
        for (label, owner, attribute), (_, _, fn) in zip(parts, originals, strict=True):
            setattr(owner, attribute, _timed(fn, totals, label))
        setattr(ops, gate_up_name, gate_up_marked)
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
                hold_device()
            totals.clear()
            marks.clear()
            start = time.perf_counter()
            saved = forward()
            middle = time.perf_counter()
            forward_parts = dict(totals)
            totals.clear()
            backward(*saved)
            samples["forward"].append(middle - start)
            samples["backward"].append(time.perf_counter() - middle)
            for mark, at in marks.items():
                samples[f"forward: {mark} at"].append(at - start)
            for phase, timed in (("forward", forward_parts), ("backward", dict(totals))):
                for label in labels:
                    samples[f"{phase}: {label}"].append(timed.get(label, 0.0))
    finally:
        for owner, attribute, fn in originals:
            setattr(owner, attribute, fn)
        setattr(ops, gate_up_name, gate_up)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return {name: statistics.median(values) * 1e6 for name, values in samples.items()}


def _ep_variants(recompute: bool) -> list[tuple[str, F.MoKConfig]]:
    base = F.MoKConfig(recompute_gate_up=recompute)
    return [("pull", base),
            ("copies", dataclasses.replace(base, fwd_copy_rows=True, bwd_copy_rows=True))]


# Calls in a row of a back-to-back sample (the first, after the sync, is left out of it): few
# enough that their launches fit the device's queue while it sleeps.
IN_A_ROW = 5


def _host_ms(fn, repeats: int, cuda: bool, in_a_row: bool = False) -> list[float]:
    """Host ms of calls of fn, the device asleep meanwhile: each after a sync (the host's pace
    from an idle GPU), or in_a_row: IN_A_ROW + 1 calls back to back after one sync, the first
    left out (the pace of a host that keeps issuing, as in training), per sample."""
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        calls = IN_A_ROW + 1 if in_a_row else 1
        if cuda:
            hold_device(HOST_AHEAD_S * calls)
        for call in range(calls):
            start = time.perf_counter()
            fn()
            if call or not in_a_row:
                times.append((time.perf_counter() - start) * 1e3)
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    return times


def _profile_top(fn, top: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(top)
    return stream.getvalue()


class _StackTimer:
    """Host time of wrapped functions, each exclusive of the wrapped functions it calls."""

    def __init__(self) -> None:
        self.own: dict[str, float] = defaultdict(float)
        self._children = [0.0]

    def wrap(self, fn, name: str):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self._children.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                self.own[name] += spent - self._children.pop()
                self._children[-1] += spent
        return wrapper


def _patched(timer: _StackTimer) -> list[tuple[object, str, object]]:
    """Wrap mok.ops' launchers, mok.ops.comm's functions and SymmetricExchange's methods in timer;
    returns what to restore."""
    from mok.exchange import SymmetricExchange
    from mok.ops import comm

    targets = [(ops, name, f"ops.{name}") for name in _launchers()]
    targets += [(comm, name, f"comm.{name}") for name, fn in vars(comm).items()
                if inspect.isfunction(fn) and fn.__module__ == comm.__name__]
    targets += [(SymmetricExchange, name, f"ep.{name}")
                for name, fn in vars(SymmetricExchange).items()
                if inspect.isfunction(fn) and name != "__init__"]
    saved = []
    for owner, name, label in targets:
        fn = getattr(owner, name)
        saved.append((owner, name, fn))
        setattr(owner, name, timer.wrap(fn, label))
    return saved


def _ep_rank(rank: int, world_size: int, shape_name: str, recompute: bool, repeats: int,
             profile: int) -> tuple[dict[str, float], dict[str, dict[str, float]], list[str]]:
    """({"variant, mode": (median, least) host ms}, {variant: {function: its own ms in a
    forward+backward}}, profiles) of this rank (see --ep)."""
    from benchmarks.ep import MoKLayer, compute_only_sizes, ep_shape, rank_inputs
    from mok.testing import make_inputs, rank_device

    device = rank_device(rank)
    cuda = device.type == "cuda"
    shape = ep_shape(BENCH_SHAPES[shape_name], world_size)
    tokens, topk, num_local = compute_only_sizes(shape, world_size)
    solo = make_inputs(tokens, shape.hidden_size, shape.intermediate_size, num_local, topk,
                       shared_intermediate_size=shape.shared_intermediate_size, device=device,
                       seed=7 + rank)
    inputs = rank_inputs(shape, rank, world_size, device)
    times, own, profiles = {}, {}, []
    layers = [("one GPU", MoKLayer(solo, None, _ep_variants(recompute)[0][1]))]
    layers += [(label, MoKLayer(inputs, dist.group.WORLD, config))
               for label, config in _ep_variants(recompute)]
    for label, layer in layers:
        layer.step()  # compiles
        for mode, fn in (("forward", layer.forward), ("forward+backward", layer.step)):
            for in_a_row in (False, True):
                samples = _host_ms(fn, repeats, cuda, in_a_row)
                times[f"{label}, {mode}{', in a row' if in_a_row else ''}"] = (
                    statistics.median(samples), min(samples))
        timer = _StackTimer()
        saved = _patched(timer)
        try:
            _host_ms(timer.wrap(layer.step, "the rest of the step"), repeats, cuda)
        finally:
            for owner, name, fn in saved:
                setattr(owner, name, fn)
        own[label] = {name: seconds * 1e3 / repeats for name, seconds in timer.own.items()}
        if profile:
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            if cuda:
                hold_device()
            text = _profile_top(layer.step, profile)
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            profiles.append(f"-- {label}, one forward+backward (rank {rank}):\n{text}")
        del layer
    return times, own, profiles


def ep_main(args) -> None:
    from mok.testing import run_distributed

    for name in args.shapes:
        results = run_distributed(_ep_rank, args.ep, name, args.recompute, args.repeats,
                                  args.profile, timeout_s=1800)
        mode = "recompute" if args.recompute else "kept gate/up"
        print(f"== {name}, EP={args.ep} ({mode}): host "
              f"ms per call, device asleep before it, median and least of {args.repeats}, "
              "slowest rank")
        for key in results[0][0]:
            median = max(times[key][0] for times, _, _ in results)
            least = max(times[key][1] for times, _, _ in results)
            print(f"  {key:34s} {median:8.3f} {least:8.3f}")
        own = results[0][1]
        print("  rank 0's host ms per forward+backward by function, its own time (mean; the "
              "timers add theirs):")
        names = sorted({name for table in own.values() for name in table},
                       key=lambda name: -max(table.get(name, 0.0) for table in own.values()))
        print("    " + "".join(f"{label:>10s}" for label in own) + "  function")
        for name in names[:args.top]:
            print("    " + "".join(f"{own[label].get(name, 0.0):10.3f}" for label in own)
                  + f"  {name}")
        print("    " + "".join(f"{sum(own[label].values()):10.3f}" for label in own)
              + "  (all of them)")
        for text in results[0][2]:
            print(text)


def main(argv=None) -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(BENCH_SHAPES),
                        default=["qwen3-30b-a3b"] if cuda else [TINY.name])
    parser.add_argument("--repeats", type=int, default=20 if cuda else 2)
    parser.add_argument("--recompute", action="store_true",
                        help="MoKConfig(recompute_gate_up=True) (default: the default config, "
                             "gate/up kept)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print the N functions with the most host time of their own")
    parser.add_argument("--top", type=int, default=25,
                        help="--ep: how many functions of the host breakdown to print")
    parser.add_argument("--ep", type=int, default=0, metavar="P",
                        help="expert parallelism over P processes (see above)")
    parser.add_argument("--parts", action="store_true",
                        help="the forward and backward by named parts (see above)")
    parser.add_argument("--precision", choices=F.PRECISIONS, default="bf16",
                        help="MoKConfig.precision (not with --ep)")
    args = parser.parse_args(argv)
    if args.ep:
        ep_main(args)
        return
    device = torch.device("cuda" if cuda else "cpu")
    if args.parts:
        for name in args.shapes:
            times = host_parts(BENCH_SHAPES[name], recompute=args.recompute,
                               repeats=args.repeats, device=device, precision=args.precision)
            print(f"== {name} {args.precision} "
                  f"({'recompute' if args.recompute else 'kept gate/up'}): host us, "
                  f"median of {args.repeats}; parts include what they call")
            for label, us in times.items():
                print(f"  {label:48s} {us:10.1f}")
        return
    for name in args.shapes:
        times = host_times(BENCH_SHAPES[name], recompute=args.recompute, repeats=args.repeats,
                           device=device, profile=args.profile, precision=args.precision)
        print(f"== {name} {args.precision} "
              f"({'recompute' if args.recompute else 'kept gate/up'}): host us per step, "
              f"median of {args.repeats}")
        for label, us in sorted(times.items(), key=lambda item: -item[1]):
            print(f"  {label:24s} {us:10.1f}")


if __name__ == "__main__":
    main()
