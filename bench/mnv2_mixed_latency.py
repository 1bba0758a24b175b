"""MobileNetV2 CPU engines with an accuracy target (issue 12): top-1 agreement with fp32 on 202 held-out images and
latency, fp32 vs int8 every layer vs int8 with --accuracy-target (weight-only layers, or float layers only).

    python bench/mnv2_mixed_latency.py [--rounds 5] [--threads 1] [--target 0.97]

Engines are real CPU builds (quantization "auto": each quantized layer on oneDNN's int8 kernel or its float layer,
whichever the autotuner timed faster), percentile ranges and GPTQ weights on the calibration third of
photo_variants(); held out: the other 74 and photo_variants(8, seed=1)'s 128. Timing: interleaved rounds, one
block per engine per round (bench's time_samples, thread CPU time at 1 thread), medians; ratios to fp32 per round.
Prints a table; load and CPU named.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.quant.data import photo_variants  # noqa: E402
from kiln.tactics import registry  # noqa: E402
from kiln.zoo.timing import time_samples  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--target", type=float, default=0.97)
    parser.add_argument("--no-gptq", action="store_true")
    parser.add_argument("--float-only", action="store_true", help="also the target's build without weight-only layers")
    parser.add_argument("--before-native-quantize", action="store_true",
                        help="also the target's engine (same float layers) built without "
                             "cpu.quantize.onednn_per_channel: its per-channel quantizes in torch ops, outside "
                             "segments")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    images = photo_variants()
    calibration = [{"pixel_values": v} for v in images[::3]]
    held = [{"pixel_values": v} for i, v in enumerate(images) if i % 3] + \
        [{"pixel_values": v} for v in photo_variants(8, seed=1)]
    path = str(zoo.mobilenet_v2())
    common = dict(precision="int8", calibration=calibration, calibrator="percentile", gptq=not args.no_gptq)
    builds = {
        "fp32": dict(),
        "int8 every layer": common,
        f"int8 target {args.target}": dict(common, accuracy_target=args.target, accuracy_metric="top1"),
    }
    if args.float_only:
        builds[f"int8 target {args.target} (float only)"] = dict(common, accuracy_target=args.target,
                                                                 accuracy_metric="top1", accuracy_weight_only=False)
    engines, notes = {}, {}
    for label, options in builds.items():
        start = time.perf_counter()
        engines[label] = kiln.build(path, **options)
        q = engines[label].plan.header.get("quantization") or {}
        ran = [v["precision"] for v in (q.get("layers") or {}).values()]
        notes[label] = {"build_s": round(time.perf_counter() - start),
                        "ran": {p: ran.count(p) for p in sorted(set(ran))},
                        "weight_only": len(q.get("weight_only") or {}), "kept_float": len(q.get("kept_float") or {}),
                        "expected_top1": (q.get("accuracy") or {}).get("top1")}
        print(label, notes[label], flush=True)
    if args.before_native_quantize:  # the same float layers, the per-channel quantize as before (torch ops)
        target = engines[f"int8 target {args.target}"].plan.header["quantization"]
        pins = {name: "fp32" for name in target.get("kept_float") or {}}
        pins.update({name: "weight_only" for name in target.get("weight_only") or {}})
        label = f"int8 target {args.target}, per-channel Q in torch (before)"
        tactic = registry.get("cpu.quantize.onednn_per_channel")
        registry.unregister(tactic.name)
        try:
            engines[label] = kiln.build(path, **common, layer_precision=pins)
        finally:
            registry.register(tactic)
        q = engines[label].plan.header.get("quantization") or {}
        ran = [v["precision"] for v in (q.get("layers") or {}).values()]
        notes[label] = {"ran": {p: ran.count(p) for p in sorted(set(ran))}}
        print(label, notes[label], flush=True)
    for label, engine in engines.items():
        found = collections.Counter(step.tactic for step in engine.program.spec.steps
                                    if step.op_type == "QuantizeLinear" and "per_channel" in (step.tactic or ""))
        members = sum(len(segment.members) for segment in engine.program.segments)
        print(f"{label}: per-channel quantize tactics {dict(found)}, {len(engine.program.segments)} native "
              f"segment(s), {members} members", flush=True)
    contexts = {label: e.create_execution_context() for label, e in engines.items()}

    def run(label: str, feeds: dict) -> np.ndarray:
        out = contexts[label].run(feeds)
        return np.asarray(next(iter(out.values())))

    reference = [run("fp32", f).argmax() for f in held]
    agreement = {label: sum(int(run(label, f).argmax() == r) for f, r in zip(held, reference)) for label in engines}
    samples: dict[str, list[float]] = {label: [] for label in engines}
    ratios: dict[str, list[float]] = {label: [] for label in engines}
    loads = []
    feeds = held[0]
    for _ in range(args.rounds):
        loads.append(os.getloadavg()[0])
        medians = {}
        for label in engines:
            block = time_samples(lambda: run(label, feeds), iterations=30, warmup=3, budget_s=3.0, min_runs=5,
                                 clock=time.thread_time if args.threads == 1 else time.perf_counter)
            samples[label] += block
            medians[label] = float(np.median(block))
        for label in engines:
            ratios[label].append(medians[label] / medians["fp32"])
        print("round: " + ", ".join(f"{k} {v:.2f} ms" for k, v in medians.items()), flush=True)
    print(f"\n{cpu_name()}, {args.threads} thread(s), 1-min load {min(loads):.1f}-{max(loads):.1f}, "
          f"{args.rounds} interleaved rounds, torch {torch.__version__}")
    print("| engine | layers (ran as) | top-1 = fp32 (202) | median ms | / fp32 (median of rounds; per round) |")
    print("|---|---|---|---|---|")
    for label in engines:
        ran = ", ".join(f"{n} {p}" for p, n in notes[label]["ran"].items()) or "-"
        per_round = ", ".join(f"{r:.2f}" for r in ratios[label])
        print(f"| {label} | {ran} | {agreement[label]}/{len(held)} | {np.median(samples[label]):.2f} | "
              f"{np.median(ratios[label]):.2f} ({per_round}) |")


if __name__ == "__main__":
    main()
