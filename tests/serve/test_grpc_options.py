"""tritonserver's gRPC production options (kiln/serve/grpc_options.py) on both transports: real tritonclient.grpc
clients over TLS with a CA made here and over mutual TLS (a client without a certificate is refused), compressed
requests and responses (the client's compression_algorithm; a raw HTTP/2 client sees the answer's grpc-encoding),
a decompression bomb answered RESOURCE_EXHAUSTED with the server still serving, the server's keepalive PINGs
(and a connection that leaves them unanswered closed), a PING flood ended with GOAWAY ENHANCE_YOUR_CALM
too_many_pings, and bad flag values refused by `kiln serve` with the flag named. Every answer is checked against
the engine's own."""

from __future__ import annotations

import queue
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import options
from test_grpc_h2 import RawClient
from tls_certificates import write_certificates
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from kiln.cli import main as kiln_main
from kiln.serve import ServerThread, grpc_h2
from kiln.serve.grpc_compression import accepted, compress, decompress, response_encoding
from kiln.serve.grpc_options import GrpcOptionError, GrpcOptions
from kiln.serve.h2_frames import (ACK, DATA, END_HEADERS, END_STREAM, ENHANCE_YOUR_CALM, GOAWAY, HEADERS, PING,
                                  SETTINGS, frame)
from kiln.serve.h2_keepalive import Keepalive

LIMIT = 1 << 20  # max_request_bytes of these servers: the bound on decompressed requests too
TRANSPORTS = ["kiln", "grpcio"]


# ---- certificates: a CA, a server certificate, a client certificate (tests/serve/tls_certificates.py) ----

@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("certs")
    write_certificates(folder)
    return folder


# ---- servers ----

def _serve(repository, transport: str, grpc_options: GrpcOptions):
    thread = ServerThread(options(repository, http_port=None, metrics_port=None, grpc_transport=transport,
                                  max_request_bytes=LIMIT, load_models=["mlp"], grpc=grpc_options))
    return thread, thread.start()


@pytest.fixture(scope="module", params=TRANSPORTS)
def plain_server(request, repository):
    """Plaintext, responses compressed at level low, keepalive PINGs every 0.2 s with no call open, ACKs due
    within 0.5 s, no limit on pings without data; gRPC's default policing of clients' pings."""
    thread, server = _serve(repository, request.param, GrpcOptions(
        infer_response_compression_level="low", keepalive_time_ms=200, keepalive_timeout_ms=500,
        keepalive_permit_without_calls=True, http2_max_pings_without_data=0))
    yield server
    assert server.core.ready
    thread.stop()


@pytest.fixture(scope="module", params=TRANSPORTS)
def tls_server(request, repository, certs):
    thread, server = _serve(repository, request.param, GrpcOptions(
        use_ssl=True, server_cert=str(certs / "server.crt"), server_key=str(certs / "server.key"),
        infer_response_compression_level="med"))
    yield server
    thread.stop()


@pytest.fixture(scope="module", params=TRANSPORTS)
def mutual_server(request, repository, certs):
    thread, server = _serve(repository, request.param, GrpcOptions(
        use_ssl_mutual=True, server_cert=str(certs / "server.crt"), server_key=str(certs / "server.key"),
        root_cert=str(certs / "ca.crt")))
    yield server
    thread.stop()


def _x(rows: int = 5) -> np.ndarray:
    return np.random.default_rng().standard_normal((rows, 8)).astype(np.float32)


def _check_infer(client: grpcclient.InferenceServerClient, engine, compression: str | None = None) -> None:
    x = _x()
    tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer("mlp", [tensor], compression_algorithm=compression, client_timeout=30)
    expected = engine.run({"x": x})
    np.testing.assert_allclose(result.as_numpy("y"), expected["y"], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(result.as_numpy("z"), 2 * x)


def _client(server, certs: Path | None = None, client_cert: bool = True) -> grpcclient.InferenceServerClient:
    if certs is None:
        return grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
    return grpcclient.InferenceServerClient(
        f"127.0.0.1:{server.ports.grpc}", ssl=True, root_certificates=str(certs / "ca.crt"),
        private_key=str(certs / "client.key") if client_cert else None,
        certificate_chain=str(certs / "client.crt") if client_cert else None)


# ---- TLS ----

def test_tls(tls_server, certs, engine_of):
    """Unary calls (requests plain, gzip, deflate; answers deflate at level med) and a ModelStreamInfer stream
    (its answers compressed too, on the event loop) over TLS."""
    client = _client(tls_server, certs, client_cert=False)
    try:
        assert client.is_server_live() and client.is_model_ready("mlp")
        for compression in (None, "gzip", "deflate"):
            _check_infer(client, engine_of("mlp", "2"), compression)
        answers: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)), compression_algorithm="gzip")
        sent = {}
        try:
            for k in range(4):
                x = np.tile(_x(1), (k + 1, 1))  # repeated rows: answers that compress
                sent[str(k)] = x
                tensor = grpcclient.InferInput("x", list(x.shape), "FP32")
                tensor.set_data_from_numpy(x)
                client.async_stream_infer("mlp", [tensor], request_id=str(k))
            for _ in range(4):
                result, error = answers.get(timeout=30)
                assert error is None, error
                np.testing.assert_array_equal(result.as_numpy("z"), 2 * sent[result.get_response().id])
        finally:
            client.stop_stream()
    finally:
        client.close()
    plain = _client(tls_server)  # a plaintext client gets no answer from a TLS port
    try:
        with pytest.raises(InferenceServerException):
            plain.is_server_live(client_timeout=5)
    finally:
        plain.close()


