"""kiln's packed GEMM alone at BERT-base's FFN-up width and its neighbours, at 1 and 2 threads interleaved in one
process, with the weight and the output warm in L3 or rotated over copies (from DRAM, as in a network): whether
a GEMM's N (its W's size, its C rows' stride) or the split of the panels over two threads costs anything.

    python bench/gemm_split.py [--shapes 128x768x2304,128x768x3072,128x768x3072:Gelu] [--threads 1,2]
                               [--copies 1,8] [--rounds 7] [--realtime] [--native]

Why: bench/results/packed-2026-12-06.md section 8.3 read BERT-base's FFN up (128 x 768 x 3072) at 2 threads ~10
points of the FMA peak below its QKV (128 x 768 x 2304) for every library, at a load of 12-16. This times the
kiln side alone, each call from C (packed_small_k.py's timer): per round, for each thread count, copies and shape,
the median of ~50 ms of calls; the table gives the median over rounds (wall clock; `--realtime`: the rounds at
SCHED_FIFO, root, so that the other work on a shared machine waits). `--copies C`: C layers of the shape, each
with its own packed W and output, called in turn (C = 8: 75 MB of W, past the 32 MB L3); 1: one layer, W and C
warm. Capped to AVX2 (KILN_CPU_ISA=avx2: the 6x16 tile) unless `--native`. Outputs are checked against float64.
The % column is of the threads' FMA peak (one core's measured by bench/gemm.py's chains, times the threads).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--native" not in sys.argv:
    os.environ.setdefault("KILN_CPU_ISA", "avx2")  # before kiln loads (cpu_features.cap_libraries)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from gemm import cpu_facts, measured_peak  # noqa: E402  bench/gemm.py
from lstm_engine import realtime  # noqa: E402  bench/lstm_engine.py
from packed_small_k import TIMER  # noqa: E402

from kiln.kernels.cpu import gemm_native, native_loop  # noqa: E402


def layers_of(m: int, k: int, n: int, act: str, copies: int, fn: int, timer):
    """A pass over `copies` layers of the shape (distinct W and output each): seconds per GEMM; and what it keeps."""
    rng = np.random.default_rng(m * 7 + k * 3 + n)
    x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
    keep = [x]
    plans = []
    for c in range(copies):
        w = torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32) / k ** 0.5)
        b = torch.from_numpy(rng.standard_normal(n, dtype=np.float32))
        layer = gemm_native.PackedLinear(w, b, act)
        y = torch.empty(m, n)
        plan, scratch = layer.plan(m)
        plan.src, plan.dst = x.data_ptr(), y.data_ptr()
        plans.append(plan)
        keep += [layer, y, plan, scratch]
        layer_call = (ctypes.c_void_p * 1)(fn), (ctypes.c_void_p * 1)(ctypes.addressof(plan))
        timer(1, *layer_call, (ctypes.c_int * 1)(0), (ctypes.c_void_p * 1)(0), None, None, None, 0)
        want = torch.nn.functional.linear(x.double(), w.double(), b.double())
        if act == "Gelu":
            want = torch.nn.functional.gelu(want)
        error = (y.double() - want).abs().max().item()
        assert error <= 1e-4 * max(want.abs().max().item(), 1.0), f"{m}x{k}x{n}{act}: max error {error:.3g}"
    fns = (ctypes.c_void_p * copies)(*[fn] * copies)
    objects = (ctypes.c_void_p * copies)(*[ctypes.addressof(p) for p in plans])
    nargs, args = (ctypes.c_int * copies)(*[0] * copies), (ctypes.c_void_p * copies)(*[0] * copies)

    def run() -> float:
        return timer(copies, fns, objects, nargs, args, None, None, None, 0) / copies

    return run, keep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="128x768x2304,128x768x3072,128x768x3072:Gelu",
                    help="MxKxN[:Gelu],... (BERT-base: QKV, FFN up without and with its GELU)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--copies", default="1,8", help="layers per shape called in turn: 1 warm, 8 from DRAM")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--realtime", action="store_true", help="the rounds at SCHED_FIFO (root)")
    ap.add_argument("--native", action="store_true", help="kiln's tile for this CPU (no AVX2 cap)")
    args = ap.parse_args()
    shapes = []
    for part in args.shapes.split(","):
        dims, _, act = part.partition(":")
        if act not in ("", "Gelu"):
            ap.error(f"{part}: the oracle here knows no activation but Gelu")
        shapes.append((*(int(v) for v in dims.split("x")), act))
    threads = [int(t) for t in args.threads.split(",")]
    copies = [int(c) for c in args.copies.split(",")]
    built = native_loop.build("bench_pass", TIMER)
    if isinstance(built, str):
        raise SystemExit(built)
    timer = ctypes.CDLL(str(built)).kiln_bench_pass
    timer.restype = ctypes.c_double
    timer.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_void_p] * 3 + [ctypes.c_int]
    lib = gemm_native.load()
    fn = ctypes.cast(lib.kiln_gemm, ctypes.c_void_p).value
    name, _, per_cycle = cpu_facts()
    core_peak = measured_peak(1, per_cycle, True)
    runs = {}
    for c in copies:
        for m, k, n, act in shapes:
            runs[(c, m, k, n, act)] = layers_of(m, k, n, act, c, fn, timer)
    load = os.getloadavg()[0]
    pool = ctypes.c_int.in_dll(lib, "kiln_pool_enabled").value
    print(f"# {name}; kiln's tile {gemm_native.linear_kernel().name}; loops on {'kiln pool' if pool else 'OpenMP'}; "
          f"one core's FMA peak {core_peak:.1f} GFLOP/s; wall{', SCHED_FIFO' if args.realtime else ''}; "
          f"load {load:.2f}", flush=True)
    times: dict = {(t, key): [] for t in threads for key in runs}
    with realtime(args.realtime):
        for r in range(args.rounds):
            for t in threads[r % len(threads):] + threads[:r % len(threads)]:
                torch.set_num_threads(t)
                for key, (run, _) in runs.items():
                    flops = 2 * key[1] * key[2] * key[3]
                    run()
                    calls = max(3, int(0.05 / (flops * key[0] / (0.8e9 * core_peak * t))))
                    times[(t, key)].append(statistics.median(run() for _ in range(calls)))
    print("| copies | M x K x N (act) | threads | us per GEMM | % of the threads' peak | % by round |")
    print("|---|---|---|---|---|---|")
    for (t, key), ts in times.items():
        c, m, k, n, act = key
        flops = 2 * m * k * n
        share = [100 * flops / v / 1e9 / (core_peak * t) for v in ts]
        print(f"| {c} | {m} x {k} x {n}{' ' + act if act else ''} | {t} | {1e6 * statistics.median(ts):.0f} | "
              f"{statistics.median(share):.1f}% | {', '.join(f'{s:.0f}' for s in share)} |")
    print(f"load {load:.2f} -> {os.getloadavg()[0]:.2f} (1-min average, {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
