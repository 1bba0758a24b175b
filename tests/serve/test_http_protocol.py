"""kiln's HTTP/1.1 protocol (kiln/serve/http_protocol.py): infer answered on httptools' callbacks.

Two oracles: uvicorn's own httptools protocol over the same InferFastPath (the ASGI path kiln serve ran before),
fed the same bytes, must write the same bytes (valid requests, every malformed infer request of test_errors,
413s, pipelined requests); and numpy (z = 2x of the mlp model, y = relu(x W)) for answers over a real socket
(tritonclient.http binary and JSON, keep-alive, chunked bodies, a request in many TCP writes, interleaved
clients, Expect: 100-continue, malformed heads and bodies)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import zlib

import numpy as np
import pytest
from conftest import RecordingTransport, options, post_request
from serve_models import MLP_W
from test_errors import CASES, binary_body, infer_json

pytest.importorskip("httptools")

from kiln.serve import ServerThread
from kiln.serve.http_fast import InferFastPath
from kiln.serve.http_protocol import MAX_HEAD_BYTES, InferProtocol
from kiln.serve.http_server import http_app
from kiln.serve.metrics import MetricsExporter


def _seeded(case: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(case.encode()))


def _mlp(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The mlp model's y and z, by numpy."""
    return np.maximum(x @ MLP_W, 0), 2 * x


# ---- against uvicorn's protocol, in process -------------------------------------------------------------------


@pytest.fixture(scope="module")
def core_thread(repository):
    thread = ServerThread(options(repository, http_port=None, grpc_port=None, metrics_port=None))
    server = thread.start()
    yield thread, server.core
    thread.stop()


async def _answers(transport: RecordingTransport, answers: int) -> None:
    for _ in range(1000):
        if b"".join(transport.calls).count(b"HTTP/1.1 ") >= answers:
            return
        await asyncio.sleep(0.01)


async def _feed(kind: str, fast: InferFastPath, pieces: list[bytes], answers: int,
                each: bool = False) -> RecordingTransport:
    """`pieces` fed one data_received each to kiln's protocol ("kiln") or uvicorn's ("uvicorn", the ASGI path)
    over `fast`, until `answers` responses have been written (or 10 s); `each`: a piece is a request, fed once
    the one before is answered."""
    import uvicorn
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.server import ServerState

    config = uvicorn.Config(fast, lifespan="off", access_log=False, log_level="warning")
    config.load()
    loop = asyncio.get_running_loop()
    if kind == "kiln":
        protocol = InferProtocol(config=config, server_state=ServerState(), app_state={}, _loop=loop, fast=fast)
    else:
        protocol = HttpToolsProtocol(config=config, server_state=ServerState(), app_state={}, _loop=loop)
    transport = RecordingTransport()
    protocol.connection_made(transport)
    for k, piece in enumerate(pieces):
        protocol.data_received(piece)
        await asyncio.sleep(0)
        if each:
            await _answers(transport, k + 1)
    await _answers(transport, answers)
    await asyncio.sleep(0.02)  # anything written after the last answer is seen too
    closed = transport.closed
    protocol.connection_lost(None)
    transport.closed = closed
    return transport



def _chunked(path: str, body: bytes, headers: dict | None = None, size: int = 7) -> bytes:
    head = [f"POST {path} HTTP/1.1", "host: 127.0.0.1", "transfer-encoding: chunked"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[k:k + size]), body[k:k + size]) for k in range(0, len(body), size))
    return ("\r\n".join(head) + "\r\n\r\n").encode() + chunks + b"0\r\n\r\n"


def _both(core_thread, pieces: list[bytes], answers: int, limit: int = 64 << 20
          ) -> tuple[RecordingTransport, RecordingTransport]:
    thread, core = core_thread
    fast = InferFastPath(http_app(core, MetricsExporter(list), limit), core, limit)
    return thread.call(_feed("uvicorn", fast, pieces, answers)), thread.call(_feed("kiln", fast, pieces, answers))


def _same_bytes(old: RecordingTransport, new: RecordingTransport) -> bytes:
    """The two protocols wrote the same bytes and closed alike; those bytes."""
    assert b"".join(new.calls) == b"".join(old.calls), (b"".join(new.calls)[:400], b"".join(old.calls)[:400])
    assert new.closed == old.closed
    return b"".join(new.calls)


