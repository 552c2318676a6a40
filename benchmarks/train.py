"""Training benchmark: the same MoE language model trained with mok and with Hugging Face's block.

    python -m benchmarks.train                      # on a GPU: the 1b model, about 2-3 minutes

One process trains the byte-level language model of `mok.app.train` (`--size 1b` on a GPU:
Qwen3-MoE's expert layout, hidden 1024, 5 layers, 128 experts, top-8, expert intermediate 512; 1.02B
parameters, 77M active; 16 x 1024 = 16,384 tokens a step) once per backend of its feed-forward,
each from the same initial weights (the seed's, copied into Hugging Face's layout for the hf
backends) on the same batches (a function of seed and step) with the same learning-rate schedule:

  mok            mok.nn.MoE: the fused Triton kernels (on CPU, mok's PyTorch reference stands in,
                 as the interpreted kernels take seconds a step: the row says `reference`).
  hf_grouped_mm  transformers' Qwen3MoeSparseMoeBlock with experts_implementation="grouped_mm",
                 what transformers 5 selects by default for a model built with from_config or
                 from_pretrained (torch's grouped GEMM over experts sorted by route).
  hf_eager       the same block with experts_implementation="eager": Qwen3MoeExperts' own
                 forward, a Python loop over the experts the batch routes to (the block as
                 written in modeling_qwen3_moe, and transformers 4's only implementation): the
                 "Hugging Face default MoE block" of the target. It is several times slower, so it
                 runs fewer steps (--eager-steps) on the same schedule.

Every backend's step runs in the same --step-mode (`mok.app.train.Stepper`; on a GPU by default
`compile`: the model under torch.compile, the whole step captured in one CUDA graph), except
hf_eager, whose loop over the experts the batch routes to reads the routes on the host and so
always runs eagerly; a mode that cannot be set up falls back to eager, and the row's step_mode
says what ran.

Precision as in `mok.app.train`: fp32 master weights, bf16 autocast on CUDA (every backend's experts
compute in bf16), fp32 on CPU. The auxiliary load-balancing loss is off (--aux-loss-coef 0)
because the hf blocks add none (transformers computes it at the model level): all backends then
minimize the same loss, and mok does no extra work.

Measured: tokens/s after --warmup steps (Triton compilation, allocator warm-up), from the wall
clock between CUDA synchronizations at the edges of --window-step windows (the steps inside a
window are queued without waiting); the training loss of every step; the peak memory allocated
during the run above what was allocated before the model was built.

Targets (docs/design.md section 5, end to end): mok >= 1.4x hf_eager and >= 1.0x hf_grouped_mm in
tokens/s; loss curves that agree within noise. Loss criterion: over the steps both runs have, the
means of each --loss-window consecutive steps' losses differ by at most
loss_atol + loss_rtol * (their mean) (defaults 0.02 nats + 2%), for mok against every other
backend; the runs start from the same weights and batches, so the curves differ only by rounding
(bf16 routes that flip between near-equal experts, and its consequences).

Outputs: a row per backend appended to --csv (benchmarks/results/train.csv), and in --out a JSON
summary (summary.json: configs, versions, per-backend losses and rates, comparisons, verdict) and
the loss curves (loss.png). Rows, summary and chart title name the GPU, commit and date taken once
at the start (the commit of the mok package that ran: mok.provenance); a chart committed beside
the CSV must be the loss.png of the run whose rows it shows, not redrawn or its rows re-stamped.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import platform
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks import append_rows, commit_id
from mok.app import train as mok_train

RESULTS = Path(__file__).resolve().parent / "results"
BACKENDS = ("mok", "hf_grouped_mm", "hf_eager")
HF_EXPERTS = {"hf_grouped_mm": "grouped_mm", "hf_eager": "eager"}
TARGET_VS_EAGER = 1.4
TARGET_VS_GROUPED_MM = 1.0
INITIAL_LOSS_TOL = 0.02  # same weights, same batch: the first losses differ by rounding only
CSV_FIELDS = ("gpu", "commit", "date", "config", "params_total", "params_active", "backend",
              "steps", "timed_steps", "tokens_per_step", "tokens_per_s", "final_loss",
              "peak_mem_gb", "speedup_vs_eager", "speedup_vs_grouped_mm", "step_mode")


@dataclass(frozen=True)
class LossCriterion:
    """Two loss curves agree when, over their common steps, every window of `window` steps has
    |mean_a - mean_b| <= atol + rtol * (mean_a + mean_b) / 2 (a partial last window included)."""

    window: int = 10
    atol: float = 0.02
    rtol: float = 0.02

    def describe(self) -> str:
        return (f"over the common steps, the {self.window}-step window means differ by at most "
                f"{self.atol} + {self.rtol} x their mean (nats per byte)")


@dataclass
class BackendRun:
    """What training one backend measured. tokens_per_s is None when no step was timed;
    error holds the exception's text when the run failed (then nothing else is meaningful)."""

    name: str             # the row's backend: mok, reference (mok's stand-in on CPU), hf_...
    slot: str             # which of BACKENDS it fills
    steps: int
    timed_steps: int
    tokens_per_s: float | None
    window_tokens_per_s: list[float]
    losses: list[float]
    peak_mem_gb: float | None
    setup_seconds: float
    train_seconds: float
    error: str | None = None
    step_mode: str = "eager"  # the mode that ran (mok.app.train.Stepper)

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None


