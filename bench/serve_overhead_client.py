"""bench/serve_overhead.py's load: one client process, closed loop, an empty model's request prepared once.

    python bench/serve_overhead_client.py PROTOCOL CLIENT PORT MODEL CONCURRENCY SECONDS

PROTOCOL grpc | http; CLIENT raw (gRPC: a bare grpc stub sending the serialized request; HTTP: HTTP/1.1
keep-alive with the binary tensor extension, written by hand), h2 (gRPC at concurrency 1 only: a blocking
socket writing HEADERS and DATA frames encoded once, reading frames to the call's trailers: the client costs
~10 us a call, so the round trip is the loopback's and the server's) or tritonclient (what users run: its
blocking client at concurrency 1; at N, tritonclient.grpc.aio's clients on one event loop, or
tritonclient.http's gevent clients). Every client has its own connection. The process warms up, prints
"go", waits for a line on stdin, runs for SECONDS (concurrency 1: one call after another) and prints one
JSON line: requests, wall seconds, p50 and p99 latency (s), and its own CPU seconds over the window.
gRPC at concurrency 1 over TLS when KILN_BENCH_GRPC_ROOT_CERT names the CA's certificate, with requests
compressed (and answers accepted compressed) when KILN_BENCH_GRPC_COMPRESSION names gzip or deflate.
HTTP with JSON tensors (the input as a JSON list, the output asked for as JSON) when KILN_BENCH_HTTP_JSON=1: the
raw client's body json.dumps'd as tritonclient.http writes it, tritonclient's tensors with binary_data=False.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import sys
import time

import numpy as np

X = np.arange(4, dtype=np.float32).reshape(1, 4)  # the empty model's input: x FP32 [1, 4]
GRPC_METHOD = "/inference.GRPCInferenceService/ModelInfer"
CHANNEL_ARGS = [("grpc.use_local_subchannel_pool", 1)]  # a connection per client


def grpc_request_bytes(model: str) -> bytes:
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="x", datatype="FP32", shape=list(X.shape))
    request.raw_input_contents.append(X.tobytes())
    return request.SerializeToString()


JSON_TENSORS = os.environ.get("KILN_BENCH_HTTP_JSON") == "1"


def http_body(model: str) -> tuple[bytes, dict[str, str]]:
    """The infer request's body (binary tensor extension: a JSON header, then the tensor's bytes; or with
    KILN_BENCH_HTTP_JSON=1 the tensors as JSON lists) and headers."""
    if JSON_TENSORS:
        body = json.dumps({"inputs": [{"name": "x", "shape": list(X.shape), "datatype": "FP32",
                                       "data": X.reshape(-1).tolist()}],
                           "outputs": [{"name": "y", "parameters": {"binary_data": False}}]}).encode()
        return body, {"Content-Type": "application/json"}
    header = json.dumps({"inputs": [{"name": "x", "shape": list(X.shape), "datatype": "FP32",
                                     "parameters": {"binary_data_size": X.nbytes}}],
                         "outputs": [{"name": "y", "parameters": {"binary_data": True}}]}).encode()
    return header + X.tobytes(), {"Content-Type": "application/octet-stream",
                                  "Inference-Header-Content-Length": str(len(header))}


def http_request_bytes(model: str, port: int) -> bytes:
    body, headers = http_body(model)
    lines = [f"POST /v2/models/{model}/infer HTTP/1.1", f"Host: 127.0.0.1:{port}",
             *(f"{k}: {v}" for k, v in headers.items()), f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class RawHttp:
    """HTTP/1.1 keep-alive over asyncio streams: write the request, read the status line, headers and body."""

    def __init__(self, port: int, request: bytes):
        self.port, self.request = port, request

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    async def __call__(self) -> None:
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head.decode(errors="replace"))
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        await self.reader.readexactly(length)


class RawH2:
    """gRPC's ModelInfer over HTTP/2 with next to no client: the call's frames (HEADERS of literals that touch no
    HPACK table, so the same bytes serve every call but the stream id; DATA with the message and END_STREAM)
    written in one send, frames read until the HEADERS that ends the stream. Checked once, at the first call:
    the answer's message and its trailers (grpc-status 0, HPACK-decoded)."""

    PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    HEADER = struct.Struct(">HBBBI")  # the frame header: 24-bit length as 16 + 8 bits, type, flags, stream id

    def __init__(self, port: int, model: str):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""
        self.stream = 1
        # SETTINGS (empty), then the connection's receive window opened to 2^31 - 1: the server never waits for
        # a WINDOW_UPDATE (each stream's 64 KB window is far above an answer)
        self.sock.sendall(self.PREFACE + self._frame(4, 0, 0, b"") + self._frame(8, 0, 0, struct.pack(">I", (1 << 31) - 1 - 65535)))

        def literal(name: bytes, value: bytes) -> bytes:  # HPACK literal without indexing, a new name, plain strings
            return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value

        self.block = (b"\x83\x86" + literal(b":path", GRPC_METHOD.encode()) +  # :method POST, :scheme http
                      literal(b":authority", f"127.0.0.1:{port}".encode()) +
                      literal(b"content-type", b"application/grpc") + literal(b"te", b"trailers"))
        body = grpc_request_bytes(model)
        self.message = b"\x00" + struct.pack(">I", len(body)) + body
        self.first = True

    def _frame(self, kind: int, flags: int, stream: int, payload: bytes) -> bytes:
        n = len(payload)
        return self.HEADER.pack(n >> 8, n & 0xFF, kind, flags, stream) + payload

    def __call__(self) -> None:
        stream = self.stream
        self.stream += 2
        self.sock.sendall(self._frame(1, 4, stream, self.block) + self._frame(0, 1, stream, self.message))
        frames = []
        while True:
            buffer = self.buffer
            while len(buffer) >= 9:
                high, low, kind, flags, sid = self.HEADER.unpack_from(buffer)
                end = 9 + (high << 8 | low)
                if len(buffer) < end:
                    break
                frames.append((kind, flags, sid, buffer[9:end]))
                buffer = buffer[end:]
                if kind == 6 and not flags & 1:  # PING: acknowledged
                    self.sock.sendall(self._frame(6, 1, 0, frames[-1][3]))
                elif kind == 4 and not flags & 1:  # SETTINGS: acknowledged
                    self.sock.sendall(self._frame(4, 1, 0, b""))
                elif kind == 1 and sid == stream and flags & 1:  # the trailers: the call is over
                    self.buffer = buffer
                    if self.first:
                        self._check(stream, frames)
                    return
            self.buffer = buffer + self.sock.recv(1 << 16)

    def _check(self, stream: int, frames: list) -> None:
        import hpack
        from tritonclient.grpc import service_pb2 as pb

        self.first = False
        decoder = hpack.Decoder()  # every header block of the connection so far, in order (its dynamic table)
        blocks = [(sid, dict(decoder.decode(payload, raw=True))) for kind, _, sid, payload in frames if kind == 1]
        data = b"".join(payload for kind, _, sid, payload in frames if kind == 0 and sid == stream)
        trailers = blocks[-1][1] if blocks else {}
        if trailers.get(b"grpc-status") != b"0" or len(data) < 5:
            raise RuntimeError(f"the first call failed: trailers {trailers}")
        answer = pb.ModelInferResponse.FromString(data[5:])
        if [list(o.shape) for o in answer.outputs] != [list(X.shape)] or len(answer.raw_output_contents[0]) != X.nbytes:
            raise RuntimeError(f"the first call's answer is not an FP32 {list(X.shape)}: {answer}")


