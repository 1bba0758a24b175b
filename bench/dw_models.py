"""MobileNetV2 / EfficientNet-B0 whole: kiln with cpu.conv.depthwise_native among its tactics, kiln without it, and
onnxruntime, one process, interleaved blocks (issue 11).

    python bench/dw_models.py --avx2 --threads 1     # both sides capped to AVX2 (bench/cpuid_avx2.py + KILN_CPU_ISA)
    python bench/dw_models.py --threads 2            # uncapped

Both kiln engines are built here (no timing cache): "kiln" lets the autotuner pick between depthwise.c and
oneDNN per depthwise layer (the tactics it took are printed), "kiln -dw" is the same build with the tactic left
out (every other CPU tactic allowed). Wall time per run (--clock thread: the calling thread's CPU time, 1 thread),
medians of --block runs per round; the ratio to
onnxruntime is taken per round.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__" and "--avx2" in sys.argv:
    import cpuid_avx2  # noqa: E402

    cpuid_avx2.enable()  # before torch, onnxruntime or kiln read cpuid
    os.environ["KILN_CPU_ISA"] = "avx2"

import kiln  # noqa: E402,I001  first: kiln/openmp.py chooses the wait policy before torch loads libgomp

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.kernels.cpu import cpu_features  # noqa: E402
from kiln.tactics import registry  # noqa: E402

TACTIC = "cpu.conv.depthwise_native"


def bench_model(name: str, args) -> None:
    exported = zoo.export(name)
    feeds = exported.inputs()
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
    session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)
    registry.load_device("cpu")
    others = [t for t in registry.all_tactics("cpu") if t != TACTIC]
    runners = {}
    for label, tactics in (("kiln", []), ("kiln -dw", others)):
        engine = kiln.build(str(exported.path), tactics=tactics)
        got = engine.run(feeds)
        error = max(float(np.abs(got[n] - w).max()) for n, w in zip(engine.output_names, want))
        depthwise = [s for s in engine.plan.program.steps if s.op_type == "FusedConv"
                     and int(s.attributes.get("group", 1)) > 1]
        on_tactic = sum(s.tactic == TACTIC for s in depthwise)
        print(f"  {label}: largest difference from onnxruntime {error:.1e}; depthwise layers on {TACTIC}: "
              f"{on_tactic} of {len(depthwise)}", flush=True)
        runners[label] = lambda engine=engine: engine.run(feeds)
    runners["onnxruntime"] = lambda: session.run(None, feeds)
    medians: dict[str, list[float]] = {k: [] for k in runners}
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    loads = []
    for _ in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for peer, run in runners.items():
            time.sleep(0.25)  # onnxruntime's worker spins ~50 ms after a call (dw-zen4-2026-12-06.md)
            for _ in range(args.warmup):
                run()
            block = []
            for _ in range(args.block):
                start = clock()
                run()
                block.append((clock() - start) * 1e3)
            medians[peer].append(statistics.median(block))
    print(f"{name}, {cpu_name()} ({cpu_features.describe()}), {args.threads} thread(s), {args.clock} clock, 1-min load "
          f"{min(loads):.1f}-{max(loads):.1f}")
    for peer in runners:
        ratios = [a / b for a, b in zip(medians[peer], medians["onnxruntime"])]
        print(f"  {peer:12s} median of rounds {statistics.median(medians[peer]):7.2f} ms  / onnxruntime by round "
              + " ".join(f"{r:.2f}" for r in ratios) + f"  (median {statistics.median(ratios):.2f})")
    a, b = medians["kiln"], medians["kiln -dw"]
    ab = [x / y for x, y in zip(a, b)]
    print(f"  kiln / kiln -dw by round " + " ".join(f"{r:.2f}" for r in ab) + f"  (median {statistics.median(ab):.2f})",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--avx2", action="store_true")
    parser.add_argument("--models", default="mobilenet_v2,efficientnet_b0")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="thread: the calling thread's CPU time (1 thread only: kiln and onnxruntime then run on "
                             "the calling thread; other work on the CPUs does not count)")
    args = parser.parse_args()
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread measures one thread: give --threads 1")
    torch.set_num_threads(args.threads)
    for name in args.models.split(","):
        bench_model(name.strip(), args)


if __name__ == "__main__":
    main()
