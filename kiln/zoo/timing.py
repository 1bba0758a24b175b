"""Peers side by side on one zoo model: kiln, onnxruntime and torch eager, same input, same threads.

Shared by the demo and bench/cpu.py so both time the same way: warm-up runs, then timed runs
until a count or a time budget is reached (at least 10), reported as median and 90th percentile.
Each peer is timed in its own block (time_runners says why not in alternating rounds).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Runner = Callable[[], object]


@dataclass(frozen=True)
class Latency:
    median_ms: float
    p90_ms: float
    runs: int


def time_samples(fn: Runner, *, iterations: int, warmup: int, budget_s: float, min_runs: int = 10,
                 clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """ms of each of up to `iterations` calls after `warmup` (at least `min_runs` calls, then only
    while `budget_s` lasts). `clock=time.thread_time`: the calling thread's CPU time, what a one-thread
    runtime spends on a shared machine without the time it waits for a core."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < iterations and (len(samples) < min_runs or time.perf_counter() < deadline):
        start = clock()
        fn()
        samples.append((clock() - start) * 1e3)
    return samples


def time_runners(runners: dict[str, Runner], *, iterations: int = 100, warmup: int = 10,
                 budget_s: float = 30.0) -> dict[str, Latency]:
    """Time each runner in its own block (warm-up, then up to `iterations` runs in its share of
    `budget_s`). Blocks, not alternating rounds: onnxruntime's worker threads keep spinning for a
    while after each call and would steal the other runtimes' cores on a 2-core machine."""
    results = {}
    share = budget_s / max(len(runners), 1)
    for name, fn in runners.items():
        samples = time_samples(fn, iterations=iterations, warmup=warmup, budget_s=share)
        results[name] = Latency(float(np.median(samples)), float(np.percentile(samples, 90)), len(samples))
    return results


def peer_runners(name: str, onnx_path, feeds: dict[str, np.ndarray], *, threads: int,
                 engine=None) -> dict[str, Runner]:
    """Callables that run `feeds` once through kiln, onnxruntime (all graph optimisations) and torch eager."""
    import onnxruntime as ort
    import torch

    import kiln
    from kiln import zoo

    torch.set_num_threads(threads)
    engine = engine or kiln.build(str(onnx_path))
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    model = zoo.torch_model(name)
    tensors = {k: torch.from_numpy(v) for k, v in feeds.items()}

    def torch_eager():
        with torch.inference_mode():
            return model(**tensors)

    return {
        "kiln": lambda: engine.run(feeds),
        "onnxruntime": lambda: session.run(None, feeds),
        "torch eager": torch_eager,
    }
