"""Bidirectional recurrent layers inside the native segment vs as steps of their own, one engine plan, one process.

    python bench/recurrent_members.py                       # bilstm and bigru, 2 threads, wall clock
    python bench/recurrent_members.py --threads 1 --clock cpu

Both engines load the same plan (same tactics, same packed weights): "members" is kiln as built; "steps" loads it
with the recurrent tactics refusing segment membership (kiln/tactics/cpu/recurrent.py _native_reason patched), as
main ran two directions before issue 11's change: each layer a Python launch, the moves around it steps on torch or
segments of their own; "members, directions in turn" is the first engine with its two directions one after the other
(recurrent.set_directions_apart(False)) instead of one per thread. Timed in interleaved blocks (members, steps,
onnxruntime, ...) with kiln / onnxruntime per round; outputs checked against onnxruntime first. Prints a table.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kiln  # noqa: E402
from cpu import commit  # noqa: E402  bench/cpu.py
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.kernels.cpu import recurrent  # noqa: E402
from kiln.runtime.engine import Engine  # noqa: E402
from kiln.tactics.cpu import recurrent as recurrent_tactics  # noqa: E402
from kiln.zoo.export import export_module  # noqa: E402
from kiln.zoo.timing import time_samples  # noqa: E402
from recurrent import LastStepHead  # noqa: E402  bench/recurrent.py

MODELS = {"bilstm": nn.LSTM, "bigru": nn.GRU}
BATCH, STEPS, FEATURES, HIDDEN = 8, 96, 16, 128


def engines(name: str, folder: Path) -> tuple[dict, np.ndarray]:
    torch.manual_seed(0)
    module = LastStepHead(MODELS[name](FEATURES, HIDDEN, num_layers=2, batch_first=True, bidirectional=True),
                          2 * HIDDEN).eval()
    x = np.random.default_rng(0).standard_normal((BATCH, STEPS, FEATURES)).astype(np.float32)
    with redirect_stdout(io.StringIO()):
        export_module(module, {"x": x}, folder)
    path = str(folder / "model.onnx")
    members = kiln.build(path)
    real = recurrent_tactics._native_reason
    recurrent_tactics._native_reason = lambda step, constants: "as main ran two directions: a step of its own"
    try:
        steps = Engine(members.plan)  # the same plan, its recurrent layers outside every segment
    finally:
        recurrent_tactics._native_reason = real
    for label, engine in (("members", members), ("steps", steps)):
        segments = engine.program.segments
        print(f"  {name:<7} {label:<8} {len(engine.plan.program.steps)} layers, native segments of "
              f"{[len(s.members) for s in segments]} layers", flush=True)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    feeds = {"x": x}
    want = session.run(None, feeds)[0]
    for engine in (members, steps):
        got = next(iter(engine.run(feeds).values()))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=name)
    def in_turn():  # the same engine, its two directions one after the other
        recurrent.set_directions_apart(False)
        try:
            return members.run(feeds)
        finally:
            recurrent.set_directions_apart(True)

    return {"members": lambda: members.run(feeds), "members, directions in turn": in_turn,
            "steps": lambda: steps.run(feeds), "onnxruntime": lambda: session.run(None, feeds)}, x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bilstm,bigru")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=float, default=4.0, help="seconds per block at most")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    print(f"# bidirectional layers as segment members vs steps: {cpu_name()}, {args.threads} thread(s), "
          f"{args.clock} clock, commit {commit()}, load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            folder = Path(tmp) / name
            folder.mkdir()
            runners, _ = engines(name, folder)
            # onnxruntime at the same thread count (a session of its own: the checked one used its defaults)
            options = ort.SessionOptions()
            options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
            session = ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
            x = {"x": np.random.default_rng(0).standard_normal((BATCH, STEPS, FEATURES)).astype(np.float32)}
            runners["onnxruntime"] = lambda session=session, x=x: session.run(None, x)
            samples = {k: [] for k in runners}
            ratios = []
            for _ in range(args.rounds):
                medians = {}
                for label, fn in runners.items():
                    block = time_samples(fn, iterations=40, warmup=3, budget_s=args.budget, min_runs=5, clock=clock)
                    samples[label] += block
                    medians[label] = float(np.median(block))
                ratios.append((medians["members"] / medians["steps"], medians["members"] / medians["onnxruntime"],
                               medians["steps"] / medians["onnxruntime"],
                               medians["members"] / medians["members, directions in turn"]))
            ms = {k: float(np.median(v)) for k, v in samples.items()}
            rows.append((name, ms, ratios))
    print(f"\nload average after: {os.getloadavg()[0]:.2f}\n")
    print("| model | members ms | members, directions in turn ms | steps ms | onnxruntime ms "
          "| members / steps by round | members / ort by round | steps / ort by round | members / in turn by round |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, ms, ratios in rows:
        by = [", ".join(f"{r[k]:.2f}" for r in ratios) for k in range(4)]
        print(f"| 2-layer {name}, batch {BATCH}, {STEPS} steps, {FEATURES} -> 2x{HIDDEN} | {ms['members']:.2f} | "
              f"{ms['members, directions in turn']:.2f} | {ms['steps']:.2f} | {ms['onnxruntime']:.2f} | {by[0]} | "
              f"{by[1]} | {by[2]} | {by[3]} |")


if __name__ == "__main__":
    main()
