"""Issue 14: what a served BERT call costs the GPU against its bucket's bare graph replay, outside the server.

    python bench/serve_graphs_probe.py                       # BERT-base fp16, batch 1..64 x seq 128 (bench/serve.py's)
    python bench/serve_graphs_probe.py --model bert_tiny --device cpu --max-batch 16 --calls 5   # a smoke run

One execution context as a served instance makes it (kiln/serve/instances.py: buckets default, warm_up twice), then:
1. what warm-up captured: each graph's input shapes and its replay time measured at capture (the buckets' costs,
   what a batch split decides on), the eager signatures and why;
2. per batch size, `calls` calls of context.run as the spin path makes them (numpy in, numpy out: the inputs' copy
   to the GPU, the padded fill, the replay, the outputs' cast and copy to pageable host memory) and as device
   tensors in and out (no host copies): wall ms, the span on the stream (CUDA events), the graph counts per call
   (replays, captures, eager runs, splits: GraphStats before/after) and the span over the bucket's bare replay;
3. two contexts on two threads and two streams at once (two served instances), each at --pair-batch rows, numpy
   in and out: calls/s together against one alone, and each call's span (the other's kernels inside it).
Medians of `calls` calls each. A table per step on stdout. No server, no network.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
import kiln  # noqa: E402
from kiln import zoo  # noqa: E402


def _counts(context) -> tuple[int, int, int, int]:
    s = context.runner.stats if context.runner is not None else None
    return (s.replays, s.captures, s.eager_runs, s.split_runs) if s is not None else (0, 0, 0, 0)


def _feeds(rng, batch: int, seq: int, device: str | None) -> dict:
    ids = rng.integers(0, 1000, (batch, seq)).astype(np.int64)
    mask = np.ones((batch, seq), np.int64)
    feeds = {"input_ids": ids, "attention_mask": mask}
    return {n: torch.from_numpy(v).to(device) for n, v in feeds.items()} if device else feeds


def _label(key) -> str:
    return ",".join("x".join(map(str, item[0])) for item in key if isinstance(item, tuple) and len(item) == 2
                    and isinstance(item[0], tuple))


def _time_calls(context, feeds, calls: int, cuda: bool, stream=None) -> dict:
    """`calls` timed calls (after 3 untimed): medians of wall ms and span ms, graph counts per call."""
    for _ in range(3):
        out = context.run(feeds)
    if cuda:
        torch.cuda.synchronize()
    walls, spans = [], []
    before = _counts(context)
    for _ in range(calls):
        start = end = None
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        out = context.run(feeds)
        if cuda:
            end.record()
            end.synchronize()  # numpy out: already done; device tensors out: the run's kernels
            spans.append(start.elapsed_time(end))
        walls.append((time.perf_counter() - t0) * 1e3)
    after = _counts(context)
    del out
    per_call = [(a - b) / calls for a, b in zip(after, before)]
    return {"wall": statistics.median(walls), "wall_spread": (min(walls), max(walls)),
            "span": statistics.median(spans) if spans else float("nan"), "counts": per_call}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bert_base")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--precision", default="fp16")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--batches", default="1,4,8,12,16,24,32,64")
    ap.add_argument("--pair-batch", type=int, default=12, help="rows per call of step 3 (0: skip it)")
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    t = time.perf_counter()
    exported = zoo.export(args.model, dynamic=True, batch=2)
    shape = f"x{args.seq}"
    engine = kiln.build(str(exported.path), device=args.device,
                        **({"precision": args.precision} if cuda else {}),
                        profiles=[{"input_ids": f"1{shape},{args.max_batch}{shape},{args.max_batch}{shape}"}])
    print(f"== {args.model} {args.precision if cuda else 'fp32'} on {torch.cuda.get_device_name() if cuda else 'cpu'}"
          f", batch 1..{args.max_batch} x seq {args.seq}; export + build {time.perf_counter() - t:.1f} s", flush=True)

    context = engine.create_execution_context()
    t = time.perf_counter()
    context.warm_up()
    context.warm_up()
    print(f"warm-up (twice, as an instance's) {time.perf_counter() - t:.1f} s; runner stats "
          f"{context.runner.stats.to_json() if context.runner is not None else None}")
    if context.runner is not None:
        print("\n1. graphs after warm-up: input shapes | replay ms at capture | eager reason")
        for key, entry in context.runner.entries.items():
            ms = "-" if entry.ms is None else f"{entry.ms:.3f}"
            print(f"| {_label(key)} | {ms} | {entry.reason if entry.graph is None else ''} |")
    if context.buckets is not None:
        print(f"buckets: symbols {context.buckets.symbols}, split symbol {context.buckets.batch}, "
              f"costs (ms) {context.buckets.costs}")

    rng = np.random.default_rng(0)
    costs = next(iter(context.buckets.costs.values()), {}) if context.buckets is not None else {}
    print("\n2. calls: batch | bucket | feeds | wall ms (min-max) | span ms | bucket replay ms | span / replay "
          "| replays/call | captures/call | eager/call | splits/call")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for batch in [int(b) for b in args.batches.split(",") if int(b) <= args.max_batch]:
        bucket = min((b for b in costs if b >= batch), default=None)
        replay = costs.get(bucket) if bucket else None
        for kind, device in (("numpy", None), ("device", args.device if cuda else None)):
            if kind == "device" and not cuda:
                continue
            r = _time_calls(context, _feeds(rng, batch, args.seq, device), args.calls, cuda)
            c = r["counts"]
            ratio = f"{r['span'] / replay:.2f}" if replay and r["span"] == r["span"] else "-"
            print(f"| {batch} | {bucket or '-'} | {kind} | {r['wall']:.3f} ({r['wall_spread'][0]:.3f}-"
                  f"{r['wall_spread'][1]:.3f}) | {r['span']:.3f} | {replay if replay is None else f'{replay:.3f}'} "
                  f"| {ratio} | {c[0]:.2f} | {c[1]:.2f} | {c[2]:.2f} | {c[3]:.2f} |", flush=True)

    if cuda and args.pair_batch:
        print(f"\n3. two contexts, two threads, two streams at once, {args.pair_batch} rows a call, numpy in and out "
              "(as two served instances; each context warmed up alone first)")
        contexts = [context, engine.create_execution_context()]
        contexts[1].warm_up()
        contexts[1].warm_up()
        streams = [torch.cuda.Stream() for _ in contexts]
        feeds = _feeds(rng, args.pair_batch, args.seq, None)
        results: list[dict | None] = [None, None]

        def serve(k: int) -> None:
            with torch.cuda.stream(streams[k]):
                results[k] = _time_calls(contexts[k], feeds, args.calls * 3, True)

        with torch.cuda.stream(streams[0]):
            alone = _time_calls(contexts[0], feeds, args.calls * 3, True)
        t = time.perf_counter()
        threads = [threading.Thread(target=serve, args=(k,)) for k in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        together = time.perf_counter() - t
        print("| run | wall ms/call | span ms/call | calls/s | replays/call | eager/call |")
        print("|---|---|---|---|---|---|")
        print(f"| one context alone | {alone['wall']:.3f} | {alone['span']:.3f} | {1e3 / alone['wall']:.0f} "
              f"| {alone['counts'][0]:.2f} | {alone['counts'][2]:.2f} |")
        for k, r in enumerate(results):
            print(f"| context {k} of two | {r['wall']:.3f} | {r['span']:.3f} | - | {r['counts'][0]:.2f} "
                  f"| {r['counts'][2]:.2f} |")
        print(f"| both (3 warm + {args.calls * 3} calls each) | - | - | {2 * (args.calls * 3 + 3) / together:.0f} | - | - |")


if __name__ == "__main__":
    main()
