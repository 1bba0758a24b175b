"""kiln serve's own CPU for one gRPC ModelInfer at concurrency 1, without a socket, old tree against new: each round
runs every tree in a fresh process of its own, in turn (A, B, A, B, ...), and each process feeds kiln's HTTP/2
transport (a GrpcConnection over an in-memory transport, as bench/serve_overhead.py --inproc does) one call's frames
at a time, the empty model (y = Identity(x), FP32 [1, 4], batching on) answered inline, the loop turning once
between calls. Prints the loop thread's CPU us per request per round (the median of its 5 windows), then the
medians per tree and the per-round ratios against the first tree.

    python bench/serve_c1_inproc_ab.py --trees /tmp/base . --rounds 7 --requests 3000

--protocol http: the same for a KServe v2 HTTP infer: the HTTP/1.1 protocol kiln serve runs (kiln's InferProtocol,
kiln/serve/http_protocol.py, where the tree has it; else uvicorn's httptools protocol, the infer fast path ahead of
FastAPI) over an in-memory transport, fed one request's bytes at a time, each with fresh
tensor bytes (made before the clock runs). --body binary: tritonclient.http's body (binary tensor extension,
generate_request_body, output y as binary); json: the tensors as JSON lists, as its binary_data=False.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

# both children's close: 5 windows of N steps, the loop thread's CPU us a request (their median) printed last
WINDOWS = r'''    windows = []
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(N):
            await step(); await asyncio.sleep(0)
        windows.append((time.thread_time() - t0) / N * 1e6)
    print(statistics.median(windows))
    await core.close()

run(main())
'''

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
''' + WINDOWS

CHILD_HTTP = r'''
import asyncio, json, statistics, sys, tempfile, time, zlib
from pathlib import Path
import numpy as np
tree = Path(sys.argv[1]); sys.path.insert(0, str(tree)); sys.path.insert(0, str(tree / "bench"))
import serve_overhead as so
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState
from kiln.serve.core import ServerCore
from kiln.serve.http_fast import InferFastPath
from kiln.serve.http_server import http_app
from kiln.serve.metrics import MetricsExporter
from kiln.serve.repository import ModelRepository
from kiln.serve.server import run

N, BODY = int(sys.argv[2]), sys.argv[3]
repo = Path(tempfile.mkdtemp())
so._write_repository(repo, sys.executable, tree)
rng = np.random.default_rng(14)

def request(x):
    if BODY == "binary":  # tritonclient.http's generate_request_body, binary in and out
        header = b'{"inputs":[{"name":"x","shape":[1,4],"datatype":"FP32","parameters":{"binary_data_size":16}}],' \
                 b'"outputs":[{"name":"y","parameters":{"binary_data":true}}]}'
        body, extra = header + x.tobytes(), f"Inference-Header-Content-Length: {len(header)}\r\n"
    else:
        body, extra = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                                              "data": x.reshape(-1).tolist()}],
                                  "outputs": [{"name": "y", "parameters": {"binary_data": False}}]}).encode(), ""
    return (f"POST /v2/models/empty/infer HTTP/1.1\r\nHost: bench\r\nContent-Type: application/octet-stream\r\n"
            f"{extra}Content-Length: {len(body)}\r\n\r\n").encode() + body

requests = [request(rng.standard_normal((1, 4)).astype(np.float32)) for _ in range(5 * N + 500)]

class Transport:
    def __init__(self):
        self.out = []
    def write(self, data):
        self.out.append(bytes(data))
    def writelines(self, parts):
        self.out.append(b"".join(parts))
    def is_closing(self):
        return False
    def close(self):
        pass
    def get_extra_info(self, key, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5555)}.get(key, default)
    def pause_reading(self):
        pass
    def resume_reading(self):
        pass

async def main():
    core = ServerCore(ModelRepository(repo))
    await core.start()
    app = InferFastPath(http_app(core, MetricsExporter(core)), core, 64 << 20)
    config = uvicorn.Config(app, access_log=False, lifespan="off", proxy_headers=False, http="httptools")
    config.load()
    try:  # kiln's own HTTP/1.1 protocol where the tree has it (h-http2), else uvicorn's as kiln serve ran it
        from kiln.serve.http_protocol import InferProtocol
        protocol = InferProtocol(config, ServerState(), {}, fast=app)
    except ImportError:
        protocol = HttpToolsProtocol(config, ServerState(), {})
    out = Transport()
    protocol.connection_made(out)
    it = iter(requests)
    bodies = []  # the warm-up's answers' bodies (past the head, whose Date moves): compared between trees
    async def step():
        protocol.data_received(next(it))
        while not out.out:
            await asyncio.sleep(0)
        if not out.out[0].startswith(b"HTTP/1.1 200"):
            raise SystemExit(out.out[0][:300])
        if len(bodies) < 500:
            bodies.append(b"".join(out.out).partition(b"\r\n\r\n")[2])
        out.out.clear()
    for _ in range(500):
        await step(); await asyncio.sleep(0)
    print("answers", zlib.crc32(b"".join(bodies)))
''' + WINDOWS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=3000, help="requests per window (5 windows a process)")
    parser.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    parser.add_argument("--body", choices=["binary", "json"], default="binary", help="--protocol http: the body")
    args = parser.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    body = f", {args.body} body" if args.protocol == "http" else ""
    print(f"CPU: {cpu} x {os.cpu_count()}; {args.protocol}{body}")
    by_tree: dict[str, list[float]] = {t: [] for t in args.trees}
    answers: set[str] = set()
    for r in range(args.rounds):
        for tree in args.trees:
            load = open("/proc/loadavg").read().split()[0]
            path = str(Path(tree).resolve())
            child = [CHILD, path, str(args.requests)] if args.protocol == "grpc" else \
                [CHILD_HTTP, path, str(args.requests), args.body]
            done = subprocess.run([sys.executable, "-c", *child], capture_output=True,
                                  text=True, cwd=path, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                      [path, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]).rstrip(os.pathsep)})
            if done.returncode:
                sys.exit(f"{tree}: {done.stderr[-2000:]}")
            value = float(done.stdout.split()[-1])
            if "answers" in done.stdout:  # http: the first 500 answers' bodies, the same in every tree
                answers.add(done.stdout.split("answers")[1].split()[0])
            by_tree[tree].append(value)
            print(f"| {r} | {tree} | {value:.1f} us/req | load {load} |", flush=True)
    base = args.trees[0]
    if answers:
        same = "the same in every process" if len(answers) == 1 else answers
        print(f"answers' bodies (crc32 of 500 a process): {same}")
    print("\n| tree | rounds | median loop CPU us/req | median ratio to the first tree |\n|---|---|---|---|")
    for tree, values in by_tree.items():
        ratios = [v / b for v, b in zip(values, by_tree[base])]
        print(f"| {tree} | {len(values)} | {statistics.median(values):.1f} | {statistics.median(ratios):.3f} |")


if __name__ == "__main__":
    main()
