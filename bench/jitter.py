"""Where batch-1 jitter comes from on the GPU: the same fixed-shape kiln engine timed five ways; on the CPU,
kiln against onnxruntime at one shape.

    python bench/jitter.py [--models resnet50_b1,bert_b1] [--calls 3000] [--ways direct] [--out DIR]
    python bench/jitter.py --device cpu [--models bert_base:1x8,bert_tiny:1x16] [--calls 2000] [--engine PATH]

A control loop cares about its worst call. For each model (bench/gpu.py's rows: ResNet-50 batch 1,
BERT-base 1 x 128 with its attention mask), after a warm-up, seven ways timed in interleaved blocks of 100 calls (a
drift of the GPU's clocks or of the host lands on all alike), each call on two clocks: CUDA events around it (the
GPU's timeline, idle included) and the host's until the result is synchronized (what a caller waiting on it sees):

- replay:             the captured CUDA graph alone: the GPU's own spread
- run:                context.run(feeds), as bench/gpu.py measures it
- run, static_heap:   inside kiln.static_heap() (the startup heap out of the collector's passes)
- run, gc off:        the collector off
- run, thread pinned: the calling thread held on one core (no migration)
- run, after gc.collect(): a full collection before each block (the load's survivors out of the young generations)
- execute (bound):    set_tensor_address once, then context.execute() (one graph launch a call)

--ways direct: the old run() path against the direct one (kiln/runtime/static_replay.py, KILN_DIRECT_REPLAY=1: one
foreach copy into the graph's inputs, no inference mode entered, nothing the collector tracks made before the
launch), two contexts of one engine in one process: replay, run (old), run (direct), each run with the collector off,
run (direct, inputs in graph) (KILN_REPLAY_CAPTURES_INPUTS=1: the same feeds each call, their copies captured at their
addresses), execute (bound).

For each way the calls above its device p99 are set beside the host's time to enqueue them (until the call
returns): where the slow calls were late on the host, the host made them slow.

On the CPU (issue 10: p99/p50 over 2,000 calls at a fixed shape, kiln vs onnxruntime): a zoo encoder exported
with symbolic batch and sequence, built with a profile (or --engine, a saved engine of it), run at one shape with
its padding mask: context.run, the same inside kiln.static_heap() (kiln/runtime/heap.py: the startup heap out of
the collector's full passes), and onnxruntime (same thread count), in alternating blocks of 100 calls so the
machine's load falls on all alike. Wall and thread CPU time (a shared machine's preemption is in the first only).

Prints a table last and writes it under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dynamic import _cpu_name, commit  # noqa: E402  bench/dynamic.py
from gpu import FirstOutput, make  # noqa: E402  bench/gpu.py

import kiln  # noqa: E402

BLOCK = 100  # calls of one way (runtime) before the next one's


def stats(xs: list[float]) -> tuple[float, float, float, float]:
    s = sorted(xs)
    p50, p99, p999 = s[len(s) // 2], s[int(0.99 * (len(s) - 1))], s[int(0.999 * (len(s) - 1))]
    return p50, p99, p999, p99 / p50


@contextlib.contextmanager
def _pinned():
    """The calling thread on one core for the block (the last it may use: core 0 takes most interrupts): no
    migration between cores."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {max(before)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@contextlib.contextmanager
def _gc_off():
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextlib.contextmanager
def _collected():
    """A full collection before the block: what a serving process's load left in the young generations (objects
    that survived a young pass but were never promoted) goes to the oldest, which young passes do not scan."""
    gc.collect()
    yield


def timed(fn, calls: int, within) -> list[tuple[float, float, float]]:
    """(device ms between CUDA events around the call, host ms until the call returns, host ms until the result
    is synchronized) per call."""
    out = []
    with within():
        for _ in range(calls):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            fn()
            t1 = time.perf_counter()
            b.record()
            b.synchronize()
            t2 = time.perf_counter()
            out.append((a.elapsed_time(b), 1000 * (t1 - t0), 1000 * (t2 - t0)))
    return out


def _context(engine, direct: bool | None):
    """A context of `engine`, its run() path the direct one or the old one (None: the environment's default)."""
    before = os.environ.get("KILN_DIRECT_REPLAY")
    if direct is not None:
        os.environ["KILN_DIRECT_REPLAY"] = "1" if direct else "0"
    try:
        return engine.create_execution_context()
    finally:
        if before is None:
            os.environ.pop("KILN_DIRECT_REPLAY", None)
        else:
            os.environ["KILN_DIRECT_REPLAY"] = before


