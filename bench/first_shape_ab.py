"""Later first calls at new shapes of a loaded dynamic engine, A against B in one process (issue 10): the engine
loaded twice, A as the tree was before a change (--a-without names what A's load leaves out), B as it is, then
first calls at new shapes, each shape on A and B in shuffled order (new to both; the other engine's run before
each cools the caches as a stream's previous request does). Thread CPU µs of the calling thread outside the loop's
C call (the whole call less its loop), and the spans of the shape values (ShapeFunction) and the view
(Segment._bind_sizes); medians, lower quartiles and the median of B / A per pair.

    python bench/first_shape_ab.py --engine /tmp/first/bert_base.kiln --pairs 60 --a-without memos

--a-without memos: A's view job fills no shape-function memos (first_calls.memo_shapes empty while its job runs);
grid-rows: A's index grids cut each corner by a copy (shape_function._GridBase's rows and corners dropped after load).
Shapes: batch x sequence inside the profile (8 x 256 for /tmp/first's engines), at most --tokens tokens (short
loops), none of the view job's trace_shapes (each engine's first call at each is a first call of the walk, not of
the traces) unless --traced.
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

import kiln  # noqa: E402,F401  (before torch: kiln sets OpenMP's wait policy)
import numpy as np  # noqa: E402

from first_call_direct import span_timer, warm_context  # noqa: E402
from kiln.runtime import first_calls, native, shape_function  # noqa: E402
from kiln.runtime.shape_function import ShapeFunction  # noqa: E402

def _no_grid_rows(context) -> None:
    """The shape function's grids cut each corner by a copy, as before _GridBase's rows (their corners dropped)."""
    for value in context.program.shape_function.fn.__globals__.values():
        base = getattr(value, "_base", None)
        if type(value).__name__ == "_Grid" and base is not None:
            base._corners.clear()
            base._row_bytes = shape_function.GRID_ROWS_BYTES


WITHOUT = {  # what A leaves out: (owner, attribute, its value during A's load) or a function of A's context after
    "memos": (first_calls, "memo_shapes", lambda program, profiles: []),
    "grid-rows": _no_grid_rows,
}


def load(path: str, without: list[str]):
    """A warmed context whose load's background jobs ran with `without`'s parts left out."""
    patches = [WITHOUT[w] for w in without if isinstance(WITHOUT[w], tuple)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        context = warm_context(path)
        if not first_calls.primitives_made(300):
            raise SystemExit("the load's background jobs did not finish in 300 s")
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
    for w in without:
        if not isinstance(WITHOUT[w], tuple):
            WITHOUT[w](context)
    return context


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--a-without", default="memos", help=f"comma-separated, of {sorted(WITHOUT)}")
    ap.add_argument("--pairs", type=int, default=60)
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--traced", action="store_true", help="shapes of trace_shapes allowed too")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    without = [w for w in args.a_without.split(",") if w]
    a = load(args.engine, without)
    b = load(args.engine, [])
    spans, timed = span_timer()
    native.Segment._bind_sizes = timed(native.Segment._bind_sizes, "view")
    ShapeFunction.__call__ = timed(ShapeFunction.__call__, "shape values")
    rng = np.random.default_rng(args.seed)
    small = set(range(1, first_calls.TRACE_SMALL + 1)) | {1 << k for k in range(12)}
    shapes = [(bb, s) for bb in range(1, args.batch + 1) for s in range(1, args.seq + 1)
              if bb * s <= args.tokens and (args.traced or s not in small)]
    rng.shuffle(shapes)
    shapes = shapes[:args.pairs]
    rows: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
    ratios = []
    for bb, s in shapes:  # the same new shape on both, in shuffled order
        order = [("A", a), ("B", b)]
        rng.shuffle(order)
        feeds = {"input_ids": rng.integers(0, 1000, (bb, s)), "attention_mask": np.ones((bb, s), np.int64)}
        got = {}
        for name, context in order:
            spans.clear()
            start = time.thread_time_ns()
            context.run(feeds)
            total = (time.thread_time_ns() - start) / 1e3
            outside = total - spans.get("loop", 0.0)
            got[name] = outside
            for part, value in (("outside the loop", outside), ("shape values", spans.get("shape values", 0.0)),
                                ("view", spans.get("view", 0.0))):
                rows[name].setdefault(part, []).append(value)
        ratios.append(got["B"] / got["A"])
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"# {Path(args.engine).name}, 1 thread, {cpu}, load {os.getloadavg()[0]:.1f} (end), {len(ratios)} pairs; "
          f"A without {without or 'nothing'}, B as the tree is")
    print("| µs, median (lower quartile) | A | B |\n|---|---|---|")
    for part in rows["A"]:
        cells = []
        for name in ("A", "B"):
            found = sorted(rows[name][part])
            cells.append(f"{statistics.median(found):.0f} ({found[len(found) // 4]:.0f})")
        print(f"| {part} | " + " | ".join(cells) + " |")
    print(f"| B / A per pair (outside the loop), median | {statistics.median(ratios):.3f} | |")


if __name__ == "__main__":
    main()
