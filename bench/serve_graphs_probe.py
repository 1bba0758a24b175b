"""Issue 14: what a served BERT call costs the GPU against its bucket's bare graph replay, outside the server.

    python bench/serve_graphs_probe.py                       # BERT-base fp16, batch 1..64 x seq 128 (bench/serve.py's)
    python bench/serve_graphs_probe.py --model bert_tiny --device cpu --max-batch 16 --calls 5   # a smoke run
    python bench/serve_graphs_probe.py --bucket-steps        # issue 14: pow2 vs half batch buckets (then stops)

One execution context as a served instance makes it (kiln/serve/instances.py: buckets default, warm_up twice), then:
1. what warm-up captured: each graph's input shapes and its replay time measured at capture (the buckets' costs,
   what a batch split decides on), the eager signatures and why;
2. per batch size, `calls` calls of context.run as the spin path makes them (numpy in, numpy out: the inputs' copy
   to the GPU, the padded fill, the replay, the outputs' cast and copy to pageable host memory) and as device
   tensors in and out (no host copies): wall ms, the span on the stream (CUDA events), the graph counts per call
   (replays, captures, eager runs, splits: GraphStats before/after) and the span over the bucket's bare replay;
   and (issue 14, bench/gpu_s31d.sh) the same context's numpy calls through its host staging (kiln/runtime/
   host_staging.py: pinned buffers of the context, one async copy each way, one wait with the GIL released):
   "staged" (outputs copied out into fresh arrays) and "staged-pinned" (arrays over pinned blocks), their outputs
   checked bitwise against the pageable path's, and each mode's thread CPU ms per call;
3. two contexts on two threads and two streams at once (two served instances), at each of --pair-batches rows: for
   every feed mode (device in/out; numpy in/out today, pageable both ways; numpy in / device out and device in /
   numpy out, one pageable direction each; staged; staged-pinned), calls/s of the two together against one alone
   (together / alone: 2.00 is full overlap, 1.00 none), each call's wall, span and thread CPU ms.
Medians of `calls` calls each. A table per step on stdout. No server, no network.

--bucket-steps (issue 14, bench/gpu_s32a.sh) instead: two contexts, batch_buckets "pow2" and "half" (kiln/runtime/
buckets.py: also 12, 24, 48 between the powers of two), each warmed up as an instance's; per context its warm-up's
seconds, graphs and their MiB; each batch bucket's replay ms at capture side by side; then per batch size (--batches,
default 9..16, 20, 24, 28, 40, 48) how each context runs it (its bucket, or the split's chunks) and the call's wall
and span, device tensors in and out (the GPU's time, no host copies) and numpy (as the spin path), pow2 and half
interleaved over --rounds rounds; medians, and half's span over pow2's.
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


# feed modes: (feeds on the device?, the context's host staging, outputs then copied to numpy by the caller?)
MODES = {
    "device": ("all", "off", False),  # device tensors in, the context's device outputs: no host copy
    "numpy": ("none", "off", False),  # numpy in/out today: pageable H2D (_to_runtime) and D2H (tensor.cpu())
    "numpy in, device out": ("mask", "off", False),  # ids pageable H2D; the mask a device tensor: torch out
    "device in, numpy out": ("all", "off", True),  # device in; each output then .cpu() (pageable D2H) as _to_user
    "staged": ("none", "copy", False),  # numpy in/out through the context's pinned buffers, fresh arrays out
    "staged-pinned": ("none", "pinned", False),  # the same, arrays over pinned blocks handed over (no host copy)
}


def _mode_feeds(feeds: dict, mode: str, device: str) -> dict:
    on_device = MODES[mode][0]
    if on_device == "none":
        return feeds
    return {n: torch.from_numpy(v).to(device) if on_device == "all" or n == "attention_mask" else v
            for n, v in feeds.items()}


def _time_calls(context, feeds, calls: int, cuda: bool, to_numpy: bool = False) -> dict:
    """`calls` timed calls (after 3 untimed): medians of wall ms, span ms and the thread's CPU ms, graph counts per
    call. `to_numpy`: each output then copied to numpy as the runtime's pageable path does (kiln/ir/dtypes.py)."""
    from kiln.ir.dtypes import torch_to_numpy

    for _ in range(3):
        out = context.run(feeds)
    if cuda:
        torch.cuda.current_stream().synchronize()  # this thread's stream only: the other context's runs go on
    walls, spans, cpus = [], [], []
    before = _counts(context)
    for _ in range(calls):
        start = end = None
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0, c0 = time.perf_counter(), time.thread_time()
        out = context.run(feeds)
        if to_numpy:
            out = {n: torch_to_numpy(v) for n, v in out.items()}
        if cuda:
            end.record()
            end.synchronize()  # numpy out: already done; device tensors out: the run's kernels
            spans.append(start.elapsed_time(end))
        walls.append((time.perf_counter() - t0) * 1e3)
        cpus.append((time.thread_time() - c0) * 1e3)
    after = _counts(context)
    del out
    per_call = [(a - b) / calls for a, b in zip(after, before)]
    return {"wall": statistics.median(walls), "wall_spread": (min(walls), max(walls)),
            "span": statistics.median(spans) if spans else float("nan"), "cpu": statistics.median(cpus),
            "counts": per_call}


