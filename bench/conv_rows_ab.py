"""One build, two engines: every 1x1 convolution on oneDNN's convolution (cpu.conv.onednn_direct) or on its inner
product over the NHWC rows (cpu.conv.onednn_rows), the rest of the tuner's choices the same; both beside onnxruntime
at 2 threads (issue 11: DenseNet-121, SqueezeNet, YOLOv5n, MobileNetV3 at 2 threads).

    python bench/conv_rows_ab.py --models densenet121@1,squeezenet1_1@1 [--clock wall|thread] [--rounds 9]

Each row's engine is built once (bench/zoo_new.py's export, kiln.build defaults at --threads) and saved; its plan is
then rewritten both ways (a 1x1 layer's tactic_config is the same for both tactics) and loaded twice, so the two
engines differ in their 1x1 layers alone, not in what a noisy tuner picked elsewhere. The three sides are timed in
interleaved blocks (conv, rows, onnxruntime; reversed every other round) as bench/zoo_new.py does: ms a call,
medians over rounds, the 1-min load beside. --profile: the per-step times of the two engines' native segments at
1 and 2 threads by the calling thread's CPU clock, summed by tactic (bench/zoo_scaling.py's reading); run it with
OMP_WAIT_POLICY=PASSIVE, where a thread waiting at oneDNN's barrier sleeps, so the caller's CPU time is its own share
of the work (~2x less at 2 threads where a step splits, the same where it does not), not its spin.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

CONV, ROWS = "cpu.conv.onednn_direct", "cpu.conv.onednn_rows"


def both_ways(engine, folder: Path) -> dict[str, Path]:
    """The engine saved with every 1x1 layer that either tactic runs on CONV, and again on ROWS."""
    from kiln.tactics import registry
    from kiln.tactics.cpu.conv_rows import pointwise_refusal

    rows = registry.get(ROWS)
    steps = [s for s in engine.plan.program.steps if s.tactic in (CONV, ROWS)]
    pointwise = [s for s in steps if s.tactic == ROWS or (
        pointwise_refusal(s, (0, 0, *s.attributes.get("kernel_shape", ()))) is None
        and not s.attributes.get("final_activation") and rows.available())]
    paths = {}
    for tactic in (CONV, ROWS):
        for step in pointwise:
            step.tactic = tactic
        paths[tactic] = folder / f"{tactic}.kiln"
        engine.save(paths[tactic])
    return paths


def per_tactic(path: Path, feeds: dict, threads: int, runs: int = 5) -> dict[str, float]:
    """ms a call inside the native segments by tactic, the calling thread's CPU clock, of the engine at `path` loaded
    at `threads` (a oneDNN primitive forks the count it was created at, whatever OpenMP's count when it runs: an
    engine loaded at 2 threads and profiled at 1 still runs its oneDNN layers on 2), every segment in its parallel
    form (its small layers on OpenMP's count): a segment with a serial form runs the one its FormChooser measured
    faster, which on a loaded machine is the serial one, the same at 1 and 2 threads."""
    import torch

    import kiln
    from kiln.kernels.cpu.form_choice import PARALLEL
    from kiln.runtime.profiler import profile_segments

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = kiln.load(path)
        for segment in engine.program.segments:
            segment.chooser, segment.only_form = None, PARALLEL
        timed = profile_segments(engine.program, engine.program_inputs(feeds), runs=runs,
                                 clock=time.CLOCK_THREAD_CPUTIME_ID)
    finally:
        torch.set_num_threads(before)
    kinds = {s.name: s.tactic or s.op_type for s in engine.program.spec.steps}
    out: collections.Counter = collections.Counter()
    for name, ms in timed.items():
        out[kinds.get(name, name)] += statistics.median(ms)
    return dict(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="densenet121@1,squeezenet1_1@1,squeezenet1_1@8,yolov5n@1,yolov5n@8,"
                                            "mobilenet_v3@8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--block-ms", type=float, default=150.0)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--keep", type=Path, default=None,
                        help="save the two engines of a row in KEEP/<model>@<batch>/, and load them from there when "
                             "they exist (no build: a DenseNet-121 build takes minutes on a loaded machine)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    import kiln
    from zoo_new import cases, interleaved, ort_session, relative_error
    from zoo_new_models import MODELS, export

    print(f"conv_rows_ab: {args.threads} thread(s), {args.clock} clock, {args.rounds} rounds of ~{args.block_ms:.0f} ms"
          f" blocks; torch {torch.__version__}; load {os.getloadavg()[0]:.2f}")
    print("| model | batch | 1x1 layers (the tuner's rows) | conv ms | rows ms | onnxruntime ms | conv / ort | rows / ort | rows / conv "
          "(by round) | max err | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, batch in cases(args.models):
        exported = export(name, batch)
        folder = Path(tempfile.mkdtemp(prefix="conv_rows_ab-")) if args.keep is None else args.keep / f"{name}@{batch}"
        paths = {t: folder / f"{t}.kiln" for t in (CONV, ROWS)}
        tuned = "kept"
        if not all(p.exists() for p in paths.values()):
            folder.mkdir(parents=True, exist_ok=True)
            built = kiln.build(str(exported.path))
            tuned = sum(s.tactic == ROWS for s in built.plan.program.steps)  # the tuner's own picks
            paths = both_ways(built, folder)
            del built
        engines = {t: kiln.load(p) for t, p in paths.items()}
        pointwise = sum(s.tactic == ROWS for s in engines[ROWS].plan.program.steps)
        session = ort_session(exported.path, args.threads)
        feeds = MODELS[name].inputs(batch, seed=1)
        error = max(relative_error(e.run(feeds), session, feeds) for e in engines.values())
        times, loads = interleaved({"conv": lambda: engines[CONV].run(feeds), "rows": lambda: engines[ROWS].run(feeds),
                                    "ort": lambda: session.run(None, feeds)}, args)
        med = {side: statistics.median(ms) for side, ms in times.items()}
        by_round = [r / c for r, c in zip(times["rows"], times["conv"])]
        print(f"| {name} | {batch} | {pointwise} ({tuned}) | {med['conv']:.3f} | {med['rows']:.3f} | {med['ort']:.3f} | "
              f"{med['conv'] / med['ort']:.3f} | {med['rows'] / med['ort']:.3f} | **{med['rows'] / med['conv']:.3f}** "
              f"({min(by_round):.2f}-{max(by_round):.2f}) | {error:.1e} | {min(loads):.1f}-{max(loads):.1f} |",
              flush=True)
        if args.profile:
            for tactic, path in paths.items():
                one, two = per_tactic(path, feeds, 1), per_tactic(path, feeds, 2)
                print(f"  {tactic.split('.')[-1]} engine, caller CPU ms @1 -> @2 by step tactic: " + "; ".join(
                    f"{k} {one[k]:.2f} -> {two.get(k, 0):.2f} (x{one[k] / max(two.get(k, 0), 1e-9):.2f})"
                    for k in sorted(one, key=lambda k: -one[k])[:5]), flush=True)


if __name__ == "__main__":
    main()
