"""Timing candidates: each callable in interleaved rounds, as the tactic search (autotune.py) compares them.

On CUDA the median of event timings over CUDA-graph replays (as the engine runs), on the CPU the least of the
rounds by the clock cpu_clock.py chose (the wall clock, or the process's CPU time where other work shares the CPUs).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kiln.builder.cpu_clock import PROCESS_CPU, WALL, process_cpu_reader
from kiln.runtime.host import host_sync_is_an_error

WARMUP_RUNS = 2
LAYER_BUDGET_S = 0.4  # timing time per measure call (a layer's match: autotune.tournament) at most, beyond 3 rounds


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_once(fn: Callable[[], Any], device: torch.device, read: Callable[[], float]) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    start_s = read()
    fn()
    return (read() - start_s) * 1e3


GRAPH_CALLS = 4  # calls per captured CUDA graph when timing a candidate: one replay, several kernels' worth


def _graph_replays(fns: dict[str, Callable[[], Any]]) -> dict[str, Callable[[], Any]]:
    """Each callable that can be captured, GRAPH_CALLS times into one CUDA graph: the replays to time instead.

    The engine runs as one CUDA graph per input shape, so a candidate's cost there is its GPU
    time; timed eagerly, a small layer's host launch cost (tens of µs through Python for a
    Triton or cuDNN-frontend kernel) would hide it and pick the tactic with the cheapest launch.
    A candidate that cannot be captured (it syncs with the host) is left out and timed eagerly: chosen,
    it makes the engine run eagerly, so its eager time is the honest one. (Until 2026-12-04 one such
    candidate sent every candidate of the layer to eager timing: a quantized layer's reference default
    reads its zero point on the host, so every INT8/FP8 layer was tuned on eager times, where a Triton
    launch's host work counted: ResNet-50's 3x3 64->64 @56 QConvs ran cuDNN's dequantized form, 0.39 ms eager
    against the Triton kernel's 0.41, where graphs time them at ~0.29 and ~0.13; the INT8 engine went from 8.43
    to 7.75 ms with this alone: bench/results/quant-gpu-2026-12-04.md.)
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    capturable = []
    for name, fn in fns.items():
        try:
            with host_sync_is_an_error(), torch.cuda.stream(stream):  # else capture is impossible
                fn()
            capturable.append(name)
        except Exception:  # noqa: BLE001  it syncs: timed eagerly
            continue
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    for name in capturable:
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(GRAPH_CALLS):
                    fns[name]()
            graphs[name] = graph
        except Exception:  # noqa: BLE001  the capture failed after all: timed eagerly
            torch.cuda.synchronize()
    return {name: graph.replay for name, graph in graphs.items()}


def measure(fns: dict[str, Callable[[], Any]], device: torch.device, runs: int = 10,
            budget_s: float = LAYER_BUDGET_S, clock: str = WALL) -> dict[str, float]:
    """ms per call of each callable, timed in interleaved rounds so a burst of load hits all alike.

    On CUDA the median of event timings, of CUDA-graph replays for every candidate that can be
    captured (as the engine will run them), of eager calls for one that cannot. On the CPU by `clock`
    (cpu_clock: WALL, or PROCESS_CPU where other work shares the CPUs), the least of the rounds:
    interference only ever adds time (a descheduled OpenMP thread stalls a whole kernel for a scheduler
    slice; a burst of other work evicts its caches), so the fastest round is the kernel's own cost. Each
    round starts at the next candidate: what one call leaves behind (workers still spinning, counted by
    the process's CPU time) falls on each candidate in turn, not always on the same one.
    """
    for fn in fns.values():
        for _ in range(WARMUP_RUNS):
            fn()
    _synchronize(device)
    per_call = dict.fromkeys(fns, 1)
    if device.type == "cuda" and (replays := _graph_replays(fns)):
        fns = {name: replays.get(name, fn) for name, fn in fns.items()}
        per_call.update(dict.fromkeys(replays, GRAPH_CALLS))
        for fn in replays.values():
            fn()
        _synchronize(device)
    # every thread's CPU time (cpu_clock.process_cpu_reader), the threads the warm-up started included
    read = process_cpu_reader() if clock == PROCESS_CPU else time.perf_counter
    samples: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    deadline = time.perf_counter() + budget_s
    for round_ in range(runs):
        if round_ >= 3 and time.perf_counter() > deadline:
            break
        shift = 0 if device.type == "cuda" else round_ % len(order)
        for name, fn in order[shift:] + order[:shift]:
            samples[name].append(_time_once(fn, device, read))
    if device.type == "cuda":
        return {name: statistics.median(s) / per_call[name] for name, s in samples.items()}
    return {name: min(s) for name, s in samples.items()}
