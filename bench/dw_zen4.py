"""MobileNetV2 / EfficientNet-B0 at 2 threads: kiln's two forms of small layers, and the chooser, against onnxruntime.

    python bench/dw_zen4.py --models mobilenet_v2,efficientnet_b0 --rounds 6 --block 10 [--torch]
    python bench/dw_zen4.py --zoo-order --trials 4 [--settle]  # the chooser's start, one run each vs three

Issue 11: bench/zoo.py measured MobileNetV2 at 1.48x and EfficientNet-B0 at 1.55x onnxruntime on a 2-vCPU EPYC
while the quickstart demo timed the same MobileNetV2 export at 0.98x. A native segment's small layers are bound
twice, on OpenMP's count ("parallel") and on the calling thread ("serial"), and a chooser picks one per run from
their recent times (kiln/kernels/cpu/form_choice.py). This builds one engine per mode in one process
(KILN_SERIAL_SMALL_LAYERS unset = the chooser, 0 = parallel only, 1 = serial only), times them and onnxruntime
(and torch eager with --torch, as bench/zoo.py interleaves it) in interleaved blocks, and prints per peer the
median, the ratio to onnxruntime per round, and for the chooser's engine which form each run took
(P parallel, s serial): whether a kiln that lost ran the form that loses on free cores.

--zoo-order replays bench/zoo.py's sequence for one engine, `--trials` times with fresh choosers: kiln once,
onnxruntime once (the correctness check), then rounds of blocks (kiln, onnxruntime, torch eager; 5 warm-up + 10
runs each; --settle: each block first sleeps SETTLE_S, as bench/zoo.py now does), with every segment's chooser
deciding on one counted run of each form (start_runs=1, before 2026-12-06) or on three (now); prints kiln's
median, its ratio to onnxruntime and the forms kiln ran.
"""

from __future__ import annotations

import kiln  # noqa: I001  first: kiln/openmp.py chooses the wait policy before torch loads libgomp

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.kernels.cpu import cpu_features  # noqa: E402

MODES = {"chooser": None, "parallel": "0", "serial": "1"}  # KILN_SERIAL_SMALL_LAYERS per kiln engine


def runnable() -> int:
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[0])


def build(path: Path, mode: str | None, timing_cache: str | None):
    """An engine whose small layers are bound as `mode` says (KILN_SERIAL_SMALL_LAYERS, read as layers bind)."""
    saved = os.environ.pop("KILN_SERIAL_SMALL_LAYERS", None)
    try:
        if mode is not None:
            os.environ["KILN_SERIAL_SMALL_LAYERS"] = mode
        return kiln.build(str(path), timing_cache=timing_cache)
    finally:
        os.environ.pop("KILN_SERIAL_SMALL_LAYERS", None)
        if saved is not None:
            os.environ["KILN_SERIAL_SMALL_LAYERS"] = saved


def form_log(engine) -> list[str]:
    """Every form the engine's first chooser records from now on ('P'/'s'), appended as it runs."""
    log: list[str] = []
    chooser = next((s.chooser for s in engine.program.segments if s.chooser is not None), None)
    if chooser is None:
        return log
    record = chooser.record

    def logged(form: str, seconds: float) -> None:
        log.append("P" if form == "parallel" else "s")
        record(form, seconds)

    chooser.record = logged
    return log


