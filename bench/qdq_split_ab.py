"""A QDQ BERT's 8-bit Elementwise chains and LayerNormQuantize layers split over the engine's threads past
kiln_quantized_split elements: engines at several thresholds (the first, 1M: the float layers' grain, which the
8-bit ones had before) A/B in one process, beside kiln fp32 and onnxruntime int8 on the same QDQ model, every peer
at the same thread count.

    python bench/qdq_split_ab.py --model bert_tiny --threads 2 --rounds 11
    python bench/qdq_split_ab.py --model bert_tiny --splits 1048576,16384,4096,0
    python bench/qdq_split_ab.py --model bert_base --rounds 7 --iterations 20
    python bench/qdq_split_ab.py --form parallel       (every segment in its parallel form)

The QDQ model is bench/quant.py's (onnxruntime quantize_static: uint8 activations, per-channel int8 weights,
reduce_range, its MatMul/Gemm layers). Each kiln QDQ side is its own engine (its segments' form choosers keep their
own history) and sets its threshold before each run. Wall clock, interleaved rotated rounds (quant.rotated_rounds);
prints per-round medians, each side's ratio to the first threshold's per round, the load average, the CPU and the
segments' form counts.
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
from kiln.kernels.cpu import transformer  # noqa: E402
from kiln.kernels.cpu.form_choice import PARALLEL  # noqa: E402

BEFORE = transformer.PARALLEL_ELEMENTS  # the float layers' grain, which the 8-bit ones had


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bert_tiny", choices=tuple(quant.MODELS))
    parser.add_argument("--threads", default="2")
    parser.add_argument("--splits", help=f"kiln_quantized_split of each kiln QDQ side (default: {BEFORE} and the "
                                         "library's own)")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--budget", type=float, default=1.0)
    parser.add_argument("--form", choices=("chosen", PARALLEL), default="chosen",
                        help="parallel: every segment runs its parallel form (the form chooser overridden)")
    args = parser.parse_args(argv)
    default = transformer.set_quantized_split(BEFORE)
    transformer.set_quantized_split(default)
    splits = [int(v) for v in args.splits.split(",")] if args.splits else [BEFORE, default]
    sides = {f"kiln QDQ, split > {v}": v for v in splits}
    peers = ("kiln fp32", *sides, "onnxruntime int8")
    first = next(iter(sides))
    label, exported, qdq = quant.onnxruntime_qdq(args.model, "kiln-qdqsplit-")
    feed = quant.inputs_for(exported, 1, seed=2)[0]
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        engines = {"kiln fp32": kiln.build(str(exported.path)), **{p: kiln.build(str(qdq)) for p in sides}}
        choosers = {p: [s.chooser for s in e.program.segments if s.chooser is not None] for p, e in engines.items()}
        if args.form == PARALLEL:
            for chooser in (c for cs in choosers.values() for c in cs):
                chooser.choose = lambda: PARALLEL

        def side(peer, engine):
            split = sides.get(peer, default)
            return lambda f: (transformer.set_quantized_split(split), quant.first_output(engine.run(f)))[1]

        ort = quant.session(qdq, threads)
        runs = {**{p: side(p, e) for p, e in engines.items()},
                "onnxruntime int8": lambda f: quant.first_output(ort.run(None, f))}
        outputs = {p: runs[p](feed) for p in peers}
        print(f"  {threads} threads: max |kiln QDQ - {first}| "
              f"{max(np.abs(outputs[p] - outputs[first]).max() for p in sides):.3g}, max |{first} - onnxruntime int8| "
              f"{np.abs(outputs[first] - outputs['onnxruntime int8']).max():.3g}")
        medians, loads = quant.rotated_rounds(runs, peers, feed, rounds=args.rounds, iterations=args.iterations,
                                              budget=args.budget, label=f"{threads} thr ")
        print(f"\n{label} at {threads} thread(s), wall clock ms, {args.rounds} interleaved rounds, CPU {cpu_name()}, "
              f"1-min load {min(loads):.1f}-{max(loads):.1f}, form {args.form}; segments' form counts: "
              + "; ".join(f"{p} {[c.runs for c in cs]}" for p, cs in choosers.items()) + "\n")
        last = list(sides)[-1]
        print("| " + " | ".join(f"{p} ms" for p in peers) + " | "
              + " | ".join(f"{p} / {first}" for p in list(sides)[1:]) + f" | {last} / kiln fp32 | "
              f"{last} / onnxruntime int8 |")
        print("|" + "---|" * (2 * len(peers) - 1))
        print("| " + " | ".join(f"{np.median(medians[p]):.3f}" for p in peers) + " | "
              + quant.ratio_cells(medians, *((p, first) for p in list(sides)[1:]), (last, "kiln fp32"),
                                  (last, "onnxruntime int8")) + " |\n", flush=True)
    transformer.set_quantized_split(default)

if __name__ == "__main__":
    main()