@dataclass(frozen=True)
class RunStamp:
    """What a run is named by: its device, the commit of the mok that ran and its start time.
    Taken once per run; its CSV rows, summary and chart title all show this one value."""

    gpu: str
    commit: str
    date: str

    @classmethod
    def take(cls, device: torch.device) -> RunStamp:
        return cls(gpu=device_name(device), commit=commit_id(),
                   date=datetime.datetime.now().isoformat(timespec="seconds"))


# -- environment -----------------------------------------------------------------------------

def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def hf_experts_available(implementation: str) -> bool:
    """Whether the installed transformers has this experts implementation ("eager" always)."""
    if implementation == "eager":
        return True
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    return implementation in ALL_EXPERTS_FUNCTIONS


def transformers_default_experts() -> str | None:
    """The experts implementation transformers picks for a Qwen3-MoE model when none is asked
    for (built tiny, on the CPU); None when it cannot be told."""
    try:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(vocab_size=16, hidden_size=8, intermediate_size=8,
                                moe_intermediate_size=4, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                                num_experts=2, num_experts_per_tok=1)
        with torch.random.fork_rng(devices=[]):
            model = Qwen3MoeForCausalLM(config)
        return model.config._experts_implementation or "eager"
    except Exception:  # a transformers without these classes or attributes
        return None


def versions() -> dict[str, str | None]:
    import triton

    try:
        import transformers
        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    return {"torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers_version,
            "cuda": torch.version.cuda if torch.cuda.is_available() else None}


def parameter_counts(config: mok_train.ModelConfig) -> tuple[int, int]:
    """(total, active per token) of mok.train's model, counted on the meta device (no memory,
    no initialization)."""
    with torch.device("meta"):
        return mok_train.MoELanguageModel(config).parameter_counts()


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# -- one backend -----------------------------------------------------------------------------

