"""libgomp's wait, A/B in one process: kiln's per-call governor against the fixed spins it replaces, capped to AVX2.

    python bench/omp_spin_ab.py --models mobilenet_v2,lstm_forecaster --threads 2 --rounds 7

Both sides capped to AVX2 as bench/zoo_avx2.py caps them (bench/cpuid_avx2.py + KILN_CPU_ISA=avx2). One engine
per model (tuned at the thread count, no timing cache) run through one execution context per mode, in interleaved
rounds of 20-run blocks (bench/lstm_engine.blocks, 50 ms settled before each: onnxruntime's pool spins after its
block), against onnxruntime:

- short: the count fixed at kiln/openmp.py's short spin (128), not governed: what a process imported on a busy
  machine ran before the governor;
- long: the count fixed at libgomp's default (300000), not governed: what a process imported on a quiet one ran;
- governed: kiln/kernels/cpu/omp_governor.py as it decides on this machine now (the decisions are printed);
- governed, cores free: the governor told the cores are free (CALL_SPIN, 4000 polls: spin between a call's
  layers, asleep ~0.1 ms after it returns): what it does on a quiet machine.

libgomp reads GOMP_SPINCOUNT once, so before the governor these took one process each; the governor writes the
count, which is what lets them alternate here. Per mode also the process CPU time over a 50 ms sleep right after
a call (median of 5): what the threads burn once a call has returned. Prints a table last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpuid_avx2  # noqa: E402

CAPPED = "--uncapped" not in sys.argv
if CAPPED:
    cpuid_avx2.enable()  # before torch, onnxruntime or kiln read cpuid
    os.environ["KILN_CPU_ISA"] = "avx2"

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import kiln  # noqa: E402  (first: KILN_CPU_ISA caps the libraries before their first kernel)
from kiln import openmp, zoo  # noqa: E402
from kiln.kernels.cpu import omp_governor  # noqa: E402
from lstm_engine import blocks, realtime  # noqa: E402


def cpu_after_call(run) -> float:
    """ms of process CPU time over a 50 ms sleep right after a call: median of 5."""
    run()
    time.sleep(0.1)  # the runner before's threads (onnxruntime's pool spins after a call) asleep first
    burnt = []
    for _ in range(5):
        run()
        before = time.process_time()
        time.sleep(0.05)
        burnt.append((time.process_time() - before) * 1e3)
    return statistics.median(burnt)


def main() -> None:
    import numpy as np
    import onnxruntime as ort
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mobilenet_v2,lstm_forecaster")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--realtime", action="store_true", help="time at SCHED_FIFO (root; bench/lstm_engine.realtime)")
    p.add_argument("--uncapped", action="store_true", help="no AVX2 cap (AVX-512 where the CPU has it)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    governor = omp_governor.governor()
    governor.begin()
    governor.end()
    if not governor.governed():
        sys.exit(f"the governor is off here: {governor.describe()}")
    count = governor._count
    free = omp_governor.Governor(runnable=lambda readings: 1)  # told: nothing else runnable
    free._lib, free._count, free._original = governor._lib, count, governor._original
    print(f"{'AVX2-capped' if CAPPED else 'uncapped'}, {args.threads} threads, libgomp's count at "
          f"{count.value} outside calls; {governor.describe()}", flush=True)
    rows = []
    for name in args.models.split(","):
        exported = zoo.export(name)
        feeds = exported.inputs()
        start = time.time()
        engine = kiln.build(str(exported.path), timing_cache=None)
        built_s = time.time() - start
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
        session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
        want = session.run(None, feeds)
        contexts = {mode: engine.create_execution_context() for mode in ("short", "long", "governed", "free")}
        contexts["short"]._omp = contexts["long"]._omp = None
        contexts["free"]._omp = free

        def fixed(ctx, value):
            def run():
                count.value = value
                return ctx.run(feeds)
            return run

        runners = {"onnxruntime": lambda: session.run(None, feeds),
                   "short (128, fixed)": fixed(contexts["short"], int(openmp.SHORT_SPIN)),
                   "long (300000, fixed)": fixed(contexts["long"], omp_governor.LIBGOMP_DEFAULT),
                   "governed": lambda: contexts["governed"].run(feeds),
                   "governed, cores free": lambda: contexts["free"].run(feeds)}
        error = 0.0
        for mode, ctx in contexts.items():
            got = ctx.run(feeds)
            for w, g in zip(want, (got[n] for n in engine.output_names)):
                error = max(error, float(np.abs(np.asarray(g) - w).max() / max(1.0, float(np.abs(w).max()))))
        count.value = governor._original
        load0 = os.getloadavg()[0]
        with realtime(args.realtime):
            times = blocks(runners, rounds=args.rounds, runs=args.runs, settle=0.05)
            burnt = {label: cpu_after_call(run) for label, run in runners.items()}
        count.value = governor._original
        load1 = os.getloadavg()[0]
        ref = statistics.median(times["onnxruntime"])
        print(f"\n{name}: built in {built_s:.1f} s, max error vs onnxruntime {error:.1e} (relative to max(1, |y|)), "
              f"1-min load {load0:.2f} -> {load1:.2f}; governed: {governor.last}", flush=True)
        for label, values in times.items():
            median = statistics.median(values)
            by_round = " ".join(f"{v / o:.2f}" for v, o in zip(values, times["onnxruntime"]))
            print(f"  {label:<22} {median:8.3f} ms  / ort {median / ref:.2f}  (by round {by_round})  "
                  f"CPU over 50 ms after a call {burnt[label]:.2f} ms")
            rows.append((name, label, median, median / ref, burnt[label], f"{load0:.1f}-{load1:.1f}"))
    print(f"\n| model | runner | ms | / onnxruntime | CPU ms in 50 ms after a call | load |\n|---|---|---|---|---|---|")
    for name, label, ms, ratio, burnt, load in rows:
        print(f"| {name} | {label} | {ms:.3f} | {ratio:.2f} | {burnt:.2f} | {load} |")


if __name__ == "__main__":
    main()
