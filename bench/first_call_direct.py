"""A first call at a new input shape bound without a run of the program (DirectRuns.bind) against the general path's
first call, in one process, shapes interleaved (issue 10: a first call's extra over a warm call).

    python bench/first_call_direct.py --engine /tmp/bert_tiny.kiln
    python bench/first_call_direct.py --engine /tmp/bert_base.kiln --seq-to 30

An engine of a BERT-like model (inputs input_ids and attention_mask, symbolic batch and sequence), padding of first
calls off (every new shape binds). Shapes 1x8, 2x16, 4x64, then b 1-3 x s 3..seq-to shuffled; each shape's first
call takes path A (DirectRuns.bind off: the general path, Program.run's loop after the shape function, the segment
binding its view at the call) or B (on: shape values and view made ahead, then one call of the compiled loop), A and
B alternating in pairs, then 3 repeats (the least is the repeat). Both first calls' outputs must equal their
repeats bit for bit. Rows, thread CPU µs, median / lower quartile / least over each path's shapes:

    first call - its repeat                 what issue 10 counts (a difference of two runs: noisy on BERT-base)
    outside the compiled loop, first - repeat   the same less the time inside the native loop's C call (both
                                            runs'): binding and Python only, the part the paths differ in

and B's first call by part (shape values, the view's binding, the input check, the rest: the loop call and glue).
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
import torch  # noqa: E402

from kiln.runtime import context as kiln_context  # noqa: E402
from kiln.runtime import direct_run, native, native_views  # noqa: E402
from kiln.runtime.shape_function import ShapeFunction  # noqa: E402


def _row(name: str, found: list[float]) -> str:
    found = sorted(found)
    return f"| {name} | {len(found)} | {statistics.median(found):.0f} | {found[len(found) // 4]:.0f} | {found[0]:.0f} |"


def warm_context(engine_path: str):
    """One thread; the saved engine's execution context, warmed up (the benches of first calls share it)."""
    torch.set_num_threads(1)
    context = kiln.load(engine_path).create_execution_context()
    context.warm_up()
    return context


def span_timer():
    """(spans, timed): timed(function, name) wraps `function` to add its thread-CPU µs to spans[name]; the compiled
    loop's C call (either path) is wrapped already, as "loop"."""
    spans: dict[str, float] = {}

    def timed(function, name):
        def wrapper(*a, **k):
            start = time.thread_time_ns()
            result = function(*a, **k)
            spans[name] = spans.get(name, 0.0) + (time.thread_time_ns() - start) / 1e3
            return result
        return wrapper

    native._run_loop = timed(native._run_loop, "loop")  # the compiled loop's C call, either path
    native_views._run_loop = timed(native_views._run_loop, "loop")
    return spans, timed


def first_and_repeats(context, spans: dict[str, float], feeds: dict, label: str) -> tuple[float, dict, float, float]:
    """A first call at `feeds`, then 3 repeats, each bit for bit the first call's (else exits, naming `label`):
    (the first call's thread CPU µs, its spans, the least repeat, the least repeat less its time in the loop)."""
    spans.clear()
    start = time.thread_time_ns()
    first_out = context.run(feeds)
    first = (time.thread_time_ns() - start) / 1e3
    got = dict(spans)
    repeats = []
    for _ in range(3):
        spans.clear()
        start = time.thread_time_ns()
        out = context.run(feeds)
        took = (time.thread_time_ns() - start) / 1e3
        repeats.append((took, took - spans.get("loop", 0.0)))
        for name in out:
            if not np.array_equal(out[name], first_out[name]):
                raise SystemExit(f"{label}: a repeat differs from the first call")
    return first, got, min(repeats)[0], min(r[1] for r in repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True, help="a saved engine with symbolic batch and sequence")
    ap.add_argument("--seq-to", type=int, default=43, help="sequence lengths 3 .. this - 1")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    context = warm_context(args.engine)
    spans, timed = span_timer()
    ShapeFunction.__call__ = timed(ShapeFunction.__call__, "shape values")
    native.Segment._bind_sizes = timed(native.Segment._bind_sizes, "view")
    kiln_context.ExecutionContext._check = timed(kiln_context.ExecutionContext._check, "check")
    bind = direct_run.DirectRuns.bind
    on = [True]
    direct_run.DirectRuns.bind = lambda self, signature, arrays: bind(self, signature, arrays) if on[0] else None
    rng = np.random.default_rng(args.seed)
    stream = [(b, s) for s in range(3, args.seq_to) for b in (1, 2, 3) if (b, s) not in ((1, 8), (2, 16))]
    rng.shuffle(stream)
    shapes = [(1, 8), (2, 16), (4, 64)] + stream
    rows = {(path, what): [] for path in "AB" for what in ("first", "outside")}
    parts = {name: [] for name in ("shape values", "view", "check", "rest (the loop call, glue)")}
    named = []
    for k, (batch, seq) in enumerate(shapes):
        on[0] = bool(k % 2) ^ bool((k // 2) % 2)
        path = "B" if on[0] else "A"
        feeds = {"input_ids": rng.integers(0, 1000, (batch, seq)), "attention_mask": np.ones((batch, seq), np.int64)}
        first, got, repeat, repeat_outside = first_and_repeats(context, spans, feeds, f"{batch}x{seq} path {path}")
        rows[path, "first"].append(first - repeat)
        rows[path, "outside"].append(first - got.get("loop", 0.0) - repeat_outside)
        if k < 3:
            named.append(f"{batch}x{seq} ({path}): first {first:.0f}, repeat {repeat:.0f}, extra {first - repeat:.0f}")
        if path == "B":
            parts["shape values"].append(got.get("shape values", 0.0))
            parts["view"].append(got.get("view", 0.0))
            parts["check"].append(got.get("check", 0.0))
            parts["rest (the loop call, glue)"].append(first - sum(got.get(n, 0.0) for n in ("shape values", "view",
                                                                                              "check")))
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"# {Path(args.engine).name}: {len(shapes)} new shapes (1x8, 2x16, 4x64, b 1-3 x s 3-{args.seq_to - 1}), "
          f"1 thread, {cpu}, load average {os.getloadavg()[0]:.1f}")
    print("; ".join(named) + " (µs; the first shapes also pay one-time costs)\n")
    print("| thread CPU µs | shapes | median | lower quartile | least |\n|---|---|---|---|---|")
    for (path, what), found in rows.items():
        label = {"first": "first call - its repeat", "outside": "outside the loop: first - repeat"}[what]
        print(_row(f"{label}, {'A general path' if path == 'A' else 'B bound ahead, run directly'}", found))
    for name, found in parts.items():
        print(_row(f"B's first call: {name}", found))


if __name__ == "__main__":
    main()
