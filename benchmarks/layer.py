"""Layer benchmark: mok and the other MoE implementations on the same inputs, checked, then timed.

    python -m mok bench [--shapes ...] [--impls ...] [--modes ...] [--repeats N] [--out DIR]

For each shape (docs/design.md section 4; `tiny` and `tiny-fp8` are small ones for CPU runs,
the second FP8's smallest) and each mode
(forward, backward, forward+backward), every implementation of benchmarks/implementations.py is
first compared with the mok.testing reference on the first input set (y for forward; y and every
gradient for the training modes, bf16 tolerances of mok.testing.tolerance), then timed: median
over --repeats calls, rotating several input sets so the L2 holds none of them, CUDA events
around each call (wall clock on CPU), the device idle before each. Backward times the backward
alone; its forward runs untimed just before. TFLOP/s counts FLOPs as docs/design.md section 4:
forward 6*T*k*H*I (+ 6*T*H*I_s), backward twice that, forward+backward three times. Peak memory
is the most allocated during a timed call above what was allocated before the timing (inputs,
weights and workspaces; CUDA only).

An implementation that fails (unavailable, wrong against the reference, out of memory) is skipped
with its reason for that shape and mode; the others go on. Each row is appended to the CSV as
soon as it is measured, the chart (<csv>.png: TFLOP/s per shape, implementation and mode) is
redrawn after each shape, and a table with the skips is printed at the end. With --rounds N each
shape's implementations are timed N times over, the order rotated by one each round, and each
row is the median round (checked once; appended after the shape's last round).

On a machine without CUDA it runs the `tiny` shape by default, mok under Triton's interpreter
(wall-clock times, no memory figures; the numbers only show that the path works), and writes
under runs/bench/ rather than into the committed benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import enum
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import append_rows, commit_id, finish_chart, newest_gpu_rows
from benchmarks.implementations import (
    IMPLEMENTATIONS,
    LIGER_TUNING,
    REPO_ROOT,
    Implementation,
    Settings,
)
from benchmarks.timing import HOST_AHEAD_S, hold_device, measure  # noqa: F401
from mok import plan
from mok.testing import (
    GRAD_NAMES,
    SHAPES,
    UNTUNED_SHAPES,
    ErrorReport,
    MoEInputs,
    MoEShape,
    error_report,
    make_shape_inputs,
    moe_reference_grads,
)
from mok.testing.tolerance import TOLERANCES

RESULTS = Path(__file__).resolve().parent / "results"
CPU_RESULTS = REPO_ROOT / "runs" / "bench"
# fallbacks: the GEMMs whose planned kernel could not run in mok's rows (mok.plan.fallbacks:
# "kind (what ran instead)"; empty where none did, and for the anchors).
CSV_FIELDS = ("gpu", "commit", "date", "shape", "impl", "mode", "ms", "tflops", "peak_mem_gb",
              "max_rel_err", "fallbacks")
TINY = MoEShape("tiny", 4, 64, 32, 2, 64, 32)  # every path, shared expert included, in seconds
TINY_FP8 = MoEShape("tiny-fp8", 4, 128, 128, 2, 64)  # FP8 with whole scale blocks, in seconds
BENCH_SHAPES = {shape.name: shape for shape in (*SHAPES, *UNTUNED_SHAPES, TINY, TINY_FP8)}


class Mode(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    FORWARD_BACKWARD = "forward+backward"

    @property
    def flops_factor(self) -> int:
        """Counted FLOPs over the forward's: the backward does twice the forward's GEMM work."""
        return {Mode.FORWARD: 1, Mode.BACKWARD: 2, Mode.FORWARD_BACKWARD: 3}[self]

    @property
    def trains(self) -> bool:
        return self is not Mode.FORWARD


@dataclass(frozen=True)
class Skip:
    shape: str
    impl: str
    mode: str
    reason: str


def train_step(impl: Implementation, inputs: MoEInputs) -> tuple:
    """(y, gradients in MoK's order) of one forward+backward."""
    y, saved = impl.forward_train(inputs)
    return y, impl.backward(saved, inputs)


def timed_call(impl: Implementation, mode: Mode, inputs: MoEInputs) -> Callable[[], object]:
    """The call to time for `mode`; for the backward, its forward runs here, untimed."""
    if mode is Mode.FORWARD:
        return functools.partial(impl.forward, inputs)
    if mode is Mode.BACKWARD:
        _, saved = impl.forward_train(inputs)
        return functools.partial(impl.backward, saved, inputs)
    return functools.partial(train_step, impl, inputs)


def check(impl: Implementation, inputs: MoEInputs, reference: tuple, trains: bool) -> ErrorReport:
    """The worst (max_rel) report of y, and of every gradient when `trains`, against the
    reference; raises AssertionError when any exceeds the implementation's tolerance (by
    default its dtype's)."""
    y_ref, grads_ref = reference
    if trains:
        y, grads = train_step(impl, inputs)
        pairs = zip(("y", *GRAD_NAMES), (y, *grads), (y_ref, *grads_ref), strict=True)
    else:
        pairs = [("y", impl.forward(inputs), y_ref)]
    tol = impl.tolerance or TOLERANCES[inputs.x.dtype]
    reports = [error_report(actual, expected, name) for name, actual, expected in pairs
               if expected is not None]
    for report in reports:
        if report.nonfinite or report.rel_rms > tol.rel_rms or report.max_rel > tol.max_rel:
            where = "" if inputs.x.is_cuda else " (under Triton's CPU interpreter)"
            raise AssertionError(f"wrong against the reference{where}: {report} exceeds {tol}")
    return max(reports, key=lambda report: report.max_rel)


def append_row(csv_path: Path, row: dict) -> None:
    """Append one row as soon as it is measured, so a later failure loses nothing."""
    append_rows(csv_path, CSV_FIELDS, [row])


def _error(exc: BaseException) -> str:
    """The exception's type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def bench_implementation(impl_name: str, shape: MoEShape, settings: Settings,
                         input_sets: list[MoEInputs], reference: tuple | None, modes: list[Mode],
                         *, repeats: int, warmup: int, record: Callable[[dict, float], None],
                         skip: Callable[[Skip], None],
                         checks: dict[bool, ErrorReport | str] | None = None) -> None:
    """Check and time one implementation at one shape in every mode; failures become skips.
    checks: by mode.trains, the worst report or why the check failed, filled here where it has
    no entry (a later round passes the first round's: no second check)."""
    try:
        impl = IMPLEMENTATIONS[impl_name](shape, settings)
    except Exception as exc:
        for mode in modes:
            skip(Skip(shape.name, impl_name, mode.value, _error(exc)))
        return
    checks = {} if checks is None else checks
    for mode in modes:
        if impl.checked and mode.trains not in checks:
            kind = "forward+backward" if mode.trains else "forward"
            start_s = time.perf_counter()
            try:
                checks[mode.trains] = check(impl, input_sets[0], reference, mode.trains)
                print(f"  check {impl.name} {kind}: worst {checks[mode.trains]} "
                      f"({time.perf_counter() - start_s:.1f} s, first calls included)", flush=True)
            except Exception as exc:
                checks[mode.trains] = f"check of the {kind} failed: {_error(exc)}"
        worst = checks.get(mode.trains)
        if isinstance(worst, str):
            skip(Skip(shape.name, impl.name, mode.value, worst))
            continue

        def prepare(i, mode=mode):
            return timed_call(impl, mode, input_sets[i % len(input_sets)])

        before = plan.fallbacks()
        try:
            ms, peak, host_ms = measure(prepare, repeats, warmup, settings.device,
                                        host_ahead=settings.host_ahead)
        except Exception as exc:
            skip(Skip(shape.name, impl.name, mode.value, f"timing failed: {_error(exc)}"))
            if settings.device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        tflops = shape.flops(backward=False) * mode.flops_factor / ms / 1e9
        name = f"{impl.name}@ahead" if settings.host_ahead else impl.name
        record(dict(shape=shape.name, impl=name, mode=mode.value, ms=float(f"{ms:.5g}"),
                    tflops=float(f"{tflops:.4g}"),
                    peak_mem_gb="" if peak is None else round(peak, 3),
                    max_rel_err="n/a" if worst is None else f"{worst.max_rel:.2e}",
                    fallbacks=_fallbacks_since(before)),
               host_ms)


def _median_row(rounds: list[tuple[dict, float]]) -> tuple[dict, float]:
    """One row for an implementation's rounds in one mode: the median round's ms and TFLOP/s
    (the lower middle one of an even count), the largest peak, the median host ms; the rest
    as the first round's."""
    by_ms = sorted(rounds, key=lambda entry: entry[0]["ms"])
    row = dict(by_ms[(len(by_ms) - 1) // 2][0])
    peaks = [r["peak_mem_gb"] for r, _ in rounds if r["peak_mem_gb"] != ""]
    row["peak_mem_gb"] = max(peaks) if peaks else ""
    row["max_rel_err"] = rounds[0][0]["max_rel_err"]
    row["fallbacks"] = "; ".join(dict.fromkeys(f for r, _ in rounds
                                               for f in r["fallbacks"].split("; ") if f))
    return row, statistics.median(host for _, host in rounds)


def _fallbacks_since(before: dict) -> str:
    """The fallbacks planned since `before` (mok.plan.fallbacks), one "kind (reason)" each."""
    return "; ".join(f"{kind} ({reason})" for (kind, reason), count in plan.fallbacks().items()
                     if count > before.get((kind, reason), 0))


def run(shapes: list[MoEShape], impl_names: list[str], modes: list[Mode], *, repeats: int = 20,
        warmup: int = 5, num_input_sets: int = 3, csv_path: Path | None = None,
        liger_autotune: bool = True, liger_tuning: Path | None = LIGER_TUNING,
        host_ahead: bool = False, rounds: int = 1) -> tuple[list[dict], list[Skip]]:
    """Benchmark; returns (rows as appended to csv_path, skips). Draws csv_path's chart.
    rounds > 1: each shape's implementations timed that many times over, in order rotated by
    one each round; a row's ms is the median of its rounds' medians (its peak the largest, its
    host ms the median), and the printed line lists the rounds."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    settings = Settings(device, liger_autotune=liger_autotune, liger_tuning=liger_tuning,
                        host_ahead=host_ahead and device.type == "cuda")
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    common = dict(gpu=gpu, commit=commit_id(),
                  date=datetime.datetime.now().isoformat(timespec="seconds"))
    rows: list[dict] = []
    skips: list[Skip] = []

    def record(row: dict, host_ms: float, each_ms: list[float] | None = None) -> None:
        row = {**common, **row}
        rows.append(row)
        if csv_path is not None:
            append_row(csv_path, row)
        peak = "n/a" if row["peak_mem_gb"] == "" else f"{row['peak_mem_gb']:.2f} GiB"
        each = "" if each_ms is None else "  rounds " + " / ".join(f"{ms:.3f}" for ms in each_ms)
        print(f"{row['shape']:18s} {row['impl']:14s} {row['mode']:17s} {row['ms']:10.3f} ms "
              f"{row['tflops']:9.4g} TFLOP/s  peak {peak}  max_rel {row['max_rel_err']}  "
              f"host {host_ms:.3f} ms{each}", flush=True)

    def skip(entry: Skip) -> None:
        if entry in skips:  # a later round's: recorded once
            return
        repeated = any((s.shape, s.impl, s.reason) == (entry.shape, entry.impl, entry.reason)
                       for s in skips)
        skips.append(entry)
        reason = "the same as above" if repeated else entry.reason
        print(f"{entry.shape:18s} {entry.impl:14s} {entry.mode:17s} skipped: {reason}",
              flush=True)

    for shape in shapes:
        print(f"== {shape.name} on {gpu}", flush=True)
        try:
            input_sets = [make_shape_inputs(shape, device=device, seed=100 + i)
                          for i in range(num_input_sets)]
            reference = moe_reference_grads(input_sets[0], compute_dtype=torch.float32)
        except Exception as exc:  # e.g. out of memory: the other shapes may still fit
            skip(Skip(shape.name, "all", "all", f"inputs or reference failed: {_error(exc)}"))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        checks = {name: {} for name in impl_names}
        timed: dict[tuple[str, str], list[tuple[dict, float]]] = {}
        for round_ in range(rounds):
            shift = round_ % len(impl_names)
            for impl_name in impl_names[shift:] + impl_names[:shift]:
                def collect(row: dict, host_ms: float, impl_name=impl_name,
                            timed=timed) -> None:
                    timed.setdefault((impl_name, row["mode"]), []).append((row, host_ms))

                bench_implementation(impl_name, shape, settings, input_sets, reference, modes,
                                     repeats=repeats, warmup=warmup, skip=skip,
                                     record=record if rounds == 1 else collect,
                                     checks=checks[impl_name])
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        for each in timed.values():
            record(*_median_row(each), each_ms=[row["ms"] for row, _ in each])
        del input_sets, reference
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if csv_path is not None and rows:
            try:
                draw_chart(csv_path.with_suffix(".png"), rows)
            except Exception as exc:  # the rows are in the CSV already
                print(f"chart not drawn: {_error(exc)}", flush=True)
    print_table(rows, skips)
    return rows, skips


def print_table(rows: list[dict], skips: list[Skip]) -> None:
    """Per shape and implementation: ms, TFLOP/s and peak GiB of each mode, then the skips."""
    modes = [mode.value for mode in Mode if any(row["mode"] == mode.value for row in rows)]
    cells = {(row["shape"], row["impl"], row["mode"]): row for row in rows}
    header = f"{'shape':18s} {'impl':14s}" + "".join(f" | {mode:>27s}" for mode in modes)
    units = f" | {'ms':>9s} {'TFLOP/s':>8s} {'peak GiB':>8s}"
    print("\n" + header + "\n" + " " * 33 + units * len(modes))
    print("-" * len(header))
    for shape, impl in dict.fromkeys((row["shape"], row["impl"]) for row in rows):
        line = f"{shape:18s} {impl:14s}"
        for mode in modes:
            row = cells.get((shape, impl, mode))
            if row is None:
                line += f" | {'-':>27s}"
            else:
                peak = "n/a" if row["peak_mem_gb"] == "" else f"{row['peak_mem_gb']:.2f}"
                line += f" | {row['ms']:9.3f} {row['tflops']:8.4g} {peak:>8s}"
        print(line)
    modes_by_reason: dict[tuple[str, str, str], list[str]] = {}
    for entry in skips:
        modes_by_reason.setdefault((entry.shape, entry.impl, entry.reason), []).append(entry.mode)
    for (shape, impl, reason), skipped_modes in modes_by_reason.items():
        print(f"skipped {shape} {impl} ({', '.join(skipped_modes)}): {reason}")


def draw_chart(path: Path, rows: list[dict]) -> None:
    """TFLOP/s per shape (groups) and implementation (bars), one panel per mode, as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    shapes = list(dict.fromkeys(row["shape"] for row in rows))
    impls = list(dict.fromkeys(row["impl"] for row in rows))
    modes = [mode.value for mode in Mode if any(row["mode"] == mode.value for row in rows)]
    tflops = {(row["shape"], row["impl"], row["mode"]): float(row["tflops"]) for row in rows}
    width = 0.8 / len(impls)
    figure = Figure(figsize=(max(7.0, 1.7 * len(shapes) + 2.0), 0.6 + 3.2 * len(modes)), dpi=110)
    FigureCanvasAgg(figure)
    for panel, mode in enumerate(modes):
        axes = figure.add_subplot(len(modes), 1, panel + 1)
        for index, impl in enumerate(impls):
            xs = [s + (index - (len(impls) - 1) / 2) * width for s in range(len(shapes))]
            values = [tflops.get((shape, impl, mode), 0.0) for shape in shapes]
            style = dict(color="0.65", hatch="//") if impl == "dense" else {}  # the ceiling
            bars = axes.bar(xs, values, width, label=impl, **style)
            axes.bar_label(bars, labels=[f"{v:.3g}" if v else "" for v in values], fontsize=6,
                           rotation=90, padding=2)
        axes.set_xticks(range(len(shapes)), shapes, fontsize=8)
        axes.set_ylabel("TFLOP/s")
        axes.set_title(mode, fontsize=10)
        axes.margins(y=0.25)
        axes.grid(axis="y", alpha=0.3)
    finish_chart(figure, rows, len(impls), "MoE layer, {gpu}, commit {commits}: counted "
                 "TFLOP/s (docs/design.md section 4)", path)


# Names of mok's implementations in rows measured before the default kept the pre-activations
# (benchmarks.implementations; the change came between the runs of 10:10 and 13:13 that day):
# "mok" recomputed then, "mok_kept" kept.
_KEPT_DEFAULT_SINCE = "2026-12-03T12:00"
_BEFORE_THE_KEPT_DEFAULT = {"mok": "mok_recompute", "mok_kept": "mok",
                            "mok_fp8": "mok_fp8_recompute", "mok_fp8_kept": "mok_fp8"}


def current_names(rows: list[dict]) -> list[dict]:
    """rows with mok's implementations under today's names: those dated before
    _KEPT_DEFAULT_SINCE are renamed by _BEFORE_THE_KEPT_DEFAULT, an "@ahead" suffix kept."""
    renamed = []
    for row in rows:
        name, at, ahead = row["impl"].partition("@")
        if row["date"] < _KEPT_DEFAULT_SINCE and name in _BEFORE_THE_KEPT_DEFAULT:
            row = dict(row, impl=_BEFORE_THE_KEPT_DEFAULT[name] + at + ahead)
        renamed.append(row)
    return renamed


def newest_rows(csv_path: Path) -> list[dict]:
    """The last GPU row of each (shape, impl, mode) in csv_path, numbers as floats (see
    benchmarks.newest_gpu_rows), mok's implementations under today's names (current_names):
    what --redraw charts and tabulates."""
    rows = newest_gpu_rows(csv_path, lambda row: row["shape"], [mode.value for mode in Mode],
                           other_modes=True, rename=current_names)
    return [dict(row, ms=float(row["ms"]), tflops=float(row["tflops"]),
                 peak_mem_gb=float(row["peak_mem_gb"]) if row["peak_mem_gb"] else "")
            for row in rows]


def main(argv: list[str] | None = None) -> None:
    from mok.app.train import int_at_least

    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(prog="python -m mok bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="python -m mok bench --ep N --help: the "
                                            "expert-parallel benchmark and its options")
    parser.add_argument("--shapes", nargs="+", choices=list(BENCH_SHAPES), metavar="SHAPE",
                        default=[s.name for s in SHAPES] if cuda else [TINY.name],
                        help=f"of {', '.join(BENCH_SHAPES)} (default: the docs/design.md shapes "
                             "on a GPU, tiny on CPU)")
    parser.add_argument("--impls", nargs="+", choices=list(IMPLEMENTATIONS), metavar="IMPL",
                        default=list(IMPLEMENTATIONS),
                        help=f"of {', '.join(IMPLEMENTATIONS)} (default: all, in this order)")
    parser.add_argument("--modes", nargs="+", choices=[mode.value for mode in Mode],
                        default=[mode.value for mode in Mode], metavar="MODE",
                        help=f"of {', '.join(mode.value for mode in Mode)} (default: all)")
    parser.add_argument("--repeats", type=int_at_least(1), default=20 if cuda else 2,
                        help="timed calls per implementation and mode (median reported)")
    parser.add_argument("--warmup", type=int_at_least(0), default=5 if cuda else 1,
                        help="untimed calls before the timed ones")
    parser.add_argument("--input-sets", type=int, default=3,
                        help="input sets rotated through the calls (the first is checked)")
    parser.add_argument("--out", type=Path, default=RESULTS if cuda else CPU_RESULTS,
                        help="folder of layer.csv (appended) and layer.png")
    parser.add_argument("--csv", type=Path, default=None,
                        help="the CSV instead of OUT/layer.csv; the chart goes next to it")
    parser.add_argument("--liger-autotune", action=argparse.BooleanOptionalAction, default=cuda,
                        help="let Liger autotune its kernels on its first call per shape "
                             "(minutes each on a GPU); --no-liger-autotune pins one config "
                             "(rows named liger_untuned)")
    parser.add_argument("--liger-tuning", type=Path, default=LIGER_TUNING, metavar="DIR",
                        help="folder where Liger's autotuning results are kept and read back "
                             "by later runs on the same Triton and GPU (default: %(default)s)")
    parser.add_argument("--host-ahead", action="store_true",
                        help="time the kernels alone: the GPU sleeps before each call until the "
                             "host has queued all of it, as when the host runs ahead in training "
                             "(rows named IMPL@ahead); the default times a call from an idle "
                             "GPU, host pace included")
    parser.add_argument("--rounds", type=int_at_least(1), default=1,
                        help="time each shape's implementations this many times over, in "
                             "rotated order, and report each row's median round (runs on one "
                             "machine drift by 10-20%%: a ratio is best read within a run)")
    parser.add_argument("--redraw", action="store_true",
                        help="measure nothing: chart and tabulate the newest GPU row of each "
                             "(shape, implementation, mode) already in the CSV")
    args = parser.parse_args(argv)
    csv_path = args.csv or args.out / "layer.csv"
    if args.redraw:
        rows = newest_rows(csv_path)
        if not rows:
            raise SystemExit(f"{csv_path} has no GPU rows to draw")
        draw_chart(csv_path.with_suffix(".png"), rows)
        print_table(rows, [])
        print(f"chart {csv_path.with_suffix('.png')} from {len(rows)} rows of {csv_path}")
        return
    run([BENCH_SHAPES[name] for name in args.shapes], list(dict.fromkeys(args.impls)),
        [Mode(mode) for mode in dict.fromkeys(args.modes)], repeats=args.repeats,
        warmup=args.warmup, num_input_sets=args.input_sets, csv_path=csv_path,
        liger_autotune=args.liger_autotune, liger_tuning=args.liger_tuning,
        host_ahead=args.host_ahead, rounds=args.rounds)
    for (kind, reason), count in plan.fallbacks().items():
        print(f"fallback: mok's {kind}: {reason} ({count} plans)")
    print(f"rows appended to {csv_path}; chart {csv_path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
