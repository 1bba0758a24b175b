"""One fresh build (no timing cache) of a zoo model against onnxruntime, for an A/B of two checkouts' tuners.

    for tree in /tmp/main /work/wt-intune; do PYTHONPATH=$tree python bench/intune_ab.py t5_small_encoder 2; done

Prints one line: the checkout, the GEMM tactics the tuner chose (count per tactic), how many layers it timed in
context (kiln/builder/in_context.py; none on a tree without it) and what the build took, then kiln and
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
    torch.set_num_threads(threads)
    exported = zoo.export(model, **CASES.get(model, {"batch": 1}))
    feeds = exported.inputs()
    start = time.perf_counter()
    said: list[str] = []
    engine = kiln.build(str(exported.path), timing_cache=None, progress=said.append)
    in_context_s = next((m.split("in context in ")[1].split(" s")[0] for m in said if "timed in context in" in m), "-")
    built_s = time.perf_counter() - start
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
    print(f"{tree:10s} {model} thr {threads} load {os.getloadavg()[0]:.1f} build {built_s:.0f} s | "
          f"kiln {statistics.median(samples['kiln']):.2f} ort {statistics.median(samples['onnxruntime']):.2f} "
          f"ratio {ratio:.3f} | GEMMs {dict(picks)} in context {in_context} ({in_context_s} s)", flush=True)


if __name__ == "__main__":
    main()
