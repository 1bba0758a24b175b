"""A decoder's calls at new input shapes with its view layers two ways, in one process, calls paired (issue 10).

The sides (one engine file loaded twice per process):

    main     program.LEAN_VIEWS off: the op's implementation for each view layer, a signature's view layers
             recorded at its 2nd call and replayed as as_strided from its 3rd (view_steps.py: main at 536393ad)
    lean     program.LEAN_VIEWS on (this tree's default): view_launches.py's launches, the op's torch call at an
             input geometry's first and second call (the second keeps the view it gave), an as_strided from its
             third; a signature's list of recorded views made after its 2nd call from those entries, nothing wrapped

Per round, one fresh process: the shapes of batch 1-B x sequence 1-S none of which the load planned, shuffled by the
round's seed; each called 4 times in a row on each side (which side first alternates: first call, 2nd, 3rd, 4th), every
output of every call checked bit for bit against side main's first call; then a cycle of 8 of those shapes --cycle
times (every call a repeated shape, no two in a row the same); then onnxruntime (1 thread) at the same shapes, a
first and a 2nd call. Thread CPU µs per call and of it outside the native segments' compiled loops. Table: the
median over rounds of each round's median, and a side's ratio to main (median over rounds of the median of paired
ratios) with the rounds below 1.

    python bench/view_launches_ab.py --engine /tmp/llama_tiny_wide.kiln --onnx /tmp/llama_tiny.onnx --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
SIDES = ("main", "lean")
ROWS = ["1st call", "1st call, outside the loop", "2nd call, outside the loop", "3rd call, outside the loop",
        "4th call, outside the loop", "cycle of 8: call", "cycle of 8: outside the loop"]


def child(args) -> None:
    os.environ["KILN_PAD_FIRST_CALLS"] = "0"  # every new shape binds at its first call
    import kiln  # noqa: F401  (before torch: kiln sets OpenMP's wait policy)
    import numpy as np
    import torch

    from kiln.runtime import native, native_views, program as program_module

    torch.set_num_threads(1)
    loop = [0.0]

    def timed(owner, attribute):  # the segments' compiled loops' C calls
        function = getattr(owner, attribute)

        def wrapper(*a, **k):
            start = time.thread_time_ns()
            try:
                return function(*a, **k)
            finally:
                loop[0] += (time.thread_time_ns() - start) / 1e3
        setattr(owner, attribute, wrapper)

    timed(native, "_run_loop")
    timed(native_views, "_run_loop")
    contexts = {}
    for side in SIDES:
        program_module.LEAN_VIEWS = side != "main"
        context = kiln.load(args.engine).create_execution_context()
        context.warm_up()
        contexts[side] = context
    program_module.LEAN_VIEWS = True
    rng = np.random.default_rng(args.seed)
    planned = {tuple(k[0][0]) for k in (contexts["main"].program.shape_plans or {})}
    batches, sequences = (int(v) for v in args.largest.split("x"))
    shapes = [(b, s) for b in range(1, batches + 1) for s in range(1, sequences + 1) if (b, s) not in planned]
    rng.shuffle(shapes)
    names = contexts["main"].engine.input_names
    feeds = [{n: (rng.integers(0, 1000, s) if n == "input_ids" else np.ones(s, np.int64)) for n in names}
             for s in shapes[:args.new]]
    rows = {side: {row: [] for row in ROWS} for side in SIDES}
    turn = iter(range(1 << 30))

    def call(side, f, *row_names):
        loop[0] = 0.0
        start = time.thread_time_ns()
        out = contexts[side].run(f)
        spent = (time.thread_time_ns() - start) / 1e3
        for name in row_names:
            rows[side][name].append(spent - loop[0] if "outside" in name else spent)
        return out

    for f in feeds:
        k = next(turn)
        reference = None
        for side in SIDES if k % 2 == 0 else SIDES[::-1]:
            outs = [call(side, f, "1st call", "1st call, outside the loop"),
                    call(side, f, "2nd call, outside the loop"), call(side, f, "3rd call, outside the loop"),
                    call(side, f, "4th call, outside the loop")]
            for out in outs:
                reference = reference or out
                for name in reference:
                    if not np.array_equal(np.asarray(out[name]), np.asarray(reference[name])):
                        raise SystemExit(f"{side} at {f['input_ids'].shape}: {name} differs bit for bit")
    for r in range(args.cycle):
        for f in feeds[:8]:
            for side in SIDES if next(turn) % 2 == 0 else SIDES[::-1]:
                call(side, f, "cycle of 8: call", "cycle of 8: outside the loop")
    out = {side: {name: statistics.median(v) for name, v in found.items()} for side, found in rows.items()}
    for side in SIDES[1:]:
        out[f"{side} / main"] = {name: statistics.median(b / a for a, b in zip(rows["main"][name], rows[side][name]))
                                 for name in ROWS}
    if args.onnx:
        import onnxruntime as ort
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        session = ort.InferenceSession(args.onnx, options, providers=["CPUExecutionProvider"])
        ort_names = [i.name for i in session.get_inputs()]
        for _ in range(3):
            session.run(None, {n: np.ones((2, 16), np.int64) for n in ort_names})
        found = {"1st call": [], "2nd call": []}
        for f in feeds:
            f = {n: v for n, v in f.items() if n in ort_names}
            for row in found:
                start = time.thread_time_ns()
                session.run(None, f)
                found[row].append((time.thread_time_ns() - start) / 1e3)
        out["onnxruntime"] = {name: statistics.median(v) for name, v in found.items()}
    out["load"] = os.getloadavg()[0]
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--onnx", default="")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new", type=int, default=40, help="new shapes a process calls")
    ap.add_argument("--cycle", type=int, default=20, help="rounds of the cycle of 8 shapes")
    ap.add_argument("--largest", default="8x64", help="batch x sequence of the profile's largest shape")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        return child(args)
    found = []
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        command = [sys.executable, str(HERE), "--child", "--engine", args.engine, "--onnx", args.onnx,
                   "--new", str(args.new), "--cycle", str(args.cycle), "--largest", args.largest,
                   "--seed", str(args.seed + r)]
        environment = {**os.environ, "PYTHONPATH": str(HERE.parents[1]), "OMP_NUM_THREADS": "1"}
        found.append(json.loads(subprocess.run(command, env=environment, capture_output=True, text=True,
                                               check=True).stdout.strip().splitlines()[-1]))
        loads.append(found[-1]["load"])
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"# {Path(args.engine).name}: {args.rounds} processes x {args.new} new shapes (4 calls each) + "
          f"{args.cycle} cycles of 8, 1 thread, {cpu}, 1-min load {min(loads):.1f}-{max(loads):.1f}; thread CPU µs, "
          "median of the rounds' medians; every call's outputs bit for bit main's first call's")
    print("| µs | " + " | ".join(SIDES) + " | " + " | ".join(f"{s} / main (rounds < 1)" for s in SIDES[1:])
          + " |\n|---|" + "---|" * (2 * len(SIDES) - 1))
    for name in ROWS:
        cells = [f"{statistics.median(d[side][name] for d in found):.0f}" for side in SIDES]
        for side in SIDES[1:]:
            ratios = [d[f"{side} / main"][name] for d in found]
            cells.append(f"{statistics.median(ratios):.3f} ({sum(x < 1 for x in ratios)}/{len(ratios)})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if "onnxruntime" in found[0]:
        print("| onnxruntime 1st call; 2nd call | " + "; ".join(
            f"{statistics.median(d['onnxruntime'][name] for d in found):.0f}" for name in ("1st call", "2nd call"))
            + " |" + " |" * (2 * len(SIDES) - 2))


if __name__ == "__main__":
    main()
