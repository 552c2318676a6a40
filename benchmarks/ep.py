"""Expert-parallel benchmark: `python -m mok bench --ep N` (N processes, one GPU each).

For each shape (docs/design.md section 4, tokens per GPU as listed; E in total, except kimi whose 6
experts are per GPU), on the same inputs on every rank:
- mok: build_schedule + forward (+ backward) over the group (symmetric memory, pulls beside the
  GEMMs);
- nccl_grouped_mm: the torchtitan way: split sizes exchanged and read on the host, NCCL
  all_to_all_single of the token rows, torch._grouped_mm experts, all_to_all_single back,
  weighted sum; backward through autograd;
- compute_only: mok on one GPU with the same per-GPU work (T tokens, the E_local local experts),
  no communication: the floor the overlap aims at;
- with --recompute-gate-up, mok and compute_only run with MoKConfig(recompute_gate_up=True)
  (rows mok_recompute, compute_only_recompute; before the default changed on 2026-12-03 the
  rows without a suffix recomputed and --keep-gate-up gave mok_kept, compute_only_kept);
- dispatch: mok's publish + pull of the forward alone (copied rows: publish + copies of every
  other rank's whole x), for the NVLink bandwidth it reaches
  (bytes of the other ranks' tokens pulled, a row per token, / time; the measured pull
  ceiling of copy_ is 371 GB/s);
- down_scatter / down_local: the forward's down GEMM writing its rows into the tokens' ranks'
  combine buffers (the combine's NVLink traffic, remote bytes / time) and the same GEMM writing
  them locally: the difference is what the remote writes cost.
Every implementation is checked against the mok.testing reference on the group first
(--no-check: not, where the fp32 reference of every rank does not fit, as 8 ranks sharing an
80 GB GPU; its rows' max_rel_err is then nan; a peer timeout still fails the run). Collective
code is timed with a fixed loop count and CUDA events (never do_bench: ranks must issue the same
number of collectives), a few calls back to back per sample as layers run in training (host time
hidden behind GPU time where it is shorter; the baseline's host sync still costs what it costs);
a row reports the slowest rank's median. Rows go to
benchmarks/results/ep.csv. Without GPUs it runs the `tiny` shape on CPU processes (gloo, mok's
kernels under Triton's interpreter, shared-memory symmetric buffers), writing under runs/bench/:
a check of the pipeline, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as torch_f

RESULTS = Path(__file__).resolve().parent / "results"
CPU_RUNS = Path(__file__).resolve().parent.parent / "runs" / "bench"
CSV_FIELDS = ("gpu", "commit", "date", "ep", "shape", "comm_sms", "impl", "mode", "ms", "tflops",
              "vs_compute_only", "gb_s", "peak_mem_gb", "max_rel_err")
DEFAULT_SHAPES = ("qwen3-30b-a3b", "kimi-ep64-slice")
PULL_CEILING_GB_S = 371.0


def ep_shape(shape, world_size):
    """E in total stays as listed, except for kimi's slice, whose experts are per GPU, and the
    tiny CPU check, whose experts grow to one per rank. E must split evenly over the ranks."""
    if shape.name.startswith("kimi"):
        return dataclasses.replace(shape, num_experts=shape.num_experts * world_size)
    if shape.name == "tiny" and shape.num_experts < world_size:
        return dataclasses.replace(shape, num_experts=world_size)
    if shape.num_experts % world_size:
        raise SystemExit(f"{shape.name}: {shape.num_experts} experts do not split over "
                         f"{world_size} ranks")
    return shape


def compute_only_sizes(shape, world_size) -> tuple[int, int, int]:
    """(tokens, top-k, experts) of the compute-only run: one GPU's share of the group's work,
    its E / P experts and, balanced, T * k routes. Where k exceeds E / P (mixtral at EP=8: one
    expert a rank, k = 2) each token takes E / P routes and the tokens grow to keep T * k (a
    shared expert then runs on those tokens too: only the tiny check has both)."""
    num_local = shape.num_experts // world_size
    topk = min(shape.topk, num_local)
    return shape.num_tokens * shape.topk // topk, topk, num_local


def rank_inputs(shape, rank, world_size, device, seed=0):
    from mok.testing import make_inputs

    num_local = shape.num_experts // world_size
    return make_inputs(shape.num_tokens, shape.hidden_size, shape.intermediate_size,
                       shape.num_experts, shape.topk,
                       shared_intermediate_size=shape.shared_intermediate_size,
                       num_local_experts=num_local, device=device, seed=seed * 1000 + rank)


# -- the baseline: NCCL all_to_all + grouped_mm ---------------------------------------------------

def nccl_grouped_mm_moe(x, topk_experts, router_weights, w_gate_up, w_down, shared, group):
    """torchtitan's expert parallelism: w_gate_up [E_local, 2I, H], w_down [E_local, H, I]."""
    from torch.distributed.nn import functional as dist_fn

    world = dist.get_world_size(group)
    num_tokens, topk = topk_experts.shape
    num_local = w_gate_up.shape[0]
    flat = topk_experts.reshape(-1)
    order = torch.argsort(flat, stable=True)               # by expert, so by destination rank
    send_counts = torch.bincount(flat // num_local, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()  # host sync
    sorted_experts = flat[order]
    recv_experts = torch.empty(sum(recv_splits), dtype=flat.dtype, device=x.device)
    dist.all_to_all_single(recv_experts, sorted_experts, recv_splits, send_splits, group=group)
    rows = dist_fn.all_to_all_single(
        torch.empty(sum(recv_splits), x.shape[1], dtype=x.dtype, device=x.device),
        x[order // topk], recv_splits, send_splits, group=group)
    local = recv_experts % num_local
    local_order = torch.argsort(local, stable=True)
    offsets = torch.cumsum(torch.bincount(local, minlength=num_local), 0).to(torch.int32)
    gate_up = torch._grouped_mm(rows[local_order], w_gate_up.transpose(-2, -1), offs=offsets)
    gate, up = gate_up.chunk(2, dim=-1)
    out_sorted = torch._grouped_mm(torch_f.silu(gate) * up, w_down.transpose(-2, -1),
                                   offs=offsets)
    out_rows = torch.empty_like(out_sorted).index_copy(0, local_order, out_sorted)
    back = dist_fn.all_to_all_single(
        torch.empty(num_tokens * topk, x.shape[1], dtype=x.dtype, device=x.device),
        out_rows, send_splits, recv_splits, group=group)
    weighted = (back.float() * router_weights.reshape(-1)[order, None]).to(x.dtype)
    y = torch.zeros_like(x).index_add(0, order // topk, weighted)
    if shared is not None:
        w_sg, w_su, w_sd = shared
        y = y + (torch_f.silu(x @ w_sg.T) * (x @ w_su.T)) @ w_sd.T
    return y


class Baseline:
    def __init__(self, inputs, group):
        self.group = group
        self.inputs = inputs
        leaf = lambda t: t.detach().clone().requires_grad_(True)  # noqa: E731
        self.x = leaf(inputs.x)
        self.rw = leaf(inputs.router_weights)
        self.w_gate_up = leaf(torch.cat([inputs.w_routed_gate, inputs.w_routed_up], dim=1))
        self.w_down = leaf(inputs.w_routed_down)
        self.shared = (tuple(leaf(w) for w in inputs.shared_weights)
                       if inputs.w_shared_gate is not None else None)

    def forward(self):
        with torch.no_grad():
            return nccl_grouped_mm_moe(self.x, self.inputs.topk_experts, self.rw, self.w_gate_up,
                                       self.w_down, self.shared, self.group)

    def step(self):
        leaves = (self.x, self.rw, self.w_gate_up, self.w_down, *(self.shared or ()))
        for t in leaves:
            t.grad = None
        y = nccl_grouped_mm_moe(self.x, self.inputs.topk_experts, self.rw, self.w_gate_up,
                                self.w_down, self.shared, self.group)
        y.backward(self.inputs.d_output)
        i = self.inputs.w_routed_gate.shape[1]
        shared = tuple(s.grad for s in self.shared) if self.shared else (None, None, None)
        return y, (self.x.grad, self.rw.grad, self.w_gate_up.grad[:, :i],
                   self.w_gate_up.grad[:, i:], self.w_down.grad, *shared)


class MoKLayer:
    def __init__(self, inputs, group, config):
        import mok.functional as F

        self.F, self.inputs, self.config = F, inputs, config
        self.workspace = F.create_workspace(
            config, group, device=inputs.x.device, num_local_tokens=inputs.x.shape[0],
            hidden_size=inputs.x.shape[1], topk=inputs.topk_experts.shape[1])

    def schedule(self):
        return self.F.build_schedule(self.workspace, self.config, self.inputs.topk_experts,
                                     num_local_experts=self.inputs.num_local_experts)

    def forward(self):
        return self.F.forward(self.config, self.workspace, self.schedule(),
                              *self.inputs.layer_args)[0]

    def step(self):
        schedule = self.schedule()
        y, ctx = self.F.forward(self.config, self.workspace, schedule, *self.inputs.layer_args)
        grads = self.F.backward(self.config, self.workspace, schedule, ctx, self.inputs.d_output,
                                *self.inputs.layer_args)
        return y, grads


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _device_tensor(value: float) -> torch.Tensor:
    return torch.tensor([value], device="cuda" if torch.cuda.is_available() else "cpu")


def timed(fn, iters, warmup, group, calls=4, host_ahead=False):
    """Median ms per call of `fn` over `iters` samples of `calls` back-to-back calls (fixed
    counts on every rank), slowest rank. Back to back, as layers run in training and as the
    one-GPU benchmark times them: the host launches the next call while the GPU runs this one,
    so host time shows only where it exceeds GPU time. host_ahead (GPU only): the GPU sleeps
    before each sample until the host has queued all its calls, so the kernels alone are timed
    (benchmarks.layer.HOST_AHEAD_S)."""
    from benchmarks.layer import HOST_AHEAD_S, hold_device

    cuda = torch.cuda.is_available()
    if not cuda:
        calls = 1
    for _ in range(warmup):
        fn()
    _sync()
    if group is not None:
        dist.barrier(group)
    times = []
    for _ in range(iters):
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            if host_ahead:
                hold_device(HOST_AHEAD_S * calls)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / calls)
        else:
            start_s = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start_s) * 1e3)
    median = _device_tensor(statistics.median(times))
    if group is not None:
        dist.all_reduce(median, op=dist.ReduceOp.MAX, group=group)
    return float(median)


def max_error(y, grads, inputs, group):
    from mok.testing import GRAD_NAMES, error_report, moe_reference_grads

    y_ref, grads_ref = moe_reference_grads(inputs, group=group, compute_dtype=torch.float32)
    worst = error_report(y, y_ref, "y").max_rel
    for name, a, b in zip(GRAD_NAMES, grads, grads_ref, strict=True):
        if b is not None:
            worst = max(worst, error_report(a, b, name).max_rel)
    value = _device_tensor(worst)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return float(value)


def config_and_name(args) -> tuple:
    """(MoKConfig, suffix of mok's rows) of the command line's mok variant: mok_recompute
    (and compute_only_recompute) with --recompute-gate-up, _fp8 with --fp8, _gpull with
    --gluon-pull, _copy with --copy-rows, _bcopy with --copy-bwd-rows, +mbN with --minibatch
    N."""
    import mok.functional as F

    config = F.MoKConfig(fwd_num_comm_sms=args.comm_sms, bwd_num_comm_sms=args.comm_sms,
                         peer_timeout_s=args.peer_timeout,
                         recompute_gate_up=args.recompute_gate_up,
                         fwd_pull_in_gluon=args.gluon_pull, fwd_copy_rows=args.copy_rows,
                         bwd_copy_rows=args.copy_bwd_rows,
                         minibatch_size=args.minibatch or F.MoKConfig().minibatch_size,
                         precision="fp8" if args.fp8 else "bf16")
    name = (("_recompute" if args.recompute_gate_up else "") + ("_fp8" if args.fp8 else "")
            + ("_gpull" if args.gluon_pull else "") + ("_copy" if args.copy_rows else "")
            + ("_bcopy" if args.copy_bwd_rows else "")
            + (f"+mb{args.minibatch}" if args.minibatch else ""))
    return config, name


def _rank_main(rank, world_size, shape_names, iters, warmup, commit, variants,
               profile=False, host_ahead=False, check=True):
    """variants: [(MoKConfig, suffix of its rows)] of mok, timed in turn in the same run (they
    share recompute_gate_up, hence the compute-only time); the first one's config times
    compute_only."""
    import mok.functional as F
    from benchmarks.layer import BENCH_SHAPES
    from mok.testing import make_inputs, rank_device
    from mok.testing.distributed import RANKS_SHARE_GPU
    from mok.testing.tolerance import FP8_TOLERANCE, TOLERANCES

    group = dist.group.WORLD
    cuda = torch.cuda.is_available()
    device = rank_device(rank) if cuda else torch.device("cpu")
    shared_gpu = cuda and RANKS_SHARE_GPU
    config = variants[0][0]
    comm_sms = config.fwd_num_comm_sms
    # compute_only's rows (mok's: the variants' suffixes)
    fp8 = config.precision == "fp8"
    recompute = ("_recompute" if config.recompute_gate_up else "") + ("_fp8" if fp8 else "")
    rows = []
    gpu = torch.cuda.get_device_name(device) if cuda else "cpu (interpreter)"
    if shared_gpu:
        gpu += f" ({world_size} ranks sharing it)"
    date = datetime.datetime.now().isoformat(timespec="seconds")
    limit = TOLERANCES[torch.bfloat16].max_rel
    # FP8's own error against the exact reference (the NCCL baseline is checked at bf16's)
    limits = {"mok": FP8_TOLERANCE.max_rel if fp8 else limit, "nccl_grouped_mm": limit}

    def row(shape, impl, mode, ms, flops, compute_ms=None, gb_s=None, err=float("nan")):
        rows.append(dict(gpu=gpu, commit=commit, date=date, ep=world_size, shape=shape.name,
                         comm_sms=comm_sms, impl=impl, mode=mode, ms=round(ms, 4),
                         tflops=round(flops / ms / 1e9, 1) if flops else "",
                         vs_compute_only=round(ms / compute_ms, 3) if compute_ms else "",
                         gb_s=round(gb_s, 1) if gb_s else "",
                         peak_mem_gb=(round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
                                      if cuda else ""),
                         max_rel_err=f"{err:.2e}"))
        if rank == 0:
            print(f"  {impl:16s} {mode:17s} {ms:9.3f} ms  "
                  f"{rows[-1]['tflops']!s:>6} TFLOP/s  x{rows[-1]['vs_compute_only']!s:6} "
                  f"{rows[-1]['gb_s']!s:>6} GB/s  err {err:.2e}", flush=True)

    for name in shape_names:
        shape = ep_shape(BENCH_SHAPES[name], world_size)
        fwd_flops = shape.flops() / 3
        mode_flops = {"forward": fwd_flops, "forward+backward": 3 * fwd_flops}
        if rank == 0:
            print(f"== {shape.name} EP={world_size}: T={shape.num_tokens}/GPU, "
                  f"E={shape.num_experts}, H={shape.hidden_size}, I={shape.intermediate_size}, "
                  f"k={shape.topk}", flush=True)
        inputs = rank_inputs(shape, rank, world_size, device)
        # compute only: the same per-GPU work on one GPU, no group
        solo_tokens, solo_topk, num_local = compute_only_sizes(shape, world_size)
        solo = make_inputs(solo_tokens, shape.hidden_size, shape.intermediate_size, num_local,
                           solo_topk, shared_intermediate_size=shape.shared_intermediate_size,
                           device=device, seed=7 + rank)
        solo_layer = MoKLayer(solo, None, config)
        if cuda:  # else the peak of the shape before (or the inputs' setup) is reported
            torch.cuda.reset_peak_memory_stats(device)
        def time_modes(layer, ahead=False):
            """{mode: ms} of a layer's forward and forward+backward (ahead: the host ahead)."""
            return {mode: timed(fn, iters, 1 if ahead else warmup, group, host_ahead=ahead)
                    for mode, fn in (("forward", layer.forward), ("forward+backward", layer.step))}

        compute = time_modes(solo_layer)
        for mode, ms in compute.items():
            row(shape, f"compute_only{recompute}", mode, ms, mode_flops[mode])
        if host_ahead and cuda:
            compute_ahead = time_modes(solo_layer, ahead=True)
            for mode, ms in compute_ahead.items():
                row(shape, f"compute_only{recompute}@ahead", mode, ms, mode_flops[mode])
        del solo_layer, solo

        baselines = [] if shared_gpu else [("nccl_grouped_mm", None, "")]  # NCCL: a GPU each
        for impl_name, impl_config, mine in [("mok", *variant) for variant in variants] + \
                baselines:
            impl = (MoKLayer(inputs, group, impl_config) if impl_name == "mok"
                    else Baseline(inputs, group))
            try:
                y, grads = impl.step()
            except RuntimeError as exc:  # e.g. torch._grouped_mm's CPU limits
                if impl_name == "mok":
                    raise
                if rank == 0:
                    print(f"  {impl_name}: skipped: {str(exc).splitlines()[0]}")
                continue
            if impl_name == "mok":
                F.check_errors(impl.workspace)  # a peer timeout fails the run, loudly
            err = max_error(y, grads, inputs, group) if check else float("nan")
            if err > limits[impl_name]:
                if rank == 0:
                    print(f"  {impl_name}: max_rel_err {err:.2e} above {limits[impl_name]}: "
                          "not timed")
                continue
            del y, grads
            if cuda:
                gc.collect()  # what earlier variants left (their workspaces) goes first
                torch.cuda.reset_peak_memory_stats(device)
                if rank == 0:
                    held = torch.cuda.memory_allocated(device) / 2**30
                    buffer = (getattr(impl.workspace.exchange, "buffer", None)
                              if impl_name == "mok" else None)
                    symmetric = buffer.nbytes / 2**30 if buffer is not None else 0.0
                    print(f"  {impl_name + mine}: {held:.3f} GB held before timing, of which "
                          f"{symmetric:.3f} GB its symmetric buffer")
            for mode, ms in time_modes(impl).items():
                row(shape, impl_name + mine, mode, ms,
                    mode_flops[mode], compute[mode], err=err)
            if impl_name == "mok" and host_ahead and cuda:
                for mode, ms in time_modes(impl, ahead=True).items():
                    row(shape, f"mok{mine}@ahead", mode, ms, mode_flops[mode],
                        compute_ahead[mode], err=err)
            if impl_name == "mok":
                ms, nbytes = dispatch_only(impl, inputs, iters, warmup, group)
                row(shape, f"mok{mine}", "dispatch", ms, 0, gb_s=nbytes / ms / 1e6)
            ring = getattr(impl.workspace.exchange, "window", None) if impl_name == "mok" else None
            if impl_name == "mok" and not fp8 and ring is None:
                # the bf16 down GEMM's scatter (the ring delivers its rows apart)
                scatter_ms, local_ms, nbytes = down_scatter_and_local(impl, inputs, iters,
                                                                      warmup, group)
                row(shape, f"mok{mine}", "down_scatter", scatter_ms, 0,
                    gb_s=nbytes / scatter_ms / 1e6)
                row(shape, f"mok{mine}", "down_local", local_ms, 0)
            if impl_name == "mok" and profile and cuda:
                print_kernel_times(impl.step, group, quiet=rank != 0)
                print_timeline(impl.step, group, rank)
                print_host_times({"forward": impl.forward, "forward+backward": impl.step},
                                 group, quiet=rank != 0)
                print_host_profile(impl.forward, group, quiet=rank != 0)
            del impl
    return rows


def print_kernel_times(step, group, quiet=False):
    """GPU time per kernel of one mok forward+backward step (torch.profiler), largest first:
    where the time goes (waits show up as the wait/pull kernels and the GEMMs that spin)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    dist.barrier(group)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        # The profilers start at different times on each rank: line the ranks up inside it,
        # or the first wait on a peer counts the other rank's start-up.
        dist.barrier(group)
        torch.cuda.synchronize()
        step()
        torch.cuda.synchronize()
    dist.barrier(group)
    if quiet:
        return
    totals = {avg.key[:60]: (avg.self_device_time_total / 1e3, avg.count)
              for avg in prof.key_averages() if avg.self_device_time_total > 0}
    print("    kernel time of one forward+backward (rank 0):")
    for name, (ms, calls) in sorted(totals.items(), key=lambda item: -item[1][0])[:20]:
        print(f"      {ms:8.3f} ms  {calls:3d}x  {name}")


def print_timeline(step, group, rank, min_us=3.0, steps=2):
    """Every rank's kernels of a forward+backward on one time line (torch.profiler; the ranks
    share the host's clock), the host kept ahead (the GPU sleeps until the steps are queued), so
    the gaps are the kernels' own: who waits on whom, and for how long. `steps` run back to
    back and the last is shown: the first follows the GPU's sleep, whose idle spell the first
    step's exchanges may pay for. Kernels shorter than min_us are left out."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.layer import hold_device

    torch.cuda.synchronize()
    dist.barrier(group)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dist.barrier(group)
        torch.cuda.synchronize()
        hold_device()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    dist.barrier(group)
    mine = sorted((event.start_ns(), event.duration_ns(), event.name())
                  for event in prof.profiler.kineto_results.events()
                  if event.device_type() == torch.autograd.DeviceType.CUDA
                  and "sleep" not in event.name() and "nccl" not in event.name().lower())
    mine = mine[len(mine) - len(mine) // steps:]  # every step launches the same kernels
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if rank != 0:
        return
    events = sorted((start, duration, peer, name)
                    for peer, events in enumerate(everyone) for start, duration, name in events)
    t0 = events[0][0] if events else 0
    print(f"    time line of forward+backward {steps} of {steps} back to back, host ahead (us "
          "from the first kernel; rank, duration, kernel):")
    for start, duration, peer, name in events:
        if duration >= min_us * 1e3:
            print(f"      {(start - t0) / 1e3:9.1f}  r{peer} {duration / 1e3:8.1f}  {name[:60]}")


def print_host_times(fns, group, quiet=False, repeats=5):
    """Host (Python + launch) ms of each call, the device idle before it: a layer whose host
    time exceeds its GPU time leaves the GPU waiting between kernels."""
    lines = []
    for mode, fn in fns.items():
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            dist.barrier(group)
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        lines.append(f"      {statistics.median(times):8.3f} ms  host time of one {mode} call")
    torch.cuda.synchronize()
    dist.barrier(group)
    if not quiet:
        print("\n".join(lines), flush=True)


def print_host_profile(fn, group, quiet=False, top=14):
    """The Python functions with the most host time of their own in one call of `fn` (cProfile;
    the GPU kept behind so no launch waits on it), in ms: where a call's host time goes."""
    import cProfile
    import pstats

    from benchmarks.layer import hold_device

    torch.cuda.synchronize()
    dist.barrier(group)
    hold_device()
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    torch.cuda.synchronize()
    dist.barrier(group)
    if quiet:
        return
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, _, own s, total s, _)}
    print("    host time of one forward call by function (cProfile; own / with callees ms):")
    for (path, line, name), (_, calls, own, total, _) in sorted(
            stats.items(), key=lambda item: -item[1][2])[:top]:
        where = f"{Path(path).name}:{line}" if line else path
        print(f"      {own * 1e3:7.3f} {total * 1e3:7.3f} ms {calls:4d}x  {name} ({where})")


