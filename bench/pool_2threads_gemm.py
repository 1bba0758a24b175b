"""kiln's packed GEMM alone at llama_tiny's and MiniLM's shapes: 1 thread vs 2 threads on kiln's pool vs 2 on
OpenMP, interleaved in one process (modes rotate by round), each call from Python through ctypes (~2 µs).

    python bench/pool_2threads_gemm.py [--rounds 8] [--calls 40] [--shapes 512x64x1024,...]

A shape is MxKxN[:activation]; per round and mode the median of --calls calls (wall clock); the table gives the
median over rounds, the spread, and in how many rounds a 2-thread mode beat 1 thread. Outputs are compared with
1 thread's (bit-identical expected).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kiln  # noqa: E402,F401  before torch: kiln chooses OpenMP's wait policy
import numpy as np  # noqa: E402
import torch  # noqa: E402

from kiln.kernels.cpu import gemm_native  # noqa: E402
from pool_2threads import set_mode  # noqa: E402

# llama_tiny at 8x64 (512 rows): LM head, SwiGLU gate|up (176 wide), down; at 4x33 (132 rows) the same;
# all-MiniLM-L6-v2 at 128 tokens: QKV, FFN up (GELU), FFN down
SHAPES = ("512x64x1024,512x64x352:SwiGLU,512x176x64,132x64x1024,132x64x352:SwiGLU,"
          "128x384x1152,128x384x1536:Gelu,128x1536x384")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--modes", default="1t,2t-pool,2t-omp")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=40)
    args = ap.parse_args()
    lib = gemm_native.load()
    rng = np.random.default_rng(0)
    layers = {}
    for spec in args.shapes.split(","):
        dims, _, act = spec.partition(":")
        m, k, n = (int(v) for v in dims.split("x"))
        w = torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32) / k ** 0.5)
        b = torch.from_numpy(rng.standard_normal(n, dtype=np.float32))
        layer = gemm_native.PackedLinear(w, b, act)
        x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
        y = torch.empty(m, layer.n)
        plan, scratch = layer.plan(m)
        plan.src, plan.dst = x.data_ptr(), y.data_ptr()
        layers[spec] = (layer, x, y, plan, scratch)
    modes = args.modes.split(",")
    results: dict[tuple[str, str], list[float]] = {}
    stats: dict[tuple[str, str], list[int]] = {}  # loops, worker items, wait ns, parks (pool.c's kiln_pool_stats)
    counters = (ctypes.c_long * 6)()
    reference, identical = {}, {}
    set_mode("1t")
    for spec, (layer, x, y, plan, _) in layers.items():
        lib.kiln_gemm(ctypes.addressof(plan), None, 0, None)
        reference[spec] = y.clone()
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        for mode in order:
            set_mode(mode)
            for spec, (layer, x, y, plan, _) in layers.items():
                address = ctypes.addressof(plan)
                for _ in range(3):
                    lib.kiln_gemm(address, None, 0, None)
                times = []
                lib.kiln_pool_stats(counters)
                before = list(counters)
                for _ in range(args.calls):
                    start = time.perf_counter_ns()
                    lib.kiln_gemm(address, None, 0, None)
                    times.append((time.perf_counter_ns() - start) / 1e3)
                results.setdefault((spec, mode), []).append(statistics.median(times))
                lib.kiln_pool_stats(counters)
                total = stats.setdefault((spec, mode), [0] * 7)
                for i in range(6):
                    total[i] += counters[i] - before[i]
                total[6] += args.calls
                identical[(spec, mode)] = identical.get((spec, mode), True) and torch.equal(y, reference[spec])
        loads.append(os.getloadavg()[0])
    print(f"1-min load {min(loads):.2f}-{max(loads):.2f}; {args.rounds} rounds x {args.calls} calls")
    print("| M x K x N | " + " | ".join(f"{m} µs (spread)" for m in modes) + " | pool / 1t (rounds < 1) | "
          "omp / 1t (rounds < 1) | pool / omp (rounds < 1) | pool / pool0 (rounds < 1) | pool / poolS (rounds < 1) |")
    print("|---" * (len(modes) + 6) + "|")
    for spec in layers:
        cells = [f"{statistics.median(results[(spec, m)]):.0f} ({min(results[(spec, m)]):.0f}-"
                 f"{max(results[(spec, m)]):.0f})" for m in modes]

        def ratio(a: str, b: str) -> str:
            if (spec, a) not in results or (spec, b) not in results:
                return "-"
            q = [u / v for u, v in zip(results[(spec, a)], results[(spec, b)])]
            return f"{statistics.median(q):.3f} ({sum(v < 1 for v in q)}/{len(q)})"
        cells += [ratio("2t-pool", "1t"), ratio("2t-omp", "1t"), ratio("2t-pool", "2t-omp"), ratio("2t-pool", "2t-pool0"), ratio("2t-pool", "2t-poolS")]
        print(f"| {spec} | " + " | ".join(cells) + " |")
    print("\nkiln's pool per call (pool.c's kiln_pool_stats): loops, items the worker ran, µs the caller waited for "
          "them, worker parks, worker items on the caller's CPU, loops left to the caller")
    for (spec, mode), (loops, items, wait, parks, shared, aside, calls) in stats.items():
        if mode.startswith("2t-pool"):  # pool0 included
            print(f"  {spec} {mode}: {loops / calls:.2f} loops, {items / calls:.2f} worker items, "
                  f"{wait / calls / 1e3:.1f} µs waited, {parks / calls:.2f} parks, {shared / calls:.2f} worker items on "
                  f"the caller's CPU, {aside / calls:.2f} loops left to the caller")
    print("bit-identical to 1 thread:", all(identical.values()), [k for k, v in identical.items() if not v])


if __name__ == "__main__":
    main()
