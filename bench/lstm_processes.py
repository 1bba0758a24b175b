"""The LSTM forecaster at 2 threads with each runtime in a process of its own: kiln (this checkout, and optionally
another checkout of kiln: before/after) and onnxruntime, one process after the other, several of each.

    python bench/lstm_processes.py --before /tmp/kiln-base         # 5 processes of each, 300 calls each
    python bench/lstm_processes.py --processes 7 --runs 500

    git archive <commit> | tar -x -C /tmp/kiln-base                # a checkout of the code before, for --before

Why: in one process onnxruntime's pool, spinning after its calls, takes the cores kiln's workers need, and a tuned
engine's picks are the ones its build timed; what a user meets is a fresh process that builds (timing cache off, so
each tunes anew) and then calls the engine back to back. Each process (the child of this script, with the runtime's
checkout first on PYTHONPATH) builds or opens the zoo's lstm_forecaster export, runs --warmup calls, then times
--runs calls (wall clock) and reports its median, p10 and p90, and kiln's LSTM picks; the runners take turns, the
order rotated by one each time. Reported: the median of the process medians per runner, their range, each process's
picks, and the 1-min load around each process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def child(runtime: str, runs: int, warmup: int) -> None:
    """One runtime in this process: its timings and (kiln) LSTM picks as one JSON line on stdout."""
    import numpy as np
    import torch

    import kiln
    from kiln import zoo

    torch.set_num_threads(2)
    exported = zoo.export("lstm_forecaster")
    feeds = exported.inputs()
    picks: list[str] = []
    if runtime == "kiln":
        engine = kiln.build(str(exported.path), timing_cache=None)
        op = {s.name: s.op_type for s in engine.plan.program.steps}
        picks = [found["tactic"].removeprefix("cpu.lstm.")
                 for name, found in engine.plan.header["tactics"]["layers"].items() if op.get(name) == "LSTM"]
        call = lambda: engine.run(feeds)  # noqa: E731
    else:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = 2, 1
        session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
        call = lambda: session.run(None, feeds)  # noqa: E731
    for _ in range(warmup):
        call()
    ms = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        ms.append((time.perf_counter() - start) * 1e3)
    p10, p50, p90 = np.percentile(ms, [10, 50, 90])
    print(json.dumps({"median": p50, "p10": p10, "p90": p90, "picks": picks, "kiln": str(Path(kiln.__file__).parent)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=5, help="processes of each runner")
    ap.add_argument("--runs", type=int, default=300, help="timed calls a process")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--before", help="another checkout of kiln, run as 'kiln before'")
    ap.add_argument("--child", choices=["kiln", "onnxruntime"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.runs, args.warmup)
        return
    this = str(HERE.parents[1])
    runners = {"kiln": ("kiln", this), **({"kiln before": ("kiln", args.before)} if args.before else {}),
               "onnxruntime": ("onnxruntime", this)}
    found: dict[str, list[dict]] = {k: [] for k in runners}
    order = list(runners)
    for p in range(args.processes):
        for label in order[p % len(order):] + order[:p % len(order)]:
            runtime, checkout = runners[label]
            load = os.getloadavg()[0]
            done = subprocess.run([sys.executable, str(HERE), "--child", runtime, "--runs", str(args.runs),
                                   "--warmup", str(args.warmup)], capture_output=True, text=True, check=True,
                                  env={**os.environ, "PYTHONPATH": checkout})
            result = json.loads(done.stdout.strip().splitlines()[-1])
            if runtime == "kiln" and Path(result["kiln"]).parent != Path(checkout).resolve():
                raise SystemExit(f"{label}: the child imported kiln from {result['kiln']}, not {checkout}")
            found[label].append({**result, "load": (load + os.getloadavg()[0]) / 2})
            print(f"{label} process {p + 1}: {result['median']:.3f} ms {' '.join(result['picks'])}", flush=True)
    from kiln.builder.timing_cache import cpu_name

    loads = [f["load"] for fs in found.values() for f in fs]
    print(f"\n# LSTM forecaster (zoo lstm_forecaster), 2 threads, a process per runtime, {cpu_name()} "
          f"({platform.machine()}), kiln at {os.popen(f'git -C {this} rev-parse --short HEAD').read().strip()}"
          f"{f', before: {args.before}' if args.before else ''}; {args.processes} processes each, {args.runs} calls "
          f"a process after {args.warmup}; 1-min load {min(loads):.2f}-{max(loads):.2f}\n")
    ort = statistics.median(f["median"] for f in found["onnxruntime"])
    print("| runner | median of medians ms | / onnxruntime | process medians ms | p10 / p90 (median) | "
          "LSTM picks (layer 1 layer 2) per process |")
    print("|---|---|---|---|---|---|")
    for label, fs in found.items():
        medians = [f["median"] for f in fs]
        print(f"| {label} | {statistics.median(medians):.3f} | {statistics.median(medians) / ort:.2f} | "
              + " ".join(f"{m:.2f}" for m in medians) + f" | {statistics.median(f['p10'] for f in fs):.2f} / "
              f"{statistics.median(f['p90'] for f in fs):.2f} | "
              + ", ".join(" ".join(f["picks"]) for f in fs) + " |")


if __name__ == "__main__":
    main()
