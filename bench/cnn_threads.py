"""ResNet-tiny and RegNetY-tiny at 1 and 2 threads: engines built by two checkouts (base and branch), run side by side
with onnxruntime (issue 11, bench/results/cnn-2threads-zen3-2026-12-07.md).

    PYTHONPATH=/path/to/base   python bench/cnn_threads.py build DIR --label base --threads 2 --builds 3
    PYTHONPATH=/path/to/branch python bench/cnn_threads.py build DIR --label branch --threads 2 --builds 3
    python bench/cnn_threads.py run DIR --threads 2 --rounds 9 --calls 300      # one process: every engine + ort
    python bench/cnn_threads.py layers DIR --threads 2 --engine resnet_tiny-branch-1-2t.kiln   # per layer, by form

`build`: each model built `--builds` times, each build in a fresh process with no timing cache (as a user's first
build), saved as MODEL-LABEL-K-Tt.kiln; prints the stem's tactic and the layer's record in context (the autotuner's
own times, ms). The kiln that builds is the one on PYTHONPATH: the checkout under test or a base exported beside it.

`run`: loads every engine in DIR of the thread count (with this checkout's runtime: the checkouts differ in the
choices their builds make) and an onnxruntime session; checks each engine's output against onnxruntime's (1e-4 of
its max); then interleaved rounds (engine 1, engine 2, ..., ort, engine 1, ...), each a block of 5 warm-up calls and
--calls timed ones, 50 ms slept before each block (onnxruntime's pool spins after its block); per round the block's
median. Prints per runtime the median of the round medians, their spread, the ratio to onnxruntime's median, the
stem's tactic and the share of runs the native segment ran its serial form (kiln/kernels/cpu/form_choice.py).
Clock: the process's CPU time at 1 thread (time waiting for a core on a shared machine is not counted), the wall
clock at 2.

`layers`: one engine's native segment per layer (Segment.timed: the compiled loop times each call), its parallel and
serial forms forced in turn (A B A B), median over --calls runs each; the whole run's median beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

MODELS = ("resnet_tiny", "regnet_tiny")
SETTLE_S = 0.05


def _feeds(model: str) -> tuple[Path, dict[str, np.ndarray]]:
    from kiln import zoo

    exported = zoo.export(model)
    return exported.path, {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in exported.inputs().items()}


def build_one(folder: Path, label: str, threads: int, k: int) -> None:
    import torch

    import kiln

    torch.set_num_threads(threads)  # tactics are tuned at the thread count they run with
    for model in MODELS:
        path, _ = _feeds(model)
        start = time.perf_counter()
        engine = kiln.build(str(path), timing_cache=None)
        seconds = time.perf_counter() - start
        engine.save(str(folder / f"{model}-{label}-{k}-{threads}t.kiln"))
        stem = engine.plan.program.steps[0]
        record = engine.plan.header["tactics"]["layers"].get(stem.name, {})
        alone = {name: ms for name, ms in record.get("candidates", {}).items() if isinstance(ms, float)}
        print(f"{model} {label} build {k}: stem {stem.tactic or 'default'}; alone {alone}; in network "
              f"{record.get('in_network')}; build {seconds:.1f} s, load {os.getloadavg()[0]:.2f}", flush=True)


def _stem_of(engine) -> str:
    return (engine.plan.program.steps[0].tactic or "default").removeprefix("cpu.conv.")


def run(folder: Path, threads: int, rounds: int, calls: int) -> None:
    import onnxruntime as ort
    import torch

    import kiln

    torch.set_num_threads(threads)
    clock = time.process_time_ns if threads == 1 else time.perf_counter_ns
    print(f"{threads} thread(s), {'process CPU time' if threads == 1 else 'wall clock'}, load "
          f"{os.getloadavg()[0]:.2f}, torch {torch.__version__}, onnxruntime {ort.__version__}", flush=True)
    print("| model | runtime | stem | ms (median of rounds) | rounds min-max | / ort | serial runs | load |")
    print("|---|---|---|---|---|---|---|---|")
    for model in MODELS:
        path, feeds = _feeds(model)
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        want = session.run(None, feeds)[0]
        runs, stems, choosers = {}, {}, {}
        for file in sorted(folder.glob(f"{model}-*-{threads}t.kiln")):
            label = file.name[len(model) + 1:-len(f"-{threads}t.kiln")]
            engine = kiln.load(str(file))
            context = engine.create_execution_context()
            got = np.asarray(next(iter(context.run(feeds).values())))
            err = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-12))
            if err > 1e-4:
                raise SystemExit(f"{file.name}: {err:.2e} of max off onnxruntime")
            runs[label] = lambda context=context: context.run(feeds)
            stems[label] = _stem_of(engine)
            choosers[label] = [s.chooser for s in context.program.segments if s.chooser is not None]
        runs["ort"] = lambda: session.run(None, feeds)
        medians: dict[str, list[float]] = {name: [] for name in runs}
        serial = {name: [0, 0] for name in choosers}
        for _ in range(rounds):
            for name, fn in runs.items():
                time.sleep(SETTLE_S)
                for _ in range(5):
                    fn()
                before = [dict(c.runs) for c in choosers.get(name, [])]
                times = []
                for _ in range(calls):
                    t0 = clock()
                    fn()
                    times.append(clock() - t0)
                medians[name].append(statistics.median(times) / 1e6)
                for c, b in zip(choosers.get(name, []), before):
                    serial[name][0] += c.runs["serial"] - b["serial"]
                    serial[name][1] += sum(c.runs.values()) - sum(b.values())
        o = statistics.median(medians["ort"])
        for name, v in medians.items():
            m = statistics.median(v)
            share = f"{serial[name][0] / serial[name][1]:.0%}" if serial.get(name, [0, 0])[1] else "-"
            print(f"| {model} | {name} | {stems.get(name, '-')} | {m:.4f} | {min(v):.3f}-{max(v):.3f} | {m / o:.2f} | "
                  f"{share} | {os.getloadavg()[0]:.2f} |", flush=True)


def layers(folder: Path, threads: int, engine_file: str, calls: int) -> None:
    import torch

    import kiln
    from kiln.kernels.cpu.form_choice import PARALLEL, SERIAL
    from kiln.runtime.profiler import profile_segments

    torch.set_num_threads(threads)
    engine = kiln.load(str(folder / engine_file))
    model = engine_file.split("-")[0]
    _, feeds = _feeds(model)
    program = engine.program
    inputs = engine.program_inputs(feeds)
    per: dict[str, dict[str, list[float]]] = {PARALLEL: {}, SERIAL: {}}
    whole: dict[str, list[float]] = {PARALLEL: [], SERIAL: []}
    with torch.inference_mode():
        for _ in range(4):
            for form in (PARALLEL, SERIAL):
                for segment in program.segments:
                    if segment.chooser is not None:
                        segment.chooser.choose = lambda form=form: form
                for _ in range(10):
                    program.run(inputs)
                for name, ms in profile_segments(program, inputs, runs=calls // 4).items():
                    per[form].setdefault(name, []).extend(ms)
                for _ in range(calls // 4):
                    t0 = time.perf_counter_ns()
                    program.run(inputs)
                    whole[form].append((time.perf_counter_ns() - t0) / 1e6)
    print(f"{engine_file}, {threads} thread(s), per-layer medians in us (wall), load {os.getloadavg()[0]:.2f}")
    print("| layer | parallel us | serial us |\n|---|---|---|")
    for name in per[PARALLEL]:
        p, s = (statistics.median(per[f][name]) * 1e3 for f in (PARALLEL, SERIAL))
        print(f"| {name} | {p:.1f} | {s:.1f} |")
    sums = [sum(statistics.median(v) for v in per[f].values()) * 1e3 for f in (PARALLEL, SERIAL)]
    print(f"| sum of layers | {sums[0]:.1f} | {sums[1]:.1f} |")
    print(f"| whole program.run | {statistics.median(whole[PARALLEL]) * 1e3:.1f} | "
          f"{statistics.median(whole[SERIAL]) * 1e3:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("build", "run", "layers"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--label", default="branch")
    parser.add_argument("--builds", type=int, default=1)
    parser.add_argument("--build-index", type=int, help=argparse.SUPPRESS)  # one build, in this process
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--engine", default="")
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    if args.mode == "build":
        if args.build_index is not None:
            build_one(args.folder, args.label, args.threads, args.build_index)
            return
        for k in range(1, args.builds + 1):  # a fresh process each: no tuning state carried between builds
            subprocess.run([sys.executable, __file__, "build", str(args.folder), "--label", args.label,
                            "--threads", str(args.threads), "--build-index", str(k)], check=True)
    elif args.mode == "run":
        run(args.folder, args.threads, args.rounds, args.calls)
    else:
        layers(args.folder, args.threads, args.engine, args.calls)


if __name__ == "__main__":
    main()
