"""A decoder (zoo llama_tiny, symbolic batch x sequence) on the CPU beside onnxruntime: new shapes and repeated
shapes, two trees/engines interleaved process by process (issue 10).

Each round starts one process per side (A, B; the order alternates by round). A process loads its side's engine
with its side's tree on PYTHONPATH, warms the context and waits for the load's background jobs, makes an
onnxruntime session on the same ONNX file with the same thread count, then:

    new      --new shapes of the profile that the load did not plan (batch x sequence, shuffled by the round's seed,
             the same on both sides): kiln's first, 2nd and 3rd call at each, then onnxruntime's first and 2nd
    steady   --steady shapes, --repeats rounds, each round one kiln call and one onnxruntime call per shape

Wall µs per call (perf_counter: at 2 threads the calling thread's CPU time misses the workers). Per process the rows
are medians; the table gives the median over rounds per side, B / A (median of the rounds' paired ratios, rounds
paired by index) and kiln / onnxruntime inside each process (the same calls' neighbours: robust to the load).

    python bench/llama_cpu.py --a-tree /tmp/base --a-engine /tmp/a.kiln --b-engine /tmp/b.kiln --onnx model.onnx \
        --threads 1 --rounds 4
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


def child(args) -> None:
    import kiln  # before torch: kiln chooses OpenMP's wait policy
    import numpy as np
    import onnxruntime as ort
    import torch

    from kiln.runtime import first_calls

    torch.set_num_threads(args.threads)
    context = kiln.load(args.engine).create_execution_context()
    context.warm_up()
    first_calls.primitives_made(120)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
    session = ort.InferenceSession(args.onnx, options, providers=["CPUExecutionProvider"])
    program = context.program
    planned = {tuple(k[0][0]) for k in (program.shape_plans or {})}
    batches, sequences = (int(v) for v in args.largest.split("x"))
    rng = np.random.default_rng(args.seed)
    shapes = [(b, s) for b in range(1, batches + 1) for s in range(1, sequences + 1) if (b, s) not in planned]
    rng.shuffle(shapes)
    for _ in range(3):
        session.run(None, {"input_ids": np.ones((2, 8), np.int64)})

    def timed(call, feed) -> float:
        start = time.perf_counter_ns()
        call(feed)
        return (time.perf_counter_ns() - start) / 1e3

    rows: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    for shape in shapes[:args.new]:
        feed = {"input_ids": rng.integers(0, 1000, shape).astype(np.int64)}
        for row in ("kiln new: first call", "kiln new: 2nd call", "kiln new: 3rd call"):
            add(row, timed(context.run, feed))
        first, second = timed(lambda f: session.run(None, f), feed), timed(lambda f: session.run(None, f), feed)
        add("ort new: first call", first)
        add("ort new: 2nd call", second)
        add("kiln / ort new: first call", rows["kiln new: first call"][-1] / first)
    steady = [tuple(int(v) for v in s.split("x")) for s in args.steady.split(",")]
    feeds = {s: {"input_ids": rng.integers(0, 1000, s).astype(np.int64)} for s in steady}
    for s, feed in feeds.items():  # each shape bound and its views recorded before the timed rounds
        for _ in range(3):
            context.run(feed)
    for r in range(args.repeats):
        for s, feed in feeds.items():
            pair = [("kiln", context.run), ("ort", lambda f: session.run(None, f))]
            for name, call in (pair if r % 2 == 0 else pair[::-1]):
                add(f"{name} {s[0]}x{s[1]}", timed(call, feed))
    for s in steady:
        kiln_calls, ort_calls = rows[f"kiln {s[0]}x{s[1]}"], rows[f"ort {s[0]}x{s[1]}"]
        rows[f"kiln / ort {s[0]}x{s[1]}"] = [k / o for k, o in zip(kiln_calls, ort_calls)]
    print(json.dumps({name: statistics.median(v) for name, v in rows.items()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a-engine", required=True)
    ap.add_argument("--b-engine", required=True)
    ap.add_argument("--onnx", required=True)
    ap.add_argument("--a-tree", default=str(HERE.parents[1]))
    ap.add_argument("--b-tree", default=str(HERE.parents[1]))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--new", type=int, default=40, help="new shapes a process calls")
    ap.add_argument("--steady", default="1x8,2x16,4x33,8x64")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--largest", default="8x64", help="batch x sequence of the profile's largest shape")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="")
    ap.add_argument("--engine", default="")
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        return child(args)
    sides = {"A": (args.a_tree, args.a_engine), "B": (args.b_tree, args.b_engine)}
    found: dict[str, list[dict]] = {"A": [], "B": []}
    loads = []
    for r in range(args.rounds):
        for side in ("AB" if r % 2 == 0 else "BA"):
            tree, engine = sides[side]
            command = [sys.executable, str(HERE), "--child", "--engine", engine, "--onnx", args.onnx,
                       "--threads", str(args.threads), "--new", str(args.new), "--steady", args.steady,
                       "--repeats", str(args.repeats), "--largest", args.largest, "--seed", str(args.seed + r),
                       "--a-engine", "", "--b-engine", ""]
            environment = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": str(args.threads)}
            done = subprocess.run(command, env=environment, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"side {side} failed:\n{done.stderr[-3000:]}")
            found[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
            loads.append(os.getloadavg()[0])
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"# {args.label}: {args.rounds} rounds (A, B processes alternating) x {args.new} new shapes, "
          f"{args.threads} thread(s), {cpu}, 1-min load {min(loads):.1f}-{max(loads):.1f}; wall µs, median of the "
          f"rounds' medians; KILN_PAD_FIRST_CALLS={os.environ.get('KILN_PAD_FIRST_CALLS', 'default')}")
    print("| µs | A | B | B / A | rounds B < A |\n|---|---|---|---|---|")
    for name in found["A"][0]:
        a = [d[name] for d in found["A"]]
        b = [d[name] for d in found["B"]]
        paired = [y / x for x, y in zip(a, b)]
        digits = 3 if "/" in name else 0
        print(f"| {name} | {statistics.median(a):.{digits}f} | {statistics.median(b):.{digits}f} | "
              f"{statistics.median(paired):.3f} | {sum(p < 1 for p in paired)}/{len(paired)} |")


if __name__ == "__main__":
    main()
