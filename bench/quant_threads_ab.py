"""kiln on onnxruntime's QDQ BERT-tiny at 2 threads, with and without the int8 matmuls' serial form: A/B in one process.

    python bench/quant_threads_ab.py --threads 2 --rounds 7
    python bench/quant_threads_ab.py --model mobilenet_v2 --rounds 5      (int8 convolutions: the same serial form)

Session 26 (h-q8cpu) found kiln's engine of onnxruntime's QDQ BERT-tiny at 2 threads 4.2x onnxruntime's time: its
64 steps (QGemm, Q/DQ, Add, GELU) all ran on OpenMP's count, each a parallel region whose join waits out a
descheduled thread on held cores, because no member had a one-thread form, so its native segment had no form choice
(kiln/kernels/cpu/form_choice.py). onednn_int8.QMatMul now binds a small matmul twice (onednn_primitives.thread_forms)
and the segment chooses per run. "before" is the same model built with the int8 layers' serial twins off
(build_parallel_only: the old engine exactly).

Peers, timed in interleaved rounds (each round: every peer's block once, order rotated; wall clock):

    kiln fp32            kiln.build of the float ONNX file
    kiln QDQ, before     the QDQ model, int8 layers without a serial twin (as before)
    kiln QDQ, after      the QDQ model, this tree (the segment's FormChooser)
    onnxruntime int8     the QDQ model, ORT_ENABLE_ALL

Prints the per-round medians, the ratios of each round, the segment's form counts, the load average and the CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant  # noqa: E402  bench/quant.py: models, inputs, the onnxruntime QDQ model

import kiln  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.kernels.cpu import onednn_int8  # noqa: E402

PEERS = ("kiln fp32", "kiln QDQ, before", "kiln QDQ, after", "onnxruntime int8")


def build_parallel_only(path: Path):
    """The QDQ engine as before this change: int8 layers on OpenMP's count only, no serial twin (float layers as
    they are: MobileNetV2's QDQ engine had a form choice in one of its two segments before, from float members)."""
    original = onednn_int8._Quantized._finish_forms

    def parallel_only(self, descriptor, forms, *rest):
        return original(self, descriptor, (None,), *rest)

    onednn_int8._Quantized._finish_forms = parallel_only
    try:
        return kiln.build(str(path))
    finally:
        onednn_int8._Quantized._finish_forms = original


def choosers(engine) -> list:
    return [s.chooser for s in engine.program.segments if s.chooser is not None]


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bert_tiny")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--budget", type=float, default=1.5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    label, exported, qdq = quant.onnxruntime_qdq(args.model, "kiln-q8thr-")
    feeds = quant.inputs_for(exported, 4, seed=2)
    engines = {"kiln fp32": kiln.build(str(exported.path)), "kiln QDQ, before": build_parallel_only(qdq),
               "kiln QDQ, after": kiln.build(str(qdq))}
    print(f"segments with a form choice: before {len(choosers(engines['kiln QDQ, before']))}, "
          f"after {len(choosers(engines['kiln QDQ, after']))}")
    ort = quant.session(qdq, args.threads)
    runs = {**{p: (lambda f, e=e: quant.first_output(e.run(f))) for p, e in engines.items()},
            "onnxruntime int8": lambda f: quant.first_output(ort.run(None, f))}
    # agreement on held-out inputs: the serial form computes the same thing (max abs difference, before vs after)
    for f in feeds:
        a, b, o = runs["kiln QDQ, before"](f), runs["kiln QDQ, after"](f), runs["onnxruntime int8"](f)
        print(f"  max |after - before| {np.abs(a - b).max():.3g}, max |after - onnxruntime int8| "
              f"{np.abs(b - o).max():.3g} (output scale {np.abs(o).max():.3g})")
    feed = feeds[0]
    medians, loads = quant.rotated_rounds(runs, PEERS, feed, rounds=args.rounds, iterations=args.iterations,
                                          budget=args.budget)
    after = choosers(engines["kiln QDQ, after"])
    print(f"\n{label} at {args.threads} threads, wall clock ms, {args.rounds} interleaved rounds, CPU {cpu_name()}, "
          f"1-min load {min(loads):.1f}-{max(loads):.1f}; after's segment ran {after[0].runs if after else None}\n")

    print("| " + " | ".join(f"{p} ms" for p in PEERS) + " | after / before | before / ORT int8 | after / ORT int8 | "
          "after / kiln fp32 |")
    print("|" + "---|" * (len(PEERS) + 4))
    print("| " + " | ".join(f"{np.median(medians[p]):.3f}" for p in PEERS) + " | "
          + quant.ratio_cells(medians, ("kiln QDQ, after", "kiln QDQ, before"),
                              ("kiln QDQ, before", "onnxruntime int8"), ("kiln QDQ, after", "onnxruntime int8"),
                              ("kiln QDQ, after", "kiln fp32")) + " |")


if __name__ == "__main__":
    main()
