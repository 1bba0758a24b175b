"""A linear layer at a row count it was not built for, CPU: oneDNN's inner product made for that row count (a
primitive created and JIT-compiled) against one matmul primitive with a runtime row count (made once; a row count
binds memory objects only), side by side in one process (issue 10: binding a new shape without new primitives).

    python bench/onednn_rows.py                       # BERT-base's layer shapes, M 1..512, 1 thread
    python bench/onednn_rows.py --threads 2 --rows 1,8,128

Per (layer shape, M): the fixed-M inner product is created the way a new row count is in kiln (weight taken from
the tuned row count's packed copy, kiln/tactics/cpu/onednn_gemm.py), its creation timed; the runtime-M matmul's row
count is bound (MatmulRows + Bound), that timed. Then both run in alternated rounds (ABAB...), median per call.
Times are the calling thread's CPU time at 1 thread; at 2 threads wall time (the worker's CPU time is not the
caller's). Also each one's largest difference from float64 torch on the same input.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kiln.kernels.cpu import onednn, onednn_matmul, onednn_primitives  # noqa: E402

# BERT-base's linear layers: (K, N, activation)
SHAPES = [(768, 768, None), (768, 2304, None), (768, 3072, "gelu_erf"), (3072, 768, None)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,96,128,192,256,333,512")
    ap.add_argument("--tuned-rows", type=int, default=1024, help="the row count the inner product was built at")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time_ns if args.threads == 1 else time.perf_counter_ns
    g = torch.Generator().manual_seed(0)
    print(f"# oneDNN {'.'.join(map(str, onednn.load().version))}, {args.threads} thread(s), "
          f"load average {os.getloadavg()[0]:.1f}, clock {'thread CPU' if args.threads == 1 else 'wall'}")
    print("\n| K x N, act | M | inner product: kernel, create µs, call µs | runtime-M matmul: kernel, bind µs, call µs "
          "| matmul / inner product | max err vs float64 (ip, mm) |")
    print("|---|---|---|---|---|---|")
    for k, n, act in SHAPES:
        w, b = torch.randn(n, k, generator=g) / k ** 0.5, torch.randn(n, generator=g)
        eltwise = onednn.Eltwise(act) if act else None
        tuned = onednn_primitives.InnerProduct(w, b, args.tuned_rows, eltwise, False, False)
        runtime = onednn_matmul.Matmul(w, b, eltwise)
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, generator=g)
            t0 = clock()
            ip = onednn_primitives.InnerProduct(w, b, m, eltwise, False, False, weight_from=tuned)
            create = (clock() - t0) / 1e3
            t0 = clock()
            rows = runtime.rows(m)
            y_mm = torch.empty(m, n)
            bound = rows.bind(x.data_ptr(), y_mm.data_ptr())
            bind = (clock() - t0) / 1e3
            lib = onednn.load()

            def run_mm(bound=bound, lib=lib):
                lib.lib.dnnl_primitive_execute(bound.primitive, lib.stream, bound.nargs, bound.args)

            y_ip = torch.empty(m, n)
            ip_bound = ip.bind(x.data_ptr(), y_ip.data_ptr())

            def run_ip(bound=ip_bound, lib=lib):
                lib.lib.dnnl_primitive_execute(bound.primitive, lib.stream, bound.nargs, bound.args)

            run_mm(), run_ip()
            want = x.double() @ w.double().T + b.double()
            want = torch.nn.functional.gelu(want) if act else want
            errors = [float((y - want).abs().max()) for y in (y_ip, y_mm)]
            reps = max(2, int(3e8 / (m * k * n)))
            times: dict[str, list[float]] = {"ip": [], "mm": []}
            for r in range(args.rounds):
                for name, fn in (("ip", run_ip), ("mm", run_mm))[:: 1 if r % 2 == 0 else -1]:
                    t0 = clock()
                    for _ in range(reps):
                        fn()
                    times[name].append((clock() - t0) / reps / 1e3)
            ip_us, mm_us = statistics.median(times["ip"]), statistics.median(times["mm"])
            print(f"| {k} x {n}{', ' + act if act else ''} | {m} | {ip.implementation}, {create:.0f}, {ip_us:.0f} | "
                  f"{rows.implementation}, {bind:.0f}, {mm_us:.0f} | {mm_us / ip_us:.2f} | "
                  f"{errors[0]:.1e}, {errors[1]:.1e} |", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()
