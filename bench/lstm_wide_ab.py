"""lstm_fused.c's wide tile (AVX2: 4 rows, each weight read once a step; 2026-12-06, issue 11) against the tiles it
replaces (2 + 2 one-pass) in the row split, beside the block split and onnxruntime, in one process.

    python bench/lstm_wide_ab.py --avx2                 # capped to AVX2 (bench/zoo_avx2.py's cap), 2 and 1 threads
    python bench/lstm_wide_ab.py --avx2 --threads 2 --rounds 9 --no-engine
    python bench/lstm_wide_ab.py                        # uncapped (AVX-512: no wide tile; a regression check)

Per thread count: the zoo's LSTM forecaster as kiln.build tunes it (SCHED_FIFO, its picks printed), the same engine
with both LSTMs pinned to cpu.lstm.fused (row split: wide tile on, and off) and to cpu.lstm.fused_blocks, and
onnxruntime's session; then the forecaster's two layers alone (96 steps, batch 8, 128 units, I = 16 and 128) on the
same runners, and at one thread a 4-row batch (the row split's slice on one core: the tile's own gain). Interleaved
rounds (bench/lstm_engine.blocks: the order rotated each round, `--settle` before each block) at SCHED_FIFO (root);
wall clock at two threads, the calling thread's CPU time at one. Per runner: median of block medians, / onnxruntime,
each round's ratio, the 1-min load before and after. Outputs checked against onnxruntime's first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--avx2" in sys.argv:  # before torch, onnxruntime or kiln read cpuid (bench/zoo_avx2.py checks MLAS obeys)
    import cpuid_avx2

    cpuid_avx2.enable()
    os.environ["KILN_CPU_ISA"] = "avx2"
os.environ.setdefault("GOMP_SPINCOUNT", "300000")  # the quiet machine SCHED_FIFO stands for (kiln/openmp.py)

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import kiln  # noqa: E402  (first: KILN_CPU_ISA caps the libraries before their first kernel)
from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.kernels.cpu import recurrent  # noqa: E402
from lstm_engine import blocks, lstm_picks, pinned, realtime  # noqa: E402
from lstm_layers import ort_layer  # noqa: E402


def wide(on: bool, fn):
    """fn with the wide tile set on or off before each call (a global of the library: set per call, interleaved)."""
    def call():
        recurrent.set_wide_tiles(on)
        return fn()
    return call


def table(title: str, times: dict[str, list[float]]) -> list[str]:
    ref = times["onnxruntime"]
    lines = [f"\n{title}\n", "| runner | ms | / ort | by round |", "|---|---|---|---|"]
    for label, values in times.items():
        median = statistics.median(values)
        lines.append(f"| {label} | {median:.3f} | {median / statistics.median(ref):.3f} | "
                     + ", ".join(f"{v / o:.2f}" for v, o in zip(values, ref)) + " |")
    return lines


def timed(title: str, runners: dict, threads: int, args) -> list[str]:
    clock = time.thread_time if threads == 1 else time.perf_counter
    load = os.getloadavg()[0]
    with realtime(args.realtime):
        times = blocks(runners, args.rounds, args.runs, clock=clock, settle=args.settle)
    recurrent.set_wide_tiles(True)
    return table(f"### {title}, {threads} thread(s), {'thread CPU time' if threads == 1 else 'wall'}, load "
                 f"{load:.2f} -> {os.getloadavg()[0]:.2f}", times)


def engine(threads: int, args) -> list[str]:
    import onnxruntime as ort
    import torch

    torch.set_num_threads(threads)
    exported = zoo.export("lstm_forecaster")
    feeds = exported.inputs()
    with realtime(args.realtime):
        tuned = kiln.build(str(exported.path), timing_cache=None)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)[0]
    rows, blocks_ = pinned(tuned, "cpu.lstm.fused"), pinned(tuned, "cpu.lstm.fused_blocks")
    runners = {"onnxruntime": lambda: session.run(None, feeds)}
    for label, e, on in (("kiln as tuned", tuned, True), ("fused (rows), wide tile", rows, True),
                         ("fused (rows), 2 + 2 one-pass", rows, False), ("fused_blocks", blocks_, True)):
        recurrent.set_wide_tiles(on)
        got = np.asarray(e.run(feeds)[e.output_names[0]])
        if float(np.abs(got - want).max()) > 1e-4:
            raise SystemExit(f"{label}: output differs from onnxruntime's")
        runners[label] = wide(on, lambda e=e: e.run(feeds))
    return timed(f"Forecaster engine; the tuner's picks: {lstm_picks(tuned)}", runners, threads, args)


def layers(threads: int, args) -> list[str]:
    import torch

    torch.set_num_threads(threads)
    steps, hidden = 96, 128
    rng = np.random.default_rng(0)
    lines = []
    for batch in ((8, 4) if threads == 1 else (8,)):
        for inputs in (16, 128):
            w = (rng.standard_normal((1, 4 * hidden, inputs)) * 0.1).astype(np.float32)
            r = (rng.standard_normal((1, 4 * hidden, hidden)) * 0.1).astype(np.float32)
            b = (rng.standard_normal((1, 8 * hidden)) * 0.1).astype(np.float32)
            x = rng.standard_normal((steps, batch, inputs)).astype(np.float32)
            session = ort_layer(w, r, b, steps, batch, hidden, threads)
            want = session.run(None, {"X": x})[0][:, 0]
            W, R, B, X = (torch.from_numpy(a) for a in (w[0], r[0], b[0], x))
            runners = {"onnxruntime": lambda session=session, x=x: session.run(None, {"X": x})}
            forms = [("rows", True), ("rows", False)] + ([("blocks", True)] if threads > 1 else [])
            for split, on in forms:
                layer = recurrent.FusedLSTMDirection(W, R, B, split=split)
                y = torch.empty(steps, batch, hidden)
                run = wide(on, lambda layer=layer, y=y: layer.run(X, y, None, None, None, None, reverse=False,
                                                                   batch_major=False))
                plan = run()
                if float(np.abs(y.numpy() - want).max()) > 1e-5:
                    raise SystemExit(f"I={inputs} {split} wide {on}: Y differs from onnxruntime's")
                label = f"{split} split" if threads > 1 else "kiln"
                runners[f"{label}{', wide tile' if plan.wide else ''}{'' if on else ', wide off'}"] = run
            lines += timed(f"One layer, I = {inputs}, batch {batch} ({layer.kernel.name.split()[0]} kernel)",
                           runners, threads, args)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--avx2", action="store_true", help="cap kiln and onnxruntime to AVX2 (cpuid masked)")
    ap.add_argument("--threads", default="2,1", help="comma-separated thread counts")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--runs", type=int, default=20, help="timed calls per block")
    ap.add_argument("--no-realtime", dest="realtime", action="store_false",
                    help="time at normal priority (default: SCHED_FIFO, root)")
    ap.add_argument("--no-engine", dest="engine", action="store_false", help="layers only")
    ap.add_argument("--no-layers", dest="layers", action="store_false", help="engines only")
    ap.add_argument("--settle", type=float, default=0.05, help="seconds slept before each block")
    args = ap.parse_args()
    commit = os.popen("git rev-parse --short HEAD").read().strip()
    print(f"# lstm_fused.c's wide tile, {cpu_name()}{' capped to AVX2' if args.avx2 else ''}, kiln at {commit}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}{', SCHED_FIFO' if args.realtime else ''}", flush=True)
    for threads in (int(t) for t in args.threads.split(",")):
        if args.engine:
            print("\n".join(engine(threads, args)), flush=True)
        if args.layers:
            print("\n".join(layers(threads, args)), flush=True)


if __name__ == "__main__":
    main()
