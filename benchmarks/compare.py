"""mok's layer in two trees side by side: the working tree against an earlier commit.

    python -m benchmarks.compare --base REV [--shapes SHAPE ...] [--rounds 2] [--repeats 30]
        [--warmup 3] [--recompute] [--forward] [--precision fp8 [--fp8-weight-gradients]]
        [--base-dir DIR] [--csv FILE]

What a change did to the layer, measured one way every time. Each tree runs in a process of its
own: the base's mok is `git archive REV mok` in a temporary folder, imported ahead of this
tree's (--base-dir: a folder holding the base's `mok`, for a copy of the tree without its git
history; REV then only names it). The two alternate --rounds times, so a drift of the machine
(its host's pace moves between calls) shows in both. Each process times mok's forward+backward
(schedule included) at each shape (--forward: the forward alone, schedule included; --precision
fp8: MoKConfig(precision="fp8"), its e4m3 weight copies made once, as in a training step) with
benchmarks.timing.measure over three input sets: from an idle GPU (the layer benchmark's way,
the host's issuing included), queued ahead (the GPU's time alone), the host's time to issue a
call, and the peak memory. Prints a row per shape and tree with each round's numbers and the
change of the median queued-ahead time (idle on CPU); --csv appends every measurement.
On CPU (Triton's interpreter) the times are the interpreter's wall clock: only a check that the
tool works.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSV_FIELDS = ("gpu", "base", "new", "date", "shape", "mode", "tree", "round", "idle_ms",
              "ahead_ms", "host_ms", "peak_gib", "precision")


def _worker(specs: list[str], repeats: int, warmup: int, recompute: bool,
            forward_only: bool, precision: str, fp8_weight_gradients: bool) -> None:
    """In the tree's process: one JSON line per shape spec (name:E,H,I,k,T,Is)."""
    import torch

    import mok
    from benchmarks.timing import measure
    from mok import functional as F
    from mok.testing import MoEShape, make_shape_inputs

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for spec in specs:
        name, sizes = spec.split(":")
        shape = MoEShape(name, *(int(v) for v in sizes.split(",")))
        sets = [make_shape_inputs(shape, device=device, seed=seed) for seed in range(3)]
        config = F.MoKConfig(recompute_gate_up=recompute, precision=precision,
                             fp8_weight_gradients=fp8_weight_gradients)
        workspace = F.create_workspace(config, None, device=device,
                                       num_local_tokens=shape.num_tokens,
                                       hidden_size=shape.hidden_size, topk=shape.topk)

        def prepare(i, sets=sets, config=config, workspace=workspace):
            inputs = sets[i % len(sets)]

            def call():
                schedule = F.build_schedule(workspace, config, inputs.topk_experts,
                                            num_local_experts=inputs.num_local_experts)
                y, context = F.forward(config, workspace, schedule, *inputs.layer_args)
                if forward_only:
                    return y
                return F.backward(config, workspace, schedule, context, inputs.d_output,
                                  *inputs.layer_args)
            return call

        idle, peak, host = measure(prepare, repeats, warmup, device)
        ahead = (measure(prepare, repeats, 1, device, host_ahead=True)[0]
                 if device.type == "cuda" else None)
        print(json.dumps(dict(shape=name, idle_ms=idle, ahead_ms=ahead, host_ms=host,
                              peak_gib=peak, mok=str(Path(mok.__file__).parent),
                              flops=shape.flops(backward=not forward_only))), flush=True)
        del sets


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()


