"""The LSTM forecaster at 2 threads in one process: pool.c's workers following back-to-back calls (kiln_pool_follow_ns)
against the 30 us poll of before, beside onnxruntime.

    python bench/lstm_follow_ab.py                      # 9 rounds of 30 calls, LSTMs pinned to the row split
    python bench/lstm_follow_ab.py --rounds 15 --follow 300000,1000000 --tuned
    python bench/lstm_follow_ab.py --realtime           # the rounds at SCHED_FIFO priority (root)

Why: the row split (cpu.lstm.fused) is two slices of ~1 ms, one a thread; a worker asleep on its futex when a call's
first loop starts begins its slice late and the call waits for it (bench/results/lstm-zen3-2026-12-07.md). Each
round runs a block per runner (a SETTLE_S sleep, warm-up, then --runs calls back to back, as a user's loop calls),
the order rotated by one each round; kiln's runners differ only in the pool's follow window, set before the block in
every library with a pool (gemm_native.set_pool_follow; 0: the form before). kiln's loops run on pool.c (KILN_POOL=1
unless set), with the OpenMP governor off (KILN_OMP_GOVERN=0), which would set the window itself (on where the
threads fit the free cores, off where they do not). Reported per runner: the median of its block medians (wall clock), the process CPU time a call, the
workers' sleeps a call (kiln_pool_parks of the LSTM's library), and per kiln runner the rounds it beat the 30 us poll.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("KILN_POOL", "1")  # before kiln loads its libraries: the pool, whatever the load says
os.environ["KILN_OMP_GOVERN"] = "0"  # the follow window is this bench's to set
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.kernels.cpu import gemm_native, recurrent  # noqa: E402
from kiln.zoo.timing import SETTLE_S  # noqa: E402
from lstm_engine import lstm_picks, pinned, realtime  # noqa: E402  (bench/ is on sys.path: a script's folder)
from lstm_layers import median_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--runs", type=int, default=30, help="timed calls per block")
    ap.add_argument("--follow", default="1000000", help="follow windows (ns, comma separated) against 0")
    ap.add_argument("--tuned", action="store_true", help="the tuner's LSTM picks instead of the row split pinned")
    ap.add_argument("--realtime", action="store_true", help="time the rounds at SCHED_FIFO priority (root)")
    args = ap.parse_args()
    import numpy as np
    import onnxruntime as ort
    import torch

    torch.set_num_threads(2)
    exported = zoo.export("lstm_forecaster")
    feeds = exported.inputs()
    engine = kiln.build(str(exported.path), timing_cache=None)
    if not args.tuned:
        engine = pinned(engine, "cpu.lstm.fused")
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 2, 1
    session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)[0]
    error = float(np.abs(np.asarray(engine.run(feeds)[engine.output_names[0]]) - want).max())
    if error > 1e-4:
        raise SystemExit(f"kiln's output differs from onnxruntime's by {error:.2e}")
    parks = recurrent.load().kiln_pool_parks
    windows = {f"kiln follow {int(ns) // 1000} us" if int(ns) else "kiln 30 us poll (before)": int(ns)
               for ns in ["0", *args.follow.split(",")]}
    runners = [*windows, "onnxruntime"]
    ms: dict[str, list[float]] = {k: [] for k in runners}
    cpu: dict[str, list[float]] = {k: [] for k in runners}
    sleeps: dict[str, list[float]] = {k: [] for k in runners}
    loads = [os.getloadavg()[0]]
    with realtime(args.realtime):
        for r in range(args.rounds):
            for label in runners[r % len(runners):] + runners[:r % len(runners)]:
                if label in windows:
                    gemm_native.set_pool_follow(windows[label])
                    fn = lambda: engine.run(feeds)  # noqa: E731
                else:
                    fn = lambda: session.run(None, feeds)  # noqa: E731
                time.sleep(SETTLE_S)  # here, not in median_ms: the CPU time below is of this block's calls only
                parked, used = parks(), time.process_time()
                ms[label].append(median_ms(fn, args.runs, time.perf_counter, warmup=5, settle=0.0))
                cpu[label].append((time.process_time() - used) * 1e3 / (args.runs + 5))
                sleeps[label].append((parks() - parked) / (args.runs + 5))
            loads.append(os.getloadavg()[0])
    before = "kiln 30 us poll (before)"
    print(f"# LSTM forecaster (zoo lstm_forecaster, x 8x96x16), 2 threads, {cpu_name()} ({platform.machine()}), "
          f"kiln at {os.popen('git rev-parse --short HEAD').read().strip()}, onnxruntime {ort.__version__}, "
          f"KILN_POOL={os.environ['KILN_POOL']}, "
          f"LSTMs {lstm_picks(engine) if args.tuned else 'pinned to cpu.lstm.fused'}"
          f"\n{args.rounds} rounds of {args.runs} calls, wall clock{', SCHED_FIFO' if args.realtime else ''}, "
          f"1-min load {min(loads):.2f}-{max(loads):.2f}\n")
    print("| runner | median ms | / onnxruntime (median of rounds) | process CPU ms a call | worker sleeps a call | "
          "rounds ahead of the 30 us poll |")
    print("|---|---|---|---|---|---|")
    for label in runners:
        ratio = statistics.median(a / b for a, b in zip(ms[label], ms["onnxruntime"]))
        ahead = "" if label not in windows or label == before else \
            f"{sum(a < b for a, b in zip(ms[label], ms[before]))} of {args.rounds}"
        print(f"| {label} | {statistics.median(ms[label]):.3f} | {ratio:.2f} | {statistics.median(cpu[label]):.3f} | "
              f"{statistics.median(sleeps[label]):.2f} | {ahead} |")
    print("\nrounds (ms): " + "; ".join(f"{k}: " + " ".join(f"{v:.2f}" for v in ms[k]) for k in runners))


if __name__ == "__main__":
    main()