def _sync_call(protocol: str, client: str, port: int, model: str):
    """A blocking call (concurrency 1)."""
    if client == "h2":
        if protocol != "grpc" or os.environ.get("KILN_BENCH_GRPC_ROOT_CERT") or os.environ.get("KILN_BENCH_GRPC_COMPRESSION"):
            raise SystemExit("the h2 client speaks plaintext gRPC, uncompressed")
        return RawH2(port, model)
    root_cert = os.environ.get("KILN_BENCH_GRPC_ROOT_CERT")
    compression = os.environ.get("KILN_BENCH_GRPC_COMPRESSION")
    if client == "raw" and protocol == "grpc":
        import grpc

        algorithm = {"gzip": grpc.Compression.Gzip, "deflate": grpc.Compression.Deflate}.get(compression)
        if root_cert:
            with open(root_cert, "rb") as f:
                channel = grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(f.read()),
                                              compression=algorithm)
        else:
            channel = grpc.insecure_channel(f"127.0.0.1:{port}", compression=algorithm)
        call = channel.unary_unary(GRPC_METHOD)
        payload = grpc_request_bytes(model)
        return lambda: call(payload)
    if client == "raw":
        import http.client

        connection = http.client.HTTPConnection("127.0.0.1", port)
        body, headers = http_body(model)

        def call():
            connection.request("POST", f"/v2/models/{model}/infer", body, headers)
            answer = connection.getresponse()
            answer.read()
            if answer.status != 200:
                raise RuntimeError(answer.status)
        return call
    if protocol == "grpc":
        import tritonclient.grpc as triton
    else:
        import tritonclient.http as triton
    address = f"127.0.0.1:{port}"
    if protocol == "grpc" and root_cert:
        triton_client = triton.InferenceServerClient(address, ssl=True, root_certificates=root_cert)
    else:
        triton_client = triton.InferenceServerClient(address)
    tensor = triton.InferInput("x", list(X.shape), "FP32")
    if protocol == "http" and JSON_TENSORS:
        tensor.set_data_from_numpy(X, binary_data=False)
        outputs = [triton.InferRequestedOutput("y", binary_data=False)]
        return lambda: triton_client.infer(model, [tensor], outputs=outputs)
    tensor.set_data_from_numpy(X)
    if protocol == "grpc" and compression:
        return lambda: triton_client.infer(model, [tensor], compression_algorithm=compression)
    return lambda: triton_client.infer(model, [tensor])


