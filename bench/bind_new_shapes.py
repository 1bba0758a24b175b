"""Binding a native segment at input sizes it has not seen (issue 10's first-call cost), without the rest of a call.

    python bench/bind_new_shapes.py --engine /tmp/bert_base.kiln         # BERT-base: b 1-2 x s 3-62, 120 new shapes

An engine of a BERT-like model (inputs input_ids and attention_mask, symbolic batch and sequence) runs a stream of
shapes it has never bound, padding of first calls off, so each call binds its shape: Segment._bind_sizes (every
member's NativeStep at the new sizes, `_natives_at`, then the view over the template, `_Resized`) is timed in
the calling thread's CPU time. Also the objects the garbage collector tracks that each new shape leaves behind
(views, the layers' per-size kernels): what makes its full passes come more often. For an A/B, run it from each
tree in turn (interleaved) and compare the least and the lower quartile: on a shared machine the medians move
more between runs than the change.

    python bench/bind_new_shapes.py --engine E --path replan    # every view bound member by member (no _PlanRewrite)
    python bench/bind_new_shapes.py --engine E --hot 3          # then every shape's view bound again, 3 passes, hot

--hot N: after the stream, the segment's views dropped and bound again from its sizes alone (Segment._bind_sizes, no
run between: caches warm), N passes over the shapes: binding's own Python and oneDNN calls without a run's cold caches
(a first call in a stream pays ~2-3x this).

--path rewrite (the runtime's default) writes the plans of kiln's own kernels by arithmetic (_PlanRewrite); --path
replan turns that off in this process, so the two ways run from one tree (interleave the runs).
"""

from __future__ import annotations

import argparse
import gc
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

from kiln.runtime import native, native_views  # noqa: E402
from kiln.runtime.shape_function import ShapeFunction  # noqa: E402
from kiln.tactics.tactic import resizable  # noqa: E402
from kiln.tactics.traced_rules import TracedRule  # noqa: E402


def _timing(owner: type, name: str, into: list[float], only_new: bool = False) -> None:
    """Wrap owner.name to append each call's thread CPU time (µs) to `into` (only_new: only keys not bound yet)."""
    original = getattr(owner, name)

    def timed(self, *args):
        if only_new and args[0] in self.resized:
            return original(self, *args)
        start = time.thread_time_ns()
        result = original(self, *args)
        into.append((time.thread_time_ns() - start) / 1e3)
        return result

    setattr(owner, name, timed)


def _timed(function, into: list[float]):
    """`function` appending each call's thread CPU time (µs) to `into`."""

    def timed(*args, **kwargs):
        start = time.thread_time_ns()
        result = function(*args, **kwargs)
        into.append((time.thread_time_ns() - start) / 1e3)
        return result

    return timed


def _op_timers(namespace: dict) -> dict[str, list[float]]:
    """Each function a generated shape function calls (its namespace: helpers `_x`, steps' ops `fN`) wrapped to
    append its calls' thread CPU µs to a list named after it (rows "  shape op NAME", summed per new shape)."""
    found: dict[str, list[float]] = {}
    for name, value in list(namespace.items()):
        if callable(value) and not name.startswith("__") and (name.startswith("_") or name[1:].isdigit()) \
                and not name.startswith("_memo"):
            into = found.setdefault(f"  shape op {getattr(value, '__name__', name)}", [])
            namespace[name] = _timed(value, into)
    return found


def _recording(into: list) -> None:
    """Wrap Segment._bind_sizes to append (segment, sizes) of each sizes not bound yet to `into`."""
    original = native.Segment._bind_sizes

    def recorded(self, key):
        if key not in self.resized:
            into.append((self, key))
        return original(self, key)

    native.Segment._bind_sizes = recorded


