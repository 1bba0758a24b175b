"""Where a first call's extra over a warm call goes, part by part (issue 10): thread-CPU spans around each part of a
first call at a new input shape, and the same run's repeat, on an engine of a BERT-like model.

    python bench/first_call_parts.py --engine /tmp/bert_base.kiln
    python bench/first_call_parts.py --engine /tmp/convnext_tiny.kiln --image 3x64x64 --named 1x1,1x2,1x8,1x16

Padding of first calls off (every new shape binds: DirectRuns.bind, then one call of the compiled loop). After
warm_up and two throw-away shapes (3x5, 2x7: one-time costs), the shapes 1x8, 2x16, 4x64, 1x200 (--named) one by one,
then --shapes more of b 1-3 x s 3-39 shuffled; each first call, then 3 repeats (the least is the repeat). Rows (µs):
first - repeat; of it inside the loop's C call and outside it; the context's check (ExecutionContext._check, or
NumpyCheck where the signature alone passes), the shape values (the generated ShapeFunction), the view
(Segment._bind_sizes: _PlanRewrite.view, its rules, its call image, a traced walk's function), DirectRuns._make (the
view included) and DirectRuns.bind (shape values, view, record).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["KILN_PAD_FIRST_CALLS"] = "0"  # every new shape binds at its first call

import kiln  # noqa: E402  (before torch: kiln sets OpenMP's wait policy)
import numpy as np  # noqa: E402

from kiln.runtime import bindings, context as kiln_context  # noqa: E402
from first_call_direct import span_timer, warm_context  # noqa: E402  bench/first_call_direct.py
from kiln.runtime import direct_run, native, native_views, view_trace  # noqa: E402
from kiln.runtime.shape_function import ShapeFunction  # noqa: E402
from kiln.tactics import traced_rules  # noqa: E402

PARTS = [  # (owner, attribute, name): inclusive spans, nested ones indented
    (kiln_context.ExecutionContext, "_check", "check"),
    *([(bindings.NumpyCheck, "__call__", "check from the signature (NumpyCheck)")]
      if hasattr(bindings, "NumpyCheck") else []),  # a tree before it (A/B runs of this script on both)
    (ShapeFunction, "__call__", "shape values"),
    (direct_run.DirectRuns, "bind", "DirectRuns.bind"),
    (direct_run.DirectRuns, "_make", "DirectRuns._make"),
    (native.Segment, "_bind_sizes", "view"),
    (native_views._PlanRewrite, "view", "  _PlanRewrite.view"),
    (traced_rules.TracedRule, "at", "    rules (TracedRule.at)"),
    (view_trace.ViewTrace, "__call__", "    traced walk (ViewTrace)"),
    (native_views._CallImage, "at", "    call image (_CallImage.at)"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True, help="a saved engine with symbolic batch and sequence")
    ap.add_argument("--named", default="1x8,2x16,4x64,1x200")
    ap.add_argument("--shapes", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--image", default="", help="CxHxW: an image model's pixel_values at new batches (--named and "
                    "the shapes are then batches: 1x8 is batch 8, the stream batches 1 to --max-batch)")
    ap.add_argument("--max-batch", type=int, default=32)
    args = ap.parse_args()
    context = warm_context(args.engine)
    spans, timed = span_timer()
    for owner, attribute, name in PARTS:
        setattr(owner, attribute, timed(getattr(owner, attribute), name))
    rng = np.random.default_rng(args.seed)

    def run(batch, seq, feeds):
        spans.clear()
        start = time.thread_time_ns()
        out = context.run(feeds)
        return (time.thread_time_ns() - start) / 1e3, dict(spans), out

    image = tuple(int(v) for v in args.image.split("x")) if args.image else None

    def feeds_at(batch, seq):
        if image is not None:  # a batch of `seq` images (the 1 of --named's 1xB, the stream's 1)
            return {"pixel_values": rng.standard_normal((seq, *image)).astype(np.float32)}
        return {"input_ids": rng.integers(0, 1000, (batch, seq)), "attention_mask": np.ones((batch, seq), np.int64)}

    throwaway = [(1, 3), (1, 5)] if image is not None else [(3, 5), (2, 7)]
    for batch, seq in throwaway:
        run(batch, seq, feeds_at(batch, seq))
    named = [tuple(int(v) for v in shape.split("x")) for shape in args.named.split(",")]
    stream = [(1, s) for s in range(1, args.max_batch + 1) if (1, s) not in named + throwaway] if image is not None \
        else [(b, s) for s in range(3, 40) for b in (1, 2, 3) if (b, s) not in named + throwaway]
    rng.shuffle(stream)
    columns: list[tuple[str, dict[str, float]]] = []
    stream_rows: dict[str, list[float]] = {}
    for k, (batch, seq) in enumerate(named + stream[:args.shapes]):
        feeds = feeds_at(batch, seq)
        first, got, first_out = run(batch, seq, feeds)
        repeats = [run(batch, seq, feeds) for _ in range(3)]
        for _, _, out in repeats:
            for name in out:
                if not np.array_equal(out[name], first_out[name]):
                    raise SystemExit(f"{batch}x{seq}: a repeat differs from the first call")
        repeat = min(r[0] for r in repeats)
        inside = got.get("loop", 0.0) - min(r[1].get("loop", 0.0) for r in repeats)
        row = {"first call - its repeat": first - repeat, "inside the loop's C call": inside,
               "outside it": first - repeat - inside, **{name: got.get(name, 0.0) for _, _, name in PARTS}}
        if k < len(named):
            columns.append((f"{batch}x{seq}", row))
        else:
            for name, value in row.items():
                stream_rows.setdefault(name, []).append(value)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"# {Path(args.engine).name}: first calls at new shapes, 1 thread, {cpu}, load average "
          f"{os.getloadavg()[0]:.1f}; median (lower quartile) of {len(stream_rows.get('outside it', []))} more shapes")
    print("| µs | " + " | ".join(name for name, _ in columns) + " | median (lq) |")
    print("|---|" + "---|" * (len(columns) + 1))
    for name in stream_rows:
        found = sorted(stream_rows[name])
        print(f"| {name} | " + " | ".join(f"{row[name]:.0f}" for _, row in columns)
              + f" | {statistics.median(found):.0f} ({found[len(found) // 4]:.0f}) |")


if __name__ == "__main__":
    main()
