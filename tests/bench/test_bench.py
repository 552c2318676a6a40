"""The layer benchmark (`python -m mok bench`, benchmarks/layer.py) end to end at its tiny shape:
rows checked against the reference and appended to the CSV, FLOP rates consistent with the
counted FLOPs, the chart written, failures turned into skips without losing measured rows, and
the Liger adapter's weight layout and routing format equal to the reference's layer. Also the
provenance every benchmark records (the commit of the mok package that ran, mok.provenance) and
the GPU test log of scripts/gpu_check.sh (benchmarks.gpu_test_log)."""

from __future__ import annotations

import csv
import dataclasses
import datetime
import hashlib
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mok
from benchmarks import commit_id, gpu_test_log, implementations, layer
from benchmarks.implementations import (
    Implementation,
    Settings,
    Unavailable,
    autograd_implementation,
    dense_gemms,
    grouped_mm_moe,
    liger_implementation,
)
from benchmarks.layer import CSV_FIELDS, TINY, Mode
from mok import _env, provenance
from mok.app.cli import main as mok_main
from mok.testing import SHAPES, TOLERANCES, MoEShape, make_inputs, moe_reference_grads
from mok.testing.distributed import too_few_gpus

from ..conftest import DEVICE

MODES = [mode.value for mode in Mode]


def read_csv(path):
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == CSV_FIELDS
        return list(reader)


