"""The precision between int8 and fp32 on this CPU, per MobileNetV2 convolution (issue 12): what the accuracy
target's search can move a layer to, timed the way kiln/builder/layer_cost.py times it (each kernel alone at 1
thread, outputs in buffers made once, thread CPU time), plus bf16, a candidate kiln does not build yet.

    python bench/precision_between_conv.py [--rounds 3]

    int8    onednn_int8.QConv2d (u8 x s8, VNNI), f32 out
    w8a16   kiln's one-pass split (split16.c) + onednn_int8.W8A16Conv2d (two int8 convolutions, summed by a post-op)
    fp32    the oneDNN float primitive cpu.conv.onednn_direct builds
    bf16    torch's oneDNN convolution on bf16 input and weight (avx512_bf16 dot products; f32 -> bf16 of the input
            included, the output left bf16): 8 mantissa bits on the input, between int8 and W8A16 in accuracy

Why: W8A16 on two int8 convolutions costs ~2x int8 + the split, which on Zen 4 is ~0.6-1.0x fp32 per layer
(bench/results/quantacc5-2026-12-06.md): the mixed engine cannot get far below fp32 with it. Per round every layer is
timed in every precision (interleaved); the table is the median over rounds of each layer's fastest of 7 calls, sums
over the 52 convolutions and by kind (depthwise, 1x1, the stem) and output size. CPU and load named.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import onnx_ir as ir  # noqa: E402
import torch  # noqa: E402

from kiln import zoo  # noqa: E402
from kiln.builder import layer_cost  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.passes import PassOptions, optimize  # noqa: E402
from kiln.quant import qdq  # noqa: E402


def bf16_ms(geometry: dict) -> float:
    size, shape = geometry["input"], tuple(geometry["weight"])
    x = torch.rand(size).contiguous(memory_format=torch.channels_last)
    w = (torch.randint(-127, 128, shape).float() * 0.01).bfloat16().contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        return layer_cost._fastest_ms(lambda: torch.nn.functional.conv2d(
            x.bfloat16(), w, None, geometry["strides"], geometry["pads"][:2], geometry["dilations"],
            geometry["groups"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = optimize(ir.load(str(zoo.mobilenet_v2())), PassOptions(fusions=False))
    layers = [(t.node.name, g) for t in qdq.targets(model.graph) if (g := layer_cost.conv_geometry(t)) is not None]
    times: dict[str, dict[str, list[float]]] = {n: {p: [] for p in (*layer_cost.PRECISIONS, "bf16")}
                                                for n, _ in layers}
    loads = []
    for _ in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for name, geometry in layers:
            for p, ms in layer_cost.conv_costs(geometry).items():
                times[name][p].append(ms)
            times[name]["bf16"].append(bf16_ms(geometry))
    med = {n: {p: float(np.median(v)) for p, v in t.items()} for n, t in times.items()}
    precisions = (*layer_cost.PRECISIONS, "bf16")
    print(f"\n{cpu_name()}, 1 thread, thread CPU time, {args.rounds} interleaved rounds, 1-min load "
          f"{min(loads):.1f}-{max(loads):.1f}, torch {torch.__version__}")
    print("| layers (kind, output side) | n | " + " | ".join(f"{p} ms" for p in precisions)
          + " | w8a16 / fp32 | bf16 / fp32 |")
    print("|---|---|" + "---|" * (len(precisions) + 2))
    groups: dict[str, list[str]] = {}
    for name, geometry in layers:
        side = geometry["input"][2] // geometry["strides"][0]
        kind = "depthwise" if geometry["groups"] > 1 else "1x1" if geometry["weight"][2:] == [1, 1] else "full"
        groups.setdefault(f"{kind} {side}x{side}", []).append(name)
    groups["all"] = [n for n, _ in layers]
    def order(label: str) -> tuple:
        return (True, "", 0) if label == "all" else (False, label.split()[0], -int(label.split()[-1].split("x")[0]))

    for label, names in sorted(groups.items(), key=lambda kv: order(kv[0])):
        sums = {p: sum(med[n][p] for n in names) for p in precisions}
        print(f"| {label} | {len(names)} | " + " | ".join(f"{sums[p]:.3f}" for p in precisions)
              + f" | {sums['w8a16'] / sums['fp32']:.2f} | {sums['bf16'] / sums['fp32']:.2f} |")


if __name__ == "__main__":
    main()
