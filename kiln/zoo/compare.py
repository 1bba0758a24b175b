"""Peers side by side on one zoo model: kiln, onnxruntime and torch eager, same input, same threads.

Shared by the demo and bench/cpu.py so both time the same way: warm-up runs, then timed rounds
until a count or a time budget is reached (at least 10), reported as median and 90th percentile.
The peers take turns within each round, so a machine that is busy for a while slows them all
alike instead of whichever ran then.
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


def time_interleaved(runners: dict[str, Runner], *, iterations: int = 100, warmup: int = 10,
                     budget_s: float = 30.0) -> dict[str, Latency]:
    """Time several runners in rounds (each runs once per round); budget_s bounds all of them together."""
    for fn in runners.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in runners}
    deadline = time.perf_counter() + budget_s
    rounds = 0
    while rounds < iterations and (rounds < 10 or time.perf_counter() < deadline):
        for name, fn in runners.items():
            start = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - start) * 1e3)
        rounds += 1
    return {name: Latency(float(np.median(s)), float(np.percentile(s, 90)), len(s)) for name, s in samples.items()}


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
