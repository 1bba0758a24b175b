"""kiln on onnxruntime's QDQ BERT-tiny, with and without the int8 Q/DQ fused into the native elementwise chains:
A/B in one process, at 1 and 2 threads.

    python bench/quant_fuse_ab.py --threads 1,2 --rounds 7
    python bench/quant_fuse_ab.py --base /tmp/base --threads 1,2 --rounds 7     (base tree vs this tree)
    python bench/quant_fuse_ab.py --rules norm   ("before": without the LayerNorm's Q/DQ rules, h-lnq8)

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

--base DIR (a checkout of the base commit, e.g. `git archive <base> | tar -x -C DIR`): the whole branch against its
base, which the rules alone do not show (this branch also moved the int8 attention's and Gelu's loops to 16 lanes,
in the C kernels both engines above share). Two worker processes, one per tree (each its own compiled kernels),
each with kiln fp32 and kiln QDQ engines of the same ONNX files; the driver asks them for timed blocks in
interleaved rounds (order rotated) with onnxruntime int8 in the driver, and checks that both trees' QDQ engines give
the same outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant  # noqa: E402  bench/quant.py: models, inputs, the onnxruntime QDQ model

import kiln  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.passes import fusion  # noqa: E402
from kiln.zoo.timing import time_samples  # noqa: E402

PEERS = ("kiln fp32", "kiln QDQ, before", "kiln QDQ, after", "onnxruntime int8")
RULES = ("fuse_int8_dequantize_into_elementwise", "fuse_int8_quantize_into_elementwise")
# --rules norm: the LayerNorm's Q and its residual's DQ (h-lnq8, kiln/passes/fusion/layernorm_quantize.py)
NORM_RULES = ("fuse_int8_layer_norm_quantize", "fuse_int8_dequantize_into_layer_norm_quantize")


def build_without_rules(path: Path, rules: tuple[str, ...] = RULES):
    """The QDQ engine as before: the int8 Q/DQ steps of their own (those `rules` fuse)."""
    saved = list(fusion.RULES)
    fusion.RULES[:] = [rule for rule in saved if rule[0] not in rules]
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
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="at 1 thread: wall clock, or the calling thread's CPU time (loaded machines)")
    parser.add_argument("--rules", default="chains", choices=("chains", "norm"),
                        help="what 'before' builds without: the elementwise chains' Q/DQ rules (h-q8fuse) or the "
                        "LayerNorm's (h-lnq8)")
    parser.add_argument("--base", help="a checkout of the base commit: its engines against this tree's "
                        "(worker processes)")
    args = parser.parse_args(argv)
    label, exported, qdq = quant.onnxruntime_qdq(args.model, "kiln-q8fuse-")
    feeds = quant.inputs_for(exported, 4, seed=2)
    if args.base:
        against_base(args, exported, qdq, feeds)
        return
    tables = []
    rules = NORM_RULES if args.rules == "norm" else RULES
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        engines = {"kiln fp32": kiln.build(str(exported.path)), "kiln QDQ, before": build_without_rules(qdq, rules),
                   "kiln QDQ, after": kiln.build(str(qdq))}
        steps = {p: len(e.program.steps) for p, e in engines.items()}  # layers (a native segment's members included)
        ort = quant.session(qdq, threads)
        runs = {**{p: (lambda f, e=e: quant.first_output(e.run(f))) for p, e in engines.items()},
                "onnxruntime int8": lambda f: quant.first_output(ort.run(None, f))}
        for f in feeds:  # the fused steps compute what the separate ones did
            a, b, o = runs["kiln QDQ, before"](f), runs["kiln QDQ, after"](f), runs["onnxruntime int8"](f)
            print(f"  {threads} thread(s): max |after - before| {np.abs(a - b).max():.3g}, max |after - onnxruntime "
                  f"int8| {np.abs(b - o).max():.3g} (output scale {np.abs(o).max():.3g})")
        feed = feeds[0]
        clock_name = args.clock if threads == 1 else "wall"  # (thread CPU time at 2 threads would miss the other)
        clock = time.thread_time if clock_name == "thread" else time.perf_counter
        medians, loads = quant.rotated_rounds(runs, PEERS, feed, rounds=args.rounds, iterations=args.iterations,
                                              budget=args.budget, clock=clock, label=f"{threads} thread(s), ")

        tables.append(
            f"| {threads} | {clock_name} | {min(loads):.1f}-{max(loads):.1f} | "
            f"{steps['kiln QDQ, before']} -> {steps['kiln QDQ, after']} | "
            + " | ".join(f"{np.median(medians[p]):.3f}" for p in PEERS) + " | "
            + quant.ratio_cells(medians, ("kiln QDQ, after", "kiln QDQ, before"), ("kiln QDQ, before", "kiln fp32"),
                                ("kiln QDQ, after", "kiln fp32"), ("kiln QDQ, after", "onnxruntime int8")) + " |")
    print(f"\n{label}, wall clock ms, medians of {args.rounds} interleaved rounds' medians, CPU {cpu_name()}\n")
    print("| threads | clock | load (1-min) | QDQ steps | " + " | ".join(f"{p}" for p in PEERS)
          + " | after / before | before / kiln fp32 | after / kiln fp32 | after / ORT int8 |")
    print("|" + "---|" * (len(PEERS) + 8))
    print("\n".join(tables))


def worker(argv: list[str]) -> None:
    """`--worker FP32 QDQ THREADS`: kiln fp32 and kiln QDQ engines of this process's kiln (sys.path[0] is the tree),
    then one JSON line per command read: `run NAME FEED.npz` (outputs) or `time NAME FEED.npz ITER BUDGET` (ms)."""
    import torch

    fp32, qdq, threads = argv[0], argv[1], int(argv[2])
    torch.set_num_threads(threads)
    engines = {"fp32": kiln.build(fp32), "qdq": kiln.build(qdq)}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command, name, path, *rest = line.split()
        feed = dict(np.load(path))
        if command == "run":
            np.save(path + f".{name}.out.npy", quant.first_output(engines[name].run(feed)))
            print(json.dumps({"done": True}), flush=True)
        else:
            clock = time.thread_time if rest[2] == "thread" else time.perf_counter
            block = time_samples(lambda: engines[name].run(feed), iterations=int(rest[0]), warmup=5,
                                 budget_s=float(rest[1]), min_runs=10, clock=clock)
            print(json.dumps({"ms": float(np.median(block))}), flush=True)


def against_base(args, exported, qdq: Path, feeds: list[dict]) -> None:
    """The base tree's engines against this tree's, in worker processes (worker), interleaved rounds."""
    peers = ("base fp32", "base QDQ", "branch fp32", "branch QDQ", "onnxruntime int8")
    here = Path(__file__).resolve()
    work = qdq.parent
    paths = []
    for j, f in enumerate(feeds):
        np.savez(work / f"feed{j}.npz", **f)
        paths.append(str(work / f"feed{j}.npz"))
    tables = []
    for threads in (int(t) for t in args.threads.split(",")):
        procs = {}
        for tree_name, tree in (("base", Path(args.base).resolve()), ("branch", here.parents[1])):
            env = {**os.environ, "PYTHONPATH": str(tree)}
            procs[tree_name] = subprocess.Popen(
                [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(tree)!r}); sys.argv[0] = {str(here)!r}; "
                 f"import runpy; sys.argv = [{str(here)!r}, '--worker', {str(exported.path)!r}, {str(qdq)!r}, "
                 f"'{threads}']; runpy.run_path({str(here)!r}, run_name='__main__')"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=str(tree))
        for p in procs.values():
            while not json.loads(_json_line(p)).get("ready"):
                pass

        def ask(tree_name: str, command: str) -> dict:
            p = procs[tree_name]
            p.stdin.write(command + "\n")
            p.stdin.flush()
            return json.loads(_json_line(p))

        for path in paths:  # the same engine outputs in both trees (the branch's fusions are exact)
            outs = []
            for tree_name in procs:
                ask(tree_name, f"run qdq {path}")
                outs.append(np.load(path + ".qdq.out.npy"))
            print(f"  {threads} thread(s): max |branch QDQ - base QDQ| {np.abs(outs[0] - outs[1]).max():.3g}")
        ort = quant.session(qdq, threads)
        # thread: the calling thread's CPU time, what a one-thread run computes without the time it waits for a core
        # on a loaded machine (at 2 threads it would miss the other thread's work: wall clock there)
        clock_name = args.clock if threads == 1 else "wall"
        clock = time.thread_time if clock_name == "thread" else time.perf_counter
        medians = {p: [] for p in peers}
        loads = []
        for r in range(args.rounds):
            order = peers[r % len(peers):] + peers[:r % len(peers)]
            loads.append(os.getloadavg()[0])
            for peer in order:
                if peer == "onnxruntime int8":
                    block = time_samples(lambda: ort.run(None, feeds[0]), iterations=args.iterations, warmup=5,
                                         budget_s=args.budget, min_runs=10, clock=clock)
                    medians[peer].append(float(np.median(block)))
                else:
                    tree_name, kind = peer.split()
                    name = "fp32" if kind == "fp32" else "qdq"
                    medians[peer].append(ask(tree_name, f"time {name} {paths[0]} {args.iterations} {args.budget} "
                                                        f"{clock_name}")["ms"])
            print(f"  {threads} thread(s), round {r}: load {loads[-1]:.1f}, "
                  + ", ".join(f"{p} {medians[p][-1]:.3f}" for p in peers), flush=True)
        for p in procs.values():
            p.stdin.close()
            p.wait(timeout=60)

        tables.append(f"| {threads} | {clock_name} | {min(loads):.1f}-{max(loads):.1f} | "
                      + " | ".join(f"{np.median(medians[p]):.3f}" for p in peers) + " | "
                      + quant.ratio_cells(medians, ("branch QDQ", "base QDQ"), ("base QDQ", "base fp32"),
                                          ("branch QDQ", "branch fp32"), ("branch QDQ", "onnxruntime int8")) + " |")
    print(f"\nBERT-tiny (seq 128), base {args.base} vs this tree, ms, medians of {args.rounds} interleaved "
          f"rounds' medians, CPU {cpu_name()}\n")
    print("| threads | clock | load (1-min) | " + " | ".join(peers)
          + " | branch / base QDQ | base QDQ / base fp32 | branch QDQ / branch fp32 | branch QDQ / ORT int8 |")
    print("|" + "---|" * (len(peers) + 7))
    print("\n".join(tables))


def _json_line(p: subprocess.Popen) -> str:
    """The worker's next JSON line (its other output, e.g. build messages, passed over)."""
    while True:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError("a worker process ended early")
        if line.startswith("{"):
            return line


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
    else:
        main()