def _measure_sync(call, seconds: float) -> dict:
    for _ in range(200):
        call()
    print("go", flush=True)
    sys.stdin.readline()
    latencies = []
    cpu0, t0 = time.process_time(), time.perf_counter()
    stop = t0 + seconds
    while (t := time.perf_counter()) < stop:
        call()
        latencies.append(time.perf_counter() - t)
    return _result(latencies, time.perf_counter() - t0, time.process_time() - cpu0)


async def _measure_async(protocol: str, client: str, port: int, model: str, concurrency: int, seconds: float) -> dict:
    if protocol == "grpc" and client == "raw":
        import grpc

        payload = grpc_request_bytes(model)
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_ARGS) for _ in range(concurrency)]
        stubs = [c.unary_unary(GRPC_METHOD) for c in channels]
        calls = [lambda stub=stub: stub(payload) for stub in stubs]
        closers = [c.close for c in channels]
    elif protocol == "http" and client == "raw":
        request = http_request_bytes(model, port)
        calls = [RawHttp(port, request) for _ in range(concurrency)]
        for call in calls:
            await call.open()
        closers = []
    else:  # tritonclient.grpc.aio
        import tritonclient.grpc.aio as triton

        clients = [triton.InferenceServerClient(f"127.0.0.1:{port}", channel_args=CHANNEL_ARGS)
                   for _ in range(concurrency)]
        tensor = triton.InferInput("x", list(X.shape), "FP32")
        tensor.set_data_from_numpy(X)
        calls = [lambda c=c: c.infer(model, [tensor]) for c in clients]
        closers = [c.close for c in clients]
    for call in calls:  # warm-up: connections and first calls
        await call()
    print("go", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    latencies = []
    stop = [float("inf")]

    async def worker(call) -> None:
        while time.perf_counter() < stop[0]:
            t = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - t)

    cpu0, t0 = time.process_time(), time.perf_counter()
    stop[0] = t0 + seconds
    await asyncio.gather(*[worker(call) for call in calls])
    result = _result(latencies, time.perf_counter() - t0, time.process_time() - cpu0)
    for close in closers:
        await close()
    return result


def _measure_gevent(port: int, model: str, concurrency: int, seconds: float) -> dict:
    """tritonclient.http at concurrency N: its gevent client, N greenlets over a pool of N connections."""
    import gevent
    import tritonclient.http as triton

    client = triton.InferenceServerClient(f"127.0.0.1:{port}", concurrency=concurrency)
    tensor = triton.InferInput("x", list(X.shape), "FP32")
    tensor.set_data_from_numpy(X)
    gevent.joinall([gevent.spawn(client.infer, model, [tensor]) for _ in range(concurrency)])
    print("go", flush=True)
    sys.stdin.readline()
    latencies = []
    stop = time.perf_counter() + seconds

    def worker() -> None:
        while time.perf_counter() < stop:
            t = time.perf_counter()
            client.infer(model, [tensor])
            latencies.append(time.perf_counter() - t)

    cpu0, t0 = time.process_time(), time.perf_counter()
    stop = t0 + seconds
    gevent.joinall([gevent.spawn(worker) for _ in range(concurrency)])
    return _result(latencies, time.perf_counter() - t0, time.process_time() - cpu0)


def _result(latencies: list[float], wall: float, cpu: float) -> dict:
    latencies.sort()
    return {"requests": len(latencies), "wall_s": wall, "p50_s": latencies[len(latencies) // 2],
            "p99_s": latencies[int(len(latencies) * 0.99)], "client_cpu_s": cpu}


def main() -> None:
    protocol, client, port, model, concurrency, seconds = sys.argv[1:7]
    port, concurrency, seconds = int(port), int(concurrency), float(seconds)
    if client == "h2" and concurrency != 1:
        raise SystemExit("the h2 client runs at concurrency 1 only")
    if concurrency == 1:
        result = _measure_sync(_sync_call(protocol, client, port, model), seconds)
    elif protocol == "http" and client == "tritonclient":
        result = _measure_gevent(port, model, concurrency, seconds)
    else:
        import uvloop

        result = uvloop.run(_measure_async(protocol, client, port, model, concurrency, seconds))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
