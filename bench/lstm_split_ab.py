"""One LSTM layer on lstm_fused.c at 2 threads with the batch's rows split between the threads (cpu.lstm.fused) and
with each step's unit blocks split (cpu.lstm.fused_blocks), and each of the CPU's tiles (AVX-512, AVX2), in one process.

    python bench/lstm_split_ab.py --threads 2 --realtime
    python bench/lstm_split_ab.py --threads 1 --realtime       # the tiles alone (both splits are one thread's)

The zoo LSTM forecaster's layer (96 steps, 128 units, batch 8) at inputs 16 and 128. Which split wins depends on the
CPU (lstm_fused.c's note on kiln_lstm_fused_row_split; bench/results/small-zen4-2026-12-06.md), so the builder times
both. Interleaved rounds, each runner's block of `--runs` calls after 5 warm-up, wall clock, median of block medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.kernels.cpu import recurrent  # noqa: E402
from lstm_engine import blocks, realtime  # noqa: E402

STEPS, HIDDEN = 96, 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--realtime", action="store_true", help="time the rounds at SCHED_FIFO priority (root)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels = [k for k in recurrent.fused_kernels() if k.supported and not k.test_only and k.units > 4]
    rng = np.random.default_rng(0)
    runs = {}
    for inputs in (16, 128):
        w, r = (torch.from_numpy(rng.standard_normal((4 * HIDDEN, k)).astype(np.float32) * 0.1) for k in (inputs, HIDDEN))
        b = torch.from_numpy(rng.standard_normal(8 * HIDDEN).astype(np.float32) * 0.1)
        x = torch.from_numpy(rng.standard_normal((STEPS, args.batch, inputs)).astype(np.float32))
        for kernel in kernels:
            for split in ("rows", "blocks"):
                layer = recurrent.FusedLSTMDirection(w, r, b, kernel=kernel, split=split)
                y = torch.empty(STEPS, args.batch, HIDDEN)
                runs[(inputs, kernel.name.split(" ")[0], split)] = (
                    lambda layer=layer, x=x, y=y: layer.run(x, y, None, None, None, None, reverse=False,
                                                            batch_major=False))
    load = os.getloadavg()[0]
    with realtime(args.realtime):
        times: dict[tuple, list[float]] = blocks(runs, args.rounds, args.runs, rotate=False)
    print(f"# One LSTM layer ({STEPS} steps, batch {args.batch}, {HIDDEN} units), {cpu_name()}, {args.threads} "
          f"thread(s), wall ms{', SCHED_FIFO' if args.realtime else ''}, 1-min load {load:.2f} -> "
          f"{os.getloadavg()[0]:.2f}\n")
    print("| I | tile | split | ms | by round |\n|---|---|---|---|---|")
    for (inputs, tile, split), values in times.items():
        print(f"| {inputs} | {tile} | {split} | {statistics.median(values):.3f} | "
              f"{', '.join(f'{v:.3f}' for v in values)} |")


if __name__ == "__main__":
    main()
