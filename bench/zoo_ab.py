"""Saved kiln engines of one zoo model against each other and onnxruntime, interleaved in one process.

    python bench/zoo_ab.py mobilevit_s main.kiln branch.kiln --rounds 7 --block 10

An A/B of two kiln builds (engines built by two checkouts, e.g. with bench/zoo.py's build or `kiln build`, then
loaded by this checkout's runtime) where bench/zoo.py times one build: on a shared machine the load moves
between two processes' runs, and interleaving the blocks (A, B, onnxruntime, A, ...) in one process puts every
peer in every moment. Prints each peer's median and its ratio to onnxruntime per round, with the 1-min load.
kiln is imported before torch: its OpenMP wait policy is chosen as kiln's users get it (kiln/openmp.py).
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="zoo name (its cached export and example inputs)")
    parser.add_argument("engines", nargs="+", help="saved .kiln engines of that model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=10, help="runs per peer per round")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="'thread': the calling thread's CPU time (with --threads 1 every peer runs there: what "
                             "each costs on a machine others load, without the time it waits for a core)")
    args = parser.parse_args(argv)
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread needs --threads 1: at more threads it leaves out the workers' share")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    torch.set_num_threads(args.threads)
    exported = zoo.export(args.model)
    feeds = exported.inputs()
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)
    runners = {"onnxruntime": lambda: session.run(None, feeds)}
    for path in args.engines:
        engine = kiln.load(path)
        got = engine.run(feeds)
        error = max(float(np.max(np.abs(got[n] - w))) for n, w in zip(engine.output_names, want))
        print(f"{path}: largest difference from onnxruntime {error:.1e}")
        runners[Path(path).name] = lambda engine=engine: engine.run(feeds)
    for run in runners.values():
        run(), run()
    samples: dict[str, list[float]] = {k: [] for k in runners}
    medians: dict[str, list[float]] = {k: [] for k in runners}
    loads = []
    for _ in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for name, run in runners.items():
            block = []
            for _ in range(args.block):
                start = clock()
                run()
                block.append(clock() - start)
            samples[name] += block
            medians[name].append(statistics.median(block))
    print(f"{args.model}, {cpu_name()}, {args.threads} threads, {args.clock} clock, 1-min load {min(loads):.1f}-{max(loads):.1f}")
    for name in runners:
        ratios = [a / b for a, b in zip(medians[name], medians["onnxruntime"])]
        print(f"  {name:32s} median {statistics.median(samples[name]) * 1e3:9.2f} ms   / onnxruntime by round "
              + ", ".join(f"{r:.2f}" for r in ratios) + f"   (median {statistics.median(ratios):.2f})")


if __name__ == "__main__":
    main()
