"""benchmarks.trace: what it reports of a call's kernels (its profiling needs a GPU)."""

import pytest
import torch

from benchmarks import trace


def test_report_counts_kernels_and_idle_gaps_not_host_calls(capsys):
    spans = [(100.0, 5.0, "host: cuLaunchKernelEx"),
             (110.0, 20.0, "route_histogram_kernel"),
             (135.0, 30.0, "gate_up_swiglu_ws_kernel"),  # 5 us idle before it
             (140.0, 2.0, "host: cuLaunchKernelEx"),
             (165.0, 10.0, "down_proj_ws_kernel")]
    totals = trace.report(spans, min_gap_us=2.0)
    assert totals == dict(wall=65.0, busy=60.0, gaps=5.0)
    out = capsys.readouterr().out
    assert "idle 5.0 us" in out and "host: cuLaunchKernelEx" in out
    assert "3 kernels" in out
    # times are printed after the first kernel's start: the host call before it is negative
    assert "-10.0" in out


def test_report_without_kernels(capsys):
    assert trace.report([(0.0, 1.0, "host: cudaEventQuery")], 2.0) == dict(
        wall=0.0, busy=0.0, gaps=0.0)
    assert "no kernels" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_needs_a_gpu():
    with pytest.raises(SystemExit):
        trace.main([])
