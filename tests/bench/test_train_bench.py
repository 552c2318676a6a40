"""The training benchmark (`python -m benchmarks.train`): rows, summary, plot and verdict of a tiny
CPU run, the loss criterion, the 1b model's size, and the one commit and date that a run's rows
and chart title both name.

On CPU mok's PyTorch reference stands in for its kernels and every backend computes in fp32 from
the same weights on the same batches, so the three loss curves agree to rounding.
"""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

from benchmarks import train as bench
from mok.app import train

TINY = ["--device", "cpu", "--size", "tiny", "--batch-size", "4", "--seq-len", "32",
        "--steps", "12", "--eager-steps", "6", "--warmup", "2", "--window", "3",
        "--loss-window", "4", "--no-progress", "--threads", "1"]


def read_rows(path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_tiny_cpu_run_writes_rows_summary_and_plot(tmp_path, monkeypatch):
    # Every call of commit_id answers differently: a run that asked twice would show it.
    calls = []

    def commit_id() -> str:
        calls.append(1)
        return f"c{len(calls)}"

    monkeypatch.setattr(bench, "commit_id", commit_id)
    out, csv_path = tmp_path / "out", tmp_path / "results" / "train.csv"
    returned = bench.main([*TINY, "--out", str(out), "--csv", str(csv_path)])
    summary = json.loads((out / "summary.json").read_text())
    assert summary == json.loads(json.dumps(returned))
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "loss.png").stat().st_size > 20_000  # two panels of curves, not a blank

    config = train.SIZES["tiny"].model
    params = train.build_model(config, "reference", seed=0, device="cpu").parameter_counts()
    assert (summary["params_total"], summary["params_active"]) == params == (255_360, 107_904)
    assert summary["config"] == "tiny" and summary["device"] == "cpu"
    assert summary["tokens_per_step"] == 4 * 32
    assert summary["model"]["aux_loss_coef"] == 0.0  # the hf blocks add no auxiliary loss
    assert summary["train"]["steps"] == summary["train"]["schedule_steps"] == 12
    assert summary["versions"]["transformers"] and summary["versions"]["torch"]
    # One commit a run, asked once: the rows (below), summary and chart title all name it.
    assert calls == [1] and summary["commit"] == "c1"
    assert summary["chart_title"].splitlines()[1] == f"{summary['gpu']}, commit c1, " \
        f"{summary['date']}"

    backends = summary["backends"]
    assert list(backends) == ["mok", "hf_grouped_mm", "hf_eager"]
    # On CPU the reference fills mok's slot; the verdict says it measured no kernels.
    assert [b["name"] for b in backends.values()] == ["reference", "hf_grouped_mm", "hf_eager"]
    assert [b["steps"] for b in backends.values()] == [12, 12, 6]
    assert [len(b["losses"]) for b in backends.values()] == [12, 12, 6]
    assert [b["timed_steps"] for b in backends.values()] == [10, 10, 4]
    # Windows of 3 after 2 warm-up steps: 12 steps -> 3 + 3 + 3 + 1, 6 steps -> 3 + 1.
    assert [len(b["window_tokens_per_s"]) for b in backends.values()] == [4, 4, 2]
    for b in backends.values():
        assert b["error"] is None and b["peak_mem_gb"] is None
        assert b["tokens_per_s"] > 0 and all(r > 0 for r in b["window_tokens_per_s"])
        assert min(b["window_tokens_per_s"]) <= b["tokens_per_s"] <= max(b["window_tokens_per_s"])
        assert b["final_loss"] == b["losses"][-1]
        assert all(math.isfinite(v) for v in b["losses"])
        assert abs(b["losses"][0] - math.log(256)) < 0.3  # a fresh model: near uniform
        assert b["losses"][-1] < b["losses"][0] - 0.5
    ours, grouped, eager = backends.values()
    # Same weights, batches and schedule, all in fp32: the curves agree to rounding.
    for other in (grouped, eager):
        for got, want in zip(other["losses"], ours["losses"], strict=False):
            assert got == pytest.approx(want, abs=1e-4)
    assert grouped["speedup_vs_eager"] == pytest.approx(
        grouped["tokens_per_s"] / eager["tokens_per_s"])
    assert ours["speedup_vs_grouped_mm"] == pytest.approx(
        ours["tokens_per_s"] / grouped["tokens_per_s"])

    comparisons = summary["loss_comparisons"]
    assert set(comparisons) == {"hf_grouped_mm", "hf_eager"}
    for slot, steps in (("hf_grouped_mm", 12), ("hf_eager", 6)):
        c = comparisons[slot]
        assert c["common_steps"] == steps and c["windows"] == math.ceil(steps / 4)
        expected = bench.compare_losses(ours["losses"], backends[slot]["losses"],
                                        bench.LossCriterion(window=4))
        assert c == expected  # JSON keeps floats exactly
        assert c["agree"] is True and c["max_window_diff"] < 1e-4
        assert c["initial_loss_diff"] < 1e-4

    verdict = summary["verdict"]
    assert verdict["speedup_vs_eager"] == pytest.approx(ours["tokens_per_s"]
                                                        / eager["tokens_per_s"])
    assert verdict["speedup_vs_grouped_mm"] == pytest.approx(ours["speedup_vs_grouped_mm"])
    assert verdict["checks"]["loss_curves_agree"] is True
    assert verdict["checks"]["initial_losses_agree"] is True
    assert verdict["checks"]["vs_eager"] == (verdict["speedup_vs_eager"] >= 1.4)
    assert verdict["measures_mok_kernels"] is False and verdict["all_met"] is False

    rows = read_rows(csv_path)
    assert tuple(rows[0]) == bench.CSV_FIELDS
    assert [r["backend"] for r in rows] == ["reference", "hf_grouped_mm", "hf_eager"]
    for row, b in zip(rows, backends.values(), strict=True):
        assert row["gpu"] == summary["gpu"] and row["gpu"].startswith("cpu")
        assert row["commit"] == summary["commit"] and row["commit"]
        assert row["date"] == summary["date"] and row["config"] == "tiny"
        assert (int(row["params_total"]), int(row["params_active"])) == params
        assert int(row["steps"]) == b["steps"] and int(row["timed_steps"]) == b["timed_steps"]
        assert int(row["tokens_per_step"]) == 128
        assert float(row["tokens_per_s"]) == pytest.approx(b["tokens_per_s"], abs=0.06)
        assert float(row["final_loss"]) == pytest.approx(b["final_loss"], abs=6e-6)
        assert row["peak_mem_gb"] == ""
        assert float(row["speedup_vs_eager"]) == pytest.approx(b["speedup_vs_eager"], abs=6e-4)
        assert float(row["speedup_vs_grouped_mm"]) == pytest.approx(b["speedup_vs_grouped_mm"],
                                                                     abs=6e-4)
    assert rows[2]["speedup_vs_eager"] == "1.0" and rows[1]["speedup_vs_grouped_mm"] == "1.0"

    # A second run appends its rows under the same header.
    bench.main([*TINY, "--out", str(tmp_path / "again"), "--csv", str(csv_path),
                "--backends", "mok", "hf_grouped_mm"])
    rows = read_rows(csv_path)
    assert len(rows) == 5 and csv_path.read_text().count("gpu,commit") == 1
    # Without hf_eager there is no eager speedup to report.
    assert [r["backend"] for r in rows[3:]] == ["reference", "hf_grouped_mm"]
    assert rows[3]["speedup_vs_eager"] == "" and float(rows[3]["speedup_vs_grouped_mm"]) > 0
    assert [r["commit"] for r in rows] == ["c1"] * 3 + ["c2"] * 2  # a commit per run


