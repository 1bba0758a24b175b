"""What the GPU test files share: CUDA-graph capture of a launch, and timing for their printed tables
(printed, never asserted)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def capture(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """fn captured into a CUDA graph (capture fails on any host synchronisation inside it), after one
    warm-up call on a side stream (Triton compiles, cuBLAS/cuDNN pick their workspaces outside the
    capture); returns the graph and the output it writes on each replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_replay(fn: Callable[[], Any]) -> Any:
    """fn captured into a CUDA graph and replayed once; its output."""
    graph, out = capture(fn)
    graph.replay()
    torch.cuda.synchronize()
    return out


def median_ms(fn: Callable[[], Any], warmup: int = 10, iters: int = 50) -> float:
    """Median of CUDA-event timings of fn(), each call timed on its own."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]