def _same_outputs(context, feeds: dict, mode: str) -> bool:
    """The context's numpy outputs under host staging `mode`: bitwise those of its pageable path (the same replay)."""
    context.host_staging = "off"
    want = context.run(feeds)
    want = {n: v.copy() for n, v in want.items()}
    context.host_staging = mode
    got = context.run(feeds)
    context.host_staging = "off"
    return all(type(got[n]) is np.ndarray and got[n].dtype == w.dtype and got[n].shape == w.shape
               and got[n].tobytes() == w.tobytes() for n, w in want.items())


def _pair(contexts, streams, feeds: dict, mode: str, calls: int, device: str) -> tuple[dict, list[dict], float, float]:
    """One context alone, then both at once on two threads and two streams, in feed `mode`: (alone's timing, each
    context's timing together, calls/s alone, calls/s together)."""
    _, staging, to_numpy = MODES[mode]
    for c in contexts:
        c.host_staging = staging
    feeds = _mode_feeds(feeds, mode, device)
    results: list[dict | None] = [None, None]
    for c, stream in zip(contexts, streams):  # a context's first staged call makes its pinned buffers: not timed
        with torch.cuda.stream(stream):
            c.run(feeds)
        stream.synchronize()

    def serve(k: int) -> None:
        with torch.cuda.stream(streams[k]):
            results[k] = _time_calls(contexts[k], feeds, calls, True, to_numpy)

    t = time.perf_counter()
    serve(0)
    alone = results[0]
    alone_rate = (calls + 3) / (time.perf_counter() - t)
    t = time.perf_counter()
    threads = [threading.Thread(target=serve, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    together = 2 * (calls + 3) / (time.perf_counter() - t)
    for c in contexts:
        c.host_staging = "off"
    return alone, results, alone_rate, together


STEPS_BATCHES = "9,10,11,12,13,14,16,20,24,28,40,48"


def _bucket_steps(engine, args, cuda: bool) -> None:
    """--bucket-steps: pow2 against half batch buckets, one context each (module docstring)."""
    contexts = {}
    for steps in ("pow2", "half"):
        t = time.perf_counter()
        context = engine.create_execution_context(host_staging="off", buckets=True, batch_buckets=steps)
        context.warm_up()
        context.warm_up()
        took = time.perf_counter() - t
        stats = context.runner.stats if context.runner is not None else None
        print(f"{steps}: batch buckets {context.buckets.sizes('batch', 1, args.max_batch)}; warm-up (twice) "
              f"{took:.1f} s" + (f"; {stats.graphs} graphs, {stats.graph_bytes / 2**20:.1f} MiB of graphs, "
                                 f"{stats.captures} captures, {stats.evictions} evictions" if stats else ""), flush=True)
        contexts[steps] = context
    costs = {steps: next(iter(c.buckets.costs.values()), {}) for steps, c in contexts.items()}
    print("\n1. replay ms at capture per batch bucket (seq %d)" % args.seq)
    print("| batch bucket | pow2 ms | half ms |")
    print("|---|---|---|")
    for bucket in sorted(set(contexts["half"].buckets.sizes("batch", 1, args.max_batch))
                         | set(contexts["pow2"].buckets.sizes("batch", 1, args.max_batch))):
        cells = [f"{costs[s][bucket]:.3f}" if bucket in costs[s] else "-" for s in ("pow2", "half")]
        print(f"| {bucket} | {' | '.join(cells)} |")
    rng = np.random.default_rng(0)
    kinds = ["device", "numpy"] if cuda else ["numpy"]
    batches = [int(b) for b in (args.batches or STEPS_BATCHES).split(",") if int(b) <= args.max_batch]
    spans: dict[tuple[int, str, str], list[float]] = {}
    walls: dict[tuple[int, str, str], list[float]] = {}
    print(f"\n2. calls, {args.calls} each after 3, pow2 and half interleaved over {args.rounds} round(s)")
    print("| batch | feeds | round | buckets | runs as | replay ms of that | wall ms | span ms | replays/call | "
          "splits/call |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for batch in batches:
        host = _feeds(rng, batch, args.seq, None)
        for round_ in range(args.rounds):
            for kind in kinds:
                for steps, context in contexts.items():
                    b = context.buckets
                    targets = b.targets(list(host.values()), engine.profiles[0], engine.input_names)
                    chunks = b.split(targets) or [(batch, targets["batch"][1])]
                    runs_as = " + ".join(str(size) for _, size in chunks)
                    known = [costs[steps].get(size) for _, size in chunks]
                    replay = f"{sum(known):.3f}" if known and None not in known else "-"
                    r = _time_calls(context, _mode_feeds(host, kind, args.device), args.calls, cuda)
                    spans.setdefault((batch, kind, steps), []).append(r["span"])
                    walls.setdefault((batch, kind, steps), []).append(r["wall"])
                    c = r["counts"]
                    print(f"| {batch} | {kind} | {round_ + 1} | {steps} | {runs_as} | {replay} | {r['wall']:.3f} | "
                          f"{r['span']:.3f} | {c[0]:.2f} | {c[3]:.2f} |", flush=True)
    print("\n3. medians over the rounds: half / pow2 (below 1.00: half is faster)")
    print("| batch | feeds | pow2 wall ms | half wall ms | half / pow2 wall | pow2 span ms | half span ms | "
          "half / pow2 span |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in batches:
        for kind in kinds:
            w = [statistics.median(walls[(batch, kind, s)]) for s in ("pow2", "half")]
            sp = [statistics.median(spans[(batch, kind, s)]) for s in ("pow2", "half")]
            print(f"| {batch} | {kind} | {w[0]:.3f} | {w[1]:.3f} | {w[1] / w[0]:.2f} | {sp[0]:.3f} | {sp[1]:.3f} | "
                  f"{sp[1] / sp[0]:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bert_base")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--precision", default="fp16")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--batches", default=None, help="batch sizes of step 2, comma-separated (default 1,4,8,12,16,24,"
                    f"32,64; with --bucket-steps {STEPS_BATCHES})")
    ap.add_argument("--bucket-steps", action="store_true",
                    help="compare pow2 and half batch buckets (module docstring) instead of steps 1-3")
    ap.add_argument("--pair-batches", default="12,64", help="rows per call of step 3, comma-separated (0: skip it)")
    ap.add_argument("--pair-modes", default=";".join(MODES), help="step 3's feed modes, separated by \";\"")
    ap.add_argument("--rounds", type=int, default=2, help="step 3 (--bucket-steps: step 2): every mode this many times, "
                    "modes interleaved")
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("serve_graphs_probe.py: --device cuda, but torch sees no CUDA device here (torch "
                 f"{torch.__version__}); for a CPU smoke run: --model bert_tiny --device cpu --max-batch 16 --calls 5")
    t = time.perf_counter()
    exported = zoo.export(args.model, dynamic=True, batch=2)
    shape = f"x{args.seq}"
    engine = kiln.build(str(exported.path), device=args.device,
                        **({"precision": args.precision} if cuda else {}),
                        profiles=[{"input_ids": f"1{shape},{args.max_batch}{shape},{args.max_batch}{shape}"}])
    print(f"== {args.model} {args.precision if cuda else 'fp32'} on {torch.cuda.get_device_name() if cuda else 'cpu'}"
          f", batch 1..{args.max_batch} x seq {args.seq}; export + build {time.perf_counter() - t:.1f} s", flush=True)

    if args.bucket_steps:
        _bucket_steps(engine, args, cuda)
        return
    context = engine.create_execution_context(host_staging="off")
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
    kinds = ["numpy", "device", "staged", "staged-pinned"] if cuda else ["numpy"]
    print("\n2. calls: batch | bucket | feeds | wall ms (min-max) | span ms | bucket replay ms | span / replay "
          "| thread CPU ms | replays/call | captures/call | eager/call | splits/call | outputs = numpy's")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for batch in [int(b) for b in (args.batches or "1,4,8,12,16,24,32,64").split(",") if int(b) <= args.max_batch]:
        bucket = min((b for b in costs if b >= batch), default=None)
        replay = costs.get(bucket) if bucket else None
        host = _feeds(rng, batch, args.seq, None)
        for kind in kinds:
            _, staging, _ = MODES[kind]
            same = _same_outputs(context, host, staging) if staging != "off" else "-"
            context.host_staging = staging
            r = _time_calls(context, _mode_feeds(host, kind, args.device), args.calls, cuda)
            context.host_staging = "off"
            c = r["counts"]
            ratio = f"{r['span'] / replay:.2f}" if replay and r["span"] == r["span"] else "-"
            print(f"| {batch} | {bucket or '-'} | {kind} | {r['wall']:.3f} ({r['wall_spread'][0]:.3f}-"
                  f"{r['wall_spread'][1]:.3f}) | {r['span']:.3f} | {replay if replay is None else f'{replay:.3f}'} "
                  f"| {ratio} | {r['cpu']:.3f} | {c[0]:.2f} | {c[1]:.2f} | {c[2]:.2f} | {c[3]:.2f} | {same} |",
                  flush=True)

    pair_batches = [int(b) for b in args.pair_batches.split(",") if 0 < int(b) <= args.max_batch]
    if cuda and pair_batches:
        modes = [m.strip() for m in args.pair_modes.split(";") if m.strip()]
        unknown = [m for m in modes if m not in MODES]
        if unknown:
            sys.exit(f"--pair-modes: unknown {unknown}; known: {', '.join(MODES)}")
        contexts = [context, engine.create_execution_context(host_staging="off")]
        contexts[1].warm_up()
        contexts[1].warm_up()
        streams = [torch.cuda.Stream() for _ in contexts]
        calls = args.calls * 3
        print(f"\n3. two contexts, two threads, two streams at once (as two served instances; each context warmed up "
              f"alone first), {calls} calls each after 3, modes interleaved over {args.rounds} round(s); together / "
              "alone: 2.00 = full overlap, 1.00 = none")
        print("| rows | feeds | round | alone calls/s | together calls/s | together / alone | alone wall ms | "
              "alone CPU ms | ctx 0 wall ms | ctx 1 wall ms | ctx 0 span ms | ctx 0 CPU ms | replays/call |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for rows in pair_batches:
            feeds = _feeds(rng, rows, args.seq, None)
            for round_ in range(args.rounds):
                for mode in modes:
                    alone, both, alone_rate, together = _pair(contexts, streams, feeds, mode, calls, args.device)
                    print(f"| {rows} | {mode} | {round_ + 1} | {alone_rate:.0f} | {together:.0f} | "
                          f"{together / alone_rate:.2f} | {alone['wall']:.3f} | {alone['cpu']:.3f} | "
                          f"{both[0]['wall']:.3f} | {both[1]['wall']:.3f} | {both[0]['span']:.3f} | "
                          f"{both[0]['cpu']:.3f} | {both[0]['counts'][0]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