def train_backend(slot: str, model_config: mok_train.ModelConfig,
                  train_config: mok_train.TrainConfig, device: torch.device,
                  train_data: torch.Tensor, *, mok_backend: str, warmup: int, window: int,
                  progress: bool, step_mode: str = "eager") -> BackendRun:
    """Train the model with one backend for train_config.steps steps; time it and keep every
    step's loss (on the device until a window ends, then read once)."""
    if slot == "mok":
        name, model_backend, hf_experts = mok_backend, mok_backend, "grouped_mm"
    else:
        name, model_backend, hf_experts = slot, "hf", HF_EXPERTS[slot]
    steps, tokens = train_config.steps, train_config.tokens_per_step
    release_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base_memory = torch.cuda.memory_allocated(device)
    started = time.perf_counter()
    model = mok_train.build_model(model_config, model_backend, train_config.seed, device,
                                  hf_experts)
    optimizer = mok_train.build_optimizer(model, train_config, device,
                                          capturable=step_mode != "eager")
    stepper = mok_train.Stepper(model, optimizer, train_config, device, step_mode)
    sampler = mok_train.BatchSampler(train_data, train_config.batch_size, train_config.seq_len,
                                     seed=train_config.seed, stream=0, device=device)
    step_losses = torch.zeros(steps, device=device)
    mok_train.synchronize(device)
    setup_seconds = time.perf_counter() - started
    marks: list[tuple[int, float]] = []  # (steps done, time) at synchronized window edges
    bar = tqdm(range(steps), desc=f"{name:>13}", unit="step", disable=not progress,
               dynamic_ncols=True)
    model.train()
    train_started = time.perf_counter()
    for step in bar:
        if step >= warmup and (step - warmup) % window == 0:
            mok_train.synchronize(device)
            marks.append((step, time.perf_counter()))
            if len(marks) > 1:
                (s0, t0), (s1, t1) = marks[-2:]
                bar.set_postfix(loss=f"{step_losses[step - 1].item():.3f}",
                                tokens_per_s=f"{tokens * (s1 - s0) / (t1 - t0):,.0f}")
        inputs, targets = sampler.batch(step)
        lr = train_config.lr * mok_train.lr_multiplier(step, train_config)
        lm_loss, _ = stepper(inputs, targets, lr=lr)
        step_losses[step] = lm_loss
    mok_train.synchronize(device)
    end = time.perf_counter()
    if marks:
        marks.append((steps, end))
    bar.close()
    window_rates = [tokens * (s1 - s0) / (t1 - t0)
                    for (s0, t0), (s1, t1) in zip(marks, marks[1:], strict=False) if s1 > s0]
    timed_steps = marks[-1][0] - marks[0][0] if marks else 0
    tokens_per_s = (tokens * timed_steps / (marks[-1][1] - marks[0][1])
                    if timed_steps > 0 else None)
    peak = None
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(device) - base_memory) / 2**30
    losses = step_losses.tolist()
    del model, optimizer, sampler, step_losses
    release_memory(device)
    return BackendRun(name=name, slot=slot, steps=steps, timed_steps=timed_steps,
                      tokens_per_s=tokens_per_s, window_tokens_per_s=window_rates, losses=losses,
                      peak_mem_gb=peak, setup_seconds=setup_seconds,
                      train_seconds=end - train_started, step_mode=stepper.mode)


def failed_run(slot: str, name: str, steps: int, error: BaseException) -> BackendRun:
    return BackendRun(name=name, slot=slot, steps=steps, timed_steps=0, tokens_per_s=None,
                      window_tokens_per_s=[], losses=[], peak_mem_gb=None, setup_seconds=0.0,
                      train_seconds=0.0, error=f"{type(error).__name__}: {error}")


# -- comparisons -----------------------------------------------------------------------------

def window_means(losses: list[float], window: int) -> list[float]:
    """Means of consecutive windows of `window` losses (the last one may be shorter)."""
    return [sum(losses[i:i + window]) / len(losses[i:i + window])
            for i in range(0, len(losses), window)]


def compare_losses(losses: list[float], other: list[float],
                   criterion: LossCriterion) -> dict:
    """How far two loss curves are apart over their common steps, against the criterion."""
    common = min(len(losses), len(other))
    if common == 0:
        return {"common_steps": 0, "agree": None}
    means = window_means(losses[:common], criterion.window)
    other_means = window_means(other[:common], criterion.window)
    differences = [abs(a - b) for a, b in zip(means, other_means, strict=True)]
    tolerances = [criterion.atol + criterion.rtol * (a + b) / 2
                  for a, b in zip(means, other_means, strict=True)]
    worst = max(range(len(differences)), key=lambda i: differences[i] / tolerances[i])
    return {
        "common_steps": common,
        "windows": len(differences),
        "max_window_diff": max(differences),
        "worst_window": worst,  # the window closest to (or furthest past) its tolerance
        "worst_window_diff": differences[worst],
        "worst_window_tolerance": tolerances[worst],
        "window_diffs": differences,
        "max_step_diff": max(abs(a - b) for a, b in zip(losses[:common], other[:common],
                                                         strict=True)),
        "initial_loss_diff": abs(losses[0] - other[0]),
        "agree": all(d <= t for d, t in zip(differences, tolerances, strict=True)),
    }


