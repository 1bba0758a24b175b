"""attention_key_mask before vs after, beside onnxruntime: an exported BERT's first calls at new shapes and its warm
calls, on the CPU (issue 10). One process, one model: two kiln engines built from the same export, one with the
rule (the exported [B, 1, S, S] mask read as its [B, 1, 1, S] key mask, the index grids gone) and one without it
(kiln.passes.fusion.RULES less attention_key_mask while it builds), and an onnxruntime session of the export.

    python bench/keymask.py --model bert_base              # BERT-base, profile 1x1 / 8x128 / 8x128
    python bench/keymask.py --model minilm --threads 2

1. Warm: at each shape of --shapes (right padding, each row at least half real, row 0 unpadded), the median of
   --warm calls' thread CPU time per runtime, the three interleaved call by call.
2. First calls: bench/dynamic.py's stream of --requests random shapes b 1-max x s 1-max (padding masks), each
   shape new to every runtime; per request the three meet it in a rotating order, then --repeats more calls each
   (bench/first_calls.py's measure_stream): first-call extra = first call - median repeat, median over the stream.
Times: time.thread_time of the calling thread (with 1 thread that is all of each runtime's work; a loaded
machine's preemption is left out, not its cache sharing). Outputs are checked against onnxruntime at real tokens.
"""

from __future__ import annotations

import argparse
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
from first_calls import measure_stream  # noqa: E402

from kiln import zoo  # noqa: E402
from kiln.passes import fusion  # noqa: E402

RULE = "attention_key_mask"


def build(path: str, profile: dict, with_rule: bool):
    saved = fusion.RULES
    if not with_rule:
        fusion.RULES = [(name, rule) for name, rule in saved if name != RULE]
    try:
        start = time.perf_counter()
        engine = kiln.build(path, device="cpu", precision="fp32", profiles=[profile])
        return engine, time.perf_counter() - start
    finally:
        fusion.RULES = saved


def padded(rng, batch: int, seq: int, vocab: int) -> dict[str, np.ndarray]:
    mask = np.ones((batch, seq), np.int64)
    for row in range(1, batch):
        mask[row, rng.integers(max(1, seq // 2), seq + 1):] = 0
    return {"input_ids": rng.integers(0, vocab, (batch, seq), dtype=np.int64), "attention_mask": mask}


def check(feeds, got: dict, want: list, output: str) -> float:
    real = feeds["attention_mask"] != 0
    return float(np.abs(np.asarray(got[output])[real] - want[0][real]).max())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert_base", help="zoo encoder: bert_base, minilm, bert_tiny")
    ap.add_argument("--shapes", default="1x8,2x16,4x32,4x64,8x64,8x128")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warm", type=int, default=7, help="warm calls per shape and runtime (the median is reported)")
    ap.add_argument("--requests", type=int, default=24, help="first calls: random shapes of the stream")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import onnxruntime as ort

    exported = zoo.export(args.model, batch=2, seq=16, dynamic=True)
    path = str(exported.path)
    top = f"{args.max_batch}x{args.max_seq}"
    profile = {"input_ids": f"1x1,{top},{top}"}
    after, after_s = build(path, profile, with_rule=True)
    before, before_s = build(path, profile, with_rule=False)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    output = session.get_outputs()[0].name
    contexts = {"before": before.create_execution_context(), "after": after.create_execution_context()}
    for context in contexts.values():
        context.warm_up()
    runners = {"onnxruntime": lambda r: session.run(None, r), **{k: c.run for k, c in contexts.items()}}
    vocab = zoo.get(args.model).vocab_size

    def timed(run, r) -> tuple[float, float]:  # (thread CPU µs, wall µs)
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        run(r)
        return (time.thread_time_ns() - c0) / 1e3, (time.perf_counter_ns() - w0) / 1e3

    # 2 first (new shapes for everyone), then 1 (the warm shapes are met again only after)
    requests = stream(args.requests, args.max_batch, args.max_seq, vocab, args.seed)
    load0 = os.getloadavg()[0]
    first, second, repeat = measure_stream(requests, runners, timed, args.repeats)
    rng = np.random.default_rng(args.seed + 1)
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    warm: dict[tuple, dict[str, float]] = {}
    errors: dict[str, float] = {"before": 0.0, "after": 0.0}
    for b, s in shapes:
        feeds = padded(rng, b, s, vocab)
        want = session.run(None, feeds)
        for name, context in contexts.items():
            errors[name] = max(errors[name], check(feeds, context.run(feeds), want, output))
            context.run(feeds)
        samples: dict[str, list[float]] = {n: [] for n in runners}
        for _ in range(args.warm):
            for name, run in runners.items():
                samples[name].append(timed(run, feeds)[0])
        warm[(b, s)] = {n: statistics.median(t) / 1e3 for n, t in samples.items()}
    for r in requests[:4]:  # the stream's outputs too
        want = session.run(None, r)
        for name, context in contexts.items():
            errors[name] = max(errors[name], check(r, context.run(r), want, output))

    print(f"# attention_key_mask before/after: {args.model}, cpu ({_cpu_name()}), commit {commit()}, "
          f"{args.threads} thread(s), load average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"builds: after {after_s:.0f} s, before {before_s:.0f} s (profile 1x1 / {top} / {top}); "
          "max |kiln - onnxruntime| "
          f"at real tokens: before {errors['before']:.2e}, after {errors['after']:.2e}")
    for name, engine in (("before", before), ("after", after)):
        steps = engine.plan.program.steps
        ops: dict[str, int] = {}
        for step in steps:
            ops[step.op_type] = ops.get(step.op_type, 0) + 1
        grid = {k: ops[k] for k in ("GatherND", "Range", "Expand", "Concat", "And", "Max") if k in ops}
        print(f"{name}: {len(steps)} steps; mask index-grid steps {grid or 'none'}")
    print("\n## warm, median thread CPU ms per call (right padding, row 0 unpadded)\n")
    print("| shape | onnxruntime | kiln before | kiln after | after / before | after / onnxruntime |")
    print("|---|---|---|---|---|---|")
    for (b, s), t in warm.items():
        print(f"| {b}x{s} | {t['onnxruntime']:.3f} | {t['before']:.3f} | {t['after']:.3f} | "
              f"{t['after'] / t['before']:.2f} | {t['after'] / t['onnxruntime']:.2f} |")
    print(f"\n## first calls at new shapes: {args.requests} requests b 1-{args.max_batch} x s 1-{args.max_seq} "
          f"(seed {args.seed}), thread CPU µs\n")
    print("| runtime | first-call extra, median | second-call extra, median | first calls total ms | "
          "repeats total ms |")
    print("|---|---|---|---|---|")
    for name in runners:
        extra = statistics.median(f[0] - p[0] for f, p in zip(first[name], repeat[name]))
        extra2 = statistics.median(f[0] - p[0] for f, p in zip(second[name], repeat[name]))
        print(f"| {name} | {extra:.0f} | {extra2:.0f} | {sum(f[0] for f in first[name]) / 1e3:.1f} | "
              f"{sum(p[0] for p in repeat[name]) / 1e3:.1f} |")


if __name__ == "__main__":
    main()