def _valid() -> dict[str, tuple[str, bytes, dict | None]]:
    gen = _seeded("valid requests")
    x = gen.standard_normal((3, 8)).astype(np.float32)
    header = {"inputs": [{"name": "x", "shape": [3, 8], "datatype": "FP32", "parameters": {"binary_data_size": 96}}],
              "parameters": {"binary_data_output": True}, "id": "r-1"}
    binary, binary_headers = binary_body(header, x.tobytes())
    import gzip
    return {
        "JSON": ("/v2/models/mlp/infer", json.dumps(infer_json(data=x[:2].reshape(-1).tolist())).encode(), None),
        "binary in and out": ("/v2/models/mlp/infer", binary, binary_headers),
        "version given": ("/v2/models/mlp/versions/2/infer", binary, binary_headers),
        "gzip": ("/v2/models/mlp/infer", gzip.compress(binary), {**binary_headers, "Content-Encoding": "gzip"}),
        "fixed model": ("/v2/models/fixed/infer", json.dumps({"inputs": [
            {"name": "a", "shape": [2, 3], "datatype": "FP32", "data": x[0, :6].tolist()},
            {"name": "i", "shape": [2, 3], "datatype": "INT64", "data": list(range(6))}]}).encode(), None),
    }


@pytest.mark.parametrize("case", list(_valid()))
def test_valid_request_writes_what_uvicorns_protocol_writes(core_thread, case):
    path, body, headers = _valid()[case]
    old, new = _both(core_thread, [post_request(path, body, headers)], 1)
    written = _same_bytes(old, new)
    assert written.startswith(b"HTTP/1.1 200 OK\r\n") and len(new.calls) == 1  # head and body in one write


def _infer_cases() -> list[str]:
    return [c for c, v in CASES.items() if v[0].endswith("/infer")]


@pytest.mark.parametrize("case", _infer_cases())
def test_malformed_request_writes_what_uvicorns_protocol_writes(core_thread, case):
    path, body, headers, status, message = CASES[case]
    body = json.dumps(body).encode() if isinstance(body, dict) else body.encode() if isinstance(body, str) else body
    old, new = _both(core_thread, [post_request(path, body or b"", headers)], 1)
    written = _same_bytes(old, new)
    head, _, payload = written.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()) and message in json.loads(payload)["error"]


def test_pipelined_keep_alive_close_and_errors_write_what_uvicorn_writes(core_thread):
    """Pipelined in one piece: infer, an error, a GET (to FastAPI), infer again, a chunked infer, then one with
    connection: close: six answers in order, the same bytes as uvicorn's, the connection closed after the last."""
    cases = _valid()
    path, body, headers = cases["binary in and out"]
    json_path, json_body, _ = cases["JSON"]
    get = b"GET /v2/models/mlp HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
    data = (post_request(path, body, headers) + post_request("/v2/models/nope/infer", b"{}") + get
            + post_request(json_path, json_body) + _chunked(path, body, headers)
            + post_request(path, body, headers, close=True))
    old, new = _both(core_thread, [data], 6)
    written = _same_bytes(old, new)
    assert written.count(b"HTTP/1.1 200 OK") == 5 and written.count(b"HTTP/1.1 404") == 1 and new.closed


def test_request_in_pieces_writes_what_uvicorn_writes(core_thread):
    """One request fed a byte at a time (head and body), then one cut mid-header: the same answers."""
    path, body, headers = _valid()["binary in and out"]
    data = post_request(path, body, headers) + _chunked(path, body, headers, size=5)
    old, new = _both(core_thread, [data[k:k + 1] for k in range(len(data))], 2)
    assert _same_bytes(old, new).count(b"HTTP/1.1 200 OK") == 2


def test_too_large_bodies_are_413_as_uvicorn_answers(core_thread):
    """Over the limit by Content-Length (answered before the body is read, whose bytes are then dropped) and by a
    chunked body's size: 413 each, the connection still serving the next request."""
    path, body, headers = _valid()["binary in and out"]
    limit = len(body) - 1
    small = post_request(path, body[:limit - 10], headers)  # a 400 (binary data short), within the limit
    data = post_request(path, body, headers) + _chunked(path, body, headers) + small
    old, new = _both(core_thread, [data], 3, limit)
    written = _same_bytes(old, new)
    assert written.count(b"HTTP/1.1 413 ") == 2 and written.count(b"HTTP/1.1 400 ") == 1 and not new.closed