def speedup(run: BackendRun, baseline: BackendRun | None) -> float | None:
    if baseline is None or not run.tokens_per_s or not baseline.tokens_per_s:
        return None
    return run.tokens_per_s / baseline.tokens_per_s


def build_verdict(runs: dict[str, BackendRun], comparisons: dict[str, dict],
                  criterion: LossCriterion, measures_mok: bool) -> dict:
    """The targets, each met (True), missed (False) or not measured (None)."""
    mok_run = runs.get("mok")
    vs_eager = speedup(mok_run, runs.get("hf_eager")) if mok_run else None
    vs_grouped = speedup(mok_run, runs.get("hf_grouped_mm")) if mok_run else None
    agreements = [c["agree"] for c in comparisons.values()]
    initial = [c["initial_loss_diff"] <= INITIAL_LOSS_TOL for c in comparisons.values()
               if c["common_steps"]]
    checks = {
        "vs_eager": None if vs_eager is None else vs_eager >= TARGET_VS_EAGER,
        "vs_grouped_mm": None if vs_grouped is None else vs_grouped >= TARGET_VS_GROUPED_MM,
        "loss_curves_agree": (None if not agreements or None in agreements
                              else all(agreements)),
        "initial_losses_agree": None if not initial else all(initial),
    }
    return {
        "speedup_vs_eager": vs_eager,
        "target_vs_eager": TARGET_VS_EAGER,
        "speedup_vs_grouped_mm": vs_grouped,
        "target_vs_grouped_mm": TARGET_VS_GROUPED_MM,
        "loss_criterion": criterion.describe(),
        "initial_loss_tolerance": INITIAL_LOSS_TOL,
        "checks": checks,
        # On CPU mok's reference stands in for its kernels: a run of the pipeline, not of mok.
        "measures_mok_kernels": measures_mok,
        "all_met": measures_mok and all(v is True for v in checks.values()),
    }


# -- outputs ---------------------------------------------------------------------------------

def csv_rows(runs: dict[str, BackendRun], stamp: RunStamp, *, config: str,
             params: tuple[int, int], tokens_per_step: int) -> list[dict]:
    def rounded(value: float | None, digits: int) -> float | str:
        return "" if value is None else round(value, digits)

    rows = []
    for run in runs.values():
        if run.error is not None:
            continue
        rows.append(dict(
            gpu=stamp.gpu, commit=stamp.commit, date=stamp.date, config=config,
            params_total=params[0], params_active=params[1], backend=run.name, steps=run.steps,
            timed_steps=run.timed_steps, tokens_per_step=tokens_per_step,
            tokens_per_s=rounded(run.tokens_per_s, 1), final_loss=rounded(run.final_loss, 5),
            peak_mem_gb=rounded(run.peak_mem_gb, 3),
            speedup_vs_eager=rounded(speedup(run, runs.get("hf_eager")), 3),
            speedup_vs_grouped_mm=rounded(speedup(run, runs.get("hf_grouped_mm")), 3),
            step_mode=run.step_mode))
    return rows


