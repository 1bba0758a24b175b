"""What kiln/kernels/cpu/omp_governor.py adds to an engine call: begin() + end() timed on the calling thread, the
working tree's governor against the module as it was at a git revision (which read /proc/loadavg in begin() once per
REFRESH_S), interleaved in one process on libgomp's one located count.

    python bench/governor_call_path.py [--base REV] [--gap-ms 5] [--seconds 2] [--rounds 3]

Why: a reading (/proc/loadavg and /proc/self/task) is ~50-100 us; taken by the call, it lands on one call in each
REFRESH_S: with calls every few ms, in its p99. Per round, each governor gets `--seconds` of begin()/end() pairs
`--gap-ms` apart (the gap slept, as between a server's requests); the table gives per governor the median, p99 and
maximum over all rounds, and the calls over 20 us.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kiln import openmp  # noqa: E402
from kiln.kernels.cpu import omp_governor  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def module_at(rev: str):
    source = subprocess.run(["git", "show", f"{rev}:kiln/kernels/cpu/omp_governor.py"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout
    folder = tempfile.mkdtemp()
    path = Path(folder) / "omp_governor_base.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("omp_governor_base", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="fefbe94~1", help="the governor as it was at this revision")
    ap.add_argument("--gap-ms", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    process = omp_governor.governor()
    process.begin()
    process.end()
    if not process.governed():
        raise SystemExit(f"not governed here: {process.describe()}")
    base = module_at(args.base)
    governors = {}
    for label, module in (("working tree", omp_governor), (f"at {args.base}", base)):
        g = module.Governor(runnable=openmp.runnable_tasks)
        g._lib, g._count, g._original = process._lib, process._count, process._original
        g.begin()
        g.end()
        governors[label] = g
    times: dict[str, list[float]] = {label: [] for label in governors}
    load = os.getloadavg()[0]
    for r in range(args.rounds):
        for label, g in (list(governors.items())[r % 2:] + list(governors.items())[:r % 2]):
            end = time.monotonic() + args.seconds
            while time.monotonic() < end:
                t0 = time.perf_counter_ns()
                g.begin()
                g.end()
                times[label].append((time.perf_counter_ns() - t0) / 1e3)
                time.sleep(args.gap_ms / 1e3)
    process._count.value = process._original
    print(f"# begin() + end(), us, calls {args.gap_ms} ms apart, {args.rounds} rounds of {args.seconds} s; "
          f"1-min load {load:.2f} -> {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
    print("| governor | calls | median | p99 | max | calls over 20 us |\n|---|---|---|---|---|---|")
    for label, ts in times.items():
        ts = sorted(ts)
        print(f"| {label} | {len(ts)} | {statistics.median(ts):.1f} | {ts[int(0.99 * (len(ts) - 1))]:.1f} | "
              f"{ts[-1]:.1f} | {sum(t > 20 for t in ts)} |")


if __name__ == "__main__":
    main()