def test_mutual_tls_refuses_a_client_without_a_certificate(mutual_server, certs, engine_of):
    client = _client(mutual_server, certs)
    try:
        assert client.is_server_ready()
        _check_infer(client, engine_of("mlp", "2"))
    finally:
        client.close()
    anonymous = _client(mutual_server, certs, client_cert=False)
    try:
        with pytest.raises(InferenceServerException) as refused:
            anonymous.is_server_live(client_timeout=10)
        assert refused.value.status() == "StatusCode.UNAVAILABLE"
    finally:
        anonymous.close()
    client = _client(mutual_server, certs)  # still serving the ones with a certificate
    try:
        _check_infer(client, engine_of("mlp", "2"))
    finally:
        client.close()


# ---- compression ----

def test_compressed_requests_and_responses(plain_server, engine_of):
    client = _client(plain_server)
    try:
        for compression in (None, "gzip", "deflate"):
            _check_infer(client, engine_of("mlp", "2"), compression)
    finally:
        client.close()


def _mlp_request(x: np.ndarray) -> bytes:
    request = pb.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    return request.SerializeToString()


def _raw_call(client: RawClient, stream: int, message: bytes, flag: int, metadata: tuple):
    client.send(frame(HEADERS, END_HEADERS, stream, client.headers("ModelInfer", metadata)),
                frame(DATA, END_STREAM, stream, struct.pack(">BI", flag, len(message)) + message))
    return client.answer(stream)


@pytest.mark.parametrize("where", ["on the event loop", "on a thread"])
def test_response_compressed_with_the_level_and_what_the_client_accepts(plain_server, engine_of, where, monkeypatch):
    """Level low: gzip for a client accepting both (gRPC core's choice), deflate for one accepting only deflate,
    none for one accepting neither; a gzip request read as well. The rows repeat so that the answer compresses
    (an answer that would not shrink goes uncompressed, as gRPC core sends it). Kiln's transport compresses
    large answers on a thread: here every answer, with the threshold at 0."""
    if where == "on a thread":
        monkeypatch.setattr(grpc_h2, "COMPRESS_IN_THREAD_BYTES", 0)
    client = RawClient(plain_server.ports.grpc)
    try:
        x = np.tile(_x(1), (16, 1))
        expected = engine_of("mlp", "2").run({"x": x})
        for stream, accepts, encoding in ((1, "identity,deflate,gzip", "gzip"), (3, "deflate", "deflate"),
                                          (5, "identity", None)):
            request = _mlp_request(x)
            sent = compress(request, "gzip") if stream == 1 else request
            metadata = (("grpc-accept-encoding", accepts),) + ((("grpc-encoding", "gzip"),) if stream == 1 else ())
            answer = _raw_call(client, stream, sent, 1 if stream == 1 else 0, metadata)
            assert answer.status == 0, answer.trailers
            flag, size = struct.unpack(">BI", answer.data[:5])
            assert size == len(answer.data) - 5
            body = answer.data[5:]
            if encoding is None:
                assert flag == 0 and b"grpc-encoding" not in answer.headers
            else:
                assert (flag, answer.headers.get(b"grpc-encoding")) == (1, encoding.encode()), (stream, answer.headers)
                body = zlib.decompressobj({"gzip": 31, "deflate": 15}[encoding]).decompress(body)
            response = pb.ModelInferResponse.FromString(body)
            y = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(16, 4)
            np.testing.assert_allclose(y, expected["y"], rtol=1e-6, atol=1e-6)
    finally:
        client.close()


