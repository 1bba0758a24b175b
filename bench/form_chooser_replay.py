"""FormChooser rule variants replayed on run times, modelled or recorded (issue 11: DenseNet-121's big segment runs
its serial form near-quiet): what each rule costs against forcing one form and against a per-run oracle.

    python bench/form_chooser_replay.py                      # modelled scenarios (seeded), a table
    python bench/form_chooser_replay.py --trace pairs.json   # + a recorded trace (bench/form_chooser_log.py --trace)

Modelled: each call's (parallel, serial) times are a quiet or a disturbed pair (the other core taken), times 0.92-1.15
uniform noise; disturbances come in bursts (a probability per call, a mean length in calls) or in phases. DenseNet's
big segment: parallel 20 / serial 28 free, 45 / 30 disturbed (bench/results/form-chooser-zen4-2026-12-07d.md);
EfficientNet-B0: 10 / 14 free, 64 / 31 busy (bench/results/efficientnet-cpu-2026-12-02.md). A recorded trace holds
real pairs (the forms run call by call, P S S P ...), each pair's two times taken as both forms' at that moment.
Printed: each rule's total time over the current rule's (below 1: faster), and the current rule's serial runs by
cause (the start, a probe, serial the incumbent).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kiln.kernels.cpu.form_choice import PARALLEL, SERIAL, FormChooser  # noqa: E402

DENSE = ({PARALLEL: 20.0, SERIAL: 28.0}, {PARALLEL: 45.0, SERIAL: 30.0})  # (free, disturbed) ms
B0 = ({PARALLEL: 10.0, SERIAL: 14.0}, {PARALLEL: 64.0, SERIAL: 31.0})


def bursts(n: int, p: float, length: float, free: dict, disturbed: dict, seed: int) -> list[dict]:
    """n calls, a burst of ~`length` disturbed calls starting with probability p at each undisturbed one."""
    rng, out, left = random.Random(seed), [], 0
    for _ in range(n):
        if left == 0 and p and rng.random() < p:
            left = max(1, int(rng.expovariate(1 / length)))
        times, left = (disturbed if left else free), max(0, left - 1)
        out.append({f: t * rng.uniform(0.92, 1.15) for f, t in times.items()})
    return out


def phases(n: int, phase: int, free: dict, disturbed: dict, seed: int) -> list[dict]:
    """n calls, free and disturbed in turn, `phase` calls each."""
    rng = random.Random(seed)
    return [{f: t * rng.uniform(0.92, 1.15) for f, t in (disturbed if (i // phase) % 2 else free).items()}
            for i in range(n)]


SCENARIOS = {
    "DenseNet big segment, quiet (no bursts)": lambda s: bursts(200, 0.0, 1, *DENSE, s),
    "DenseNet, near-quiet: bursts 5%/call x3": lambda s: bursts(200, 0.05, 3, *DENSE, s),
    "DenseNet, near-quiet: bursts 10%/call x2": lambda s: bursts(200, 0.10, 2, *DENSE, s),
    "DenseNet, load ~3: bursts 30%/call x5": lambda s: bursts(200, 0.30, 5, *DENSE, s),
    "DenseNet, phases of 50": lambda s: phases(400, 50, *DENSE, s),
    "B0, quiet: bursts 5%/call x3": lambda s: bursts(400, 0.05, 3, *B0, s),
    "B0, busy cores: free gaps 5%/call x3": lambda s: bursts(400, 0.05, 3, B0[1], B0[0], s),
    "B0, busy cores always": lambda s: bursts(400, 0.0, 1, B0[1], B0[1], s),
    "B0, phases of 50": lambda s: phases(400, 50, *B0, s),
    "B0, phases of 20": lambda s: phases(400, 20, *B0, s),
}

RULES = {
    "current": FormChooser,
    "window 5": lambda: FormChooser(window=5),
    "window 7": lambda: FormChooser(window=7),
    "probe_cost 1.5%": lambda: FormChooser(probe_cost=0.015),
    "explore_every 32": lambda: FormChooser(explore_every=32),
}


def replay(chooser, times: list[dict]) -> tuple[float, dict]:
    """Total time of the chooser's picks over `times`, and its serial runs by cause."""
    total, causes = 0.0, {"start": 0, "probe": 0, "incumbent": 0}
    for t in times:
        form = chooser.choose()
        if form == SERIAL:
            cause = "start" if not chooser._started else "incumbent" if chooser.best() == SERIAL else "probe"
            causes[cause] += 1
        chooser.record(form, t[form])
        total += t[form]
    return total, causes


def row(name: str, runs: list[list[dict]]) -> None:
    totals = {rule: sum(replay(make(), t)[0] for t in runs) for rule, make in RULES.items()}
    base = totals["current"]
    forced = {f: sum(sum(x[f] for x in t) for t in runs) for f in (PARALLEL, SERIAL)}
    oracle = sum(sum(min(x.values()) for x in t) for t in runs)
    causes = [replay(FormChooser(), t)[1] for t in runs]
    mean = {k: sum(c[k] for c in causes) / len(causes) for k in causes[0]}
    print(f"| {name} | {oracle / base:.3f} | {forced[PARALLEL] / base:.3f} | {forced[SERIAL] / base:.3f} | "
          + " | ".join(f"{totals[r] / base:.3f}" for r in RULES if r != "current")
          + f" | {mean['start']:.0f} / {mean['probe']:.0f} / {mean['incumbent']:.0f} of {len(runs[0])} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=80)
    parser.add_argument("--trace", type=Path, action="append", default=[])
    args = parser.parse_args()
    print("| times over the current rule's | per-run oracle | forced parallel | forced serial | "
          + " | ".join(r for r in RULES if r != "current") + " | current's serial runs: start / probe / incumbent |")
    print("|---" * (len(RULES) + 4) + "|")
    for name, make in SCENARIOS.items():
        row(name, [make(seed) for seed in range(args.seeds)])
    for path in args.trace:
        for k, pairs in enumerate(json.loads(path.read_text())):
            row(f"trace {path.name}, segment {k}", [[{f: v * 1e3 for f, v in p.items()} for p in pairs]])


if __name__ == "__main__":
    main()
