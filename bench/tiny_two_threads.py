"""Tiny models at 2 threads with and without the tiny-segment skip (issue 11), in one process: each of
bench/tiny_models.py's models built twice, once as kiln builds it (a segment under native_members.TINY_WORK runs its
serial form alone; a context of one such segment skips the OpenMP governor) and once with TINY_WORK at 0 (the form
chooser and the governor per call, as before), beside onnxruntime at the same thread count.

    python bench/tiny_two_threads.py --threads 2 --rounds 9

Rounds interleave the three sides (the order rotates each round), each a block of ~--block-ms of calls after 20 ms
slept and 5 calls, timed by --clock (the calling thread's CPU time by default; `wall` where a parallel form's second
thread must count). Per side the median of its rounds; the ratios are per round, then their median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_models import CLOCKS, check_against, interleaved, ort_session, tiny_models  # noqa: E402


def measure(name: str, model, args: argparse.Namespace) -> None:
    import kiln
    from kiln.runtime import native

    options = {"profiles": model.profiles} if model.profiles else {}
    engines = {"skip": kiln.build(model.onnx, **options)}
    kept = native.TINY_WORK
    native.TINY_WORK = 0  # no segment is tiny: the chooser where there are two forms, the governor per call
    try:
        engines["no skip"] = kiln.build(model.onnx, **options)
        engines["no skip"].run(model.feeds[0])  # its thread's context made here: the governor kept (_tiny_calls)
    finally:
        native.TINY_WORK = kept
    session = ort_session(model, args.threads)
    check_against(session, list(engines.values()), model, name)
    cycle = model.feeds

    def block_of(run, ort_call: bool):
        def block(n: int) -> None:
            k = len(cycle)
            for i in range(n):
                run(None, cycle[i % k]) if ort_call else run(cycle[i % k])
        return block

    sides = {side: block_of(e.run, False) for side, e in engines.items()}
    sides["onnxruntime"] = block_of(session.run, True)
    times, loads = interleaved(sides, len(cycle), args)
    med = {side: statistics.median(v) for side, v in times.items()}
    ratio = {side: statistics.median(a / b for a, b in zip(times[side], times["onnxruntime"])) for side in engines}
    gain = statistics.median(a / b for a, b in zip(times["skip"], times["no skip"]))
    context = engines["skip"]._threads.context
    print(f"| {name} | {med['no skip']:.2f} | {ratio['no skip']:.3f} | {med['skip']:.2f} | **{ratio['skip']:.3f}** | "
          f"{med['onnxruntime']:.2f} | {gain:.3f} | {'off' if context._omp is None else 'on'} | "
          f"{min(loads):.2f}-{max(loads):.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="comma-separated (default: every model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="thread")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--block-ms", type=float, default=20.0)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    import onnxruntime

    models = tiny_models()
    chosen = args.models.split(",") if args.models else list(models)
    print(f"tiny models with / without the tiny skip: {args.threads} thread(s), {args.clock} clock, {args.rounds} "
          f"rounds, torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, load {os.getloadavg()[0]:.2f}")
    print("| model | no skip µs | no skip / ort | skip µs | **skip / ort** | ort µs | skip / no skip | governor | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in chosen:
        measure(name, models[name], args)


if __name__ == "__main__":
    main()