def test_decompression_bomb_is_resource_exhausted(plain_server, engine_of):
    """8 MB of zeros in ~8 KB of gzip, against a 1 MB limit: refused without being inflated whole, the
    connection and the server still serving."""
    bomb = compress(b"\0" * (8 << 20), "gzip")
    assert len(bomb) < LIMIT
    client = RawClient(plain_server.ports.grpc)
    try:
        answer = _raw_call(client, 1, bomb, 1, (("grpc-encoding", "gzip"),))
        assert answer.status == 8, answer.trailers  # RESOURCE_EXHAUSTED
        x = _x(2)
        answer = _raw_call(client, 3, _mlp_request(x), 0, ())
        assert answer.status == 0
    finally:
        client.close()
    triton = _client(plain_server)  # tritonclient's own gzip of a tensor past the limit once inflated
    try:
        zeros = np.zeros((LIMIT // 32 + 1024, 8), np.float32)
        tensor = grpcclient.InferInput("x", list(zeros.shape), "FP32")
        tensor.set_data_from_numpy(zeros)
        with pytest.raises(InferenceServerException) as refused:
            triton.infer("mlp", [tensor], compression_algorithm="gzip", client_timeout=30)
        assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        _check_infer(triton, engine_of("mlp", "2"), "gzip")
    finally:
        triton.close()


def test_compression_codec():
    message = np.random.default_rng().bytes(3000) * 4
    for encoding in ("gzip", "deflate"):
        packed = compress(message, encoding)
        assert len(packed) < len(message)
        assert decompress(packed, encoding, len(message)) == message
        with pytest.raises(Exception, match="larger than max") as big:
            decompress(packed, encoding, len(message) - 1)
        assert big.value.code.name == "RESOURCE_EXHAUSTED"
        with pytest.raises(Exception, match="truncated") as cut:
            decompress(packed[:-5], encoding, len(message))
        assert cut.value.code.name == "INTERNAL"
    assert accepted(b"identity, deflate,gzip") == ("gzip", "deflate")
    for level, accepts, chosen in (("none", ("gzip", "deflate"), None), ("low", ("gzip", "deflate"), "gzip"),
                                   ("med", ("gzip", "deflate"), "deflate"), ("high", ("gzip", "deflate"), "deflate"),
                                   ("high", ("gzip",), "gzip"), ("low", (), None)):
        assert response_encoding(level, accepts) == chosen


# ---- keepalive ----

def _frames_for(client: RawClient, seconds: float, acks: int) -> list[tuple[float, int, int]]:
    """(time, type, flags) of each frame read within `seconds`, the server's first `acks` PINGs acknowledged;
    stops early when the connection closes (then a (time, -1, 0) row)."""
    start, seen = time.monotonic(), []
    while (left := seconds - (time.monotonic() - start)) > 0:
        got = client.read_frame(timeout=min(left, 0.25))
        if got is None:
            try:
                client.sock.settimeout(0.01)
                closed = client.sock.recv(1, 2) == b""  # MSG_PEEK: an orderly close, not a quiet moment
            except (TimeoutError, BlockingIOError):
                closed = False
            except OSError:
                closed = True
            if closed:
                seen.append((time.monotonic() - start, -1, 0))
                return seen
            continue
        kind, flags, _, payload = got
        seen.append((time.monotonic() - start, kind, flags))
        if kind == SETTINGS and not flags & ACK:
            client.send(frame(SETTINGS, ACK, 0))
        if acks and kind == PING and not flags & ACK:
            client.send(frame(PING, ACK, 0, payload))
            acks -= 1
    return seen


def test_keepalive_pings_and_their_timeout(plain_server):
    answering = RawClient(plain_server.ports.grpc)
    silent = None
    try:
        seen = _frames_for(answering, 1.5, acks=1000)
        pings = [t for t, kind, flags in seen if kind == PING and not flags & ACK]
        assert len(pings) >= 3, seen  # every 0.2 s with no call open (permit_without_calls)
        assert -1 not in [kind for _, kind, _ in seen]
        # the first acknowledged (grpcio's opening PING is its flow-control probe, whose timeout is a minute)
        silent = RawClient(plain_server.ports.grpc)
        seen = _frames_for(silent, 5.0, acks=1)
        assert seen[-1][1] == -1, f"a connection leaving PINGs unanswered was not closed: {seen}"
    finally:
        answering.close()
        if silent is not None:
            silent.close()


def test_ping_flood_ends_with_goaway_too_many_pings(plain_server, engine_of):
    client = RawClient(plain_server.ports.grpc)
    try:
        goaway = None
        for k in range(10):
            try:
                client.send(frame(PING, 0, 0, struct.pack(">Q", k)))
            except OSError:
                break
            time.sleep(0.02)
        while (got := client.read_frame(timeout=5)) is not None:
            if got[0] == GOAWAY:
                goaway = got[3]
                break
        assert goaway is not None, client.seen
        assert int.from_bytes(goaway[4:8], "big") == ENHANCE_YOUR_CALM and goaway[8:] == b"too_many_pings"
        acked = [f for f in client.seen if f[0] == PING and f[1] & ACK]
        assert 3 <= len(acked) <= 4, client.seen  # the first free, 2 strikes allowed, the third ends it (grpcio
        # acknowledges that one before its GOAWAY)
    finally:
        client.close()
    triton = _client(plain_server)
    try:
        _check_infer(triton, engine_of("mlp", "2"))
    finally:
        triton.close()


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_ping_policy_counts_strikes_as_grpc_core_does():
    clock = _Clock()
    calls = [False]
    policy = Keepalive(GrpcOptions(http2_min_recv_ping_interval_without_data_ms=1000, http2_max_ping_strikes=2),
                       lambda payload: None, lambda: None, lambda: calls[0], clock)
    calls[0] = True
    assert policy.ping_received() is False  # the first: nothing to compare with
    clock.now += 1.5
    assert policy.ping_received() is False  # after the interval: no strike
    clock.now += 0.1
    assert [policy.ping_received(), policy.ping_received()] == [False, False] and policy.strikes == 2
    assert policy.ping_received() is True  # the third strike
    policy.data_sent()  # answers flowing: strikes and the last ping forgotten
    assert policy.strikes == 0 and policy.ping_received() is False and policy.ping_received() is False
    calls[0] = False  # idle without permit_without_calls: 2 hours between pings
    clock.now += 1000
    assert policy.ping_received() is False and policy.strikes == 2
    unlimited = Keepalive(GrpcOptions(http2_max_ping_strikes=0), lambda payload: None, lambda: None, lambda: True,
                          clock)
    assert not any(unlimited.ping_received() for _ in range(50))


# ---- flags ----

@pytest.mark.parametrize("flags, says", [
    (["--grpc-use-ssl"], "--grpc-use-ssl needs --grpc-server-cert and --grpc-server-key"),
    (["--grpc-use-ssl=true", "--grpc-server-cert", "/nonexistent.crt", "--grpc-server-key", "/nonexistent.key"],
     "--grpc-server-cert '/nonexistent.crt': no such file"),
    (["--grpc-use-ssl-mutual", "--grpc-server-cert", "{certs}/server.crt", "--grpc-server-key", "{certs}/server.key"],
     "--grpc-use-ssl-mutual needs --grpc-root-cert"),
    (["--grpc-use-ssl", "--grpc-server-cert", "{certs}/server.crt", "--grpc-server-key", "{certs}/client.key"],
     "a certificate and its own key"),
    (["--grpc-root-cert", "{certs}/ca.crt"], "--grpc-root-cert given without --grpc-use-ssl"),
    (["--grpc-keepalive-time", "0"], "--grpc-keepalive-time 0: give an integer from 1"),
    (["--grpc-keepalive-timeout", "-5"], "--grpc-keepalive-timeout -5: give an integer from 1"),
    (["--grpc-http2-max-ping-strikes", "-1"], "--grpc-http2-max-ping-strikes -1: give an integer from 0"),
    (["--grpc-http2-min-recv-ping-interval-without-data", "9999999999"],
     "--grpc-http2-min-recv-ping-interval-without-data 9999999999"),
])
def test_bad_flag_values_are_named(flags, says, certs, tmp_path, capsys):
    code = kiln_main(["serve", str(tmp_path), *[f.format(certs=certs) for f in flags]])
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("kiln serve: error: ") and says in err, err


@pytest.mark.parametrize("flags, says", [
    (["--grpc-use-ssl=maybe"], "'maybe' is not a boolean"),
    (["--grpc-infer-response-compression-level", "max"], "invalid choice: 'max'"),
    (["--grpc-keepalive-time", "soon"], "invalid int value: 'soon'"),
])
def test_unparsable_flag_values_are_usage_errors(flags, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        kiln_main(["serve", str(tmp_path), *flags])
    assert exited.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_server_refuses_bad_options_before_serving(repository, transport):
    """Options built in code (not through the CLI) are checked too, before the gRPC port is bound."""
    thread = ServerThread(options(repository, http_port=None, metrics_port=None, grpc_transport=transport,
                                  load_models=[], grpc=GrpcOptions(http2_max_ping_strikes=-3)))
    with pytest.raises(GrpcOptionError, match="--grpc-http2-max-ping-strikes -3"):
        thread.start()


def test_front_end_processes_take_the_options(repository, certs, engine_of):
    """With --frontends the options reach each front-end process (kiln's transport): TLS and compressed requests."""
    thread = ServerThread(options(repository, http_port=None, metrics_port=None, frontends=1, load_models=["mlp"],
                                  grpc=GrpcOptions(use_ssl=True, server_cert=str(certs / "server.crt"),
                                                   server_key=str(certs / "server.key"))))
    server = thread.start()
    try:
        client = _client(server, certs, client_cert=False)
        try:
            for compression in (None, "gzip"):
                _check_infer(client, engine_of("mlp", "2"), compression)
        finally:
            client.close()
    finally:
        thread.stop()
