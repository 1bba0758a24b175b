"""Build peak memory of two kiln checkouts, A/B: each build in a process of its own (bench/memory.py's build child),
the two checkouts alternating model by model and round by round (what the machine's load does to the tuner's
choices, and with them to what a build packs, falls on both).

    git archive BASE | tar -x -C /tmp/base
    python bench/memory_ab.py --before /tmp/base --models bert_base,deit_small,resnet50,mobilenet_v2 --rounds 2

Prints one row per model: the model's weights, each build's peak RSS growth over its imports (MiB, in run order),
the medians and their multiple of the weights (issue 11's unit: <= 3x), and the in-context stage's seconds and
layers (kiln/builder/in_context.py). A CPU build writes its large weights to the temporary directory (spill.py): where
that disk is full they stay in memory and the build peaks ~1x the weights higher (the build says so); TMPDIR=/dev/shm
counts the same (pages released leave the process's RSS; they stay in the machine's memory). Results:
bench/results/mem3-2026-12-05c.md, mem4-2026-12-05c.md, mem5-2026-12-05d.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from cpu import commit  # noqa: E402  bench/cpu.py
from memory import MiB, child  # noqa: E402  bench/memory.py


def builds(name: str, roots: list[Path], rounds: int, threads: int, folder: str) -> list[list[dict]]:
    """Per checkout, its builds of `name`: round r runs the checkouts in turn, starting at checkout r mod 2."""
    done: list[list[dict]] = [[] for _ in roots]
    for r in range(rounds):
        for k in [*range(r % len(roots), len(roots)), *range(r % len(roots))]:
            report = child("build", name, str(Path(folder) / f"{name}-{k}.kiln"), 1, threads, roots[k])
            print(f"  {name} {'AB'[k]} round {r + 1}: build +{report['build'] / MiB:.0f} MiB, "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
            done[k].append(report)
    return done


def stage(report: dict) -> str:
    """The in-context stage of one build: seconds and layers (or what it was)."""
    record = report.get("in_context")
    if not record:
        return "-"
    if "failed" in record:
        return "failed"
    return f"{record['seconds']:.1f} s, {record['layers']}"


def row(name: str, done: list[list[dict]]) -> list[str]:
    weights = done[0][0]["weights"]
    cells = [name, f"{weights / MiB:.0f}"]
    for reports in done:
        peaks = [r["build"] for r in reports]
        median = statistics.median(peaks)
        cells += [", ".join(f"{p / MiB:.0f}" for p in peaks), f"**{median / MiB:.0f} ({median / weights:.1f}x)**",
                  "; ".join(stage(r) for r in reports)]
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, type=Path, help="the A checkout (B: this one)")
    parser.add_argument("--models", default="bert_base,deit_small,resnet50,mobilenet_v2")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    roots = [args.before.resolve(), ROOT]
    header = ["model", "weights MiB", "A builds", "A median (x)", "A in context", "B builds", "B median (x)",
              "B in context"]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models.split(","):
            rows.append(row(name, builds(name, roots, args.rounds, args.threads, folder)))
    print(f"\nA: {roots[0]}; B: {ROOT} at {commit()}; {args.threads} threads; build peak RSS growth over the imports, "
          "MiB\n")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    print("\n".join("| " + " | ".join(r) + " |" for r in rows))


if __name__ == "__main__":
    main()
