"""A server's life: models loaded and unloaded through the repository API (HTTP and gRPC), reloaded
with a config, back-pressure (429 with Retry-After, then recovery), per-request timeouts, the body
limit, and a graceful shutdown of `kiln serve` (a subprocess, SIGTERM) that answers every request in
flight. Every server binds 127.0.0.1 on free ports and is stopped by its test."""

from __future__ import annotations

import gc
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import options
from serve_models import READY, lines_until_ready
from tritonclient.utils import InferenceServerException

from kiln.runtime.heap import INTERPRETER_FROZEN
from kiln.serve import Server, ServerThread
from kiln.serve.server import run

REPO = Path(__file__).resolve().parents[2]


def _post(port: int, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", path, body=json.dumps(body) if isinstance(body, dict) else body, headers=headers or {})
    response = connection.getresponse()
    data = response.read()
    connection.close()
    return response.status, (json.loads(data) if data else {}), {k.lower(): v for k, v in response.getheaders()}


def _slow_request(rows: int = 1, **parameters) -> dict:
    body = {"inputs": [{"name": "x", "shape": [rows, 4], "datatype": "FP32", "data": [1.0] * (4 * rows)}]}
    if parameters:
        body["parameters"] = parameters
    return body


@pytest.fixture
def explicit_server(repository, grpc_transport):
    """Explicit model control: nothing loaded at start; a 64 KiB body limit."""
    thread = ServerThread(options(repository, load_models=[], max_request_bytes=64 << 10,
                                  grpc_transport=grpc_transport))
    server = thread.start()
    yield server
    thread.stop()


def test_load_and_unload_over_http(explicit_server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{explicit_server.ports.http}")
    assert client.is_server_ready()
    assert client.get_model_repository_index(), "the index lists models not loaded yet"
    assert not client.is_model_ready("fixed")
    a, i = np.ones((2, 3), np.float32), np.arange(6).reshape(2, 3)
    inputs = [httpclient.InferInput("a", [2, 3], "FP32"), httpclient.InferInput("i", [2, 3], "INT64")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(i)
    with pytest.raises(InferenceServerException, match="not loaded") as caught:
        client.infer("fixed", inputs)
    assert caught.value.status() == "404"
    client.load_model("fixed")
    assert client.is_model_ready("fixed")
    np.testing.assert_array_equal(client.infer("fixed", inputs).as_numpy("i1"), i + 1)
    client.unload_model("fixed")
    assert not client.is_model_ready("fixed")
    index = {r["name"]: r for r in client.get_model_repository_index()}
    assert index["fixed"]["state"] == "UNAVAILABLE" and index["fixed"]["reason"] == "unloaded"
    client.close()


def test_reload_with_a_config_over_grpc(explicit_server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{explicit_server.ports.grpc}")
    client.load_model("mlp")
    assert client.get_model_metadata("mlp").versions == ["2"]
    config = json.dumps({"max_batch_size": 8, "version_policy": {"all": {}},
                         "dynamic_batching": {"preferred_batch_size": [4]}})
    client.load_model("mlp", config=config)  # reload: both versions, the new batch bound
    assert list(client.get_model_metadata("mlp").versions) == ["1", "2"]
    assert client.is_model_ready("mlp", "1") and client.is_model_ready("mlp", "2")
    assert client.get_model_config("mlp", "1").config.max_batch_size == 8
    x = np.random.default_rng().standard_normal((9, 8)).astype(np.float32)
    tensor = grpcclient.InferInput("x", [9, 8], "FP32")
    tensor.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException, match="batch size 9"):
        client.infer("mlp", [tensor], model_version="1")
    client.unload_model("mlp")
    assert not client.is_model_ready("mlp")
    with pytest.raises(InferenceServerException, match="not a Triton model config"):
        client.load_model("mlp", config="{bad")
    with pytest.raises(InferenceServerException, match="not_there"):
        client.load_model("broken")
    assert client.is_server_ready()
    client.close()


def test_body_limit_is_a_413(explicit_server):
    status, answer, _ = _post(explicit_server.ports.http, "/v2/models/mlp/infer", b"x" * (65 << 10))
    assert status == 413 and "limit" in answer["error"]


def test_queue_overflow_answers_429_and_recovers(server):
    """slow: one instance (~40 ms a call), a queue of 2. Ten requests at once: the first runs, two
    wait, the rest are refused at once with Retry-After; afterwards the model serves again."""
    results: list[tuple[int, dict]] = []
    lock = threading.Lock()
    start = threading.Barrier(10)

    def send() -> None:
        start.wait()
        status, _, headers = _post(server.ports.http, "/v2/models/slow/infer", _slow_request())
        with lock:
            results.append((status, headers))

    threads = [threading.Thread(target=send) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    statuses = sorted(s for s, _ in results)
    assert len(statuses) == 10
    assert set(statuses) <= {200, 429}, statuses
    assert 429 in statuses and 200 in statuses, statuses
    assert all(h.get("retry-after") == "1" for s, h in results if s == 429)
    status, _, _ = _post(server.ports.http, "/v2/models/slow/infer", _slow_request())
    assert status == 200
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.ports.http}")
    stats = client.get_inference_statistics("slow")["model_stats"][0]
    assert stats["inference_stats"]["fail"]["count"] >= statuses.count(429)
    client.close()


def test_grpc_overflow_is_resource_exhausted(grpc_server):
    """Over gRPC as over HTTP: past the queue's bound a call is refused at once with RESOURCE_EXHAUSTED and a
    retry-after trailer (tritonclient shows the code only: 6 of the 8 calls go through grpc's generated stub, which
    gives the trailers), and the model serves again afterwards."""
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    server = grpc_server
    codes: list[str] = []
    retry_after: list[str | None] = []
    start = threading.Barrier(8)

    def send() -> None:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
        tensor = grpcclient.InferInput("x", [1, 4], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 4), np.float32))
        start.wait()
        try:
            client.infer("slow", [tensor])
            codes.append("OK")
        except InferenceServerException as e:
            codes.append(e.status())
        finally:
            client.close()

    def send_raw() -> None:
        request = service_pb2.ModelInferRequest(model_name="slow")
        request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
        request.raw_input_contents.append(np.ones((1, 4), np.float32).tobytes())
        with grpc.insecure_channel(f"127.0.0.1:{server.ports.grpc}") as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            start.wait()
            try:
                stub.ModelInfer(request, timeout=60)
                codes.append("OK")
            except grpc.RpcError as e:
                codes.append(str(e.code()))
                if e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    retry_after.append(dict(e.trailing_metadata() or ()).get("retry-after"))

    threads = [threading.Thread(target=send if k % 4 == 0 else send_raw) for k in range(8)]  # 2 tritonclient, 6 raw
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert "OK" in codes and "StatusCode.RESOURCE_EXHAUSTED" in codes, codes
    assert set(codes) <= {"OK", "StatusCode.RESOURCE_EXHAUSTED"}
    assert retry_after and all(value == "1" for value in retry_after), (codes, retry_after)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")  # recovered: serves again
    try:
        x = np.random.default_rng(zlib.crc32(b"after-overflow")).standard_normal((1, 4)).astype(np.float32)
        tensor = grpcclient.InferInput("x", [1, 4], "FP32")
        tensor.set_data_from_numpy(x)
        np.testing.assert_array_equal(client.infer("slow", [tensor]).as_numpy("y"), x)
    finally:
        client.close()


def test_request_timeout_in_the_queue(server):
    """A request whose timeout passes while it waits behind a long call is answered, not run."""
    blocked: list[int] = []
    blocker = threading.Thread(target=lambda: blocked.append(
        _post(server.ports.http, "/v2/models/slow/infer", _slow_request(4))[0]))
    blocker.start()
    # the timed request must arrive while the blocker runs: wait for the one instance to be busy (a fixed
    # sleep let a loaded machine send the timed request first, which then ran at once and answered 200)
    slow = next(v for v in server.core.ready_versions() if v.config.name == "slow")
    deadline = time.monotonic() + 30
    while slow.batcher.idle and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not slow.batcher.idle, "the blocking request never started"
    status, answer, headers = _post(server.ports.http, "/v2/models/slow/infer", _slow_request(timeout=20000))
    blocker.join(60)
    # 20 ms cannot be met behind a ~40 ms call (nor by one of its own)
    assert status == 503 and "timeout" in answer["error"] and headers.get("retry-after") == "1"
    assert blocked == [200]


def _start_cli(repository: Path, *extra: str) -> tuple[subprocess.Popen, dict[str, int]]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "kiln", "serve", str(repository), "--http-port", "0", "--grpc-port", "0",
         "--metrics-port", "-1", "--shutdown-timeout", "20", *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = lines_until_ready(process, 120)
    if lines and lines[-1].strip() == READY:
        found = (re.match(r"kiln serve: (HTTP|gRPC) on 127\.0\.0\.1:(\d+)", line) for line in lines)
        return process, {f.group(1): int(f.group(2)) for f in found if f}
    process.kill()
    raise AssertionError("kiln serve did not start:\n" + "".join(lines))


SLOW_QUEUE = """
max_batch_size: 4
dynamic_batching { preferred_batch_size: [4] max_queue_delay_microseconds: 5000000 }
"""


@pytest.mark.parametrize("frontends", ["0", "2"])
def test_sigterm_answers_every_request_in_flight(tmp_path, engines, repository, frontends):
    """Three requests wait (a 5 s queue delay holds them), two over HTTP and one over gRPC (tritonclient), when kiln
    serve gets SIGTERM: all answered (with 2 front-end processes too: they finish what they forwarded before the
    engine stops)."""
    (tmp_path / "slowq" / "1").mkdir(parents=True)
    (tmp_path / "slowq" / "1" / "model.kiln").write_bytes((engines / "slow.kiln").read_bytes())
    (tmp_path / "slowq" / "config.pbtxt").write_text(SLOW_QUEUE)
    process, ports = _start_cli(tmp_path, "--frontends", frontends)
    try:
        statuses: list[int | str] = []

        def over_grpc() -> None:
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{ports['gRPC']}")
            x = np.full((1, 4), 2.5, np.float32)
            tensor = grpcclient.InferInput("x", [1, 4], "FP32")
            tensor.set_data_from_numpy(x)
            try:
                answer = client.infer("slowq", [tensor], client_timeout=60).as_numpy("y")
                statuses.append(200 if np.array_equal(answer, x) else f"gRPC answer {answer}")
            except InferenceServerException as e:
                statuses.append(f"gRPC {e.status()}: {e.message()}")
            finally:
                client.close()

        threads = [threading.Thread(target=lambda: statuses.append(
            _post(ports["HTTP"], "/v2/models/slowq/infer", _slow_request())[0])) for _ in range(2)]
        threads.append(threading.Thread(target=over_grpc))
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while _metric(ports["HTTP"], "nv_inference_pending_request_count") != "3" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _metric(ports["HTTP"], "nv_inference_pending_request_count") == "3"
        process.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert statuses == [200, 200, 200], (statuses, output)
    # issue 14: the engine aborted after its graceful stop (a daemon thread inside torch as the interpreter finalized)
    assert "terminate called" not in output and "Fatal Python error" not in output, output
    assert process.returncode == 0, output
    assert "kiln serve: stopped" in output


def test_closing_a_model_ends_its_instances_threads(repository):
    """A batcher's close() returns once its instances' threads have ended, not only been told to (issue 14: `kiln
    serve` exits right after, and a daemon thread still ending while the interpreter finalizes may be inside torch,
    which aborts the process after every request was answered)."""
    thread = ServerThread(options(repository, load_models=["mlp"]))
    server = thread.start()
    try:
        x = np.random.default_rng(zlib.crc32(b"close ends the threads")).standard_normal((3, 8)).astype(np.float32)
        status, answer, _ = _post(server.ports.http, "/v2/models/mlp/infer", {"inputs": [
            {"name": "x", "shape": [3, 8], "datatype": "FP32", "data": x.ravel().tolist()}]})
        assert status == 200, answer
        version = next(v for v in server.core.ready_versions() if v.config.name == "mlp")
        assert version.batcher.instances and all(i.thread.is_alive() for i in version.batcher.instances)

        async def close_and_look() -> list[bool]:
            await version.batcher.close()
            return [i.thread.is_alive() for i in version.batcher.instances]  # at once, on the loop: before, alive

        assert not any(thread.call(close_and_look())), "close() returned before its instances' threads ended"
    finally:
        thread.stop()


def _metric(port: int, name: str) -> str | None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    connection.close()
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return line.rsplit(" ", 1)[1]
    return None


def test_listening_sockets_say_tcp():
    """asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto is TCP; without it a response
    written as headers then body waited ~40 ms for the client's delayed ACK."""
    import socket

    from kiln.serve.frontdoors import listen as _listen

    sock = _listen("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()


def test_kiln_serve_keeps_its_loaded_heap_out_of_the_collector_while_it_serves(repository):
    """`kiln serve`'s loop (Server.serve_forever on the main thread) freezes the heap alive once its models are
    loaded (kiln.static_heap: the collector's full passes skip it), answers requests so, and gives the heap back
    when it stops; a ServerThread (someone else's process) freezes nothing."""
    gc.collect()
    assert gc.get_freeze_count() <= INTERPRETER_FROZEN
    seen: dict[str, object] = {}

    def ask(server: Server) -> None:  # a client on another thread, then SIGTERM as an operator sends it
        try:
            client = httpclient.InferenceServerClient(f"127.0.0.1:{server.ports.http}")
            seen["frozen"] = gc.get_freeze_count()
            seen["ready"] = client.is_server_ready() and client.is_model_ready("fixed")
            client.close()
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    run(Server(options(repository)).serve_forever(lambda server: threading.Thread(target=ask, args=(server,)).start()))
    assert seen["ready"]
    assert seen["frozen"] > 1000, "the loaded heap was not frozen while serving"
    assert gc.get_freeze_count() <= INTERPRETER_FROZEN, "the heap was not given back when the server stopped"
    thread = ServerThread(options(repository))
    thread.start()
    try:
        assert gc.get_freeze_count() <= INTERPRETER_FROZEN
    finally:
        thread.stop()
