"""A decoder's (or an encoder's) run() at input shapes past the ones planned at load, two trees interleaved (issue 10).

Each round starts one process per tree (A, B; the order alternates by round), each loads the engine, warms it and
waits for the load's background jobs, then, in order:

    new      --new shapes none of which was planned at load (batch x sequence over the profile, shuffled by the
             round's seed, the same for A and B), each called 3 times in a row (its first call, 2nd and 3rd)
    cycle    8 of those shapes already called, run round robin --cycle times (every call a repeated shape)
    ort      onnxruntime (1 thread, its own session, warmed at 2 x 16) at the `new` shapes: first call, then a 2nd

Per call: thread CPU µs of the call, and of it outside the native segments' compiled loops (the call less the C
calls of every segment's loop: the part a new shape's binding, the shape values, views and Python glue take). Rows
are medians over the round's calls; the table gives the median of the rounds per tree and how many rounds B was
below A (paired by round). One thread, first-call padding off (every new shape binds at its first call).

    python bench/new_shape_calls_ab.py --a-tree /tmp/base --engine /tmp/llama_tiny_wide.kiln --onnx llama.onnx
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
ROWS = ["new: first call", "new: first call, outside the loop", "new: 2nd call, outside the loop",
        "new: 3rd call, outside the loop", "new: first - 3rd call, outside the loop", "cycle of 8: call",
        "cycle of 8: call, outside the loop", "ort: first call", "ort: 2nd call"]


def child(args) -> None:
    """One tree's measurements: the tree on PYTHONPATH, its own bench helpers (first_call_direct puts its tree first)."""
    os.environ["KILN_PAD_FIRST_CALLS"] = "0"
    sys.path.insert(0, str(Path(os.environ["PYTHONPATH"].split(os.pathsep)[0]) / "bench"))
    import numpy as np

    from first_call_direct import span_timer, warm_context
    from kiln.runtime import first_calls

    context = warm_context(args.engine)
    first_calls.primitives_made(120)
    spans, _timed = span_timer()  # spans["loop"]: the segments' compiled loops' C calls
    program = context.program
    planned = {tuple(k[0][0]) for k in (program.shape_plans or {})}
    batches, sequences = (int(v) for v in args.largest.split("x"))
    shapes = [(b, s) for b in range(1, batches + 1) for s in range(1, sequences + 1) if (b, s) not in planned]
    rng = np.random.default_rng(args.seed)
    rng.shuffle(shapes)
    shapes = shapes[:args.new]
    names = context.engine.input_names
    feeds = [{n: (rng.integers(0, 1000, s) if n == "input_ids" else np.ones(s, np.int64)) for n in names}
             for s in shapes]

    def call(f) -> tuple[float, float]:
        spans.clear()
        start = time.thread_time_ns()
        context.run(f)
        spent = (time.thread_time_ns() - start) / 1e3
        return spent, spent - spans.get("loop", 0.0)

    rows: dict[str, list[float]] = {name: [] for name in ROWS}
    for f in feeds:
        first, first_outside = call(f)
        _second, second_outside = call(f)
        _third, third_outside = call(f)
        rows["new: first call"].append(first)
        rows["new: first call, outside the loop"].append(first_outside)
        rows["new: 2nd call, outside the loop"].append(second_outside)
        rows["new: 3rd call, outside the loop"].append(third_outside)
        rows["new: first - 3rd call, outside the loop"].append(first_outside - third_outside)
    for _ in range(args.cycle):
        for f in feeds[:8]:
            spent, outside = call(f)
            rows["cycle of 8: call"].append(spent)
            rows["cycle of 8: call, outside the loop"].append(outside)
    if args.onnx:
        import onnxruntime as ort
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        session = ort.InferenceSession(args.onnx, options, providers=["CPUExecutionProvider"])
        ort_names = [i.name for i in session.get_inputs()]
        warm = {n: np.ones((2, 16), np.int64) for n in ort_names}
        for _ in range(3):
            session.run(None, warm)
        for f in feeds:
            f = {n: v for n, v in f.items() if n in ort_names}
            for row in ("ort: first call", "ort: 2nd call"):
                start = time.thread_time_ns()
                session.run(None, f)
                rows[row].append((time.thread_time_ns() - start) / 1e3)
    print(json.dumps({name: statistics.median(v) for name, v in rows.items() if v}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--onnx", default="")
    ap.add_argument("--a-tree", default="", help="tree A (a checkout of the base commit); B is this script's tree")
    ap.add_argument("--b-tree", default=str(HERE.parents[1]))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--new", type=int, default=60, help="new shapes a process calls")
    ap.add_argument("--cycle", type=int, default=20, help="rounds of the cycle of 8 shapes")
    ap.add_argument("--largest", default="8x64", help="batch x sequence of the profile's largest shape")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="")
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        return child(args)
    trees = {"A": args.a_tree, "B": args.b_tree}
    found: dict[str, list[dict]] = {"A": [], "B": []}
    loads = []
    for r in range(args.rounds):
        for side in ("AB" if r % 2 == 0 else "BA"):
            command = [sys.executable, str(HERE), "--child", "--engine", args.engine,
                       "--onnx", args.onnx, "--new", str(args.new), "--cycle", str(args.cycle),
                       "--largest", args.largest, "--seed", str(args.seed + r)]
            environment = {**os.environ, "PYTHONPATH": trees[side], "OMP_NUM_THREADS": "1"}
            out = subprocess.run(command, env=environment, capture_output=True, text=True, check=True).stdout
            found[side].append(json.loads(out.strip().splitlines()[-1]))
            loads.append(os.getloadavg()[0])
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"# {args.label} {Path(args.engine).name}: {args.rounds} rounds x {args.new} new shapes, 1 thread, {cpu}, "
          f"1-min load {min(loads):.1f}-{max(loads):.1f}; thread CPU µs, median of the rounds' medians")
    print("| µs | A | B | B / A | rounds B < A |\n|---|---|---|---|---|")
    for name in ROWS:
        a = [d[name] for d in found["A"] if name in d]
        b = [d[name] for d in found["B"] if name in d]
        if not a or not b:
            continue
        ma, mb = statistics.median(a), statistics.median(b)
        below = sum(y < x for x, y in zip(a, b))
        print(f"| {name} | {ma:.0f} | {mb:.0f} | {mb / ma:.3f} | {below}/{len(a)} |")


if __name__ == "__main__":
    main()