def test_loss_criterion():
    criterion = bench.LossCriterion(window=2, atol=0.1, rtol=0.0)
    assert bench.window_means([1.0, 3.0, 5.0], 2) == [2.0, 5.0]
    same = bench.compare_losses([1.0, 3.0, 5.0], [1.0, 3.0, 5.0], criterion)
    assert same["agree"] is True and same["max_window_diff"] == 0.0
    # Per-step differences that cancel within a window are noise; a shifted window is not.
    noisy = bench.compare_losses([1.0, 3.0, 5.0, 5.0], [1.3, 2.7, 5.0, 5.0], criterion)
    assert noisy["agree"] is True and noisy["max_step_diff"] == pytest.approx(0.3)
    shifted = bench.compare_losses([1.0, 3.0, 5.0, 5.0, 9.0], [1.0, 3.0, 5.2, 5.2], criterion)
    assert shifted["common_steps"] == 4 and shifted["windows"] == 2
    assert shifted["agree"] is False and shifted["worst_window"] == 1
    assert shifted["worst_window_diff"] == pytest.approx(0.2)
    relative = bench.compare_losses([4.0, 4.0], [4.3, 4.3],
                                    bench.LossCriterion(window=2, atol=0.0, rtol=0.1))
    assert relative["agree"] is True and relative["worst_window_tolerance"] == pytest.approx(0.415)


