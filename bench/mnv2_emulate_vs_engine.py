"""MobileNetV2 INT8 with an accuracy target (issue 12): why the emulated engine agrees with fp32 on 196 of 202 held-out
images and the real CPU engine of the same build on 193-194.

    python bench/mnv2_emulate_vs_engine.py [--targets 0.97] [--draws 4] [--images 2]

One quantized model per target (calibration, GPTQ, the top-1 search: quantize(), what kiln.build runs), then the SAME
Q/DQ model two ways: "reference" as bench/quant_accuracy.py runs it (the optimizer without CPU rules, kiln's
reference kernels: exact integer accumulation, float64 requantization) and "engine" (kiln.build of that model on this
CPU: oneDNN int8 convolutions, per-channel quantize reorders, fp32 oneDNN convolutions for the float layers, native
segments). Printed:

- top-1 agreement with fp32 on the 202 held-out images (photo_variants' 74 + photo_variants(8, seed=1)'s 128) and
  the logits' mean relative error to fp32 (and engine to reference);
- the same counts on `--draws` redraws: every input times (1 + 1e-6 * N(0, 1)), a change far below the image's own
  8-bit quantization and of the kind a kernel's float summation order makes, so the spread of counts each plan
  gets from rounding alone;
- per layer on the `--images` images where the two differ: each engine step's output against the reference's, chained
  (each engine fed by its own predecessors) and alone (kiln.tools.accuracy.replay: each step fed the reference's
  inputs), as max |difference| and how many elements differ.
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
from kiln.builder.build import build  # noqa: E402
from kiln.builder.calibration import quantize  # noqa: E402
from kiln.builder.config import BuildConfig  # noqa: E402
from kiln.builder.lower import lower  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.frontend import onnx as onnx_frontend  # noqa: E402
from kiln.ir import dtypes  # noqa: E402
from kiln.passes import PassOptions, optimize  # noqa: E402
from kiln.quant.data import photo_variants  # noqa: E402
from kiln.runtime.program import Program  # noqa: E402
from kiln.tools.accuracy import replay, trace  # noqa: E402


def _numpy(value: torch.Tensor) -> np.ndarray:
    value = value.detach()
    if value.dtype in (torch.float16, torch.bfloat16):
        value = value.float()
    return dtypes.torch_to_numpy(value.contiguous())


def per_layer(reference: Program, engine, image: np.ndarray) -> list[str]:
    """Each engine step's outputs against the reference program's values of the same name, chained and alone."""
    x = dtypes.numpy_to_torch(np.ascontiguousarray(image))
    want = {k: _numpy(v) for k, v in trace(reference, [x]).items() if isinstance(v, torch.Tensor)}
    feeds = engine.program_inputs({"pixel_values": image})
    chained = {k: _numpy(v) for k, v in trace(engine.program, feeds).items() if isinstance(v, torch.Tensor)}
    alone = replay(engine.program, want, feeds)
    lines = []
    for step in engine.program.spec.steps:
        for name in step.outputs:
            if name not in want or name not in chained or chained[name].size != want[name].size:
                continue
            d = np.abs(chained[name].astype(np.float64).ravel() - want[name].astype(np.float64).ravel())
            line = (f"  {step.name:20s} {step.op_type:14s} {step.tactic or '-':32s} {str(chained[name].dtype):8s} "
                    f"chained max {d.max():9.3g} ({int((d > 0).sum()):7d} differ)")
            if name in alone:
                got, ref = (_numpy(t).astype(np.float64).ravel() for t in alone[name])
                a = np.abs(got - ref)
                line += f" | alone max {a.max():9.3g} ({int((a > 0).sum()):7d} differ of {a.size})"
            lines.append(line)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--targets", type=float, nargs="*", default=[0.97])
    parser.add_argument("--draws", type=int, default=4)
    parser.add_argument("--images", type=int, default=2, help="per-layer tables for this many differing images")
    parser.add_argument("--no-gptq", action="store_true")
    parser.add_argument("--plan", nargs=2, action="append", default=[], metavar=("FLOAT", "WEIGHT_ONLY"),
                        help="also a build with these comma-separated layers pinned fp32 and weight-only (no target; "
                             "'-' for none); repeatable")
    args = parser.parse_args()
    torch.set_num_threads(1)
    images = photo_variants()
    calibration = [{"pixel_values": v} for v in images[::3]]
    held = [v for i, v in enumerate(images) if i % 3] + list(photo_variants(8, seed=1))
    path = str(zoo.mobilenet_v2())
    fp32 = build(path, BuildConfig())
    want = [np.asarray(next(iter(fp32.run({"pixel_values": v}).values()))) for v in held]
    top1 = [w.argmax() for w in want]
    rng = np.random.default_rng(0)
    draws = [[(v * (1 + 1e-6 * rng.standard_normal(v.shape))).astype(np.float32) for v in held]
             for _ in range(args.draws)]

    def relerr(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.linalg.norm(a.ravel() - b.ravel()) / np.linalg.norm(b.ravel()))

    print(f"{cpu_name()}, 1 thread, torch {torch.__version__}, load {os.getloadavg()[0]:.1f}", flush=True)
    rows = []
    plans = [(target, {}) for target in args.targets]
    for floats, weight_only in args.plan:
        pins = {name: "fp32" for name in floats.split(",") if name != "-"}
        pins.update({name: "weight_only" for name in weight_only.split(",") if name != "-"})
        plans.append((None, pins))
    for target, pins in plans:
        start = time.perf_counter()
        config = BuildConfig(precision="int8", calibration=calibration, calibrator="percentile",
                             gptq=not args.no_gptq, accuracy_target=target, accuracy_metric="top1",
                             layer_precision=pins)
        quantized, info = quantize(onnx_frontend.load(path), config, lambda _m: None)
        kept = len(info.get("kept_float") or {})
        proto = ir.to_proto(quantized)
        spec, weights, _, _ = lower(optimize(ir.from_proto(proto), PassOptions(unsigned_activations=True,
                                                                                cpu_rules=False)))
        reference = Program(spec, weights)
        engine = build(ir.from_proto(proto), BuildConfig())
        context = engine.create_execution_context()

        def run_reference(v: np.ndarray) -> np.ndarray:
            with torch.inference_mode():
                return _numpy(reference.run([dtypes.numpy_to_torch(np.ascontiguousarray(v))])[0])

        def run_engine(v: np.ndarray) -> np.ndarray:
            return np.asarray(next(iter(context.run({"pixel_values": v}).values())))

        out = {"reference": [run_reference(v) for v in held], "engine": [run_engine(v) for v in held]}
        agree = {k: [int(o.argmax() == t) for o, t in zip(outs, top1)] for k, outs in out.items()}
        counts = {k: [sum(v)] for k, v in agree.items()}
        for draw in draws:
            counts["reference"].append(sum(int(run_reference(v).argmax() == t) for v, t in zip(draw, top1)))
            counts["engine"].append(sum(int(run_engine(v).argmax() == t) for v, t in zip(draw, top1)))
        row = {"target": target if target is not None else f"pinned ({len(pins)})", "kept_float": kept,
               "weight_only": len(info.get("weight_only") or {}),
               "expected": (info.get("accuracy") or {}).get("top1") or float("nan"),
               "counts": counts, "seconds": round(time.perf_counter() - start),
               "relerr": {k: float(np.mean([relerr(o, w) for o, w in zip(outs, want)])) for k, outs in out.items()},
               "engine_vs_reference": float(np.mean([relerr(e, r) for e, r in zip(out["engine"], out["reference"])]))}
        rows.append(row)
        print(row, flush=True)
        differ = [i for i in range(len(held)) if agree["reference"][i] != agree["engine"][i]]
        print(f"images where they differ: {differ}")
        for i in differ[:args.images]:
            print(f"image {i} (reference {'keeps' if agree['reference'][i] else 'flips'} its top-1):")
            print("\n".join(per_layer(reference, engine, held[i])), flush=True)
    print(f"\n{cpu_name()}, 1 thread, load {os.getloadavg()[0]:.1f}, {len(held)} held-out images, "
          f"{args.draws} redraws (inputs x (1 + 1e-6 N(0,1)))")
    print("| target | layers float, weight-only | expected top-1 | reference (as is; redraws) | "
          "engine (as is; redraws) | "
          "relerr ref / engine / engine-ref |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        c = r["counts"]
        print(f"| {r['target']} | {r['kept_float']}, {r['weight_only']} | {r['expected']:.4f} | {c['reference'][0]}; "
              f"{', '.join(map(str, c['reference'][1:]))} | {c['engine'][0]}; {', '.join(map(str, c['engine'][1:]))} "
              f"| {r['relerr']['reference']:.4f} / {r['relerr']['engine']:.4f} / {r['engine_vs_reference']:.4f} |")


if __name__ == "__main__":
    main()
