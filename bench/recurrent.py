"""Recurrent forecasters on the CPU: kiln vs onnxruntime vs torch eager, side by side in one run, fp32.

    python bench/recurrent.py                    # every model, 2 threads, 5 rounds
    python bench/recurrent.py --models lstm --rounds 3 --no-write
    python bench/recurrent.py --models lstm --threads 1 --clock cpu   # CPU time of the calling thread

Each model is a torch recurrent body over [batch, time, features] with a linear head on the last
step (a sensor forecaster), exported with torch.onnx.export(dynamo=True) (one ONNX LSTM/GRU node
per layer). Every runtime gets the same input and the same thread count; they are timed in
interleaved rounds of blocks (kiln, onnxruntime, torch eager, kiln, ...), so a shared machine's
drift lands on all three alike. `--clock cpu` (one thread only: every runtime then computes on the calling
thread) times each call by that thread's CPU time, which other work on a shared machine does not inflate
by preempting it. Prints a table with the CPU model and writes
bench/results/recurrent-<date>.md (appended when it exists).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import io
import os
import platform
import sys
import tempfile
import time
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kiln  # noqa: E402
from cpu import commit, wait_for_quiet  # noqa: E402  bench/cpu.py
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.zoo.export import export_module  # noqa: E402
from kiln.zoo.timing import time_samples  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PEERS = ("kiln", "onnxruntime", "torch eager")


@dataclass(frozen=True)
class Model:
    label: str
    cell: type[nn.Module]  # nn.LSTM | nn.GRU
    hidden: int
    layers: int
    bidirectional: bool = False
    batch: int = 8
    steps: int = 96
    features: int = 16

    def module(self) -> nn.Module:
        body = self.cell(self.features, self.hidden, num_layers=self.layers, batch_first=True,
                         bidirectional=self.bidirectional)
        return LastStepHead(body, self.hidden * (2 if self.bidirectional else 1)).eval()

    def shape_text(self) -> str:
        return f"batch {self.batch}, {self.steps} steps, {self.features} -> {self.hidden}"


class LastStepHead(nn.Module):
    def __init__(self, body: nn.Module, width: int):
        super().__init__()
        self.body, self.head = body, nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)[0][:, -1])  # [B, S, D·H] -> [B, 1]


MODELS = {
    "lstm": Model("2-layer LSTM", nn.LSTM, 128, 2),
    "gru": Model("2-layer GRU", nn.GRU, 128, 2),
    "bilstm": Model("2-layer BiLSTM", nn.LSTM, 128, 2, bidirectional=True),
}


def cpu_time_samples(fn, *, iterations: int, warmup: int, budget_s: float, min_runs: int = 10) -> list[float]:
    """time_samples' loop on the calling thread's CPU clock (ms per call)."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < iterations and (len(samples) < min_runs or time.perf_counter() < deadline):
        start = time.thread_time()
        fn()
        samples.append((time.thread_time() - start) * 1e3)
    return samples


def recurrent_tactics(engine) -> str:
    """The tactic the build picked for each recurrent layer ('cpu.lstm.lanes x2')."""
    picked = [layer.get("tactic", "") for layer in engine.plan.header.get("tactics", {}).get("layers", {}).values()
              if str(layer.get("tactic", "")).startswith(("cpu.lstm", "cpu.gru", "cpu.rnn"))]
    return ", ".join(f"{t} x{picked.count(t)}" for t in sorted(set(picked))) or "none"


def runners(model: Model, threads: int, folder: Path) -> tuple[dict, float, np.ndarray]:
    """(runner per peer, kiln build seconds, the input), every output checked against onnxruntime's."""
    torch.manual_seed(0)
    module = model.module()
    x = np.random.default_rng(0).standard_normal((model.batch, model.steps, model.features)).astype(np.float32)
    with redirect_stdout(io.StringIO()):
        export_module(module, {"x": x}, folder)
    path = str(folder / "model.onnx")
    torch.set_num_threads(threads)
    start = time.perf_counter()
    engine = kiln.build(path)
    build_s = time.perf_counter() - start
    segments = engine.program.segments
    print(f"  {model.label:<15} kiln's recurrent tactics: {recurrent_tactics(engine)}; native segments: "
          f"{len(segments)} running {sum(len(s.members) for s in segments)} of {len(engine.plan.program.steps)} "
          "steps", flush=True)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    feeds, tensor = {"x": x}, torch.from_numpy(x)

    def eager():
        with torch.inference_mode():
            return module(tensor)

    out = {"kiln": lambda: engine.run(feeds), "onnxruntime": lambda: session.run(None, feeds), "torch eager": eager}
    want = session.run(None, feeds)[0]
    for peer in ("kiln", "torch eager"):  # a benchmark of wrong answers is worth nothing
        got = out[peer]()
        got = next(iter(got.values())) if isinstance(got, dict) else got.numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=f"{model.label}: {peer}")
    return out, build_s, x


