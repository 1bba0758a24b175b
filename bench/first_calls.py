"""The first call at a new input shape against a repeat, kiln and onnxruntime side by side in one process
(issue 10: "other shapes inside the profile run at near-segment speed").

    python bench/first_calls.py                                  # bert_tiny, b 1-8 x s 1-128, 40 requests, 1 thread
    python bench/first_calls.py --threads 2 --engine /tmp/bert_tiny.kiln

bench/dynamic.py's stream (random batch x sequence, padding masks). Per request: onnxruntime, then kiln, at a shape
neither has seen (which of them first alternates per request), then --repeats more of each. Times are CPU time
of the calling thread (time.thread_time: a loaded machine's preemption is left out, its cache sharing is not; with
2 threads the workers' time is not in it) and wall. A "repeat" is the median of calls 3 and later at a shape: kiln
runs a new shape's first call padded inside a bound one where it can (kiln/runtime/first_calls.py) and binds the
shape once its padded runs have cost what binding would (a later call, often never), so the second call's extra is
reported too. KILN_PAD_FIRST_CALLS=0: no padding (A/B).

Then where a kiln first call's extra time goes: the stream again with everything kept, dropping before each
request's first call (a) nothing kept, (b) its shape plan only (the shape-only steps run again), (c) its segment
views only (every member of every native segment is bound again at the new sizes), (d) nothing: extra = that call
- the median repeat, median over the stream. These rows time the binding path: the shapes are bound once already,
so the padding runs each at its own size.

The garbage collector's passes during the stream are counted (a full pass scans the whole process: ~110 ms with
BERT-base loaded); --static-heap runs the stream inside kiln.static_heap() (kiln/runtime/heap.py) to compare.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import kiln  # noqa: E402  (before torch: kiln sets OpenMP's wait policy)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from dynamic import _cpu_name, commit, stream  # noqa: E402

from kiln import zoo  # noqa: E402


class Collector:
    """The garbage collector's passes while the block runs: count and thread CPU ms per generation."""

    def __init__(self) -> None:
        self.passes: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._start = 0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.thread_time_ns()
        else:
            self.passes[info["generation"]].append((time.thread_time_ns() - self._start) / 1e6)

    def __enter__(self) -> Collector:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def describe(self) -> str:
        return "; ".join(f"generation {g}: {len(ms)} passes, {sum(ms):.1f} ms, longest {max(ms, default=0):.1f} ms"
                         for g, ms in self.passes.items())


