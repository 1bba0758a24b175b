"""kiln serve's own overhead: an empty model (y = Identity(x), FP32 [1, 4]) over gRPC, measured from
the server's side as CPU time per request, thread by thread, read from /proc.

    python bench/serve_overhead.py                           # this checkout, concurrency 1 and 64
    python bench/serve_overhead.py --trees /tmp/before . --rounds 3   # interleaved: A B A B A B
    python bench/serve_overhead.py --profile /tmp/serve.prof # cProfile of the server's loop thread
    python bench/serve_overhead.py --frontends 0 1 2 --rounds 3   # kiln serve --frontends N, interleaved

A `kiln serve` subprocess (one per tree and round, 127.0.0.1, free ports) serves the empty model with
dynamic batching on (no queue delay). The client is a bare grpc stub with the request serialized
once: at concurrency 1 one blocking stub call after another, at concurrency N one grpc.aio channel
with N tasks in a client subprocess, each on a channel (connection) of its own. The server's CPU time over the measured requests (utime +
stime of each of its threads, before and after) divided by their count is what kiln serve and
grpc cost per request, whatever else runs on the machine; wall-clock numbers (p50, requests/s)
are printed too but on a shared machine they move with its load. CPU time per request is the
number to compare between trees, in interleaved rounds. With --frontends the server's CPU time is its
processes' (the engine's and its front ends'), shown whole and split: the engine process, of it its
event loop thread, and the front ends together.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import _start  # noqa: E402 - bench/serve.py's server start (ports read from its log)

TICK = os.sysconf("SC_CLK_TCK")


def _write_repository(root: Path, python: str, tree: Path) -> None:
    """The empty model's engine, built by the tree under test (so its engine format matches)."""
    version = root / "empty" / "1"
    version.mkdir(parents=True)
    script = f"""
import onnx, kiln
from onnx import TensorProto, helper
g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "empty",
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])])
onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), {str(root / 'e.onnx')!r})
kiln.build({str(root / 'e.onnx')!r}).save({str(version / 'model.kiln')!r})
"""
    subprocess.run([python, "-c", script], cwd=tree, check=True, env={**os.environ, "PYTHONPATH": str(tree)})
    (root / "empty" / "config.pbtxt").write_text("max_batch_size: 64\ndynamic_batching { }\n")


