"""Where a decoder's first call at a new shape takes its minor page faults (issue 10, session 27 h-touch1): getrusage
minor faults of the calling thread per call, split into the compiled loops' C calls (native._run_loop and
native_views._run_loop: the segments' kernels writing their exits, the user's logits among them), the mask Wheres'
rewritten launches (RewrittenLaunch.__call__, kiln's kernels outside segments), the largest exit of a loop call
(by bytes: which tensor's pages a loop's faults are) and the rest (Python, the shape function, the views, torch's
allocations and copies outside the loop). Each new shape's first call, then its repeat; thread CPU µs beside.

    python bench/first_touch.py --engine /tmp/llama3/llama_tiny_wide.kiln
    MALLOC_TRIM_THRESHOLD_=268435456 MALLOC_MMAP_THRESHOLD_=33554432 python bench/first_touch.py --engine ...

Prints one row per call and a summary: faults per first call by part, and the loop's µs per fault (first calls
against their repeats, pairs whose fault counts differ by 50 or more).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["KILN_PAD_FIRST_CALLS"] = "0"

import kiln  # noqa: E402,F401
import numpy as np  # noqa: E402

from first_call_direct import warm_context  # noqa: E402
from kiln.runtime import first_calls, native, native_views  # noqa: E402
from kiln.tactics.cpu import native_member  # noqa: E402

SHAPES = "3x5,5x33,6x41,7x47,8x53,5x59,6x61,7x37,8x45,5x50,6x29,8x38,7x60"


def faults() -> int:
    """This thread's minor page faults so far."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--shapes", default=SHAPES)
    args = ap.parse_args()
    context = warm_context(args.engine)
    first_calls.primitives_made(120)
    now: dict[str, float] = {}

    def counted(function, name):
        def wrapper(*a, **k):
            f0, t0 = faults(), time.thread_time_ns()
            result = function(*a, **k)
            now[name] = now.get(name, 0) + faults() - f0
            now[name + " µs"] = now.get(name + " µs", 0) + (time.thread_time_ns() - t0) / 1e3
            return result
        return wrapper

    native._run_loop = counted(native._run_loop, "loop")
    native_views._run_loop = counted(native_views._run_loop, "loop")
    native_member.RewrittenLaunch.__call__ = counted(native_member.RewrittenLaunch.__call__, "Wheres")
    rng = np.random.default_rng(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    names = context.engine.input_names
    rows = []
    for shape in shapes:
        feeds = {"input_ids": rng.integers(0, 1000, shape), "attention_mask": np.ones(shape, np.int64)}
        feeds = {k: v for k, v in feeds.items() if k in names}
        for which in ("first", "repeat"):
            now.clear()
            f0, t0 = faults(), time.thread_time_ns()
            out = context.run(feeds)
            total, us = faults() - f0, (time.thread_time_ns() - t0) / 1e3
            largest = max(out.values(), key=lambda v: v.nbytes)
            rows.append((shape, which, total, now.get("loop", 0), now.get("Wheres", 0),
                         total - now.get("loop", 0) - now.get("Wheres", 0), largest.nbytes / 4096, us,
                         now.get("loop µs", 0)))
            del out, largest
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    env = os.environ.get
    print(f"# {Path(args.engine).name}, 1 thread, {cpu}, load {os.getloadavg()[0]:.1f}, MALLOC_TRIM_THRESHOLD_="
          f"{env('MALLOC_TRIM_THRESHOLD_')} MALLOC_MMAP_THRESHOLD_={env('MALLOC_MMAP_THRESHOLD_')}")
    print("| shape | call | faults | in the loops | in the Wheres | rest | the output's pages | µs | loops µs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape, *values in rows:
        print(f"| {'x'.join(map(str, shape))} | " + " | ".join(v if isinstance(v, str) else f"{v:.0f}" for v in values)
              + " |")
    firsts = [r for r in rows if r[1] == "first"][1:]  # (3x5: the first new shape of all, other costs)
    print(f"first calls after the first ({len(firsts)}), median faults: total "
          f"{statistics.median(r[2] for r in firsts):.0f}, loops {statistics.median(r[3] for r in firsts):.0f}, "
          f"Wheres {statistics.median(r[4] for r in firsts):.0f}, rest {statistics.median(r[5] for r in firsts):.0f}; "
          f"sums {sum(r[2] for r in firsts)}, {sum(r[3] for r in firsts)}, {sum(r[4] for r in firsts)}, "
          f"{sum(r[5] for r in firsts)}")
    per = [(a[8] - b[8]) / (a[3] - b[3]) for a, b in zip(rows[::2], rows[1::2]) if abs(a[3] - b[3]) >= 50]
    if per:
        print(f"loop µs per fault (first - repeat over their faults, {len(per)} pairs): "
              f"median {statistics.median(per):.2f}")


if __name__ == "__main__":
    main()
