"""The LSTM forecaster's tactic picks in fresh processes: per build, each LSTM layer's clock, every candidate's
measured ms and effective ms (autotune._effective_ms: after the preference and native credits), and the pick.

    python bench/lstm_picks.py --processes 8
    python bench/lstm_picks.py --processes 8 --before /work/main     # each process of this checkout after one of that


Why: a pick that differs from process to process is read from one build's record; the header keeps each
candidate's ms and the clock they were timed by, and this prints them side by side with the load around the build.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()


def child(clock: str | None) -> None:
    """One fresh build at 2 threads: per LSTM layer, its clock, candidates (ms, effective ms) and pick as JSON;
    `clock`: the tuner's clock forced (cpu_clock.WALL or PROCESS_CPU), else its own choice."""
    import torch

    import kiln
    from kiln import zoo
    from kiln.builder import autotune
    from kiln.builder.autotune import _effective_ms

    torch.set_num_threads(2)
    if clock is not None:
        autotune.cpu_clock = lambda threads: clock
    engine = kiln.build(str(zoo.export("lstm_forecaster").path), timing_cache=None)
    op = {s.name: s.op_type for s in engine.plan.program.steps}
    layers = []
    for name, found in engine.plan.header["tactics"]["layers"].items():
        if op.get(name) != "LSTM":
            continue
        times = {k: v for k, v in found["candidates"].items() if isinstance(v, float)}
        layers.append({"pick": found["tactic"], "clock": found.get("clock"),
                       "ms": times, "effective": {k: round(_effective_ms(k, v), 4) for k, v in times.items()}})
    print(json.dumps(layers))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=8)
    ap.add_argument("--clock", choices=["wall", "process cpu"], help="force the tuner's clock (default: its own)")
    ap.add_argument("--before", help="another checkout of kiln: its fresh process runs before each of this one's")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.clock)
        return
    runners = ([("before", args.before)] if args.before else []) + [("this", str(HERE.parents[1]))]
    print(f"cpu: {open('/proc/cpuinfo').read().split('model name')[1].split(':')[1].splitlines()[0].strip()}")
    for p in range(args.processes):
        for runner, checkout in runners:
            load = open("/proc/loadavg").read().split()[0]
            out = subprocess.run([sys.executable, str(HERE), "--child", *(["--clock", args.clock] if args.clock else [])],
                                 env={**os.environ, "PYTHONPATH": checkout}, capture_output=True, text=True,
                                 check=True).stdout.strip().splitlines()[-1]
            picks = []
            for i, layer in enumerate(json.loads(out)):
                print(f"{runner} process {p} load {load} layer {i + 1} clock {layer['clock']!r}: pick {layer['pick']}")
                for row in ("ms", "effective"):
                    print(f"    {row:9} " + "  ".join(f"{k.removeprefix('cpu.lstm.')} {v:.3f}"
                                                    for k, v in layer[row].items()))
                picks.append(layer["pick"].removeprefix("cpu.lstm."))
            print(f"{runner} process {p} picks: {' '.join(picks)}", flush=True)


if __name__ == "__main__":
    main()