def assert_row_consistent(row, checked: bool):
    """Times positive, TFLOP/s = counted FLOPs / time, error within the bf16 tolerance."""
    assert row["shape"] == TINY.name
    assert row["gpu"] == (torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu")
    ms = float(row["ms"])
    assert 0 < ms < 60_000 and math.isfinite(ms)
    flops = TINY.flops(backward=False) * Mode(row["mode"]).flops_factor
    assert float(row["tflops"]) == pytest.approx(flops / ms / 1e9, rel=1e-3)
    if DEVICE.type == "cuda":
        assert float(row["peak_mem_gb"]) >= 0
    else:
        assert row["peak_mem_gb"] == ""
    if checked:
        # bf16 layers against the fp32 reference: never exact, always within the tolerance.
        assert 0 < float(row["max_rel_err"]) <= TOLERANCES[torch.bfloat16].max_rel
    else:
        assert row["max_rel_err"] == "n/a"


def test_bench_command_writes_checked_rows_table_and_chart(tmp_path, capsys):
    # Not here: liger (its bf16 GEMMs are wrong under the interpreter; the fp32 test below checks
    # its adapter) and compile (tens of seconds of compiling on CPU).
    mok_main(["bench", "--shapes", "tiny", "--impls", "mok", "dense", "grouped_mm", "loop",
              "sonicmoe", "--repeats", "1", "--warmup", "0", "--input-sets", "2",
              "--out", str(tmp_path)])
    out = capsys.readouterr().out
    rows = read_csv(tmp_path / "layer.csv")
    by_key = {(row["impl"], row["mode"]): row for row in rows}
    assert len(by_key) == len(rows)  # one row per implementation and mode
    assert {row["commit"] for row in rows} == {commit_id()}
    for impl in ("mok", "dense", "grouped_mm", "loop"):
        for mode in MODES:
            assert_row_consistent(by_key[(impl, mode)], checked=impl != "dense")
    # SonicMoE cannot run here: skipped with its reason, no row.
    assert not any(row["impl"] == "sonicmoe" for row in rows)
    assert "sonicmoe" in out and "nvidia-cutlass-dsl" in out
    # The table: a header naming every mode, a line per measured implementation.
    assert any(all(mode in line for mode in MODES) and line.startswith("shape")
               for line in out.splitlines())
    for impl in ("mok", "dense", "grouped_mm", "loop"):
        assert any(line.split()[:2] == ["tiny", impl] and line.count("|") == 3
                   for line in out.splitlines())
    # The chart: a real PNG with drawn content.
    png = tmp_path / "layer.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.shape[0] > 300 and image.shape[1] > 500
    assert float(image[..., :3].std()) > 0.05
    # A second run appends (no second header).
    mok_main(["bench", "--shapes", "tiny", "--impls", "dense", "--modes", "forward",
              "--repeats", "1", "--warmup", "0", "--out", str(tmp_path)])
    again = read_csv(tmp_path / "layer.csv")
    assert again[:len(rows)] == rows and len(again) == len(rows) + 1
    assert (again[-1]["impl"], again[-1]["mode"]) == ("dense", "forward")


def test_failures_are_skipped_and_measured_rows_kept(tmp_path, monkeypatch):
    def wrong(shape, settings):  # 1.5x the layer: must fail the check, never be timed
        return autograd_implementation(
            "wrong", lambda *args: 1.5 * grouped_mm_moe(*args), fuse_gate_up=True)

    def broken_backward(shape, settings):  # a correct forward, a backward that raises
        good = implementations.grouped_mm_implementation(shape, settings)

        def backward(saved, inputs):
            raise RuntimeError("backward kernel failed to launch")

        return Implementation("broken_backward", good.forward, good.forward_train, backward)

    def fails_when_timed(shape, settings):  # passes the check, then runs out of memory
        good = implementations.grouped_mm_implementation(shape, settings)
        calls = []

        def forward(inputs):
            calls.append(1)
            if len(calls) > 1:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return good.forward(inputs)

        return Implementation("fails_when_timed", forward, good.forward_train, good.backward)

    def unavailable(shape, settings):
        raise Unavailable("not installed here")

    monkeypatch.setattr(layer, "IMPLEMENTATIONS", {
        "wrong": wrong, "broken_backward": broken_backward,
        "fails_when_timed": fails_when_timed, "unavailable": unavailable,
        "dense": implementations.dense_implementation})
    csv_path = tmp_path / "layer.csv"
    rows, skips = layer.run([TINY], ["wrong", "broken_backward", "fails_when_timed",
                                     "unavailable", "dense"], list(Mode), repeats=1, warmup=0,
                            num_input_sets=2, csv_path=csv_path, liger_autotune=False)
    measured = {(row["impl"], row["mode"]) for row in read_csv(csv_path)}
    assert measured == {(row["impl"], row["mode"]) for row in rows} == {
        ("broken_backward", "forward"), ("fails_when_timed", "backward"),
        ("fails_when_timed", "forward+backward"), *(("dense", mode) for mode in MODES)}
    reasons = {(skip.impl, skip.mode): skip.reason for skip in skips}
    assert set(reasons) == {*(("wrong", mode) for mode in MODES),
                            ("broken_backward", "backward"),
                            ("broken_backward", "forward+backward"),
                            ("fails_when_timed", "forward"),
                            *(("unavailable", mode) for mode in MODES)}
    assert reasons[("wrong", "forward")].startswith("check of the forward failed")
    assert "exceeds" in reasons[("wrong", "forward+backward")]
    assert "backward kernel failed to launch" in reasons[("broken_backward", "backward")]
    assert reasons[("fails_when_timed", "forward")].startswith("timing failed: OutOfMemoryError")
    assert reasons[("unavailable", "backward")] == "Unavailable: not installed here"
    assert (tmp_path / "layer.png").stat().st_size > 0


def test_rounds_rotate_the_order_check_once_and_record_the_median_round(tmp_path, monkeypatch,
                                                                         capsys):
    built, checked = [], []

    def factory(name):
        def make(shape, settings):
            built.append(name)
            return dataclasses.replace(
                implementations.grouped_mm_implementation(shape, settings), name=name)
        return make

    def unavailable(shape, settings):
        built.append("unavailable")
        raise Unavailable("not installed here")

    def counted_check(impl, *args):
        checked.append(impl.name)
        return check(impl, *args)

    check = layer.check
    monkeypatch.setattr(layer, "check", counted_check)
    monkeypatch.setattr(layer, "IMPLEMENTATIONS", {"a": factory("a"), "b": factory("b"),
                                                   "unavailable": unavailable})
    csv_path = tmp_path / "layer.csv"
    rows, skips = layer.run([TINY], ["a", "b", "unavailable"], [Mode.FORWARD], repeats=1,
                            warmup=0, num_input_sets=1, csv_path=csv_path, rounds=3)
    # each round starts one later in the list
    assert built == ["a", "b", "unavailable", "b", "unavailable", "a", "unavailable", "a", "b"]
    assert checked == ["a", "b"]  # once each: the first round's
    # one row per implementation and mode, its ms the median of the printed rounds
    assert read_csv(csv_path) == [{k: str(v) for k, v in row.items()} for row in rows]
    assert [row["mode"] for row in rows] == ["forward", "forward"]
    lines = [line for line in capsys.readouterr().out.splitlines() if "rounds " in line]
    assert len(lines) == 2
    for row, line in zip(rows, lines, strict=True):
        each = [float(ms) for ms in line.split("rounds ")[1].split(" / ")]
        assert len(each) == 3 and abs(row["ms"] - sorted(each)[1]) <= 5e-4  # printed .3f
    # the implementation that cannot run: one skip, not one a round
    assert [(skip.impl, skip.reason) for skip in skips] == [
        ("unavailable", "Unavailable: not installed here")]


def test_dense_ceiling_has_the_layers_counted_flops():
    for shape in (*SHAPES, TINY):
        assert sum(2 * m * k * n for m, k, n in dense_gemms(shape)) == shape.flops(False)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="Triton's fp32 dot is TF32 on a GPU; the "
                    "benchmark's bf16 check covers Liger there")
def test_liger_adapter_computes_the_reference_layer_in_fp32():
    """Weight layout (gate_up rows), int32 routing, gradient split and shared expert: equal to
    the reference in fp32, where Triton's interpreter computes Liger's kernels exactly."""
    try:
        impl = liger_implementation(TINY, Settings(DEVICE, liger_autotune=False))
    except Unavailable as exc:
        pytest.skip(str(exc))
    inputs = make_inputs(48, 64, 32, 4, 2, shared_intermediate_size=16, dtype=torch.float32,
                         seed=3)
    reference = moe_reference_grads(inputs, compute_dtype=torch.float64)
    report = layer.check(impl, inputs, reference, trains=True)
    assert report.max_rel <= TOLERANCES[torch.float32].max_rel


