"""A QDQ BERT's 8-bit Elementwise chains and LayerNormQuantize layers split over the engine's threads past
kiln_quantized_split elements (after) or past the float layers' 1M (before: in practice never at seq 128): A/B in one
process, beside kiln fp32 and onnxruntime int8 on the same QDQ model, every peer at the same thread count.

    python bench/qdq_split_ab.py --model bert_tiny --threads 2 --rounds 11
    python bench/qdq_split_ab.py --model bert_base --threads 2 --rounds 7 --iterations 20
    python bench/qdq_split_ab.py --threads 2 --form parallel       (every segment in its parallel form)

The QDQ model is bench/quant.py's (onnxruntime quantize_static: uint8 activations, per-channel int8 weights,
reduce_range, its MatMul/Gemm layers). Each kiln QDQ side is its own engine (its segments' form choosers keep their
own history) and sets the threshold before each run. Wall clock, interleaved rotated rounds (quant.rotated_rounds);
prints per-round medians, the ratios of each round, the load average, the CPU and the segments' form counts.
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

PEERS = ("kiln fp32", "kiln QDQ, before", "kiln QDQ, after", "onnxruntime int8")
BEFORE = transformer.PARALLEL_ELEMENTS  # the float layers' grain, which the 8-bit ones had


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bert_tiny", choices=tuple(quant.MODELS))
    parser.add_argument("--threads", default="2")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--budget", type=float, default=1.0)
    parser.add_argument("--form", choices=("chosen", PARALLEL), default="chosen",
                        help="parallel: every segment runs its parallel form (the form chooser overridden)")
    args = parser.parse_args(argv)
    after = transformer.set_quantized_split(BEFORE)
    transformer.set_quantized_split(after)
    label, exported, qdq = quant.onnxruntime_qdq(args.model, "kiln-qdqsplit-")
    feed = quant.inputs_for(exported, 1, seed=2)[0]
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        engines = {"kiln fp32": kiln.build(str(exported.path)),
                   **{p: kiln.build(str(qdq)) for p in ("kiln QDQ, before", "kiln QDQ, after")}}
        choosers = {p: [s.chooser for s in e.program.segments if s.chooser is not None] for p, e in engines.items()}
        if args.form == PARALLEL:
            for chooser in (c for cs in choosers.values() for c in cs):
                chooser.choose = lambda: PARALLEL

        def side(peer, engine):
            split = BEFORE if peer.endswith("before") else after
            return lambda f: (transformer.set_quantized_split(split), quant.first_output(engine.run(f)))[1]

        ort = quant.session(qdq, threads)
        runs = {**{p: side(p, e) for p, e in engines.items()},
                "onnxruntime int8": lambda f: quant.first_output(ort.run(None, f))}
        print(f"  {threads} threads: max |QDQ after - QDQ before| "
              f"{np.abs(runs['kiln QDQ, after'](feed) - runs['kiln QDQ, before'](feed)).max():.3g}, "
              f"max |QDQ after - onnxruntime int8| {np.abs(runs['kiln QDQ, after'](feed) - runs['onnxruntime int8'](feed)).max():.3g}")
        medians, loads = quant.rotated_rounds(runs, PEERS, feed, rounds=args.rounds, iterations=args.iterations,
                                              budget=args.budget, label=f"{threads} thr ")
        print(f"\n{label} at {threads} thread(s), wall clock ms, {args.rounds} interleaved rounds, CPU {cpu_name()}, "
              f"1-min load {min(loads):.1f}-{max(loads):.1f}, form {args.form}, kiln_quantized_split {after}; "
              "segments' form counts: " + "; ".join(f"{p} {[c.runs for c in cs]}" for p, cs in choosers.items()) + "\n")
        print("| " + " | ".join(f"{p} ms" for p in PEERS) + " | QDQ after / before | QDQ after / fp32 | "
              "QDQ after / onnxruntime int8 |")
        print("|" + "---|" * (len(PEERS) + 3))
        print("| " + " | ".join(f"{np.median(medians[p]):.3f}" for p in PEERS) + " | "
              + quant.ratio_cells(medians, ("kiln QDQ, after", "kiln QDQ, before"), ("kiln QDQ, after", "kiln fp32"),
                                  ("kiln QDQ, after", "onnxruntime int8")) + " |\n", flush=True)
    transformer.set_quantized_split(after)


if __name__ == "__main__":
    main()
