"""A/B of two versions of kiln's depthwise.c on MobileNetV2's and EfficientNet-B0's depthwise layers (and oneDNN's
jit_dw beside them), one process, interleaved rounds.

    python bench/dw_ab.py --base REV [--avx2] [--threads 1] [--models mnv2,b0] [--layers 96x112]

A: depthwise.c as committed at REV (git show), B: the working tree's. Each layer is bench/dw_kernel.py's (its
channels, size, kernel, stride; MobileNetV2 bias + ReLU6, B0 bias + SiLU, or --activation for all), batch 1, NHWC,
each kernel's bound call through the native loop (a segment's path). Both outputs are checked against torch's
conv2d (float64) first. Time: thread CPU time at 1 thread (the kernel runs on the calling thread: a descheduled
moment on this shared machine is not counted), wall time at more; per round the median of 30 calls, and the table
gives the median of the rounds and B/A (and oneDNN/B) per round's median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__" and "--avx2" in sys.argv:
    import cpuid_avx2  # noqa: E402

    cpuid_avx2.enable()
    os.environ["KILN_CPU_ISA"] = "avx2"

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kiln  # noqa: E402,F401
from dw_kernel import LAYERS, looped  # noqa: E402
from kiln.kernels.cpu import depthwise, native_loop, onednn, onednn_primitives  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="HEAD", help="the git revision of A's depthwise.c")
    parser.add_argument("--avx2", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--models", default="mnv2,b0")
    parser.add_argument("--layers", default="", help="comma-separated CxHW filters (e.g. 96x112,144x56)")
    parser.add_argument("--activation", default="", help="Clip (ReLU6), SiLU, Relu or none for every layer")
    parser.add_argument("--also", action="append", default=[],
                        help="another depthwise.c (a path) timed beside them as C, D, ... (a variant under trial)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(__file__).resolve().parents[1]
    old = subprocess.run(["git", "show", f"{args.base}:kiln/kernels/cpu/depthwise.c"], cwd=root, check=True,
                         capture_output=True, text=True).stdout
    base = native_loop.KernelLibrary("depthwise_base", old, ["kiln_depthwise", "kiln_depthwise_lanes"]).load()
    assert base is not None
    extra = {}
    for k, path in enumerate(args.also):
        extra[chr(ord("C") + k)] = native_loop.KernelLibrary(f"depthwise_{k}", Path(path).read_text(),
                                                             ["kiln_depthwise", "kiln_depthwise_lanes"]).load()
        print(f"{chr(ord('C') + k)} = {path}")
    clock = time.thread_time_ns if args.threads == 1 else time.perf_counter_ns
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    print(f"CPU {cpu}, depthwise.c {depthwise.lanes()} lanes, {args.threads} thread(s), "
          f"{'thread CPU time' if args.threads == 1 else 'wall'}, A = {args.base}, B = working tree")
    print("| model | layer | act | A us | B us | oneDNN us | B/A (rounds) | B/oneDNN | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for model, c, hw, k, s in LAYERS:
        if model not in args.models.split(",") or (args.layers and f"{c}x{hw}" not in args.layers.split(",")):
            continue
        act = args.activation or ("SiLU" if model == "b0" else "Clip")
        act = "" if act == "none" else act
        alpha, beta = (0.0, 6.0) if act == "Clip" else (0.0, 0.0)
        p = k // 2
        xt = torch.from_numpy(rng.standard_normal((1, c, hw, hw), dtype=np.float32))
        wt = torch.from_numpy(rng.standard_normal((c, 1, k, k), dtype=np.float32) * 0.3)
        bt = torch.from_numpy(rng.standard_normal(c, dtype=np.float32))
        nhwc = xt.contiguous(memory_format=torch.channels_last)
        layers = {"A": depthwise.DepthwiseConv(wt, bt, (1, c, hw, hw), [s, s], [p] * 4, act, alpha, beta),
                  "B": depthwise.DepthwiseConv(wt, bt, (1, c, hw, hw), [s, s], [p] * 4, act, alpha, beta)}
        layers["A"].library = base
        for name, lib in extra.items():
            layers[name] = depthwise.DepthwiseConv(wt, bt, (1, c, hw, hw), [s, s], [p] * 4, act, alpha, beta)
            layers[name].library = lib
        dnnl = onednn_primitives.Conv2d(wt, bt, [1, c, hw, hw], [s, s], [p] * 4, [1, 1], c,
                                        onednn.eltwise_for(act, alpha, beta) if act else None, False, False,
                                        prefer="jit_dw:")
        ref = torch.nn.functional.conv2d(xt.double(), wt.double(), bt.double(), s, p, groups=c)
        ref = {"SiLU": torch.nn.functional.silu, "Clip": lambda r: r.clamp(0, 6), "Relu": torch.relu,
               "": lambda r: r}[act](ref)
        size = layers["B"].output_size
        out = {n: torch.empty(size).contiguous(memory_format=torch.channels_last) for n in (*layers, "oneDNN")}
        runs = {n: looped(layers[n].bind(nhwc.data_ptr(), out[n].data_ptr())) for n in layers}
        runs["oneDNN"] = looped(dnnl.bind(nhwc.data_ptr(), out["oneDNN"].data_ptr()))
        for n, run in runs.items():
            run()
            err = ((out[n].double() - ref).abs() / (1 + ref.abs())).max().item()
            if err > 1e-4:
                raise SystemExit(f"{model} {c}x{hw} k{k} s{s}: {n} off by {err:.2e} from torch's conv2d")
        medians: dict[str, list[float]] = {n: [] for n in runs}
        loads = []
        for _ in range(args.rounds):
            for n, run in runs.items():
                for _ in range(3):
                    run()
                times = []
                for _ in range(30):
                    t0 = clock()
                    run()
                    times.append(clock() - t0)
                medians[n].append(statistics.median(times) / 1e3)
            loads.append(os.getloadavg()[0])
        ratio = [b / a for a, b in zip(medians["A"], medians["B"])]
        a, b, d = (statistics.median(medians[n]) for n in ("A", "B", "oneDNN"))
        print(f"| {model} | {c}x{hw}² k{k} s{s} | {act or 'none'} | {a:.1f} | {b:.1f} | {d:.1f} | "
              f"{statistics.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f}) | "
              f"{statistics.median(b_ / d_ for b_, d_ in zip(medians['B'], medians['oneDNN'])):.2f} | "
              f"{min(loads):.1f}-{max(loads):.1f} |"
              + "".join(f" {n}/A {statistics.median(v / a_ for a_, v in zip(medians['A'], medians[n])):.2f}"
                        for n in extra), flush=True)


if __name__ == "__main__":
    main()
