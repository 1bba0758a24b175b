"""The LSTM forecaster's two layers alone (96 steps, batch 8, 128 units, I = 16 and 128) on lstm_fused.c's block split
at two threads in its three forms, beside onnxruntime's LSTM, in one process: after (whole-slice claims, x parts
computed ahead of the step's barrier), whole slices with the x parts after the barrier, and before (item claims).

    python bench/lstm_barrier_layers.py --avx2                 # capped to AVX2 (bench/zoo_avx2.py's cap)
    python bench/lstm_barrier_layers.py --avx2 --rounds 40 --runs 15

Interleaved rounds at SCHED_FIFO (bench/lstm_engine.realtime, root), 50 ms settle before each block, wall clock. Per
runner: median and lower quartile of the block medians (on a loaded VM other work only adds time), each over
onnxruntime's, the median per-round ratio, and the loop's own numbers from the plan (plan.waited_ns: the longest
a thread waited at the barriers; plan.ahead). Every output is checked against onnxruntime's first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--avx2" in sys.argv:  # before torch, onnxruntime or kiln read cpuid (bench/zoo_avx2.py checks MLAS obeys)
    import cpuid_avx2

    cpuid_avx2.enable()
    os.environ["KILN_CPU_ISA"] = "avx2"

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import kiln  # noqa: E402, F401  (first: KILN_CPU_ISA caps the libraries before their first kernel)
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.kernels.cpu import recurrent  # noqa: E402
from lstm_engine import blocks, realtime  # noqa: E402
from recurrent_layer_ab import HIDDEN, STEPS, onnxruntime_layer  # noqa: E402

FORMS = {"after": (True, True), "whole slices, x after the barrier": (True, False), "before": (False, False)}


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--avx2", action="store_true", help="kiln and onnxruntime on an AVX2-only CPU (cpuid masked)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(2)
    kernel = next(k for k in recurrent.fused_kernels() if k.supported and not k.test_only)
    rng = np.random.default_rng(0)
    runs, plans = {}, {}
    for inputs in (16, 128):
        w, r = (rng.standard_normal((4 * HIDDEN, k)).astype(np.float32) * 0.1 for k in (inputs, HIDDEN))
        b = rng.standard_normal(8 * HIDDEN).astype(np.float32) * 0.1
        x = rng.standard_normal((STEPS, 8, inputs)).astype(np.float32)
        session = onnxruntime_layer(w, r, b, 8, 2)
        want = session.run(None, {"x": x})[0][:, 0]
        runs[("onnxruntime", inputs)] = lambda s=session, x=x: s.run(None, {"x": x})
        xt = torch.from_numpy(x)
        for name, (whole, ahead) in FORMS.items():
            layer = recurrent.FusedLSTMDirection(torch.from_numpy(w), torch.from_numpy(r), torch.from_numpy(b),
                                                 kernel=kernel, split="blocks")
            y = torch.empty(STEPS, 8, HIDDEN)

            def run(layer=layer, y=y, key=(name, inputs), whole=whole, ahead=ahead) -> None:
                recurrent.set_whole_slices(whole)
                recurrent.set_fused_ahead(ahead)
                plan = layer.run(xt, y, None, None, None, None, reverse=False, batch_major=False)
                plans.setdefault(key, []).append((plan.waited_ns, plan.ahead))

            run()
            error = float(np.abs(y.numpy() - want).max())
            if error > 1e-5:
                raise SystemExit(f"{name} I={inputs}: Y differs from onnxruntime's by {error:.2e}")
            runs[(name, inputs)] = run
    load = os.getloadavg()[0]
    with realtime(True):
        times = blocks(runs, args.rounds, args.runs, settle=0.05)
    recurrent.set_whole_slices(True)
    recurrent.set_fused_ahead(True)
    print(f"# One layer ({STEPS} steps, batch 8, {HIDDEN} units), {cpu_name()}, "
          f"{'AVX2 only' if args.avx2 else 'native ISA'}, 2 threads, {kernel.name}, wall ms, SCHED_FIFO, "
          f"1-min load {load:.2f} -> {os.getloadavg()[0]:.2f}\n")
    print("| I | runner | median | / ort | q1 | / ort | per-round ratio (median) | waited us | ahead |")
    print("|---|---|---|---|---|---|---|---|---|")
    q1 = lambda v: sorted(v)[len(v) // 4]  # noqa: E731
    for (name, inputs), values in times.items():
        ort = times[("onnxruntime", inputs)]
        ratio = statistics.median(a / o for a, o in zip(values, ort))
        waited = f"{statistics.median(p[0] for p in plans[(name, inputs)]) / 1e3:.0f}" if name in FORMS else ""
        ahead = str(plans[(name, inputs)][-1][1]) if name in FORMS else ""
        print(f"| {inputs} | {name} | {statistics.median(values):.3f} | "
              f"{statistics.median(values) / statistics.median(ort):.3f} | {q1(values):.3f} | "
              f"{q1(values) / q1(ort):.3f} | {ratio:.3f} | {waited} | {ahead} |")


if __name__ == "__main__":
    main()
