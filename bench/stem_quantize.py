"""The int8 ResNet-50 engine's stem on the GPU, in parts (issue 12): the image's QuantizeLinear, the space-to-depth fold
of the 8-bit image (torch's pad + fill + strided copy before, one Triton pass now), the quantizing fold that reads the
float image once (the QuantizeLinear folded into the stem's QConv: kiln/passes/fusion/qdq_layers.py), the whole stem
layer each way, and the max pool after it on int8 against fp16 at a few tiles.

    python3 bench/stem_quantize.py [--batch 256] [--out DIR]
    python3 bench/stem_quantize.py --dry-run     (the CPU, Triton's interpreter, batch 1: checks the script, no times)

Correctness first: every fold is compared byte for byte with torch's, the fused stem with the int8 stem on
QuantizeLinear(x) bit for bit, each pool with torch's max_pool2d of the float values. ms per call: 20 calls in one
CUDA graph, median of 10 replays (bench/gpu.py's graph_ms). Prints the table row by row, and writes it to
DIR/stem_quantize.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kiln.kernels.cuda.triton import qelementwise, qstem  # noqa: E402
from kiln.kernels.cuda.triton.pool import PoolConfig, max_pool2d  # noqa: E402
from tests.kernels.qlayers import conv_layer, prepared  # noqa: E402

STEM_TACTIC = "cuda.qconv.triton_igemm.128x64x64w4s4.space_to_depth"
PLAIN_QUANTIZE = "cuda.qconv.dequantized"  # quantize kernel first, then the fp16 layer (the fallback's cost)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    if args.dry_run:
        n, dev = 1, torch.device("cpu")

        def graph_ms(fn) -> float:
            fn()
            return 0.0
    else:
        from gpu import graph_ms
        n, dev = args.batch, torch.device("cuda")
    rows: list[tuple[str, float, str]] = []
    device = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU dry run (interpreter), no times"
    header = [f"# stem parts, batch {n}, {device}, torch {torch.__version__}", "", "| what | ms | check |",
              "|---|---|---|"]
    print("\n".join(header), flush=True)

    def row(what: str, fn, check: str = "—") -> None:  # printed as it comes: a run cut short keeps its rows
        rows.append((what, graph_ms(fn), check))
        print(f"| {what} | {rows[-1][1]:.4f} | {check} |", flush=True)

    # the layer's quantization and weights at a small batch (the output scale from its reference), the image at n
    small = conv_layer(torch.int8, torch.int8, n=2, cin=3, cout=64, size=(224, 224), kernel=7, stride=2,
                       pads=[3, 3, 3, 3], activation="Relu", seed=5)
    scale, zero = float(small.args[1]), int(small.args[2])
    g = torch.Generator(device=dev).manual_seed(0)
    image32 = torch.randn(n, 3, 224, 224, device=dev, generator=g) * 1.5
    image16 = image32.half()
    x8 = qelementwise.quantize(image16, scale, zero, torch.int8)  # what the engine's Q step writes (fp16 in)
    ho = wo = 112
    zero_bits = int(torch.tensor(zero, dtype=torch.int8).view(torch.uint8))
    pads = (3, 3, 3, 3)

    row("QuantizeLinear fp16 -> int8 (cuda.quantize.triton)", lambda: qelementwise.quantize(image16, scale, zero,
                                                                                            torch.int8))
    row("QuantizeLinear fp32 -> int8", lambda: qelementwise.quantize(image32, scale, zero, torch.int8))
    row("fp32 -> fp16 cast (the runtime's boundary cast)", lambda: image32.half())
    want = qstem.space_to_depth_torch(x8, zero_bits, 7, pads, ho, wo)
    got = qstem.space_to_depth(x8, zero_bits, 7, pads, ho, wo)
    same = "bytes equal" if torch.equal(got.view(torch.uint8), want.view(torch.uint8)) else "WRONG"
    row("fold int8, torch (pad + fill + copy: before)", lambda: qstem.space_to_depth_torch(x8, zero_bits, 7, pads,
                                                                                          ho, wo))
    row("fold int8, Triton (one pass)", lambda: qstem.space_to_depth(x8, zero_bits, 7, pads, ho, wo), same)
    for name, image in (("fp16", image16), ("fp32", image32)):
        fused = qstem.space_to_depth(image, zero_bits, 7, pads, ho, wo, quantize=(scale, float(zero), torch.int8))
        on_q = qstem.space_to_depth(qelementwise.quantize(image, scale, zero, torch.int8), zero_bits, 7, pads, ho, wo)
        check = "bytes equal" if torch.equal(fused, on_q) else "WRONG"
        row(f"quantize + fold from {name}, Triton (one pass)",
            lambda image=image: qstem.space_to_depth(image, zero_bits, 7, pads, ho, wo,
                                                     quantize=(scale, float(zero), torch.int8)), check)

    # the whole stem layer: int8 x (Q step before it) vs the float image (the QuantizeLinear folded in)
    quantized = dataclasses.replace(small, args=[x8, *[a.to(dev) if isinstance(a, torch.Tensor) else a
                                                       for a in small.args[1:]]])
    floating = dataclasses.replace(quantized, args=[image16, *quantized.args[1:]])
    for name in (STEM_TACTIC, PLAIN_QUANTIZE):
        on_int8 = prepared(name, quantized, dev)
        on_float = prepared(name, floating, dev)
        a = on_int8(quantized.ctx, *quantized.args, **quantized.attributes)
        b = on_float(floating.ctx, *floating.args, **floating.attributes)
        check = "bit for bit" if torch.equal(a, b) else f"WRONG ({int((a.int() - b.int()).abs().max())} steps)"
        short = name.removeprefix("cuda.qconv.")
        row(f"stem {short} on int8 x (+ the Q step's row above)",
            lambda f=on_int8: f(quantized.ctx, *quantized.args, **quantized.attributes))
        row(f"stem {short} on the fp16 image (Q folded)",
            lambda f=on_float: f(floating.ctx, *floating.args, **floating.attributes), check)

    # the max pool after the stem: [n, 64, 112, 112] NHWC, 3x3/2 pad 1
    act8 = torch.randint(-128, 128, (n, 112, 112, 64), device=dev, dtype=torch.int8).permute(0, 3, 1, 2)
    act16 = act8.half()
    reference = F.max_pool2d(act16.float(), 3, 2, 1)
    row("MaxPool fp16 NHWC (cuda.pool.max.triton, default tile)", lambda: max_pool2d(act16, [3, 3], [2, 2], [1] * 4))
    for block_p, block_c, warps in ((0, 0, 4), (128, 64, 4), (128, 64, 8), (256, 64, 8)):
        config = PoolConfig(block_p, block_c, warps)
        got = max_pool2d(act8, [3, 3], [2, 2], [1] * 4, config=config)
        check = "exact" if torch.equal(got.float(), reference) else "WRONG"
        tile = "default tile" if not block_p else f"{block_p}x{block_c} w{warps}"
        row(f"MaxPool int8 NHWC, {tile}", lambda c=config: max_pool2d(act8, [3, 3], [2, 2], [1] * 4, config=c), check)

    text = "\n".join(header + [f"| {w} | {ms:.4f} | {c} |" for w, ms, c in rows])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "stem_quantize.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
