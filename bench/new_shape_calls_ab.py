"""A decoder's (or an encoder's) run() at input shapes past the ones planned at load, two trees interleaved (issue 10).

Each round starts one process per tree (A, B; the order alternates by round), each loads the engine, warms it and
waits for the load's background jobs, then, in order:

    new      --new shapes none of which was planned at load (batch x sequence over the profile, shuffled by the
             round's seed, the same for A and B), each called 3 times in a row (its first call, 2nd and 3rd)
    cycle    8 of those shapes already called, run round robin --cycle times (every call a repeated shape)
    ort      onnxruntime (1 thread, its own session, warmed at 2 x 16) at the `new` shapes: first call, then a 2nd

Per call: thread CPU µs of the call, and of it outside the native segments' compiled loops (the call less the C
calls of every segment's loop: the part a new shape's binding, the shape values, views and Python glue take). Rows
are medians over the round's calls; the table gives the median of the rounds per tree, B / A (the median of the
rounds' ratios; with --toggle of each round's median of ratios of paired calls) and in how many rounds it was below 1.
One thread, first-call padding off (every new shape binds at its first call). --toggle: one process a round, the engine
loaded twice, A without signature views (view_steps.py): the part of B that recorded views make, calls paired.

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
    """One tree's measurements: the tree on PYTHONPATH, its bench helpers (first_call_direct puts its tree first).
    --toggle: the engine loaded twice in this process, A's program without its signature views (view_steps.py), every
    measurement made on both in alternating order (A B, then B A): rows per side and the median of paired B / A."""
    os.environ["KILN_PAD_FIRST_CALLS"] = "0"
    sys.path.insert(0, str(Path(os.environ["PYTHONPATH"].split(os.pathsep)[0]) / "bench"))
    import numpy as np

    from first_call_direct import span_timer, warm_context
    from kiln.runtime import first_calls

    contexts = {side: warm_context(args.engine) for side in (("A", "B") if args.toggle else ("",))}
    if args.toggle:
        contexts["A"].program.signature_views = None
    first_calls.primitives_made(120)
    spans, _timed = span_timer()  # spans["loop"]: the segments' compiled loops' C calls
    program = contexts["B" if args.toggle else ""].program
    planned = {tuple(k[0][0]) for k in (program.shape_plans or {})}
    batches, sequences = (int(v) for v in args.largest.split("x"))
    shapes = [(b, s) for b in range(1, batches + 1) for s in range(1, sequences + 1) if (b, s) not in planned]
    rng = np.random.default_rng(args.seed)
    rng.shuffle(shapes)
    shapes = shapes[:args.new]
    names = program.spec.inputs
    feeds = [{n: (rng.integers(0, 1000, s) if n == "input_ids" else np.ones(s, np.int64)) for n in names}
             for s in shapes]
    rows: dict[str, dict[str, list[float]]] = {side: {name: [] for name in ROWS} for side in contexts}
    turn = iter(range(1 << 30))

    def calls(f) -> dict[str, tuple[float, float]]:
        """One call on each side (alternating which goes first): (thread CPU µs, of it outside the loop)."""
        found = {}
        for side in (contexts if next(turn) % 2 == 0 else list(contexts)[::-1]):
            spans.clear()
            start = time.thread_time_ns()
            contexts[side].run(f)
            spent = (time.thread_time_ns() - start) / 1e3
            found[side] = (spent, spent - spans.get("loop", 0.0))
        return found

    for f in feeds:
        first, second, third = calls(f), calls(f), calls(f)
        for side, found in rows.items():
            found["new: first call"].append(first[side][0])
            found["new: first call, outside the loop"].append(first[side][1])
            found["new: 2nd call, outside the loop"].append(second[side][1])
            found["new: 3rd call, outside the loop"].append(third[side][1])
            found["new: first - 3rd call, outside the loop"].append(first[side][1] - third[side][1])
    for _ in range(args.cycle):
        for f in feeds[:8]:
            made = calls(f)
            for side, found in rows.items():
                found["cycle of 8: call"].append(made[side][0])
                found["cycle of 8: call, outside the loop"].append(made[side][1])
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
                spent = (time.thread_time_ns() - start) / 1e3
                for found in rows.values():
                    found[row].append(spent)
    out = {side: {name: statistics.median(v) for name, v in found.items() if v} for side, found in rows.items()}
    if args.toggle:  # paired per call: B's / A's
        out["B / A"] = {name: statistics.median(b / a for a, b in zip(rows["A"][name], rows["B"][name]) if a > 0)
                        for name in ROWS if rows["A"][name] and not name.startswith(("ort", "new: first - 3rd"))}
    print(json.dumps(out))


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
    ap.add_argument("--toggle", action="store_true", help="A: this tree without signature views, in B's processes")
    args = ap.parse_args()
    if args.child:
        return child(args)
    trees = {"A": args.a_tree, "B": args.b_tree}
    found: dict[str, list[dict]] = {"A": [], "B": [], "B / A": []}
    loads = []
    for r in range(args.rounds):
        for side in ("B",) if args.toggle else ("AB" if r % 2 == 0 else "BA"):
            command = [sys.executable, str(HERE), "--child", "--engine", args.engine, "--onnx", args.onnx,
                       "--new", str(args.new), "--cycle", str(args.cycle), "--largest", args.largest,
                       "--seed", str(args.seed + r)] + (["--toggle"] if args.toggle else [])
            environment = {**os.environ, "PYTHONPATH": trees[side], "OMP_NUM_THREADS": "1"}
            out = json.loads(subprocess.run(command, env=environment, capture_output=True, text=True,
                                            check=True).stdout.strip().splitlines()[-1])
            for key, rows in out.items():
                found[key or side].append(rows)
            loads.append(os.getloadavg()[0])
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    how = "in one process each, A its signature views off, calls paired" if args.toggle else "A and B processes"
    print(f"# {args.label} {Path(args.engine).name}: {args.rounds} rounds ({how}) x {args.new} new shapes, 1 thread, "
          f"{cpu}, 1-min load {min(loads):.1f}-{max(loads):.1f}; thread CPU µs, median of the rounds' medians")
    print("| µs | A | B | B / A | rounds B < A |\n|---|---|---|---|---|")
    for name in ROWS:
        a = [d[name] for d in found["A"] if name in d]
        b = [d[name] for d in found["B"] if name in d]
        if not a or not b:
            continue
        paired = [d[name] for d in found["B / A"] if name in d] or [y / x for x, y in zip(a, b)]
        below = sum(ratio < 1 for ratio in paired)
        print(f"| {name} | {statistics.median(a):.0f} | {statistics.median(b):.0f} | {statistics.median(paired):.3f} "
              f"| {below}/{len(paired)} |")


if __name__ == "__main__":
    main()
