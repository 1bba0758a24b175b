"""The zoo's LSTM forecaster capped to AVX2: lstm_fused.c's AVX2 kernel with its 6-row two-pass tile (full tiles of 6
rows, the rest one-pass: 8 rows as 6 + 2) against the kernel before it (one-pass 3-row tiles only: 3 + 3 + 2), both
splits, whole engines and one layer, beside onnxruntime, in one process.

    python bench/lstm_avx2_tiles.py                    # 2 and 1 threads, SCHED_FIFO (root), 7 rounds
    python bench/lstm_avx2_tiles.py --threads 2 --rounds 9 --no-realtime

Both sides capped to AVX2 as bench/zoo_avx2.py caps them (cpuid masked before any library loads, KILN_CPU_ISA=avx2).
Per thread count: one engine tuned by kiln.build (its picks printed), then that engine's plan with every LSTM step
pinned to cpu.lstm.fused (rows split) and to cpu.lstm.fused_blocks, each with the new kernel and with the old one
("avx2onepass", a test-only entry of FUSED_KERNELS), and onnxruntime's session; then the forecaster's two layers
alone (96 steps, batch 8, 128 units, I = 16 and 128) the same way. Interleaved rounds (bench/lstm_engine.blocks: the
order rotated each round), medians of block medians; wall clock at two threads, the calling thread's CPU time at
one (every runtime computes on it there). Per runner: ms, / onnxruntime (ratio of medians) and each round's ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpuid_avx2  # noqa: E402

cpuid_avx2.enable()  # before torch, onnxruntime or kiln read cpuid (bench/zoo_avx2.py checks MLAS obeys)
os.environ["KILN_CPU_ISA"] = "avx2"
if "--no-realtime" not in sys.argv:  # the quiet machine SCHED_FIFO stands for: libgomp's own spin
    os.environ.setdefault("GOMP_SPINCOUNT", "300000")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import kiln  # noqa: E402  (first: KILN_CPU_ISA caps the libraries before their first kernel)
from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.kernels.cpu import recurrent  # noqa: E402
from lstm_engine import blocks, lstm_picks, pinned, realtime  # noqa: E402
from lstm_layers import ort_layer  # noqa: E402

OLD = "avx2onepass"


def kernels() -> dict[str, recurrent.FusedKernel]:
    found = {k.name.split()[0]: k for k in recurrent.fused_kernels() if k.supported}
    if "avx2" not in found or OLD not in found:
        raise SystemExit(f"no AVX2 fused kernels here: {sorted(found)}")
    return {"new": found["avx2"], "old": found[OLD]}


@contextlib.contextmanager
def default_kernel(kernel: recurrent.FusedKernel):
    """FusedLSTMDirection's default kernel `kernel` while engines are made (the tactic passes none)."""
    init = recurrent.FusedLSTMDirection.__init__

    def patched(self, w, r, b, *, kernel=None, split=None, chosen=kernel):
        init(self, w, r, b, kernel=kernel or chosen, split=split)

    recurrent.FusedLSTMDirection.__init__ = patched
    try:
        yield
    finally:
        recurrent.FusedLSTMDirection.__init__ = init


def table(title: str, times: dict[str, list[float]], reference: str) -> list[str]:
    ref = times[reference]
    lines = [f"\n{title}\n", "| runner | ms | / ort | by round |", "|---|---|---|---|"]
    for label, values in times.items():
        median = statistics.median(values)
        lines.append(f"| {label} | {median:.3f} | {median / statistics.median(ref):.2f} | "
                     + ", ".join(f"{v / o:.2f}" for v, o in zip(values, ref)) + " |")
    return lines


