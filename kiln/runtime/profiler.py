"""Timing helpers for `kiln bench`: timed runs, latency statistics, dispatch overhead.

Lean-runtime safe: imports only torch and the runtime. Tests never assert on the numbers;
they only check that the helpers run and return sane shapes of data.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kiln.runtime.host import ShapePlan
from kiln.runtime.program import Program


@dataclass
class LatencyStats:
    """Latency of one runtime over repeated runs, in seconds."""

    count: int
    min: float
    mean: float
    median: float
    p90: float
    p95: float
    p99: float
    total: float  # wall time of the timed runs, back to back

    @property
    def qps(self) -> float:
        """Runs per second, one request at a time (what a latency-bound caller gets)."""
        return self.count / self.total if self.total > 0 else float("inf")

    @classmethod
    def from_samples(cls, samples: list[float]) -> LatencyStats:
        if not samples:
            raise ValueError("no timed runs to summarise")
        ordered = sorted(samples)
        return cls(
            count=len(ordered),
            min=ordered[0],
            mean=statistics.fmean(ordered),
            median=statistics.median(ordered),
            p90=percentile(ordered, 90),
            p95=percentile(ordered, 95),
            p99=percentile(ordered, 99),
            total=sum(ordered),
        )

    def to_json(self) -> dict[str, float]:
        return {**self.__dict__, "qps": self.qps}


def percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on sorted samples."""
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100
    lo = int(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def time_runs(
    fn: Callable[[], Any],
    *,
    warmup: int = 5,
    iterations: int | None = None,
    duration: float | None = None,
    sync: Callable[[], None] | None = None,
) -> list[float]:
    """Warm up, then time `fn` run after run; returns per-run seconds.

    `iterations` alone: exactly that many runs. `duration` alone: runs until that many
    seconds have passed (at least one). Both: at least `iterations` runs and `duration` seconds
    (trtexec's rule). `sync` waits for queued device work, so each sample covers the whole run.
    """
    if iterations is None and duration is None:
        iterations = 10
    sync = sync or (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    samples: list[float] = []
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
        enough_runs = iterations is None or len(samples) >= iterations
        enough_time = duration is None or time.perf_counter() - start >= duration
        if enough_runs and enough_time:
            return samples


def device_sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def dispatch_overhead(program: Program, inputs: list[Any], repeats: int = 20) -> float | None:
    """Seconds per layer the interpreter loop costs beyond the kernels themselves.

    Runs the program once for real, recording every layer's result, then times the same loop
    with each kernel replaced by "return the recorded result": what remains is the Python
    dispatch (argument gathering, calls, slot writes, frees). Subgraph layers count as one.
    Returns None for a program without steps.
    """
    steps = program.steps
    if not steps:
        return None
    results: list[Any] = [None] * len(steps)

    def recording(i: int, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(ctx, *args, **attrs):
            results[i] = fn(ctx, *args, **attrs)
            return results[i]

        return call

    def replaying(i: int) -> Callable[..., Any]:
        return lambda ctx, *args, **attrs: results[i]

    recorder = program.with_kernels(recording)
    replayer = program.with_kernels(lambda i, fn: replaying(i))
    with torch.inference_mode():
        recorder.run(inputs)
        samples = time_runs(lambda: replayer.run(inputs), warmup=2, iterations=repeats)
    return statistics.median(samples) / len(steps)


def profile_layers(program: Program, inputs: list[Any], runs: int = 10) -> list[dict[str, Any]]:
    """Per-layer time (trtexec's --dumpProfile): median ms of each step over `runs` eager runs.

    On CUDA each step is bracketed by device events (no CUDA graph, so launch gaps show); host
    shape steps are computed once per shape, as the runtime does, and cost nothing after.
    """
    device = program.device
    cuda = device is not None and device.type == "cuda"
    samples: list[list[float]] = [[] for _ in program.steps]

    def timed_kernel(i: int, fn):
        def call(ctx, *args, **kw):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                result = fn(ctx, *args, **kw)
                end.record()
                pending.append((i, start, end))
                return result
            t0 = time.perf_counter()
            result = fn(ctx, *args, **kw)
            samples[i].append(1000 * (time.perf_counter() - t0))
            return result

        return call

    timed = program.with_kernels(timed_kernel)
    plan = None
    if cuda:
        plan = ShapePlan()
    pending: list = []
    with torch.inference_mode():
        timed.run(inputs, plan=plan)  # records the host steps of this shape
        if plan is not None:
            plan.recording = False
        pending.clear()
        for s in samples:
            s.clear()
        for _ in range(runs):
            timed.run(inputs, plan=plan)
            if cuda:
                torch.cuda.synchronize()
                for i, start, end in pending:
                    samples[i].append(start.elapsed_time(end))
                pending.clear()
    layers = []
    for spec, s in zip(program.spec.steps, samples):
        layers.append({"name": spec.name, "op_type": spec.op_type, "tactic": getattr(spec, "tactic", "") or "default",
                       "ms": statistics.median(s) if s else 0.0})
    return layers


def profile_segments(program: Program, inputs: list[Any], runs: int = 10,
                     clock: int = time.CLOCK_MONOTONIC) -> dict[str, list[float]]:
    """Layer name -> its ms in each of `runs` runs of `program` as it is (its native segments' compiled loops
    timing each call by `clock`; Segment.timed), for the layers inside native segments.

    profile_layers runs every layer through its own launch, without segments; this times the engine's own
    loop, where a layer runs after the layer before it evicted its weights and activations: a GEMM tactic
    that won alone may lose here (kiln/builder/in_context.py)."""
    with contextlib.ExitStack() as stack, torch.inference_mode():
        found = [stack.enter_context(segment.timed(clock)) for segment in program.segments]
        for _ in range(runs):
            program.run(inputs)
    return {name: ms for per_segment in found for name, ms in per_segment.items()}