def bench_model(name: str, args) -> None:
    exported = zoo.export(name)
    feeds = exported.inputs()
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)
    runners = {}
    logs = {}
    for label in args.modes.split(","):
        engine = build(exported.path, MODES[label], args.timing_cache)
        got = engine.run(feeds)
        error = max(float(np.abs(got[n] - w).max()) for n, w in zip(engine.output_names, want))
        print(f"  kiln {label}: largest difference from onnxruntime {error:.1e}")
        logs[label] = form_log(engine)
        runners[f"kiln {label}"] = lambda engine=engine: engine.run(feeds)
    runners["onnxruntime"] = lambda: session.run(None, feeds)
    if args.torch:
        model = zoo.torch_model(name)
        tensors = {k: torch.from_numpy(v) for k, v in feeds.items()}

        def torch_eager():
            with torch.inference_mode():
                return model(**tensors)

        runners["torch eager"] = torch_eager
    medians: dict[str, list[float]] = {k: [] for k in runners}
    samples: dict[str, list[float]] = {k: [] for k in runners}
    loads, tasks = [], []
    for _ in range(args.rounds):
        loads.append(os.getloadavg()[0])
        tasks.append(runnable())
        for peer, run in runners.items():
            for _ in range(args.warmup):
                run()
            block = []
            for _ in range(args.block):
                start = time.perf_counter()
                run()
                block.append((time.perf_counter() - start) * 1e3)
            samples[peer] += block
            medians[peer].append(statistics.median(block))
    print(f"{name}, {cpu_name()} ({cpu_features.describe()}), {args.threads} threads, GOMP_SPINCOUNT="
          f"{os.environ.get('GOMP_SPINCOUNT', 'unset')}, 1-min load {min(loads):.1f}-{max(loads):.1f}, runnable "
          f"tasks {min(tasks)}-{max(tasks)}")
    for peer in runners:
        ratios = [a / b for a, b in zip(medians[peer], medians["onnxruntime"])]
        print(f"  {peer:16s} median {statistics.median(samples[peer]):7.2f} ms  / onnxruntime by round "
              + " ".join(f"{r:.2f}" for r in ratios) + f"  (median {statistics.median(ratios):.2f})")
    for label, log in logs.items():
        if log:
            print(f"  forms run by kiln {label}: {''.join(log)}")


def zoo_order(name: str, args) -> None:
    """bench/zoo.py's run_cpu sequence on one engine, each trial with fresh choosers of each start-up rule."""
    from kiln.kernels.cpu.form_choice import FormChooser
    from kiln.zoo.timing import SETTLE_S, peer_runners, time_samples

    exported = zoo.export(name)
    feeds = exported.inputs()
    engine = build(exported.path, None, args.timing_cache)
    runners = peer_runners(name, exported.path, feeds, threads=args.threads, engine=engine)
    segments = [s for s in engine.program.segments if s.chooser is not None]
    rows = []
    for trial in range(args.trials):
        for start_runs in (1, 3):
            for s in segments:
                s.chooser = FormChooser(start_runs=start_runs)
            log = form_log(engine)
            load = os.getloadavg()[0]
            runners["kiln"]()
            runners["onnxruntime"]()
            samples: dict[str, list[float]] = {"kiln": [], "onnxruntime": []}
            for _ in range(3):
                for peer in ("kiln", "onnxruntime", "torch eager"):
                    block = time_samples(runners[peer], iterations=10, warmup=5, budget_s=4.0, min_runs=5,
                                         settle_s=SETTLE_S if args.settle else 0.0)
                    if peer in samples:
                        samples[peer] += block
            kiln_ms, ort_ms = statistics.median(samples["kiln"]), statistics.median(samples["onnxruntime"])
            rows.append((trial, start_runs, load, kiln_ms, ort_ms, "".join(log)))
    print(f"{name}, {cpu_name()} ({cpu_features.describe()}), {args.threads} threads, bench/zoo.py's order "
          f"({'a settle before each block' if args.settle else 'no settle, as before 2026-12-06'}), "
          f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', 'unset')}")
    print("| trial | chooser start | 1-min load | kiln ms | onnxruntime ms | kiln / ort "
          "| forms kiln ran (P parallel, s serial) |")
    print("|---|---|---|---|---|---|---|")
    for trial, start_runs, load, kiln_ms, ort_ms, log in rows:
        print(f"| {trial} | {start_runs} run(s) each | {load:.1f} | {kiln_ms:.2f} | {ort_ms:.2f} | "
              f"{kiln_ms / ort_ms:.2f} | {log} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mobilenet_v2,efficientnet_b0")
    parser.add_argument("--modes", default="chooser,parallel,serial", help="kiln engines: " + ",".join(MODES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--block", type=int, default=10, help="timed runs per peer per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs before each block")
    parser.add_argument("--torch", action="store_true", help="torch eager as a peer too (bench/zoo.py's order)")
    parser.add_argument("--timing-cache", help="the builds' timing cache (default: none, every build times)")
    parser.add_argument("--zoo-order", action="store_true", help="bench/zoo.py's sequence, chooser start 1 vs 3 runs")
    parser.add_argument("--trials", type=int, default=3, help="--zoo-order: fresh choosers per start-up rule")
    parser.add_argument("--settle", action="store_true",
                        help="--zoo-order: each block first waits SETTLE_S (bench/zoo.py now; before 2026-12-06 not)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for name in args.models.split(","):
        (zoo_order if args.zoo_order else bench_model)(name.strip(), args)


if __name__ == "__main__":
    main()
