"""The engine process's own work per request under `kiln serve --frontends N`: its event loop's CPU time
to take a front end's infer calls off the socket, validate and batch them, run them and send the answers.

    python bench/serve_engine_loop.py                                   # this checkout
    python bench/serve_engine_loop.py --trees /tmp/before . --rounds 5  # interleaved: A B A B ...
    python bench/serve_engine_loop.py --model image --group 1 16         # 301 KB images through a staging arena

No sockets and no front-end processes: a FrontendPool (kiln/serve/frontends.py) of the tree under test gets
one front end whose connection's transport only counts what is written, and `--group` infer calls arrive in
one read, framed as that tree's front end frames them; the loop runs until every one is answered. Models
(dynamic batching, max batch 64): "empty", y = Identity(x), FP32 [1, 4]; "image", y = x[:, :, 0, 0] with x
FP16 [1, 3, 224, 224] (MobileNetV2's request), its tensors in the front end's staging arena as `kiln serve
--frontends N` sends them (kiln/serve/staging.py), its engine calls on the instance's thread as a CUDA
instance's are. The numbers are the loop thread's CPU time (time.thread_time) per request over many such
reads, and the whole process's (loop, instance thread): what the engine spends on a request whatever else
runs on the machine, so trees compare on a loaded one. Each tree runs in its own subprocess, in rounds,
interleaved. (Since 2026-12-03 a read waits for its answers on an event; before, it polled the loop, whose turns
counted too: numbers from before then, e.g. bench/results/serve-batching-cpu-2026-12-02.md, are higher.)
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
from serve_frontend_cost import _MODEL  # noqa: E402 - the same empty and image models, built by the tree under test

_CHILD = r"""
import asyncio, os, sys, time
import numpy as np
from kiln.serve import ipc
from kiln.serve.core import InferRequest, ServerCore
from kiln.serve.frontends import Frontend, FrontendPool
from kiln.serve.metrics import MetricsExporter
from kiln.serve.options import ServeOptions
from kiln.serve.repository import ModelRepository

repo, model, group, reads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if model == "image":  # engine calls on the instance's thread, as on CUDA (a CPU instance runs tiny ones inline)
    from kiln.serve import instances
    instances.INLINE_NS = 0

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
    if model == "empty":
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        stream = frames([ipc.InferCall(k, InferRequest(model, "", "", {"x": x})) for k in range(group)])
    else:  # the calls' images in a staging arena, at the offsets a front end puts them (each read the same)
        from kiln.serve.staging import StagingArena, StagingView
        x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float16)
        arena = StagingArena(64 << 20)
        connection.staging = StagingView(arena.key, arena.byte_size)
        arena.unlink()
        stream = frames([ipc.InferCall(k, InferRequest(model, "", "", {"x": arena.put(k, x)})) for k in range(group)])

    waiting = []  # (answers to wait for, event) of the read in progress
    sent = pool._reply

    def reply(to, answer):  # wakes one_read at its last answer (no polling: the loop sleeps while instances run)
        sent(to, answer)
        if waiting and to.answered >= waiting[0][0]:
            waiting.pop()[1].set()

    pool._reply = reply

    async def one_read():
        answered = asyncio.Event()
        waiting.append((frontend.answered + group, answered))
        connection.data_received(stream)
        await answered.wait()
        await asyncio.sleep(0)  # the answers' flush

    for _ in range(50):  # warm-up: the instance goes inline after its first calls, as it does serving
        await one_read()
    cpu, whole = time.thread_time(), time.process_time()
    for _ in range(reads):
        await one_read()
    n = reads * group
    print((time.thread_time() - cpu) / n * 1e6, (time.process_time() - whole) / n * 1e6)
    await core.close()

asyncio.run(main())
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", default=[str(ROOT)], help="kiln checkouts to compare, interleaved")
    parser.add_argument("--model", default="empty", choices=["empty", "image"])
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
            folder = repos[tree] / args.model
            (folder / "1").mkdir(parents=True)
            subprocess.run([python, "-c", _MODEL, args.model, str(folder)], cwd=tree, check=True,
                           env={**os.environ, "PYTHONPATH": str(Path(tree).resolve())})
            (folder / "config.pbtxt").write_text("max_batch_size: 64\ndynamic_batching { }\n")
        print("| round | tree | calls per read | engine loop CPU us/request | engine process |\n|---|---|---|---|---|",
              flush=True)
        for r in range(args.rounds):
            for tree in args.trees:
                for group in args.group:
                    reads = max(1, args.requests // group)
                    out = subprocess.run([python, "-c", _CHILD, str(repos[tree]), args.model, str(group), str(reads)],
                                         cwd=tree, check=True, capture_output=True, text=True,
                                         env={**os.environ, "PYTHONPATH": str(Path(tree).resolve())})
                    loop_us, process_us = map(float, out.stdout.split()[-2:])
                    results.setdefault((tree, group), []).append((loop_us, process_us))
                    print(f"| {r} | {tree} | {group} | {loop_us:.1f} | {process_us:.1f} |", flush=True)
    print("\nmedians: | tree | calls per read | engine loop CPU us/request (min..max) | engine process |\n|---|---|---|---|")
    for (tree, group), values in results.items():
        loops, processes = [v[0] for v in values], [v[1] for v in values]
        print(f"| {tree} | {group} | {statistics.median(loops):.1f} ({min(loops):.1f}..{max(loops):.1f}) "
              f"| {statistics.median(processes):.1f} ({min(processes):.1f}..{max(processes):.1f}) |")


if __name__ == "__main__":
    main()
