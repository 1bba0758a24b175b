"""A kiln serve process's ports: HTTP (uvicorn; infer on kiln's HTTP/1.1 protocol, kiln/serve/http_protocol.py, or
the ASGI fast path ahead of FastAPI), gRPC (kiln's own
HTTP/2 transport, kiln/serve/grpc_h2.py, or grpc.aio: options.grpc_transport) and the metrics port, over one core, started together and stopped gracefully together.

The engine process runs them over its ServerCore (`frontends` 0), or only the metrics port while
front-end processes (kiln/serve/frontends.py) run HTTP and gRPC over their RemoteCores, each binding
the same ports with SO_REUSEPORT: the kernel spreads the connections over them.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import socket

import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response

from kiln.serve.core import ServerCore
from kiln.serve.grpc_h2 import GrpcServer
from kiln.serve.grpc_server import SERVICE, InferenceServicer, grpc_server, method_handlers
from kiln.serve.http_fast import InferFastPath
from kiln.serve.http_server import http_app
from kiln.serve.metrics import CONTENT_TYPE, MetricsExporter
from kiln.serve.options import ServeOptions


# uvicorn pauses reading a request once more than its HIGH_WATER_LIMIT (64 KiB) of body waits for the app, and reads
# on at the app's next receive(): a 301 KB image (MobileNetV2's request) came in three pieces, each a pause, a resume
# and a turn of the loop. kiln's infer path takes the whole body (up to --max-request-bytes) as it comes, so bodies up
# to this size are read unpaused: the loop's CPU per 301 KB request fell ~9% (bench/results/serve5-2026-12-05c.md).
BODY_HIGH_WATER = 4 << 20


def _read_bodies_unpaused() -> None:
    """uvicorn's HTTP/1.1 protocols (httptools', h11's) pause no body below BODY_HIGH_WATER (a module constant there,
    no Config option)."""
    for name in ("httptools_impl", "h11_impl"):
        try:
            module = importlib.import_module(f"uvicorn.protocols.http.{name}")
        except ImportError:  # httptools not installed: uvicorn serves with h11
            continue
        module.HIGH_WATER_LIMIT = max(module.HIGH_WATER_LIMIT, BODY_HIGH_WATER)


def _http_protocol(fast: InferFastPath):
    """kiln's HTTP/1.1 protocol (infer answered on httptools' callbacks, kiln/serve/http_protocol.py), or uvicorn's
    own ("auto": h11) where httptools is not installed."""
    try:
        from kiln.serve.http_protocol import infer_protocol
    except ImportError:
        return "auto"
    return infer_protocol(fast)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its signal handlers: the Server owns shutdown (it drains the batchers too)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def listen(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket; `reuse_port`: SO_REUSEPORT, so other front-end processes can listen on the port too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and without it
    # a response written as headers then body waits ~40 ms for the client's delayed ACK (Nagle)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _metrics_app(metrics: MetricsExporter) -> FastAPI:
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(await metrics.scrape(), media_type=CONTENT_TYPE)

    return app


class Frontdoors:
    def __init__(self, options: ServeOptions):
        self.options = options
        self._uvicorns: list[tuple[_Uvicorn, asyncio.Task]] = []
        self._grpc = None

    async def serve(self, core: ServerCore, metrics: MetricsExporter,
                    reuse_port: bool = False) -> tuple[int | None, int | None]:
        """HTTP and gRPC over `core`, where the options ask for them; the ports bound (HTTP, gRPC)."""
        o = self.options
        http = grpc = None
        if o.http_port is not None:
            app = http_app(core, metrics, o.max_request_bytes)
            fast = InferFastPath(app, core, o.max_request_bytes)
            http = await self.start_http(fast, o.http_port, reuse_port, _http_protocol(fast))
        if o.grpc_port is not None:
            grpc = await self.start_grpc(core, reuse_port)
        return http, grpc

    async def start_grpc(self, core: ServerCore, reuse_port: bool) -> int:
        o = self.options
        o.grpc.check()  # GrpcOptionError (a ValueError) naming the flag, before a port is bound
        if o.grpc_transport == "kiln":
            sock = listen(o.host, o.grpc_port, reuse_port)
            self._grpc = GrpcServer(SERVICE, method_handlers(InferenceServicer(core)), o.max_request_bytes, o.grpc)
            await self._grpc.start(sock)
            return sock.getsockname()[1]
        if o.grpc_transport != "grpcio":
            raise ValueError(f"grpc_transport {o.grpc_transport!r}: 'kiln' (kiln's own HTTP/2) or 'grpcio'")
        self._grpc, port = grpc_server(core, o.host, o.grpc_port, o.max_request_bytes, reuse_port, o.grpc)
        await self._grpc.start()
        return port

    async def serve_metrics(self, metrics: MetricsExporter) -> int | None:
        if self.options.metrics_port is None:
            return None
        return await self.start_http(_metrics_app(metrics), self.options.metrics_port)

    async def start_http(self, app, port: int, reuse_port: bool = False, protocol="auto") -> int:
        """uvicorn serving `app` on `port`; `protocol`: uvicorn.Config's `http` (a name, or a protocol factory)."""
        o = self.options
        sock = listen(o.host, port, reuse_port)
        _read_bodies_unpaused()
        config = uvicorn.Config(app, http=protocol, log_level=o.log_level, access_log=False, lifespan="off",
                                proxy_headers=False, timeout_graceful_shutdown=o.shutdown_timeout, timeout_keep_alive=30,
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
        """No new connections; what the servers hold finishes (within the options' shutdown_timeout)."""
        stops = []
        for server, task in self._uvicorns:
            server.should_exit = True
            stops.append(task)
        if self._grpc is not None:
            stops.append(asyncio.ensure_future(self._grpc.stop(self.options.shutdown_timeout)))
        if stops:
            await asyncio.gather(*stops, return_exceptions=True)
        self._uvicorns, self._grpc = [], None