def engines(threads: int, args, found) -> list[str]:
    import onnxruntime as ort
    import torch

    torch.set_num_threads(threads)
    exported = zoo.export("lstm_forecaster")
    feeds = exported.inputs()
    with realtime(args.realtime):
        tuned = kiln.build(str(exported.path), timing_cache=None)
    calls = {"kiln as tuned": tuned}
    for which, kernel in found.items():
        with default_kernel(kernel):
            for tactic in ("cpu.lstm.fused", "cpu.lstm.fused_blocks"):
                calls[f"{tactic.removeprefix('cpu.lstm.')}, {which} kernel"] = pinned(tuned, tactic)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)[0]
    runners = {"onnxruntime": lambda: session.run(None, feeds)}
    for label, engine in calls.items():
        got = np.asarray(engine.run(feeds)[engine.output_names[0]])
        if float(np.abs(got - want).max()) > 1e-4:
            raise SystemExit(f"{label}: output differs from onnxruntime's")
        runners[label] = lambda engine=engine: engine.run(feeds)
    clock = time.thread_time if threads == 1 else time.perf_counter
    load = os.getloadavg()[0]
    with realtime(args.realtime):
        times = blocks(runners, args.rounds, args.runs, clock=clock, settle=args.settle)
    clock_name = "thread CPU time" if threads == 1 else "wall"
    return table(f"### Engine, {threads} thread(s), {clock_name}, load {load:.2f} -> {os.getloadavg()[0]:.2f}; "
                 f"the tuner's picks: {lstm_picks(tuned)}", times, "onnxruntime")


def layers(threads: int, args, found) -> list[str]:
    import torch

    torch.set_num_threads(threads)
    steps, batch, hidden = 96, 8, 128
    rng = np.random.default_rng(0)
    lines = []
    for inputs in (16, 128):
        w = (rng.standard_normal((1, 4 * hidden, inputs)) * 0.1).astype(np.float32)
        r = (rng.standard_normal((1, 4 * hidden, hidden)) * 0.1).astype(np.float32)
        b = (rng.standard_normal((1, 8 * hidden)) * 0.1).astype(np.float32)
        x = rng.standard_normal((steps, batch, inputs)).astype(np.float32)
        session = ort_layer(w, r, b, steps, batch, hidden, threads)
        want = session.run(None, {"X": x})[0][:, 0]
        W, R, B, X = (torch.from_numpy(a) for a in (w[0], r[0], b[0], x))
        runners = {"onnxruntime": lambda session=session, x=x: session.run(None, {"X": x})}
        for which, kernel in found.items():
            for split in (("rows", "blocks") if threads > 1 else ("rows",)):
                layer = recurrent.FusedLSTMDirection(W, R, B, kernel=kernel, split=split)
                y = torch.empty(steps, batch, hidden)
                run = (lambda layer=layer, y=y: layer.run(X, y, None, None, None, None, reverse=False,
                                                            batch_major=False))
                run()
                if float(np.abs(y.numpy() - want).max()) > 1e-5:
                    raise SystemExit(f"I={inputs} {which} {split}: Y differs from onnxruntime's")
                runners[f"{which} kernel{', ' + split + ' split' if threads > 1 else ''}"] = run
        clock = time.thread_time if threads == 1 else time.perf_counter
        load = os.getloadavg()[0]
        with realtime(args.realtime):
            times = blocks(runners, args.rounds, args.runs, clock=clock, settle=args.settle)
        lines += table(f"### One layer, I = {inputs}, {threads} thread(s), load {load:.2f} -> {os.getloadavg()[0]:.2f}",
                       times, "onnxruntime")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="2,1", help="comma-separated thread counts")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--runs", type=int, default=20, help="timed calls per block")
    ap.add_argument("--no-realtime", dest="realtime", action="store_false",
                    help="time at normal priority (default: SCHED_FIFO, root)")
    ap.add_argument("--no-layers", dest="layers", action="store_false", help="engines only")
    ap.add_argument("--settle", type=float, default=0.05,
                    help="seconds slept before each block (the last block's spinning threads go to sleep)")
    args = ap.parse_args()
    found = kernels()
    commit = os.popen("git rev-parse --short HEAD").read().strip()
    print(f"# lstm_fused.c's AVX2 tiles, {cpu_name()} capped to AVX2, kiln at {commit}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}{', SCHED_FIFO' if args.realtime else ''}", flush=True)
    for threads in (int(t) for t in args.threads.split(",")):
        print("\n".join(engines(threads, args, found)), flush=True)
        if args.layers:
            print("\n".join(layers(threads, args, found)), flush=True)


if __name__ == "__main__":
    main()
