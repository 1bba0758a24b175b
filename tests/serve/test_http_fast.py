"""kiln serve's HTTP infer fast path (kiln/serve/http_fast.py) against the FastAPI route it stands in
front of: the same request through each, raw ASGI messages in and out, must give the same status, the
same body and the same protocol headers. Valid requests (JSON and binary, FP16, classification,
gzip, a batched model and a fixed one) and every malformed infer request of test_errors."""

from __future__ import annotations

import gzip
import json
import sys
import zlib

import ml_dtypes
import numpy as np
import pytest
from conftest import RecordingTransport, options, post_request, rng
from test_errors import CASES, binary_body, infer_json

from kiln.serve import ServerThread
from kiln.serve.http_fast import InferFastPath
from kiln.serve.http_server import http_app
from kiln.serve.metrics import MetricsExporter
from kiln.serve.server import _SwitchInterval

COMPARED = ("content-type", "inference-header-content-length", "retry-after")


@pytest.fixture(scope="module")
def core_thread(repository):
    thread = ServerThread(options(repository, http_port=None, grpc_port=None, metrics_port=None))
    server = thread.start()
    yield thread, server.core
    thread.stop()


async def _asgi(app, path: str, body: bytes, headers: dict[str, str], method: str = "POST",
                chunk: int | None = None) -> tuple[int, bytes, dict[str, str]]:
    """One request through an ASGI app: the status, the body and the headers it sent."""
    parts = [body[k:k + chunk] for k in range(0, len(body), chunk)] if chunk and body else [body]
    messages = [{"type": "http.request", "body": p, "more_body": k < len(parts) - 1} for k, p in enumerate(parts)]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    raw_headers = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    raw_headers.append((b"content-length", str(len(body)).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": raw_headers,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], payload, {k.decode().lower(): v.decode() for k, v in start["headers"]}


def _both(core_thread, path: str, body: bytes | str | dict | None, headers: dict | None = None, **kw):
    thread, core = core_thread
    if isinstance(body, dict):
        body = json.dumps(body)
    body = body.encode() if isinstance(body, str) else (body or b"")
    headers = headers or {}
    app = http_app(core, MetricsExporter(list))
    fast = InferFastPath(app, core, 64 << 20)
    return (thread.call(_asgi(app, path, body, headers, **kw)), thread.call(_asgi(fast, path, body, headers, **kw)))


def _same(slow, fast) -> None:
    assert fast[0] == slow[0], (fast, slow)
    assert fast[1] == slow[1], (fast[1][:300], slow[1][:300])
    for key in COMPARED:
        assert fast[2].get(key) == slow[2].get(key), key


def _valid_cases() -> dict[str, tuple]:
    x = rng().standard_normal((3, 8)).astype(np.float32)
    header = {"inputs": [{"name": "x", "shape": [3, 8], "datatype": "FP32", "parameters": {"binary_data_size": 96}}],
              "parameters": {"binary_data_output": True}, "id": "r-1"}
    binary, binary_headers = binary_body(header, x.tobytes())
    mixed = {**header, "outputs": [{"name": "z", "parameters": {"binary_data": False}},
                                   {"name": "y", "parameters": {"classification": 3}}]}
    mixed_body, mixed_headers = binary_body(mixed, x.tobytes())
    h = rng().standard_normal((2, 4)).astype(np.float16)
    b = rng().standard_normal((2, 4)).astype(ml_dtypes.bfloat16)
    half = {"inputs": [{"name": "h", "shape": [2, 4], "datatype": "FP16", "parameters": {"binary_data_size": 16}},
                       {"name": "b", "shape": [2, 4], "datatype": "BF16", "parameters": {"binary_data_size": 16}}],
            "parameters": {"binary_data_output": True}}
    half_body, half_headers = binary_body(half, h.tobytes() + b.tobytes())
    a = rng().standard_normal((2, 3)).astype(np.float32)
    fixed = {"inputs": [{"name": "a", "shape": [2, 3], "datatype": "FP32", "data": a.reshape(-1).tolist()},
                        {"name": "i", "shape": [2, 3], "datatype": "INT64", "data": list(range(6))}]}
    return {
        "JSON": ("/v2/models/mlp/infer", infer_json(data=x[:2].reshape(-1).tolist()), None),
        "binary in and out": ("/v2/models/mlp/infer", binary, binary_headers),
        "version given": ("/v2/models/mlp/versions/2/infer", binary, binary_headers),
        "mixed outputs, classification": ("/v2/models/mlp/infer", mixed_body, mixed_headers),
        "FP16 and BF16": ("/v2/models/half/infer", half_body, half_headers),
        "fixed model, INT64": ("/v2/models/fixed/infer", fixed, None),
        "gzip": ("/v2/models/mlp/infer", gzip.compress(binary), {**binary_headers, "Content-Encoding": "gzip"}),
    }


@pytest.mark.parametrize("case", list(_valid_cases()))
def test_valid_request_answers_as_the_fastapi_route(core_thread, case):
    path, body, headers = _valid_cases()[case]
    slow, fast = _both(core_thread, path, body, headers)
    assert slow[0] == 200, slow
    _same(slow, fast)


def test_body_in_several_messages(core_thread):
    path, body, headers = _valid_cases()["binary in and out"]
    slow, fast = _both(core_thread, path, body, headers, chunk=7)
    assert slow[0] == 200
    _same(slow, fast)


@pytest.mark.parametrize("case", [c for c, v in CASES.items() if v[0].endswith("/infer")])
def test_malformed_request_answers_as_the_fastapi_route(core_thread, case):
    path, body, headers, status, message = CASES[case]
    slow, fast = _both(core_thread, path, body, headers)
    assert fast[0] == status and message in json.loads(fast[1])["error"]
    _same(slow, fast)


def test_too_large_and_other_routes(core_thread, repository):
    thread, core = core_thread
    app = http_app(core, MetricsExporter(list), max_request_bytes=100)
    fast = InferFastPath(app, core, 100)
    body = json.dumps(infer_json()).encode()
    slow_answer = thread.call(_asgi(app, "/v2/models/mlp/infer", body, {}))
    fast_answer = thread.call(_asgi(fast, "/v2/models/mlp/infer", body, {}))
    assert fast_answer[0] == 413
    _same(slow_answer, fast_answer)
    # not infer, or infer with another method: FastAPI answers, through the fast path's app
    for method, path in (("GET", "/v2/models/mlp"), ("GET", "/v2/models/mlp/infer"), ("POST", "/v2/models/x/infer/y")):
        _same(thread.call(_asgi(app, path, b"", {}, method=method)), thread.call(_asgi(fast, path, b"", {}, method=method)))


def test_server_sets_the_switch_interval_while_serving(repository):
    thread = ServerThread(options(repository, http_port=None, grpc_port=None, metrics_port=None,
                                  switch_interval_us=50))
    thread.start()
    try:
        assert sys.getswitchinterval() <= 51e-6  # the smallest any running server asked for
    finally:
        thread.stop()


def test_switch_interval_restored_when_the_last_server_stops():
    switch = _SwitchInterval()
    python = 0.005
    saved = sys.getswitchinterval()  # what the servers of other tests in this process left
    sys.setswitchinterval(python)
    try:
        switch.enter(300)
        switch.enter(100)
        assert sys.getswitchinterval() == pytest.approx(100e-6, abs=2e-6)
        switch.leave()
        assert sys.getswitchinterval() == pytest.approx(100e-6, abs=2e-6)  # one server still runs
        switch.leave()
        assert sys.getswitchinterval() == pytest.approx(python, abs=2e-6)  # Python keeps whole microseconds
    finally:
        sys.setswitchinterval(saved)


async def _through_uvicorn(app, http: str, data: bytes, answers: int) -> RecordingTransport:
    """`data` fed to uvicorn's `http` protocol (httptools or h11) over a recording transport, until `answers`
    responses have been written (or 5 s)."""
    import asyncio

    import uvicorn
    from uvicorn.server import ServerState

    config = uvicorn.Config(app, http=http, lifespan="off", access_log=False, log_level="warning")
    config.load()
    protocol = config.http_protocol_class(config=config, server_state=ServerState(), app_state={},
                                          _loop=asyncio.get_running_loop())
    transport = RecordingTransport()
    protocol.connection_made(transport)
    protocol.data_received(data)
    for _ in range(500):
        if sum(c.count(b"HTTP/1.1 ") for c in transport.calls) >= answers:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.02)  # anything written after the last answer is seen too
    closed = transport.closed
    protocol.connection_lost(None)
    transport.closed = closed  # as the answers left it
    return transport



@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_an_answer_leaves_in_one_write_under_uvicorn(core_thread, http):
    """Under uvicorn the fast path's answer (head and body) is one write: two pipelined requests, two writes, each a
    whole response whose tensors are the FastAPI route's; an error answer likewise; connection: close closes after
    the write. A send that is not uvicorn's gets the two ASGI messages (the tests above)."""
    pytest.importorskip(http)
    thread, core = core_thread
    app = http_app(core, MetricsExporter(list))
    fast = InferFastPath(app, core, 64 << 20)
    path, body, headers = _valid_cases()["binary in and out"]
    expected = thread.call(_asgi(app, path, body, headers))
    assert expected[0] == 200
    one = post_request(path, body, headers)
    bad = post_request("/v2/models/nope/infer", b"{}", {})
    transport = thread.call(_through_uvicorn(fast, http, one + bad, 2))
    assert len(transport.calls) == 2, [c[:60] for c in transport.calls]
    for call, (status, payload) in zip(transport.calls, [(200, expected[1]), (404, None)]):
        head, _, rest = call.partition(b"\r\n\r\n")
        assert head.startswith(f"HTTP/1.1 {status} ".encode()), head
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        assert len(rest) == length
        if payload is not None:
            assert rest == payload
        else:
            assert "nope" in json.loads(rest)["error"]
    assert not transport.closed
    closing = thread.call(_through_uvicorn(fast, http, post_request(path, body, headers, close=True), 1))
    assert len(closing.calls) == 1 and closing.calls[0].endswith(expected[1]) and closing.closed


def _seeded(case: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(case.encode()))


def test_a_repeated_header_answers_each_request_with_its_own_tensors(core_thread):
    """HeaderLayouts: a client repeating its JSON header byte for byte gets its layout decoded from memory. Each of
    these requests (same header, fresh tensors; one header of the same length but another id; one with the binary
    data cut short) must answer as the FastAPI route (no layouts) answers it alone: an answer made from another
    request's tensors, id or outputs fails here."""
    thread, core = core_thread
    app = http_app(core, MetricsExporter(list))
    fast = InferFastPath(app, core, 64 << 20)
    gen = _seeded("repeated header")
    header = {"inputs": [{"name": "x", "shape": [3, 8], "datatype": "FP32", "parameters": {"binary_data_size": 96}}],
              "outputs": [{"name": "z", "parameters": {"binary_data": True}},
                          {"name": "y", "parameters": {"classification": 2}}], "id": "r-1"}
    other = {**header, "id": "r-2"}  # the same length, one byte apart
    requests = [binary_body(h, gen.standard_normal((3, 8)).astype(np.float32).tobytes())
                for h in (header, header, header, other, header, other)]
    short_body, short_headers = binary_body(header, b"\0" * 95)
    requests.append((short_body, short_headers))
    answers, statuses = [], []
    for body, headers in requests:
        slow = thread.call(_asgi(app, "/v2/models/mlp/infer", body, headers))
        answer = thread.call(_asgi(fast, "/v2/models/mlp/infer", body, headers))
        _same(slow, answer)
        statuses.append(answer[0])
        answers.append(answer[1])
    assert statuses == [200] * 6 + [400] and len(set(answers[:6])) == 6  # fresh tensors: every answer differs
    assert b'"id":"r-2"' in answers[3] and b'"id":"r-1"' in answers[4]
    assert json.loads(answers[6])["error"]  # cut short: the full decode's error
    assert len(fast.layouts.known) == 2  # both headers were learned (and the later requests decoded from them)


def test_header_layouts_decode_as_the_full_decode():
    """decode_request with HeaderLayouts against without, request by request: BYTES, FP16 and INT64 inputs of one
    repeated header, then a body of another length; a header of JSON tensors is learned by its pieces around their
    data (tests/serve/test_http_codec_json.py), once: the same header as the extension's decodes from it."""
    from kiln.serve.http_codec import HeaderLayouts, decode_request
    from kiln.serve.shared_memory import SharedMemoryRegistry

    registry, layouts = SharedMemoryRegistry(), HeaderLayouts()
    gen = _seeded("header layouts")

    def body(words: list[bytes]) -> tuple[bytes, str]:
        text = b"".join(len(w).to_bytes(4, "little") + w for w in words)
        h = gen.standard_normal((2, 2)).astype(np.float16).tobytes()
        i = gen.integers(-9, 9, (3,)).astype(np.int64).tobytes()
        header = json.dumps({"inputs": [
            {"name": "s", "shape": [len(words)], "datatype": "BYTES", "parameters": {"binary_data_size": len(text)}},
            {"name": "h", "shape": [2, 2], "datatype": "FP16", "parameters": {"binary_data_size": 8}},
            {"name": "i", "shape": [3], "datatype": "INT64", "parameters": {"binary_data_size": 24}}],
            "parameters": {"timeout": 5000}}).encode()
        return header + text + h + i, str(len(header))

    cases = [body([b"ab", b"cd"]), body([b"xy", b"zw"]), body([b"12", b"34"]), body([b"long word", b"q"])]
    for data, length in cases:
        want, want_options = decode_request(data, length, "m", "", registry)
        got, got_options = decode_request(data, length, "m", "", registry, layouts)
        assert (got.id, got.outputs, got.timeout_us, got.output_places) == (want.id, want.outputs, want.timeout_us,
                                                                           want.output_places)
        assert got_options == want_options and list(got.inputs) == list(want.inputs)
        for name, array in want.inputs.items():
            assert got.inputs[name].dtype == array.dtype and got.inputs[name].shape == array.shape
            assert got.inputs[name].tolist() == array.tolist(), name
    assert len(layouts.known) == 2
    as_json = json.dumps(infer_json()).encode()
    decode_request(as_json, None, "m", "", registry, layouts)
    header = json.dumps(infer_json()).encode()
    decode_request(header, str(len(header)), "m", "", registry, layouts)  # the extension's header, JSON tensors
    assert len(layouts.known) == 3


def test_quick_validation_takes_named_outputs_as_the_full_one(core_thread):
    """core._validate_quickly answers requests that name their outputs (as HTTP clients do) with _validate's answer,
    and leaves unknown or repeated outputs to _validate (its 400s)."""
    from kiln.serve.core import InferRequest, _validate, _validate_quickly

    _, core = core_thread
    model = core.model("mlp", "")
    x = _seeded("quick validation").standard_normal((3, 8)).astype(np.float32)
    for outputs in (None, ["y"], ["z", "y"], []):
        request = InferRequest(model="mlp", inputs={"x": x}, outputs=outputs)
        quick, full = _validate_quickly(request, model), _validate(request, model)
        assert quick is not None and quick[1:] == full[1:] and list(quick[0]) == list(full[0]), outputs
        assert all(quick[0][n] is full[0][n] for n in full[0])
    for outputs in (["q"], ["y", "y"], ["y", "q"]):
        assert _validate_quickly(InferRequest(model="mlp", inputs={"x": x}, outputs=outputs), model) is None


def test_remembered_answer_headers_encode_as_json_dumps():
    """encode_response_pieces' remembered JSON headers (all outputs binary) against the header encoded afresh
    (_encode_pieces), answer by answer: answers repeating, and answers apart in one of model, version, id, an
    output's name, dtype or shape, or an output sent as JSON."""
    from kiln.serve.core import InferResponse
    from kiln.serve.http_codec import OutputOptions, _encode_pieces, encode_response_pieces
    from kiln.serve.shared_memory import SharedMemoryRegistry

    gen, registry = _seeded("answer headers"), SharedMemoryRegistry()
    binary, y_as_json = OutputOptions(True), OutputOptions(True, {"y": False})

    def answer(model="m", version="1", id="", shapes=((2, 3), (4,)), dtypes=(np.float32, np.int64), names="yz"):
        outputs = [(n, (gen.standard_normal(s) * 9).astype(d)) for n, s, d in zip(names, shapes, dtypes)]
        return InferResponse(model=model, version=version, id=id, outputs=outputs)

    variants = [{}, {}, {"model": "n"}, {"version": "2"}, {"id": "a"}, {"id": "b"}, {"names": "yq"},
                {"dtypes": (np.float16, np.int64)}, {"dtypes": (ml_dtypes.bfloat16, np.int64)},
                {"shapes": ((3, 2), (4,))}, {"shapes": ((2, 3), (5,))}, {"shapes": ((2, 3, 1), (4,))}, {}]
    for options in (binary, y_as_json, binary):
        for kw in variants * 2:
            response = answer(**kw)
            got, got_length = encode_response_pieces(response, options, False, registry)
            want, want_length = _encode_pieces(response, options, False, registry)
            assert got_length == want_length and [bytes(p) for p in got] == [bytes(p) for p in want], (kw, got[0])
