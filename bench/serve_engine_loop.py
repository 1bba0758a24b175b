"""The engine process's own work per request under `kiln serve --frontends N`: its event loop's CPU time
to take a front end's infer calls off the socket, validate and batch them, run them and send the answers.

    python bench/serve_engine_loop.py                                   # this checkout
    python bench/serve_engine_loop.py --trees /tmp/before . --rounds 5  # interleaved: A B A B ...

No sockets and no front-end processes: a FrontendPool (kiln/serve/frontends.py) of the tree under test gets
one front end whose connection's transport only counts what is written, and `--group` infer calls for an
empty model (y = Identity(x), FP32 [1, 4], dynamic batching, max batch 64) arrive in one read, framed as that
tree's front end frames them; the loop runs until every one is answered. The number is the loop thread's
CPU time (time.thread_time) per request over many such reads: what the engine's one loop spends on a
request whatever else runs on the machine, so trees compare on a loaded one. Each tree runs in its own
subprocess, in rounds, interleaved.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_overhead import _write_repository  # noqa: E402 - the same empty model, built by the tree under test

_CHILD = r"""
import asyncio, os, sys, time
import numpy as np
from kiln.serve import ipc
from kiln.serve.core import InferRequest, ServerCore
from kiln.serve.frontends import Frontend, FrontendPool
from kiln.serve.metrics import MetricsExporter
from kiln.serve.options import ServeOptions
from kiln.serve.repository import ModelRepository

repo, group, reads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

class Transport:
    def __init__(self): self.bytes = 0
    def writelines(self, parts): self.bytes += sum(len(p) for p in parts)
    def write(self, data): self.bytes += len(data)
    def is_closing(self): return False
    def close(self): pass

def frames(messages) -> bytes:
    # as this tree's front end writes a loop turn's calls: in runs (encode_all) where it has them
    if hasattr(ipc, "encode_all"):
        return b"".join(bytes(p) for p in ipc.encode_all(messages))
    return b"".join(bytes(p) for m in messages for p in ipc.encode(m))

async def main():
    core = ServerCore(ModelRepository(repo))
    await core.start()
    pool = FrontendPool(core, MetricsExporter(list), ServeOptions(repository=repo))
    connection = pool._new_connection()
    connection.connection_made(Transport())
    frontend = Frontend(0, None)
    frontend.connection = connection
    pool._linked[connection] = frontend
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    stream = frames([ipc.InferCall(k, InferRequest("empty", "", "", {"x": x})) for k in range(group)])

    async def one_read():
        target = frontend.answered + group
        connection.data_received(stream)
        while frontend.answered < target:
            await asyncio.sleep(0)
        await asyncio.sleep(0)  # the answers' flush

    for _ in range(50):  # warm-up: the instance goes inline after its first calls, as it does serving
        await one_read()
    cpu = time.thread_time()
    for _ in range(reads):
        await one_read()
    print((time.thread_time() - cpu) / (reads * group) * 1e6)
    await core.close()

asyncio.run(main())
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", default=[str(ROOT)], help="kiln checkouts to compare, interleaved")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--group", type=int, nargs="+", default=[1, 16, 64], help="infer calls per socket read")
    parser.add_argument("--requests", type=int, default=20000, help="requests per measurement")
    args = parser.parse_args()
    python = sys.executable
    results: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="kiln-engine-loop-") as tmp:
        repos = {}
        for k, tree in enumerate(args.trees):
            repos[tree] = Path(tmp) / f"repo{k}"
            _write_repository(repos[tree], python, Path(tree).resolve())
        print("| round | tree | calls per read | engine loop CPU us/request |\n|---|---|---|---|", flush=True)
        for r in range(args.rounds):
            for tree in args.trees:
                for group in args.group:
                    reads = max(1, args.requests // group)
                    out = subprocess.run([python, "-c", _CHILD, str(repos[tree]), str(group), str(reads)],
                                         cwd=tree, check=True, capture_output=True, text=True,
                                         env={**os.environ, "PYTHONPATH": str(Path(tree).resolve())})
                    us = float(out.stdout.split()[-1])
                    results.setdefault((tree, group), []).append(us)
                    print(f"| {r} | {tree} | {group} | {us:.1f} |", flush=True)
    print("\nmedians: | tree | calls per read | engine loop CPU us/request (min..max) |\n|---|---|---|")
    for (tree, group), values in results.items():
        print(f"| {tree} | {group} | {statistics.median(values):.1f} ({min(values):.1f}..{max(values):.1f}) |")


if __name__ == "__main__":
    main()
