"""Which layers of an engine use the engine's second thread: each layer's CPU time in the calling thread and in
all other threads, in the engine's own native segment loops run in their parallel form.

    OMP_WAIT_POLICY=passive python bench/quant_step_threads.py --threads 2 --peers "kiln fp32,kiln QDQ"

CPU time, not wall clock, so a loaded machine moves the numbers less: a layer split evenly over 2 threads shows
about as much "other threads" time as caller time, a layer on one thread ~0. Two passes of `--runs` runs: the
segments timing each layer by the calling thread's CPU clock, then by the process's (kiln.runtime.profiler
profile_segments); "other threads" is the difference of their medians. The pool's workers poll ~30 µs after a
loop (kiln/kernels/cpu/pool.c), which the process clock charges to the next layer: read a few µs as 0.
`--pair-work 0` counts attention's (query, key) pairs by their products only, as before attention.c's
kiln_attention_pair_work; `--quantized-split 1048576` keeps the 8-bit Elementwise chains and LayerNormQuantize on one
thread below 1M elements, as before transformer.c's kiln_quantized_split.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import statistics
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant  # noqa: E402  bench/quant.py: models, inputs, the onnxruntime QDQ model

import kiln  # noqa: E402
from kiln.kernels.cpu import transformer  # noqa: E402
from kiln.kernels.cpu.form_choice import PARALLEL  # noqa: E402
from kiln.runtime import profiler  # noqa: E402


def step_cpu(engine, feeds, runs: int) -> list[tuple[str, str, float, float]]:
    """(name, op type, caller CPU ms, other threads' CPU ms) of each layer inside native segments, medians over
    `runs` runs of the engine's own loops in their parallel form (the segment's form chooser overridden)."""
    program = engine.program
    for segment in program.segments:
        if segment.chooser is not None:
            segment.chooser.choose = lambda: PARALLEL
    inputs = engine.program_inputs(feeds)
    engine.run(feeds)
    own = profiler.profile_segments(program, inputs, runs, clock=time.CLOCK_THREAD_CPUTIME_ID)
    every = profiler.profile_segments(program, inputs, runs, clock=time.CLOCK_PROCESS_CPUTIME_ID)
    ops = {spec.name: spec.op_type for spec in program.spec.steps}
    return [(name, ops.get(name, "?"), statistics.median(ms), max(statistics.median(every[name]) - statistics.median(ms), 0.0))
            for name, ms in own.items()]


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bert_tiny")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--peers", default="kiln fp32,kiln QDQ")
    parser.add_argument("--pair-work", type=int, help="attention.c's kiln_attention_pair_work (0: as before)")
    parser.add_argument("--quantized-split", type=int,
                        help="transformer.c's kiln_quantized_split (1048576: as before)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.pair_work is not None:
        transformer.set_attention_pair_work(args.pair_work)
    if args.quantized_split is not None:
        transformer.set_quantized_split(args.quantized_split)
    label, exported, qdq = quant.onnxruntime_qdq(args.model, "kiln-qsteps-")
    feeds = quant.inputs_for(exported, 1, seed=2)[0]
    paths = {"kiln fp32": exported.path, "kiln QDQ": qdq}
    print(f"# {label}, {args.threads} threads, CPU ms per step (median of {args.runs}), load "
          f"{os.getloadavg()[0]:.2f}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    for peer in args.peers.split(","):
        rows = step_cpu(kiln.build(str(paths[peer])), feeds, args.runs)
        by = collections.defaultdict(lambda: [0, 0.0, 0.0])
        for _, op, own, other in rows:
            by[op][0] += 1
            by[op][1] += own
            by[op][2] += other
        print(f"\n## {peer}\n\n| op type | steps | caller CPU ms | other threads CPU ms | off the caller |\n|---|---|---|---|---|")
        for op, (n, own, other) in sorted(by.items(), key=lambda kv: -kv[1][1] - kv[1][2]):
            print(f"| {op} | {n} | {own:.3f} | {other:.3f} | {100 * other / max(own + other, 1e-9):.0f}% |")
        own, other = sum(r[2] for r in rows), sum(r[3] for r in rows)
        print(f"| total | {len(rows)} | {own:.3f} | {other:.3f} | {100 * other / max(own + other, 1e-9):.0f}% |")


if __name__ == "__main__":
    main()
