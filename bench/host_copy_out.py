"""Issue 14, the host side of a CUDA call's numpy outputs, on any machine (no GPU): what each path costs the CPU after
the bytes are in host memory.

    python bench/host_copy_out.py                 # BERT-base's last_hidden_state, fp32 [rows, 128, 768], rows 12 32 64
    python bench/host_copy_out.py --rounds 9 --rows 12,64

Paths, timed side by side, interleaved round by round (A B C A B C ...), medians of the rounds:
- "torch.empty (pageable)": a fresh tensor from torch's CPU allocator written once, what `tensor.cpu()` allocates and
  the driver's staged copy then writes (kiln/ir/dtypes.py torch_to_numpy, the path today) — its page faults
  included, not the DMA, nor the driver's chunking;
- "numpy copy out of a buffer": a fresh numpy array copied from a buffer kept across calls (host staging "copy",
  kiln/runtime/host_staging.py: the context's pinned buffer, here plain memory);
- "view (handed over)": host staging "pinned": a numpy view of the block, no copy.
Each round's arrays are dropped before the next, as a served answer's are after it is sent.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="12,32,64")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)  # a served instance's thread; torch's intra-op pool would take the other cores
    print(f"torch {torch.__version__}, numpy {np.__version__}, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.2f}; ms per output, median of {args.rounds} interleaved rounds (min-max)")
    print("| rows | MB | torch.empty (pageable) + write | numpy copy out of a buffer | view (handed over) |")
    print("|---|---|---|---|---|")
    for rows in [int(r) for r in args.rows.split(",")]:
        shape = (rows, args.seq, args.width)
        source = torch.randn(shape)  # the bytes as the DMA leaves them in the pinned buffer
        buffer = source.numpy()

        def pageable() -> object:
            out = torch.empty(shape)  # tensor.cpu()'s allocation
            out.copy_(source)  # the driver's staged copy writes every page once
            return out.numpy()

        def copy_out() -> object:
            return buffer.copy()

        def view() -> object:
            return source.numpy()

        paths = (pageable, copy_out, view)
        times: list[list[float]] = [[] for _ in paths]
        for _ in range(args.rounds + 1):  # the first round warms up, not kept
            for k, path in enumerate(paths):
                t = time.perf_counter()
                out = path()
                times[k].append((time.perf_counter() - t) * 1e3)
                del out
        cells = []
        for ts in times:
            kept = ts[1:]
            cells.append(f"{statistics.median(kept):.3f} ({min(kept):.3f}-{max(kept):.3f})")
        print(f"| {rows} | {source.numel() * 4 / 1e6:.1f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
