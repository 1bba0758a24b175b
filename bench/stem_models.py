"""ResNet-tiny's and RegNetY-tiny's whole engines with and without kiln's stem kernel (cpu.conv.stem_native), beside
onnxruntime: does the 3-channel stem close the gap (bench/results/zoo-cpu-zen3-all-2026-12-07.md)?

    python bench/stem_models.py build DIR --threads 1     # three engines per model into DIR
    python bench/stem_models.py run DIR --threads 1       # one process: the engines and onnxruntime, interleaved

The engines, per model:
    base    built without cpu.conv.stem_native (what main builds: oneDNN's convolution on the stem)
    tuned   built as this branch builds it: the autotuner picks between the stem kernel and the others
    stem    built with the stem kernel forced on the 3-channel layer (the other convolution tactics refuse it)

`run` times each engine's `run` on one fixed input and onnxruntime's session (intra-op threads as --threads), in
interleaved rounds (base, tuned, stem, ort, base, ...) of --calls calls; per round the median call; printed: the
median over rounds and the spread (min-max of the rounds' medians). Clock: CPU time of the process at 1 thread
(a loaded shared machine: time waiting for a core is not counted), wall time at 2 threads. The outputs are compared
with onnxruntime's first.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
from kiln.tactics import registry  # noqa: E402

MODELS = ("resnet_tiny", "regnet_tiny")
VARIANTS = ("base", "tuned", "stem")
STEM = "cpu.conv.stem_native"


def _few_channels(inputs) -> bool:
    x = inputs[0]
    return x.shape is not None and len(x.shape) == 4 and isinstance(x.shape[1], int) and x.shape[1] <= 4


def _tactics_for(variant: str) -> None:
    """The registry as the variant builds (this process builds one variant)."""
    tactics = registry.all_tactics("cpu")
    if variant == "base":
        registry.unregister(STEM)
    if variant == "stem":  # every other convolution tactic refuses a layer of <= 4 input channels
        for name, tactic in tactics.items():
            if tactic.op_type == "FusedConv" and name != STEM:
                def supports(step, inputs, _inner=tactic.supports):
                    return "forced: the stem kernel runs <= 4 channels" if _few_channels(inputs) else _inner(step,
                                                                                                              inputs)
                registry._TACTICS[name] = dataclasses.replace(tactic, supports=supports)


def build(folder: Path, threads: int, variant: str) -> None:
    torch.set_num_threads(threads)  # tactics are tuned at the thread count they run with
    _tactics_for(variant)
    for model in MODELS:
        path = zoo.export(model).path
        engine = kiln.build(str(path))
        engine.save(str(folder / f"{model}-{variant}-{threads}t.kiln"))
        steps = engine.plan.program.steps
        print(model, variant, "stem on", steps[0].tactic)


def run(folder: Path, threads: int, rounds: int, calls: int) -> None:
    torch.set_num_threads(threads)
    clock = time.process_time_ns if threads == 1 else time.perf_counter_ns
    print(f"{threads} thread(s), {'CPU time' if threads == 1 else 'wall'}, load {os.getloadavg()[0]:.1f}, "
          f"torch {torch.__version__}, onnxruntime {ort.__version__}")
    print("| model | base ms | tuned ms | stem ms | ort ms | base/ort | tuned/ort | stem/ort | stem/base | load |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model in MODELS:
        exported = zoo.export(model)
        feeds = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in exported.inputs().items()}
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
        want = session.run(None, feeds)[0]
        runs = {}
        for variant in VARIANTS:
            engine = kiln.load(str(folder / f"{model}-{variant}-{threads}t.kiln"))
            context = engine.create_execution_context()
            got = np.asarray(next(iter(context.run(feeds).values())))
            err = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-12))
            if err > 1e-4:
                raise SystemExit(f"{model} {variant}: {err:.2e} of max off onnxruntime")
            runs[variant] = lambda context=context: context.run(feeds)
        runs["ort"] = lambda: session.run(None, feeds)
        medians: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(rounds):
            for name, fn in runs.items():
                for _ in range(5):
                    fn()
                times = []
                for _ in range(calls):
                    t0 = clock()
                    fn()
                    times.append(clock() - t0)
                medians[name].append(statistics.median(times) / 1e6)
        med = {name: statistics.median(v) for name, v in medians.items()}
        spread = {name: f"{min(v):.3f}-{max(v):.3f}" for name, v in medians.items()}
        o = med["ort"]
        print(f"| {model} | {med['base']:.3f} ({spread['base']}) | {med['tuned']:.3f} ({spread['tuned']}) | "
              f"{med['stem']:.3f} ({spread['stem']}) | {o:.3f} ({spread['ort']}) | {med['base'] / o:.2f} | "
              f"{med['tuned'] / o:.2f} | {med['stem'] / o:.2f} | {med['stem'] / med['base']:.2f} | "
              f"{os.getloadavg()[0]:.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("build", "run"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variant", choices=VARIANTS, help="build: one variant (default: each in a process)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    if args.mode == "build":
        if args.variant:
            build(args.folder, args.threads, args.variant)
            return
        import subprocess
        for variant in VARIANTS:  # a process each: the registry changes are the process's
            subprocess.run([sys.executable, __file__, "build", str(args.folder), "--threads", str(args.threads),
                            "--variant", variant], check=True)
    else:
        run(args.folder, args.threads, args.rounds, args.calls)


if __name__ == "__main__":
    main()
