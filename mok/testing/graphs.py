"""The GPU checks every layer step must pass: no host sync, and CUDA-graph capture."""

from __future__ import annotations

from collections.abc import Callable

import torch


def eager_and_captured(step: Callable[[], tuple], before_capture: Callable[[], None] | None = None,
                       ) -> tuple[tuple, torch.cuda.CUDAGraph, tuple]:
    """Run `step` once to compile and fill caches, once eagerly under
    `torch.cuda.set_sync_debug_mode("error")` (any host sync raises), once on a side stream (as
    capture requires), then capture it in a CUDA graph (after `before_capture`, e.g. a barrier
    so every rank captures together). Returns (eager outputs, graph, captured outputs); the
    graph has not been replayed yet."""
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    if before_capture is not None:
        torch.cuda.synchronize()
        before_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    return eager, graph, captured