def measure_stream(requests, runners, timed, repeats) -> tuple[dict, dict, dict]:
    """Each request's first call (who meets the shape first alternates), then `repeats` more of each: (first,
    second, repeat) per runner, the repeat the median of the calls after the second."""
    first: dict[str, list] = {n: [] for n in runners}
    second: dict[str, list] = {n: [] for n in runners}
    repeat: dict[str, list] = {n: [] for n in runners}
    for k, r in enumerate(requests):
        order = list(runners.items())[::-1 if k % 2 else 1]  # who meets the shape first alternates
        for name, run in order:
            first[name].append(timed(run, r))
        again: dict[str, list] = {n: [] for n in runners}
        for _ in range(repeats):
            for name, run in order:
                again[name].append(timed(run, r))
        for name in runners:
            second[name].append(again[name][0])
            repeat[name].append(tuple(statistics.median(t[i] for t in again[name][1:]) for i in (0, 1)))
    return first, second, repeat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert_tiny")
    ap.add_argument("--engine", help="a saved engine of the model (else built here with the profile below)")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="calls after the first at each shape (at least 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--static-heap", action="store_true", help="the stream inside kiln.static_heap() (gc.freeze)")
    args = ap.parse_args()
    if args.repeats < 2:
        ap.error("--repeats: at least 2 (a later call at a shape may bind it; calls 3 and later are the repeats)")
    torch.set_num_threads(args.threads)
    import onnxruntime as ort

    exported = zoo.export(args.model, batch=2, seq=16, dynamic=True)
    if args.engine:
        engine = kiln.load(args.engine)
    else:
        opt = f"{min(8, args.max_batch)}x{min(128, args.max_seq)}"
        profile = {"input_ids": f"1x1,{opt},{args.max_batch}x{args.max_seq}"}
        engine = kiln.build(str(exported.path), device="cpu", precision="fp32", profiles=[profile])
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
    context = engine.create_execution_context()
    start = time.perf_counter()
    context.warm_up()  # on the CPU it waits for the primitives made ahead (kiln/kernels/cpu/onednn_ahead.py)
    warm_s = time.perf_counter() - start
    requests = stream(args.requests, args.max_batch, args.max_seq, zoo.get(args.model).vocab_size, args.seed)
    runners = {"onnxruntime": lambda r: session.run(None, r), "kiln": context.run}

    def timed(run, r) -> tuple[float, float]:  # (thread CPU µs, wall µs)
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        run(r)
        return (time.thread_time_ns() - c0) / 1e3, (time.perf_counter_ns() - w0) / 1e3

    heap = kiln.static_heap() if args.static_heap else contextlib.nullcontext()
    with Collector() as collector, heap:
        first, second, repeat = measure_stream(requests, runners, timed, args.repeats)
    print(f"# first calls at new shapes: {args.model}, cpu ({_cpu_name()}), commit {commit()}, "
          f"{args.threads} thread(s), {args.requests} requests b 1-{args.max_batch} x s 1-{args.max_seq}, "
          f"load average {os.getloadavg()[0]:.1f}, padded first calls "
          f"{'on' if context._first_calls is not None else 'off'}{', inside kiln.static_heap()' if args.static_heap else ''}")
    print("\n| clock | kiln first calls / onnxruntime's (stream) | per request median, worst | first-call extra "
          "kiln, onnxruntime (median µs) | second-call extra kiln, onnxruntime (median µs) | repeats kiln / onnxruntime |")
    print("|---|---|---|---|---|---|")
    for i, clock in ((0, "thread CPU"), (1, "wall")):
        total = {n: sum(t[i] for t in first[n]) for n in runners}
        ratios = [k[i] / o[i] for k, o in zip(first["kiln"], first["onnxruntime"])]
        extra = {n: statistics.median(f[i] - p[i] for f, p in zip(first[n], repeat[n])) for n in runners}
        extra2 = {n: statistics.median(f[i] - p[i] for f, p in zip(second[n], repeat[n])) for n in runners}
        repeats = {n: sum(t[i] for t in repeat[n]) for n in runners}
        print(f"| {clock} | {total['kiln'] / total['onnxruntime']:.2f} | {statistics.median(ratios):.2f}, "
              f"{max(ratios):.2f} | {extra['kiln']:.0f}, {extra['onnxruntime']:.0f} | "
              f"{extra2['kiln']:.0f}, {extra2['onnxruntime']:.0f} | {repeats['kiln'] / repeats['onnxruntime']:.2f} |")
    print(f"\ngarbage collector during the stream (both runtimes): {collector.describe()}")
    try:
        from kiln.kernels.cpu.onednn_ahead import AHEAD
        print(f"\nmade ahead (background thread): {AHEAD.made}; warm_up {warm_s:.1f} s wall")
    except ImportError:  # a tree from before it
        print(f"\nwarm_up {warm_s:.1f} s wall")
    if context._first_calls is not None:
        print(f"\nkiln first calls run padded: {context._first_calls.padded_runs} of {args.requests}; binding measured "
              f"{', '.join(f'{ms:.2f}' for ms in context._first_calls.bind_ms)} ms (thread CPU)")

    program = engine.program

    def drop_views() -> None:
        for segment in program.segments:
            segment.resized.clear()

    def drop_shape_plans() -> None:
        if program.shape_plans is not None:
            program.shape_plans.clear()
            program._plan_sizes.clear()
            program.shape_plan_bytes = 0

    print("\n| kept before each request's first kiln call | kiln first-call extra, median µs (thread CPU) |")
    print("|---|---|")
    for what, drop in (("nothing (a true first call)", lambda: (drop_views(), drop_shape_plans())),
                       ("the segment views (the shape-only steps run again)", drop_shape_plans),
                       ("the shape plans (every segment member bound again)", drop_views),
                       ("everything (a repeat after another shape)", lambda: None)):
        for r in requests:  # every view and shape plan made; then each request drops what this row says
            context.run(r)
        extra = []
        for r in requests:
            drop()
            session.run(None, r)
            call = timed(context.run, r)[0]
            again = []
            for _ in range(args.repeats):
                session.run(None, r)
                again.append(timed(context.run, r)[0])
            extra.append(call - statistics.median(again))
        print(f"| {what} | {statistics.median(extra):.0f} |")
    print(f"\nload average {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()
