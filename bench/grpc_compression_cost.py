"""What --grpc-infer-response-compression-level and compressed requests cost kiln's transport per message, on
the event loop: kiln/serve/grpc_compression.py's compress (zlib's default level, gzip and deflate) and decompress
(bounded by the max message size) against zlib at level 1, for tensors as a ModelInferResponse carries them.

    python bench/grpc_compression_cost.py [--repeat 5]

Prints a table: message, bytes, compressed bytes, microseconds (least of --repeat) to compress and decompress.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time
import zlib
from pathlib import Path

import numpy as np

from kiln.serve.grpc_compression import compress, decompress


def _least_us(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    messages = {
        "empty model's answer, FP32 [1,4]": np.arange(4, dtype=np.float32).tobytes(),
        "ResNet-50 logits FP32 [1,1000]": rng.standard_normal(1000).astype(np.float32).tobytes(),
        "image FP32 [1,3,224,224], N(0,1)": rng.standard_normal(3 * 224 * 224).astype(np.float32).tobytes(),
        "image UINT8 [1,3,224,224], smooth": np.repeat(rng.integers(0, 255, 3 * 224 * 28, np.uint8), 8).tobytes(),
        "mask INT64 [8,384], mostly ones": np.ones(8 * 384, np.int64).tobytes(),
    }
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"commit {commit}; CPU {cpu} x {os.cpu_count()}; load average {os.getloadavg()[0]:.2f}; "
          f"least of {args.repeat}")
    print("| message | bytes | encoding | compressed bytes | compress us | decompress us | zlib level 1: bytes, us |\n"
          "|---|---|---|---|---|---|---|")
    for name, message in messages.items():
        for encoding in ("gzip", "deflate"):
            packed = compress(message, encoding)
            c_us = _least_us(lambda: compress(message, encoding), args.repeat)
            d_us = _least_us(lambda: decompress(packed, encoding, len(message)), args.repeat)
            fast = zlib.compress(message, 1)
            f_us = _least_us(lambda: zlib.compress(message, 1), args.repeat)
            print(f"| {name} | {len(message)} | {encoding} | {len(packed)} | {c_us:.0f} | {d_us:.0f} "
                  f"| {len(fast)}, {f_us:.0f} |", flush=True)
    bomb = compress(b"\0" * (64 << 20), "gzip")
    b_us = _least_us(lambda: _refused(bomb), args.repeat)
    print(f"\n64 MiB of zeros as {len(bomb)} bytes of gzip against a 1 MiB limit: refused in {b_us:.0f} us")


def _refused(bomb: bytes) -> None:
    try:
        decompress(bomb, "gzip", 1 << 20)
    except Exception:  # noqa: BLE001 - the refusal is what is timed
        return
    raise AssertionError("the bomb was inflated")


if __name__ == "__main__":
    main()
