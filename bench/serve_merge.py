"""The batcher's merge of a call's requests (kiln/serve/batcher.py merge_rows), side by side: each part copied by
Python with the GIL held (the path every plain batch took before 2026-12-07) against one np.concatenate where every
part is small (NUMPY_HELD_ELEMENTS), for BERT's requests (input_ids and attention_mask, [1, seq] int64 each) and
MobileNetV2's (a [1, 3, 224, 224] FP16 image: large parts, the per-part path either way).

    python bench/serve_merge.py                     # requests per call 8 16 33 60, 5 interleaved rounds
    python bench/serve_merge.py --requests 60 --rounds 9

Times are the median of many merges per round (the calling thread's wall clock, no other thread running); the table
gives the median over rounds and their spread (min-max). A call merges each input: BERT's two inputs cost twice a row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kiln.serve import batcher  # noqa: E402

CASES = {"bert token row [1, 128] int64": ((1, 128), np.int64),
         "image [1, 3, 224, 224] fp16": ((1, 3, 224, 224), np.float16)}  # a control: large parts, one path both sides


def _time(parts: list[np.ndarray], repeats: int) -> float:
    batcher.merge_rows(parts)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        batcher.merge_rows(parts)
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[8, 16, 33, 60])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    generator = np.random.default_rng()
    held = batcher.NUMPY_HELD_ELEMENTS
    results: dict[tuple, dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for case, (shape, dtype) in CASES.items():
            for n in args.requests:
                parts = [generator.integers(0, 30000, shape).astype(dtype) for _ in range(n)]  # fresh each round
                for part in parts:
                    part.flags.writeable = False  # as a request's views of its buffer
                repeats = 400 if shape[-1] == 128 else 10
                for path, limit in (("per part", 0), ("one concatenate", held)):  # A B, every round
                    batcher.NUMPY_HELD_ELEMENTS = limit
                    results.setdefault((case, n), {}).setdefault(path, []).append(_time(parts, repeats))
    batcher.NUMPY_HELD_ELEMENTS = held
    load = os.getloadavg()[0]
    print(f"merge_rows, {args.rounds} rounds, load {load:.1f}; us per merged input, median (min-max over rounds)\n")
    print("| parts | requests | per part (before) | one concatenate where small (now) | now / before |")
    print("|---|---|---|---|---|")
    for (case, n), paths in results.items():
        a, b = paths["per part"], paths["one concatenate"]
        ratio = statistics.median(b) / statistics.median(a)
        print(f"| {case} | {n} | {statistics.median(a):.1f} ({min(a):.1f}-{max(a):.1f}) "
              f"| {statistics.median(b):.1f} ({min(b):.1f}-{max(b):.1f}) | {ratio:.2f} |")


if __name__ == "__main__":
    main()
