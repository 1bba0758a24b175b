"""One fresh build (no timing cache) of a zoo model against onnxruntime, for an A/B of two checkouts' tuners, or of
the GEMM tactics timed in context (kiln/builder/in_context.py) on and off in one checkout:

    for tree in /tmp/main /work/wt-intune; do PYTHONPATH=$tree python bench/intune_ab.py t5_small_encoder 2; done
    for i in 1 2 3; do for c in on off; do python bench/intune_ab.py bert_base 2 $c; done; done

Prints one line: the checkout, in context on or off, the GEMM tactics the tuner chose (count per tactic), how many
layers it timed in context (none on a tree without it) and what the build and that stage took, then kiln and
onnxruntime in `ROUNDS` interleaved blocks (medians of 40 calls; at one thread the calling thread's CPU time,
every runtime computing on it, at more the wall clock), kiln / onnxruntime as the median of the per-block ratios.
Run the two trees alternately, several times: builds differ (the tuner's picks), and so does the machine's load.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

import kiln
from kiln import zoo
from kiln.zoo.timing import peer_runners, time_samples

ROUNDS = 8
CASES = {"bert_base": {"batch": 1, "seq": 128}}


def main() -> None:
    model, threads = sys.argv[1], int(sys.argv[2])
    in_context_on = (sys.argv[3] if len(sys.argv) > 3 else "on") == "on"
    torch.set_num_threads(threads)
    exported = zoo.export(model, **CASES.get(model, {"batch": 1}))
    feeds = exported.inputs()
    start = time.perf_counter()
    engine = kiln.build(str(exported.path), timing_cache=None, **({} if in_context_on else {"in_context": False}))
    built_s = time.perf_counter() - start
    stage = engine.plan.header["tactics"].get("in_context") or {}
    in_context_s = f"{stage['seconds']} s, {stage.get('rounds')} rounds {stage.get('stopped')}" if stage else "-"
    layers = engine.plan.header["tactics"]["layers"]
    picks = Counter(s.tactic.removeprefix("cpu.gemm.") for s in engine.plan.program.steps if s.op_type == "FusedGemm")
    in_context = sum("in_network" in layer for layer in layers.values())
    runners = peer_runners(model, exported.path, feeds, threads=threads, engine=engine)
    clock = time.thread_time if threads == 1 else time.perf_counter
    samples: dict[str, list[float]] = {"kiln": [], "onnxruntime": []}
    for r in range(ROUNDS):
        for name in (("kiln", "onnxruntime") if r % 2 == 0 else ("onnxruntime", "kiln")):
            samples[name].append(float(np.median(time_samples(runners[name], iterations=40, warmup=3, budget_s=1.0,
                                                              clock=clock))))
    ratio = statistics.median(k / o for k, o in zip(samples["kiln"], samples["onnxruntime"]))
    tree = Path(kiln.__file__).parents[1].name
    print(f"{tree:10s} in context {'on ' if in_context_on else 'off'} {model} thr {threads} load {os.getloadavg()[0]:.1f} build {built_s:.0f} s | "
          f"kiln {statistics.median(samples['kiln']):.2f} ort {statistics.median(samples['onnxruntime']):.2f} "
          f"ratio {ratio:.3f} | GEMMs {dict(picks)} in context {in_context} ({in_context_s})", flush=True)


if __name__ == "__main__":
    main()
