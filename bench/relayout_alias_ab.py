"""A zoo model with kiln's relayouts that move no byte run as aliases inside native segments (the default) beside the
same engine with every relayout a copy, and onnxruntime, in one process.

    python bench/relayout_alias_ab.py                                  # convnext_tiny, 2 threads
    python bench/relayout_alias_ab.py --models convnext_tiny,swin_tiny --realtime

Why: ConvNeXt's blocks permute the NCHW image to [N, H·W, C] rows for the LayerNorm and the two Linears and back; in a
segment 4-D values are NHWC, so both permutes are the same bytes, and each was a copy (18 in convnext_tiny,
bench/results/small-zen4-2026-12-06.md). Both engines are built on one timing cache (the same tactics: only the
relayouts differ); outputs are checked against onnxruntime first; then interleaved rounds of blocks (each runner's
block after 5 warm-up calls, starting at the next runner each round), wall clock, median of block medians, and per
round the ratio to onnxruntime. `--realtime`: the rounds at SCHED_FIFO (root; bench/lstm_engine.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.runtime import native_runs  # noqa: E402
from lstm_engine import blocks, realtime  # noqa: E402


def copies(engine) -> tuple[int, int]:
    """(relayout members that copy, those that alias) over the engine's segments."""
    members = [m for s in engine.program.segments for m in s.members if m.ctx.op_type == "Relayout"]
    return sum(not m.fn.native.alias for m in members), sum(m.fn.native.alias for m in members)


def rounds_against_onnxruntime(exported, feeds: dict, engines: dict, args) -> tuple[dict, dict, float]:
    """The engines' outputs checked against onnxruntime (args.threads intra-op threads), then interleaved rounds of
    blocks of every engine's calls and onnxruntime's (`--realtime`: at SCHED_FIFO): (ms by runner and round, max
    error relative to the largest output by engine, the 1-min load before the rounds)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
    session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)
    errors = {}
    for label, engine in engines.items():
        got = engine.run(feeds)
        errors[label] = max(float(np.abs(got[n] - w).max()) / max(1.0, float(np.abs(w).max()))
                            for n, w in zip(engine.output_names, want))
    calls = {label: (lambda e=engine: e.run(feeds)) for label, engine in engines.items()}
    calls["onnxruntime"] = lambda: session.run(None, feeds)
    load = os.getloadavg()[0]
    with realtime(args.realtime):
        return blocks(calls, args.rounds, args.runs), errors, load


def measure(name: str, args) -> list[str]:
    import torch

    torch.set_num_threads(args.threads)
    exported = zoo.export(name)
    feeds = exported.inputs()
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(Path(tmp) / "timing.json")
        aliased = kiln.build(str(exported.path), timing_cache=cache)
        with mock.patch.object(native_runs, "_aliasing", lambda step, native, *_: (step, native)):
            copied = kiln.build(str(exported.path), timing_cache=cache)
    runners = {"kiln, relayouts aliased": aliased, "kiln, relayouts copied": copied}
    times, errors, load = rounds_against_onnxruntime(exported, feeds, runners, args)
    lines = [f"### {name}, {cpu_name()}, {args.threads} thread(s), wall ms, {args.rounds} rounds of {args.runs}"
             f"{', SCHED_FIFO' if args.realtime else ''}, 1-min load {load:.2f} -> {os.getloadavg()[0]:.2f}", "",
             "| runner | relayouts (copy / alias) | ms | / onnxruntime | by round | max err vs ort |",
             "|---|---|---|---|---|---|"]
    for label, values in times.items():
        ratios = [a / o for a, o in zip(values, times["onnxruntime"])]
        count = "" if label == "onnxruntime" else "%d / %d" % copies(runners[label])
        error = "" if label == "onnxruntime" else f"{errors[label]:.1e}"
        lines.append(f"| {label} | {count} | {statistics.median(values):.3f} | {statistics.median(ratios):.3f} | "
                     f"{', '.join(f'{q:.2f}' for q in ratios)} | {error} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="convnext_tiny")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--runs", type=int, default=100, help="timed calls per block")
    ap.add_argument("--realtime", action="store_true", help="time the rounds at SCHED_FIFO priority (root)")
    args = ap.parse_args()
    for name in args.models.split(","):
        print("\n".join(measure(name.strip(), args)) + "\n", flush=True)


if __name__ == "__main__":
    main()