def plot(path: Path, runs: dict[str, BackendRun], comparisons: dict[str, dict],
         criterion: LossCriterion, title: str) -> None:
    """Left: every backend's loss per step. Right: |window-mean difference| to mok per window,
    with the criterion's tolerance."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.8), dpi=120)
    FigureCanvasAgg(figure)
    curves, differences = figure.subplots(1, 2)
    # Dashed and dotted lines keep every curve visible where they coincide.
    for run, style in zip(runs.values(), ("-", "--", ":", "-."), strict=False):
        if not run.losses:
            continue
        rate = f"{run.tokens_per_s:,.0f} tokens/s" if run.tokens_per_s else "not timed"
        curves.plot(range(1, len(run.losses) + 1), run.losses, linewidth=1.2, linestyle=style,
                    label=f"{run.name} ({rate})")
    curves.set_xlabel("step")
    curves.set_ylabel("training cross-entropy (nats per byte)")
    curves.set_title(title, fontsize=9)
    curves.grid(alpha=0.3)
    curves.legend()
    mok_run = runs.get("mok")
    for slot, comparison in comparisons.items():
        if not comparison["common_steps"]:
            continue
        centers = [min(i * criterion.window + criterion.window / 2, comparison["common_steps"])
                   for i in range(comparison["windows"])]
        differences.plot(centers, comparison["window_diffs"], marker="o", markersize=3,
                         label=f"{runs[slot].name} vs {mok_run.name}")
    if mok_run is not None and mok_run.losses:
        means = window_means(mok_run.losses, criterion.window)
        centers = [i * criterion.window + criterion.window / 2 for i in range(len(means))]
        differences.plot(centers, [criterion.atol + criterion.rtol * m for m in means],
                         color="gray", linestyle="--", label="tolerance")
    differences.set_xlabel("step")
    differences.set_ylabel(f"|difference of {criterion.window}-step means|")
    differences.set_title("loss agreement")
    differences.grid(alpha=0.3)
    differences.legend()
    figure.tight_layout()
    figure.savefig(path)


def chart_title(stamp: RunStamp, *, config: str, params: tuple[int, int],
                tokens_per_step: int) -> str:
    """The loss chart's title: the model, then the stamp's GPU, commit and date, the values the
    run's CSV rows carry (the date tells a chart's rows among a CSV's)."""
    return (f"{config}: {count(params[0])} parameters ({count(params[1])} active), "
            f"{tokens_per_step:,} tokens a step\n"
            f"{stamp.gpu}, commit {stamp.commit}, {stamp.date}")


