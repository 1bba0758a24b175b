"""kiln on onnxruntime's QDQ BERT-tiny, with and without the int8 Q/DQ fused into the native elementwise chains:
A/B in one process, at 1 and 2 threads.

    python bench/quant_fuse_ab.py --threads 1,2 --rounds 7

Session 26 (h-q8thr) left kiln's engine of onnxruntime's QDQ BERT-tiny at 1.29x kiln's FP32 engine at 2 threads
(bench/results/quant-cpu-2026-12-06.md): of its 64 steps, 16 DequantizeLinear and 12 QuantizeLinear sat around
the bias Adds, the Gelus and the residual Adds, each a pass over the tensor. fuse_int8_dequantize_into_elementwise
and fuse_int8_quantize_into_elementwise (kiln/passes/fusion/elementwise_dequantize.py) make each DQ -> chain -> Q
one native Elementwise step that reads and writes 8 bits. "before" is the same QDQ model built without those two
rules (the old engine exactly).

Peers, timed in interleaved rounds (each round: every peer's block once, order rotated; wall clock):

    kiln fp32            kiln.build of the float ONNX file
    kiln QDQ, before     the QDQ model without the two rules
    kiln QDQ, after      the QDQ model, this tree
    onnxruntime int8     the QDQ model, ORT_ENABLE_ALL

Prints the per-round medians, each round's ratios, the load average and the CPU, one table per thread count.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant  # noqa: E402  bench/quant.py: models, inputs, the onnxruntime QDQ model

import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.passes import fusion  # noqa: E402
from kiln.zoo.timing import time_samples  # noqa: E402

PEERS = ("kiln fp32", "kiln QDQ, before", "kiln QDQ, after", "onnxruntime int8")
RULES = ("fuse_int8_dequantize_into_elementwise", "fuse_int8_quantize_into_elementwise")


def build_without_rules(path: Path):
    """The QDQ engine as before: the int8 Q/DQ steps of their own."""
    saved = list(fusion.RULES)
    fusion.RULES[:] = [rule for rule in saved if rule[0] not in RULES]
    try:
        return kiln.build(str(path))
    finally:
        fusion.RULES[:] = saved


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bert_tiny")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--budget", type=float, default=1.5)
    args = parser.parse_args(argv)
    label, seq = quant.MODELS[args.model]
    exported = zoo.export(args.model, batch=1, seq=seq) if seq else zoo.export(args.model, batch=1)
    calibration = quant.inputs_for(exported, 8, seed=1)
    feeds = quant.inputs_for(exported, 4, seed=2)
    qdq = Path(tempfile.mkdtemp(prefix="kiln-q8fuse-")) / f"{args.model}-qdq.onnx"
    quant.ort_qdq(exported.path, calibration, qdq, seq is not None)
    tables = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        engines = {"kiln fp32": kiln.build(str(exported.path)), "kiln QDQ, before": build_without_rules(qdq),
                   "kiln QDQ, after": kiln.build(str(qdq))}
        steps = {p: len(e.program.steps) + sum(len(s.members) - 1 for s in e.program.segments)
                 for p, e in engines.items()}
        ort = quant.session(qdq, threads)
        first = lambda out: np.asarray(next(iter(out.values())) if isinstance(out, dict) else out[0])  # noqa: E731
        runs = {**{p: (lambda f, e=e: first(e.run(f))) for p, e in engines.items()},
                "onnxruntime int8": lambda f: first(ort.run(None, f))}
        for f in feeds:  # the fused steps compute what the separate ones did
            a, b, o = runs["kiln QDQ, before"](f), runs["kiln QDQ, after"](f), runs["onnxruntime int8"](f)
            print(f"  {threads} thread(s): max |after - before| {np.abs(a - b).max():.3g}, max |after - onnxruntime "
                  f"int8| {np.abs(b - o).max():.3g} (output scale {np.abs(o).max():.3g})")
        feed = feeds[0]
        medians = {p: [] for p in PEERS}
        loads = []
        for r in range(args.rounds):
            order = PEERS[r % len(PEERS):] + PEERS[:r % len(PEERS)]
            loads.append(os.getloadavg()[0])
            for peer in order:
                block = time_samples(lambda: runs[peer](feed), iterations=args.iterations, warmup=5,
                                     budget_s=args.budget, min_runs=10)
                medians[peer].append(float(np.median(block)))
            print(f"  {threads} thread(s), round {r}: load {loads[-1]:.1f}, "
                  + ", ".join(f"{p} {medians[p][-1]:.3f}" for p in PEERS), flush=True)

        def ratio(a: str, b: str) -> str:
            per = [x / y for x, y in zip(medians[a], medians[b])]
            return f"**{np.median(per):.2f}** ({', '.join(f'{v:.2f}' for v in per)})"

        tables.append(
            f"| {threads} | {min(loads):.1f}-{max(loads):.1f} | {steps['kiln QDQ, before']} -> {steps['kiln QDQ, after']} | "
            + " | ".join(f"{np.median(medians[p]):.3f}" for p in PEERS) + " | "
            + " | ".join(ratio(a, b) for a, b in (("kiln QDQ, after", "kiln QDQ, before"),
                                                  ("kiln QDQ, before", "kiln fp32"),
                                                  ("kiln QDQ, after", "kiln fp32"),
                                                  ("kiln QDQ, after", "onnxruntime int8"))) + " |")
    print(f"\n{label}, wall clock ms, medians of {args.rounds} interleaved rounds' medians, CPU {cpu_name()}\n")
    print("| threads | load (1-min) | QDQ steps | " + " | ".join(f"{p}" for p in PEERS)
          + " | after / before | before / kiln fp32 | after / kiln fp32 | after / ORT int8 |")
    print("|" + "---|" * (len(PEERS) + 7))
    print("\n".join(tables))


if __name__ == "__main__":
    main()
