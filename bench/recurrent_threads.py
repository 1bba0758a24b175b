"""The zoo's recurrent forecasters at 1 and 2 threads: kiln with lstm_fused.c's row split and with its block split,
beside onnxruntime.

    python bench/recurrent_threads.py                        # lstm_forecaster, 2 threads, 9 rounds
    python bench/recurrent_threads.py --models lstm_forecaster,bilstm_forecaster,gru_forecaster --threads 2,1
    python bench/recurrent_threads.py --realtime             # the rounds at SCHED_FIFO priority (root)
    python bench/recurrent_threads.py --avx2                 # both sides on an AVX2-only CPU (bench/zoo_avx2.py's cap)
    python bench/recurrent_threads.py --lstm cpu.lstm.fused  # the LSTMs on one tactic (the tuner's pick drifts, loaded)
    python bench/recurrent_threads.py --realtime --avx2 --beside cpu.lstm.fused --normal-build  # pick vs pinned

One engine per model and thread count; "kiln" as built (lstm_fused.c: each thread a slice of the batch's rows through
every step, where each gets two rows or more), "kiln, block split" the same engine with each step's unit blocks split
between the threads instead, a barrier a step (recurrent.set_row_split(False): the form before 2026-12-05), and
onnxruntime's session, timed in interleaved rounds (each round a block per runner, warm-up then `--runs` calls,
starting at the next runner each round). Per runner: the median over rounds of each block's median wall time and of
its median process CPU time (every thread of the process: at two threads what the call cost the machine, spinning
included), and per round the ratio of wall medians to onnxruntime's. `--realtime`: every thread of the process at
SCHED_FIFO while the build and the rounds run (bench/lstm_engine.py), so that a shared VM's other work waits: the
wall clock then approaches a quiet machine's, and the tuner, seeing a real-time priority, times the candidates by it
as on a quiet machine (kiln/builder/cpu_clock.py; built at normal priority beside the load, it timed the two threads
taking turns and put an LSTM on cpu.lstm.lanes, 17% slower with the cores free: bench/results/tcn-2026-12-05c.md),
and libgomp spins as kiln lets it on a quiet machine (GOMP_SPINCOUNT 300000, libgomp's default, unless set: kiln
imported beside the load sets 100, with which the TCN's parallel form, 13 small convolutions, ran no faster than its
serial one at 2 threads).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--realtime" in sys.argv:  # the quiet machine SCHED_FIFO stands for: libgomp's own spin, which kiln keeps there
    os.environ.setdefault("GOMP_SPINCOUNT", "300000")  # (imported beside the load it sets 100: kiln/openmp.py)
if "--avx2" in sys.argv:  # before torch, onnxruntime or kiln read cpuid (bench/zoo_avx2.py checks MLAS obeys)
    import cpuid_avx2

    cpuid_avx2.enable()
    os.environ["KILN_CPU_ISA"] = "avx2"

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import kiln  # noqa: E402  (first: KILN_CPU_ISA caps the libraries before their first kernel)
from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.kernels.cpu import recurrent  # noqa: E402
from kiln.zoo.timing import SETTLE_S  # noqa: E402
from lstm_engine import lstm_picks, pinned, realtime  # noqa: E402  (bench/ is on sys.path: a script's folder)


def block(fn: Callable[[], object], runs: int, warmup: int) -> tuple[float, float]:
    """(median wall ms, median process CPU ms) of `runs` calls after a SETTLE_S sleep (onnxruntime's workers stop
    spinning: lstm_layers.median_ms) and `warmup`."""
    time.sleep(SETTLE_S)
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(runs):
        w, c = time.perf_counter(), time.process_time()
        fn()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def row_split(on: bool, fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        recurrent.set_row_split(on)
        return fn()
    return run


def measure(model: str, threads: int, args) -> list[str]:
    import onnxruntime as ort
    import torch

    torch.set_num_threads(threads)  # before the build: tactics are tuned at the thread count they run with
    exported = zoo.export(model)
    feeds = exported.inputs()
    with realtime(args.realtime):  # the tactics tuned with the cores the rounds will have (cpu_clock.py: wall clock)
        tuned = kiln.build(str(exported.path), timing_cache=None)
    engine = pinned(tuned, args.lstm) if args.lstm else tuned
    others = {f"kiln, LSTMs on {args.beside}": pinned(tuned, args.beside)} if args.beside else {}
    if args.normal_build:  # tuned beside the machine's other work, as a build without the priority is
        others["kiln, built at normal priority"] = normal = kiln.build(str(exported.path), timing_cache=None)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)[0]
    runners = {"kiln": row_split(True, lambda: engine.run(feeds)),
               "kiln, block split": row_split(False, lambda: engine.run(feeds)),
               **{label: (lambda e=e: e.run(feeds)) for label, e in others.items()},
               "onnxruntime": lambda: session.run(None, feeds)}
    for label in list(runners)[:-1]:
        got = runners[label]()[engine.output_names[0]]
        error = float(np.abs(np.asarray(got) - want).max())
        if error > 1e-4:
            raise SystemExit(f"{model} {label}: output differs from onnxruntime's by {error:.2e}")
    rounds: dict[str, list[tuple[float, float]]] = {k: [] for k in runners}
    order = list(runners.items())
    load = os.getloadavg()[0]
    with realtime(args.realtime):
        for r in range(args.rounds):
            shift = r % len(order)
            for label, fn in order[shift:] + order[:shift]:
                rounds[label].append(block(fn, args.runs, args.warmup))
    recurrent.set_row_split(True)
    ort_wall = [w for w, _ in rounds["onnxruntime"]]
    picks = f"pinned to {args.lstm}; the tuner's: {lstm_picks(tuned)}" if args.lstm else lstm_picks(tuned)
    picks += f"; at normal priority: {lstm_picks(normal)}" if args.normal_build else ""
    lines = [f"| {model} | {threads} | {picks} |"]
    for label, values in rounds.items():
        wall = statistics.median(w for w, _ in values)
        cpu = statistics.median(c for _, c in values)
        by_round = ", ".join(f"{w / o:.2f}" for (w, _), o in zip(values, ort_wall))
        lines.append(f"| | | | {label} | {wall:.3f} | {cpu:.3f} | {wall / statistics.median(ort_wall):.2f} | "
                     f"{by_round} | {load:.2f} -> {os.getloadavg()[0]:.2f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="lstm_forecaster", help="comma-separated zoo names")
    ap.add_argument("--threads", default="2", help="comma-separated thread counts")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--runs", type=int, default=40, help="timed calls per block")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--realtime", action="store_true", help="time the rounds at SCHED_FIFO priority (root)")
    ap.add_argument("--avx2", action="store_true", help="kiln and onnxruntime on an AVX2-only CPU (cpuid masked)")
    ap.add_argument("--lstm", help="every LSTM layer on this tactic (cpu.lstm.fused, ...), not the tuner's pick")
    ap.add_argument("--beside", help="also the tuned engine with every LSTM layer on this tactic, as one more runner")
    ap.add_argument("--normal-build", action="store_true",
                    help="with --realtime: also an engine tuned at normal priority (beside the machine's other work)")
    args = ap.parse_args()
    import onnxruntime as ort
    import torch

    print(f"# Recurrent forecasters by threads, {cpu_name()} ({platform.machine()}), kiln at "
          f"{os.popen('git rev-parse --short HEAD').read().strip()}, torch {torch.__version__}, onnxruntime "
          f"{ort.__version__}, {args.rounds} rounds of {args.runs} calls{', SCHED_FIFO' if args.realtime else ''}"
          f"{', AVX2 only (cpuid masked, KILN_CPU_ISA=avx2)' if args.avx2 else ''}\n",
          flush=True)
    print("| model | threads | LSTM tactics [tuner ms] | runner | wall ms | process CPU ms | wall / ort | wall / ort by round "
          "| 1-min load |\n|---|---|---|---|---|---|---|---|---|", flush=True)
    for model in args.models.split(","):
        for threads in (int(t) for t in args.threads.split(",")):
            print("\n".join(measure(model, threads, args)), flush=True)


if __name__ == "__main__":
    main()
