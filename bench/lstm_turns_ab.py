"""lstm_fused.c's row split with and without its turns (threads taking turns at the slices while some have not started,
set_slice_turns), one LSTM layer of the forecaster and the whole forecaster, beside onnxruntime, in one process.

    python bench/lstm_turns_ab.py                     # 2 threads, SCHED_FIFO (root), 9 rounds
    python bench/lstm_turns_ab.py --rounds 15 --gap-us 200 --no-realtime

Why: with one slice a thread, a worker that starts d late ends the call at T + d; taking turns, at T + d / 2. The
layers are the forecaster's (96 steps, batch 8, 128 units, I = 16 and 128, recurrent_layer_ab's weights); the engine
is kiln.build's of zoo lstm_forecaster with both LSTMs on cpu.lstm.fused (the row split). Interleaved rounds, each a
block of `--runs` calls per runner after 3 warm-up, starting at the next runner each round, 20 ms settle before each
block, `--gap-us` of busy wait before each call (the caller's other work: a worker that polled past its spin
sleeps). Per runner, over every call: the median, the mean and the 90th percentile in ms (wall clock), each over
onnxruntime's; the share of calls in which a thread turned (plan.stalled) where the runner is a layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.kernels.cpu import recurrent  # noqa: E402
from kiln.runtime.engine import Engine  # noqa: E402
from lstm_engine import realtime  # noqa: E402
from recurrent_layer_ab import HIDDEN, STEPS, onnxruntime_layer  # noqa: E402


def turns(mode: int, fn):
    def run():
        recurrent.set_slice_turns(mode)
        try:
            return fn()
        finally:
            recurrent.set_slice_turns(1)
    return run


def layer_runners(batch: int, threads: int, stalled: dict) -> dict:
    import torch

    rng = np.random.default_rng(0)
    out = {}
    for inputs in (16, 128):
        w, r = (rng.standard_normal((4 * HIDDEN, k)).astype(np.float32) * 0.1 for k in (inputs, HIDDEN))
        b = rng.standard_normal(8 * HIDDEN).astype(np.float32) * 0.1
        x = rng.standard_normal((STEPS, batch, inputs)).astype(np.float32)
        session = onnxruntime_layer(w, r, b, batch, threads)
        want = session.run(None, {"x": x})[0][:, 0]
        out[f"onnxruntime I={inputs}"] = lambda s=session, x=x: s.run(None, {"x": x})
        layer = recurrent.FusedLSTMDirection(torch.from_numpy(w), torch.from_numpy(r), torch.from_numpy(b),
                                             split="rows")
        xt, y = torch.from_numpy(x), torch.empty(STEPS, batch, HIDDEN)
        for mode, label in ((1, "turns"), (0, "no turns")):
            key = f"{label} I={inputs}"
            stalled[key] = []

            def run(layer=layer, xt=xt, y=y, key=key):
                stalled[key].append(layer.run(xt, y, None, None, None, None, reverse=False, batch_major=False).stalled)
            turns(mode, run)()
            error = float(np.abs(y.numpy() - want).max())
            if error > 1e-5:
                raise SystemExit(f"{key}: Y differs from onnxruntime's by {error:.2e}")
            stalled[key].clear()
            out[key] = turns(mode, run)
    return out


def engine_runners(threads: int) -> dict:
    import onnxruntime as ort

    exported = zoo.export("lstm_forecaster")
    feeds = exported.inputs()
    engine = kiln.build(str(exported.path), timing_cache=None)
    steps = [dataclasses.replace(s, tactic="cpu.lstm.fused") if s.op_type == "LSTM" else s
             for s in engine.plan.program.steps]  # kiln's LSTM tactics share a config
    engine = Engine(dataclasses.replace(engine.plan, program=dataclasses.replace(engine.plan.program, steps=steps)))
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
    want = session.run(None, feeds)[0]
    error = float(np.abs(np.asarray(engine.run(feeds)[engine.output_names[0]]) - want).max())
    if error > 1e-4:
        raise SystemExit(f"forecaster: kiln's output differs from onnxruntime's by {error:.2e}")
    return {"onnxruntime forecaster": lambda: session.run(None, feeds),
            "turns forecaster": turns(1, lambda: engine.run(feeds)),
            "no turns forecaster": turns(0, lambda: engine.run(feeds))}


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--gap-us", type=float, default=0.0, help="busy wait before each call")
    ap.add_argument("--no-realtime", action="store_true", help="at the default priority rather than SCHED_FIFO")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    stalled: dict = {}
    calls = {**layer_runners(args.batch, args.threads, stalled), **engine_runners(args.threads)}
    times: dict = {k: [] for k in calls}
    load = os.getloadavg()[0]
    order = list(calls.items())
    with realtime(not args.no_realtime):
        for r in range(args.rounds):
            for key, fn in order[r % len(order):] + order[:r % len(order)]:
                time.sleep(0.02)
                for _ in range(3):
                    fn()
                for _ in range(args.runs):
                    start = time.perf_counter()
                    while time.perf_counter() - start < args.gap_us * 1e-6:
                        pass
                    start = time.perf_counter()
                    fn()
                    times[key].append((time.perf_counter() - start) * 1e3)
    print(f"# lstm_fused.c's row split, turns or not: {cpu_name()}, {args.threads} threads, batch {args.batch}, wall ms "
          f"over {args.rounds} x {args.runs} calls{'' if args.no_realtime else ', SCHED_FIFO'}, gap {args.gap_us:.0f} us, "
          f"kiln at {os.popen('git rev-parse --short HEAD').read().strip()}, 1-min load {load:.2f} -> "
          f"{os.getloadavg()[0]:.2f}\n")
    print("| runner | median | mean | p90 | median / ort | mean / ort | p90 / ort | calls turned |\n"
          "|---|---|---|---|---|---|---|---|")
    for key, values in times.items():
        base = np.array(times["onnxruntime " + key.split(" ")[-1]])
        v = np.array(values)
        stats = [np.median(v), v.mean(), np.percentile(v, 90)]
        ref = [np.median(base), base.mean(), np.percentile(base, 90)]
        turned = f"{np.mean(stalled[key]):.2f}" if stalled.get(key) else ""
        print(f"| {key} | " + " | ".join(f"{s:.3f}" for s in stats) + " | "
              + " | ".join(f"{s / q:.3f}" for s, q in zip(stats, ref)) + f" | {turned} |")


if __name__ == "__main__":
    main()