def test_liger_tuning_is_kept_in_its_folder_and_read_back(tmp_path, monkeypatch):
    """What Triton's autotuner writes through the cache manager (check_disk_cache: get_file,
    then put of <kernel>.autotune.json) lands in the kept folder, is found there by a later run
    whose own Triton cache is empty, and other files stay in Triton's cache only."""
    triton = pytest.importorskip("triton")
    from triton.runtime.cache import get_cache_manager

    kept = tmp_path / "kept"
    with triton.knobs.cache.scope():
        triton.knobs.cache.manager_class = implementations.kept_tuning_cache(kept)
        monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "run1"))
        key, other = hashlib.sha256(b"tuning").hexdigest(), hashlib.sha256(b"other").hexdigest()
        first = get_cache_manager(key)
        assert first.get_file("_kernel.autotune.json") is None
        timings = '{"key": [1024, 512], "configs_timings": [[{"kwargs": {}}, [0.5, 0.5, 0.5]]]}'
        first.put(timings, "_kernel.autotune.json", binary=False)
        first.put(b"cubin", "_kernel.cubin")
        (held,) = kept.rglob("*.json")
        assert held.read_text() == timings and held.parent.name == first.key
        assert not list(kept.rglob("*.cubin"))
        assert (tmp_path / "run1" / first.key / "_kernel.cubin").read_bytes() == b"cubin"

        monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "run2"))  # a fresh machine
        second = get_cache_manager(key)
        assert Path(second.get_file("_kernel.autotune.json")).read_text() == timings
        assert second.get_file("_kernel.cubin") is None
        assert get_cache_manager(other).get_file("_kernel.autotune.json") is None
    assert triton.knobs.cache.manager_class is None


