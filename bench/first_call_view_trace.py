"""A first call at a new input shape with its segment's view made by the template's walk (A) against the walk's traced
closed forms (B, kiln/runtime/view_trace.py), in one process, shapes interleaved in pairs (issue 10).

    python bench/first_call_view_trace.py --engine /tmp/bert_base.kiln --seq-to 30

An engine of a BERT-like model (inputs input_ids and attention_mask, symbolic batch and sequence), padding of first
calls off (every new shape binds, through DirectRuns.bind: one call of the compiled loop). Shapes 1x8, 2x16, 4x64,
1x200 (--named), then b 1-3 x s 3..seq-to shuffled; each shape's first call takes path A (ViewTrace off: no path answers, none
is learned) or B (on: views on a traced path are one call; a view off every path is walked, then traced), A and B
alternating in pairs, then 3 repeats (the least is the repeat). Both first calls' outputs must equal their repeats
bit for bit. Rows, thread CPU µs, median / lower quartile / least over each path's shapes:

    first call - its repeat                     what issue 10 counts (a difference of two runs: noisy on BERT-base)
    outside the loop: first - repeat            the same less the time inside the native loop's C call (both runs'):
                                                binding and Python only, the part the paths differ in
    the view (Segment._bind_sizes)              the view's binding alone
    the binding (DirectRuns.bind)               shape values, the view, the record
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

from first_call_direct import _row, first_and_repeats, span_timer, warm_context  # noqa: E402  bench/first_call_direct.py
from kiln.runtime import direct_run, native, view_trace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True, help="a saved engine with symbolic batch and sequence")
    ap.add_argument("--seq-to", type=int, default=43, help="sequence lengths 3 .. this - 1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--named", default="1x8,2x16,4x64,1x200", help="the first shapes, reported one by one (bert_tiny's "
                    "positions end at 128: 1x8,2x16,4x64)")
    args = ap.parse_args()
    context = warm_context(args.engine)
    spans, timed = span_timer()
    native.Segment._bind_sizes = timed(native.Segment._bind_sizes, "view")
    direct_run.DirectRuns.bind = timed(direct_run.DirectRuns.bind, "bind")
    answer, learn = view_trace.ViewTrace.__call__, view_trace.ViewTrace.learn
    on = [True]  # path B: ViewTrace answers and learns
    view_trace.ViewTrace.__call__ = lambda self, key: answer(self, key) if on[0] else None
    view_trace.ViewTrace.learn = lambda self, *a: learn(self, *a) if on[0] else False
    rng = np.random.default_rng(args.seed)
    named = [tuple(int(v) for v in shape.split("x")) for shape in args.named.split(",")]
    stream = [(b, s) for s in range(3, args.seq_to) for b in (1, 2, 3) if (b, s) not in named]

    def switch(path_b: bool) -> None:
        on[0] = path_b

    rows, notes = first_calls_ab(context, spans, rng, named, stream, switch)
    segment = context.program.lean_steps[0].fn
    template = segment._grown or segment
    paths = template._rewrite._whole.paths if template._rewrite is not None else 0
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"# {Path(args.engine).name}: {len(stream)} new shapes (b 1-3 x s 3-{args.seq_to - 1}) after {args.named}; "
          f"1 thread, {cpu}, load average {os.getloadavg()[0]:.1f}; {paths} traced paths of the walk")
    print("; ".join(notes) + " (µs)\n")
    print_rows(rows, "A walked", "B traced walk")


LABELS = {"first": "first call - its repeat", "outside": "outside the loop: first - repeat",
          "view": "the view (Segment._bind_sizes)", "bind": "the binding (DirectRuns.bind)"}


def first_calls_ab(context, spans: dict[str, float], rng, named: list[tuple[int, int]],
                   stream: list[tuple[int, int]], switch) -> tuple[dict, list[str]]:
    """The named shapes, then `stream` shuffled: each shape's first call after switch(False) (path A) or
    switch(True) (B), alternating in pairs, then 3 repeats, each bit for bit the first call's. (rows, notes): rows
    {(path, what): thread CPU µs per stream shape} for each of LABELS; notes, the named shapes' own (their first
    calls also pay one-time costs: a rule's or the walk's first trace), left out of the rows. bench/
    first_call_glue_ab.py runs the same loop."""
    rng.shuffle(stream)
    rows = {(path, what): [] for path in "AB" for what in LABELS}
    notes = []
    for k, (batch, seq) in enumerate(named + stream):
        on = bool(k % 2) ^ bool((k // 2) % 2)
        path = "B" if on else "A"
        switch(on)
        feeds = {"input_ids": rng.integers(0, 1000, (batch, seq)), "attention_mask": np.ones((batch, seq), np.int64)}
        first, got, repeat, repeat_outside = first_and_repeats(context, spans, feeds, f"{batch}x{seq} path {path}")
        outside = first - got.get("loop", 0.0) - repeat_outside
        if k < len(named):
            notes.append(f"{batch}x{seq} ({path}): extra {first - repeat:.0f}, outside {outside:.0f}, "
                         f"view {got.get('view', 0.0):.0f}")
            continue
        rows[path, "first"].append(first - repeat)
        rows[path, "outside"].append(outside)
        rows[path, "view"].append(got.get("view", 0.0))
        rows[path, "bind"].append(got.get("bind", 0.0))
    return rows, notes


def print_rows(rows: dict, path_a: str, path_b: str) -> None:
    """first_calls_ab's rows as a table, each row for path A (named `path_a`) then B."""
    print("| thread CPU µs | shapes | median | lower quartile | least |\n|---|---|---|---|---|")
    for what, label in LABELS.items():
        for path, name in (("A", path_a), ("B", path_b)):
            print(_row(f"{label}, {name}", rows[path, what]))


if __name__ == "__main__":
    main()
