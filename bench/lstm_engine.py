"""The zoo's LSTM forecaster as whole engines, each LSTM kernel pinned, beside the tuner's own pick and onnxruntime.

    python bench/lstm_engine.py                      # 1 and 2 threads, 7 rounds
    python bench/lstm_engine.py --threads 2 --rounds 9 --builds 3
    python bench/lstm_engine.py --realtime           # the rounds at SCHED_FIFO priority: a shared VM's neighbours wait

Why: the tuner times each LSTM layer alone (bench/results/zoo-cpu-epyc-2026-12-03.md: its pick drifted between
builds on a quiet Zen 4), while what a user gets is the engine. Per thread count, one engine per LSTM kernel and one
on the op's own implementation (torch's kernel), each the first tuned engine's plan with its LSTM steps' tactic
replaced, `--builds` engines as kiln.build tunes them (timing cache off) and onnxruntime's session run the same input
in interleaved rounds: each round a block per runner (a SETTLE_S sleep, warm-up, then `--runs` calls), starting at
the next runner each round. Reported per runner: the least and the median of its rounds' block medians (at one
thread the calling thread's CPU time, every runtime computing on it; at more the wall clock), the ratio to
onnxruntime's of the same statistic, and the 1-min load average.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import kiln  # noqa: E402  (first: KILN_CPU_ISA caps the libraries before their first kernel)
from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.runtime.engine import Engine  # noqa: E402
from lstm_layers import median_ms  # noqa: E402  (bench/ is on sys.path: a script's folder)

LSTM_KERNELS = ("cpu.lstm.fused", "cpu.lstm.lanes", "cpu.lstm.native")


def lstm_picks(engine) -> str:
    """The tactic of each LSTM layer, and the tuner's times of its candidates (ms, as the tuner measured)."""
    steps = {s.name: s.op_type for s in engine.plan.program.steps}
    parts = []
    for name, found in engine.plan.header["tactics"]["layers"].items():
        if steps.get(name) != "LSTM":
            continue
        timed = {k.removeprefix("cpu.lstm."): v for k, v in found["candidates"].items() if isinstance(v, float)}
        parts.append(f"{found['tactic'].removeprefix('cpu.lstm.')} ["
                     + ", ".join(f"{k} {v:.3f}" for k, v in sorted(timed.items(), key=lambda kv: kv[1])) + "]")
    return "; ".join(parts)


def pinned(engine, tactic: str):
    """`engine` with every LSTM step on `tactic` ("" : the op's own implementation, torch's kernel), the other
    steps as tuned: one engine per kernel that differs from the others in the LSTMs only."""
    steps = [dataclasses.replace(s, tactic=tactic, tactic_config=s.tactic_config if tactic else {})
             if s.op_type == "LSTM" else s for s in engine.plan.program.steps]  # kiln's LSTM tactics share a config
    program = dataclasses.replace(engine.plan.program, steps=steps)
    return Engine(dataclasses.replace(engine.plan, program=program))


def engines(path: Path, builds: int) -> dict[str, object]:
    tuned = {f"tuned {b + 1}": kiln.build(str(path), timing_cache=None) for b in range(builds)}
    first = next(iter(tuned.values()))
    return {**{k.removeprefix("cpu."): pinned(first, k) for k in LSTM_KERNELS}, "torch (default)": pinned(first, ""),
            **tuned}


@contextlib.contextmanager
def realtime(on: bool):
    """Every thread of this process (kiln's pool, onnxruntime's, OpenMP's: started by the builds and warm-up calls
    before, or meanwhile, inheriting it) at SCHED_FIFO priority 10 while the rounds run, then back: on a VM shared
    with other work the neighbours wait instead of taking the cores in the middle of a call (root only; the kernel
    still leaves them 5% of each second)."""
    if not on:
        yield
        return
    for t in (int(t) for t in os.listdir("/proc/self/task")):
        os.sched_setscheduler(t, os.SCHED_FIFO, os.sched_param(10))
    try:
        yield
    finally:
        for t in (int(t) for t in os.listdir("/proc/self/task")):  # those started meanwhile (a build's) inherited it
            with contextlib.suppress(ProcessLookupError):
                os.sched_setscheduler(t, os.SCHED_OTHER, os.sched_param(0))


