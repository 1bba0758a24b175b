"""The server: one event loop running the HTTP frontend (uvicorn), the gRPC frontend (grpc.aio),
the metrics endpoint and every model's batcher, over one ServerCore.

    server = Server(ServeOptions(repository="models/"))
    await server.start()      # loads the models, binds the ports (0: free ones; see server.ports)
    await server.stop()       # graceful: not ready, no new connections, every request in flight answered

`ServerThread` runs one on a background thread (tests, benchmarks, notebooks); `kiln serve` runs
one on the main thread until SIGINT/SIGTERM. Everything binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response

from kiln.serve.core import DEFAULT_MAX_QUEUE_SIZE, ServerCore
from kiln.serve.grpc_server import grpc_server
from kiln.serve.http_fast import InferFastPath
from kiln.serve.http_server import DEFAULT_MAX_REQUEST_BYTES, http_app
from kiln.serve.metrics import CONTENT_TYPE, MetricsExporter
from kiln.serve.repository import ModelRepository

log = logging.getLogger("kiln.serve")
SWITCH_INTERVAL_US = 200


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed (uvicorn's standard extra brings it), else asyncio's: grpc.aio
    and the batcher's callbacks run on it, and on a 2-core VM uvloop took about a quarter off the
    server's CPU time per gRPC request (bench/serve_overhead.py)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(coroutine):
    """asyncio.run on new_event_loop()'s loop (what `kiln serve` runs its server with)."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coroutine)


class _SwitchInterval:
    """The process's GIL switch interval while servers run: set by the first to start (the smallest asked
    for wins), Python's own restored when the last one stops (tests run several servers in one process)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._servers = 0
        self._saved = 0.0

    def enter(self, microseconds: int) -> None:
        with self._lock:
            if self._servers == 0:
                self._saved = sys.getswitchinterval()
            self._servers += 1
            sys.setswitchinterval(min(microseconds / 1e6, sys.getswitchinterval()))

    def leave(self) -> None:
        with self._lock:
            self._servers -= 1
            if self._servers == 0:
                sys.setswitchinterval(self._saved)


_SWITCH = _SwitchInterval()


@dataclass
class ServeOptions:
    repository: str | Path | None = None  # a model repository folder
    model: str | Path | None = None  # or one .onnx/.kiln file
    model_name: str | None = None  # the single model's name (default: the file's stem)
    host: str = "127.0.0.1"
    http_port: int | None = 8000  # None: no HTTP; 0: a free port
    grpc_port: int | None = 8001
    metrics_port: int | None = 8002  # /metrics is also on the HTTP port
    load_models: list[str] | None = None  # explicit model control: load only these at start ([]: none)
    max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE  # per model, where its config sets none
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    shutdown_timeout: float = 30.0  # seconds for requests in flight to finish at shutdown
    log_level: str = "warning"
    # Python's GIL switch interval while serving (None: leave Python's 5 ms). An instance's thread gives the
    # GIL up inside its engine call (a stream sync, a copy, a native segment) and then waits for it behind
    # the event loop, which parses requests without pause under load: up to one interval per give-up. On the
    # H200 (commit 6c09b4d) MobileNetV2 calls of 14 requests took 12.7 ms for ~1 ms of GPU work; a thread
    # with four 0.2-ms GIL-free waits beside a busy one took 22-48 ms at 5 ms, 2.4-3.6 ms at 200 us.
    switch_interval_us: int | None = SWITCH_INTERVAL_US


class _Uvicorn(uvicorn.Server):
    """uvicorn without its signal handlers: the Server owns shutdown (it drains the batchers too)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and without it
    # a response written as headers then body waits ~40 ms for the client's delayed ACK (Nagle)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _metrics_app(metrics: MetricsExporter) -> FastAPI:
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


@dataclass
class Ports:
    http: int | None = None
    grpc: int | None = None
    metrics: int | None = None