def _stat(path: str) -> list[str] | None:
    """/proc's stat fields past the command name (None: gone meanwhile)."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _cpu(pid: int) -> dict[tuple[int, int], float]:
    """Seconds of CPU (user + system) per (process, thread) of a process and its children (front ends)."""
    pids = [pid] + [int(e) for e in os.listdir("/proc") if e.isdigit() and (_stat(f"/proc/{e}/stat") or [0, 0])[1]
                    == str(pid)]
    out = {}
    for p in pids:
        for task in os.listdir(f"/proc/{p}/task"):
            fields = _stat(f"/proc/{p}/task/{task}/stat")
            if fields is not None:
                out[p, int(task)] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def _request_bytes() -> bytes:
    import numpy as np
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name="empty")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(np.arange(4, dtype=np.float32).tobytes())
    return request.SerializeToString()


_CLIENT = r"""
import asyncio, sys, time, grpc
port, concurrency, seconds, payload = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), bytes.fromhex(sys.argv[4])
async def main():
    # a connection per worker (its own subchannel pool): with front-end processes, the kernel spreads connections
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(concurrency)]
    calls = [c.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=None,
                           response_deserializer=None) for c in channels]
    counts = [0]; lat = []
    stop = time.perf_counter() + seconds
    async def worker(call):
        while time.perf_counter() < stop:
            t = time.perf_counter(); await call(payload); lat.append(time.perf_counter() - t); counts[0] += 1
    for call in calls:  # warm-up: connections and first calls
        await call(payload)
    print("go", flush=True); sys.stdin.readline()
    stop = time.perf_counter() + seconds
    t0 = time.perf_counter()
    await asyncio.gather(*[worker(call) for call in calls])
    lat.sort()
    print(counts[0], time.perf_counter() - t0, lat[len(lat) // 2], lat[int(len(lat) * 0.99)], flush=True)
    for c in channels:
        await c.close()
asyncio.run(main())
"""


def _measure(process: subprocess.Popen, port: int, concurrency: int, requests: int, seconds: float,
             python: str) -> dict:
    payload = _request_bytes()
    if concurrency == 1:
        import grpc

        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        for _ in range(200):
            call(payload)
        before = _cpu(process.pid)
        latencies = []
        t0 = time.perf_counter()
        for _ in range(requests):
            t = time.perf_counter()
            call(payload)
            latencies.append(time.perf_counter() - t)
        wall = time.perf_counter() - t0
        after = _cpu(process.pid)
        channel.close()
        count = requests
        latencies.sort()
        p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]
    else:
        client = subprocess.Popen([python, "-c", _CLIENT, str(port), str(concurrency), str(seconds), payload.hex()],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert client.stdout.readline().strip() == "go"
        before = _cpu(process.pid)
        client.stdin.write("\n")
        client.stdin.flush()
        count, wall, p50, p99 = client.stdout.readline().split()
        after = _cpu(process.pid)
        client.wait(30)
        count, wall, p50, p99 = int(count), float(wall), float(p50), float(p99)
    threads = sorted(((after[t] - before.get(t, 0.0)) * 1e6 / count, t) for t in after)
    threads.reverse()
    main = next(us for us, t in threads if t == (process.pid, process.pid))
    engine = sum(us for us, (p, _) in threads if p == process.pid)
    return {"count": count, "rate": count / wall, "p50_us": p50 * 1e6, "p99_us": p99 * 1e6,
            "server_us": sum(us for us, _ in threads), "loop_us": main, "engine_us": engine,
            "frontends_us": sum(us for us, (p, _) in threads if p != process.pid),
            "others_us": [round(us) for us, t in threads if t[0] == process.pid and t[1] != process.pid and us >= 1][:4]}


def _inproc(tree: Path, repo: Path, requests: int, concurrency: list[int]) -> None:
    """kiln's own share, without grpc: the servicer's ModelInfer path (decode, validate, batch, run,
    split, encode) called on an event loop with the request already parsed; CPU time of the loop
    thread (time.thread_time) and of the whole process per request."""
    sys.path.insert(0, str(tree))
    from tritonclient.grpc import service_pb2 as pb

    from kiln.serve.core import ServerCore
    from kiln.serve.grpc_server import InferenceServicer
    from kiln.serve.repository import ModelRepository

    request = pb.ModelInferRequest.FromString(_request_bytes())

    async def run() -> None:
        core = ServerCore(ModelRepository(repo))
        await core.start()
        servicer = InferenceServicer(core)
        for c in concurrency:
            for _ in range(300):
                await servicer._infer(request)
            n = requests - requests % c
            loop0, cpu0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
            for _ in range(n // c):
                if c == 1:
                    await servicer._infer(request)
                else:
                    await asyncio.gather(*[servicer._infer(request) for _ in range(c)])
            loop1, cpu1, t1 = time.thread_time(), time.process_time(), time.perf_counter()
            print(f"| inproc {tree} | {c} | {n} | {n / (t1 - t0):.0f} | wall {(t1 - t0) / n * 1e6:.1f} us/req "
                  f"| loop thread {(loop1 - loop0) / n * 1e6:.1f} us/req | process {(cpu1 - cpu0) / n * 1e6:.1f} us/req |",
                  flush=True)
        await core.close()

    asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", default=[str(ROOT)], help="kiln checkouts to compare, interleaved")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--frontends", type=int, nargs="+", default=[0], help="kiln serve --frontends values to compare")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--requests", type=int, default=3000, help="sequential requests at concurrency 1")
    parser.add_argument("--seconds", type=float, default=3.0, help="window at higher concurrency")
    parser.add_argument("--profile", help="cProfile the server's main thread into this file (one tree)")
    parser.add_argument("--inproc", action="store_true", help="kiln's own path without grpc, in this process "
                        "(one tree)")
    args = parser.parse_args()
    if args.inproc:
        with tempfile.TemporaryDirectory(prefix="kiln-overhead-") as tmp:
            tree = Path(args.trees[0]).resolve()
            _write_repository(Path(tmp), sys.executable, tree)
            _inproc(tree, Path(tmp), args.requests, args.concurrency)
        return
    python = sys.executable
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-overhead-") as tmp:
        repos = {}
        for k, tree in enumerate(args.trees):
            repos[tree] = Path(tmp) / f"repo{k}"
            _write_repository(repos[tree], python, Path(tree).resolve())
        print("| round | tree | front ends | concurrency | requests | req/s | p50 us | p99 us | server CPU us/req "
              "| engine process | its loop thread | its other threads | front ends |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
        for r in range(args.rounds):
            for tree, frontends in [(t, n) for t in args.trees for n in args.frontends]:
                process, ports = _start(repos[tree], frontends, None, tree=Path(tree).resolve(), python=python,
                                        profile=args.profile)
                port = ports["gRPC"]
                try:
                    for c in args.concurrency:
                        m = _measure(process, port, c, args.requests, args.seconds, python)
                        rows.append(((tree, frontends), c, m))
                        print(f"| {r} | {tree} | {frontends} | {c} | {m['count']} | {m['rate']:.0f} | {m['p50_us']:.0f} "
                              f"| {m['p99_us']:.0f} | {m['server_us']:.0f} | {m['engine_us']:.0f} | {m['loop_us']:.0f} "
                              f"| {m['others_us']} | {m['frontends_us']:.0f} |", flush=True)
                finally:
                    process.terminate()
                    process.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    if args.rounds > 1:
        print("\nmedians over rounds: | tree | front ends | concurrency | req/s | p50 us | server CPU us/req "
              "| engine process us/req | its loop thread us/req | front ends us/req |")
        for tree, frontends in [(t, n) for t in args.trees for n in args.frontends]:
            for c in args.concurrency:
                ms = [m for t, cc, m in rows if t == (tree, frontends) and cc == c]
                print(f"| {tree} | {frontends} | {c} | {statistics.median(m['rate'] for m in ms):.0f} "
                      f"| {statistics.median(m['p50_us'] for m in ms):.0f} "
                      f"| {statistics.median(m['server_us'] for m in ms):.0f} "
                      f"| {statistics.median(m['engine_us'] for m in ms):.0f} "
                      f"| {statistics.median(m['loop_us'] for m in ms):.0f} "
                      f"| {statistics.median(m['frontends_us'] for m in ms):.0f} |")


if __name__ == "__main__":
    main()
