"""Where MobileNetV2's FP8 (E4M3) error comes from, layer by layer (issue 12: FP8 agrees with FP32 on ~64%).

    python bench/fp8_layers_mnv2.py [--images 24]

kiln's own quantization of the build (percentile ranges on the calibration third of photo_variants(), per-channel
E4M3 weights, per-channel depthwise inputs, bias correction: what `kiln build --fp8 --quantization emulate` makes),
run through the accuracy search's switched program (kiln/builder/sensitivity.py SwitchedModel): each layer alone
in FP8 (weight and input), its weight alone, its input alone, the rest float; the mean relative logit error
|q - fp32| / |fp32| (L2) over --images held-out images. Then whole-network variants on all 202 held-out images
(74 + 128 more crops): top-1 agreement with fp32, relerr. Deterministic (no times). Prints tables.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kiln import zoo  # noqa: E402
from kiln.builder.calibration import measure_ranges  # noqa: E402
from kiln.builder.sensitivity import SwitchedModel  # noqa: E402
from kiln.frontend import onnx as onnx_frontend  # noqa: E402
from kiln.passes import PassOptions, optimize  # noqa: E402
from kiln.quant import qdq  # noqa: E402
from kiln.quant.data import photo_variants  # noqa: E402


def kinds(model) -> dict[str, str]:
    """Layer name -> a short name: stem, b<i>.expand / b<i>.dw / b<i>.project, head, classifier (graph order)."""
    names, block, seen_dw = {}, 0, False
    targets = qdq.targets(model.graph)
    for i, t in enumerate(targets):
        if i == 0:
            names[t.node.name] = "stem"
        elif t.node.op_type != "Conv":
            names[t.node.name] = "classifier"
        elif qdq.is_depthwise(t.node):
            block += 1
            seen_dw = True
            names[t.node.name] = f"b{block}.dw"
        elif seen_dw:
            names[t.node.name] = f"b{block}.project"
            seen_dw = False
        elif i == len(targets) - 2:
            names[t.node.name] = "head"
        else:
            names[t.node.name] = f"b{block + 1}.expand"
    return names


def relerr(got: list, want: list) -> float:
    return float(np.mean([float(torch.linalg.vector_norm(g[0].double() - w[0].double())
                                / torch.linalg.vector_norm(w[0].double())) for g, w in zip(got, want)]))


def agree(got: list, want: list) -> int:
    return sum(int(g[0].argmax() == w[0].argmax()) for g, w in zip(got, want))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=24, help="held-out images for the per-layer table")
    parser.add_argument("--dtype", default="fp8", choices=["fp8", "int8"])
    args = parser.parse_args()
    images = photo_variants()
    calibration = [{"pixel_values": v} for v in images[::3]]
    held = [{"pixel_values": v} for i, v in enumerate(images) if i % 3]
    held += [{"pixel_values": v} for v in photo_variants(8, seed=1)]
    model = optimize(onnx_frontend.load(str(zoo.mobilenet_v2())), PassOptions(fusions=False))
    means: dict = {}
    lows: dict | None = {} if args.dtype == "int8" else None
    unsigned = args.dtype == "int8"
    ranges, _ = measure_ranges(model, calibration, "percentile", args.dtype, exclude=set(), cache_path=None,
                               preprocessing="imagenet", say=lambda _m: None, channel_means=means, unsigned=unsigned,
                               lows=lows)
    switched = SwitchedModel(model, ranges, args.dtype, set(), held, unsigned=unsigned, channel_means=means, lows=lows)
    short = kinds(model)
    layers = switched.layers
    few = list(range(0, len(held), max(1, len(held) // args.images)))[:args.images]
    want = [switched.reference[k] for k in few]
    rows = []
    for name in layers:
        full = relerr(switched.outputs({name}, few), want)
        weight = relerr(switched.outputs(set(), few, weight_only={name}), want)
        inp = relerr(switched.outputs(set(), few, input_only={name}), want)
        rows.append((short.get(name, name), full, weight, inp))
    rows.sort(key=lambda r: -r[1])
    print(f"\n{args.dtype}: each layer alone (the rest float), mean relerr of the logits over {len(few)} held-out "
          "images")
    print("| layer | weight + input | weight alone | input alone |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.4f} | {r[2]:.4f} | {r[3]:.4f} |")
    by_kind: dict[str, list] = {}
    for r in rows:
        kind = r[0].split(".")[-1] if "." in r[0] else r[0]
        by_kind.setdefault(kind, []).append(r)
    print("\n| kind | layers | sum weight + input | sum weight alone | sum input alone |\n|---|---|---|---|---|")
    for kind, rs in sorted(by_kind.items(), key=lambda kv: -sum(r[1] for r in kv[1])):
        print(f"| {kind} | {len(rs)} | {sum(r[1] for r in rs):.4f} | {sum(r[2] for r in rs):.4f} | "
              f"{sum(r[3] for r in rs):.4f} |")
    everything = set(layers)
    dw = {n for n in layers if short.get(n, "").endswith(".dw")}
    variants = {
        "every layer": dict(quantized=everything),
        "weights alone (every input float)": dict(quantized=set(), weight_only=everything),
        "inputs alone (every weight float)": dict(quantized=set(), input_only=everything),
        "every layer but the depthwise inputs (dw weight-only)": dict(quantized=everything - dw, weight_only=dw),
        "depthwise layers alone (rest float)": dict(quantized=dw),
        "depthwise inputs alone": dict(quantized=set(), input_only=dw),
        "every layer but stem and b1.dw": dict(quantized={n for n in layers if short.get(n) not in ("stem", "b1.dw")}),
    }
    print(f"\n{args.dtype}, whole network on {len(held)} held-out images (74 + 128)")
    print("| variant | top-1 = fp32 | relerr |\n|---|---|---|")
    for label, kw in variants.items():
        got = switched.outputs(kw.pop("quantized"), **kw)
        print(f"| {label} | {agree(got, switched.reference)}/{len(held)} | {relerr(got, switched.reference):.4f} |",
              flush=True)


if __name__ == "__main__":
    main()
