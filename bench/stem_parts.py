"""ResNet-50's stem (7x7/2, 3 -> 64 channels, batch 256 at 224x224) on the GPU, in parts: the layer kiln's int8
and FP8 engines run on the dequantized tactic (cuda.qconv.dequantized: dequantize x, cuDNN fp16 convolution,
requantize) at ~1 ms, its fp16 convolution alone ~0.55 ms (bench/results/qconv-2026-12-02.md). Which memory
format and cuDNN algorithm search the convolution wants with 3 input channels, and what the two passes cost.

    python3 bench/stem_parts.py [--out DIR]

ms per call: 20 calls in one CUDA graph, median of 10 replays (bench/gpu.py); every convolution variant is first
compared with the NCHW one (fp16 tolerance).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kiln.kernels.cuda.triton import qelementwise  # noqa: E402
from kiln.kernels.cuda.triton.qgemm import Epilogue  # noqa: E402


def main() -> None:
    from gpu import graph_ms

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    xq = torch.randint(-128, 128, (256, 3, 224, 224), device="cuda", generator=g, dtype=torch.int8)
    w = torch.randn(64, 3, 7, 7, device="cuda", generator=g, dtype=torch.float16) * 0.05
    x16 = qelementwise.dequantize(xq, 0.02, 0.0, torch.float16)
    want = F.conv2d(x16, w, None, 2, 3)
    lines = ["| what | ms | check |", "|---|---|---|"]
    rows = {}
    for layout in ("NCHW", "NHWC"):
        fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
        xl, wl = x16.contiguous(memory_format=fmt), w.contiguous(memory_format=fmt)
        for search in (False, True):
            torch.backends.cudnn.benchmark = search
            got = F.conv2d(xl, wl, None, 2, 3)
            error = float((got.float() - want.float()).abs().max() / want.float().abs().max())
            rows[f"cuDNN fp16 conv, {layout} in and out, cudnn.benchmark {search}"] = (
                graph_ms(lambda xl=xl, wl=wl: F.conv2d(xl, wl, None, 2, 3)), f"{'ok' if error < 2e-3 else 'WRONG'} "
                f"({error:.1e} of max)")
    torch.backends.cudnn.benchmark = False
    xq_cl = xq.contiguous(memory_format=torch.channels_last)
    rows["x int8 NCHW -> channels-last copy"] = (graph_ms(lambda: xq.contiguous(memory_format=torch.channels_last)),
                                                 "—")
    rows["dequantize x (NCHW, int8 -> fp16)"] = (graph_ms(lambda: qelementwise.dequantize(xq, 0.02, 0.0,
                                                                                            torch.float16)), "—")
    rows["dequantize x (channels-last)"] = (graph_ms(lambda: qelementwise.dequantize(xq_cl, 0.02, 0.0,
                                                                                      torch.float16)), "—")
    acc = want.contiguous(memory_format=torch.channels_last)
    epilogue = Epilogue(torch.ones(64, device="cuda"), torch.zeros(64, device="cuda"), torch.int8, y_scale=0.05,
                        y_zero=-128.0, activation="Relu")
    rows["requantize fp16 [256, 64, 112, 112] NHWC -> int8"] = (
        graph_ms(lambda: qelementwise.requantize(acc, epilogue, 1)), "—")
    rows["requantize, NCHW conv output"] = (graph_ms(lambda: qelementwise.requantize(want, epilogue, 1)), "—")
    for what, (ms, check) in rows.items():
        lines.append(f"| {what} | {ms:.4f} | {check} |")
    table = "\n".join(lines)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "stem_parts.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
