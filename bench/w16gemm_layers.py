"""MobileNetV2's 1x1 layers as W8A16 on the CPU: the one-pass GEMM (kiln/kernels/cpu/w16gemm.c, tactic
cpu.qconv.w8a16_gemm) against the split path (split16 + two oneDNN int8 convolutions, cpu.qconv.w8a16), oneDNN fp32
and oneDNN int8 (issue 12).

    python bench/w16gemm_layers.py [--rounds 5] [--threads 1]

Each kernel as layer_cost.py times it (outputs in buffers made once, random data): gemm f32 / split f32 write float32;
gemm u8 requantizes in its epilogue, split u8 adds the quantizing reorder an 8-bit reader needs (what the engine
runs when the layer's output is int8). Per shape the median over interleaved rounds of each round's fastest of 9
calls (thread CPU time at 1 thread, wall time at more), summed over the network's layers of that shape. Prints a
markdown table; CPU and load named.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.kernels.cpu import onednn_int8, onednn_primitives, split16, w16gemm  # noqa: E402

# (input channels, side, output channels, how many of MobileNetV2's 1x1 layers have this shape), 224x224 input
LAYERS = [(32, 112, 16, 1), (16, 112, 96, 1), (96, 56, 24, 1), (24, 56, 144, 2), (144, 56, 24, 1), (144, 28, 32, 1),
          (32, 28, 192, 3), (192, 28, 32, 2), (192, 14, 64, 1), (64, 14, 384, 4), (384, 14, 64, 3),
          (384, 14, 96, 1), (96, 14, 576, 3), (576, 14, 96, 2), (576, 7, 160, 1), (160, 7, 960, 3),
          (960, 7, 160, 2), (960, 7, 320, 1), (320, 7, 1280, 1)]
KINDS = ("gemm f32", "split f32", "gemm u8", "split u8", "fp32", "int8")


def kernels(c: int, side: int, o: int, generator: torch.Generator) -> dict[str, object]:
    size = [1, c, side, side]
    cl = torch.channels_last
    x = torch.rand(size, generator=generator).contiguous(memory_format=cl)
    w = torch.randint(-127, 128, (o, c, 1, 1), generator=generator, dtype=torch.int8)
    ws = torch.full((o,), 0.01)
    geometry = ([1, 1], [0, 0, 0, 0], [1, 1], 1)
    wide = onednn_int8.W8A16Conv2d(w, ws, None, size, *geometry, 1 / 65535, False)
    out = torch.empty(wide.output_size).contiguous(memory_format=cl)
    out8 = torch.empty(wide.output_size, dtype=torch.uint8).contiguous(memory_format=cl)
    hi, lo = split16.split(x, 1 / 65535, 0, torch.uint16)
    requantize = onednn_int8.ScaledReorder(list(wide.output_size), torch.float32, torch.uint8, 0.05, 0, True)
    gemm = w16gemm.W16Gemm(w, ws, None, size, 1 / 65535, torch.uint16)
    gemm8 = w16gemm.W16Gemm(w, ws, None, size, 1 / 65535, torch.uint16, y=(torch.uint8, 0.05, 0))
    fp32 = onednn_primitives.Conv2d((w.float() * 0.01).contiguous(memory_format=cl), None, size, *geometry[:3], 1,
                                    None, False, False)
    int8 = onednn_int8.QConv2d(w, ws, None, size, *geometry, torch.uint8, 1 / 255, 0, None)
    x8 = torch.randint(0, 256, size, generator=generator, dtype=torch.uint8).contiguous(memory_format=cl)

    def split() -> None:
        split16.split(x, 1 / 65535, 0, torch.uint16, (hi, lo))
        wide.lo(lo, out=wide.hi(hi, out))

    def split_u8() -> None:
        split()
        requantize(out)

    return {"gemm f32": lambda: gemm(x, out), "split f32": split, "gemm u8": lambda: gemm8(x, out8),
            "split u8": split_u8, "fp32": lambda: fp32(x), "int8": lambda: int8(x8, out)}


def fastest_ms(fn, clock) -> float:
    fn()
    samples = []
    for _ in range(9):
        start = clock()
        fn()
        samples.append((clock() - start) * 1e3)
    return min(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    generator = torch.Generator().manual_seed(0)
    built = [kernels(c, side, o, generator) for c, side, o, _ in LAYERS]
    times = [{k: [] for k in KINDS} for _ in LAYERS]
    loads = []
    with torch.inference_mode():
        for _ in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for calls, kept in zip(built, times):
                for kind in KINDS:
                    kept[kind].append(fastest_ms(calls[kind], clock))
    median = [{k: sorted(v)[len(v) // 2] for k, v in kept.items()} for kept in times]
    print(f"{cpu_name()}, w16gemm: {w16gemm.isa()}, {args.threads} thread(s), "
          f"{'thread CPU' if args.threads == 1 else 'wall'} time, 1-min load {min(loads):.1f}-{max(loads):.1f}, "
          f"{args.rounds} interleaved rounds, torch {torch.__version__}")
    print("| layer (in -> out) | n | " + " | ".join(f"{k} ms" for k in KINDS)
          + " | gemm/split f32 | gemm/split u8 | gemm u8/fp32 |")
    print("|---|---|" + "---|" * (len(KINDS) + 3))
    total = dict.fromkeys(KINDS, 0.0)
    for (c, side, o, n), m in zip(LAYERS, median):
        for k in KINDS:
            total[k] += n * m[k]
        print(f"| {c}x{side}² -> {o} | {n} | " + " | ".join(f"{n * m[k]:.3f}" for k in KINDS)
              + f" | {m['gemm f32'] / m['split f32']:.2f} | {m['gemm u8'] / m['split u8']:.2f} | "
              f"{m['gemm u8'] / m['fp32']:.2f} |")
    best = sum(n * min(m["gemm u8"], m["split u8"]) for (_c, _s, _o, n), m in zip(LAYERS, median))
    print(f"| all 1x1 | {sum(n for *_x, n in LAYERS)} | " + " | ".join(f"{total[k]:.3f}" for k in KINDS)
          + f" | {total['gemm f32'] / total['split f32']:.2f} | {total['gemm u8'] / total['split u8']:.2f} | "
          f"{total['gemm u8'] / total['fp32']:.2f} |")
    print(f"faster of gemm u8 / split u8 per layer, summed: {best:.3f} ms ({best / total['split u8']:.2f}x split u8, "
          f"{best / total['fp32']:.2f}x fp32)")


if __name__ == "__main__":
    main()