def _run_tree(mok_root: Path, commit: str, args, specs: list[str]) -> list[dict]:
    """The worker in a process whose mok is mok_root's; its JSON lines."""
    env = dict(os.environ, MOK_COMMIT=commit,
               PYTHONPATH=os.pathsep.join([str(mok_root), str(ROOT)]))
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--specs", *specs,
               "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
    if args.recompute:
        command.append("--recompute")
    if args.forward:
        command.append("--forward")
    command += ["--precision", args.precision]
    if args.fp8_weight_gradients:
        command.append("--fp8-weight-gradients")
    done = subprocess.run(command, cwd=mok_root, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the {commit} tree's process failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    for row in rows:  # the process ran the tree it was meant to
        if Path(row["mok"]).resolve() != (mok_root / "mok").resolve():
            raise SystemExit(f"the {commit} tree's process imported mok from {row['mok']}")
    return rows


def _fmt(values: list) -> str:
    return " / ".join("-" if v is None else f"{v:.3f}" for v in values)


def compare(args) -> list[dict]:
    """Run both trees args.rounds times; returns every measurement as a CSV row."""
    from benchmarks import commit_id
    from benchmarks.layer import BENCH_SHAPES

    specs = []
    for name in args.shapes:
        shape = BENCH_SHAPES[name]
        sizes = [getattr(shape, f.name) for f in dataclasses.fields(shape)][1:]
        specs.append(f"{name}:{','.join(str(v) for v in sizes)}")
    base = args.base if args.base_dir else _git("rev-parse", "--short", args.base)
    new = commit_id()
    measured = []
    with tempfile.TemporaryDirectory() as tmp:
        base_root = Path(tmp)
        if args.base_dir:
            base_root = args.base_dir.resolve()
            if not (base_root / "mok" / "__init__.py").is_file():
                raise SystemExit(f"--base-dir {args.base_dir} holds no mok package")
        else:
            archive = subprocess.run(["git", "archive", base, "mok"], cwd=ROOT, check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(base_root)], input=archive, check=True)
        for round_ in range(args.rounds):
            for tree, root, commit in (("base", base_root, base), ("new", ROOT, new)):
                for row in _run_tree(root, commit, args, specs):
                    measured.append(dict(row, tree=tree, round=round_ + 1, commit=commit))
                    print(f"  round {round_ + 1} {tree} {commit} {row['shape']}: idle "
                          f"{row['idle_ms']:.3f} ms, ahead {_fmt([row['ahead_ms']])} ms, host "
                          f"{row['host_ms']:.3f} ms", flush=True)
    mode = "forward" if args.forward else "forward+backward"
    precision = args.precision + ("+fp8_weight_gradients" if args.fp8_weight_gradients else "")
    _print_table(measured, args.shapes, base, new, f"{mode}, {precision}")
    gpu = _gpu_name()
    date = datetime.datetime.now().isoformat(timespec="seconds")
    return [dict(gpu=gpu, base=base, new=new, date=date, shape=row["shape"], mode=mode,
                 tree=row["tree"],
                 round=row["round"], idle_ms=row["idle_ms"], ahead_ms=row["ahead_ms"],
                 host_ms=row["host_ms"], peak_gib=row["peak_gib"], precision=precision)
            for row in measured]


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (interpreter)"


def _print_table(measured: list[dict], shapes: list[str], base: str, new: str,
                 mode: str) -> None:
    print(f"\nmok {mode}, ms per round (base {base}, new {new}); change: median of the new "
          f"tree's rounds against the base's, queued ahead and from an idle GPU (on CPU: idle)")
    print(f"{'shape':20s} {'tree':5s} {'queued ahead':>24s} {'idle GPU':>24s} "
          f"{'host':>20s} {'peak GiB':>9s} {'TFLOP/s':>8s}  change")
    for shape in shapes:
        medians = {}
        for tree in ("base", "new"):
            rows = [row for row in measured if row["shape"] == shape and row["tree"] == tree]
            ahead = [row["ahead_ms"] for row in rows]
            idle = [row["idle_ms"] for row in rows]
            medians[tree] = (None if ahead[0] is None else statistics.median(ahead),
                             statistics.median(idle))
            timed = medians[tree][0] or medians[tree][1]
            tflops = rows[0]["flops"] / timed / 1e9
            peak = rows[0]["peak_gib"]
            change = ""
            if tree == "new":
                change = ", ".join(
                    f"{label}{(now / was - 1) * 100:+.1f}%"
                    for label, now, was in zip(("ahead ", "idle "), medians["new"],
                                               medians["base"], strict=True)
                    if now is not None)
            print(f"{shape:20s} {tree:5s} {_fmt(ahead):>24s} {_fmt(idle):>24s} "
                  f"{_fmt([row['host_ms'] for row in rows]):>20s} "
                  f"{'-' if peak is None else f'{peak:.2f}':>9s} {tflops:8.1f}  {change}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="the commit to compare the working tree with")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="SHAPE",
                        help="benchmarks.layer's shape names (default: qwen3-30b-a3b, "
                             "sonicmoe-7b and mok-small on a GPU, tiny on CPU)")
    parser.add_argument("--rounds", type=int, default=2, help="times each tree runs, in turns")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before them")
    parser.add_argument("--recompute", action="store_true", help="recompute_gate_up=True")
    parser.add_argument("--base-dir", type=Path, default=None,
                        help="a folder holding the base's mok (instead of git archive REV)")
    parser.add_argument("--forward", action="store_true",
                        help="the forward alone (schedule included), not forward+backward")
    parser.add_argument("--precision", choices=("bf16", "fp8"), default="bf16",
                        help="MoKConfig.precision of both trees")
    parser.add_argument("--fp8-weight-gradients", action="store_true",
                        help="MoKConfig.fp8_weight_gradients (with --precision fp8)")
    parser.add_argument("--csv", type=Path, default=None, help="append every measurement here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--specs", nargs="+", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.specs, args.repeats, args.warmup, args.recompute, args.forward,
                args.precision, args.fp8_weight_gradients)
        return
    if args.base is None:
        parser.error("--base REV is required")
    if args.fp8_weight_gradients and args.precision != "fp8":
        parser.error("--fp8-weight-gradients needs --precision fp8")
    if args.shapes is None:
        import torch

        args.shapes = (["qwen3-30b-a3b", "sonicmoe-7b", "mok-small"]
                       if torch.cuda.is_available() else ["tiny"])
    rows = compare(args)
    if args.csv is not None:
        from benchmarks import append_rows

        append_rows(args.csv, CSV_FIELDS, rows)
        print(f"rows appended to {args.csv}")


if __name__ == "__main__":
    main()
