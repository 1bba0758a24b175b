"""A QDQ transformer (MiniLM by default) with and without kiln's AVX2 int8 GEMM (cpu.qgemm.kiln_i8) as a candidate of
its QGemm layers, A/B in one process, beside kiln fp32 and onnxruntime int8 / fp32, every peer at the same threads.

    python bench/int8_gemm_minilm_ab.py --threads 1 --clock thread --rounds 9
    python bench/int8_gemm_minilm_ab.py --threads 2 --rounds 9          (run it in several fresh processes)

The QDQ model is bench/quant.py's (onnxruntime quantize_static: uint8 activations, per-channel int8 weights,
reduce_range; MatMul/Gemm layers), batch 1 at the model's sequence length; `--source kiln`: kiln's own int8 build of
the float model instead (its FFN QGemms carry the Gelu), onnxruntime's QDQ model still its int8 peer. "kiln QDQ before" is built with the tactic
taken out of the registry (what the tuner chose before it existed: oneDNN int8 or the float layer), "kiln QDQ" with
every tactic (the tuner's choice, never forced). Interleaved rotated rounds (quant.rotated_rounds); prints per-round
medians, the ratios per round, the load average, which tactic each side's QGemm layers run, and how far the two QDQ
engines' outputs are from each other and from onnxruntime's.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant  # noqa: E402  bench/quant.py: models, inputs, the onnxruntime QDQ model

import kiln  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.tactics import registry  # noqa: E402

TACTIC = "cpu.qgemm.kiln_i8"
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def build_without(build, name: str):
    """build() as the tuner makes it with tactic `name` out of the registry (put back after)."""
    registry.load_device("cpu")
    removed = registry._TACTICS.pop(name)
    try:
        return build()
    finally:
        registry._TACTICS[name] = removed


def qgemm_tactics(engine) -> dict[str, int]:
    return dict(collections.Counter(s.tactic for s in engine.plan.program.steps if s.op_type == "QGemm"))


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="minilm", choices=tuple(quant.MODELS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--budget", type=float, default=1.5)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="thread: the calling thread's CPU time (1 thread only)")
    parser.add_argument("--source", choices=("ort", "kiln"), default="ort",
                        help="the int8 engines: onnxruntime's QDQ model, or kiln's own int8 build (entropy calibration "
                             "on the 8 inputs onnxruntime's is calibrated on: bench/quant.py's 'kiln int8')")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    label, exported, qdq = quant.onnxruntime_qdq(args.model, "kiln-i8ab-")
    feed = quant.inputs_for(exported, 1, seed=2)[0]
    if args.source == "ort":
        def build_int8():
            return kiln.build(str(qdq))
    else:
        calibration = quant.inputs_for(exported, 8, seed=1)

        def build_int8():
            return kiln.build(str(exported.path), precision="int8", calibration=calibration, calibrator="entropy")
    engines = {"kiln fp32": kiln.build(str(exported.path)), "kiln QDQ before": build_without(build_int8, TACTIC),
               "kiln QDQ": build_int8()}
    ort_int8, ort_fp32 = quant.session(qdq, args.threads), quant.session(exported.path, args.threads)
    runs = {**{p: (lambda f, e=e: quant.first_output(e.run(f))) for p, e in engines.items()},
            "onnxruntime int8": lambda f: quant.first_output(ort_int8.run(None, f)),
            "onnxruntime fp32": lambda f: quant.first_output(ort_fp32.run(None, f))}
    peers = tuple(runs)
    outputs = {p: runs[p](feed) for p in peers}
    scale = float(np.abs(outputs["kiln fp32"]).max())
    print(f"# {label}, int8 from {args.source}, {args.threads} thread(s), CPU {cpu_name()}; QGemm tactics: before "
          f"{qgemm_tactics(engines['kiln QDQ before'])}, after {qgemm_tactics(engines['kiln QDQ'])}")
    print(f"# max |kiln QDQ - kiln QDQ before| {np.abs(outputs['kiln QDQ'] - outputs['kiln QDQ before']).max():.3g}, "
          f"max |kiln QDQ - onnxruntime int8| {np.abs(outputs['kiln QDQ'] - outputs['onnxruntime int8']).max():.3g}, "
          f"max |kiln QDQ before - onnxruntime int8| "
          f"{np.abs(outputs['kiln QDQ before'] - outputs['onnxruntime int8']).max():.3g} (output magnitude {scale:.3g})")
    medians, loads = quant.rotated_rounds(runs, peers, feed, rounds=args.rounds, iterations=args.iterations,
                                          budget=args.budget, clock=CLOCKS[args.clock])
    print(f"\n{label} at {args.threads} thread(s), {args.clock} clock ms, {args.rounds} interleaved rounds, "
          f"1-min load {min(loads):.1f}-{max(loads):.1f}\n")
    print("| " + " | ".join(f"{p} ms" for p in peers) + " | kiln QDQ / before | kiln QDQ / kiln fp32 | "
          "kiln QDQ / onnxruntime int8 | before / onnxruntime int8 |")
    print("|" + "---|" * (len(peers) + 4))
    print("| " + " | ".join(f"{np.median(medians[p]):.3f}" for p in peers) + " | "
          + quant.ratio_cells(medians, ("kiln QDQ", "kiln QDQ before"), ("kiln QDQ", "kiln fp32"),
                              ("kiln QDQ", "onnxruntime int8"), ("kiln QDQ before", "onnxruntime int8")) + " |\n",
          flush=True)


if __name__ == "__main__":
    main()
