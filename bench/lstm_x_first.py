"""lstm_fused.c's x parts first (kiln_lstm_fused_x_first) against each step's tile computing them, one LSTM layer of
the forecaster's sizes (96 steps, 128 units) in one process, on and off in interleaved rounds.

    python bench/lstm_x_first.py                         # I = 16 and 128; 1 thread (4 rows) and 2 threads (8 rows)
    sudo chrt -f 10 python bench/lstm_x_first.py         # the cores its own on a shared machine

1 thread: the thread's CPU time of a call (4 rows: one slice of the row split). 2 threads: each slice's wall time from
lstm_fused.c's trace, in calls where both slices started within 50 us of each other (both cores streaming at once,
which is where the L3 traffic the x pass saves is shared). kiln_lstm_fused_x_first_inputs is lowered to 16 here so
that both sizes can run both ways (the library's rule: I >= 64). Reported: medians (and p10 for the slices) of each
side, and the median over rounds of the on / off ratio.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lstm_timeline import _Trace  # noqa: E402

from kiln.kernels.cpu import recurrent  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--calls", type=int, default=25)
    args = ap.parse_args()
    lib = recurrent.load()
    if lib is None:
        raise SystemExit(f"kiln's recurrent library is not built: {recurrent.reason()}")
    ctypes.c_long.in_dll(lib, "kiln_lstm_fused_x_first_inputs").value = 16  # before any layer's scratch is sized
    x_first = ctypes.c_int.in_dll(lib, "kiln_lstm_fused_x_first")
    tracing = ctypes.c_int.in_dll(lib, "kiln_lstm_fused_tracing")
    count = ctypes.c_long.in_dll(lib, "kiln_lstm_fused_trace_count")
    traces = (_Trace * 4096).in_dll(lib, "kiln_lstm_fused_traces")
    steps, hidden = 96, 128
    from kiln.builder.timing_cache import cpu_name

    print(f"# x parts first, one LSTM layer ({steps} steps, {hidden} units), {cpu_name()}, 1-min load "
          f"{os.getloadavg()[0]:.2f}, {args.rounds} rounds of {args.calls} calls a side\n")
    print("| threads, rows | I | off ms | x first ms | on / off (median of rounds) | slices together off / on |")
    print("|---|---|---|---|---|---|")
    for threads, batch in ((1, 4), (2, 8)):
        torch.set_num_threads(threads)
        for inputs in (16, 128):
            torch.manual_seed(0)
            w, r = torch.randn(4 * hidden, inputs) * 0.2, torch.randn(4 * hidden, hidden) * 0.2
            b, x = torch.randn(8 * hidden) * 0.2, torch.randn(steps, batch, inputs)
            y = torch.empty(steps, batch, hidden)
            layer = recurrent.FusedLSTMDirection(w, r, b, split="rows")
            run = lambda: layer.run(x, y, None, None, None, None, reverse=False, batch_major=False)  # noqa: E731
            rounds: dict[int, list[float]] = {0: [], 1: []}
            slices: dict[int, list[float]] = {0: [], 1: []}
            together = {0: 0, 1: 0}
            for k in range(args.rounds):
                for mode in (0, 1) if k % 2 else (1, 0):
                    x_first.value = mode
                    for _ in range(3):
                        run()
                    if threads == 1:
                        ms = []
                        for _ in range(args.calls):
                            start = time.thread_time_ns()
                            run()
                            ms.append((time.thread_time_ns() - start) / 1e6)
                        rounds[mode].append(statistics.median(ms))
                        continue
                    tracing.value, first = 1, count.value
                    for _ in range(args.calls):
                        run()
                    tracing.value = 0
                    ms = []
                    for i in range(first, count.value):
                        t = traces[i % 4096]
                        if t.slices == 2 and abs(t.slice_start[1] - t.slice_start[0]) < 50_000:
                            together[mode] += 1
                            ms += [(t.slice_end[q] - t.slice_start[q]) / 1e6 for q in range(2)]
                    slices[mode] += ms
                    rounds[mode].append(statistics.median(ms) if ms else float("nan"))
            x_first.value = 1
            ratio = statistics.median(a / b for a, b in zip(rounds[1], rounds[0]))
            if threads == 1:
                print(f"| 1, {batch} (thread CPU) | {inputs} | {statistics.median(rounds[0]):.3f} | "
                      f"{statistics.median(rounds[1]):.3f} | {ratio:.3f} | |")
            else:
                def cell(v):
                    return f"{np.percentile(v, 50):.3f} (p10 {np.percentile(v, 10):.3f})" if v else "-"
                print(f"| 2, {batch} (a slice's wall) | {inputs} | {cell(slices[0])} | {cell(slices[1])} | {ratio:.3f} | "
                      f"{together[0]} / {together[1]} of {args.rounds * args.calls} |")


if __name__ == "__main__":
    main()
