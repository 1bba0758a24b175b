"""kiln serve's own overhead: an empty model (y = Identity(x), FP32 [1, 4]) over gRPC and HTTP, measured
from the server's side as CPU time per request, thread by thread, read from /proc, and from the client's
(latency p50/p99, requests/s, the client's own CPU per request).

    python bench/serve_overhead.py --floor grpcio h2 h2-kiln # this checkout, gRPC and HTTP, raw and tritonclient
    python bench/serve_overhead.py --grpc-transports kiln grpcio --protocols grpc --clients h2 raw tritonclient \
        --floor h2 grpcio --concurrency 1 64 --rounds 3       # issue 14's c=1 overhead and c=64 rate (d: 2026-12-04)
    python bench/serve_overhead.py --trees /tmp/before . --rounds 3   # interleaved: A B A B A B
    python bench/serve_overhead.py --batching on off         # the model with and without dynamic batching
    python bench/serve_overhead.py --profile /tmp/serve.prof # cProfile of the server's loop thread
    python bench/serve_overhead.py --frontends 0 1 2 --rounds 3   # kiln serve --frontends N, interleaved
    python bench/serve_overhead.py --grpc-transports kiln grpcio --protocols grpc --rounds 3   # interleaved
    python bench/serve_overhead.py --inproc                  # kiln's path without a socket, in this process
    python bench/serve_overhead.py --trees /work/main . --grpc-options tls gzip --protocols grpc --concurrency 1
                                       # also the last tree with TLS (--grpc-use-ssl), with gzip both ways

A `kiln serve` subprocess (one per tree and round, 127.0.0.1, free ports) serves the empty model with
dynamic batching on (no queue delay) and off. Each row's load is a client subprocess
(bench/serve_overhead_client.py): raw (a bare grpc stub sending the request serialized once; hand-written
HTTP/1.1 with the binary tensor extension) or tritonclient, one blocking call after another at
concurrency 1, N clients on one event loop at N, each on a connection of its own. `--floor` adds bare
gRPC servers answering a constant: grpc.aio's (what gRPC in Python costs before kiln does anything) and
bench/serve_h2_floor.py's (HTTP/2 on uvloop's protocol callbacks, nothing decoded: what a transport of
kiln's own would start from); h2-kiln is that HTTP/2 experiment answering through kiln serve's ModelInfer
handler (decode, validate, batch, run, encode): kiln's path without grpcio. The server's
CPU time over the measured requests (utime + stime of each of its threads, before and after) divided by
their count is what kiln serve and grpc cost per request, whatever else runs on the machine; wall-clock
numbers (p50, requests/s) are printed too but on a shared machine (client and server on its cores) they
move with its load. CPU time per request is the number to compare between trees, in interleaved rounds.

The server's own overhead per request at concurrency 1 (issue 14's <= 100 us p50) is read two ways, both
printed: its CPU time per request, and "p50 over the floor", the round trip's p50 less that of the h2 floor
(HTTP/2 answering a constant, ~6 us of CPU) with the same client in the same round, which takes out the
client's own time, the loopback and the process wake-ups. With `--clients h2` (bench/serve_overhead_client.py:
frames encoded once, ~10 us of client per call) the client hardly competes with the server for the 2 cores;
with grpc's and tritonclient's Python clients (150-250 us of client CPU per call) it does, and the server's CPU
per request roughly doubles (cold caches, preemption): those rows say what users see.
With --frontends the server's CPU time is its processes' (the engine's and its front ends'), shown whole
and split: the engine process, of it its event loop thread, and the front ends together.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from serve_overhead_client import grpc_request_bytes  # noqa: E402
from tests.serve.tls_certificates import write_certificates as _write_certificates  # noqa: E402 - the gRPC tests' CA

TICK = os.sysconf("SC_CLK_TCK")


def _write_repository(root: Path, python: str, tree: Path) -> None:
    """The empty model's engine, built by the tree under test (so its engine format matches), served as "empty"
    (dynamic batching on, no queue delay) and "empty_alone" (no dynamic batching: each request its own call)."""
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
    alone = root / "empty_alone" / "1"
    alone.mkdir(parents=True)
    shutil.copy(version / "model.kiln", alone / "model.kiln")
    (root / "empty_alone" / "config.pbtxt").write_text("max_batch_size: 64\n")


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


_FLOOR = r"""
import grpc, uvloop
from tritonclient.grpc import service_pb2 as pb
answer = pb.ModelInferResponse(model_name="empty", model_version="1")
answer.outputs.add(name="y", datatype="FP32", shape=[1, 4])
answer.raw_output_contents.append(bytes(16))
answer = answer.SerializeToString()
async def infer(request, context):
    return answer
