"""Build peak memory of two kiln checkouts with the same tactics chosen: A/B of what a build holds, not of the
tuner's choices on a loaded machine.

    TMPDIR=/dev/shm python bench/pinned_build_peak_ab.py --before /tmp/base --model resnet50 --rounds 3

Why: on this shared 2-vCPU machine one ResNet-50 build picks 3 Winograd layers and the next 8, and the build's peak
moves by 40 MiB with them (bench/results/mem9-2026-12-06.md), more than most changes this compares. So a first build
(of B, in a process of its own) writes its per-layer choices to a timing cache; every build after it reads that cache
without its in-context table (the stage is timed afresh each build, as in a build without a cache), the kernels'
digest in its keys pinned (timing_cache.environment: A's kernel sources differ from B's), so A and B pack
the same tactics and run the same stage. Each build runs in a process of its own as bench/memory.py's build child
does (numpy, onnxruntime, torch and kiln imported first), the checkouts alternating round by round. The cost of the
pinning: a cached layer prepares only its chosen candidate, so the search's own peak is lower than a real build's;
the in-context stage and the engine's load are as in one. bench/memory_ab.py measures whole builds unpinned.

Prints each build's peak RSS growth over the imports (MiB), the medians, their multiple of the weights, and per
build the Winograd layers and the in-context stage's record; the last lines a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20

_CHILD = """
import json, sys
import numpy as np
import onnxruntime as ort
import torch
import kiln
from kiln import zoo
from kiln.builder import timing_cache
from kiln.runtime.rss import PeakMemory

timing_cache.kernels_digest = lambda: "pinned"  # part of every key: A's and B's kernels differ, their choices not
name, cache, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(threads)
exported = zoo.export(name)
feeds = exported.inputs()
peak = PeakMemory.start()
engine = kiln.build(str(exported.path), timing_cache=cache)
grown = peak.delta()
header = engine.plan.header
tactics = [step.tactic for step in engine.plan.program.steps]
print(json.dumps({"build": grown, "weights": header["build_memory"]["model_weight_bytes"],
                  "winograd": tactics.count("cpu.conv.winograd"),
                  "tactics": {t: tactics.count(t) for t in sorted(set(tactics))},
                  "in_context": header["tactics"].get("in_context")}))
"""


def child(root: Path, name: str, cache: str, threads: int) -> dict:
    done = subprocess.run([sys.executable, "-c", _CHILD, name, cache, str(threads)], capture_output=True, text=True,
                          cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"build in {root} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def without_contexts(cache: Path, folder: Path) -> str:
    """A copy of the timing cache without its in-context table: the stage runs in every build that reads it."""
    doc = json.loads(cache.read_text())
    doc["in_context"] = {}
    copy = folder / f"pinned-{os.urandom(4).hex()}.json"
    copy.write_text(json.dumps(doc))
    return str(copy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, type=Path, help="the A checkout (B: this one)")
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", type=Path, help="a timing cache to pin the choices with (default: made by a first "
                                                   "build of B)")
    args = parser.parse_args()
    roots = [args.before.resolve(), ROOT]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        cache = args.cache
        if cache is None:
            cache = folder / "choices.json"
            first = child(ROOT, args.model, str(cache), args.threads)
            print(f"choices pinned by a first build of B: {first['tactics']}, load {os.getloadavg()[0]:.1f}",
                  flush=True)
        done: list[list[dict]] = [[], []]
        for r in range(args.rounds):
            for k in [*range(r % 2, 2), *range(r % 2)]:
                report = child(roots[k], args.model, without_contexts(cache, folder), args.threads)
                record = report["in_context"] or {}
                print(f"  {'AB'[k]} round {r + 1}: build +{report['build'] / MiB:.0f} MiB, winograd layers "
                      f"{report['winograd']}, in context {record.get('layers')} layer(s) cached={record.get('cached')} "
                      f"changed={len(record.get('changed', {}))}, load {os.getloadavg()[0]:.1f}", flush=True)
                done[k].append(report)
    weights = done[0][0]["weights"]
    print(f"\n{args.model}, weights {weights / MiB:.0f} MiB; A {roots[0]}, B {ROOT}; {args.threads} threads; "
          "build peak RSS growth over the imports, MiB, the same tactics pinned\n")
    print("| checkout | builds | median (x weights) |\n|---|---|---|")
    for k, reports in enumerate(done):
        peaks = [r["build"] for r in reports]
        median = statistics.median(peaks)
        print(f"| {'AB'[k]} | {', '.join(f'{p / MiB:.0f}' for p in peaks)} | {median / MiB:.0f} "
              f"({median / weights:.2f}x) |")


if __name__ == "__main__":
    main()
