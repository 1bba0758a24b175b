"""kiln serve's own CPU for one gRPC ModelInfer at concurrency 1, without a socket, old tree against new: each round
runs every tree in a fresh process of its own, in turn (A, B, A, B, ...), and each process feeds kiln's HTTP/2
transport (a GrpcConnection over an in-memory transport, as bench/serve_overhead.py --inproc does) one call's frames
at a time, the empty model (y = Identity(x), FP32 [1, 4], batching on) answered inline, the loop turning once
between calls. Prints the loop thread's CPU us per request per round (the median of its 5 windows), then the
medians per tree and the per-round ratios against the first tree.

    python bench/serve_c1_inproc_ab.py --trees /tmp/base . --rounds 7 --requests 3000
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import asyncio, statistics, sys, tempfile, time
from pathlib import Path
tree = Path(sys.argv[1]); sys.path.insert(0, str(tree)); sys.path.insert(0, str(tree / "bench"))
import serve_overhead as so
from kiln.serve.core import ServerCore
from kiln.serve.grpc_h2 import GrpcServer
from kiln.serve.grpc_server import SERVICE, InferenceServicer, method_handlers
from kiln.serve.h2_frames import PREFACE, SETTINGS, WINDOW_UPDATE, frame
from kiln.serve.repository import ModelRepository
from kiln.serve.server import run

N = int(sys.argv[2])
repo = Path(tempfile.mkdtemp())
so._write_repository(repo, sys.executable, tree)
data = so.grpc_request_bytes("empty")
calls = [so._call_frames(1 + 2 * k, data) for k in range(6 * N + 600)]  # made before the clock runs

async def main():
    core = ServerCore(ModelRepository(repo))
    await core.start()
    conn = GrpcServer(SERVICE, method_handlers(InferenceServicer(core)), 1 << 26)._connection()
    out = so._Transport()
    conn.connection_made(out)
    conn.data_received(PREFACE + frame(SETTINGS, 0, 0))
    window = frame(WINDOW_UPDATE, 0, 0, (1 << 12).to_bytes(4, "big"))
    it = iter(calls)
    async def step():
        conn.data_received(next(it) + window)
        answered = out.answers()
        while answered < 1:
            await asyncio.sleep(0)
            answered += out.answers()
    for _ in range(500):
        await step(); await asyncio.sleep(0)
    windows = []
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(N):
            await step(); await asyncio.sleep(0)
        windows.append((time.thread_time() - t0) / N * 1e6)
    print(statistics.median(windows))
    await core.close()

run(main())
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=3000, help="requests per window (5 windows a process)")
    args = parser.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"CPU: {cpu} x {os.cpu_count()}")
    by_tree: dict[str, list[float]] = {t: [] for t in args.trees}
    for r in range(args.rounds):
        for tree in args.trees:
            load = open("/proc/loadavg").read().split()[0]
            path = str(Path(tree).resolve())
            done = subprocess.run([sys.executable, "-c", CHILD, path, str(args.requests)], capture_output=True,
                                  text=True, cwd=path, env={**os.environ, "PYTHONPATH": path})
            if done.returncode:
                sys.exit(f"{tree}: {done.stderr[-2000:]}")
            value = float(done.stdout.split()[-1])
            by_tree[tree].append(value)
            print(f"| {r} | {tree} | {value:.1f} us/req | load {load} |", flush=True)
    base = args.trees[0]
    print("\n| tree | rounds | median loop CPU us/req | median ratio to the first tree |\n|---|---|---|---|")
    for tree, values in by_tree.items():
        ratios = [v / b for v, b in zip(values, by_tree[base])]
        print(f"| {tree} | {len(values)} | {statistics.median(values):.1f} | {statistics.median(ratios):.3f} |")


if __name__ == "__main__":
    main()
