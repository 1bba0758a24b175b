"""Which MobileNetV2 layers cost the INT8 top-1 agreement on this CPU (issue 12), as kiln's own accuracy-target search
measures them: the CPU build's quantization (percentile, GPTQ, 7-bit weights without VNNI but for the depthwise ones,
target 0.97 + the default margin, top-1 metric) run alone (kiln.builder.calibration.quantize), then per layer: its kind,
weight bits, the softmax KL from fp32 with it alone quantized (whole layer) and with its input alone quantized (the
calibration images of the lowest top-1 margins), its int8 and fp32 ms (layer_cost, 1 thread), and where the chosen
plan put it.

    python bench/int8_avx2_sensitivity.py [--top 20] [--save PLAN.json]

--save: the chosen plan's fp32 layers as JSON ({"fp32": [...]}), for bench/mnv2_w8a16.py --plan (the same engine
built from pinned layers, without the search).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from kiln import zoo  # noqa: E402
from kiln.builder.calibration import quantize  # noqa: E402
from kiln.builder.config import BuildConfig  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.frontend import onnx as onnx_frontend  # noqa: E402
from kiln.kernels.cpu import cpu_features  # noqa: E402
from kiln.quant import qdq  # noqa: E402
from kiln.quant.data import photo_variants  # noqa: E402


def kind(node) -> str:
    w = node.inputs[1].const_value.shape
    if node.op_type != "Conv":
        return "classifier"
    if qdq.is_depthwise(node):
        return f"depthwise {w[2]}x{w[3]}"
    return f"conv {w[2]}x{w[3]} {w[1]}->{w[0]}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--timing-cache", default=None)
    parser.add_argument("--save", default=None, help="write the chosen plan's fp32 layers here (JSON)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.time()
    images = photo_variants()
    model = onnx_frontend.load(str(zoo.mobilenet_v2()))
    nodes = {t.node.name: t.node for t in qdq.targets(model.graph)}
    kinds = {name: kind(node) for name, node in nodes.items()}
    config = BuildConfig(precision="int8", calibration=[{"pixel_values": v} for v in images[::3]],
                         calibrator="percentile", gptq=True, accuracy_target=0.97, accuracy_metric="top1",
                         timing_cache=args.timing_cache)
    _, record = quantize(model, config, lambda _m: None)
    accuracy = record["accuracy"]
    full, inputs = accuracy.get("sensitivity", {}), accuracy.get("input_sensitivity", {})
    ms = accuracy.get("layer_ms", {})
    kept, wide = set(record["kept_float"]), set(record["w8a16"])
    if args.save:
        Path(args.save).write_text(json.dumps({"fp32": sorted(kept), "w8a16": sorted(wide)}))
    print(f"{cpu_name()} ({cpu_features.describe()}), 1-min load {os.getloadavg()[0]:.1f}, "
          f"{time.time() - start:.0f} s; weights {record['weights']}")
    print(f"expected top-1: every layer int8 {accuracy.get('top1_all_quantized')}, chosen plan "
          f"{accuracy.get('chosen_plan')!r} {accuracy.get('top1')}: {len(kept)} fp32, {len(wide)} w8a16; plans "
          + ", ".join(f"{k}: {len(v['kept_float'])} fp32 + {len(v['w8a16'])} w8a16, {v['ms']:.2f} ms"
                      for k, v in (accuracy.get("plans") or {}).items()))
    print(f"\n| rank | layer | kind | weights | KL, layer alone int8 | KL, input alone | int8 ms | fp32 ms | plan |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for rank, name in enumerate(list(full)[:args.top], 1):
        bits = 7 if record["weights"].startswith("7") and qdq.pairs_bytes(nodes[name]) else 8
        cost = ms.get(name, {})
        where = "fp32" if name in kept else "w8a16" if name in wide else "int8"
        print(f"| {rank} | {name} | {kinds.get(name, '?')} | {bits}-bit | {full[name]:.2e} | "
              f"{inputs.get(name, 0):.2e} | {cost.get('int8', 0):.3f} | {cost.get('fp32', 0):.3f} | {where} |")
    counts: dict[str, list[int]] = {}
    for name, k in kinds.items():
        group = k.split(" ")[0] if not k.startswith("conv") else ("conv 1x1" if "1x1" in k else "conv 3x3")
        counts.setdefault(group, [0, 0])[0] += 1
        counts[group][1] += name in kept
    print("\n| kind | layers | kept fp32 |\n|---|---|---|")
    for group, (n, k) in sorted(counts.items()):
        print(f"| {group} | {n} | {k} |")


if __name__ == "__main__":
    main()
