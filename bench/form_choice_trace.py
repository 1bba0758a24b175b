"""One engine alone, run back to back while the load is switched under it: which form each run of its first native
segment took and how long (the segment's chooser, kiln/kernels/cpu/form_choice.py).

    python bench/form_choice_trace.py efficientnet_b0 --runs 150 --spinners 0,3,0,3

Each phase starts that many spinning processes (bounded: stopped with the phase), then makes --runs runs; prints per
phase each form's runs and median segment time, the mean of all runs, and the sequence (P parallel, s serial).
"""

from __future__ import annotations

import kiln  # noqa: I001  first: kiln/openmp.py chooses the wait policy before torch loads libgomp

import argparse
import multiprocessing
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kiln import zoo  # noqa: E402
from small_layers_forms import _spin  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=150, help="runs per phase")
    parser.add_argument("--spinners", default="0,3,0,3", help="spinning processes per phase")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.pop("KILN_SERIAL_SMALL_LAYERS", None)
    exported = zoo.export(args.model)
    feeds = exported.inputs()
    engine = kiln.build(str(exported.path))
    chooser = next((s.chooser for s in engine.program.segments if s.chooser is not None), None)
    if chooser is None:
        raise SystemExit(f"{args.model}: no native segment has a serial form")
    log: list[tuple[str, float]] = []
    record = chooser.record

    def logged(form: str, seconds: float) -> None:
        log.append((form, seconds * 1e3))
        record(form, seconds)

    chooser.record = logged
    for count in (int(c) for c in args.spinners.split(",")):
        spinners = [multiprocessing.Process(target=_spin, args=(600.0,), daemon=True) for _ in range(count)]
        for p in spinners:
            p.start()
        start, load = len(log), os.getloadavg()[0]
        try:
            for _ in range(args.runs):
                engine.run(feeds)
        finally:
            for p in spinners:
                p.terminate()
                p.join()
        phase = log[start:]
        forms = {f: [t for g, t in phase if g == f] for f in ("parallel", "serial")}
        print(f"+{count} spinning, 1-min load {load:.1f}: "
              + ", ".join(f"{f} {len(v)} runs median {statistics.median(v):.1f} ms" for f, v in forms.items() if v)
              + f"; mean of all runs {statistics.mean(t for _, t in phase):.1f} ms")
        print("  " + "".join("P" if f == "parallel" else "s" for f, _ in phase))


if __name__ == "__main__":
    main()