@dataclass
class Server:
    options: ServeOptions
    ports: Ports = field(default_factory=Ports)

    def __post_init__(self):
        o = self.options
        if (o.repository is None) == (o.model is None):
            raise ValueError("serve a model repository or one model file (one of repository=, model=)")
        self.repository = (ModelRepository(o.repository) if o.repository is not None
                           else ModelRepository.single(o.model, o.model_name))
        self.core = ServerCore(self.repository, o.max_queue_size)
        self.metrics = MetricsExporter(lambda: [v.stats for v in self.core.ready_versions()])
        self._uvicorns: list[tuple[_Uvicorn, asyncio.Task]] = []
        self._grpc = None
        self._switch_interval = False  # this server set it (restored when the last server stops)
        self.stopped = asyncio.Event()

    async def start(self) -> None:
        o = self.options
        if o.switch_interval_us is not None:
            _SWITCH.enter(o.switch_interval_us)
            self._switch_interval = True
        await self.core.start(o.load_models)
        if o.http_port is not None:
            app = http_app(self.core, self.metrics, o.max_request_bytes)
            self.ports.http = await self._start_http(InferFastPath(app, self.core, o.max_request_bytes), o.http_port)
        if o.metrics_port is not None:
            self.ports.metrics = await self._start_http(_metrics_app(self.metrics), o.metrics_port)
        if o.grpc_port is not None:
            self._grpc, self.ports.grpc = grpc_server(self.core, o.host, o.grpc_port, o.max_request_bytes)
            await self._grpc.start()

    async def _start_http(self, app, port: int) -> int:
        sock = _listen(self.options.host, port)
        config = uvicorn.Config(app, log_level=self.options.log_level, access_log=False, lifespan="off", proxy_headers=False,
                                timeout_graceful_shutdown=self.options.shutdown_timeout, timeout_keep_alive=30,
                                h11_max_incomplete_event_size=1 << 20)
        server = _Uvicorn(config)
        task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                task.result()  # raises what stopped it
                raise OSError(f"the HTTP server on port {port} stopped while starting")
            await asyncio.sleep(0.01)
        self._uvicorns.append((server, task))
        return sock.getsockname()[1]

    async def stop(self) -> None:
        """Graceful: not ready from now; frontends stop taking connections and finish what they
        hold; batchers run everything queued; then the instances' threads stop."""
        self.core.accepting = False
        grace = self.options.shutdown_timeout
        stops = []
        for server, task in self._uvicorns:
            server.should_exit = True
            stops.append(task)
        if self._grpc is not None:
            stops.append(asyncio.ensure_future(self._grpc.stop(grace)))
        if stops:
            await asyncio.gather(*stops, return_exceptions=True)
        await self.core.close()
        if self._switch_interval:
            _SWITCH.leave()
            self._switch_interval = False
        self.stopped.set()

    async def serve_forever(self, on_started=None) -> None:
        """Start, run until SIGINT/SIGTERM, stop gracefully (the main thread's way)."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await self.start()
        if on_started is not None:
            on_started(self)
        await stop.wait()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await self.stop()


class ServerThread:
    """A Server on a background thread with its own event loop: start() returns once it serves."""

    def __init__(self, options: ServeOptions):
        self.options = options
        self.server: Server | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None

    def start(self, timeout: float = 120.0) -> Server:
        self._thread = threading.Thread(target=self._run, name="kiln-serve", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise TimeoutError(f"the server did not start within {timeout} s")
        if self._error is not None:
            raise self._error
        return self.server

    def _run(self) -> None:
        self.loop = new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.server = Server(self.options)
            self.loop.run_until_complete(self.server.start())
        except BaseException as e:  # noqa: BLE001 - handed to the thread that called start()
            self._error = e
            self._started.set()
            self.loop.close()
            return
        self._started.set()
        self.loop.run_until_complete(self.server.stopped.wait())
        self.loop.run_until_complete(self.loop.shutdown_default_executor())
        self.loop.close()

    def call(self, coroutine, timeout: float | None = 60.0):
        """Run a coroutine on the server's loop from another thread; its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self, timeout: float = 60.0) -> None:
        if self.server is None or self.loop is None or self.loop.is_closed():
            return
        self.call(self.server.stop(), timeout)
        self._thread.join(timeout)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
