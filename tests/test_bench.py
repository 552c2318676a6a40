"""The layer benchmark (`python -m mok bench`, benchmarks/layer.py) end to end at its tiny shape:
rows checked against the reference and appended to the CSV, FLOP rates consistent with the
counted FLOPs, the chart written, failures turned into skips without losing measured rows, and
the Liger adapter's weight layout and routing format equal to the reference's layer."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from benchmarks import implementations, layer
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
from mok.__main__ import main as mok_main
from mok.testing import SHAPES, TOLERANCES, make_inputs, moe_reference_grads
from mok.testing.distributed import RANKS_SHARE_GPU

from .conftest import DEVICE

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


def test_redraw_charts_the_newest_gpu_row_of_each_cell(tmp_path, capsys):
    csv_path = tmp_path / "layer.csv"

    def row(gpu, commit, shape, impl, mode, tflops):
        return dict(gpu=gpu, commit=commit, date="2026-01-01T00:00:00", shape=shape, impl=impl,
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


def test_host_times_cover_every_launcher_of_a_step(capsys):
    from benchmarks import host

    times = host.host_times(TINY, kept=False, repeats=1, device=DEVICE)
    for name in ("build_routing", "gate_up_swiglu", "down_proj", "combine", "down_bwd_dswiglu",
                 "d_x_rows", "grouped_wgrad_gate_up", "grouped_wgrad", "router_grad"):
        assert 0 < times[name] < times["step"], name
    parts = sum(us for name, us in times.items() if name != "step")
    assert parts == pytest.approx(times["step"], rel=1e-6)  # one step: the parts add up
    assert all(getattr(host.ops, name).__module__ != host.__name__ for name in host._launchers())
    host.main(["--shapes", TINY.name, "--repeats", "1", "--kept", "--profile", "5"])
    out = capsys.readouterr().out
    assert "kept gate/up" in out and "outside launchers" in out
    assert "cProfile of 1 steps" in out and "tottime" in out


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2
                    and not RANKS_SHARE_GPU,
                    reason="two ranks need two GPUs, or MOK_RANKS_SHARE_GPU=1")
def test_host_times_under_expert_parallelism(capsys):
    # Two processes (gloo on CPU): the host time of one forward and forward+backward of the EP
    # layer, pulled and copied, and of the same work on one GPU, each function's own time;
    # the EP functions appear for the EP variants only, and every wrapper is taken off again.
    from benchmarks import host
    from mok.expert_parallel import ExpertParallel
    from mok.ops import comm

    before = (dict(vars(ExpertParallel)), dict(vars(comm)))
    host.main(["--ep", "2", "--shapes", TINY.name, "--repeats", "1", "--top", "60"])
    assert (dict(vars(ExpertParallel)), dict(vars(comm))) == before
    out = capsys.readouterr().out
    for label in ("one GPU, forward", "pull, forward+backward", "copies, forward+backward",
                  "one GPU, forward, in a row", "copies, forward+backward, in a row"):
        assert label in out, label
    rows = [line.split() for line in out.splitlines()
            if line.startswith("    ") and "function" not in line]
    table = {" ".join(row[3:]): [float(v) for v in row[:3]] for row in rows}
    assert table["(all of them)"][1] > table["(all of them)"][0]  # EP adds host work
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
