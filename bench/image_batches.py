"""Image models at batches other than the tuned one (issue 10), side by side with onnxruntime in one process.

    python bench/image_batches.py --build                      # engines into --engines (once; any tree can load them)
    python bench/image_batches.py                              # the table, with this tree's kiln

One engine per model with a dynamic batch profile (1, --opt, --max; tuned at --opt) and, per measured batch, one built
for that batch alone (profile b, b, b): the "build at that batch" a dynamic engine's steady state is held against.
Rows, per model and batch (ms of thread CPU time, 1 thread: a loaded machine's preemption left out; median of --reps
interleaved rounds, each in a shuffled order: an engine always called after onnxruntime finds kiln's code and data
colder than one always called after another kiln engine, 10-30% on these tiny calls; a rotation keeps who goes before
whom):
  dynamic       the dynamic engine at this batch in its steady state: after the calls that make a batch met often
                bound exactly on the background thread and the trial that keeps it or the runs
                (kiln/runtime/native_batches.py call_batch); `kept` says which each image segment kept
  runs only     a second load of the dynamic engine whose batches stay in runs (no exact bind: h-imgview's)
  built at b    the engine built for this batch
  onnxruntime   its session (intra-op threads 1), same input
  first - rep.  the dynamic engine's first call at this batch minus its repeat, thread CPU time (what a new batch
                costs beyond the compute; onnxruntime's beside it), median over a shuffled stream of new batches
Run it from two trees (before/after) on the same engine files, alternating, to compare runtimes; the load average and
the CPU are printed with the table. Which engine a process loads first matters on these tiny calls (swin_tiny at batch
1: 1.09-1.23x with the built engine loaded last, 0.96 loaded first, session 23): run it both ways (--built-first).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["KILN_PAD_FIRST_CALLS"] = "0"  # every new batch binds or runs as given (none runs padded)

import kiln  # noqa: E402  (before torch: kiln sets OpenMP's wait policy)
import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

from kiln import zoo  # noqa: E402
from kiln.runtime import native_batches  # noqa: E402
from kiln.runtime.first_calls import primitives_made  # noqa: E402

MODELS = {"resnet_tiny": (3, 64, 64), "convnext_tiny": (3, 64, 64), "swin_tiny": (3, 32, 32),
          "mobilenet_v2": (3, 224, 224)}


def _profile(image: tuple[int, ...], lo: int, opt: int, hi: int) -> dict[str, str]:
    dims = "x".join(map(str, image))
    return {"pixel_values": f"{lo}x{dims},{opt}x{dims},{hi}x{dims}"}


def build(args, names: list[str], batches: list[int]) -> None:
    folder = Path(args.engines)
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        exported = zoo.export(name, dynamic=True)
        image = MODELS[name]
        for tag, profile in [("dynamic", _profile(image, 1, args.opt, args.max)),
                             *[(f"b{b}", _profile(image, b, b, b)) for b in batches]]:
            path = folder / f"{name}-{tag}.kiln"
            if not path.exists():
                start = time.time()
                kiln.build(str(exported.path), profiles=[profile]).save(path)
                print(f"built {path.name} in {time.time() - start:.0f} s", flush=True)


def _first_calls(context, session, image: tuple[int, ...], stream: list[int], rng) -> tuple[list[float], list[float]]:
    """(kiln's first - repeat, onnxruntime's first - repeat) in ms of thread CPU time, per batch of `stream`."""
    ours, theirs = [], []
    for batch in stream:
        native_batches.BINDS.wait(120)  # an earlier batch's exact bind done: the first call alone on the machine
        x = rng.standard_normal((batch, *image), dtype=np.float32)
        for run, found in ((lambda: context.run({"pixel_values": x}), ours),
                           (lambda: session.run(None, {"pixel_values": x}), theirs)):
            start = time.thread_time()
            run()
            first = time.thread_time() - start
            repeats = []
            for _ in range(2):
                start = time.thread_time()
                run()
                repeats.append(time.thread_time() - start)
            found.append((first - min(repeats)) * 1e3)
    return ours, theirs


def _plans(context, batch: int) -> list:
    """The BatchPlans of `context`'s segments at `batch` images."""
    return [plan for segment in context.program.segments for key, plan in segment._batch_plans.items()
            if key[0][0] * batch_of(segment) == batch * segment._planned_key[0][0]]


def batch_of(segment) -> int:
    """The batch a segment was planned at: its planned_batch, else (a view segment's: native_batches.another_batch)
    the first dim of its first entry, which in these image models' token segments is the batch."""
    return segment._planned_batch or segment._planned_key[0][0]


