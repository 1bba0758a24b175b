"""Does a new int8 tactic change what an INT8 engine computes? The same builds with and without it, side by side.

    python bench/quant_tactics_drift.py --avx2 --without cpu.qconv.kiln_i8,cpu.qconv.kiln_dw
    python bench/quant_tactics_drift.py --model resnet50 --held-out 64 --without cpu.qconv.kiln_i8

Builds kiln's own PTQ engine (bench/quant.py's calibration) and kiln on onnxruntime's QDQ model twice each: with every
tactic, then with `--without` left out (the engines as they were before it came). Per engine pair, on `--held-out`
crops: the top-1 agreement of each with kiln fp32 and with each other, the largest logit difference between the two
(against the logits' range), and which tactics their quantized layers took. Both engines compute the same int8
arithmetic where their kernels agree to the bit; a layer's kernel may round a tie one step the other way (within one
quantization step of the reference), and the chains of such steps are what this measures. onnxruntime's int8 session
on the QDQ model is given as a third opinion where there is one.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant  # noqa: E402  bench/quant.py (reads --avx2 from sys.argv before any library loads)

import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
from kiln.kernels.cpu import cpu_features  # noqa: E402
from kiln.tactics import registry  # noqa: E402


def tactic_counts(engine) -> str:
    counts = collections.Counter(s.tactic.removeprefix("cpu.") or "default" for s in engine.plan.program.steps
                                 if s.op_type in ("QConv", "QGemm"))
    return ", ".join(f"{t} x{n}" for t, n in counts.most_common())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mobilenet_v2", choices=["mobilenet_v2", "resnet50"])
    parser.add_argument("--without", required=True, help="comma-separated tactic names")
    parser.add_argument("--held-out", type=int, default=64)
    parser.add_argument("--calibrator", default="entropy")
    parser.add_argument("--avx2", action="store_true", help="bench/quant.py's cap: every library on AVX2")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    exported = zoo.export(args.model)
    calibration = quant.inputs_for(exported, 8, seed=1)
    held_out = quant.inputs_for(exported, args.held_out, seed=2)
    qdq = Path(tempfile.mkdtemp(prefix="kiln-qdrift-")) / "qdq.onnx"
    quant.ort_qdq(exported.path, calibration, qdq, False)
    print(f"# {args.model}: with and without {args.without}; {cpu_features.describe()}; "
          f"{args.held_out} held-out crops; load {os.getloadavg()[0]:.2f}\n")
    fp32 = kiln.build(str(exported.path))
    builds = {"kiln int8": lambda **kw: kiln.build(str(exported.path), precision="int8", calibration=calibration,
                                                   calibrator=args.calibrator, **kw),
              "kiln int8 (ORT QDQ)": lambda **kw: kiln.build(str(qdq), **kw)}
    # the reference: every quantized layer on kiln's reference op (float64 on exact integers), the Q/DQ steps on theirs
    reference = {peer: build(tactics=["cpu.quantize", "cpu.dequantize"]) for peer, build in builds.items()}
    with_all = {peer: build() for peer, build in builds.items()}
    registry.load_device("cpu")
    for name in [t for t in args.without.split(",") if t]:
        if registry.get(name) is None:
            parser.error(f"--without {name}: no such tactic")
        registry.unregister(name)
    without = {peer: build() for peer, build in builds.items()}

    def logits(engine) -> np.ndarray:
        return np.stack([quant.first_output(engine.run(f)).reshape(-1) for f in held_out])

    ort = quant.session(qdq, 1)
    ort_logits = np.stack([quant.first_output(ort.run(None, f)).reshape(-1) for f in held_out])
    want = logits(fp32).argmax(axis=1)
    print("| engine | top-1 = kiln fp32 (with) | top-1 = kiln fp32 (without) | top-1 with = without | "
          "max logit diff (logit range) | with - reference: max, mean | without - reference: max, mean | "
          "QConv/QGemm tactics with | without |")
    print("|---|---|---|---|---|---|---|---|---|")
    for peer in builds:
        a, b, ref = logits(with_all[peer]), logits(without[peer]), logits(reference[peer])
        line = (f"| {peer} | {np.mean(a.argmax(1) == want) * 100:.0f}% | {np.mean(b.argmax(1) == want) * 100:.0f}% | "
                f"{np.mean(a.argmax(1) == b.argmax(1)) * 100:.0f}% | {np.abs(a - b).max():.3f} ({np.ptp(b):.1f}) | "
                f"{np.abs(a - ref).max():.3f}, {np.abs(a - ref).mean():.4f} | "
                f"{np.abs(b - ref).max():.3f}, {np.abs(b - ref).mean():.4f} | "
                f"{tactic_counts(with_all[peer])} | {tactic_counts(without[peer])} |")
        print(line)
        if peer == "kiln int8 (ORT QDQ)":
            print(f"| onnxruntime int8 (same QDQ) | {np.mean(ort_logits.argmax(1) == want) * 100:.0f}% | | "
                  f"with {np.mean(a.argmax(1) == ort_logits.argmax(1)) * 100:.0f}%, without "
                  f"{np.mean(b.argmax(1) == ort_logits.argmax(1)) * 100:.0f}% | with {np.abs(a - ort_logits).max():.3f}"
                  f", without {np.abs(b - ort_logits).max():.3f} | {np.abs(ort_logits - ref).max():.3f}, "
                  f"{np.abs(ort_logits - ref).mean():.4f} | | | |")
    print("\nThe build's whole-engine check (kiln/builder/accuracy.py: the tuned engine against the default one, "
          "whose own drift is its float inputs scaled by 1 + 2^-20):\n")
    for label, engines in (("with", with_all), ("without", without)):
        for peer, engine in engines.items():
            record = engine.plan.header.get("tactics", {}).get("accuracy", {})
            outputs = record.get("outputs", {})
            print(f"- {peer} {label}: " + "; ".join(
                f"error {o.get('error', 0):.3f} (the default engine's own drift {o.get('default_error', 0):.3f}, "
                f"allowed {o.get('allowed', 0):.3f})" for o in outputs.values()) + f", {record.get('tuned_engine')}")
    print(f"\nload {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
