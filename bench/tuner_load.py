"""Does the autotuner pick the same tactics on a loaded CPU? Builds one zoo model N times (no timing cache,
so every build times every candidate) with background load beside it, and prints each layer's pick per build.

    python bench/tuner_load.py [--model lstm_forecaster] [--builds 5] [--load 2] [--threads 2] [--ops LSTM]

--load N starts N busy loops (`yes > /dev/null`, each ended by `timeout` after --load-s seconds at most, and
killed when the builds end): on a 2-vCPU VM, two of them take a core's worth of time each from the build's
two threads. Per layer of the selected ops: the tactic each build chose, with its time and the runner-up's.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kiln  # noqa: E402  (first: KILN_CPU_ISA caps the libraries before their first kernel)
from kiln import zoo  # noqa: E402


def start_load(count: int, seconds: int) -> list[subprocess.Popen]:
    """`count` busy loops, each bounded by `timeout` (a crash of this script cannot leave one running long)."""
    # a session of its own per loop: stop_load ends `timeout` and its `yes` together, by that group's id
    return [subprocess.Popen(["timeout", "-s", "KILL", str(seconds), "yes"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True) for _ in range(count)]


def stop_load(loops: list[subprocess.Popen]) -> None:
    for p in loops:  # only the process groups this script started
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:  # its timeout already ended it
            pass
        p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="lstm_forecaster")
    ap.add_argument("--builds", type=int, default=5)
    ap.add_argument("--load", type=int, default=2, help="busy loops beside the builds")
    ap.add_argument("--load-s", type=int, default=300, help="each busy loop ends after this many seconds at most")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ops", default="LSTM", help="op types whose layers are reported (comma-separated; '' all)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    exported = zoo.export(args.model)
    ops = {o for o in args.ops.split(",") if o}
    picks: dict[str, list[str]] = collections.defaultdict(list)
    lines = []
    loops = start_load(args.load, args.load_s)
    try:
        time.sleep(1.0 if loops else 0.0)
        for build in range(args.builds):
            load = os.getloadavg()[0]
            start = time.perf_counter()
            engine = kiln.build(str(exported.path), timing_cache=None)
            seconds = time.perf_counter() - start
            steps = {s.name: s.op_type for s in engine.plan.program.steps}
            for name, found in engine.plan.header["tactics"]["layers"].items():
                if ops and steps.get(name) not in ops:
                    continue
                picks[name].append(found["tactic"])
                timed = {k: v for k, v in found["candidates"].items() if isinstance(v, float)}
                ranked = ", ".join(f"{k.removeprefix('cpu.')} {v:.3f}" for k, v in sorted(timed.items(), key=lambda kv: kv[1]))
                lines.append(f"build {build + 1} (load {load:.1f}, {seconds:.1f} s) {name}: {found['tactic']} "
                             f"[{found.get('clock')}: {ranked}]")
                print(lines[-1], flush=True)
    finally:
        stop_load(loops)
    print(f"\n{args.model}, {args.builds} builds, {args.threads} threads, {args.load} busy loops beside; "
          f"1-min load now {os.getloadavg()[0]:.1f}")
    for name, chosen in picks.items():
        counts = collections.Counter(chosen)
        verdict = "same in every build" if len(counts) == 1 else "DIFFERS"
        print(f"| {name} | " + ", ".join(f"{n} x {t}" for t, n in counts.most_common()) + f" | {verdict} |")


if __name__ == "__main__":
    main()