async def main():
    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(infer)  # no (de)serializers: bytes in, bytes out
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService", {"ModelInfer": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"kiln serve: gRPC on 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()
uvloop.run(main())
"""


FLOORS = {"grpcio": ["-c", _FLOOR], "h2": [str(ROOT / "bench" / "serve_h2_floor.py")],
          "h2-kiln": [str(ROOT / "bench" / "serve_h2_floor.py"), "--repository"]}


def _start_floor(python: str, kind: str, repository: Path) -> tuple[subprocess.Popen, dict[str, int]]:
    """A floor: a bare gRPC server (uvloop, as kiln serve's) answering every ModelInfer with the same serialized
    response, nothing decoded or run: grpc.aio's, or bench/serve_h2_floor.py's HTTP/2 on uvloop's callbacks; or
    (h2-kiln) that HTTP/2 answering through kiln serve's ModelInfer handler (this checkout's) over `repository`."""
    command = [python, *FLOORS[kind]] + ([str(repository)] if kind == "h2-kiln" else [])
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    return process, {"gRPC": int(process.stdout.readline().rsplit(":", 1)[1])}


# --grpc-options: kiln serve's flags for each, and the client's environment (bench/serve_overhead_client.py)
def _grpc_options(variant: str, certs: Path) -> tuple[tuple[str, ...], dict[str, str]]:
    if variant == "tls":
        return (("--grpc-use-ssl", "--grpc-server-cert", str(certs / "server.crt"), "--grpc-server-key",
                 str(certs / "server.key")), {"KILN_BENCH_GRPC_ROOT_CERT": str(certs / "ca.crt")})
    if variant == "gzip":  # requests gzip-compressed by the client, answers by the server (level low: gzip)
        return ("--grpc-infer-response-compression-level", "low"), {"KILN_BENCH_GRPC_COMPRESSION": "gzip"}
    return (), {}


def _measure(process: subprocess.Popen, port: int, protocol: str, client: str, model: str, concurrency: int,
             seconds: float, python: str, env: dict[str, str] | None = None) -> dict:
    """One row: the client process warms up, the server's threads' CPU time is read around its window."""
    load = subprocess.Popen([python, str(ROOT / "bench" / "serve_overhead_client.py"), protocol, client, str(port),
                             model, str(concurrency), str(seconds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})})
    if load.stdout.readline().strip() != "go":
        load.kill()
        raise RuntimeError(f"the {protocol} {client} client did not start")
    before = _cpu(process.pid)
    load.stdin.write("\n")
    load.stdin.flush()
    result = json.loads(load.stdout.readline())
    after = _cpu(process.pid)
    load.wait(30)
    count = result["requests"]
    threads = sorted(((after[t] - before.get(t, 0.0)) * 1e6 / count, t) for t in after)
    threads.reverse()
    main = next(us for us, t in threads if t == (process.pid, process.pid))
    engine = sum(us for us, (p, _) in threads if p == process.pid)
    return {"count": count, "rate": count / result["wall_s"], "p50_us": result["p50_s"] * 1e6,
            "p99_us": result["p99_s"] * 1e6, "client_us": result["client_cpu_s"] * 1e6 / count,
            "server_us": sum(us for us, _ in threads), "loop_us": main, "engine_us": engine,
            "frontends_us": sum(us for us, (p, _) in threads if p != process.pid),
            "others_us": [round(us) for us, t in threads if t[0] == process.pid and t[1] != process.pid and us >= 1][:4]}


class _Transport:
    """What a GrpcConnection driven by hand writes to (no socket): the bytes kept until read, answers counted."""

    def __init__(self):
        self.out: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def close(self) -> None:
        pass

    def answers(self) -> int:
        count = sum(chunk.count(b"grpc-status") for chunk in self.out)
        self.out.clear()
        return count


def _call_frames(stream: int, message: bytes) -> bytes:
    """A ModelInfer call's HEADERS (literals that touch no HPACK table) and DATA (END_STREAM), as the h2 client's."""
    from kiln.serve.h2_frames import DATA, END_HEADERS, END_STREAM, HEADERS, frame, literal

    block = (b"\x83\x86" + literal(b":path", b"/inference.GRPCInferenceService/ModelInfer") +
             literal(b":authority", b"bench") + literal(b"content-type", b"application/grpc") +
             literal(b"te", b"trailers"))
    return frame(HEADERS, END_HEADERS, stream, block) + frame(DATA, END_STREAM, stream,
                                                              b"\x00" + len(message).to_bytes(4, "big") + message)


def _inproc(tree: Path, repo: Path, requests: int, concurrency: list[int], model: str) -> None:
    """kiln's own share, without a socket, on kiln serve's event loop, CPU time of the loop thread
    (time.thread_time) and of the whole process per request. "handler": the ModelInfer handler as kiln serve
    registers it (the request's deserializer, the handler, the response's serializer) called with the request's
    bytes. "transport": kiln's gRPC transport (a GrpcConnection fed the calls' HTTP/2 frames, C calls per read, its
    writes kept in memory) with that handler behind it: everything of a request but the socket and epoll. At
    concurrency 1 the loop turns once between requests, as a server's does between reads."""
    sys.path.insert(0, str(tree))
    from kiln.serve.core import ServerCore
    from kiln.serve.grpc_h2 import GrpcServer
    from kiln.serve.grpc_server import SERVICE, InferenceServicer, method_handlers
    from kiln.serve.h2_frames import PREFACE, SETTINGS, WINDOW_UPDATE, frame
    from kiln.serve.repository import ModelRepository
    from kiln.serve.server import run as run_on_serve_loop

    data = grpc_request_bytes(model)

    async def run() -> None:
        core = ServerCore(ModelRepository(repo))
        await core.start()
        handlers = method_handlers(InferenceServicer(core))  # what both transports serve
        handler = handlers["ModelInfer"]
        parse, infer, serialize = handler.request_deserializer, handler.unary_unary, handler.response_serializer
        connection = GrpcServer(SERVICE, handlers, 1 << 26)._connection()
        transport = _Transport()
        connection.connection_made(transport)
        connection.data_received(PREFACE + frame(SETTINGS, 0, 0))
        stream = 1

        async def one() -> bytes:
            return serialize(await infer(parse(data), None))

        async def by_transport(c: int) -> None:
            nonlocal stream
            window = frame(WINDOW_UPDATE, 0, 0, (1 << 12).to_bytes(4, "big"))  # the answers' bytes given back
            connection.data_received(b"".join(_call_frames(stream + 2 * k, data) for k in range(c)) + window)
            stream += 2 * c
            answered = transport.answers()
            while answered < c:
                await asyncio.sleep(0)
                answered += transport.answers()

        async def by_handler(c: int) -> None:
            if c == 1:
                await one()
            else:
                await asyncio.gather(*[one() for _ in range(c)])

        for c in concurrency:
            for path, step in (("handler", by_handler), ("transport", by_transport)):
                for _ in range(300 // c + 20):
                    await step(c)
                    await asyncio.sleep(0)
                n = requests - requests % c
                loop0, cpu0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
                for _ in range(n // c):
                    await step(c)
                    await asyncio.sleep(0)
                loop1, cpu1, t1 = time.thread_time(), time.process_time(), time.perf_counter()
                print(f"| inproc {tree} | {path} | {model} | {c} | {n} | {n / (t1 - t0):.0f} "
                      f"| wall {(t1 - t0) / n * 1e6:.1f} us/req | loop thread {(loop1 - loop0) / n * 1e6:.1f} us/req "
                      f"| process {(cpu1 - cpu0) / n * 1e6:.1f} us/req |", flush=True)
        await core.close()

    run_on_serve_loop(run())


MODELS = {"on": "empty", "off": "empty_alone"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", default=[str(ROOT)], help="kiln checkouts to compare, interleaved")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--frontends", type=int, nargs="+", default=[0], help="kiln serve --frontends values to compare")
    parser.add_argument("--grpc-transports", nargs="+", default=[None], choices=["kiln", "grpcio"],
                        help="kiln serve --grpc-transport values to compare (default: the tree's default)")
    parser.add_argument("--protocols", nargs="+", default=["grpc", "http"], choices=["grpc", "http"])
    parser.add_argument("--clients", nargs="+", default=["raw", "tritonclient"], choices=["raw", "h2", "tritonclient"])
    parser.add_argument("--batching", nargs="+", default=["on"], choices=list(MODELS),
                        help="the model's dynamic batching (off: each request its own engine call)")
    parser.add_argument("--floor", nargs="*", default=[], choices=list(FLOORS),
                        help="also bare gRPC servers answering a constant: grpcio (grpc.aio: what gRPC in Python costs "
                        "before kiln does anything), h2 (bench/serve_h2_floor.py: HTTP/2 on uvloop's callbacks); "
                        "h2-kiln: that HTTP/2 answering through kiln serve's ModelInfer handler")
    parser.add_argument("--grpc-options", nargs="*", default=[], choices=["tls", "gzip"],
                        help="also the last tree's server with these gRPC options (gRPC rows only): tls "
                        "(--grpc-use-ssl, a CA made here), gzip (requests and answers gzip-compressed)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--seconds", type=float, default=3.0, help="each row's window")
    parser.add_argument("--requests", type=int, default=3000, help="--inproc: requests per concurrency")
    parser.add_argument("--profile", help="cProfile the server's main thread into this file (one tree)")
    parser.add_argument("--inproc", action="store_true", help="kiln's own path without a socket, in this process: "
                        "the ModelInfer handler alone, then kiln's gRPC transport fed the calls' frames (one tree)")
    args = parser.parse_args()
    if args.inproc:
        with tempfile.TemporaryDirectory(prefix="kiln-overhead-") as tmp:
            tree = Path(args.trees[0]).resolve()
            _write_repository(Path(tmp), sys.executable, tree)
            print(f"CPU: {_cpu_model()}; load average before: {os.getloadavg()[0]:.2f}", flush=True)
            for batching in args.batching:
                _inproc(tree, Path(tmp), args.requests, args.concurrency, MODELS[batching])
        return
    python = sys.executable
    servers = [(t, n, g, "") for t in args.trees for n in args.frontends for g in args.grpc_transports] + \
        [(args.trees[-1], 0, g, variant) for variant in args.grpc_options for g in args.grpc_transports] + \
        [(f"floor {kind}", 0, None, "") for kind in args.floor]
    loads = [(p, c, b) for p in args.protocols for c in args.clients for b in args.batching]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-overhead-") as tmp:
        repos = {}
        certs = Path(tmp) / "certs"
        if "tls" in args.grpc_options:
            certs.mkdir()
            _write_certificates(certs)
        for k, tree in enumerate(args.trees):
            repos[tree] = Path(tmp) / f"repo{k}"
            _write_repository(repos[tree], python, Path(tree).resolve())
        print(f"CPU: {_cpu_model()}; load average before: {os.getloadavg()[0]:.2f}", flush=True)
        print("| round | server | front ends | protocol | client | batching | concurrency | requests | req/s | p50 us "
              "| p99 us | server CPU us/req | engine process | its loop thread | its other threads | front ends "
              "| client CPU us/req |\n" + "|---" * 17 + "|", flush=True)
        for r in range(args.rounds):
            for tree, frontends, transport, variant in servers:
                flags, env = _grpc_options(variant, certs)
                if tree.startswith("floor "):
                    process, ports = _start_floor(python, tree.split()[1], repos[args.trees[0]])
                else:
                    process, ports = _start(repos[tree], frontends, None, tree=Path(tree).resolve(), python=python,
                                            profile=args.profile, grpc_transport=transport, extra=flags)
                try:
                    for protocol, client, batching in loads:
                        if tree.startswith("floor ") and (protocol != "grpc" or batching != "on"
                                                          and tree != "floor h2-kiln"):
                            continue
                        if variant and protocol != "grpc":
                            continue
                        for c in args.concurrency:
                            if client == "h2" and (c != 1 or protocol != "grpc" or variant):
                                continue  # bench/serve_overhead_client.py's h2: plain gRPC at concurrency 1 only
                            m = _measure(process, ports["gRPC" if protocol == "grpc" else "HTTP"], protocol, client,
                                         MODELS[batching], c, args.seconds, python, env)
                            name = tree if transport is None else f"{tree} (gRPC transport {transport})"
                            name += f", {variant}" if variant else ""
                            key = (name, frontends, protocol, client, batching, c)
                            m["round"] = r
                            rows.append((key, m))
                            print(f"| {r} | {name} | {frontends} | {protocol} | {client} | {batching} | {c} "
                                  f"| {m['count']} | {m['rate']:.0f} | {m['p50_us']:.0f} | {m['p99_us']:.0f} "
                                  f"| {m['server_us']:.0f} | {m['engine_us']:.0f} | {m['loop_us']:.0f} "
                                  f"| {m['others_us']} | {m['frontends_us']:.0f} | {m['client_us']:.0f} |", flush=True)
                finally:
                    process.terminate()
                    process.wait(30)
        print(f"load average after: {os.getloadavg()[0]:.2f}", flush=True)
        shutil.rmtree(tmp, ignore_errors=True)
    if args.rounds > 1:
        print("\nmedians over rounds (CPU per request: least of rounds in brackets; p50 over the floor: the median "
              "over rounds of p50 minus the h2 floor's p50 with the same client and concurrency in the same round)\n"
              "| server | front ends | protocol | client | batching | concurrency | req/s | p50 us | p50 over the floor us "
              "| p99 us | server CPU us/req | its loop thread | client CPU us/req |\n" + "|---" * 13 + "|")
        for key in dict.fromkeys(k for k, _ in rows):
            ms = [m for k, m in rows if k == key]
            med = {f: statistics.median(m[f] for m in ms) for f in ms[0] if f != "others_us"}
            low = {f: min(m[f] for m in ms) for f in ("server_us", "loop_us", "client_us")}
            tree, frontends, protocol, client, batching, c = key
            print(f"| {tree} | {frontends} | {protocol} | {client} | {batching} | {c} | {med['rate']:.0f} "
                  f"| {med['p50_us']:.0f} | {_over_floor(rows, key)} | {med['p99_us']:.0f} "
                  f"| {med['server_us']:.0f} ({low['server_us']:.0f}) "
                  f"| {med['loop_us']:.0f} ({low['loop_us']:.0f}) | {med['client_us']:.0f} ({low['client_us']:.0f}) |")


def _over_floor(rows: list, key: tuple) -> str:
    """The server's own share of the round trip: the row's p50 less the h2 floor's (bench/serve_h2_floor.py, an
    HTTP/2 server answering a constant for ~6 us of CPU: the client, the loopback and the wake-ups) with the same
    client and concurrency, round by round; the median over rounds. "-": no floor measured beside it."""
    _, _, protocol, client, _, c = key
    floor = {m["round"]: m["p50_us"] for k, m in rows
             if k[0] == "floor h2" and k[2:4] == (protocol, client) and k[5] == c}
    over = [m["p50_us"] - floor[m["round"]] for k, m in rows if k == key and m["round"] in floor]
    return f"{statistics.median(over):.0f}" if over and key[0] != "floor h2" else "-"


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    return f"{names[0]} x {len(names)}" if names else "unknown"


if __name__ == "__main__":
    main()