def test_redraw_charts_the_newest_gpu_row_of_each_cell(tmp_path, capsys):
    csv_path = tmp_path / "layer.csv"

    def row(gpu, commit, shape, impl, mode, tflops):
        return dict(gpu=gpu, commit=commit, date="2026-12-04T00:00:00", shape=shape, impl=impl,
                    mode=mode, ms=1.0, tflops=tflops, peak_mem_gb=0.5, max_rel_err="1e-02")

    rows = [row("NVIDIA H200", "old", "qwen3-30b-a3b", "mok", "forward", 100.0),
            row("NVIDIA H200", "old", "olmoe-1b-7b", "mok", "forward", 200.0),
            row("NVIDIA H200", "new", "qwen3-30b-a3b", "mok", "forward", 300.0),
            row("cpu", "cpu", "qwen3-30b-a3b", "mok", "forward", 1.0),
            row("NVIDIA H200", "new", "qwen3-30b-a3b", "dense", "forward", 700.0)]
    layer.append_rows(csv_path, CSV_FIELDS, rows)
    newest = layer.newest_rows(csv_path)
    assert [(r["shape"], r["impl"], r["commit"], r["tflops"]) for r in newest] == [
        ("qwen3-30b-a3b", "mok", "new", 300.0), ("qwen3-30b-a3b", "dense", "new", 700.0),
        ("olmoe-1b-7b", "mok", "old", 200.0)]
    mok_main(["bench", "--redraw", "--csv", str(csv_path)])
    assert (tmp_path / "layer.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "from 3 rows" in out and "300" in out
    with csv_path.open(newline="") as handle:
        assert len(list(csv.DictReader(handle))) == len(rows)  # nothing appended
    with pytest.raises(SystemExit, match="name the CSV with --csv"):
        mok_main(["bench", "--redraw", "--csv", str(tmp_path / "missing.csv")])


def test_triton_dense_computes_what_dense_computes():
    # The anchor of Triton's own GEMM speed does the cuBLAS anchor's products, in each operand
    # layout they use (a @ w.T, d_out @ w, d_out.T @ a), on the same operands.
    settings = Settings(DEVICE, liger_autotune=False)
    inputs = make_inputs(16, TINY.hidden_size, TINY.intermediate_size, TINY.num_experts,
                         TINY.topk, device=DEVICE, seed=3)
    dense = implementations.dense_implementation(TINY, settings)
    triton_dense = implementations.triton_dense_implementation(TINY, settings)
    outputs, saved = dense.forward_train(inputs)
    outputs_triton, saved_triton = triton_dense.forward_train(inputs)
    pairs = [*zip(outputs, outputs_triton, strict=True),
             *zip(dense.backward(saved, inputs), triton_dense.backward(saved_triton, inputs),
                  strict=True)]
    assert len(pairs) == 3 * len(dense_gemms(TINY))
    for expected, actual in pairs:
        assert actual.shape == expected.shape and actual.dtype == torch.bfloat16
        rel = (actual.float() - expected.float()).norm() / expected.float().norm()
        assert rel < 1e-2, rel


def test_dense_fp8_computes_the_dense_products_of_its_e4m3_operands():
    # The FP8 ceiling: each of the dense anchor's products (a @ w.T, d_out @ w, d_out.T @ a) by
    # torch._scaled_mm, on e4m3 operands made before the timed calls.
    shape = MoEShape("fp8-tiny", 4, 128, 64, 2, 64)
    settings = Settings(DEVICE, liger_autotune=False)
    inputs = make_inputs(shape.num_tokens, shape.hidden_size, shape.intermediate_size,
                         shape.num_experts, shape.topk, device=DEVICE, seed=4)
    dense_fp8 = implementations.dense_fp8_implementation(shape, settings)
    outputs, saved = dense_fp8.forward_train(inputs)
    grads = dense_fp8.backward(saved, inputs)
    assert len(outputs) == len(dense_gemms(shape)) and len(grads) == 2 * len(outputs)
    for i, (a, w, w_t, d_out, d_out_t, a_t) in enumerate(saved):
        assert a.dtype == torch.float8_e4m3fn
        assert torch.equal(w_t.float(), w.float().T) and torch.equal(a_t.float(), a.float().T)
        assert torch.equal(d_out_t.float(), d_out.float().T)
        for actual, expected in ((outputs[i], a.float() @ w.float().T),
                                 (grads[2 * i], d_out.float() @ w.float()),
                                 (grads[2 * i + 1], d_out.float().T @ a.float())):
            assert actual.dtype == torch.bfloat16 and actual.shape == expected.shape
            torch.testing.assert_close(actual.float(), expected, rtol=1e-2, atol=1e-2)
    odd = MoEShape("odd", 4, 136, 72, 2, 24)
    with pytest.raises(implementations.Unavailable, match="multiples of 16"):
        implementations.dense_fp8_implementation(odd, settings)


def test_fp8_rows_run_at_expert_widths_of_a_partial_scale_block():
    # gpt-oss-20b's I = 2880 and the like: FP8 rows are timed there too (no longer skipped).
    settings = Settings(DEVICE, liger_autotune=False)
    for factory in (implementations.mok_fp8_implementation,
                    implementations.mok_fp8_recompute_implementation):
        for shape in (MoEShape("gpt-oss-like", 4, 256, 192, 2, 16),
                      MoEShape("shared-64", 4, 256, 128, 2, 16, 64)):
            assert factory(shape, settings).tolerance is not None


def test_host_times_cover_every_launcher_of_a_step(capsys):
    from benchmarks import host

    times = host.host_times(TINY, recompute=True, repeats=1, device=DEVICE)
    # the recomputing dSwiGLU: one launch, or two (dswiglu_apart, the sm_90 tile rule's)
    dswiglu = "dswiglu_apart" if "dswiglu_apart" in times else "down_bwd_dswiglu"
    for name in ("build_routing", "gate_up_swiglu", "down_proj", "combine", dswiglu,
                 "d_x_rows", "grouped_wgrad_gate_up", "grouped_wgrad", "router_grad"):
        assert 0 < times[name] < times["step"], name
    parts = sum(us for name, us in times.items() if name != "step")
    assert parts == pytest.approx(times["step"], rel=1e-6)  # one step: the parts add up
    assert all(getattr(host.ops, name).__module__ != host.__name__ for name in host._launchers())
    host.main(["--shapes", TINY.name, "--repeats", "1", "--profile", "5"])
    out = capsys.readouterr().out
    assert "kept gate/up" in out and "outside launchers" in out
    assert "cProfile of 1 steps" in out and "tottime" in out


def test_host_parts_of_the_forward_and_the_backward(capsys):
    from benchmarks import host

    wrapped = [getattr(owner, attribute) for _, owner, attribute in host._parts()]
    times = host.host_parts(TINY, recompute=False, repeats=1, device=DEVICE)
    assert [getattr(owner, attribute) for _, owner, attribute in host._parts()] == wrapped
    assert host.ops.gate_up_swiglu.__module__ != host.__name__  # restored
    forward = times["forward"]
    assert 0 < times["forward: schedule built at"] < times["forward: gate/up launched at"] < forward
    assert 0 < times["forward: allocations (torch.empty)"] < forward
    assert 0 < times["forward: the flags' copy to the host"] < forward  # once, in the forward
    assert times["backward: the flags' copy to the host"] == 0
    assert 0 < times["backward: allocations (torch.empty)"] < times["backward"]
    host.main(["--parts", "--shapes", TINY.name, "--repeats", "1"])
    out = capsys.readouterr().out
    assert "parts include what they call" in out and "forward: gate/up launched at" in out


@pytest.mark.skipif(too_few_gpus(2), reason="two ranks need two GPUs, or MOK_RANKS_SHARE_GPU=1")
@pytest.mark.slow
def test_host_times_under_expert_parallelism(capsys):
    # Two processes (gloo on CPU): the host time of one forward and forward+backward of the EP
    # layer, pulled and copied, and of the same work on one GPU, each function's own time;
    # the EP functions appear for the EP variants only, and every wrapper is taken off again.
    from benchmarks import host
    from mok.exchange import SymmetricExchange
    from mok.ops import comm

    before = (dict(vars(SymmetricExchange)), dict(vars(comm)))
    host.main(["--ep", "2", "--shapes", TINY.name, "--repeats", "1", "--top", "60"])
    assert (dict(vars(SymmetricExchange)), dict(vars(comm))) == before
    out = capsys.readouterr().out
    for label in ("one GPU, forward", "pull, forward+backward", "copies, forward+backward",
                  "one GPU, forward, in a row", "copies, forward+backward, in a row"):
        assert label in out, label
    rows = [line.split() for line in out.splitlines()
            if line.startswith("    ") and "function" not in line]
    table = {" ".join(row[3:]): [float(v) for v in row[:3]] for row in rows}
    # The EP variants' own functions show that EP adds host work; the totals are not compared:
    # under the interpreter a total is seconds of noise (a run measured 1951 ms for the pulled
    # variant against 2125 ms on one GPU).
    assert all(ms > 0 for ms in table["(all of them)"])
    for name in ("ops.gate_up_swiglu", "ops.down_bwd_dswiglu", "the rest of the step"):
        assert all(ms > 0 for ms in table[name]), name
    for name in ("ep.build_plan", "comm.finish", "ops.exchange_routes"):
        one_gpu, pulled, copied = table[name]
        assert one_gpu == 0 and pulled > 0 and copied > 0, name
    for name in ("ep.forward_copy", "ops.local_first_blocks"):
        assert table[name][:2] == [0, 0] and table[name][2] > 0, name


def test_ncu_summary_reads_ncu_details_csv():
    # ncu --csv --page details, after ncu's own messages (scripts/gpu_ncu.sh's --log-file):
    # a row per launch, the units converted to microseconds, a missing metric shown as "-".
    from benchmarks.ncu_summary import METRICS, raw_metrics, read_launches, summary

    fields = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
              '"Block Size","Grid Size","Device","CC","Section Name","Metric Name",'
              '"Metric Unit","Metric Value"')

    def row(launch, kernel, section, name, unit, value):
        return (f'"{launch}","1","python3","h","{kernel}","1","7","(256, 1, 1)","(132, 1, 1)",'
                f'"0","9.0","{section}","{name}","{unit}","{value}"')

    text = "\n".join([
        "==PROF== Connected to process 1",
        fields,
        row(0, "gate_up_swiglu_kernel", "GPU Speed Of Light Throughput", "Duration", "msecond",
            "1.62"),
        row(0, "gate_up_swiglu_kernel", "GPU Speed Of Light Throughput",
            "Compute (SM) Throughput", "%", "71.25"),
        row(0, "gate_up_swiglu_kernel", "Occupancy", "Achieved Occupancy", "%", "12.4"),
        row(1, "down_bwd_dswiglu_kernel", "GPU Speed Of Light Throughput", "Duration",
            "usecond", "2,912.5"),
        row(1, "down_bwd_dswiglu_kernel", "Memory Workload Analysis", "L2 Hit Rate", "%",
            "88.0"),
    ])
    launches = read_launches(text)
    assert [(launch, kernel) for launch, kernel, _ in launches] == [
        ("0", "gate_up_swiglu_kernel"), ("1", "down_bwd_dswiglu_kernel")]
    table = summary(text).splitlines()
    assert len(table) == 3 and table[0].split()[:2] == ["id", "kernel"]
    titles = [title for title, _ in METRICS]
    cells = {line.split()[1]: dict(zip(titles, line.split()[2:], strict=True))
             for line in table[1:]}
    assert cells["gate_up_swiglu_kernel"]["us"] == "1620.0"
    assert cells["gate_up_swiglu_kernel"]["SM %"] == "71.2"
    assert cells["gate_up_swiglu_kernel"]["occ %"] == "12.4"
    assert cells["gate_up_swiglu_kernel"]["L2 hit %"] == "-"
    assert cells["down_bwd_dswiglu_kernel"]["us"] == "2912.5"
    assert cells["down_bwd_dswiglu_kernel"]["L2 hit %"] == "88.0"
    with pytest.raises(SystemExit, match="no ncu CSV header"):
        summary("==PROF== nothing profiled")
    # The raw page (the second pass): a column per metric, units in the row after the header;
    # the pipes' shares and the stall reasons, largest first, names shortened.
    tensor = "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    raw = "\n".join([
        "==PROF== Disconnected",
        f'"ID","Kernel Name","{tensor}","{stall.format("barrier")}",'
        f'"{stall.format("long_scoreboard")}"',
        '"","","%","ratio","ratio"',
        '"0","gate_up_swiglu_kernel","71.5","0.5","2.25"',
    ])
    lines = raw_metrics(raw).splitlines()
    assert lines[0].split() == ["0", "gate_up_swiglu_kernel"]
    assert lines[1].split(": ")[1] == "tensor_op_gmma=71.50"
    assert lines[2].split(": ")[1] == "long_scoreboard=2.25 barrier=0.50"


