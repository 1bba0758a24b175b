"""The step barrier of recurrent.c's loop (run_stages) at two threads, before and after 2026-12-06, on the zoo's
recurrent forecasters beside onnxruntime, in one process: each thread claiming its own slice of a step's items at
once (recurrent.set_whole_slices) against item by item, and lstm_fused.c's block split computing each thread's x parts
of a step before the barrier (recurrent.set_fused_ahead) against after it.

    python bench/recurrent_barrier_ab.py --avx2         # capped to AVX2 (bench/zoo_avx2.py's cap), 2 and 1 threads
    python bench/recurrent_barrier_ab.py --models lstm_forecaster,gru_forecaster --threads 2 --rounds 9
    python bench/recurrent_barrier_ab.py --avx2 --lstm cpu.lstm.fused_blocks   # the LSTMs pinned to one tactic as well

Per model and thread count one engine, tuned by kiln.build at SCHED_FIFO (the cores the rounds will have); runners:
that engine as it runs now ("after": whole slices, x parts ahead), with whole slices but the x parts after the
barrier, and as before (item claims, after the barrier); `--lstm`'s pinned engine the same three ways; onnxruntime's
session. Interleaved rounds at SCHED_FIFO (bench/lstm_engine.realtime, root), the order rotated each round,
`--settle` seconds slept before each block (onnxruntime's pool spins after its calls and, at SCHED_FIFO, would keep
the next runner's pool worker off its core: bench/results/zoo-cpu-avx2-2026-12-06.md). Wall clock at two threads,
the calling thread's CPU time at one (neither change acts there: one thread runs a step's items in order, no
barrier). Per runner: median of block medians, / onnxruntime, each round's ratio, the 1-min load before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--avx2" in sys.argv:  # before torch, onnxruntime or kiln read cpuid (bench/zoo_avx2.py checks MLAS obeys)
    import cpuid_avx2

    cpuid_avx2.enable()
    os.environ["KILN_CPU_ISA"] = "avx2"
os.environ.setdefault("GOMP_SPINCOUNT", "300000")  # the quiet machine SCHED_FIFO stands for (kiln/openmp.py)

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import kiln  # noqa: E402  (first: KILN_CPU_ISA caps the libraries before their first kernel)
from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.kernels.cpu import recurrent  # noqa: E402
from lstm_engine import blocks, lstm_picks, pinned, realtime  # noqa: E402  (bench/ is on sys.path)


FORMS = {"after": (True, True), "whole slices, x after the barrier": (True, False),
         "before (item claims, x after the barrier)": (False, False)}


def form(whole: bool, ahead: bool, fn):
    def run():
        recurrent.set_whole_slices(whole)
        recurrent.set_fused_ahead(ahead)
        return fn()
    return run


def measure(model: str, threads: int, args) -> list[str]:
    import onnxruntime as ort
    import torch

    torch.set_num_threads(threads)  # before the build: tactics are tuned at the thread count they run with
    exported = zoo.export(model)
    feeds = exported.inputs()
    with realtime(True):
        tuned = kiln.build(str(exported.path), timing_cache=None)
    engines = {"kiln": tuned}
    if args.lstm and "lstm" in model:
        engines[f"kiln, LSTMs on {args.lstm}"] = pinned(tuned, args.lstm)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)[0]
    runners = {}
    for label, engine in engines.items():
        for name, (whole, ahead) in FORMS.items():
            runners[f"{label}, {name}"] = form(whole, ahead, lambda e=engine: e.run(feeds))
    runners["onnxruntime"] = lambda: session.run(None, feeds)
    for label in list(runners)[:-1]:
        got = runners[label]()[tuned.output_names[0]]
        error = float(np.abs(np.asarray(got) - want).max())
        if error > 1e-4:
            raise SystemExit(f"{model} {label}: output differs from onnxruntime's by {error:.2e}")
    clock = time.thread_time if threads == 1 else time.perf_counter
    load = os.getloadavg()[0]
    with realtime(True):
        times = blocks(runners, args.rounds, args.runs, clock=clock, settle=args.settle)
    recurrent.set_whole_slices(True)
    recurrent.set_fused_ahead(True)
    ort_ms = times["onnxruntime"]
    picks = lstm_picks(tuned) or "-"
    lines = [f"| {model} | {threads} | {picks} | | | | | {load:.2f} -> {os.getloadavg()[0]:.2f} |"]
    for label, values in times.items():
        ratios = [v / o for v, o in zip(values, ort_ms)]
        lines.append(f"| | | | {label} | {statistics.median(values):.3f} | "
                     f"{statistics.median(values) / statistics.median(ort_ms):.3f} | "
                     f"{', '.join(f'{q:.2f}' for q in ratios)} | |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--avx2", action="store_true", help="kiln and onnxruntime on an AVX2-only CPU (cpuid masked)")
    ap.add_argument("--models", default="lstm_forecaster,gru_forecaster")
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--settle", type=float, default=0.05, help="seconds slept before each block")
    ap.add_argument("--lstm", help="also the engine with every LSTM layer pinned to this tactic")
    args = ap.parse_args()
    print(f"# {cpu_name()}, {'AVX2 only' if args.avx2 else 'native ISA'}, SCHED_FIFO; wall ms at 2 threads, the "
          f"calling thread's CPU ms at 1\n")
    print("| model | threads | LSTM tactics [tuner ms] | runner | ms | / onnxruntime | by round | 1-min load |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        for threads in (int(t) for t in args.threads.split(",")):
            print("\n".join(measure(model, threads, args)), flush=True)


if __name__ == "__main__":
    main()