def test_verdict_against_the_targets():
    def run(slot, rate, losses):
        return bench.BackendRun(name=slot, slot=slot, steps=len(losses), timed_steps=1,
                                tokens_per_s=rate, window_tokens_per_s=[rate], losses=losses,
                                peak_mem_gb=1.0, setup_seconds=0.0, train_seconds=1.0)

    criterion = bench.LossCriterion(window=2)
    runs = {"mok": run("mok", 150.0, [5.0, 4.0, 3.0, 2.0]),
            "hf_grouped_mm": run("hf_grouped_mm", 140.0, [5.0, 4.0, 3.0, 2.1]),
            "hf_eager": run("hf_eager", 100.0, [5.001, 4.0])}
    comparisons = {slot: bench.compare_losses(runs["mok"].losses, r.losses, criterion)
                   for slot, r in runs.items() if slot != "mok"}
    verdict = bench.build_verdict(runs, comparisons, criterion, measures_mok=True)
    assert verdict["speedup_vs_eager"] == pytest.approx(1.5)
    assert verdict["speedup_vs_grouped_mm"] == pytest.approx(150 / 140)
    assert verdict["checks"] == {"vs_eager": True, "vs_grouped_mm": True,
                                 "loss_curves_agree": True, "initial_losses_agree": True}
    assert verdict["all_met"] is True
    runs["hf_eager"] = run("hf_eager", 110.0, [5.001, 4.0])
    runs["hf_grouped_mm"] = run("hf_grouped_mm", 160.0, [5.0, 4.0, 3.5, 3.0])
    comparisons["hf_grouped_mm"] = bench.compare_losses(
        runs["mok"].losses, runs["hf_grouped_mm"].losses, criterion)
    verdict = bench.build_verdict(runs, comparisons, criterion, measures_mok=True)
    assert verdict["checks"] == {"vs_eager": False, "vs_grouped_mm": False,
                                 "loss_curves_agree": False, "initial_losses_agree": True}
    assert verdict["all_met"] is False
    rows = bench.csv_rows(runs, bench.RunStamp(gpu="g", commit="c", date="d"), config="1b",
                          params=(2, 1), tokens_per_step=8)
    assert [(r["backend"], r["speedup_vs_eager"], r["speedup_vs_grouped_mm"]) for r in rows] \
        == [("mok", 1.364, 0.938), ("hf_grouped_mm", 1.455, 1.0), ("hf_eager", 1.0, 0.688)]


def test_1b_model_size():
    """The benchmark's model: about 1B parameters in Qwen3-MoE's expert layout, 16,384 tokens a
    step (counted on the meta device; the count is the one a built model reports)."""
    preset = train.SIZES["1b"]
    config = preset.model
    assert (config.hidden_size, config.num_layers, config.num_experts, config.top_k,
            config.moe_intermediate_size) == (1024, 5, 128, 8, 512)
    assert preset.batch_size * preset.seq_len == 16_384
    assert bench.parameter_counts(config) == (1_020_931_712, 77_213_312)
    tiny = train.SIZES["tiny"].model
    assert bench.parameter_counts(tiny) == \
        train.build_model(tiny, "reference", seed=0, device="cpu").parameter_counts()


def test_rows_and_chart_title_name_one_stamp(monkeypatch):
    """A run's CSV rows and its loss chart's title come from one RunStamp: same GPU, commit and
    date (the committed train.csv once named another commit than train_1b_loss.png)."""
    monkeypatch.setattr(bench, "commit_id", lambda: "77ba741-dirty")
    stamp = bench.RunStamp.take(torch.device("cpu"))
    assert stamp.commit == "77ba741-dirty" and stamp.gpu.startswith("cpu")
    runs = {slot: bench.BackendRun(name=slot, slot=slot, steps=2, timed_steps=1,
                                   tokens_per_s=10.0, window_tokens_per_s=[10.0],
                                   losses=[2.0, 1.0], peak_mem_gb=None, setup_seconds=0.0,
                                   train_seconds=1.0)
            for slot in bench.BACKENDS}
    rows = bench.csv_rows(runs, stamp, config="1b", params=(1_020_931_712, 77_213_312),
                          tokens_per_step=16_384)
    title = bench.chart_title(stamp, config="1b", params=(1_020_931_712, 77_213_312),
                              tokens_per_step=16_384)
    assert title.splitlines() == [
        "1b: 1.02B parameters (77.2M active), 16,384 tokens a step",
        f"{stamp.gpu}, commit 77ba741-dirty, {stamp.date}"]
    assert {(r["gpu"], r["commit"], r["date"]) for r in rows} == \
        {(stamp.gpu, stamp.commit, stamp.date)}