def dispatch_only(layer, inputs, iters, warmup, group):
    """Time the forward's publish + pull alone (fwd_copy_rows: publish + copies; FP8: x
    quantized, published and pulled as packed e4m3 rows); bytes that crossed NVLink into this
    rank."""
    from mok import ops
    from mok.exchange import Phase

    workspace, config = layer.workspace, layer.config
    ep = workspace.exchange
    schedule = layer.schedule()
    x = inputs.x
    weights = inputs.router_weights.contiguous()
    block_m = schedule.tiles.pick("gate_up", inputs.w_routed_gate.shape[1], x.shape[1]).block_m

    def run():
        peer = ep.peer_flags(workspace.error_flags)
        if config.precision == "fp8":  # publish x quantized, pull, acknowledge
            ep.forward_rows_fp8(schedule.exchange, x, None, weights, config=config)
            return
        if getattr(ep, "window", None) is not None:  # the ring: window by window, each acknowledged
            ep.forward_rows(schedule.exchange, x, weights, config=config, block_m=block_m)
            return
        if config.fwd_copy_rows:
            ep.forward_copy(peer, schedule.exchange, x, weights, block_m=block_m)
            ep.copies_joined()
        else:
            dst, _, pull = ep.forward_pull(
                peer, schedule.exchange, x, weights, minibatch=config.minibatch_size,
                num_programs=config.fwd_num_comm_sms)
            pull.run_apart(dst)
        ep.pulled(peer, Phase.FORWARD)

    ms = timed(run, iters, warmup, group)
    if config.fwd_copy_rows:  # every other rank's whole published x
        return ms, _min_row_bytes((ep.world_size - 1) * ep.num_tokens, x, group)
    nbytes = _pulled_bytes(schedule, ep, x, group)
    if config.precision == "fp8":  # packed e4m3 rows (mok.ops.unpack_rows)
        nbytes *= ops.packed_row_bytes(x.shape[1]) / (x.shape[1] * x.element_size())
    return ms, nbytes