def test_expect_100_continue_as_uvicorn(core_thread):
    path, body, headers = _valid()["binary in and out"]
    data = post_request(path, body, {**headers, "Expect": "100-continue"})
    head, _, rest = data.partition(b"\r\n\r\n")
    old, new = _both(core_thread, [head + b"\r\n\r\n", rest], 2)
    written = _same_bytes(old, new)
    assert written.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n")


def test_malformed_head_is_uvicorns_400(core_thread):
    for data in (b"POST /v2/models/mlp/infer HTTP/1.1\r\ncontent-length: x\r\n\r\n",
                 b"P\x00ST / HTTP/1.1\r\n\r\n",
                 b"POST /v2/models/mlp/infer HTTP/1.1\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n"):
        old, new = _both(core_thread, [data], 1)
        assert _same_bytes(old, new).startswith(b"HTTP/1.1 400 Bad Request") and new.closed


def test_head_past_the_limit_is_a_400(core_thread):
    thread, core = core_thread
    fast = InferFastPath(http_app(core, MetricsExporter(list)), core, 1 << 20)
    big = b"POST /v2/models/mlp/infer HTTP/1.1\r\nx-big: " + b"a" * (MAX_HEAD_BYTES // 4)
    pieces = [big[:100], *[b"a" * (MAX_HEAD_BYTES // 4)] * 5]
    new = thread.call(_feed("kiln", fast, pieces, 1))
    written = b"".join(new.calls)
    assert written.startswith(b"HTTP/1.1 400 Bad Request") and b"head is longer" in written and new.closed


def test_infer_skips_asgi_but_other_requests_go_to_it(core_thread, monkeypatch):
    """The point of the protocol: an infer request takes no ASGI cycle (uvicorn's on_headers_complete is not run for
    it), on a connection's first request and on the next ones (keep-alive); a GET, an infer with a query string and
    one pipelined behind another do (mlp's queue delay: the first infer is still waiting when the rest arrive)."""
    to_app = []
    original = InferProtocol._to_app

    def counted(self):
        to_app.append(self.url)
        original(self)

    monkeypatch.setattr(InferProtocol, "_to_app", counted)
    path, body, headers = _valid()["binary in and out"]
    thread, core = core_thread
    fast = InferFastPath(http_app(core, MetricsExporter(list)), core, 64 << 20)
    one = thread.call(_feed("kiln", fast, [post_request(path, body, headers)] * 3, 3, each=True))  # keep-alive
    assert b"".join(one.calls).count(b"HTTP/1.1 200 OK") == 3 and to_app == []
    get = b"GET /v2/models/mlp HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
    pipelined = get + post_request(path + "?q=1", body, headers) + post_request(path, body, headers)
    two = thread.call(_feed("kiln", fast, [pipelined], 3))
    assert b"".join(two.calls).count(b"HTTP/1.1 200 OK") == 3
    assert to_app == [b"/v2/models/mlp", path.encode() + b"?q=1", path.encode()]  # the last: behind the others
    to_app.clear()
    three = thread.call(_feed("kiln", fast, [post_request(path, body, headers) * 2], 2))
    assert b"".join(three.calls).count(b"HTTP/1.1 200 OK") == 2 and to_app == [path.encode()]


class _Clock:
    """A loop's time and call_later, run by hand."""

    def __init__(self):
        self.now = 100.0
        self.timers: list[list] = []  # [when, callback, cancelled]

    def time(self) -> float:
        return self.now

    def call_later(self, delay, callback):
        timer = [self.now + delay, callback, False]
        self.timers.append(timer)

        class Handle:
            @staticmethod
            def cancel():
                timer[2] = True

        return Handle()

    def advance(self, seconds: float) -> None:
        self.now += seconds
        for timer in [t for t in self.timers if t[0] <= self.now and not t[2]]:
            self.timers.remove(timer)
            timer[1]()

    def armed(self) -> list[float]:
        return [t[0] for t in self.timers if not t[2]]


def test_keep_alive_timer_closes_an_idle_connection_as_uvicorns(core_thread):
    """One timer a connection (not one a request), closing it once timeout_keep_alive seconds passed since the last
    answer with no data since: driven by hand (_Clock), no real time measured."""
    import uvicorn
    from uvicorn.server import ServerState

    thread, core = core_thread
    fast = InferFastPath(http_app(core, MetricsExporter(list)), core, 64 << 20)
    config = uvicorn.Config(fast, lifespan="off", access_log=False, timeout_keep_alive=5)
    config.load()
    clock = _Clock()
    protocol = InferProtocol(config=config, server_state=ServerState(), app_state={}, _loop=clock, fast=fast)
    transport = RecordingTransport()
    protocol.connection_made(transport)
    protocol.on_response_complete()  # an answer at 100
    assert clock.armed() == [105.0]
    clock.advance(1)
    protocol._unset_keepalive_if_required()  # data at 101 (uvicorn's data_received calls this)
    clock.advance(1)
    protocol.on_response_complete()  # its answer at 102: no second timer
    assert clock.armed() == [105.0]
    clock.advance(3)  # 105: idle for 3 s only: armed again for the 2 left
    assert not transport.closed and clock.armed() == [107.0]
    clock.advance(1.5)
    assert not transport.closed
    clock.advance(0.5)  # 107: idle for 5 s
    assert transport.closed
    # a request being read or answered when the timer fires keeps the connection; its answer arms the timer again
    transport = RecordingTransport()
    protocol = InferProtocol(config=config, server_state=ServerState(), app_state={}, _loop=clock, fast=fast)
    protocol.connection_made(transport)
    protocol.on_response_complete()
    protocol._unset_keepalive_if_required()
    clock.advance(10)
    assert not transport.closed and clock.armed() == []
    protocol.on_response_complete()
    assert clock.armed() == [clock.now + 5]
    protocol.connection_lost(None)  # the timer goes with the connection
    assert clock.armed() == []


def test_keep_alive_timeout_closes_a_served_connection(core_thread):
    """The same on a real loop: a connection answered, then idle, is closed by the timer (within a generous 10 s of
    a 0.2 s timeout: only that it closes is asserted)."""
    import uvicorn
    from uvicorn.server import ServerState

    thread, core = core_thread
    fast = InferFastPath(http_app(core, MetricsExporter(list)), core, 64 << 20)
    path, body, headers = _valid()["binary in and out"]

    async def serve() -> RecordingTransport:
        config = uvicorn.Config(fast, lifespan="off", access_log=False, timeout_keep_alive=0.2)
        config.load()
        protocol = InferProtocol(config=config, server_state=ServerState(), app_state={},
                                 _loop=asyncio.get_running_loop(), fast=fast)
        transport = RecordingTransport()
        protocol.connection_made(transport)
        for _ in range(3):
            protocol.data_received(post_request(path, body, headers))
            await _answers(transport, 1)
            transport.calls.clear()
        for _ in range(1000):
            if transport.closed:
                break
            await asyncio.sleep(0.01)
        protocol.connection_lost(None)
        return transport

    assert thread.call(serve()).closed


class _Cancelled(InferFastPath):
    """answer() ends in CancelledError (a future it awaits cancelled, as an unloaded model's queue does): at once, or
    after waiting (in a task)."""

    def __init__(self, app, core, limit, wait: bool):
        super().__init__(app, core, limit)
        self.wait = wait

    async def answer(self, body, model_name, model_version, encoding, header_length):
        future = asyncio.get_running_loop().create_future()
        if self.wait:
            asyncio.get_running_loop().call_later(0.01, future.cancel)
        else:
            future.cancel()
        return await future


@pytest.mark.parametrize("wait", [False, True])
def test_a_cancelled_answer_is_a_500_and_the_connection_serves_on(core_thread, wait):
    thread, core = core_thread
    path, body, headers = _valid()["binary in and out"]
    fast = _Cancelled(http_app(core, MetricsExporter(list)), core, 64 << 20, wait)
    new = thread.call(_feed("kiln", fast, [post_request(path, body, headers)] * 2, 2, each=True))
    written = b"".join(new.calls)
    assert written.count(b"HTTP/1.1 500 Internal Server Error") == 2 and not new.closed
    assert b'{"error":"internal error: CancelledError: "}' in written


# ---- over a socket, the shared server --------------------------------------------------------------------------


def _read_answer(sock: socket.socket, buffer: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer (Content-Length) from `sock`, `buffer` holding what was read past the last."""
    while b"\r\n\r\n" not in buffer:
        data = sock.recv(65536)
        assert data, "the server closed the connection"
        buffer += data
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers["content-length"])
    while len(rest) < length:
        data = sock.recv(65536)
        assert data, "the server closed the connection"
        rest += data
    buffer[:] = rest[length:]
    return status, headers, rest[:length]


def _binary_request(x: np.ndarray, request_id: str = "") -> tuple[bytes, dict]:
    header = {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                          "parameters": {"binary_data_size": x.nbytes}}],
              "outputs": [{"name": "y", "parameters": {"binary_data": True}},
                          {"name": "z", "parameters": {"binary_data": True}}]}
    if request_id:
        header["id"] = request_id
    return binary_body(header, x.tobytes())


def _check_binary_answer(status: int, headers: dict, payload: bytes, x: np.ndarray, request_id: str = "") -> None:
    assert status == 200, payload[:300]
    length = int(headers["inference-header-content-length"])
    answer = json.loads(payload[:length])
    assert answer.get("id", "") == request_id
    y, z = _mlp(x)
    offset, got = length, {}
    for output in answer["outputs"]:
        size = output["parameters"]["binary_data_size"]
        got[output["name"]] = np.frombuffer(payload[offset:offset + size], np.float32).reshape(output["shape"])
        offset += size
    assert offset == len(payload)
    np.testing.assert_array_equal(got["z"], z)  # exact: z = 2x
    np.testing.assert_allclose(got["y"], y, rtol=1e-5, atol=1e-5)


def _connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.ports.http), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_http(server, binary):
    import tritonclient.http as httpclient

    gen = _seeded(f"tritonclient {binary}")
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.ports.http}", connection_timeout=30,
                                              network_timeout=30)
    try:
        for k in range(4):  # several calls on its connection, each with fresh tensors
            x = gen.standard_normal((1 + k, 8)).astype(np.float32)
            tensor = httpclient.InferInput("x", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x, binary_data=binary)
            outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("y", "z")]
            result = client.infer("mlp", [tensor], outputs=outputs, request_id=f"r{k}")
            y, z = _mlp(x)
            np.testing.assert_array_equal(result.as_numpy("z"), z)
            np.testing.assert_allclose(result.as_numpy("y"), y, rtol=1e-5, atol=1e-5)
            assert result.get_response()["id"] == f"r{k}"
    finally:
        client.close()


def test_keep_alive_chunked_and_json_on_one_connection(server):
    gen = _seeded("keep-alive")
    with _connect(server) as sock:
        buffer = bytearray()
        for k in range(6):
            x = gen.standard_normal((2, 8)).astype(np.float32)
            body, headers = _binary_request(x, f"k{k}")
            data = _chunked("/v2/models/mlp/infer", body, headers, size=13) if k % 2 else \
                post_request("/v2/models/mlp/infer", body, headers)
            sock.sendall(data)
            _check_binary_answer(*_read_answer(sock, buffer), x, f"k{k}")
        x = gen.standard_normal((1, 8)).astype(np.float32)
        sock.sendall(post_request("/v2/models/mlp/infer", json.dumps(infer_json(shape=(1, 8),
                                                                            data=x.ravel().tolist())).encode()))
        status, headers, payload = _read_answer(sock, buffer)
        assert status == 200 and headers["content-type"] == "application/json"
        z = next(o for o in json.loads(payload)["outputs"] if o["name"] == "z")
        np.testing.assert_array_equal(np.asarray(z["data"], np.float32).reshape(1, 8), 2 * x)


def test_request_split_across_many_writes(server):
    gen = _seeded("many writes")
    x = gen.standard_normal((3, 8)).astype(np.float32)
    body, headers = _binary_request(x, "split")
    data = post_request("/v2/models/mlp/infer", body, headers)
    with _connect(server) as sock:
        for k in range(0, len(data), 17):
            sock.sendall(data[k:k + 17])
            time.sleep(0.001)
        _check_binary_answer(*_read_answer(sock, bytearray()), x, "split")


def test_pipelined_over_a_socket(server):
    gen = _seeded("pipelined socket")
    xs = [gen.standard_normal((1, 8)).astype(np.float32) for _ in range(4)]
    requests = [_binary_request(x, f"p{k}") for k, x in enumerate(xs)]
    get = b"GET /v2/health/ready HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
    data = post_request("/v2/models/mlp/infer", *requests[0]) + get + b"".join(
        post_request("/v2/models/mlp/infer", *r) for r in requests[1:])
    with _connect(server) as sock:
        sock.sendall(data)
        buffer = bytearray()
        _check_binary_answer(*_read_answer(sock, buffer), xs[0], "p0")
        assert _read_answer(sock, buffer)[0] == 200
        for k in range(1, 4):
            _check_binary_answer(*_read_answer(sock, buffer), xs[k], f"p{k}")


def test_two_clients_interleaved_each_get_their_own(server):
    """Two connections, each request sent in two halves, the halves of the two alternating; then two threads at once:
    each answer is its own request's (id and tensors)."""
    gen = _seeded("interleaved")
    with _connect(server) as a, _connect(server) as b:
        buffers = {a: bytearray(), b: bytearray()}
        for k in range(5):
            sent = {}
            for sock, name in ((a, "a"), (b, "b")):
                x = gen.standard_normal((1 + k % 3, 8)).astype(np.float32)
                sent[sock] = (x, f"{name}{k}", post_request("/v2/models/mlp/infer", *_binary_request(x, f"{name}{k}")))
            half = {sock: len(data) // 2 for sock, (_, _, data) in sent.items()}
            for sock in (a, b):
                sock.sendall(sent[sock][2][:half[sock]])
            time.sleep(0.002)
            for sock in (b, a):
                sock.sendall(sent[sock][2][half[sock]:])
            for sock in (b, a):
                x, request_id, _ = sent[sock]
                _check_binary_answer(*_read_answer(sock, buffers[sock]), x, request_id)
    failures = []

    def client(name: str) -> None:
        try:
            client_gen = _seeded(f"thread {name}")
            with _connect(server) as sock:
                buffer = bytearray()
                for k in range(30):
                    x = client_gen.standard_normal((1, 8)).astype(np.float32)
                    sock.sendall(post_request("/v2/models/mlp/infer", *_binary_request(x, f"{name}{k}")))
                    _check_binary_answer(*_read_answer(sock, buffer), x, f"{name}{k}")
        except Exception as e:  # noqa: BLE001 - reported by the test
            failures.append(f"{name}: {e!r}")

    threads = [threading.Thread(target=client, args=(n,)) for n in ("s", "t")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures


def test_malformed_requests_answer_and_the_server_serves_on(server):
    """A malformed head: 400 and the connection closes; a malformed body: 400 {"error"} and the connection serves
    on; a client gone mid-body: nothing to answer. A good request on a new connection works after each."""
    gen = _seeded("malformed socket")
    with _connect(server) as sock:
        sock.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\ncontent-length: nope\r\n\r\n")
        status, _, payload = _read_answer(sock, bytearray())
        assert status == 400 and b"Invalid HTTP request" in payload
        assert sock.recv(10) == b""  # closed
    with _connect(server) as sock:
        buffer = bytearray()
        sock.sendall(post_request("/v2/models/mlp/infer", b"{not json"))
        status, headers, payload = _read_answer(sock, buffer)
        assert status == 400 and "not valid JSON" in json.loads(payload)["error"]
        x = gen.standard_normal((1, 8)).astype(np.float32)
        sock.sendall(post_request("/v2/models/mlp/infer", *_binary_request(x, "after")))
        _check_binary_answer(*_read_answer(sock, buffer), x, "after")
    with _connect(server) as sock:
        sock.sendall(post_request("/v2/models/mlp/infer", b"{" * 100)[:-50])  # gone with half its body sent
    with _connect(server) as sock:
        x = gen.standard_normal((2, 8)).astype(np.float32)
        sock.sendall(post_request("/v2/models/mlp/infer", *_binary_request(x, "last")))
        _check_binary_answer(*_read_answer(sock, bytearray()), x, "last")
