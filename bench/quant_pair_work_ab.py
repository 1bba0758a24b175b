"""BERT-tiny's attention split over the engine's threads (attention.c counting each (query, key) pair's softmax,
kiln_attention_pair_work) or not (0: the pairs' products only, as before): A/B in one process, kiln fp32 and kiln
on onnxruntime's QDQ model.

    python bench/quant_pair_work_ab.py --threads 1,2 --rounds 9
    python bench/quant_pair_work_ab.py --threads 2 --form parallel     (every segment in its parallel form)

Each side is its own engine (its segments' form choosers keep their own history) and sets the count before each
run. At 1 thread nothing differs (the control). Wall clock, interleaved rotated rounds (quant.rotated_rounds);
prints per-round medians, the ratios of each round, the load average and the CPU.
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

PEERS = ("kiln fp32, before", "kiln fp32, after", "kiln QDQ, before", "kiln QDQ, after", "onnxruntime int8")


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bert_tiny")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--budget", type=float, default=1.0)
    parser.add_argument("--form", choices=("chosen", PARALLEL), default="chosen",
                        help="parallel: every segment runs its parallel form (the form chooser overridden)")
    args = parser.parse_args(argv)
    after = transformer.set_attention_pair_work(0)
    transformer.set_attention_pair_work(after)
    label, exported, qdq = quant.onnxruntime_qdq(args.model, "kiln-pairwork-")
    feed = quant.inputs_for(exported, 1, seed=2)[0]
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        paths = {"kiln fp32": exported.path, "kiln QDQ": qdq}
        engines = {p: kiln.build(str(paths[p.split(",")[0]])) for p in PEERS[:4]}
        choosers = {p: [s.chooser for s in e.program.segments if s.chooser is not None] for p, e in engines.items()}
        if args.form == PARALLEL:
            for chooser in (c for cs in choosers.values() for c in cs):
                chooser.choose = lambda: PARALLEL

        def side(peer, engine):
            work = after if peer.endswith("after") else 0
            return lambda f: (transformer.set_attention_pair_work(work), quant.first_output(engine.run(f)))[1]

        ort = quant.session(qdq, threads)
        runs = {**{p: side(p, e) for p, e in engines.items()},
                "onnxruntime int8": lambda f: quant.first_output(ort.run(None, f))}
        for a, b in (("kiln fp32, before", "kiln fp32, after"), ("kiln QDQ, before", "kiln QDQ, after")):
            print(f"  {threads} threads: max |{b} - {a}| {np.abs(runs[b](feed) - runs[a](feed)).max():.3g}")
        medians, loads = quant.rotated_rounds(runs, PEERS, feed, rounds=args.rounds, iterations=args.iterations,
                                              budget=args.budget, label=f"{threads} thr ")
        print(f"\n{label} at {threads} thread(s), wall clock ms, {args.rounds} interleaved rounds, CPU {cpu_name()}, "
              f"1-min load {min(loads):.1f}-{max(loads):.1f}, form {args.form}; segments' form counts: "
              + "; ".join(f"{p} {[c.runs for c in cs]}" for p, cs in choosers.items()) + "\n")

        print("| " + " | ".join(f"{p} ms" for p in PEERS) + " | fp32 after / before | QDQ after / before | "
              "QDQ after / fp32 after |")
        print("|" + "---|" * (len(PEERS) + 3))
        print("| " + " | ".join(f"{np.median(medians[p]):.3f}" for p in PEERS) + " | "
              + quant.ratio_cells(medians, ("kiln fp32, after", "kiln fp32, before"),
                                  ("kiln QDQ, after", "kiln QDQ, before"),
                                  ("kiln QDQ, after", "kiln fp32, after")) + " |\n", flush=True)
    transformer.set_attention_pair_work(after)


if __name__ == "__main__":
    main()
