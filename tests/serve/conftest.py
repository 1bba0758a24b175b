"""Fixtures of the server tests: a repository of small models (engines built once per session) and
one server on 127.0.0.1, free ports, in this process (a ServerThread), shared by the tests that only
read from it. Tests that load, unload, overflow or stop a server start their own."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc")
pytest.importorskip("fastapi")

from serve_models import write_repository

import kiln
from kiln.serve import ServeOptions, ServerThread


@pytest.fixture(scope="session")
def engines(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="session")
def repository(tmp_path_factory, engines) -> Path:
    return write_repository(tmp_path_factory.mktemp("repository"), engines)


def run_clients(client: Callable[[int], None], count: int, timeout: float, failures: list[str]) -> None:
    """client(0) .. client(count - 1) at once, a thread each; fails if one has not finished after timeout seconds
    or any of them appended to failures (the first five shown)."""
    threads = [threading.Thread(target=client, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), f"a client did not finish in {timeout:.0f} s"
    assert not failures, failures[:5]


def options(repository: Path, **overrides) -> ServeOptions:
    """127.0.0.1, free ports, a short shutdown: what every test server uses."""
    return ServeOptions(**{"repository": repository, "host": "127.0.0.1", "http_port": 0, "grpc_port": 0,
                           "metrics_port": 0, "shutdown_timeout": 10.0, **overrides})


class RecordingTransport:
    """What an HTTP/1.1 protocol (uvicorn's, kiln's) writes, as a transport: each write or writelines call's bytes,
    and whether it closed."""

    def __init__(self):
        self.calls: list[bytes] = []
        self.closed = False

    def write(self, data):
        self.calls.append(bytes(data))

    def writelines(self, parts):
        self.calls.append(b"".join(bytes(p) for p in parts))

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5000)}.get(name, default)

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass

    def set_protocol(self, protocol):
        pass


def post_request(path: str, body: bytes, headers: dict | None = None, close: bool = False) -> bytes:
    """An HTTP/1.1 POST of `body` to `path` (Content-Length), its headers `headers`, Connection: close if `close`."""
    head = [f"POST {path} HTTP/1.1", "host: 127.0.0.1", f"content-length: {len(body)}"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()] + (["connection: close"] if close else [])
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


@pytest.fixture(scope="session")
def server(repository):
    thread = ServerThread(options(repository))
    running = thread.start()
    yield running
    thread.stop()


@pytest.fixture(scope="session", params=["kiln", "grpcio"])
def grpc_transport(request) -> str:
    """Each gRPC test runs over both transports: kiln's own HTTP/2 (kiln/serve/grpc_h2.py) and grpc.aio."""
    return request.param


@pytest.fixture(scope="session")
def grpc_server(repository, grpc_transport):
    """A server of the repository with its gRPC on `grpc_transport` (and HTTP: tests checking one protocol's
    calls through the other)."""
    thread = ServerThread(options(repository, metrics_port=None, grpc_transport=grpc_transport))
    running = thread.start()
    yield running
    thread.stop()


@pytest.fixture
def http(server):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.ports.http}", connection_timeout=30,
                                              network_timeout=30)
    yield client
    client.close()


@pytest.fixture
def grpc(grpc_server):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_server.ports.grpc}")
    yield client
    client.close()


@pytest.fixture(scope="session")
def engine_of(repository):
    """The repository's engines run directly, the oracle every served answer is checked against."""
    cache = {}

    def load(name: str, version: str = "1") -> kiln.Engine:
        if (name, version) not in cache:
            cache[name, version] = kiln.load(repository / name / version / "model.kiln")
        return cache[name, version]

    return load


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rng() -> np.random.Generator:
    return np.random.default_rng()