def measure(name: str, calls: int, ways_set: str = "all") -> list[tuple]:
    """Rows (model, timed, clock, p50, p99, p99.9, p99/p50) of every way, timed in interleaved blocks of BLOCK calls
    (a clock's drift lands on all alike), and a line per way on its slow calls: was the host late with them?"""
    module, inputs, desc = make(name)
    module = FirstOutput(module).eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.onnx")
        names = ["x", "mask"][:len(inputs)]
        torch.onnx.export(module, inputs, path, dynamo=True, input_names=names, output_names=["y"])
        engine = kiln.build(path, device="cuda", precision="fp16")
    ctx = _context(engine, False if ways_set == "direct" else None)
    direct = _context(engine, True)
    os.environ["KILN_REPLAY_CAPTURES_INPUTS"] = "1"  # a third: the inputs' copies captured at their addresses
    in_graph = _context(engine, True)
    os.environ.pop("KILN_REPLAY_CAPTURES_INPUTS")
    feeds = {n: t.cuda() for n, t in zip(names, inputs)}
    for _ in range(100):
        ctx.run(feeds)
        direct.run(feeds)
        in_graph.run(feeds)
    torch.cuda.synchronize()
    old_out, new_out = (next(iter(c.run(feeds).values())).float() for c in (ctx, direct))
    graph_out = next(iter(in_graph.run(feeds).values())).float()
    print(f"{name}: direct path {'taken' if direct._static_replay is not None else 'NOT taken'}; max |direct - old| "
          f"{float((old_out - new_out).abs().max()):.2e}; inputs' graph "
          f"{'captured' if getattr(in_graph._static_replay, 'inputs_graph', None) is not None else 'NOT captured'}, "
          f"max |it - old| {float((old_out - graph_out).abs().max()):.2e}", flush=True)
    entry = next(e for e in ctx.runner.entries.values() if e.graph is not None)
    bound = engine.create_execution_context()  # TensorRT's way: tensors bound once, then execute()
    for n, t in feeds.items():
        bound.set_tensor_address(n, t)
    for _ in range(100):
        bound.execute()
    torch.cuda.synchronize()
    run = lambda: ctx.run(feeds)  # noqa: E731
    run_direct = lambda: direct.run(feeds)  # noqa: E731
    run_in_graph = lambda: in_graph.run(feeds)  # noqa: E731
    ways = {"replay": (entry.graph.replay, contextlib.nullcontext), "run": (run, contextlib.nullcontext),
            "run, static_heap": (run, kiln.static_heap), "run, gc off": (run, _gc_off),
            "run, thread pinned": (run, _pinned), "run, after gc.collect()": (run, _collected),
            "execute (bound)": (bound.execute, contextlib.nullcontext)}
    if ways_set == "direct":
        ways = {"replay": (entry.graph.replay, contextlib.nullcontext), "run (old)": (run, contextlib.nullcontext),
                "run (direct)": (run_direct, contextlib.nullcontext), "run (old), gc off": (run, _gc_off),
                "run (direct), gc off": (run_direct, _gc_off),
                "run (direct, inputs in graph)": (run_in_graph, contextlib.nullcontext),
                "execute (bound)": (bound.execute, contextlib.nullcontext)}
    samples: dict[str, list[tuple[float, float, float]]] = {w: [] for w in ways}
    for _ in range(-(-calls // BLOCK)):
        for way, (fn, within) in ways.items():
            samples[way] += timed(fn, BLOCK, within)
    rows = []
    for way, got in samples.items():
        got = got[:calls]
        device, enqueue, host = ([g[i] for g in got] for i in range(3))
        rows.append((desc, way, "device (events)", *stats(device)))
        rows.append((desc, way, "host (until synced)", *stats(host)))
        slow = [e for d, e, _ in got if d > stats(device)[1]]
        late = stats(enqueue)[1]
        print(f"{desc} {way}: enqueue p50 {stats(enqueue)[0]:.3f} p99 {late:.3f} ms; the {len(slow)} calls above the "
              f"device p99: enqueue median {statistics.median(slow) if slow else float('nan'):.3f} ms, "
              f"{sum(e > late for e in slow)} of them above the enqueue p99", flush=True)
    first_run = next(w for w in ways if w.startswith("run"))
    print(f"{desc}: median {first_run} {statistics.median(d for d, _, _ in samples[first_run]):.3f} ms", flush=True)
    return rows


def measure_cpu(spec: str, calls: int, threads: int, engine_path: str | None) -> list[tuple]:
    """(model shape, timed, clock, p50, p99, p99.9, p99/p50) rows for kiln, kiln in a static heap, onnxruntime."""
    import numpy as np
    import onnxruntime as ort

    from kiln import zoo

    name, shape = spec.split(":")
    batch, seq = (int(d) for d in shape.split("x"))
    exported = zoo.export(name, batch=2, seq=16, dynamic=True)
    engine = kiln.load(engine_path) if engine_path else kiln.build(
        str(exported.path), device="cpu", precision="fp32", profiles=[{"input_ids": "1x1,8x64,8x128"}])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    mask = np.ones((batch, seq), np.int64)
    mask[:, max(1, seq * 3 // 4):] = 0  # a padding mask as a tokenizer gives it
    feeds = {"input_ids": rng.integers(0, zoo.get(name).vocab_size, (batch, seq), dtype=np.int64),
             "attention_mask": mask}
    context = engine.create_execution_context(warm_up=True)
    want = session.run(None, feeds)[0]
    got = context.run(feeds)[engine.output_names[0]]
    error = float(np.abs(got - want).max())
    if error > 1e-3:  # fp32 both sides: two implementations' rounding, 12 layers
        raise SystemExit(f"{spec}: kiln differs from onnxruntime by {error:.2e}")
    runners = {"kiln run": lambda: context.run(feeds), "kiln run, static_heap": lambda: context.run(feeds),
               "onnxruntime": lambda: session.run(None, feeds)}
    for run in runners.values():
        for _ in range(20):
            run()
    times: dict[str, list[tuple[float, float]]] = {n: [] for n in runners}
    for _ in range(-(-calls // BLOCK)):
        for n, run in runners.items():
            with kiln.static_heap() if "static_heap" in n else contextlib.nullcontext():
                for _ in range(BLOCK):
                    w, c = time.perf_counter_ns(), time.thread_time_ns()
                    run()
                    times[n].append(((time.perf_counter_ns() - w) / 1e6, (time.thread_time_ns() - c) / 1e6))
    rows = []
    for n, samples in times.items():
        for i, clock in ((0, "wall"), (1, "thread CPU")):
            rows.append((f"{name} {batch}x{seq}", n, clock, *stats([t[i] for t in samples[:calls]])))
    print(f"{spec}: kiln vs onnxruntime max |diff| {error:.1e}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--models", default=None, help="cuda: resnet50_b1,bert_b1; cpu: zoo model:BxS,...")
    ap.add_argument("--calls", type=int, default=None, help="per timed way (cuda 3000, cpu 2000)")
    ap.add_argument("--threads", type=int, default=1, help="cpu: kiln's and onnxruntime's threads")
    ap.add_argument("--engine", help="cpu: a saved engine of the (one) model, else built with a profile")
    ap.add_argument("--ways", default="all", choices=["all", "direct"], help="cuda: the ways timed (module doc)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
        calls = args.calls or 2000
        rows = []
        for spec in (args.models or "bert_base:1x8,bert_tiny:1x16").split(","):
            rows += measure_cpu(spec, calls, args.threads, args.engine)
        lines = [f"CPU {_cpu_name()}, {args.threads} thread(s), torch {torch.__version__}, commit {commit()}, "
                 f"{calls} calls each, ms, load average {os.getloadavg()[0]:.1f} at the end",
                 "| model | timed | clock | p50 | p99 | p99.9 | p99/p50 |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {d} | {w} | {c} | {a:.3f} | {b:.3f} | {e:.3f} | {r:.2f} |" for d, w, c, a, b, e, r in rows]
        print("\n".join(lines))
        if args.out:
            Path(args.out, "jitter-cpu.md").write_text("\n".join(lines) + "\n")
        return
    args.models = args.models or "resnet50_b1,bert_b1"
    args.calls = args.calls or 3000
    lines = [f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, commit {commit()}, {args.calls} calls "
             f"each, in interleaved blocks of {BLOCK}, ms",
             "| model | timed | clock | p50 | p99 | p99.9 | p99/p50 |", "|---|---|---|---|---|---|---|"]
    for name in args.models.split(","):  # each model's rows written as it finishes (a device call's time limit)
        lines += [f"| {d} | {w} | {c} | {a:.3f} | {b:.3f} | {e:.3f} | {r:.2f} |"
                  for d, w, c, a, b, e, r in measure(name, args.calls, args.ways)]
        torch.cuda.empty_cache()
        print("\n".join(lines), flush=True)
        if args.out:
            Path(args.out, "jitter.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
