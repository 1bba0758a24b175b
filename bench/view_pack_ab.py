"""In-process A/B of a view's assembly at new shapes (issue 10, kiln/runtime/view_pack.py): one saved engine loaded
twice in one process, A's segment rewrites without the pack (main's numpy copy and stores: _PlanRewrite._packed None),
B's with it; first calls at the same new shapes (--shapes of them drawn from 1..8 x 1..64 past the plans made at load)
alternate A and B, the order flipped every shape. Per first call: thread-CPU µs of the views (Segment._bind_sizes
summed) and outside the loop (first - repeat, less the loop's own difference); medians, lower quartiles, and the
median of paired B/A ratios of the views.

    python bench/view_pack_ab.py --engine /tmp/llama3/llama_tiny_wide.kiln --shapes 80
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["KILN_PAD_FIRST_CALLS"] = "0"

import numpy as np  # noqa: E402

from first_call_direct import span_timer, warm_context  # noqa: E402
from kiln.runtime import first_calls, native  # noqa: E402


def rewrites(context) -> list:
    return [(s.fn._grown or s.fn)._rewrite for s in context.engine.program.lean_steps
            if isinstance(s.fn, native.Segment) and (s.fn._grown or s.fn)._rewrite is not None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--shapes", type=int, default=80)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    a = warm_context(args.engine)
    first_calls.primitives_made(120)
    b = warm_context(args.engine)
    first_calls.primitives_made(120)
    for rewrite in rewrites(a):
        rewrite._packed = None
    assert rewrites(b) and all(r._packed is not None for r in rewrites(b)), "B's views are not packed"
    spans, timed = span_timer()
    native.Segment._bind_sizes = timed(native.Segment._bind_sizes, "view")
    rng = np.random.default_rng(args.seed)
    planned = {key[0][0] for key in a.engine.program.shape_plans}
    shapes = [(n, s) for n in range(1, 9) for s in range(1, 65) if (n, s) not in planned]
    rng.shuffle(shapes)
    views: dict[str, list[float]] = {"A": [], "B": []}
    outside: dict[str, list[float]] = {"A": [], "B": []}
    for i, shape in enumerate(shapes[:args.shapes]):
        for name, context in ((("A", a), ("B", b)) if i % 2 == 0 else (("B", b), ("A", a))):
            feeds = {"input_ids": rng.integers(0, 1000, shape), "attention_mask": np.ones(shape, np.int64)}
            feeds = {k: v for k, v in feeds.items() if k in context.engine.input_names}
            times = []
            for _ in range(2):  # the first call, then a repeat
                spans.clear()
                start = time.thread_time_ns()
                context.run(feeds)
                times.append(((time.thread_time_ns() - start) / 1e3, dict(spans)))
            (first, got), (repeat, again) = times
            views[name].append(got.get("view", 0.0))
            outside[name].append(first - repeat - got.get("loop", 0.0) + again.get("loop", 0.0))
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"# {Path(args.engine).name}, 1 thread, {cpu}, load {os.getloadavg()[0]:.2f}, {args.shapes} new shapes")
    print("| µs, median (lower quartile) | views | outside the loop |\n|---|---|---|")
    for name in "AB":
        print(f"| {name} | {statistics.median(views[name]):.0f} ({np.percentile(views[name], 25):.0f}) | "
              f"{statistics.median(outside[name]):.0f} ({np.percentile(outside[name], 25):.0f}) |")
    ratios = [y / x for x, y in zip(views["A"], views["B"]) if x > 0]
    print(f"| B / A views (median of paired ratios) | {statistics.median(ratios):.3f} | |")


if __name__ == "__main__":
    main()
