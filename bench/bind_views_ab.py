"""A/B of a native segment's views at new shapes in one process: another revision's kiln/runtime/native_views.py
(`git show REV:...`, loaded as a module of its own) binds engine A's views, this tree's binds engine B's.

    python bench/bind_views_ab.py --engine-a /tmp/main.kiln --engine-b /tmp/branch.kiln --against main

Both engines run one stream of new shapes (BERT-like inputs input_ids and attention_mask; b 1-2 x s 3-62, shuffled,
padding of first calls off), each shape on A and B back to back, the order flipped every shape, so both see the
same load and the same cold caches after a run. Thread CPU time of the shape values (ShapeFunction), of binding the
view (Segment._bind_sizes, in the stream: cold), of binding it again with the views dropped (--hot passes,
interleaved: hot) and of the first call minus its repeat. Only native_views.py differs between A and B (what it
imports is this tree's: a revision whose native_views needs another kiln/runtime/view_arguments.py is not comparable
this way), so it measures a change to views (and, with two engines, one built by each tree: their graphs).
On a shared machine this is steadier than alternating processes: load moves both sides alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["KILN_PAD_FIRST_CALLS"] = "0"  # every new shape binds at its first call

import kiln  # noqa: E402  (before torch: kiln sets OpenMP's wait policy)
import numpy as np  # noqa: E402
import torch  # noqa: E402

from kiln.runtime import native  # noqa: E402
from kiln.runtime.shape_function import ShapeFunction  # noqa: E402

ROWS = ("shape values", "_bind_sizes (cold, in the stream)", "_bind_sizes again (hot)", "first call - its repeat")


def _views_module(revision: str):
    """kiln/runtime/native_views.py at `revision`, imported as a module of its own."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:kiln/runtime/native_views.py"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "native_views_other.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("kiln.runtime.native_views_other", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine-a", required=True, help="bound by --against's native_views")
    ap.add_argument("--engine-b", required=True, help="bound by this tree's (may be the same file as A)")
    ap.add_argument("--against", default="main", help="the revision whose native_views binds A")
    ap.add_argument("--hot", type=int, default=2, help="passes binding every view again, hot")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    other = _views_module(args.against)
    engines = [kiln.load(args.engine_a), kiln.load(args.engine_b)]
    segments = [e.program.segments[0] for e in engines]
    segments[0]._rewrite = other._PlanRewrite(segments[0])  # as Segment._rewritten makes it, from the other module
    contexts = [e.create_execution_context() for e in engines]
    for c in contexts:
        c.warm_up()
    side = {id(s): i for i, s in enumerate(segments)}
    side_of_function = {id(e.program.shape_function): i for i, e in enumerate(engines)}
    times = {(i, row): [] for i in range(2) for row in ROWS}

    shape_values = ShapeFunction.__call__

    def timed_shape_values(self, env):
        start = time.thread_time_ns()
        shape_values(self, env)
        times[side_of_function[id(self)], ROWS[0]].append((time.thread_time_ns() - start) / 1e3)

    bind_sizes = native.Segment._bind_sizes
    bound: list[tuple[native.Segment, tuple]] = []

    def timed_bind_sizes(self, key):
        if key in self.resized:
            return bind_sizes(self, key)
        bound.append((self, key))
        start = time.thread_time_ns()
        found = bind_sizes(self, key)
        times[side[id(self)], ROWS[1]].append((time.thread_time_ns() - start) / 1e3)
        return found

    ShapeFunction.__call__, native.Segment._bind_sizes = timed_shape_values, timed_bind_sizes
    rng = np.random.default_rng(args.seed)
    shapes = [(b, s) for s in range(3, 63) for b in (1, 2)]
    rng.shuffle(shapes)
    for n, (b, s) in enumerate(shapes):
        feeds = {"input_ids": rng.integers(0, 1000, (b, s)), "attention_mask": np.ones((b, s), np.int64)}
        for i in (0, 1) if n % 2 == 0 else (1, 0):
            calls = []
            for _ in range(2):  # the first call at the shape (it binds), then a repeat
                start = time.thread_time_ns()
                contexts[i].run(feeds)
                calls.append((time.thread_time_ns() - start) / 1e3)
            times[i, ROWS[3]].append(calls[0] - calls[1])
    for segment, module in zip(segments, (other.__name__, "kiln.runtime.native_views")):
        if not all(type(v).__module__ == module for v in segment.resized.values()):  # None: the layers ran one by one
            raise RuntimeError(f"a view of {segment} was not bound by {module}")
    for _ in range(args.hot):
        for j in range(0, len(bound), 2):  # the stream's pairs, A and B back to back
            for segment, key in bound[j:j + 2]:
                segment.resized.pop(key, None)
                start = time.thread_time_ns()
                bind_sizes(segment, key)
                times[side[id(segment)], ROWS[2]].append((time.thread_time_ns() - start) / 1e3)
    print(f"# A: {Path(args.engine_a).name} bound by {args.against}'s native_views; B: {Path(args.engine_b).name} by "
          f"this tree's; {len(shapes)} new shapes, 1 thread, load average {os.getloadavg()[0]:.1f}\n")
    print("| thread CPU, µs: median / lower quartile / least | A | B | B - A, medians |\n|---|---|---|---|")
    for row in ROWS:
        cells, medians = [], []
        for i in range(2):
            found = sorted(times[i, row])
            medians.append(statistics.median(found))
            cells.append(f"{medians[-1]:.0f} / {found[len(found) // 4]:.0f} / {found[0]:.0f}")
        print(f"| {row} | {cells[0]} | {cells[1]} | {medians[1] - medians[0]:+.0f} |")


if __name__ == "__main__":
    main()
