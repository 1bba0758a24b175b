"""First calls of a loaded dynamic engine at classes of sizes the load's view job did not trace (issue 10): the job's
trace_shapes narrowed to batch 2-3 x sequence 9-10 here, so batch 1, sequence 1 and long sequences are classes met
first at a call (as a model whose rules branch past trace_shapes's grid would meet them). B: the call walks with its
rules run plainly and leaves the traces to the background thread (native_views._PlanRewrite._learn_later); A: it
traces them itself (the tree before; _PlanRewrite._ahead off). One process each (--off: A), the shapes in order,
each first call then the background thread waited for; thread CPU µs of the calling thread outside the loop's C
call, and the spans of the view and of the traces made on the calling thread.

    python bench/first_shape_untraced.py --engine /tmp/first/bert_base.kiln [--off]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["KILN_PAD_FIRST_CALLS"] = "0"

import kiln  # noqa: E402,F401  (before torch: kiln sets OpenMP's wait policy)
import numpy as np  # noqa: E402

from first_call_direct import span_timer, warm_context  # noqa: E402
from kiln.runtime import first_calls, native, view_trace  # noqa: E402
from kiln.tactics import traced_rules  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--shapes", default="1x5,1x6,4x1,5x1,3x17,2x100,1x77,6x3")
    ap.add_argument("--off", action="store_true", help="A: a call traces what it misses itself")
    args = ap.parse_args()
    first_calls.trace_shapes = lambda program, profiles: [[(b, s)] * len(program.spec.inputs)
                                                          for b in (2, 3) for s in (9, 10)]
    context = warm_context(args.engine)
    first_calls.primitives_made(300)
    segment = context.program.lean_steps[0].fn
    rewrite = (segment._grown or segment)._rewrite
    if args.off:
        rewrite._ahead = False
    spans, timed = span_timer()
    caller = threading.get_ident()

    def here(function, name):  # spans of the calling thread only (the background thread's traces are not its)
        wrapped = timed(function, name)
        return lambda *a, **k: (wrapped if threading.get_ident() == caller else function)(*a, **k)
    traced_rules.TracedRule._trace = here(traced_rules.TracedRule._trace, "rule traces")
    view_trace.ViewTrace.learn = here(view_trace.ViewTrace.learn, "walk trace")
    native.Segment._bind_sizes = here(native.Segment._bind_sizes, "view")
    rng = np.random.default_rng(0)
    rows: dict[str, list[float]] = {}
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for b, s in shapes:
        feeds = {"input_ids": rng.integers(0, 1000, (b, s)), "attention_mask": np.ones((b, s), np.int64)}
        spans.clear()
        start = time.thread_time_ns()
        context.run(feeds)
        total = (time.thread_time_ns() - start) / 1e3
        for name, value in (("outside the loop", total - spans.get("loop", 0.0)), ("view", spans.get("view", 0.0)),
                            ("rule traces (caller)", spans.get("rule traces", 0.0)),
                            ("walk trace (caller)", spans.get("walk trace", 0.0))):
            rows.setdefault(name, []).append(value)
        rows.setdefault("walk paths right after the call", []).append(rewrite._whole.paths)
        first_calls.primitives_made(30)  # the deferred traces done before the next shape
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"# {'A (traced by the call)' if args.off else 'B (traced on the background thread)'} "
          f"{Path(args.engine).name}, 1 thread, {cpu}, load {os.getloadavg()[0]:.1f}")
    print("| µs | " + " | ".join(f"{b}x{s}" for b, s in shapes) + " |")
    print("|---|" + "---|" * len(shapes))
    for name, values in rows.items():
        print(f"| {name} | " + " | ".join(f"{v:.0f}" for v in values) + " |")


if __name__ == "__main__":
    main()
