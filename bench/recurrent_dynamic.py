"""The zoo's recurrent forecasters exported with a dynamic batch: kiln vs onnxruntime, side by side in one run, fp32.

    python bench/recurrent_dynamic.py                       # bilstm + gru forecasters, batch 1 8 32, 1 and 2 threads
    python bench/recurrent_dynamic.py --rounds 3 --no-write

Each model is exported as users export for serving (torch.onnx.export(dynamo=True), axis 0 of x symbolic), and
built once per thread count with a profile of batches 1 to 32. Peers: "kiln" (this branch: one native segment at
every batch), "kiln before" (the same build without the symbolic-batch rewrites: main's plan, where the moves
around each layer are torch steps and the layers fall out of the segment) and onnxruntime (ORT_ENABLE_ALL). Blocks
are interleaved (kiln, kiln before, onnxruntime, kiln, ...); 2 threads are timed by the wall clock, 1 thread by the
calling thread's CPU time (what a shared machine's other work does not inflate). Every output is checked against
onnxruntime's before it is timed. Results are appended to bench/results/recurrent-<date>c.md.
"""

from __future__ import annotations

import argparse
import datetime
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kiln  # noqa: E402
from cpu import commit  # noqa: E402  bench/cpu.py
from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.passes import fusion  # noqa: E402
from kiln.passes.fusion import relayout as relayout_pass  # noqa: E402
from kiln.zoo.export import export_module  # noqa: E402
from kiln.zoo.timing import time_samples  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("bilstm_forecaster", "gru_forecaster")
PEERS = ("kiln", "kiln before", "onnxruntime")
STEPS, FEATURES = 96, 16
SYMBOLIC_RULES = ("drop_zero_initial_states", "constant_reshape_target")


def build(path: str, threads: int, before: bool):
    torch.set_num_threads(threads)
    profile = [{"x": f"1x{STEPS}x{FEATURES},8x{STEPS}x{FEATURES},32x{STEPS}x{FEATURES}"}]
    if not before:
        return kiln.build(path, profiles=profile)
    rules, around = fusion.RULES, relayout_pass._around_recurrent
    fusion.RULES = [(n, r) for n, r in rules if n not in SYMBOLIC_RULES]
    relayout_pass._around_recurrent = lambda chain: False
    try:
        return kiln.build(path, profiles=profile)
    finally:
        fusion.RULES, relayout_pass._around_recurrent = rules, around


def segment_text(engine) -> str:
    steps = engine.plan.program.steps
    layers = [s for s in steps if s.op_type in ("LSTM", "GRU")]
    inside = {m.ctx.name for seg in engine.program.segments for m in seg.members}
    return (f"{len(engine.program.segments)} segment(s) running {len(inside)} of {len(steps)} steps, "
            f"recurrent layers inside: {sum(s.name in inside for s in layers)} of {len(layers)} "
            f"({', '.join(sorted({s.tactic for s in layers}))})")


def cpu_samples(fn, **kw) -> list[float]:
    return time_samples(fn, clock=time.thread_time, **kw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    lines: list[str] = []
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        for threads in args.threads:
            clock = "CPU time of the calling thread" if threads == 1 else "wall"
            lines += [f"\n{threads} thread(s), {clock}, median of {args.rounds} interleaved rounds:\n",
                      "| model | batch | kiln ms | kiln before ms | onnxruntime ms | kiln / ort | kiln / before | "
                      "kiln / ort by round |", "|---|---|---|---|---|---|---|---|"]
            for name in MODELS:
                folder = Path(tmp) / name
                folder.mkdir(exist_ok=True)
                path = str(folder / "model.onnx")
                if not os.path.exists(path):
                    x0 = rng.standard_normal((8, STEPS, FEATURES)).astype(np.float32)
                    with redirect_stdout(io.StringIO()):
                        export_module(zoo.torch_model(name), {"x": x0}, folder, dynamic_axes={0: "batch"})
                engines = {"kiln": build(path, threads, False), "kiln before": build(path, threads, True)}
                for peer, engine in engines.items():
                    print(f"  {name} {threads}t {peer}: {segment_text(engine)}", flush=True)
                options = ort.SessionOptions()
                options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
                session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
                contexts = {p: e.create_execution_context() for p, e in engines.items()}
                for batch in args.batches:
                    feeds = {"x": rng.standard_normal((batch, STEPS, FEATURES)).astype(np.float32)}
                    want = session.run(None, feeds)[0]
                    run = {p: (lambda c=c: c.run(feeds)) for p, c in contexts.items()}
                    run["onnxruntime"] = lambda: session.run(None, feeds)
                    for p, c in contexts.items():  # a benchmark of wrong answers is worth nothing
                        got = next(iter(c.run(feeds).values()))
                        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(want).max()),
                                                   err_msg=f"{name} batch {batch} {p}")
                    timer = cpu_samples if threads == 1 else time_samples
                    rounds: dict[str, list[float]] = {p: [] for p in PEERS}
                    for _ in range(args.rounds):
                        for p in PEERS:
                            rounds[p].append(float(np.median(timer(run[p], iterations=args.runs, warmup=3,
                                                                   budget_s=2.0, min_runs=5))))
                    med = {p: float(np.median(v)) for p, v in rounds.items()}
                    by_round = ", ".join(f"{a / b:.2f}" for a, b in zip(rounds["kiln"], rounds["onnxruntime"]))
                    row = (f"| {name} | {batch} | {med['kiln']:.2f} | {med['kiln before']:.2f} | "
                           f"{med['onnxruntime']:.2f} | {med['kiln'] / med['onnxruntime']:.2f}x | "
                           f"{med['kiln'] / med['kiln before']:.2f}x | {by_round} |")
                    print(row, flush=True)
                    lines.append(row)
    header = [f"\n### kiln vs onnxruntime at a dynamic batch (bench/recurrent_dynamic.py), "
              f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC\n",
              f"- device: {cpu_name()}, {os.cpu_count()} vCPUs; commit {commit()}; torch {torch.__version__}, "
              f"onnxruntime {ort.__version__}",
              f"- machine load (1-min) {load_before:.2f} before, {os.getloadavg()[0]:.2f} after, on 2 cores shared "
              "with other sessions",
              "- zoo bilstm_forecaster (2-layer bidirectional LSTM 16 -> 2x128) and gru_forecaster (2-layer GRU "
              "16 -> 128), 96 steps, exported with a symbolic batch, kiln profile 1..32, default tuner; 'kiln before': "
              "the same build without this branch's symbolic-batch rewrites (main's plan)"]
    text = "\n".join(header + lines) + "\n"
    print(text)
    if not args.no_write:
        out = RESULTS / f"recurrent-{datetime.date.today().isoformat()}c.md"
        with open(out, "a") as f:
            f.write(text)
        print(f"appended to {out}")


if __name__ == "__main__":
    main()
