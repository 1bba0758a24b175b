"""execute() with a bound output, in one process: A copies every bound output after the run (the run's own fresh
output, then bound.copy_), B lets the layer computing it write the caller's tensor (ExecutionContext._outputs_into).
The caller holds one output buffer of the largest shape's output, touched before the calls, and binds a contiguous
view of it per shape (bindings outside the timed call).

First calls: the engine loaded twice (A's context and B's), warmed, the background jobs done; at each new shape both
make their first call, in alternating order, then 3 repeats each; thread CPU µs and minor faults of each first call.
Steady: one more context, each shape bound once, then rounds of shuffled (shape, side) calls; median µs per shape and
the median of paired B / A per round.

    python bench/execute_into_ab.py --engine /tmp/outplace/llama_tiny_wide.kiln
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["KILN_PAD_FIRST_CALLS"] = "0"

import numpy as np  # noqa: E402
import torch  # noqa: E402

from first_call_direct import warm_context  # noqa: E402
from first_touch import SHAPES  # noqa: E402
from kiln.runtime import first_calls  # noqa: E402
from kiln.runtime.context import ExecutionContext  # noqa: E402

IN_PLACE = ExecutionContext._outputs_into


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


class Caller:
    """A context called through execute(), its output a view of one touched buffer; `in_place` picks A or B."""

    def __init__(self, context, shapes: list[tuple[int, ...]]):
        self.context = context
        self.output = context.engine.outputs[0]
        self.tail = tuple(self.output.shape[len(shapes[0]):])
        self.held = torch.zeros(max(math.prod(s) for s in shapes) * math.prod(self.tail))

    def call(self, feeds: dict[str, np.ndarray], in_place: bool) -> tuple[float, int]:
        context = self.context
        for name, value in feeds.items():
            context.set_tensor_address(name, torch.from_numpy(value))
        size = (*next(iter(feeds.values())).shape, *self.tail)
        context.set_tensor_address(self.output.name, self.held[:math.prod(size)].view(size))
        ExecutionContext._outputs_into = IN_PLACE if in_place else (lambda self: None)
        f0, t0 = faults(), time.thread_time_ns()
        context.execute()
        return (time.thread_time_ns() - t0) / 1e3, faults() - f0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--steady", default="2x8,4x33,8x53,8x64", help="shapes of the steady A/B")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    steady = [tuple(int(v) for v in s.split("x")) for s in args.steady.split(",")]
    a, b = Caller(warm_context(args.engine), shapes + steady), Caller(warm_context(args.engine), shapes + steady)
    first_calls.primitives_made(300)
    names = a.context.engine.input_names

    def feeds(shape):
        made = {"input_ids": rng.integers(0, 1000, shape), "attention_mask": np.ones(shape, np.int64)}
        return {k: v for k, v in made.items() if k in names}

    firsts = {"A": [], "B": []}
    for k, shape in enumerate(shapes):
        f = feeds(shape)
        order = (("A", a, False), ("B", b, True)) if k % 2 == 0 else (("B", b, True), ("A", a, False))
        for side, caller, in_place in order:
            us, fl = caller.call(f, in_place)
            repeat = min(caller.call(f, in_place)[0] for _ in range(3))
            firsts[side].append((us, fl, repeat))
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"# {Path(args.engine).name}, execute(), 1 thread, {cpu}, load {os.getloadavg()[0]:.1f}; A copies the "
          f"bound output, B writes it in place")
    print("| first calls (the first of all left out) | A | B | B / A, median of pairs |\n|---|---|---|---|")
    for j, what in enumerate(("first call µs", "minor faults", "best repeat µs")):
        va, vb = [r[j] for r in firsts["A"][1:]], [r[j] for r in firsts["B"][1:]]
        ratio = statistics.median(y / x for x, y in zip(va, vb) if x) if j != 1 else float("nan")
        print(f"| {what} (median) | {statistics.median(va):.0f} | {statistics.median(vb):.0f} | {ratio:.3f} |")

    c = Caller(warm_context(args.engine), steady)
    first_calls.primitives_made(300)
    f = {shape: feeds(shape) for shape in steady}
    for shape in steady:
        c.call(f[shape], True)
    times: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        order = [(shape, side) for shape in steady for side in (False, True)]
        rng.shuffle(order)
        for shape, side in order:
            times.setdefault((shape, side), []).append(c.call(f[shape], bool(side))[0])
    print(f"\n| steady, {args.rounds} rounds (load {os.getloadavg()[0]:.1f}) | A µs | B µs | B / A (paired median) |")
    print("|---|---|---|---|")
    for shape in steady:
        ta, tb = times[shape, False], times[shape, True]
        print(f"| {'x'.join(map(str, shape))} | {statistics.median(ta):.0f} | {statistics.median(tb):.0f} | "
              f"{statistics.median(y / x for x, y in zip(ta, tb)):.3f} |")


if __name__ == "__main__":
    main()