# -- provenance: the commit of the mok that ran -----------------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[2]
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(cwd: Path, *args: str) -> str:
    """git's stdout in cwd, with no repository inherited from the environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c",
                           "commit.gpgsign=false", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, check=True).stdout.strip()


def expected_commit() -> str:
    """This repository's short HEAD (+ -dirty), as git says from the root; in a copy of the tree
    without .git, the package version."""
    try:
        git(REPO_ROOT, "ls-files", "--error-unmatch", "--", "mok/__init__.py")
        head = git(REPO_ROOT, "rev-parse", "--short", "HEAD")
        dirty = git(REPO_ROOT, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return f"mok-{mok.__version__}"
    return head + ("-dirty" if dirty else "")


def commit_in_subprocess(cwd: Path, **env: str) -> list[str]:
    """[commit_id(), its source] as a fresh python started in cwd, importing this repository's
    mok and benchmarks (PYTHONPATH), records them."""
    environ = {k: v for k, v in os.environ.items()
               if k != "MOK_COMMIT" and not k.startswith("GIT_")}
    environ.update(PYTHONPATH=str(REPO_ROOT), **env)
    code = ("from benchmarks import commit_id; from mok.provenance import resolve_commit; "
            "print(commit_id()); print(resolve_commit()[1])")
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=environ, text=True,
                         capture_output=True, check=True).stdout
    return out.splitlines()[-2:]


@needs_git
def test_commit_is_the_mok_packages_not_the_working_directorys(tmp_path):
    # A run started inside another git repository records the commit of the mok it imported.
    other = tmp_path / "other"
    other.mkdir()
    git(other, "init", "-q")
    (other / "README").write_text("another project\n")
    git(other, "add", "README")
    git(other, "commit", "-q", "-m", "another project")
    (other / "README").write_text("changed\n")  # dirty there, whatever this tree is
    other_head = git(other, "rev-parse", "--short", "HEAD")
    before = expected_commit()
    commit, source = commit_in_subprocess(other)
    after = expected_commit()  # a commit made meanwhile in this tree is as good
    assert commit in (before, after)
    assert not commit.startswith(other_head)
    assert source == ("package version" if commit.startswith("mok-") else "git")


def test_mok_commit_overrides(tmp_path, monkeypatch):
    assert commit_in_subprocess(tmp_path, MOK_COMMIT="77ba741") == ["77ba741", "MOK_COMMIT"]
    monkeypatch.setattr(_env, "COMMIT", "abc1234")
    assert commit_id() == provenance.commit_id() == "abc1234"
    # Unset (mok._env's "unknown") or blank, it is not a commit.
    for unset in ("unknown", " "):
        monkeypatch.setattr(_env, "COMMIT", unset)
        assert provenance.resolve_commit()[1] != "MOK_COMMIT"


@needs_git
def test_git_commit_of_a_package_tracked_or_not(tmp_path, monkeypatch):
    git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text("venv/\n")
    git(tmp_path, "add", ".gitignore")
    git(tmp_path, "commit", "-q", "-m", "ignore venv")
    # A package inside the work tree but not tracked by it (an installed copy in an ignored
    # virtualenv) is not that tree's code.
    installed = tmp_path / "venv" / "site-packages" / "mok"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text("")
    assert provenance.git_commit(installed) is None
    assert provenance.git_commit(tmp_path / "venv") is None  # no __init__.py at all
    package = tmp_path / "src" / "mok"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    git(tmp_path, "add", "src")
    git(tmp_path, "commit", "-q", "-m", "the package")
    head = git(tmp_path, "rev-parse", "--short", "HEAD")
    assert provenance.git_commit(package) == head
    (tmp_path / ".gitignore").write_text("venv/\nbuild/\n")  # any tracked file counts
    assert provenance.git_commit(package) == f"{head}-dirty"
    (tmp_path / "notes.txt").write_text("untracked\n")
    git(tmp_path, "checkout", "-q", "--", ".gitignore")
    assert provenance.git_commit(package) == head  # untracked files do not
    # Outside any git tree (an installed wheel): the package version.
    monkeypatch.setattr(_env, "COMMIT", "unknown")
    monkeypatch.setattr(provenance, "git_commit", lambda package_dir=None: None)
    assert provenance.resolve_commit() == (f"mok-{mok.__version__}", "package version")
    assert commit_id() == f"mok-{mok.__version__}"


# -- the GPU test log ----------------------------------------------------------------------------

PASSED = "....s.....\n12 passed, 1 skipped in 3.21s\n"
FAILED = """..F.E.
=================================== FAILURES ===================================
__________________________________ test_sum ___________________________________
    def test_sum():
