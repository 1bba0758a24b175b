"""MobileNetV2 at 2 threads capped to AVX2: tuned engines and an onednn_direct-only one against onnxruntime, timed at
SCHED_FIFO, under the libgomp spin the process has.

    GOMP_SPINCOUNT=300000 python bench/mnv2_spin.py     # libgomp's default spin (what kiln keeps on a quiet machine)
    GOMP_SPINCOUNT=100 python bench/mnv2_spin.py        # what kiln/openmp.py sets when imported on a busy machine

Run the two in alternating processes: libgomp reads the spin once per process. Both sides capped to AVX2 as
bench/zoo_avx2.py caps them. `BUILDS` (2) engines built at SCHED_FIFO (bench/lstm_engine.realtime) with no timing
cache, one built with only cpu.conv.onednn_direct for the convolutions, then interleaved rounds (`ROUNDS`, 9) of
20-run blocks, 50 ms slept before each (bench/lstm_engine.blocks' settle: onnxruntime's pool spins after its block).
Prints each build's convolutions not on onednn_direct, and per runner the median of block medians, its ratio to
onnxruntime's and each round's (bench/results/zoo-cpu-avx2-2026-12-06.md, session 22).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpuid_avx2  # noqa: E402

cpuid_avx2.enable()  # before torch, onnxruntime or kiln read cpuid
os.environ["KILN_CPU_ISA"] = "avx2"

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import kiln  # noqa: E402  (first: KILN_CPU_ISA caps the libraries before their first kernel)
from kiln import zoo  # noqa: E402
from lstm_engine import blocks, realtime  # noqa: E402


def main() -> None:
    import onnxruntime as ort
    import torch

    threads = int(os.environ.get("THREADS", 2))
    torch.set_num_threads(threads)
    exported = zoo.export("mobilenet_v2")
    feeds = exported.inputs()
    print(f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '(libgomp default)')}, {threads} threads", flush=True)
    built = {}
    with realtime(True):
        for i in range(int(os.environ.get("BUILDS", 2))):
            start = time.time()
            engine = kiln.build(str(exported.path), timing_cache=None)
            odd = [(s.name, s.tactic) for s in engine.plan.program.steps
                   if s.op_type == "FusedConv" and s.tactic != "cpu.conv.onednn_direct"]
            print(f"build {i}: {time.time() - start:.1f} s, convolutions not on onednn_direct: {odd}", flush=True)
            built[f"tuned {i}"] = engine
        built["onednn_direct only"] = kiln.build(
            str(exported.path), timing_cache=None,
            tactics=["cpu.conv.onednn_direct", "cpu.gap", "cpu.gemm", "cpu.alias"])
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
    runners = {"onnxruntime": lambda: session.run(None, feeds)}
    runners.update({label: (lambda e=e: e.run(feeds)) for label, e in built.items()})
    load = os.getloadavg()[0]
    with realtime(True):
        times = blocks(runners, rounds=int(os.environ.get("ROUNDS", 9)), runs=20, settle=0.05)
    ref = times["onnxruntime"]
    print(f"load {load:.2f} -> {os.getloadavg()[0]:.2f}")
    for label, values in times.items():
        median = statistics.median(values)
        print(f"  {label:<20} {median:.3f} ms  / ort {median / statistics.median(ref):.2f}  by round "
              + " ".join(f"{v / o:.2f}" for v, o in zip(values, ref)))


if __name__ == "__main__":
    main()
