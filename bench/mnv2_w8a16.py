"""MobileNetV2 INT8 with W8A16 layers on the CPU (issue 12): the accuracy target's engine, whose layers between int8
and float run W8A16 (int8 weights, 16-bit inputs: two int8 convolutions on the input's bytes) and are chosen by
milliseconds per accuracy, against fp32, int8 every layer, the previous 97% engine (target 0.98, float layers only,
fewest layers) and onnxruntime's QDQ int8 model.

    python bench/mnv2_w8a16.py [--rounds 5] [--target 0.97] [--margin 0.01] [--redraws 4] [--no-previous] [--threads 1]
                               [--timing-cache PATH] [--rebuilds N] [--split-too] [--plan PLAN.json] [--avx2]

Images as quantacc4 (kiln.quant.data.photo_variants: every third of 112 calibrates (38), held out: the other 74 and
photo_variants(8, seed=1)'s 128 = 202). Agreement = top-1 equal to kiln fp32's top-1 on the same input; redraws:
every held-out input x (1 + 1e-6 N(0,1)) (far below a pixel's step; what a different float summation order does),
fp32's top-1 taken again on each. Engines: real CPU builds (percentile, GPTQ). onnxruntime: quantize_static QDQ
(MinMax, uint8 activations, per-channel int8 weights, reduce_range) on the same 38 images, ORT_ENABLE_ALL, --threads
intra-op threads. Timing: interleaved rounds, one block per engine per round, thread CPU time at 1 thread (wall clock
at more), medians; ratios to kiln fp32 per round. Prints tables; CPU and load named.

--timing-cache: the builds' timing cache (the W8A16 search's layer times too: a second run with the same file makes
the same plan); --rebuilds N: the W8A16 engine built N more times with that cache, each plan printed and compared
with the first (stable plans), the first one's engine timed. --split-too: the W8A16 engine built again with the
one-pass GEMM tactic (cpu.qconv.w8a16_gemm) taken away, from the same timing cache (a temporary one where none is
given): the same plan, its 1x1 W8A16 layers on the split path (cpu.qconv.w8a16), timed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--avx2" in sys.argv:  # every peer on an AVX2-only CPU (bench/quant.py's caps), set before any library loads
    import cpuid_avx2  # noqa: E402

    cpuid_avx2.enable()
    os.environ["KILN_CPU_ISA"] = "avx2"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.quant.data import photo_variants  # noqa: E402
from kiln.tactics import registry  # noqa: E402
from kiln.tactics.cpu import w8a16 as w8a16_tactics  # noqa: E402
from kiln.zoo.timing import time_samples  # noqa: E402


GEMM = "cpu.qconv.w8a16_gemm"


def ort_qdq_session(path: str, calibration: list[dict], folder: str, threads: int = 1, spinning: bool = True):
    import onnxruntime as ort
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType, \
        quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter(calibration)

        def get_next(self):
            return next(self.items, None)

    out = str(Path(folder) / "mnv2_qdq.onnx")
    quantize_static(path, out, Reader(), quant_format=QuantFormat.QDQ, activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8, per_channel=True, reduce_range=True,
                    calibrate_method=CalibrationMethod.MinMax)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if not spinning:  # its intra-op threads sleep after a run instead of spinning (a shared machine's cores)
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(out, options, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--target", type=float, default=0.97)
    parser.add_argument("--margin", type=float, default=0.01)
    parser.add_argument("--redraws", type=int, default=4)
    parser.add_argument("--no-previous", action="store_true", help="leave out the previous 0.98 float-only engine")
    parser.add_argument("--timing-cache", default=None, help="the builds' timing cache (layer times of the search too)")
    parser.add_argument("--rebuilds", type=int, default=0, help="build the W8A16 engine this many more times")
    parser.add_argument("--threads", type=int, default=1, help="builds and runs at this many threads (above 1: "
                        "wall clock, not the thread's CPU time)")
    parser.add_argument("--plan", default=None, help="a plan of bench/int8_avx2_sensitivity.py --save: the target's "
                        "engine built with its layers pinned (layer_precision), without the search")
    parser.add_argument("--avx2", action="store_true", help="kiln (KILN_CPU_ISA=avx2) and onnxruntime's MLAS "
                        "(bench/cpuid_avx2.py's cpuid mask) capped to AVX2")
    parser.add_argument("--split-too", action="store_true",
                        help="the W8A16 engine again without the one-pass GEMM tactic (the same plan)")
    args = parser.parse_args()
    if args.split_too and args.timing_cache is None:
        args.timing_cache = str(Path(tempfile.mkdtemp()) / "timing.json")
    torch.set_num_threads(args.threads)
    one = args.threads == 1
    clock, clock_name = (time.thread_time, "thread CPU time") if one else (time.perf_counter, "wall clock")
    images = photo_variants()
    calibration = [{"pixel_values": v} for v in images[::3]]
    held = [{"pixel_values": v} for i, v in enumerate(images) if i % 3] + \
        [{"pixel_values": v} for v in photo_variants(8, seed=1)]
    path = str(zoo.mobilenet_v2())
    common = dict(precision="int8", calibration=calibration, calibrator="percentile", gptq=True,
                  timing_cache=args.timing_cache)
    target = f"kiln int8 + W8A16, target {args.target} + {args.margin}"
    builds = {
        "kiln fp32": dict(),
        "kiln int8 every layer": common,
        target: dict(common, accuracy_target=args.target, accuracy_metric="top1", accuracy_margin=args.margin),
    }
    if args.split_too:
        builds["kiln int8 + W8A16, split path only (the same plan)"] = dict(builds[target])
    if not args.no_previous:
        builds["kiln int8, target 0.98 float only (before)"] = dict(
            common, accuracy_target=0.98, accuracy_metric="top1", accuracy_margin=0.0, accuracy_weight_only=False)
    if args.plan:
        plan = json.loads(Path(args.plan).read_text())
        builds.pop(target, None)
        builds[f"kiln int8, a target's plan pinned ({len(plan['fp32'])} fp32, {len(plan['w8a16'])} w8a16)"] = dict(
            common, layer_precision={**dict.fromkeys(plan["fp32"], "fp32"), **dict.fromkeys(plan["w8a16"], "w8a16")})
    runners, notes = {}, {}
    for label, options in builds.items():
        start = time.perf_counter()
        registry.load_device("cpu")
        gemm = registry._TACTICS.pop(GEMM) if label.endswith("split path only (the same plan)") else None
        try:
            engine = kiln.build(path, **options)
        finally:
            if gemm is not None:
                registry._TACTICS[GEMM] = gemm
        tactics = [s.tactic for s in engine.plan.program.steps]
        q = engine.plan.header.get("quantization") or {}
        ran = [v["precision"].split(" (")[0] for v in (q.get("layers") or {}).values()]
        accuracy = q.get("accuracy") or {}
        notes[label] = {"build_s": round(time.perf_counter() - start),
                        "ran": {p: ran.count(p) for p in sorted(set(ran))},
                        "w8a16": len(q.get("w8a16") or ()), "kept_float": len(q.get("kept_float") or {}),
                        "expected_top1": accuracy.get("top1"), "plan": accuracy.get("chosen_plan"),
                        "plans": {k: (len(v["kept_float"]), len(v["w8a16"]), v["ms"])
                                  for k, v in (accuracy.get("plans") or {}).items()},
                        "w8a16 tactics": {t: tactics.count(t) for t in w8a16_tactics.TACTICS},
                        "segments": len(engine.program.segments),
                        "members": sum(len(s.members) for s in engine.program.segments)}
        print(label, notes[label], flush=True)
        if q.get("w8a16"):
            print("  w8a16:", q["w8a16"], "\n  fp32:", sorted(q.get("kept_float") or {}), flush=True)
        if label.startswith("kiln int8 + W8A16"):
            first = (sorted(q.get("kept_float") or {}), q.get("w8a16"))
            for k in range(args.rebuilds):
                again = kiln.build(path, **options).plan.header["quantization"]
                plan = (sorted(again.get("kept_float") or {}), again.get("w8a16"))
                print(f"  rebuild {k + 1}: {len(plan[0])} fp32 + {len(plan[1])} w8a16, "
                      f"{'the same plan' if plan == first else 'ANOTHER PLAN'}", flush=True)
        context = engine.create_execution_context()
        runners[label] = lambda feeds, c=context: np.asarray(next(iter(c.run(feeds).values())))
    with tempfile.TemporaryDirectory() as folder:
        ort_session = ort_qdq_session(path, calibration, folder, args.threads)
        name = ort_session.get_inputs()[0].name
        runners["onnxruntime int8 QDQ"] = lambda feeds: ort_session.run(None, {name: feeds["pixel_values"]})[0]
        notes["onnxruntime int8 QDQ"] = {"ran": {}}
        rng = np.random.default_rng(12)
        draws = [held] + [[{"pixel_values": (f["pixel_values"] * (1 + 1e-6 * rng.standard_normal(
            f["pixel_values"].shape))).astype(np.float32)} for f in held] for _ in range(args.redraws)]
        agreement: dict[str, list[int]] = {label: [] for label in runners}
        for feeds in draws:
            reference = [runners["kiln fp32"](f).argmax() for f in feeds]
            for label, run in runners.items():
                agreement[label].append(sum(int(run(f).argmax() == r) for f, r in zip(feeds, reference)))
        print({k: v for k, v in agreement.items()}, flush=True)
        samples: dict[str, list[float]] = {label: [] for label in runners}
        ratios: dict[str, list[float]] = {label: [] for label in runners}
        loads = []
        feeds = held[0]
        for _ in range(args.rounds):
            loads.append(os.getloadavg()[0])
            medians = {}
            for label, run in runners.items():
                block = time_samples(lambda: run(feeds), iterations=30, warmup=3, budget_s=3.0, min_runs=5,
                                     clock=clock)
                samples[label] += block
                medians[label] = float(np.median(block))
            for label in runners:
                ratios[label].append(medians[label] / medians["kiln fp32"])
            print("round: " + ", ".join(f"{k} {v:.2f} ms" for k, v in medians.items()), flush=True)
    print(f"\n{cpu_name()}, {args.threads} thread(s), {clock_name}, 1-min load {min(loads):.1f}-{max(loads):.1f}, "
          f"{args.rounds} interleaved rounds, torch {torch.__version__}")
    print(f"| engine | layers (ran as) | top-1 = fp32 of {len(held)}: as is; {args.redraws} redraws (mean) | median ms "
          "| / kiln fp32 (median of rounds; per round) |")
    print("|---|---|---|---|---|")
    for label in runners:
        ran = ", ".join(f"{n} {p}" for p, n in notes[label]["ran"].items()) or "-"
        counts = agreement[label]
        redrawn = ", ".join(str(c) for c in counts[1:])
        per_round = ", ".join(f"{r:.2f}" for r in ratios[label])
        print(f"| {label} | {ran} | {counts[0]}; {redrawn} ({np.mean(counts):.1f} = "
              f"{100 * np.mean(counts) / len(held):.1f}%) | {np.median(samples[label]):.2f} | "
              f"{np.median(ratios[label]):.2f} ({per_round}) |")


if __name__ == "__main__":
    main()
