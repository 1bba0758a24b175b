"""Where a request's time goes in `kiln serve --frontends N`, with engines that cost ~nothing.

    python bench/serve_frontend_cost.py                      # empty + image models, 0 1 2 front ends, both protocols
    python bench/serve_frontend_cost.py --profile 4           # + py-spy per process: CPU us/request per stage
    python bench/serve_frontend_cost.py --models image --frontends 4 --clients raw triton --processes 4

Models: "empty" is y = Identity(x), FP32 [1, 4] (16 bytes each way: per-request overhead alone);
"image" is y = x[:, :, 0, 0], x FP16 [1, 3, 224, 224] (MobileNetV2's request on the wire, 301 KB in,
6 bytes out), so the front ends move the bytes the H200 run moved while the engine costs ~nothing.

Clients (each in its own process(es), closed loop, one connection per concurrent worker):
- raw: the request serialized once, sent as bytes (gRPC: a bare grpc.aio unary call; HTTP: asyncio streams,
  keep-alive, binary tensor extension) and the answer checked for status only: a client as cheap as a client gets,
  so the server is the limit where the machine has room;
- triton: tritonclient.grpc.aio / tritonclient.http.aio (binary), as bench/serve.py and kiln perf drive the server.
Per row: requests/s, p50, the server's CPU us per request (/proc: the engine process, its front ends) and the
client's CPU us per request (its own getrusage), so a row says which side ran out first. On a 2-core VM every
process shares both cores: requests/s is what the whole machine reaches; the CPU columns are what each side costs.

--profile S: py-spy samples every server process (250 Hz, non-blocking) for S seconds of a raw client's window and sorts
each sample into the stage its innermost known frame belongs to; samples x interval / requests = CPU us per request
per stage (Python frames only: time in grpc's Cython core or uvloop's C shows under the nearest Python frame).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import _start  # noqa: E402 - bench/serve.py's server start (ports read from its log)
from serve_overhead import _stat  # noqa: E402 - /proc stat fields

TICK = os.sysconf("SC_CLK_TCK")
SPY = str(Path(sys.executable).with_name("py-spy"))

_MODEL = r"""
import sys, onnx, kiln
from onnx import TensorProto, helper
name, folder = sys.argv[1], sys.argv[2]
if name == "empty":
    nodes = [helper.make_node("Identity", ["x"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
elif name == "hidden":
    # y = x tiled 128 times: a 3 KB request, BERT-base's 393 KB answer (its last hidden state, seq 128, FP32)
    nodes = [helper.make_node("Unsqueeze", ["x", "one"], ["x1"]), helper.make_node("Tile", ["x1", "repeats"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 768])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 128, 768])
else:
    # y = x[:, :, 0, 0]: the engine reads 6 bytes of each request's 301 KB
    nodes = [helper.make_node("Gather", ["x", "zero"], ["x0"], axis=2), helper.make_node("Gather", ["x0", "zero"],
                                                                                          ["y"], axis=2)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", 3, 224, 224])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["batch", 3])
zero = [helper.make_tensor("zero", TensorProto.INT64, [], [0])] if name == "image" else []
if name == "hidden":
    zero = [helper.make_tensor("one", TensorProto.INT64, [1], [1]),
            helper.make_tensor("repeats", TensorProto.INT64, [3], [1, 128, 1])]
g = helper.make_graph(nodes, name, [x], [y], initializer=zero)
onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), folder + "/m.onnx")
kiln.build(folder + "/m.onnx").save(folder + "/1/model.kiln")
"""

SHAPES = {"empty": ([1, 4], "FP32", "<f4"), "image": ([1, 3, 224, 224], "FP16", "<f2"),
          "hidden": ([1, 768], "FP32", "<f4")}


def write_repository(root: Path, models: list[str]) -> None:
    for name in models:
        folder = root / name
        (folder / "1").mkdir(parents=True)
        subprocess.run([sys.executable, "-c", _MODEL, name, str(folder)], check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
        (folder / "config.pbtxt").write_text("max_batch_size: 64\ndynamic_batching { }\n")


def server_pids(pid: int) -> list[int]:
    """The engine process and its children (the front ends)."""
    return [pid] + [int(e) for e in os.listdir("/proc") if e.isdigit()
                    and (_stat(f"/proc/{e}/stat") or [0, 0])[1] == str(pid)]


def cpu_s(pids: list[int]) -> dict[int, float]:
    out = {}
    for p in pids:
        fields = _stat(f"/proc/{p}/stat")
        if fields is not None:
            out[p] = (int(fields[11]) + int(fields[12])) / TICK
    return out


# ---- the clients: each runs as `python -c CLIENT ...` and prints "go", waits for a line, prints its numbers ----

_CLIENT = r"""
import asyncio, json, resource, sys, time
import numpy as np
kind, protocol, port, model, concurrency, seconds = sys.argv[1:7]
port, concurrency, seconds = int(port), int(concurrency), float(seconds)
shape, datatype, dtype = json.loads(sys.argv[7])
data = np.random.default_rng(0).standard_normal(shape).astype(dtype)

def raw_grpc():
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="x", datatype=datatype, shape=shape)
    request.raw_input_contents.append(data.tobytes())
    payload = request.SerializeToString()
    async def make():
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1),
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        async def infer():
            await call(payload)
        return infer, channel.close
    return make

