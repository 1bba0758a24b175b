"""Small layers' two forms under a changing load: one engine file loaded three ways, against onnxruntime.

    python bench/small_layers_forms.py --models efficientnet_b0,mobilenet_v2 --phases quiet,busy,quiet

One process per model: the engine is built once (this checkout, 2 threads) and loaded with
KILN_SERIAL_SMALL_LAYERS=0 ("parallel": every layer on OpenMP's count), =1 ("serial": small layers on one
thread) and unset ("measured": both forms bound, each segment runs the one its recent run times favour,
kiln/kernels/cpu/form_choice.py). Before this change kiln was "parallel" or "serial" per process, by the 1-min load
average as it loaded (>= 1 per CPU: serial). Each phase runs blocks of --block runs of each peer, interleaved
(parallel, serial, measured, onnxruntime, parallel, ...), --rounds rounds; a "busy" phase first starts --busy
processes that spin (bounded: they stop with the phase or after --busy-limit seconds), as the other jobs of a
shared machine do. Prints per phase each peer's median ms and ratio to onnxruntime (median of rounds), the
measured engine's share of runs in the serial form, and the 1-min load.
"""

from __future__ import annotations

import kiln  # noqa: I001  first: kiln/openmp.py chooses the wait policy before torch loads libgomp

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402

FORMS = {"parallel": "0", "serial": "1", "measured": None}  # peer -> KILN_SERIAL_SMALL_LAYERS at load


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x += 1


def _load(path: str, setting: str | None):
    before = os.environ.pop("KILN_SERIAL_SMALL_LAYERS", None)
    if setting is not None:
        os.environ["KILN_SERIAL_SMALL_LAYERS"] = setting
    try:
        return kiln.load(path)  # the primitives are created here: the setting decides their forms
    finally:
        os.environ.pop("KILN_SERIAL_SMALL_LAYERS", None)
        if before is not None:
            os.environ["KILN_SERIAL_SMALL_LAYERS"] = before


def _serial_share(engine) -> float | None:
    choosers = [s.chooser for s in engine.program.segments if getattr(s, "chooser", None) is not None]
    runs = [c.runs for c in choosers]
    total = sum(sum(r.values()) for r in runs)
    return sum(r.get("serial", 0) for r in runs) / total if total else None


def _reset_counts(engine) -> None:
    for s in engine.program.segments:
        if getattr(s, "chooser", None) is not None:
            s.chooser.runs = {f: 0 for f in s.chooser.runs}  # only the bookkeeping of what ran: its times stay


def bench_model(name: str, args) -> list[str]:
    exported = zoo.export(name)
    feeds = exported.inputs()
    folder = Path(tempfile.mkdtemp(prefix="kiln-forms-"))
    path = str(folder / f"{name}.kiln")
    start = time.perf_counter()
    kiln.build(str(exported.path)).save(path)
    build_s = time.perf_counter() - start
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)
    engines = {peer: _load(path, setting) for peer, setting in FORMS.items()}
    runners = {peer: (lambda e=e: e.run(feeds)) for peer, e in engines.items()}
    runners["onnxruntime"] = lambda: session.run(None, feeds)
    errors = {}
    for peer, engine in engines.items():
        got = engine.run(feeds)
        errors[peer] = max(float(np.max(np.abs(got[n] - w))) for n, w in zip(engine.output_names, want))
    lines = [f"\n{name}: built in {build_s:.0f} s; largest difference from onnxruntime "
             + ", ".join(f"{p} {e:.1e}" for p, e in errors.items())]
    for run in runners.values():
        run(), run()
    lines.append("| phase | 1-min load | " + " | ".join(f"{p} ms" for p in runners) + " | "
                 + " | ".join(f"{p} / ort" for p in FORMS) + " | measured: serial share |")
    lines.append("|" + "---|" * (3 + len(runners) + len(FORMS) - 1))
    for phase in args.phases.split(","):
        spinners = []
        if phase == "busy":
            spinners = [multiprocessing.Process(target=_spin, args=(args.busy_limit,), daemon=True)
                        for _ in range(args.busy)]
            for p in spinners:
                p.start()
            time.sleep(1.0)
        _reset_counts(engines["measured"])
        loads, medians = [], {p: [] for p in runners}
        try:
            for _ in range(args.rounds):
                loads.append(os.getloadavg()[0])
                for peer, run in runners.items():
                    block = []
                    for _ in range(args.block):
                        t = time.perf_counter()
                        run()
                        block.append(time.perf_counter() - t)
                    medians[peer].append(statistics.median(block))
        finally:
            for p in spinners:
                p.terminate()
                p.join()
        ratio = {p: statistics.median(a / b for a, b in zip(medians[p], medians["onnxruntime"])) for p in FORMS}
        share = _serial_share(engines["measured"])
        lines.append(f"| {phase}{f' (+{args.busy} spinning)' if spinners else ''} | {min(loads):.1f}-{max(loads):.1f} | "
                     + " | ".join(f"{statistics.median(v) * 1e3:.1f}" for v in medians.values()) + " | "
                     + " | ".join(f"{ratio[p]:.2f}" for p in FORMS) + f" | {'-' if share is None else f'{share:.0%}'} |")
        print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="efficientnet_b0,mobilenet_v2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--phases", default="quiet,busy,quiet", help="comma-separated: quiet or busy")
    parser.add_argument("--busy", type=int, default=2, help="spinning processes in a busy phase")
    parser.add_argument("--busy-limit", type=float, default=300.0, help="seconds a spinner runs at most")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=10, help="runs per peer per round")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    head = (f"small layers' forms: {cpu_name()} ({torch.backends.cpu.get_cpu_capability()}), {args.threads} threads, "
            f"{os.cpu_count()} CPUs; blocks of {args.block} runs interleaved, {args.rounds} rounds per phase")
    print(head, flush=True)
    lines = [head]
    for name in args.models.split(","):
        lines += bench_model(name.strip(), args)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
