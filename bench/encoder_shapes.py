"""A transformer encoder or decoder exported with symbolic batch and sequence, at a few shapes: kiln vs onnxruntime
vs torch eager on the CPU, side by side in one process (issue 10's small-shape gap).

    python bench/encoder_shapes.py                                   # bert_tiny, 1 thread, 1x7 2x16 1x64 4x128
    python bench/encoder_shapes.py --model bert_base --threads 2 --shapes 1x8,1x128
    python bench/encoder_shapes.py --kiln-root /tmp/before --label before   # another checkout's kiln
    python bench/encoder_shapes.py --model qwen2_small --shapes 1x1,1x16,1x128,4x64 --clock thread  # a decoder

The engine is built as a new user builds it (`kiln.build(path)`, symbolic dims tuned at their
defaults); every runtime gets the same feeds (random ids, an attention mask of ones unless --padding)
and the same thread count; a decoder takes input_ids only (the inputs are the export's). Timed in
interleaved rounds of blocks (kiln, onnxruntime, torch eager, kiln, ...: a shared machine's drift lands
on all alike); per round the median of a block, and per shape the median over rounds and each round's
kiln / onnxruntime ratio. The load average before and after is printed with the table. `--clock thread`
times the calling thread's CPU time (at 1 thread every runtime runs there: what each costs on a machine
others load, without the time it waits). Results are appended to bench/results/encoder-shapes-cpu-<date>.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def _import_kiln(root: str | None):
    """kiln from this checkout, or from `root` (a before/after comparison on one machine)."""
    sys.path.insert(0, str(Path(root).resolve() if root else HERE.parent))
    import kiln
    from kiln import zoo
    return kiln, zoo


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def _commit(root: Path) -> str:
    import subprocess

    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
    return done.stdout.strip() or "?"


def block(fn, budget_s: float, clock=time.perf_counter, min_calls: int = 3) -> float:
    """Median ms of the calls of one block, timed by `clock`."""
    samples = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < min_calls or time.perf_counter() < deadline:
        start = clock()
        fn()
        samples.append((clock() - start) * 1e3)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert_tiny")
    ap.add_argument("--shapes", default="1x7,2x16,1x64,4x128", help="BATCHxSEQ,...")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block-s", type=float, default=0.3, help="seconds per runtime per round")
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall",
                    help="'thread': the calling thread's CPU time (meaningful at --threads 1)")
    ap.add_argument("--padding", action="store_true", help="pad every row but the first at the end")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--kiln-root", default=None, help="import kiln from this checkout instead")
    ap.add_argument("--label", default="", help="a word for the table's title (before/after)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--engine", default="", help="time this saved engine instead of building one")
    ap.add_argument("--save-engine", default="", help="save the engine built here (a later --engine A/B: both "
                    "sides' tactics fixed, the build's tuning out of the comparison)")
    args = ap.parse_args()

    kiln, zoo = _import_kiln(args.kiln_root)
    import onnxruntime as ort
    import torch

    torch.set_num_threads(args.threads)
    # an example batch of 1 would have torch.export specialise the batch dim to 1: export at 2 or more
    exported = zoo.export(args.model, batch=max(2, zoo.get(args.model).batch), dynamic=True)
    t0 = time.perf_counter()
    engine = kiln.load(args.engine) if args.engine else kiln.build(str(exported.path))
    build_s = time.perf_counter() - t0
    if args.save_engine:
        engine.save(args.save_engine)
    context = engine.create_execution_context()
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
    session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
    module = None if args.no_torch else zoo.torch_model(args.model).eval()
    rng = np.random.default_rng(0)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    load_before = os.getloadavg()
    rows = []
    for text in args.shapes.split(","):
        b, s = (int(v) for v in text.split("x"))
        mask = np.ones((b, s), np.int64)
        if args.padding:
            for r in range(1, b):
                mask[r, int(rng.integers(1, s + 1)):] = 0
        feeds = {"input_ids": rng.integers(0, 1000, (b, s), dtype=np.int64), "attention_mask": mask}
        feeds = {k: v for k, v in feeds.items() if k in exported.meta["inputs"]}  # a decoder: input_ids only
        tensors = {k: torch.from_numpy(v) for k, v in feeds.items()}
        runners = {"kiln": lambda: context.run(feeds), "onnxruntime": lambda: session.run(None, feeds)}
        if module is not None:
            def eager(tensors=tensors):
                with torch.inference_mode():
                    module(**tensors)
            runners["torch eager"] = eager
        got = next(iter(context.run(feeds).values()))
        want = session.run(None, feeds)[0]
        real = mask.astype(bool)
        error = float(np.abs(got[real] - want[real]).max())
        for fn in runners.values():  # warm-up: first calls, shape plans, bound segments
            for _ in range(3):
                fn()
        per_round: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(args.rounds):
            for name, fn in runners.items():
                per_round[name].append(block(fn, args.block_s, clock))
        ratios = [k / o for k, o in zip(per_round["kiln"], per_round["onnxruntime"])]
        rows.append((text, {n: statistics.median(v) for n, v in per_round.items()}, ratios, error))
        print(f"{text}: " + ", ".join(f"{n} {statistics.median(v):.3f} ms" for n, v in per_round.items())
              + f"; kiln/ort per round {' '.join(f'{r:.2f}' for r in ratios)}", flush=True)
    load_after = os.getloadavg()

    root = Path(args.kiln_root).resolve() if args.kiln_root else HERE.parent
    names = list(rows[0][1]) if rows else []
    lines = [f"## {args.model} at several shapes{' (' + args.label + ')' if args.label else ''}: "
             f"{_cpu_name()}, {args.threads} thread(s), kiln commit {_commit(root)}, {datetime.date.today()}",
             (f"loaded {args.engine}" if args.engine else "built with kiln.build(path)") + f" in {build_s:.1f} s"
             + f"; masks {'padded' if args.padding else 'of ones'}; "
             f"{args.rounds} interleaved rounds of {args.block_s} s blocks, {args.clock} clock; load average "
             f"{load_before[0]:.1f} before, {load_after[0]:.1f} after (the machine has {os.cpu_count()} cores)", "",
             "| shape | " + " | ".join(f"{n} ms" for n in names) + " | kiln / onnxruntime (median) | per round | "
             "max abs err vs onnxruntime |",
             "|---|" + "---|" * len(names) + "---|---|---|"]
    for text, medians, ratios, error in rows:
        lines.append(f"| {text} | " + " | ".join(f"{medians[n]:.3f}" for n in names)
                     + f" | {statistics.median(ratios):.2f} | {' '.join(f'{r:.2f}' for r in ratios)} | {error:.1e} |")
    table = "\n".join(lines)
    print("\n" + table)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        with open(RESULTS / f"encoder-shapes-cpu-{datetime.date.today().isoformat()}.md", "a") as f:
            f.write(table + "\n\n")


if __name__ == "__main__":
    main()
