"""Timing for the GPU test files' printed tables (printed, never asserted)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


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
