"""Transformers on kiln's C loops at 2 threads: kiln's own pool (pool.c) vs OpenMP vs 1 thread, interleaved in
each process, several processes (issue 10/11, a 2-vCPU Zen 3).

Each process loads the engines bench/pool_2threads_prep.py made (llama_tiny at 8x64 and 4x33, bert_tiny and
all-MiniLM-L6-v2 at 1x128), warms them, then runs --rounds rounds; a round runs every mode in turn (the order
rotates by round):

    1t        torch.set_num_threads(1)
    2t-pool   2 threads, kiln_pool_enabled = 1 in every library with a pool.c (gemm_native._POOLED)
    2t-pool0  the same with kiln_pool_step_aside = 0 and kiln_pool_backoff_max_ns = 0 (the pool before 2026-12-07:
              a worker woken on the caller's CPU runs items there, every loop wakes the sleepers)
    2t-poolS  step aside, no back-off (kiln_pool_backoff_max_ns = 0)
    2t-omp    2 threads, kiln_pool_enabled = 0 (kiln_parallel_for is an OpenMP dynamic loop)
    (--ort: onnxruntime at 1 and 2 intra-op threads, the same feeds: the control)

and in each mode every workload --calls calls (wall clock, perf_counter); a mode's number in a round is the median.
The process prints one JSON line per round; the parent starts --processes processes one after another, prints the
1-min load before each, and a table: per workload and mode the median over all rounds, the spread (min-max of the
rounds' medians), and in how many rounds each 2-thread mode beat 1 thread and the pool beat OpenMP.
Outputs of every mode are compared with 1 thread's (bit-identical expected: the split changes no sum's order).

    python bench/pool_2threads.py --dir /tmp/pool2t --processes 3 --rounds 6 [--modes 1t,2t-pool,2t-omp] [--ort]
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
MODES = ("1t", "2t-pool", "2t-omp")


def set_mode(mode: str) -> None:
    import ctypes

    import torch

    from kiln.kernels.cpu import gemm_native
    # "2t-pool:16": gemm.c's kiln_gemm_items_per_thread = 16 (default 4); "2t-pool0": pool.c's kiln_pool_step_aside = 0
    mode, _, items = mode.partition(":")
    torch.set_num_threads(1 if mode.startswith("1t") else 2)
    pool = 0 if mode.endswith("omp") else 1
    for lib in gemm_native._POOLED:
        ctypes.c_int.in_dll(lib, "kiln_pool_enabled").value = pool
        ctypes.c_int.in_dll(lib, "kiln_pool_step_aside").value = 0 if mode.endswith("pool0") else 1
        # "2t-poolS": step aside, no back-off; "2t-pool0": neither (the pool before 2026-12-07)
        ctypes.c_long.in_dll(lib, "kiln_pool_backoff_max_ns").value = 0 if mode[-1] in "0S" else 1_000_000
        ctypes.c_long.in_dll(lib, "kiln_gemm_items_per_thread").value = int(items or 4)


def child(args) -> None:
    import kiln  # before torch: kiln chooses OpenMP's wait policy
    import numpy as np
    import torch

    folder = Path(args.dir)
    torch.set_num_threads(2)
    rng = np.random.default_rng(args.seed)
    work = {}  # name -> (context, feed)
    sessions = {}
    names = args.workloads.split(",")
    for name in names:
        model = name.split("@")[0]
        context = kiln.load(str(folder / f"{model}.kiln")).create_execution_context()
        if model == "llama":
            b, s = (int(v) for v in name.split("@")[1].split("x"))
            feed = {"input_ids": rng.integers(0, 1000, (b, s)).astype(np.int64)}
        else:
            feed = dict(np.load(folder / f"{model}.npz"))
        context.warm_up()
        work[name] = (context, feed)
        if args.ort:
            import onnxruntime as ort
            for t in (1, 2):
                options = ort.SessionOptions()
                options.intra_op_num_threads, options.inter_op_num_threads = t, 1
                sessions[(name, t)] = ort.InferenceSession(str(folder / f"{model}.onnx"), options,
                                                           providers=["CPUExecutionProvider"])
    modes = list(args.modes.split(",")) + (["ort-1t", "ort-2t"] if args.ort else [])
    reference = {}
    set_mode("1t")
    for name, (context, feed) in work.items():
        for _ in range(5):
            out = context.run(feed)
        reference[name] = [np.array(v, copy=True) for v in (out.values() if isinstance(out, dict) else out)]
    identical = {}
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        row = {}
        for mode in order:
            if not mode.startswith("ort"):
                set_mode(mode)
            for name, (context, feed) in work.items():
                if mode.startswith("ort"):
                    session = sessions[(name, int(mode[4]))]
                    call = lambda f, s=session: s.run(None, f)  # noqa: E731
                else:
                    call = context.run
                for _ in range(3):
                    out = call(feed)
                times = []
                for _ in range(args.calls):
                    start = time.perf_counter_ns()
                    out = call(feed)
                    times.append((time.perf_counter_ns() - start) / 1e3)
                row[f"{name}|{mode}"] = statistics.median(times)
                if not mode.startswith("ort"):
                    got = list(out.values()) if isinstance(out, dict) else list(out)
                    same = all(np.array_equal(np.asarray(g), w) for g, w in zip(got, reference[name]))
                    identical[f"{name}|{mode}"] = identical.get(f"{name}|{mode}", True) and same
        print(json.dumps({"round": r, "load": os.getloadavg()[0], "us": row}), flush=True)
    print(json.dumps({"identical": identical}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/pool2t")
    ap.add_argument("--workloads", default="llama@8x64,llama@4x33,bert,minilm")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--processes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ort", action="store_true")
    ap.add_argument("--tree", default=str(HERE.parents[1]), help="the kiln tree the processes run")
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        return child(args)
    rounds = []
    loads = []
    identical: dict[str, bool] = {}
    for p in range(args.processes):
        loads.append(os.getloadavg()[0])
        command = [sys.executable, str(HERE), "--child", *sys.argv[1:]]
        env = {**os.environ, "PYTHONPATH": args.tree}
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"process {p} failed:\n{done.stderr[-4000:]}")
        for line in done.stdout.splitlines():
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            if "us" in record:
                record["process"] = p
                rounds.append(record)
            elif "identical" in record:
                for k, v in record["identical"].items():
                    identical[k] = identical.get(k, True) and v
    print(f"tree {args.tree}; {args.processes} processes x {args.rounds} rounds x {args.calls} calls; 1-min load at "
          f"process starts {min(loads):.2f}-{max(loads):.2f}, at rounds' ends "
          f"{min(r['load'] for r in rounds):.2f}-{max(r['load'] for r in rounds):.2f}")
    keys = list(rounds[0]["us"])
    names = list(dict.fromkeys(k.split("|")[0] for k in keys))
    modes = list(dict.fromkeys(k.split("|")[1] for k in keys))
    print("| workload | " + " | ".join(f"{m} µs (spread)" for m in modes) +
          " | 2t-pool / 1t (rounds < 1) | 2t-omp / 1t (rounds < 1) | pool / omp (rounds < 1) | pool / pool0 (rounds < 1) | pool / poolS (rounds < 1) |")
    print("|---" * (len(modes) + 6) + "|")
    for name in names:
        cells = []
        for m in modes:
            v = [r["us"][f"{name}|{m}"] for r in rounds]
            cells.append(f"{statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})")

        def ratio(a: str, b: str) -> str:
            if f"{name}|{a}" not in rounds[0]["us"] or f"{name}|{b}" not in rounds[0]["us"]:
                return "-"
            q = [r["us"][f"{name}|{a}"] / r["us"][f"{name}|{b}"] for r in rounds]
            return f"{statistics.median(q):.3f} ({sum(x < 1 for x in q)}/{len(q)})"
        cells += [ratio("2t-pool", "1t"), ratio("2t-omp", "1t"), ratio("2t-pool", "2t-omp"), ratio("2t-pool", "2t-pool0"), ratio("2t-pool", "2t-poolS")]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("outputs bit-identical to 1 thread's:", all(identical.values()) if identical else "n/a",
          {k: v for k, v in identical.items() if not v})


if __name__ == "__main__":
    main()