def count(number: int) -> str:
    """1020931712 -> '1.02B', 77213312 -> '77.2M', 255360 -> '255K'."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if number >= scale:
            return f"{number / scale:.3g}{suffix}"
    return str(number)


def _format(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def print_report(runs: dict[str, BackendRun], comparisons: dict[str, dict],
                 verdict: dict) -> None:
    print(f"\n{'backend':>14} {'steps':>6} {'timed':>6} {'tokens/s':>12} {'vs eager':>9} "
          f"{'vs grouped':>10} {'final loss':>10} {'peak GiB':>9}")
    for run in runs.values():
        if run.error is not None:
            print(f"{run.name:>14}  failed: {run.error}")
            continue
        print(f"{run.name:>14} {run.steps:>6} {run.timed_steps:>6} "
              f"{_format(run.tokens_per_s, ',.0f'):>12} "
              f"{_format(speedup(run, runs.get('hf_eager')), '.2f'):>9} "
              f"{_format(speedup(run, runs.get('hf_grouped_mm')), '.2f'):>10} "
              f"{_format(run.final_loss, '.4f'):>10} {_format(run.peak_mem_gb, '.2f'):>9}")
    mok_name = runs["mok"].name if "mok" in runs else "mok"
    for slot, c in comparisons.items():
        if not c["common_steps"]:
            continue
        print(f"loss {runs[slot].name} vs {mok_name} over {c['common_steps']} steps: max "
              f"window-mean diff {c['max_window_diff']:.4f} (worst window {c['worst_window']}: "
              f"{c['worst_window_diff']:.4f} against {c['worst_window_tolerance']:.4f}), max "
              f"per-step diff {c['max_step_diff']:.4f}, first-step diff "
              f"{c['initial_loss_diff']:.2e}")

    def mark(value: bool | None) -> str:
        return {True: "PASS", False: "FAIL", None: "n/a"}[value]

    checks = verdict["checks"]
    print("\nverdict:")
    print(f"  {mark(checks['vs_eager'])}  mok / hf_eager tokens/s "
          f"{_format(verdict['speedup_vs_eager'], '.2f')}x (target >= {TARGET_VS_EAGER}x)")
    print(f"  {mark(checks['vs_grouped_mm'])}  mok / hf_grouped_mm tokens/s "
          f"{_format(verdict['speedup_vs_grouped_mm'], '.2f')}x "
          f"(target >= {TARGET_VS_GROUPED_MM}x)")
    print(f"  {mark(checks['loss_curves_agree'])}  loss curves agree: "
          f"{verdict['loss_criterion']}")
    print(f"  {mark(checks['initial_losses_agree'])}  first-step losses agree within "
          f"{INITIAL_LOSS_TOL} (same weights, same batch)")
    if not verdict["measures_mok_kernels"]:
        print("  (mok's PyTorch reference stood in for its kernels: not a measurement of mok)")
    print(f"  targets {'all met' if verdict['all_met'] else 'NOT all met'}")


# -- command line ----------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("auto", *mok_train.SIZES), default="auto",
                        help="model (mok.train's sizes): auto is 1b on CUDA, tiny on CPU")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS),
                        help="backends to train, in this order (default: all)")
    parser.add_argument("--mok-backend", choices=("auto", "mok", "mok_fp8", "reference"),
                        default="auto",
                        help="what runs the mok slot: auto is mok's kernels on CUDA and its "
                             "PyTorch reference on CPU (Triton's interpreter is too slow); "
                             "mok_fp8 its kernels in FP8")
    parser.add_argument("--steps", type=int, default=200,
                        help="steps of mok and hf_grouped_mm, and the schedule's length "
                             "(default: %(default)s)")
    parser.add_argument("--eager-steps", type=int, default=40,
                        help="steps of hf_eager, on the same schedule (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=5,
                        help="steps left out of tokens/s (default: %(default)s)")
    parser.add_argument("--window", type=int, default=10,
                        help="steps between synchronized timings (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, help="sequences a step (default: the size's)")
    parser.add_argument("--seq-len", type=int, help="bytes a sequence (default: the size's)")
    parser.add_argument("--lr", type=float, help="peak learning rate (default: the size's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--aux-loss-coef", type=float, default=0.0,
                        help="mok's load-balancing loss weight; the hf blocks add none, so the "
                             "default 0 keeps the objectives equal")
    parser.add_argument("--loss-window", type=int, default=LossCriterion.window)
    parser.add_argument("--loss-atol", type=float, default=LossCriterion.atol)
    parser.add_argument("--loss-rtol", type=float, default=LossCriterion.rtol)
    parser.add_argument("--step-mode", choices=mok_train.STEP_MODES, default="auto",
                        help="how every backend's step runs (mok.app.train.Stepper): eager, graph, "
                        "compile; auto: compile on CUDA, eager on CPU (default: %(default)s)")
    parser.add_argument("--device", default="auto", help="auto (CUDA if present), cpu or cuda")
    parser.add_argument("--out", default="runs/train_bench",
                        help="folder of summary.json and loss.png (default: %(default)s)")
    parser.add_argument("--csv", default=str(RESULTS / "train.csv"),
                        help="CSV the rows are appended to (default: %(default)s)")
    parser.add_argument("--no-csv", action="store_true", help="append no rows")
    parser.add_argument("--threads", type=int, help="CPU threads for torch")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    for name in ("steps", "eager_steps", "window", "loss_window"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the summary written to OUT/summary.json."""
    args = parse_args(argv)
    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = mok_train.resolve_device(args.device)
    size = args.size if args.size != "auto" else ("1b" if device.type == "cuda" else "tiny")
    mok_backend = args.mok_backend
    if mok_backend == "auto":
        mok_backend = "mok" if device.type == "cuda" else "reference"
    preset = mok_train.SIZES[size]
    model_config = dataclasses.replace(preset.model, aux_loss_coef=args.aux_loss_coef)
    schedule_steps = args.steps
    train_config = mok_train.TrainConfig(
        steps=args.steps, schedule_steps=schedule_steps,
        warmup_steps=max(1, min(100, schedule_steps // 10)),
        batch_size=args.batch_size or preset.batch_size, seq_len=args.seq_len or preset.seq_len,
        lr=args.lr if args.lr is not None else preset.lr, seed=args.seed)
    criterion = LossCriterion(args.loss_window, args.loss_atol, args.loss_rtol)
    try:
        step_mode = mok_train.resolve_step_mode(args.step_mode, device)
    except ValueError as exc:
        raise SystemExit(f"--step-mode: {exc}") from None
    train_data, _ = mok_train.split_corpus(mok_train.load_corpus())
    params = parameter_counts(model_config)
    stamp = RunStamp.take(device)  # the one commit and date this run's outputs name
    print(f"training benchmark on {stamp.gpu}: size {size} ({params[0]:,} parameters, "
          f"{params[1]:,} active), {train_config.batch_size} x {train_config.seq_len} = "
          f"{train_config.tokens_per_step:,} tokens a step, {args.steps} steps "
          f"(hf_eager {min(args.eager_steps, args.steps)}), steps run {step_mode}, "
          f"warm-up {args.warmup}, "
          f"windows of {args.window}; commit {stamp.commit}")
    print(f"  model: {dataclasses.asdict(model_config)}")

    runs: dict[str, BackendRun] = {}
    for slot in args.backends:
        steps = min(args.eager_steps, args.steps) if slot == "hf_eager" else args.steps
        name = mok_backend if slot == "mok" else slot
        if slot in HF_EXPERTS and not hf_experts_available(HF_EXPERTS[slot]):
            print(f"{slot}: the installed transformers has no {HF_EXPERTS[slot]!r} experts "
                  "implementation; skipped")
            continue
        config = dataclasses.replace(train_config, steps=steps)
        mode = "eager" if slot == "hf_eager" else step_mode
        try:
            run = train_backend(slot, model_config, config, device, train_data,
                                mok_backend=mok_backend, warmup=args.warmup, window=args.window,
                                progress=not args.no_progress, step_mode=mode)
        except Exception as error:  # e.g. out of memory: report it, measure the others
            traceback.print_exc()
            run = failed_run(slot, name, steps, error)
        if run.error is not None:
            release_memory(device)  # the failed run's tensors, freed with its traceback
        runs[slot] = run
        if run.error is None:
            print(f"{run.name}: {_format(run.tokens_per_s, ',.0f', 'n/a')} tokens/s over "
                  f"{run.timed_steps} timed steps, loss {run.losses[0]:.4f} -> "
                  f"{run.final_loss:.4f}, setup {run.setup_seconds:.1f} s, training "
                  f"{run.train_seconds:.1f} s", flush=True)

    comparisons: dict[str, dict] = {}
    mok_run = runs.get("mok")
    if mok_run is not None and mok_run.losses:
        for slot, run in runs.items():
            if slot != "mok" and run.losses:
                comparisons[slot] = compare_losses(mok_run.losses, run.losses, criterion)
    verdict = build_verdict(runs, comparisons, criterion,
                            measures_mok=mok_backend in ("mok", "mok_fp8"))

    rows = csv_rows(runs, stamp, config=size, params=params,
                    tokens_per_step=train_config.tokens_per_step)
    title = chart_title(stamp, config=size, params=params,
                        tokens_per_step=train_config.tokens_per_step)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "gpu": stamp.gpu, "device": str(device), "commit": stamp.commit, "date": stamp.date,
        "config": size, "chart_title": title,
        "params_total": params[0], "params_active": params[1],
        "tokens_per_step": train_config.tokens_per_step,
        "model": dataclasses.asdict(model_config), "train": dataclasses.asdict(train_config),
        "steps": args.steps, "eager_steps": min(args.eager_steps, args.steps),
        "warmup": args.warmup, "window": args.window,
        "versions": versions(), "transformers_default_experts": transformers_default_experts(),
        "backends": {slot: {**dataclasses.asdict(run), "final_loss": run.final_loss,
                            "speedup_vs_eager": speedup(run, runs.get("hf_eager")),
                            "speedup_vs_grouped_mm": speedup(run, runs.get("hf_grouped_mm"))}
                     for slot, run in runs.items()},
        "loss_comparisons": comparisons,
        "verdict": verdict,
        "csv": None if args.no_csv else str(args.csv),
        "rows": rows,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(out / "loss.png", runs, comparisons, criterion, title)
    if not args.no_csv and rows:
        append_rows(Path(args.csv), CSV_FIELDS, rows)
    print_report(runs, comparisons, verdict)
    print(f"wrote {out / 'summary.json'}, {out / 'loss.png'}"
          + ("" if args.no_csv or not rows else f", {len(rows)} rows to {args.csv}")
          + f" ({time.perf_counter() - started:.0f} s in all)")
    return summary


if __name__ == "__main__":
    main()
