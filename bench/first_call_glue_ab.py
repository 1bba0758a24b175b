"""A first call at a new input shape with session 21's glue cuts off (A) and on (B), in one process, shapes
interleaved in pairs (issue 10): the new signature's check from the signature alone (NumpyCheck, else
ExecutionContext._check) and a view's plans and loop objects in one buffer (_PlanRewrite._image_calls, else two
arrays, numpy's .ctypes and ctypes' from_buffer).

    python bench/first_call_glue_ab.py --engine /tmp/bert_base.kiln --seq-to 30

Its loop and rows are bench/first_call_view_trace.py's (first_calls_ab): padding of first calls off, the named
shapes first (one-time costs, left out of the rows), then b 1-3 x s 3..seq-to shuffled, A and B alternating in pairs,
each first call then 3 repeats (bit for bit the first's). Rows, thread CPU µs, median / lower quartile / least.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["KILN_PAD_FIRST_CALLS"] = "0"  # every new shape binds at its first call

import kiln  # noqa: E402  (before torch: kiln sets OpenMP's wait policy)
import numpy as np  # noqa: E402

from first_call_direct import span_timer, warm_context  # noqa: E402  bench/first_call_direct.py
from first_call_view_trace import first_calls_ab, print_rows  # noqa: E402  bench/first_call_view_trace.py
from kiln.runtime import direct_run, native  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True, help="a saved engine with symbolic batch and sequence")
    ap.add_argument("--seq-to", type=int, default=43, help="sequence lengths 3 .. this - 1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--named", default="1x8,2x16,4x64,1x200")
    args = ap.parse_args()
    context = warm_context(args.engine)
    spans, timed = span_timer()
    native.Segment._bind_sizes = timed(native.Segment._bind_sizes, "view")
    direct_run.DirectRuns.bind = timed(direct_run.DirectRuns.bind, "bind")
    check = context._numpy_check
    segment = context.program.lean_steps[0].fn
    kept: dict[int, tuple] = {}

    def cuts(on: bool) -> None:
        context._numpy_check = check if on else None
        rewrite = (segment._grown or segment)._rewrite
        if rewrite is not None:
            if id(rewrite) not in kept:
                kept[id(rewrite)] = rewrite._image_calls
            rewrite._image_calls = kept[id(rewrite)] if on else None

    rng = np.random.default_rng(args.seed)
    named = [tuple(int(v) for v in shape.split("x")) for shape in args.named.split(",")]
    stream = [(b, s) for s in range(3, args.seq_to) for b in (1, 2, 3) if (b, s) not in named]
    rows, _ = first_calls_ab(context, spans, rng, named, stream, cuts)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"# {Path(args.engine).name}: {len(stream)} new shapes (b 1-3 x s 3-{args.seq_to - 1}) after {args.named}; "
          f"1 thread, {cpu}, load average {os.getloadavg()[0]:.1f}")
    print_rows(rows, "A cuts off", "B cuts on")


if __name__ == "__main__":
    main()