def time_model(model: Model, args, folder: Path) -> tuple[dict[str, float], list[float], float]:
    """(median ms per peer over every round, kiln / onnxruntime per round, kiln build seconds)."""
    peers, build_s, _ = runners(model, args.threads, folder)
    samples: dict[str, list[float]] = {p: [] for p in PEERS}
    by_round, quiet = [], True
    for _ in range(args.rounds):
        medians = {}
        for peer in PEERS:  # blocks, not alternating calls: onnxruntime's spinning workers would take the cores
            quiet = wait_for_quiet(args.quiet_wait) and quiet
            timer = cpu_time_samples if args.clock == "cpu" else time_samples
            block = timer(peers[peer], iterations=args.iterations, warmup=args.warmup,
                                 budget_s=args.budget / args.rounds / len(PEERS), min_runs=5)
            samples[peer] += block
            medians[peer] = float(np.median(block))
        by_round.append(medians["kiln"] / medians["onnxruntime"])
    medians = {p: float(np.median(v)) for p, v in samples.items()}
    for peer in PEERS:
        print(f"  {model.label:<15} {peer:<12} median {medians[peer]:7.2f} ms ({len(samples[peer])} runs)", flush=True)
    print(f"  {model.label:<15} kiln / onnxruntime by round: {', '.join(f'{r:.2f}' for r in by_round)}", flush=True)
    if not quiet:
        print(f"  {model.label:<15} the machine did not go quiet within {args.quiet_wait:.0f}s before every block")
    return medians, by_round, build_s


def table(rows: list[tuple[Model, dict[str, float], list[float], float]]) -> list[str]:
    header = ["model", "input", *(f"{p} ms" for p in PEERS), "kiln / ort", "kiln / torch",
              "kiln / ort, median of rounds", "kiln / ort by round", "kiln build s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for model, ms, by_round, build_s in rows:
        cells = [model.label, model.shape_text(), *(f"{ms[p]:.2f}" for p in PEERS),
                 f"{ms['kiln'] / ms['onnxruntime']:.2f}x", f"{ms['kiln'] / ms['torch eager']:.2f}x",
                 f"{float(np.median(by_round)):.2f}x", ", ".join(f"{r:.2f}" for r in by_round), f"{build_s:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {list(MODELS)}")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="blocks per runtime, interleaved")
    parser.add_argument("--iterations", type=int, default=40, help="timed runs per block at most")
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs before each block")
    parser.add_argument("--budget", type=float, default=30.0, help="seconds of timed blocks per model at most")
    parser.add_argument("--no-write", action="store_true", help="print only, write no results file")
    parser.add_argument("--out", help="results file name in bench/results (default recurrent-<date>.md)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: the calling thread's CPU time per call (with --threads 1 only)")
    parser.add_argument("--quiet-wait", type=float, default=0.0,
                        help="before each block, wait up to this many seconds for the machine to go idle (a shared "
                             "CPU); 0: do not wait")
    args = parser.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu measures the calling thread: use it with --threads 1")

    now = datetime.datetime.now(datetime.timezone.utc)
    versions = {p: importlib.metadata.version(p) for p in ("torch", "onnxruntime", "onnx")}
    load_before = os.getloadavg()[0]
    print(f"kiln {kiln.__version__} recurrent benchmark: {cpu_name()}, {args.threads} thread(s), fp32, median "
          f"latency; load average {load_before:.2f} on {os.cpu_count()} cores")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model = MODELS[name.strip()]
            folder = Path(tmp) / name
            folder.mkdir()
            rows.append((model, *time_model(model, args, folder)))
    load_after = os.getloadavg()[0]
    lines = table(rows)
    print("\n" + "\n".join(lines))
    if args.no_write:
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / (args.out or f"recurrent-{now:%Y-%m-%d}.md")
    contended = max(load_before, load_after) > args.threads + 0.5
    warning = (["**Contended run**: other processes shared the CPU (see the load below); every latency is "
                "inflated, torch's OpenMP threads (kiln, torch eager) far more than onnxruntime's pool, and "
                "the per-round ratios scatter. Re-run on an idle machine before drawing conclusions.", ""]
               if contended else [])
    if contended:
        print("\n" + warning[0])
    earlier = out.read_text() if out.exists() else ""
    out.write_text(earlier + ("\n---\n\n" if earlier else "") + "\n".join([
        f"{'##' if earlier else '#'} kiln recurrent benchmark, {now:%Y-%m-%d %H:%M} UTC",
        "",
        *warning,
        f"- device: {cpu_name()} ({platform.machine()}), {args.threads} thread(s) for every runtime",
        f"- commit: {commit()}; kiln {kiln.__version__}; " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"- clock: {'CPU time of the calling thread' if args.clock == 'cpu' else 'wall'}\n"
        f"- fp32, latency in ms: median over {args.rounds} interleaved rounds of blocks (kiln, onnxruntime, "
        f"torch eager, kiln, ...), each block up to {args.iterations} runs after {args.warmup} warm-up runs; "
        "'by round': kiln / onnxruntime of each round's block medians (their median is the figure least "
        "moved by other work on a shared machine)",
        f"- machine load (1-min load average) {load_before:.2f} before, {load_after:.2f} after, on "
        f"{os.cpu_count()} cores: above the thread count, other work shared the CPU"
        + (f"; each block started after the machine was idle for 2 s (waited up to {args.quiet_wait:.0f}s)"
           if args.quiet_wait else ""),
        "- models: torch recurrent body + linear head on the last step, random weights, exported with "
        "torch.onnx.export(dynamo=True); onnxruntime: CPUExecutionProvider, ORT_ENABLE_ALL; "
        "torch eager: inference_mode",
        "",
        *lines,
        "",
        "Ratios < 1: kiln is faster.",
        "",
    ]))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
