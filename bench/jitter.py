"""Where batch-1 jitter comes from on the GPU: the same fixed-shape kiln engine timed five ways.

    python bench/jitter.py [--models resnet50_b1,bert_b1] [--calls 3000] [--out DIR]

A control loop cares about its worst call. For each model (bench/gpu.py's rows: ResNet-50 batch 1,
BERT-base 1 x 128 with its attention mask), after a warm-up, p50 / p99 / p99.9 and p99/p50 of:

- replay:     the captured CUDA graph alone (graph.replay() between CUDA events): the GPU's own spread
- run:        context.run(feeds) between CUDA events, as bench/gpu.py measures it
- run, no gc: the same with Python's garbage collector off (gc.freeze() after warm-up, gc.disable())
- host:       perf_counter around run + synchronize: what a caller waiting on the result sees
- host, no gc: the same with the collector off
- execute (bound): set_tensor_address once, then context.execute() (one graph launch a call), CUDA events and host

Prints a table last and writes it under --out.
"""

from __future__ import annotations

import argparse
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
from gpu import FirstOutput, make  # noqa: E402  bench/gpu.py

import kiln  # noqa: E402


def events(fn, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def host(fn, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def stats(xs: list[float]) -> tuple[float, float, float, float]:
    s = sorted(xs)
    p50, p99, p999 = s[len(s) // 2], s[int(0.99 * (len(s) - 1))], s[int(0.999 * (len(s) - 1))]
    return p50, p99, p999, p99 / p50


def measure(name: str, calls: int) -> list[tuple]:
    module, inputs, desc = make(name)
    module = FirstOutput(module).eval()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.onnx")
        names = ["x", "mask"][:len(inputs)]
        torch.onnx.export(module, inputs, path, dynamo=True, input_names=names, output_names=["y"])
        engine = kiln.build(path, device="cuda", precision="fp16")
    ctx = engine.create_execution_context()
    feeds = {n: t.cuda() for n, t in zip(names, inputs)}
    for _ in range(100):
        ctx.run(feeds)
    torch.cuda.synchronize()
    entry = next(e for e in ctx.runner.entries.values() if e.graph is not None)
    rows = [(desc, "replay", *stats(events(entry.graph.replay, calls))),
            (desc, "run", *stats(events(lambda: ctx.run(feeds), calls))),
            (desc, "host", *stats(host(lambda: ctx.run(feeds), calls)))]
    bound = engine.create_execution_context()  # TensorRT's way: tensors bound once, then execute()
    for n, t in feeds.items():
        bound.set_tensor_address(n, t)
    for _ in range(100):
        bound.execute()
    torch.cuda.synchronize()
    rows += [(desc, "execute (bound)", *stats(events(bound.execute, calls))),
             (desc, "execute (bound), host", *stats(host(bound.execute, calls)))]
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        rows.append((desc, "run, no gc", *stats(events(lambda: ctx.run(feeds), calls))))
        rows.append((desc, "host, no gc", *stats(host(lambda: ctx.run(feeds), calls))))
    finally:
        gc.enable()
        gc.unfreeze()
    for r in rows:
        print(r, flush=True)
    print(f"{desc}: median run {statistics.median(events(lambda: ctx.run(feeds), 200)):.3f} ms", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet50_b1,bert_b1")
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    rows = []
    for name in args.models.split(","):
        rows += measure(name, args.calls)
        torch.cuda.empty_cache()
    lines = [f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.calls} calls each, ms",
             "| model | timed | p50 | p99 | p99.9 | p99/p50 |", "|---|---|---|---|---|---|"]
    lines += [f"| {d} | {w} | {a:.3f} | {b:.3f} | {c:.3f} | {r:.2f} |" for d, w, a, b, c, r in rows]
    print("\n".join(lines))
    if args.out:
        Path(args.out, "jitter.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
