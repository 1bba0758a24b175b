"""Which steps of kiln's native segments do not scale from 1 to 2 threads (issue 11: DenseNet, SqueezeNet, YOLOv5n).

    python bench/zoo_scaling.py --models densenet121@1,squeezenet1_1@1,yolov5n@1 [--engines DIR]

One engine per row, built at 2 threads (as bench/zoo_new.py --threads 2 does) and saved (in --engines DIR/<row>.kiln,
reused when there); it is then loaded twice, at 1 and at 2 threads, and each load's segments are timed per step
(kiln/runtime/profiler.py profile_segments) alternately, several rounds, summed per op type and tactic: ms at 1, ms at
2 and their ratio. Loaded at each count, not one engine with OpenMP's count changed between runs: a oneDNN primitive
forks the count it was created at whatever the count when it runs, so the first version of this script (session 33)
timed the oneDNN layers at 2 threads on both sides and read "no gain" (bench/results/zoo-2threads-zen4-2026-12-07d.md).
Every segment runs its parallel form (the one with its small layers on OpenMP's count): a segment with a serial form
otherwise runs the one its FormChooser measured faster, on a loaded machine the serial one.
--clock thread (the default): the calling thread's CPU time, so a step that splits its work shows ~2 (the caller ran
about half of it) and one that stays on one thread ~1, whatever the load; OMP_WAIT_POLICY=PASSIVE is set here (before
libgomp loads) so that the caller's wait at oneDNN's barrier sleeps instead of spinning on the clock. --clock wall:
elapsed time, which on a shared machine carries the load (printed).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp: a barrier's wait sleeps

import argparse  # noqa: E402
import collections  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


CLOCKS = {"thread": time.CLOCK_THREAD_CPUTIME_ID, "wall": time.CLOCK_MONOTONIC}


def loaded_at(path: Path, threads: int):
    """The engine at `path` loaded at `threads` (its oneDNN primitives made at that count), every segment on its
    parallel form."""
    import torch

    import kiln
    from kiln.kernels.cpu.form_choice import PARALLEL

    torch.set_num_threads(threads)
    engine = kiln.load(path)
    for segment in engine.program.segments:
        segment.chooser, segment.only_form = None, PARALLEL
    return engine


def per_kind(program, inputs, runs: int, clock: int) -> dict[str, float]:
    """ms per call by op type [tactic] inside the native segments: each step's median over `runs` runs."""
    from kiln.runtime.profiler import profile_segments

    kinds = {s.name: f"{s.op_type} [{getattr(s, 'tactic', '') or 'default'}]" for s in program.spec.steps}
    out: collections.Counter = collections.Counter()
    for name, ms in profile_segments(program, inputs, runs=runs, clock=clock).items():
        out[kinds.get(name, name)] += statistics.median(ms)
    return dict(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="densenet121@1,squeezenet1_1@1,yolov5n@1")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rows", type=int, default=14)
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="thread")
    parser.add_argument("--engines", type=Path, default=None, help="keep (and reuse) the built engines here")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    import kiln
    from zoo_new import cases
    from zoo_new_models import MODELS, export

    folder = args.engines or Path(tempfile.mkdtemp(prefix="zoo_scaling-"))
    folder.mkdir(parents=True, exist_ok=True)
    for name, batch in cases(args.models):
        path = folder / f"{name}@{batch}.kiln"
        if not path.exists():
            torch.set_num_threads(2)
            kiln.build(str(export(name, batch).path)).save(path)
        engines = {threads: loaded_at(path, threads) for threads in (1, 2)}
        inputs = engines[2].program_inputs(MODELS[name].inputs(batch, seed=1))
        sums = {1: collections.defaultdict(list), 2: collections.defaultdict(list)}
        loads = []
        for _ in range(args.rounds):
            for threads in (1, 2, 2, 1):
                torch.set_num_threads(threads)
                loads.append(os.getloadavg()[0])
                for kind, ms in per_kind(engines[threads].program, inputs, args.runs, CLOCKS[args.clock]).items():
                    sums[threads][kind].append(ms)
        torch.set_num_threads(2)
        one = {k: statistics.median(v) for k, v in sums[1].items()}
        two = {k: statistics.median(v) for k, v in sums[2].items()}
        print(f"\n{name}@{batch}: segment steps ({args.clock} clock) 1 thread {sum(one.values()):.2f} ms, "
              f"2 threads {sum(two.values()):.2f} ms (load {min(loads):.1f}-{max(loads):.1f})")
        print("| op [tactic] | ms @1 | ms @2 | @1 / @2 | ms lost vs 2x |")
        print("|---|---|---|---|---|")
        for kind in sorted(one, key=lambda k: -(two.get(k, 0) - one[k] / 2))[:args.rows]:
            at2 = two.get(kind, 0.0)
            print(f"| {kind} | {one[kind]:.3f} | {at2:.3f} | {one[kind] / max(at2, 1e-9):.2f} | "
                  f"{at2 - one[kind] / 2:.3f} |", flush=True)


if __name__ == "__main__":
    main()
