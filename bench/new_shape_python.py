"""What a first call at a new shape costs in Python around the compiled loop (issue 10, bert_tiny-sized models):
bench/results/new-shapes-zen4-2026-12-07d.md.

    python bench/new_shape_python.py --engine /tmp/bert_tiny_8x128.kiln            # all three parts
    PYTHONPATH=/tmp/base python /tmp/base/bench/new_shape_python.py --engine E      # the same from another tree

A saved engine of a BERT-like model (input_ids + attention_mask over symbolic batch x sequence, one native segment
once its shape values are known), 1 thread, the context warmed up; shapes b 1..--max-batch x s 1..--max-seq drawn
without repeats, masks padded at the end (at least half real). Three parts, thread CPU time:

1. "hot": the compiled loop's C call replaced by a no-op (outputs garbage), so consecutive calls find Python's code
   and objects in the caches: each new shape's first call, its second, a repeat (median µs). Padding first calls
   is left on with the binding budget pinned at 0 (every new shape binds: the loop's time, here 0, would
   otherwise make every call pad).
2. "in situ": each new shape's bind done by hand, part by part, right after a real run of the previous shape (the
   caches as a stream leaves them): the signature, its check, the shape values, the view's traced walk and its
   assembly, the record, then the run (median µs each; the clock reads themselves ~1 µs each).
3. "long stream": --long new shapes, each called once (padding on, the default), the calls counted that took the
   general path (Program.run: torch conversions, the loop's steps) instead of a direct call of the loop.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kiln  # noqa: E402  (before torch: kiln sets OpenMP's wait policy)
import numpy as np  # noqa: E402
import torch  # noqa: E402

from kiln.runtime import native_views, program as kiln_program  # noqa: E402
from kiln.runtime.bindings import _numpy_signature  # noqa: E402
from kiln.runtime.cpu_paths import CheckedSignature  # noqa: E402


def shapes_and_feeds(rng, max_batch: int, max_seq: int, count: int) -> list[dict[str, np.ndarray]]:
    shapes = [(b, s) for b in range(1, max_batch + 1) for s in range(1, max_seq + 1)]
    rng.shuffle(shapes)
    feeds = []
    for b, s in shapes[:count]:
        mask = np.ones((b, s), np.int64)
        for row in range(b):
            mask[row, rng.integers((s + 1) // 2, s + 1):] = 0
        feeds.append({"input_ids": rng.integers(0, 1000, (b, s)), "attention_mask": mask})
    return feeds


def context_of(path: str, pad: bool = True):
    context = kiln.load(path).create_execution_context(pad_first_calls=pad)
    context.warm_up()
    return context


def hot(path: str, feeds: list[dict]) -> str:
    context = context_of(path)
    if context._first_calls is not None:
        context._first_calls.budget_ms = lambda: 0.0  # every new shape binds
    loop = native_views._run_loop
    native_views._run_loop = lambda *a, **k: None
    try:
        first, second, repeat = [], [], []
        for f in feeds:
            for into in (first, second, repeat):
                t = time.thread_time_ns()
                context.run(f)
                into.append((time.thread_time_ns() - t) / 1e3)
    finally:
        native_views._run_loop = loop
    return (f"hot Python, loop skipped (median µs of {len(feeds)} shapes): first call {statistics.median(first):.1f}, "
            f"second {statistics.median(second):.1f}, repeat {statistics.median(repeat):.1f}")


def in_situ(path: str, feeds: list[dict]) -> str:
    context = context_of(path, pad=False)
    direct = context._direct
    program, segment = direct.program, direct.segment
    template = segment._grown or segment
    rewrite = template._rewrite
    names = context._input_names
    clock = time.thread_time_ns
    labels = ["numpy signature", "check (NumpyCheck)", "CheckedSignature", "shape values (plan_ahead)", "entry key",
              "traced walk (ViewTrace)", "view assembly (_assembled)", "view kept + record (_make)", "run (record.run)",
              "a repeat's whole call"]
    rows = []
    previous = feeds[0]
    context.run(previous)
    for f in feeds[1:]:
        context.run(previous)  # the previous shape's repeat: the caches as a stream leaves them
        stamps = [clock()]
        key = _numpy_signature(names, f)
        stamps.append(clock())
        profile = context._numpy_check(key)
        stamps.append(clock())
        checked = CheckedSignature.of(key, profile)
        context._checked[key] = checked
        stamps.append(clock())
        arrays, signature = [f[n] for n in names], checked.program_signature
        program.plan_ahead(arrays, signature)
        stamps.append(clock())
        plan = program.shape_plans[signature]
        entry_key = (signature[0][0], tuple(template.entry_sizes[1]), tuple(plan[0][1].shape), signature[1][0],
                     (), ())
        stamps.append(clock())
        whole = rewrite._whole(entry_key)
        stamps.append(clock())
        view = rewrite._assembled(template, entry_key, *whole)
        stamps.append(clock())
        with segment._resize_lock:
            segment.resized[entry_key] = view
        record = direct._make(signature)
        stamps.append(clock())
        record.run(arrays)
        stamps.append(clock())
        context.run(f)
        stamps.append(clock())
        rows.append([(b - a) / 1e3 for a, b in zip(stamps, stamps[1:])])
        previous = f
    parts = [f"{label} {statistics.median(r[i] for r in rows):.1f}" for i, label in enumerate(labels)]
    before = statistics.median(sum(r[:8]) for r in rows)
    return f"in situ (median µs of {len(rows)} shapes): " + "; ".join(parts) + f"; before the run {before:.1f}"


def long_stream(path: str, feeds: list[dict]) -> str:
    context = context_of(path)
    general = [0]
    run = kiln_program.Program.run

    def counting(self, *args, **kwargs):
        general[0] += 1
        return run(self, *args, **kwargs)

    kiln_program.Program.run = counting
    try:
        counts = []
        for k, f in enumerate(feeds):
            if k == 0:
                general[0] = 0  # (the warm-up's runs left out)
            context.run(f)
            if (k + 1) % 100 == 0:
                counts.append(f"{k + 1}: {general[0]}")
    finally:
        kiln_program.Program.run = run
    return (f"long stream ({len(feeds)} new shapes, one call each, padding on; SHAPE_PLANS "
            f"{kiln_program.SHAPE_PLANS}): general-path runs after n calls " + ", ".join(counts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-seq", type=int, default=128)
    ap.add_argument("--shapes", type=int, default=200, help="new shapes for parts 1 and 2")
    ap.add_argument("--long", type=int, default=600, help="new shapes for part 3")
    ap.add_argument("--parts", default="hot,situ,long")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(args.seed)
    print(f"# {Path(args.engine).name}, tree {Path(kiln.__file__).resolve().parents[1]}, 1 thread, "
          f"load {os.getloadavg()[0]:.1f}")
    parts = args.parts.split(",")
    if "hot" in parts:
        print(hot(args.engine, shapes_and_feeds(rng, args.max_batch, args.max_seq, args.shapes)))
    if "situ" in parts:
        print(in_situ(args.engine, shapes_and_feeds(rng, args.max_batch, args.max_seq, args.shapes)))
    if "long" in parts:
        print(long_stream(args.engine, shapes_and_feeds(rng, args.max_batch, args.max_seq, args.long)))
    print(f"# load {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()
