"""Where a training step of the main job's model goes, per backend and way of running it.

    python -m benchmarks.step [--size small] [--backends mok hf_grouped_mm] [--modes eager graph]

One process builds the `mok.app.train` model at --size once per backend (the same initial weights
and batches) and, per mode, times --steps training steps after --warmup:

  eager   `mok.app.train.train_step` as `python -m mok train` runs it.
  graph   the same step captured once in a CUDA graph and replayed (`mok.app.train.GraphedStep`).
  compile the model under torch.compile (default mode), its step captured as in graph.
The optimizer is the capturable fused AdamW in every mode, so graph and eager losses compare
bitwise where the backend is deterministic.

A mode that cannot be set up runs eagerly (with a message), and its row says eager.
Per (backend, mode): ms a step (wall clock between synchronizations, steps queued back to back),
the host's ms to issue one step that starts on an idle GPU (about the step's time where the host
is the bottleneck), the peak memory (model and optimizer included), and the GPU time of one
step by kind of kernel (torch.profiler): mok's kernels, GEMMs, attention, the optimizer, the rest
(elementwise, reductions, copies), with the largest kernels of the rest named. Rows go to
--csv (benchmarks/results/step.csv).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import pkgutil
import re
import statistics
import time
import traceback
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks import append_rows, commit_id
from mok.app import train as mok_train

RESULTS = Path(__file__).resolve().parent / "results"
BACKENDS = {"mok": ("mok", "grouped_mm"), "hf_grouped_mm": ("hf", "grouped_mm")}
MODES = ("eager", "graph", "compile")
CSV_FIELDS = ("gpu", "commit", "date", "size", "backend", "mode", "ms_per_step", "tokens_per_s",
              "host_ms_per_step", "peak_mem_gb", "gpu_ms_mok", "gpu_ms_gemm",
              "gpu_ms_attention", "gpu_ms_optimizer", "gpu_ms_other")
_GEMM = re.compile(r"gemm|nvjet|xmma|cutlass|sm90_|cublas|_mm_", re.I)
_ATTENTION = re.compile(r"flash|fmha|attention|sdpa", re.I)
_OPTIMIZER = re.compile(r"adam|multi_tensor|foreach", re.I)


def mok_kernel_names() -> set[str]:
    """Names of the Triton and Gluon kernels in mok.kernels."""
    import mok.kernels

    names = set()
    for info in pkgutil.iter_modules(mok.kernels.__path__):
        module = importlib.import_module(f"mok.kernels.{info.name}")
        for name, obj in vars(module).items():
            if "JITFunction" in type(obj).__name__ or hasattr(obj, "fn") and hasattr(obj, "run"):
                names.add(name)
    return names


def kind_of(kernel: str, mok_names: set[str]) -> str:
    if kernel.split("(")[0].strip() in mok_names:
        return "mok"
    if _ATTENTION.search(kernel):
        return "attention"
    if _OPTIMIZER.search(kernel):
        return "optimizer"
    if _GEMM.search(kernel):
        return "gemm"
    return "other"


class Runner:
    """One backend's model, optimizer and batches; runs its steps through `mok.app.train.Stepper`
    in one mode (`mode`: the one that runs, eager where the asked one could not be set up)."""

    def __init__(self, backend: str, size: str, device: torch.device, data: torch.Tensor,
                 mode: str) -> None:
        preset = mok_train.SIZES[size]
        model_backend, hf_experts = BACKENDS[backend]
        self.device = device
        self.config = mok_train.TrainConfig(
            steps=1000, schedule_steps=1000, warmup_steps=10, batch_size=preset.batch_size,
            seq_len=preset.seq_len, lr=preset.lr)
        model = mok_train.build_model(preset.model, model_backend, 0, device, hf_experts)
        # The capturable AdamW in every mode, so that graph and eager run the same kernels.
        optimizer = mok_train.build_optimizer(model, self.config, device, capturable=True)
        self.stepper = mok_train.Stepper(model, optimizer, self.config, device, mode)
        self.mode = self.stepper.mode
        self.sampler = mok_train.BatchSampler(data, preset.batch_size, preset.seq_len, seed=0,
                                              stream=0, device=device)
        self.step_index = 0

    def step(self) -> torch.Tensor:
        inputs, targets = self.sampler.batch(self.step_index)
        lr = self.config.lr * mok_train.lr_multiplier(self.step_index, self.config)
        self.step_index += 1
        return self.stepper(inputs, targets, lr=lr)[0]


def measure(runner: Runner, *, warmup: int, steps: int, mok_names: set[str]) -> dict:
    device = runner.device
    losses = torch.zeros(warmup + steps, device=device)
    for index in range(warmup):
        losses[index] = runner.step()
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for index in range(warmup, warmup + steps):
        losses[index] = runner.step()
    torch.cuda.synchronize(device)
    ms = (time.perf_counter() - started) * 1e3 / steps
    torch.cuda.set_sync_debug_mode("error")  # the first host sync in a step, if any, raises
    try:
        runner.step()
        sync = None
    except RuntimeError as error:
        frames = traceback.extract_tb(error.__traceback__)[-4:]
        sync = f"{error}".splitlines()[0] + " at " + " <- ".join(
            f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))
        print(f"    host sync: {sync}")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize(device)
    host = []
    for _ in range(3):  # the host's time to issue a step that starts on an idle GPU
        torch.cuda.synchronize(device)
        issued = time.perf_counter()
        runner.step()
        host.append((time.perf_counter() - issued) * 1e3)
    torch.cuda.synchronize(device)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.step()
        torch.cuda.synchronize(device)
    by_kind: dict[str, float] = defaultdict(float)
    other: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for event in prof.key_averages():
        us = event.device_time_total if hasattr(event, "device_time_total") else \
            event.cuda_time_total
        if not us or event.key.startswith(("ProfilerStep", "cudaGraph")):
            continue
        kind = kind_of(event.key, mok_names)
        by_kind[kind] += us / 1e3
        if kind in ("other", "mok", "gemm"):
            other[f"{kind}: {event.key[:90]}"] = [event.count, us / 1e3]
    return dict(ms=ms, host_ms=statistics.median(host), losses=losses.tolist(), sync=sync,
                peak_gb=torch.cuda.max_memory_allocated(device) / 2**30, by_kind=dict(by_kind),
                top=sorted(other.items(), key=lambda item: -item[1][1])[:25])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=tuple(mok_train.SIZES), default="small")
    parser.add_argument("--backends", nargs="+", choices=tuple(BACKENDS), default=list(BACKENDS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--csv", default=str(RESULTS / "step.csv"))
    parser.add_argument("--no-csv", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.step times CUDA steps; no GPU here")
    device = torch.device("cuda")
    train_data, _ = mok_train.split_corpus(mok_train.load_corpus())
    mok_names = mok_kernel_names()
    preset = mok_train.SIZES[args.size]
    tokens = preset.batch_size * preset.seq_len
    stamp = dict(gpu=torch.cuda.get_device_name(device), commit=commit_id(),
                 date=datetime.date.today().isoformat(), size=args.size)
    rows, losses = [], {}
    for backend in args.backends:
        for mode in args.modes:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            try:
                runner = Runner(backend, args.size, device, train_data, mode)
                ran = runner.mode  # the mode that ran names the row
                result = measure(runner, warmup=args.warmup, steps=args.steps,
                                 mok_names=mok_names)
            except Exception as error:  # noqa: BLE001 - one failed variant, the others go on
                print(f"{backend} {mode}: failed: {type(error).__name__}: {error}")
                continue
            finally:
                runner = None
            kinds = result["by_kind"]
            losses[backend, ran] = result["losses"]
            print(f"\n{backend} {ran}: {result['ms']:.2f} ms/step, "
                  f"{tokens / result['ms'] * 1e3:,.0f} tokens/s, host {result['host_ms']:.2f} "
                  f"ms/step, peak {result['peak_gb']:.1f} GiB; GPU busy "
                  f"{sum(kinds.values()):.2f} ms: " +
                  ", ".join(f"{k} {v:.2f}" for k, v in sorted(kinds.items())))
            for name, (count, ms) in result["top"]:
                print(f"    {ms:8.3f} ms {count:5d}x  {name}")
            rows.append(dict(stamp, backend=backend, mode=ran, ms_per_step=round(result["ms"], 3),
                             tokens_per_s=round(tokens / result["ms"] * 1e3),
                             host_ms_per_step=round(result["host_ms"], 3),
                             peak_mem_gb=round(result["peak_gb"], 2),
                             **{f"gpu_ms_{k}": round(kinds.get(k, 0.0), 3)
                                for k in ("mok", "gemm", "attention", "optimizer", "other")}))
    for (backend, mode), graph in losses.items():
        if mode != "eager" and (backend, "eager") in losses:
            eager = losses[backend, "eager"]
            differ = [i for i, (a, b) in enumerate(zip(eager, graph, strict=True)) if a != b]
            print(f"{backend}: {mode} against eager, {len(eager)} steps' losses: " +
                  ("bitwise equal" if not differ else
                   f"{len(differ)} differ, first at step {differ[0]}, largest by "
                   f"{max(abs(eager[i] - graph[i]) for i in differ):.3g}"))
    if rows and not args.no_csv:
        append_rows(Path(args.csv), CSV_FIELDS, rows)


if __name__ == "__main__":
    main()