def blocks(calls: dict, rounds: int, runs: int, *, rotate: bool = True, clock=time.perf_counter,
           warmup: int = 5, settle: float = 0.0) -> dict:
    """Per call, its block medians in ms: `rounds` rounds, each call in turn (the order rotated by one each round
    where `rotate`) `warmup` untimed runs then a block of `runs` timed by `clock`. `settle`: seconds slept before
    each block, so that the threads the block before left spinning (onnxruntime's pool spins after each call) have
    gone to sleep: at SCHED_FIFO a spinning thread keeps its core from an equal-priority one, and with the rotation
    the same runner always follows onnxruntime's block (bench/results/zoo-cpu-avx2-2026-12-06.md, session 22)."""
    times: dict = {k: [] for k in calls}
    order = list(calls.items())
    for r in range(rounds):
        shift = r % len(order) if rotate else 0
        for key, fn in order[shift:] + order[:shift]:
            if settle:
                time.sleep(settle)
            for _ in range(warmup):
                fn()
            block = []
            for _ in range(runs):
                start = clock()
                fn()
                block.append(clock() - start)
            times[key].append(statistics.median(block) * 1e3)
    return times


def measure(threads: int, args) -> list[str]:
    import onnxruntime as ort
    import torch

    torch.set_num_threads(threads)  # before the builds: tactics are tuned at the thread count they run with
    exported = zoo.export("lstm_forecaster")
    feeds = exported.inputs()
    built = engines(exported.path, args.builds)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)[0]
    runners = {"onnxruntime": lambda: session.run(None, feeds)}
    for label, engine in built.items():
        got = engine.run(feeds)[engine.output_names[0]]
        error = float(np.abs(np.asarray(got) - want).max())
        if error > 1e-4:
            raise SystemExit(f"{label}: output differs from onnxruntime's by {error:.2e}")
        runners[label] = lambda engine=engine: engine.run(feeds)
    rounds: dict[str, list[float]] = {k: [] for k in runners}
    order = list(runners.items())
    # one thread: every runtime computes on the calling thread, whose CPU time leaves out the waits for a core
    clock = time.thread_time if threads == 1 else time.perf_counter
    with realtime(args.realtime):
        for r in range(args.rounds):
            shift = r % len(order)
            for label, fn in order[shift:] + order[:shift]:
                rounds[label].append(median_ms(fn, args.runs, clock, args.warmup))
    ort_least, ort_median = min(rounds["onnxruntime"]), statistics.median(rounds["onnxruntime"])
    lines = [f"\n{threads} thread(s), {args.rounds} rounds of {args.runs} calls, "
             f"{'CPU time of the calling thread' if threads == 1 else 'wall clock'}"
             f"{', SCHED_FIFO' if args.realtime else ''}, "
             f"1-min load now {os.getloadavg()[0]:.2f}",
             "| runner | least ms | median ms | least / ort | median / ort | steps a run | "
             "LSTM tactics [tuner's ms per candidate] |",
             "|---|---|---|---|---|---|---|"]
    for label, values in rounds.items():
        picks = lstm_picks(built[label]) if label.startswith("tuned") else ""
        # the program's steps a run: a native segment (kiln/runtime/native.py) is one
        steps = len(built[label].program.run_steps) if label in built else ""
        lines.append(f"| {label} | {min(values):.3f} | {statistics.median(values):.3f} | "
                     f"{min(values) / ort_least:.2f} | {statistics.median(values) / ort_median:.2f} | {steps} | "
                     f"{picks} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--runs", type=int, default=30, help="timed calls per block")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--builds", type=int, default=2, help="engines built with every tactic allowed (the tuner's pick)")
    ap.add_argument("--realtime", action="store_true", help="time the rounds at SCHED_FIFO priority (root)")
    args = ap.parse_args()
    import onnxruntime as ort
    import torch

    print(f"# LSTM forecaster (zoo lstm_forecaster, x 8x96x16), {cpu_name()} ({platform.machine()}), "
          f"kiln at {os.popen('git rev-parse --short HEAD').read().strip()}, torch {torch.__version__}, "
          f"onnxruntime {ort.__version__}; 1-min load before {os.getloadavg()[0]:.2f}", flush=True)
    for threads in (int(t) for t in args.threads.split(",")):
        print("\n".join(measure(threads, args)), flush=True)


if __name__ == "__main__":
    main()