def _bind_again(bind_sizes, bound: list[tuple[native.Segment, tuple]], passes: int) -> list[float]:
    """Thread CPU µs of binding each (segment, sizes) again by `bind_sizes` (Segment._bind_sizes), its view dropped
    first, `passes` times."""
    found = []
    for _ in range(passes):
        for segment, key in bound:
            segment.resized.pop(key, None)
            start = time.thread_time_ns()
            bind_sizes(segment, key)
            found.append((time.thread_time_ns() - start) / 1e3)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True, help="a saved engine with symbolic batch and sequence")
    ap.add_argument("--max-batch", type=int, default=2)
    ap.add_argument("--seq", type=int, nargs=2, default=(3, 63), help="sequence lengths [from, to)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--path", choices=("rewrite", "replan"), default="rewrite")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hot", type=int, default=0, help="passes binding every shape's view again, hot (0: none)")
    ap.add_argument("--parts", action="store_true",
                    help="also time the rewrite's parts and the shape function's calls by what they call (their "
                         "timers add to the totals: leave off for an A/B)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.path == "replan":
        native.Segment._rewritten = lambda self, key: None  # every view by _natives_at and _Resized.bound_at
    engine = kiln.load(args.engine)
    context = engine.create_execution_context()
    context.warm_up()
    rows = ("first call - its repeat", "shape values (ShapeFunction)", "_bind_sizes", "  _rewritten",
            "    rules (once per layer shape)", "    at() of members without a rule",
            "    _rebound (those members' calls)", "  _natives_at", "  _view")
    times: dict[str, list[float]] = {name: [] for name in rows}
    _timing(ShapeFunction, "__call__", times["shape values (ShapeFunction)"])
    bind_sizes = native.Segment._bind_sizes  # unwrapped, for --hot
    _timing(native.Segment, "_bind_sizes", times["_bind_sizes"], only_new=True)
    bound: list[tuple[native.Segment, tuple]] = []  # (segment, sizes) of every view the stream bound
    _recording(bound)
    _timing(native.Segment, "_rewritten", times["  _rewritten"])
    _timing(native.Segment, "_natives_at", times["  _natives_at"])
    _timing(native.Segment, "_view", times["  _view"])
    per_call: dict[str, list[float]] = {name: [] for name in ("    rules (once per layer shape)",  # summed per shape
                                                              "    at() of members without a rule",
                                                              "    _rebound (those members' calls)")}
    if args.parts and args.path == "rewrite":  # inside _PlanRewrite.view only (_natives_at, _view call them too)
        _timing(TracedRule, "__call__", per_call["    rules (once per layer shape)"])  # traced answers or the rule
        _timing(resizable, "__call__", per_call["    at() of members without a rule"])
        native_views._rebound = _timed(native_views._rebound, per_call["    _rebound (those members' calls)"])
    if args.parts:  # the shape function's calls, by what they call (a step's op, or a helper of the generator)
        if engine.program.shape_function is not None:
            per_call.update(_op_timers(engine.program.shape_function.fn.__globals__))
    rng = np.random.default_rng(args.seed)
    shapes = [(b, s) for s in range(*args.seq) for b in range(1, args.max_batch + 1)]
    gc.collect()
    tracked = len(gc.get_objects())
    for batch, seq in shapes:
        feeds = {"input_ids": rng.integers(0, 1000, (batch, seq)), "attention_mask": np.ones((batch, seq), np.int64)}
        calls = []
        for _ in range(2):  # the first call at the shape (it binds), then a repeat
            start = time.thread_time_ns()
            context.run(feeds)
            calls.append((time.thread_time_ns() - start) / 1e3)
        times["first call - its repeat"].append(calls[0] - calls[1])
        for name, found in per_call.items():
            if found:
                times.setdefault(name, []).append(sum(found))
                found.clear()
    gc.collect()
    kept = (len(gc.get_objects()) - tracked) / len(shapes)
    if args.hot:
        streamed = {name: len(found) for name, found in times.items()}
        hot = _bind_again(bind_sizes, bound, args.hot)
        for name, count in streamed.items():  # the parts' timers saw the hot passes too: the stream's rows only
            del times[name][count:]
        times["_bind_sizes, hot"] = hot
    print(f"# binding new shapes: {Path(args.engine).name}, {len(shapes)} shapes, {args.threads} thread(s), "
          f"--path {args.path}, load average {os.getloadavg()[0]:.1f}")
    print(f"objects tracked by the garbage collector kept per new shape: {kept:.0f}\n")
    print("Rules, at() and _rebound are summed per new shape where marked; rows below _bind_sizes are its parts. "
          "A repeat binds nothing: the first row is what a first call adds (noisy: it is a difference of two runs).\n")
    print("| thread CPU, µs | calls | median | lower quartile | least |\n|---|---|---|---|---|")
    for name, found in times.items():
        if not found:
            continue
        found.sort()
        print(f"| {name} | {len(found)} | {statistics.median(found):.0f} | {found[len(found) // 4]:.0f} | "
              f"{found[0]:.0f} |")


if __name__ == "__main__":
    main()