def raw_http():
    header = json.dumps({"inputs": [{"name": "x", "shape": shape, "datatype": datatype,
                                     "parameters": {"binary_data_size": data.nbytes}}],
                         "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}).encode()
    body = header + data.tobytes()
    head = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {len(header)}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    async def make():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        async def infer():
            writer.write(head + body)
            status = await reader.readuntil(b"\r\n\r\n")
            if not status.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(status.decode())
            length = int(re.search(rb"(?i)content-length: *(\d+)", status).group(1))
            await reader.readexactly(length)
        async def close():
            writer.close()
        return infer, close
    return make

def triton(module_name):
    import importlib
    module = importlib.import_module(module_name)
    async def make():
        if protocol == "http":
            client = module.InferenceServerClient(f"127.0.0.1:{port}")
        else:
            client = module.InferenceServerClient(f"127.0.0.1:{port}", channel_args=[
                ("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", -1),
                ("grpc.max_send_message_length", -1)])
        tensor = module.InferInput("x", shape, datatype)
        if protocol == "http":
            tensor.set_data_from_numpy(data, binary_data=True)
            outputs = [module.InferRequestedOutput("y", binary_data=True)]
        else:
            tensor.set_data_from_numpy(data)
            outputs = [module.InferRequestedOutput("y")]
        async def infer():
            result = await client.infer(model, [tensor], outputs=outputs)
            result.as_numpy("y")
        return infer, client.close
    return make

import re
if kind == "raw":
    make = raw_grpc() if protocol == "grpc" else raw_http()
else:
    make = triton("tritonclient.grpc.aio" if protocol == "grpc" else "tritonclient.http.aio")

async def main():
    pairs = [await make() for _ in range(concurrency)]
    for infer, _ in pairs:  # warm-up: connections and first calls
        await infer(); await infer()
    print("go", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    latencies = []
    stop = time.perf_counter() + seconds
    async def worker(infer):
        while time.perf_counter() < stop:
            t = time.perf_counter(); await infer(); latencies.append(time.perf_counter() - t)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    await asyncio.gather(*[worker(infer) for infer, _ in pairs])
    t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    latencies.sort()
    print(len(latencies), t1 - t0, cpu, latencies[len(latencies) // 2], flush=True)
    for _, close in pairs:
        await close()
try:
    import uvloop; uvloop.install()
except ImportError:
    pass
asyncio.run(main())
"""


def measure(server: subprocess.Popen, port: int, protocol: str, kind: str, model: str, concurrency: int,
            processes: int, seconds: float, spy_s: float) -> dict:
    shape, datatype, dtype = SHAPES[model]
    import json

    shares = [concurrency // processes + (k < concurrency % processes) for k in range(processes)]
    clients = [subprocess.Popen([sys.executable, "-c", _CLIENT, kind, protocol, str(port), model, str(n),
                                 str(seconds), json.dumps([shape, datatype, dtype])],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}) for n in shares if n]
    for c in clients:
        line = c.stdout.readline().strip()
        if line != "go":
            raise RuntimeError(f"a {kind} {protocol} client did not start ({line!r})")
    pids = server_pids(server.pid)
    before, wall0 = cpu_s(pids), time.perf_counter()
    spies = []
    if spy_s:
        folder = tempfile.mkdtemp(prefix="kiln-spy-")
        spies = [(p, f"{folder}/{p}.txt", subprocess.Popen(
            [SPY, "record", "--pid", str(p), "--format", "raw", "--nonblocking", "--gil", "--rate", "250", "-d",
             str(int(spy_s)), "-o", f"{folder}/{p}.txt"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            for p in pids]
    for c in clients:
        c.stdin.write("\n")
        c.stdin.flush()
    parts = [c.stdout.readline().split() for c in clients]
    after, wall = cpu_s(pids), time.perf_counter() - wall0
    for c in clients:
        c.wait(30)
    count = sum(int(p[0]) for p in parts)
    row = {"count": count, "rate": count / max(float(p[1]) for p in parts),
           "p50_us": sorted(float(p[3]) for p in parts)[len(parts) // 2] * 1e6,
           "client_us": sum(float(p[2]) for p in parts) / count * 1e6,
           "engine_us": (after[server.pid] - before[server.pid]) / count * 1e6,
           "frontends_us": sum(after[p] - before.get(p, after[p]) for p in after if p != server.pid) / count * 1e6,
           "wall_s": wall}
    if spies:
        stages: Counter = Counter()
        for p, path, spy in spies:
            spy.wait(spy_s + 30)
            role = "engine" if p == server.pid else "front end"
            for stage, n in stage_samples(path).items():
                stages[role, stage] += n
        # samples at 250 Hz over the spy's seconds; requests over the same seconds ~ rate * spy_s
        row["stages"] = {k: n / 250 / (row["rate"] * spy_s) * 1e6 for k, n in stages.items()}
    return row


# innermost frame first: the first rule whose regex matches a frame ("function (file:line)") names the sample's
# stage; a sample that matches none is "other" (the loop's own frames, C code outside any kiln function)
STAGES = [(re.compile(pattern), name) for pattern, name in [
    (r"kiln/serve/ipc\.py", "IPC frames (pickle, socket)"),
    (r"kiln/serve/http_codec\.py", "HTTP tensor codec"),
    (r"kiln/serve/grpc_wire\.py", "gRPC tensor codec"),
    (r"kiln/serve/batcher\.py", "batcher"),
    (r"kiln/serve/instances\.py|kiln/runtime/", "engine call"),
    (r"^(infer|_send|_settle|received|call) \(.*kiln/serve/frontend_process\.py", "RemoteCore (futures)"),
    (r"^(_received|_dispatch|_infer_answered|_reply) \(.*kiln/serve/frontends\.py", "engine's front-end pool"),
    (r"kiln/serve/core\.py", "core (route, validate)"),
    (r"kiln/serve/grpc_server\.py", "gRPC servicer"),
    (r"kiln/serve/http_fast\.py|kiln/serve/http_protocol\.py", "HTTP infer path"),
    (r"/httptools|/uvicorn/", "HTTP protocol (uvicorn)"),
    (r"/grpc/", "grpc.aio (Python/Cython)"),
    (r"/google/protobuf", "protobuf"),
]]


def stage_samples(path: str) -> Counter:
    counts: Counter = Counter()
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return counts
    for line in lines:
        stack, _, n = line.rpartition(" ")
        stage = "other"
        for frame in reversed(stack.split(";")):
            hit = next((name for pattern, name in STAGES if pattern.search(frame)), None)
            if hit is not None:
                stage = hit
                break
        counts[stage] += int(n)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["empty", "image"], choices=sorted(SHAPES))
    parser.add_argument("--frontends", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--protocols", nargs="+", default=["grpc", "http"])
    parser.add_argument("--clients", nargs="+", default=["raw", "triton"])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--processes", type=int, default=1, help="client processes")
    parser.add_argument("--staging-mib", type=int, nargs="+", default=[64],
                        help="kiln serve --staging-mib values, each a server of its own (0: tensors over the socket)")
    parser.add_argument("--rounds", type=int, default=1, help="the servers again, interleaved (A B A B)")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--profile", type=float, default=0.0, help="seconds of py-spy per row (0: none)")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(f"# {os.cpu_count()} CPUs, load {load:.1f} at start; concurrency {args.concurrency}, "
          f"{args.processes} client process(es), {args.seconds} s windows\n")
    print("| model | front ends | staging MiB | protocol | client | req/s | p50 ms | server CPU us/req | engine process "
          "| front ends | client CPU us/req |\n|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    profiles = []
    with tempfile.TemporaryDirectory(prefix="kiln-fe-") as tmp:
        write_repository(Path(tmp), args.models)
        servers = [(n, mib) for n in args.frontends for mib in (args.staging_mib if n else [0])]
        for frontends, mib in servers * args.rounds:
            server, ports = _start(Path(tmp), frontends, mib)
            http, grpc = ports["HTTP"], ports["gRPC"]
            try:
                for model in args.models:
                    for protocol in args.protocols:
                        for kind in args.clients:
                            port = http if protocol == "http" else grpc
                            spy = args.profile if kind == "raw" else 0.0
                            m = measure(server, port, protocol, kind, model, args.concurrency, args.processes,
                                        max(args.seconds, spy + 1.0) if spy else args.seconds, spy)
                            print(f"| {model} | {frontends} | {mib} | {protocol} | {kind} | {m['rate']:.0f} "
                                  f"| {m['p50_us'] / 1e3:.2f} | {m['engine_us'] + m['frontends_us']:.0f} "
                                  f"| {m['engine_us']:.0f} | {m['frontends_us']:.0f} | {m['client_us']:.0f} |",
                                  flush=True)
                            if "stages" in m:
                                profiles.append((model, f"{frontends} front ends, staging {mib} MiB", protocol,
                                                 m["stages"]))
            finally:
                server.terminate()
                server.wait(30)
    for model, frontends, protocol, stages in profiles:
        print(f"\n### py-spy, {model}, {frontends}, {protocol}, raw client: CPU us per request by stage\n")
        print("| process | stage | us/req |\n|---|---|---|")
        for (role, stage), us in sorted(stages.items(), key=lambda kv: (kv[0][0], -kv[1])):
            if us >= 1:
                print(f"| {role} | {stage} | {us:.0f} |")
    print(f"\nload {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
