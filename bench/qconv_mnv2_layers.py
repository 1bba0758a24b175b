"""MobileNetV2's int8 convolutions one by one: oneDNN fp32 and int8 against kiln's own int8 kernels.

    python bench/qconv_mnv2_layers.py --avx2                 # every library capped to AVX2 (bench/cpuid_avx2.py)
    python bench/qconv_mnv2_layers.py --avx2 --kinds 1x1 --rounds 15

Per layer of MobileNetV2 (batch 1, 224², every distinct shape once), peers on the same input, one thread, the calling
thread's CPU time of each call, interleaved: every peer once per round, `--rounds` rounds of `--calls` calls each;
the table gives each peer's median and the ratios to oneDNN int8 (kiln's tactic before kiln's kernels came) and to
the float layer. Peers:

    fp32 oneDNN        the float layer (kiln's fp32 tactic: cpu.conv.onednn_direct's primitive)
    fp32 kiln dw       depthwise layers: kiln's float depthwise.c (cpu.conv.depthwise_native)
    int8 oneDNN        cpu.qconv.onednn: u8 source, s8 7-bit weights, uint8 output requantized
    int8 kiln          cpu.qconv.kiln_i8 (1x1: i8gemm.c on the NHWC rows) / cpu.qconv.kiln_dw (depthwise: qdepthwise.c)

Weights 7-bit (onnxruntime's reduce_range), per output channel; Clip(0, 6) fused as MobileNetV2's ReLU6 on the expand
and depthwise layers, none on the projections. The load average is printed beside the table: on a shared machine
read the ratios of peers measured in the same rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--avx2" in sys.argv:  # every library on an AVX2-only CPU (bench/zoo_avx2.py's caps), before any loads
    import cpuid_avx2  # noqa: E402

    cpuid_avx2.enable()
    os.environ["KILN_CPU_ISA"] = "avx2"

import kiln  # noqa: E402, F401  (first: KILN_CPU_ISA caps the libraries before their first kernel)
import torch  # noqa: E402

from kiln.kernels.cpu import cpu_features, depthwise, i8gemm, onednn, onednn_primitives  # noqa: E402
from kiln.kernels.cpu.onednn_int8 import QConv2d  # noqa: E402

POINTWISE = [(32, 16, 112), (16, 96, 112), (96, 24, 56), (24, 144, 56), (144, 24, 56), (144, 32, 28), (32, 192, 28),
             (192, 32, 28), (192, 64, 14), (64, 384, 14), (384, 64, 14), (384, 96, 14), (96, 576, 14), (576, 96, 14),
             (576, 160, 7), (160, 960, 7), (960, 160, 7), (960, 320, 7), (320, 1280, 7)]  # (C, O, H)
DEPTHWISE = [(32, 112, 1), (96, 112, 2), (144, 56, 1), (144, 56, 2), (192, 28, 1), (192, 28, 2), (384, 14, 1),
             (576, 14, 1), (576, 14, 2), (960, 7, 1)]  # (C, H, stride), 3x3, padding 1
X_SCALE, X_ZERO, Y = 0.02, 0, (torch.uint8, 0.05, 0)


def timed(peers: dict, rounds: int, calls: int) -> dict[str, float]:
    """The median thread-clock ms of a call of each peer over interleaved rounds."""
    samples = {name: [] for name in peers}
    for fn in peers.values():
        fn(), fn()
    for _ in range(rounds):
        for name, fn in peers.items():
            for _ in range(calls):
                start = time.thread_time()
                fn()
                samples[name].append((time.thread_time() - start) * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def pointwise_peers(c: int, o: int, h: int, relu6: bool) -> dict:
    x = torch.randn(1, c, h, h).contiguous(memory_format=torch.channels_last)
    xq = torch.randint(0, 256, (1, c, h, h), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    w = torch.randint(-64, 64, (o, c, 1, 1), dtype=torch.int8)
    scale, bias = torch.rand(o) * 0.01 + 1e-3, torch.randint(-500, 500, (o,), dtype=torch.int32)
    act = ("Clip", 0.0, 6.0) if relu6 else ("", 0.0, 0.0)
    conv = onednn_primitives.Conv2d(w.float() * 0.01, bias.float(), [1, c, h, h], [1, 1], [0] * 4, [1, 1], 1,
                                    onednn.eltwise_for(*act), False, False)
    qconv = QConv2d(w, scale, bias, [1, c, h, h], [1, 1], [0] * 4, [1, 1], 1, torch.uint8, X_SCALE, X_ZERO, Y, *act)
    gemm = i8gemm.I8Gemm(w.reshape(o, c), scale, bias, h * h, torch.uint8, X_SCALE, X_ZERO, Y, *act)
    rows = xq.permute(0, 2, 3, 1).reshape(h * h, c)
    out = torch.empty(h * h, o, dtype=torch.uint8)
    return {"fp32 oneDNN": lambda: conv(x), "int8 oneDNN": lambda: qconv(xq), "int8 kiln": lambda: gemm(rows, out)}


def depthwise_peers(c: int, h: int, s: int) -> dict:
    from kiln.kernels.cpu import qdepthwise

    x = torch.randn(1, c, h, h).contiguous(memory_format=torch.channels_last)
    xq = torch.randint(0, 256, (1, c, h, h), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    w = torch.randint(-64, 64, (c, 1, 3, 3), dtype=torch.int8)
    scale, bias = torch.rand(c) * 0.01 + 1e-3, torch.randint(-500, 500, (c,), dtype=torch.int32)
    act = ("Clip", 0.0, 6.0)
    conv = onednn_primitives.Conv2d(w.float() * 0.01, bias.float(), [1, c, h, h], [s, s], [1] * 4, [1, 1], c,
                                    onednn.eltwise_for(*act), False, False)
    dw = depthwise.DepthwiseConv(w.float() * 0.01, bias.float(), (1, c, h, h), [s, s], [1] * 4, *act)
    qconv = QConv2d(w, scale, bias, [1, c, h, h], [s, s], [1] * 4, [1, 1], c, torch.uint8, X_SCALE, X_ZERO, Y, *act)
    qdw = qdepthwise.QDepthwiseConv(w, scale, bias, (1, c, h, h), [s, s], [1] * 4, torch.uint8, X_SCALE, X_ZERO, Y,
                                    *act)
    return {"fp32 oneDNN": lambda: conv(x), "fp32 kiln dw": lambda: dw(x), "int8 oneDNN": lambda: qconv(xq),
            "int8 kiln": lambda: qdw(xq)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", default="1x1,depthwise")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--avx2", action="store_true", help="every library capped to AVX2 (read before they load)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    kinds = args.kinds.split(",")
    print(f"MobileNetV2 int8 layers, 1 thread, thread clock, {cpu_features.describe()}, "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    total: dict[str, float] = {}
    layers = []
    if "1x1" in kinds:
        layers += [(f"1x1 {c}->{o} {h}²", lambda c=c, o=o, h=h: pointwise_peers(c, o, h, o > c))
                   for c, o, h in POINTWISE]
    if "depthwise" in kinds:
        layers += [(f"dw 3x3/{s} {c} {h}²", lambda c=c, h=h, s=s: depthwise_peers(c, h, s)) for c, h, s in DEPTHWISE]
    header = None
    for label, make in layers:
        ms = timed(make(), args.rounds, args.calls)
        if header != tuple(ms):
            header = tuple(ms)
            print(f"\n| layer | {' | '.join(f'{p} ms' for p in ms)} | int8 kiln / int8 oneDNN | "
                  "int8 kiln / fp32 (best) | int8 oneDNN / fp32 (best) | load |")
            print("|---|" + "---|" * (len(ms) + 4))
        fp32 = min(v for k, v in ms.items() if k.startswith("fp32"))
        for k, v in ms.items():
            total[f"{label.split()[0]} {k}"] = total.get(f"{label.split()[0]} {k}", 0.0) + v
        print(f"| {label} | {' | '.join(f'{v:.4f}' for v in ms.values())} | "
              f"{ms['int8 kiln'] / ms['int8 oneDNN']:.2f} | {ms['int8 kiln'] / fp32:.2f} | "
              f"{ms['int8 oneDNN'] / fp32:.2f} | {os.getloadavg()[0]:.2f} |", flush=True)
    print("\nsums over the distinct shapes (each once): " + ", ".join(f"{k} {v:.3f} ms" for k, v in total.items()))


if __name__ == "__main__":
    main()
