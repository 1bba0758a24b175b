"""Where the LSTM forecaster's call goes, kiln beside onnxruntime, each in fresh processes of its own (2 threads).

    python bench/lstm_timeline.py                      # 5 processes of each, 300 calls each, taking turns
    python bench/lstm_timeline.py --processes 7 --pin fused
    python bench/lstm_timeline.py --set kiln_lstm_fused_wide=0        # also kiln with that C int of lstm_fused.c
    sudo chrt -f 10 python bench/lstm_timeline.py                      # the cores its own on a shared machine

kiln: each process builds the zoo's lstm_forecaster (timing cache off; --pin: its LSTMs then put on one tactic), then
traces its calls (lstm_fused.c's row-split trace, kiln_lstm_fused_tracing): per call, from Python's call to the first LSTM's
loop, each LSTM loop's slices (when the worker's slice started after the loop's start, each slice's length, the wait at the loop's end for the later slice), the gap between the loops, the end to Python's return.
onnxruntime: each process times its calls, then (a second session, profiling on) reports each node's median time.
Why: the end-to-end ratio says whether kiln is behind, these phases say where (the worker starting late, a slice
running slow, the time around the loops). Reported: per phase the median over the processes of each process's
median, and the range of the process medians.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


class _Trace(ctypes.Structure):  # struct fused_trace in lstm_fused.c
    _fields_ = [("start", ctypes.c_long), ("end", ctypes.c_long), ("slices", ctypes.c_long),
                ("slice_start", ctypes.c_long * 8), ("slice_end", ctypes.c_long * 8), ("by_worker", ctypes.c_long * 8)]


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def kiln_child(runs: int, warmup: int, pin: str | None, settings: tuple = ()) -> dict:
    import torch

    import kiln
    from kiln import zoo
    from kiln.kernels.cpu import recurrent
    from kiln.runtime.engine import Engine

    torch.set_num_threads(2)
    exported = zoo.export("lstm_forecaster")
    feeds = exported.inputs()
    build_start = time.perf_counter()
    engine = kiln.build(str(exported.path), timing_cache=None)
    build_s = time.perf_counter() - build_start
    if pin:  # every LSTM step on cpu.lstm.<pin>, the rest as tuned (bench/lstm_engine.py's pinned)
        steps = [dataclasses.replace(s, tactic=f"cpu.lstm.{pin}") if s.op_type == "LSTM" else s
                 for s in engine.plan.program.steps]
        plan = dataclasses.replace(engine.plan, program=dataclasses.replace(engine.plan.program, steps=steps))
        for found in plan.header["tactics"]["layers"].values():
            if found["tactic"].startswith("cpu.lstm."):
                found["tactic"] = f"cpu.lstm.{pin}"
        engine = Engine(plan)
    op = {s.name: s.op_type for s in engine.plan.program.steps}
    picks = [found["tactic"].removeprefix("cpu.lstm.")
             for name, found in engine.plan.header["tactics"]["layers"].items() if op.get(name) == "LSTM"]
    lib = recurrent.load()
    for setting in settings:  # another side: a C int of the recurrent library (e.g. kiln_lstm_fused_wide=0)
        name, value = setting.split("=")
        ctypes.c_int.in_dll(lib, name).value = int(value)
    tracing = ctypes.c_int.in_dll(lib, "kiln_lstm_fused_tracing")
    count = ctypes.c_long.in_dll(lib, "kiln_lstm_fused_trace_count")
    traces = (_Trace * 4096).in_dll(lib, "kiln_lstm_fused_traces")
    for _ in range(warmup):
        engine.run(feeds)
    tracing.value = 1
    calls = []
    for _ in range(runs):
        first = count.value
        t0 = time.monotonic_ns()
        engine.run(feeds)
        t1 = time.monotonic_ns()
        calls.append((t0, t1, first, count.value))
    tracing.value = 0
    phases: dict[str, list[float]] = {}

    def add(name, ns, scale=1e-6):
        phases.setdefault(name, []).append(ns * scale)

    for t0, t1, first, last in calls:
        add("call", t1 - t0)
        loops = [traces[i % 4096] for i in range(first, last)]
        if len(loops) != 2:
            continue
        add("python -> LSTM 1", loops[0].start - t0)
        for k, t in enumerate(loops, 1):
            add(f"LSTM {k} loop", t.end - t.start)
            starts = [t.slice_start[q] - t.start for q in range(t.slices)]
            add(f"LSTM {k} last slice starts after", max(starts))
            add(f"LSTM {k} slices run by the worker (mean)", sum(t.by_worker[q] for q in range(t.slices)), 1)
            for q in range(t.slices):
                add(f"LSTM {k} slice {q}", t.slice_end[q] - t.slice_start[q])
            add(f"LSTM {k} end after the first slice ends", t.end - min(t.slice_end[q] for q in range(t.slices)))
        add("LSTM 1 -> LSTM 2", loops[1].start - loops[0].end)
        add("LSTM 2 -> python", t1 - loops[1].end)
    summary = {k: statistics.mean(v) if "by the worker" in k else _median(v) for k, v in phases.items()}
    return {"picks": picks, "build_s": build_s, "phases": summary,
            "p90": {k: sorted(v)[int(0.9 * len(v))] for k, v in phases.items()}}


def ort_child(runs: int, warmup: int) -> dict:
    import numpy as np
    import onnxruntime as ort

    from kiln import zoo

    exported = zoo.export("lstm_forecaster")
    feeds = exported.inputs()

    def session(profile: bool):
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = 2, 1
        options.enable_profiling = profile
        return ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])

    plain = session(False)
    for _ in range(warmup):
        plain.run(None, feeds)
    ms = []
    for _ in range(runs):
        start = time.monotonic_ns()
        plain.run(None, feeds)
        ms.append((time.monotonic_ns() - start) / 1e6)
    del plain
    profiled = session(True)
    for _ in range(warmup + runs // 3):
        profiled.run(None, feeds)
    path = profiled.end_profiling()
    nodes: dict[str, list[float]] = {}
    for event in json.loads(Path(path).read_text()):
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            nodes.setdefault(event["args"]["op_name"] + " " + event["name"].removesuffix("_kernel_time"),
                             []).append(event["dur"] / 1e3)
    os.unlink(path)
    phases = {"call": float(np.median(ms))}
    phases.update({f"node {k}": _median(v[warmup:]) for k, v in nodes.items() if sum(v) / len(v) > 0.01})
    return {"phases": phases, "p90": {"call": float(np.percentile(ms, 90))}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=5)
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--pin", help="the LSTMs' tactic without tuning them (e.g. fused)")
    ap.add_argument("--set", action="append", default=[],
                    help="also kiln with this int of the recurrent library set after its build, e.g. "
                         "kiln_lstm_fused_wide=0 (repeatable: one runner each)")
    ap.add_argument("--child", choices=["kiln", "onnxruntime"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        result = kiln_child(args.runs, args.warmup, args.pin, tuple(args.set)) if args.child == "kiln" else \
            ort_child(args.runs, args.warmup)
        print(json.dumps(result))
        return
    runners = {"kiln": ("kiln", None), **{f"kiln {setting}": ("kiln", setting) for setting in args.set},
               "onnxruntime": ("onnxruntime", None)}
    found: dict[str, list[dict]] = {k: [] for k in runners}
    loads = []
    order = list(runners)
    for p in range(args.processes):
        for label in order[p % len(order):] + order[:p % len(order)]:
            runtime, setting = runners[label]
            loads.append(os.getloadavg()[0])
            command = [sys.executable, str(HERE), "--child", runtime, "--runs", str(args.runs), "--warmup",
                       str(args.warmup), *(["--pin", args.pin] if args.pin else []),
                       *(["--set", setting] if setting else [])]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            found[label].append(result)
            print(f"{label} process {p + 1}: call {result['phases']['call']:.3f} ms "
                  f"{' '.join(result.get('picks', []))} (load {loads[-1]:.2f})", flush=True)
    loads.append(os.getloadavg()[0])
    from kiln.builder.timing_cache import cpu_name

    commit = os.popen(f"git -C {HERE.parents[1]} rev-parse --short HEAD").read().strip()
    print(f"\n# LSTM forecaster timeline, 2 threads, {cpu_name()}, kiln at {commit}, {args.processes} processes each, "
          f"{args.runs} calls after {args.warmup}; 1-min load {min(loads):.2f}-{max(loads):.2f}\n")
    for runtime, results in found.items():
        print(f"| {runtime}: phase | median of process medians ms | process medians | median of p90 |")
        print("|---|---|---|---|")
        for name in results[0]["phases"]:
            values = [r["phases"].get(name, float("nan")) for r in results]
            p90 = [r["p90"][name] for r in results if name in r.get("p90", {})]
            print(f"| {name} | {_median(values):.3f} | {' '.join(f'{v:.3f}' for v in values)} | "
                  f"{_median(p90):.3f} |" if p90 else f"| {name} | {_median(values):.3f} | "
                  f"{' '.join(f'{v:.3f}' for v in values)} | |")
        if runtime != "onnxruntime":
            print("\npicks: " + ", ".join(" ".join(r["picks"]) for r in results))
        print()


if __name__ == "__main__":
    main()
