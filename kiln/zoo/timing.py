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
# Seconds a block waits before its first run. onnxruntime's intra-op worker keeps spinning after a call returns:
# 1.32's burned 30-50 ms of CPU after each MobileNetV2 call on a 2-vCPU EPYC (bench/results/dw-zen4-2026-12-06.md),
# on the core the next runtime's second thread needs. Its warm-up runs absorbed that time, but kiln learns during
# warm-up which form of its small layers is faster (kiln/kernels/cpu/form_choice.py), and bench/zoo.py's kiln
# learned "serial" from runs made beside the spinning worker (1.48x onnxruntime instead of ~1.0x).
SETTLE_S = 0.25


@dataclass(frozen=True)
class Latency:
    median_ms: float
    p90_ms: float
    runs: int


def time_samples(fn: Runner, *, iterations: int, warmup: int, budget_s: float, min_runs: int = 10,
                 clock: Callable[[], float] = time.perf_counter, settle_s: float = 0.0) -> list[float]:
    """ms of each of up to `iterations` calls after `warmup` (at least `min_runs` calls, then only
    while `budget_s` lasts). `clock=time.thread_time`: the calling thread's CPU time, what a one-thread
    runtime spends on a shared machine without the time it waits for a core. `settle_s`: a sleep first, so
    that the runtime timed before has stopped spinning (SETTLE_S)."""
    time.sleep(settle_s)
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
        samples = time_samples(fn, iterations=iterations, warmup=warmup, budget_s=share, settle_s=SETTLE_S)
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