def _pulled_bytes(schedule, ep, x, group) -> float:
    """Bytes of the tokens of other ranks with a route scheduled here, one row each (min over
    ranks): what the dispatch pulls over NVLink."""
    scheduled = (schedule.exchange.group_routing.route_row >= 0).view(-1, ep.topk).any(dim=1)
    rank_of = torch.arange(scheduled.shape[0], device=scheduled.device) // ep.num_tokens
    return _min_row_bytes((scheduled & (rank_of != ep.rank)).sum(), x, group)


def _remote_bytes(schedule, ep, x, group) -> float:
    """Bytes of the rows of this rank's schedule whose tokens live on other ranks (min over
    ranks): what the down GEMM writes into their combine buffers."""
    routes = schedule.exchange.group_routing.row_route
    return _min_row_bytes(((routes >= 0) & (routes // ep.routes_per_rank != ep.rank)).sum(), x,
                          group)


def _min_row_bytes(rows, x, group) -> float:
    """`rows` rows of x's width and dtype in bytes, the smallest over the group's ranks."""
    value = _device_tensor(float(rows) * x.shape[1] * x.element_size())
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return float(value)


def down_scatter_and_local(layer, inputs, iters, warmup, group):
    """(ms of the down GEMM writing into the tokens' ranks' combine buffers, ms of the same GEMM
    writing locally, remote bytes written)."""
    from mok import ops

    workspace = layer.workspace
    config = dataclasses.replace(layer.config, recompute_gate_up=True)  # a context with h
    ep = workspace.exchange
    schedule = layer.schedule()
    _, context = layer.F.forward(config, workspace, schedule, *inputs.layer_args)
    w_down = inputs.w_routed_down
    tiles = schedule.tiles.pick("down", w_down.shape[1], w_down.shape[2])
    scatter = ep.scatter_rows(schedule.exchange, inputs.x.dtype)

    def remote():
        ops.down_proj(context.h, w_down, schedule.routing, tiles, context.weights_group,
                      scatter=scatter)

    def local():
        ops.down_proj(context.h, w_down, schedule.routing, tiles, context.weights_group)

    scatter_ms = timed(remote, iters, warmup, group)
    local_ms = timed(local, iters, warmup, group)
    return scatter_ms, local_ms, _remote_bytes(schedule, ep, inputs.x, group)


CHART_MODES = ("forward", "forward+backward")


def newest_rows(csv_path: Path) -> list[dict]:
    """The last GPU row of each (ep, shape, impl, mode) of CHART_MODES in csv_path (see
    benchmarks.newest_gpu_rows), without the host-ahead rows (IMPL@ahead, kernels alone)."""
    from benchmarks import newest_gpu_rows

    return [row for row in newest_gpu_rows(csv_path, lambda row: (row["ep"], row["shape"]),
                                           CHART_MODES, other_modes=False)
            if "@" not in row["impl"]]


def draw_chart(path: Path, rows: list[dict]) -> None:
    """Milliseconds per (shape, EP size) and implementation, one panel per mode, as a PNG; mok's
    bars say their ratio to the compute-only time."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    groups = list(dict.fromkeys((str(row["ep"]), row["shape"]) for row in rows))
    impls = list(dict.fromkeys(row["impl"] for row in rows))
    cells = {(str(row["ep"]), row["shape"], row["impl"], row["mode"]): row for row in rows}
    width = 0.8 / len(impls)
    figure = Figure(figsize=(max(6.0, 2.2 * len(groups) + 2.0, 0.45 * len(impls) * len(groups)),
                             0.6 + 3.0 * len(CHART_MODES)), dpi=110)
    FigureCanvasAgg(figure)
    for panel, mode in enumerate(CHART_MODES):
        axes = figure.add_subplot(len(CHART_MODES), 1, panel + 1)
        for index, impl in enumerate(impls):
            xs = [g + (index - (len(impls) - 1) / 2) * width for g in range(len(groups))]
            found = [cells.get((ep, shape, impl, mode)) for ep, shape in groups]
            values = [float(row["ms"]) if row else 0.0 for row in found]
            labels = [(f"{float(row['ms']):.3g}" + (f" x{float(row['vs_compute_only']):.2f}"
                                                    if row["vs_compute_only"] else ""))
                      if row else "" for row in found]
            bars = axes.bar(xs, values, width, label=impl)
            axes.bar_label(bars, labels=labels, fontsize=6, rotation=90, padding=2)
        axes.set_xticks(range(len(groups)), [f"{shape}\nEP={ep}" for ep, shape in groups],
                        fontsize=8)
        axes.set_ylabel("ms (lower is better)")
        axes.set_title(mode, fontsize=10)
        axes.margins(y=0.3)
        axes.grid(axis="y", alpha=0.3)
    from benchmarks import finish_chart

    finish_chart(figure, rows, len(impls), "MoE layer, expert parallelism, {gpu}, commit "
                 "{commits}: ms, xN = time / compute-only time", path, max_cols=4)


def main(argv=None) -> None:
    import mok.functional as F
    from mok.app.train import int_at_least, positive_float

    parser = argparse.ArgumentParser(prog="python -m mok bench --ep N", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    parser.add_argument("--ep", type=int_at_least(2), required=True,
                        help="processes, one GPU each (at least 2)")
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES) if cuda else "tiny",
                        help="comma-separated shape names, or 'all'")
    parser.add_argument("--iters", type=int_at_least(1), default=10 if cuda else 2)
    parser.add_argument("--warmup", type=int_at_least(0), default=3 if cuda else 1)
    parser.add_argument("--csv", type=Path,
                        default=(RESULTS if cuda else CPU_RUNS) / "ep.csv")
    parser.add_argument("--comm-sms", type=int_at_least(1),
                        default=F.MoKConfig().fwd_num_comm_sms,
                        help="programs that pull rows in each GEMM launch (MoKConfig)")
    parser.add_argument("--peer-timeout", type=positive_float, default=20.0,
                        help="MoKConfig.peer_timeout_s")
    parser.add_argument("--profile", action="store_true",
                        help="print mok's GPU time per kernel of one step, every rank's kernels "
                             "on one time line, and the host's time (torch.profiler, cProfile)")
    parser.add_argument("--recompute-gate-up", action="store_true",
                        help="mok and its compute-only time with MoKConfig(recompute_gate_up="
                             "True); rows named mok_recompute, compute_only_recompute")
    parser.add_argument("--host-ahead", action="store_true",
                        help="also time mok and compute_only with the host ahead of the GPU "
                             "(the GPU sleeps until a sample's calls are queued): the kernels "
                             "alone; rows IMPL@ahead")
    parser.add_argument("--fp8", action="store_true",
                        help="MoKConfig(precision='fp8') for mok and its compute-only time; "
                             "rows named mok_fp8, compute_only_fp8")
    parser.add_argument("--gluon-pull", action="store_true",
                        help="MoKConfig(fwd_pull_in_gluon=True): the Gluon gate/up pulls its "
                             "rows itself; rows named mok_gpull")
    parser.add_argument("--copy-rows", action="store_true",
                        help="MoKConfig(fwd_copy_rows=True): the forward's rows move by copies "
                             "beside the gate/up GEMM; rows named mok_copy")
    parser.add_argument("--copy-bwd-rows", action="store_true",
                        help="MoKConfig(bwd_copy_rows=True): the backward's rows move by copies "
                             "beside the dSwiGLU (the Gluon kernel); rows named mok_bcopy")
    parser.add_argument("--also-copies", action="store_true",
                        help="in the same run, also time mok with --copy-rows and "
                             "--copy-bwd-rows (rows named mok..._copy_bcopy), against the same "
                             "compute-only and NCCL times")
    parser.add_argument("--macrobatch", type=int_at_least(1), default=None,
                        help="in the same run, also time mok with MoKConfig(macrobatch_size=N): "
                             "the symmetric buffer a ring of two windows of N tokens a rank; "
                             "rows named mok...+ringN")
    parser.add_argument("--minibatch", type=int_at_least(1), default=None,
                        help="MoKConfig.minibatch_size; mok's rows get +mbN")
    parser.add_argument("--no-check", action="store_true",
                        help="time without checking against the reference (for runs whose "
                             "ranks' fp32 references do not fit on the GPU)")
    parser.add_argument("--timeout", type=positive_float, default=900.0)
    parser.add_argument("--redraw", action="store_true",
                        help="measure nothing: chart the newest GPU rows already in the CSV")
    args = parser.parse_args(argv)
    from benchmarks import append_rows, commit_id
    from mok.testing import SHAPES, run_distributed

    chart = args.csv.with_suffix(".png")
    if args.redraw:
        rows = newest_rows(args.csv)
        if not rows:
            raise SystemExit(f"{args.csv} has no GPU rows to draw")
        draw_chart(chart, rows)
        print(f"chart {chart} from {len(rows)} rows of {args.csv}")
        return

    names = [s.name for s in SHAPES] if args.shapes == "all" else args.shapes.split(",")
    from benchmarks.layer import BENCH_SHAPES

    unknown = [name for name in names if name not in BENCH_SHAPES]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; known: {', '.join(BENCH_SHAPES)}")
    for name in names:  # experts that do not split over the ranks: said here, not in a rank
        ep_shape(BENCH_SHAPES[name], args.ep)
    from mok.testing.distributed import RANKS_SHARE_GPU

    if cuda and RANKS_SHARE_GPU:
        print(f"MOK_RANKS_SHARE_GPU: {args.ep} ranks share GPU 0 (gloo between them, no NCCL "
              "baseline): the ranks' kernels take turns on one GPU, times compare mok's "
              "variants only")
    elif cuda and torch.cuda.device_count() < args.ep:
        raise SystemExit(f"--ep {args.ep} needs at least {args.ep} CUDA GPUs (one a rank), "
                         f"found {torch.cuda.device_count()}")
    if not cuda:
        print(f"no GPU: {args.ep} CPU processes, {', '.join(names)} under Triton's "
              "interpreter (a check of the pipeline, not a measurement; shapes other than tiny "
              "take hours there)")
    for key, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(key, value)  # never NVLink multicast
    variants = [config_and_name(args)]
    if args.also_copies and not (args.copy_rows and args.copy_bwd_rows):
        args.copy_rows = args.copy_bwd_rows = True
        variants.append(config_and_name(args))
    if args.macrobatch:
        config, name = variants[0]
        try:
            ring = dataclasses.replace(config, macrobatch_size=args.macrobatch)
        except ValueError as error:  # not a multiple of the minibatch
            raise SystemExit(f"--macrobatch {args.macrobatch}: {error}") from None
        variants.append((ring, f"{name}+ring{args.macrobatch}"))
    results = run_distributed(_rank_main, args.ep, names, args.iters, args.warmup, commit_id(),
                              variants, args.profile, args.host_ahead, not args.no_check,
                              backend="nccl" if cuda and not RANKS_SHARE_GPU else "gloo",
                              timeout_s=args.timeout)
    rows = results[0]
    append_rows(args.csv, CSV_FIELDS, rows)
    print(f"{len(rows)} rows appended to {args.csv}")
    try:
        draw_chart(chart, [row for row in rows
                           if row["mode"] in CHART_MODES and "@" not in row["impl"]])
        print(f"chart {chart}")
    except Exception as exc:  # the rows are in the CSV already
        print(f"chart not drawn: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