>       assert "FAILED tests/x.py::fake" == 1
E       AssertionError
==================================== ERRORS ====================================
________________________ ERROR at setup of test_load _________________________
E   RuntimeError: boom
=========================== short test summary info ============================
FAILED tests/test_a.py::test_sum - AssertionError
ERROR tests/test_a.py::test_load - RuntimeError: boom
1 failed, 3 passed, 1 error in 12.50s
"""
KILLED = "......\n...F..\n"  # SIGKILL at the time limit: no summary
COLLECTION = """============================= test session starts ==============================
==================================== ERRORS ====================================
____________________ ERROR collecting tests/test_b.py _____________________
E   ModuleNotFoundError: No module named 'nothing'
=========================== short test summary info ============================
ERROR tests/test_b.py - ModuleNotFoundError: No module named 'nothing'
!!!!!!!!!!!!!!!!!!!! Interrupted: 1 error during collection !!!!!!!!!!!!!!!!!!!!
=============================== 1 error in 0.52s ===============================
"""


def test_pytest_summary_lines():
    assert gpu_test_log.pytest_summary(PASSED) == ([], "12 passed, 1 skipped in 3.21s")
    short, final = gpu_test_log.pytest_summary(FAILED)
    assert short == ["FAILED tests/test_a.py::test_sum - AssertionError",
                     "ERROR tests/test_a.py::test_load - RuntimeError: boom"]
    assert final == "1 failed, 3 passed, 1 error in 12.50s"
    assert gpu_test_log.pytest_summary(KILLED) == ([], None)
    short, final = gpu_test_log.pytest_summary(COLLECTION)
    assert short[0].startswith("ERROR tests/test_b.py") and "Interrupted" in short[1]
    assert final == "1 error in 0.52s"
    assert gpu_test_log.pytest_summary("no tests ran in 0.01s\n") == ([], "no tests ran in 0.01s")


def test_gpu_test_log_has_header_and_every_groups_summary(tmp_path):
    logs = []
    for index, text in enumerate((PASSED, FAILED, KILLED, COLLECTION)):
        logs.append(tmp_path / f"pytest.{index}.log")
        logs[-1].write_text(text)
    commands = [f"timeout -s KILL 330 python3 -m pytest -q -rfE -p no:cacheprovider "
                f"tests/test_{index}.py" for index in range(4)]
    groups = [gpu_test_log.Group(log, status, command)
              for log, status, command in zip(logs, (0, 1, 137, 2), commands, strict=True)]
    date = datetime.datetime(2026, 11, 30, 23, 59, 58, tzinfo=datetime.UTC)
    kwargs = dict(commit="abc1234-dirty", commit_source="git", date=date,
                  gpu="NVIDIA H200, driver 570.86.15",
                  versions={"torch": "2.11.0+cu128", "triton": "3.6.0"},
                  env={"MOK_RANKS_SHARE_GPU": "1"})
    path = gpu_test_log.write_log(tmp_path / "gpu-tests", groups, **kwargs)
    assert path == tmp_path / "gpu-tests" / "2026-11-30_abc1234-dirty.log"
    lines = path.read_text().splitlines()
    assert "benchmarks/results/gpu-tests/" in lines[0]
    assert lines[1:8] == ["suite: tests", "commit: abc1234-dirty (from git)",
                          "date: 2026-11-30T23:59:58Z", "gpu: NVIDIA H200, driver 570.86.15",
                          "versions: torch 2.11.0+cu128, triton 3.6.0",
                          "env: MOK_RANKS_SHARE_GPU=1", "commands:"]
    assert lines[8:12] == [f"  [{index}] {command}" for index, command in enumerate(commands)]
    assert lines[12] == "result: NOT all passed: group(s) 1, 2, 3 of 4 did not exit 0"
    sections = "\n".join(lines[13:]).strip().split("\n\n")
    assert sections[0].splitlines() == ["== group 0 (pytest.0.log): exit status 0: passed",
                                        "12 passed, 1 skipped in 3.21s"]
    assert sections[1].splitlines() == [
        "== group 1 (pytest.1.log): exit status 1: tests failed",
        "FAILED tests/test_a.py::test_sum - AssertionError",
        "ERROR tests/test_a.py::test_load - RuntimeError: boom",
        "1 failed, 3 passed, 1 error in 12.50s"]
    assert sections[2].splitlines() == [
        "== group 2 (pytest.2.log): exit status 137: killed (time limit)",
        "no pytest summary line: the run did not finish; its last lines:",
        "  ......", "  ...F.."]
    assert sections[3].splitlines()[0] == \
        "== group 3 (pytest.3.log): exit status 2: interrupted"
    assert sections[3].splitlines()[-1] == "1 error in 0.52s"
    assert "test session starts" not in path.read_text()  # summaries only, not the output
    # Another run of the same day and commit keeps the first log; a suite names its own.
    again = gpu_test_log.write_log(tmp_path / "gpu-tests", groups[:1], **kwargs)
    assert again.name == "2026-11-30_abc1234-dirty.2.log"
    assert "result: all 1 pytest groups passed" in again.read_text()
    ep = gpu_test_log.write_log(tmp_path / "gpu-tests", groups[:1], suite="ep", **kwargs)
    assert ep.name == "2026-11-30_abc1234-dirty_ep.log"
    assert path.read_text().splitlines()[1] == "suite: tests"


def test_gpu_test_log_command_line(tmp_path, capsys):
    log = tmp_path / "pytest.0.log"
    log.write_text(FAILED)
    out = tmp_path / "gpu-tests"
    command = "python3 -m pytest -q -rfE -k 'expert_parallel or test_ep_' tests/test_nn.py"
    path = gpu_test_log.main(["--out-dir", str(out), "--suite", "ep",
                              "--group", str(log), "1", command])
    today = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    assert path.parent == out and path.name.startswith(today)
    assert path.name.endswith(f"_{commit_id()}_ep.log")
    text = path.read_text()
    assert f"commit: {commit_id()} (from " in text and f"  [0] {command}\n" in text
    assert f"torch {torch.__version__}" in text and "triton " in text
    assert "gpu: " in text and "FAILED tests/test_a.py::test_sum" in text
    assert str(path) in capsys.readouterr().out


def run_gpu_check_tests(tmp_path, **env_vars):
    """scripts/gpu_check.sh's test step alone in tmp_path, on two made-up test files (test_bad
    fails, test_good passes), with these TESTS_* variables."""
    for name in ("mok", "benchmarks"):
        (tmp_path / name).symlink_to(REPO_ROOT / name)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_good.py").write_text("def test_good():\n    pass\n")
    (tmp_path / "tests" / "test_bad.py").write_text("def test_bad():\n    assert 1 == 2\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # python3 is the interpreter running these tests (a script, as a link would leave its venv).
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "RUN_", "TESTS_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", OUT=str(tmp_path / "out"),
               MOK_COMMIT="c0ffee1", TESTS_JOBS="2", RUN_BENCH="0", PYTHONPATH="", **env_vars)
    return subprocess.run(["bash", str(REPO_ROOT / "scripts" / "gpu_check.sh")], cwd=tmp_path,
                          env=env, text=True, capture_output=True, timeout=300)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_script_writes_the_test_log(tmp_path):
    # The groups' commands and exit statuses reach the log.
    done = run_gpu_check_tests(tmp_path)
    logs = list((tmp_path / "out" / "gpu-tests").glob("*_c0ffee1.log"))
    assert len(logs) == 1, done.stdout + done.stderr
    text = logs[0].read_text()
    assert "commit: c0ffee1 (from MOK_COMMIT)" in text
    assert "result: NOT all passed: group(s) 0 of 2 did not exit 0" in text
    assert ("  [0] timeout -s KILL 330 python3 -m pytest -q -rfE -p no:cacheprovider "
            "tests/test_bad.py\n") in text
    assert "== group 0 (pytest.0.log): exit status 1: tests failed" in text
    assert "FAILED tests/test_bad.py::test_bad - assert 1 == 2" in text
    assert "== group 1 (pytest.1.log): exit status 0: passed" in text
    assert "1 passed in " in text
    # the groups' logs end up in one file (a GPU call brings back a few files only)
    out = tmp_path / "out"
    assert not list(out.glob("pytest.*"))
    merged = (out / "tests.log").read_text()
    assert "== group 0" in merged and "== group 1" in merged and "test_bad" in merged


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_script_runs_a_shard_of_the_tests(tmp_path):
    # TESTS_SHARD=2/2: the second of the two test ids alone, in one group (not two: an empty
    # group would run pytest on everything), its log named for the shard.
    done = run_gpu_check_tests(tmp_path, TESTS_SHARD="2/2")
    logs = list((tmp_path / "out" / "gpu-tests").glob("*_c0ffee1_shard2of2.log"))
    assert len(logs) == 1, done.stdout + done.stderr
    text = logs[0].read_text()
    assert "result: all 1 pytest groups passed" in text, text
    assert "<the 1 tests of pytest.0.ids>" in text
    merged = (tmp_path / "out" / "tests.log").read_text()
    assert "tests/test_good.py::test_good" in merged and "test_bad" not in merged


def test_rows_gain_new_columns_without_losing_old_ones(tmp_path):
    # A CSV written before a column existed (here: fallbacks) is rewritten with the new header
    # when rows with it are appended: the old rows keep every value, their new cell empty.
    csv_path = tmp_path / "layer.csv"
    old_fields = [name for name in CSV_FIELDS if name != "fallbacks"]
    old = dict(gpu="NVIDIA H200", commit="old", date="2026-01-01T00:00:00", shape="tiny",
               impl="mok", mode="forward", ms="1.0", tflops="2.0", peak_mem_gb="0.5",
               max_rel_err="1e-02")
    layer.append_rows(csv_path, old_fields, [old])
    new = {**old, "commit": "new", "fallbacks": "d_x (the Triton kernel runs its Gluon tiles)"}
    layer.append_row(csv_path, new)
    with csv_path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        assert tuple(reader.fieldnames) == CSV_FIELDS
        assert list(reader) == [{**old, "fallbacks": ""}, new]
    with pytest.raises(ValueError, match="columns"):
        layer.append_rows(csv_path, old_fields[:-1], [old])


def test_redraw_names_rows_from_before_the_kept_default_as_today():
    # Until 2026-12-03 "mok" recomputed gate/up and "mok_kept" kept it; now "mok" keeps it and
    # "mok_recompute" recomputes. Rows measured before are charted under today's names.
    def row(date, impl):
        return dict(gpu="NVIDIA H200", commit="c", date=date, shape="qwen3-30b-a3b", impl=impl,
                    mode="forward+backward", ms=1.0, tflops=1.0, peak_mem_gb=0.5,
                    max_rel_err="1e-02")

    rows = [row("2026-12-02T21:58:51", "mok"), row("2026-12-02T21:58:51", "mok_kept"),
            row("2026-12-02T21:58:51", "mok_kept@ahead"), row("2026-12-03T09:52:16", "mok_fp8"),
            row("2026-12-03T09:52:16", "dense"), row("2026-12-03T16:08:27", "mok"),
            row("2026-12-03T16:08:27", "mok_recompute")]
    assert [r["impl"] for r in layer.current_names(rows)] == [
        "mok_recompute", "mok", "mok@ahead", "mok_fp8_recompute", "dense", "mok",
        "mok_recompute"]