def _settle(context, x: dict, batch: int) -> str:
    """Call until every plan at this batch left its exact bind's trial (bound kept, runs kept or failed); the states."""
    for _ in range(native_batches.BIND_AFTER):
        context.run(x)
    native_batches.BINDS.wait(120)
    for _ in range(4 * native_batches.TRIAL):
        if all(p.state not in ("binding", "trial") for p in _plans(context, batch)):
            break
        context.run(x)
    states = [p.state for p in _plans(context, batch)]
    return ",".join(f"{states.count(s)} {s}" for s in dict.fromkeys(states)) or "planned"


def _runs_only(context, x: dict, batch: int) -> None:
    """A first call, then its plans held in runs (as h-imgview ran every batch)."""
    context.run(x)
    for plan in _plans(context, batch):
        if plan.state == "runs":
            plan.state = "runs kept"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet_tiny,convnext_tiny,swin_tiny,mobilenet_v2")
    ap.add_argument("--batches", default="1,3,8,32")
    ap.add_argument("--opt", type=int, default=2)
    ap.add_argument("--max", type=int, default=32)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--stream", type=int, default=12, help="new batches for the first-call rows")
    ap.add_argument("--engines", default="/tmp/kiln-image-batches")
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--built-first", action="store_true", help="load the engines built at each batch before the "
                    "dynamic ones (by default each is loaded after them, at its batch's rows)")
    args = ap.parse_args()
    names = args.models.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(1)
    if args.build:
        build(args, names, batches)
        return
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    rng = np.random.default_rng(0)
    rows = []
    for name in names:
        image = MODELS[name]
        folder = Path(args.engines)
        session = ort.InferenceSession(str(zoo.export(name, dynamic=True).path), options,
                                       providers=["CPUExecutionProvider"])
        # the engines built at each batch loaded before the dynamic ones (--built-first) or each after them: which
        # engine of a process was loaded first moved swin_tiny's ratios at batch 1 by ~10-25% (session 23)
        built_at = {b: kiln.load(folder / f"{name}-b{b}.kiln").create_execution_context() for b in batches} \
            if args.built_first else {}
        dynamic = kiln.load(folder / f"{name}-dynamic.kiln").create_execution_context(pad_first_calls=False)
        runs_only = kiln.load(folder / f"{name}-dynamic.kiln").create_execution_context(pad_first_calls=False)
        primitives_made(120)  # what the engine makes ahead on its background thread (before timing anything)
        dynamic.run({"pixel_values": rng.standard_normal((args.opt, *image), dtype=np.float32)})
        stream = [b for b in range(1, args.max + 1) if b != args.opt and b not in batches]
        rng.shuffle(stream)
        warm = [b for b in (3, 1) if b not in batches]  # one-time costs (the one-image view) before the stream
        _first_calls(dynamic, session, image, warm, rng)
        ours, theirs = _first_calls(dynamic, session, image, stream[:args.stream], rng)
        rows.append((name, "first - repeat, new batches", statistics.median(ours), None, None,
                     statistics.median(theirs)))
        for batch in batches:
            built = built_at.pop(batch, None) or kiln.load(folder / f"{name}-b{batch}.kiln").create_execution_context()
            x = {"pixel_values": rng.standard_normal((batch, *image), dtype=np.float32)}
            runs = {"dynamic": lambda: dynamic.run(x), "runs only": lambda: runs_only.run(x),
                    "built": lambda: built.run(x), "onnxruntime": lambda: session.run(None, x)}
            kept = _settle(dynamic, x, batch)
            _runs_only(runs_only, x, batch)
            for run in runs.values():
                run()
            times: dict[str, list[float]] = {k: [] for k in runs}
            for _ in range(args.reps):
                for key in rng.permutation(list(runs)):  # each engine after each other one alike (no order bias)
                    run = runs[key]
                    start = time.thread_time()  # 1 thread: the work, without a loaded machine's preemption
                    run()
                    times[key].append((time.thread_time() - start) * 1e3)
            rows.append((name, f"batch {batch} ({kept})", *(statistics.median(times[k]) for k in runs)))
            del built
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"# {cpu}, 1 thread, load average {os.getloadavg()[0]:.1f} (end), opt {args.opt}, ms of thread CPU time")
    print("| model | rows | dynamic | runs only | built at b | onnxruntime | dynamic / built | runs only / built | "
          "dynamic / ort |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, what, ours, runs, built, theirs in rows:
        if built is None:
            print(f"| {name} | {what} | {ours:.2f} | | | {theirs:.2f} | | | |")
        else:
            print(f"| {name} | {what} | {ours:.2f} | {runs:.2f} | {built:.2f} | {theirs:.2f} | {ours / built:.2f} | "
                  f"{runs / built:.2f} | {ours / theirs:.2f} |")


if __name__ == "__main__":
    main()
