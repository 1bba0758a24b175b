"""The stream steps' split (cpu.elementwise.nhwc chains, cpu.concat.nhwc past STREAM_ELEMENTS on OpenMP's team) on and
off in one process, beside onnxruntime, at 2 threads (issue 11: DenseNet-121, SqueezeNet at 2 threads).

    python bench/stream_split_ab.py --models densenet121@1,squeezenet1_1@8 [--engines DIR] [--rounds 9]

Why in one process: on this shared 2-vCPU machine a whole process falls into one of two states (DenseNet at 2
threads ~37 ms beside onnxruntime's ~31, or ~58 ms beside its ~100: the second vCPU taken for the process's life),
so base and branch in alternating processes compared the processes' luck. Here the engine's bound stream plans are
switched between their split (as built) and one thread (grain past any step, pool flag off: main's behaviour before
this change) between blocks; sides interleaved as bench/zoo_new.py's `interleaved` does (reversed every other
round), wall clock and the calling thread's CPU time a call, medians.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def stream_plans() -> list:
    """Every bound plan of a stream step alive in the process (what the segments' C loop reads at each call)."""
    from kiln.kernels.cpu import elementwise
    from kiln.kernels.cpu.transformer import KernelBound

    kinds = (elementwise.Elementwise, elementwise.Concat)
    return [b._plan for b in gc.get_objects() if type(b) is KernelBound and issubclass(b._kernel_type, kinds)
            and getattr(b._plan, "team", 0) == 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="densenet121@1,squeezenet1_1@8")
    parser.add_argument("--engines", type=Path, default=None, help="keep (and reuse) the built engines here")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--block-ms", type=float, default=120.0)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    import kiln
    from kiln.kernels.cpu.elementwise import ONE_THREAD
    from zoo_new import cases, ort_session, relative_error
    from zoo_new_models import MODELS, export

    print(f"stream_split_ab: 2 threads, {args.rounds} rounds of ~{args.block_ms:.0f} ms blocks; torch {torch.__version__};"
          f" load {os.getloadavg()[0]:.2f}")
    print("| model | batch | stream plans | split ms | one thread ms | onnxruntime ms | split / one thread (by round) | "
          "caller CPU ms split / one thread | split / ort | max err | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    folder = args.engines or Path(tempfile.mkdtemp(prefix="stream_split_ab-"))
    folder.mkdir(parents=True, exist_ok=True)
    for name, batch in cases(args.models):
        path = folder / f"{name}@{batch}.kiln"
        if not path.exists():
            kiln.build(str(export(name, batch).path)).save(path)
        gc.collect()
        before = {id(p) for p in stream_plans()}  # the rows before's engines, if still alive
        engine = kiln.load(path)
        session = ort_session(export(name, batch).path, 2)
        feeds = MODELS[name].inputs(batch, seed=1)
        error = relative_error(engine.run(feeds), session, feeds)  # binds the segments: their plans exist now
        plans = [p for p in stream_plans() if id(p) not in before]
        built = [(p.grain, p.team) for p in plans]

        def state(split: bool) -> None:
            for p, (grain, team) in zip(plans, built):
                p.grain, p.team = (grain, team) if split else (ONE_THREAD, 0)

        def kiln_side(split: bool):
            def call():
                state(split)
                engine.run(feeds)
            return call

        sides = {"split": kiln_side(True), "one": kiln_side(False), "ort": lambda: session.run(None, feeds)}
        blocks = {}
        for side, call in sides.items():
            call()
            t0 = time.perf_counter_ns()
            call()
            blocks[side] = max(1, int(args.block_ms * 1e6 / (time.perf_counter_ns() - t0)))
        wall = {s: [] for s in sides}
        cpu = {s: [] for s in sides}
        loads = []
        order = list(sides)
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for side in (order if r % 2 == 0 else order[::-1]):
                time.sleep(0.25)  # onnxruntime's pool spins after a call (kiln/zoo/timing.py)
                sides[side]()
                w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                for _ in range(blocks[side]):
                    sides[side]()
                wall[side].append((time.perf_counter_ns() - w0) / blocks[side] / 1e6)
                cpu[side].append((time.thread_time_ns() - c0) / blocks[side] / 1e6)
        state(True)
        med = {s: statistics.median(v) for s, v in wall.items()}
        by_round = [a / b for a, b in zip(wall["split"], wall["one"])]
        print(f"| {name} | {batch} | {len(plans)} | {med['split']:.3f} | {med['one']:.3f} | {med['ort']:.3f} | "
              f"**{med['split'] / med['one']:.3f}** ({min(by_round):.2f}-{max(by_round):.2f}) | "
              f"{statistics.median(cpu['split']):.2f} / {statistics.median(cpu['one']):.2f} | "
              f"{med['split'] / med['ort']:.3f} | {error:.1e} | {min(loads):.1f}-{max(loads):.1f} |", flush=True)


if __name__ == "__main__":
    main()
