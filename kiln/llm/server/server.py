"""Running the OpenAI server: one uvicorn on the event loop, the engine on its own thread.

    server = LLMServer(ServerOptions(model="path/to/hf-folder", port=0))
    server.start_in_thread()   # tests, notebooks: returns once it listens (server.port: the port bound)
    ...
    server.stop()

`kiln llm serve` runs `serve_forever()` on the main thread until SIGINT/SIGTERM. It binds 127.0.0.1
unless told otherwise; `max_lifetime` stops it by itself after that many seconds (tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn

from kiln.llm.async_engine import AsyncLLM
from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.server.app import build_app
from kiln.llm.server.metrics import LLMMetrics

log = logging.getLogger("kiln.llm")


@dataclass
class ServerOptions:
    model: str | Path
    served_model_name: str | None = None  # default: the folder's name
    host: str = "127.0.0.1"
    port: int = 8000  # 0: a free one
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_pending: int = 1024  # requests in flight before 429
    max_lifetime: float | None = None  # seconds, then stop by itself
    log_level: str = "warning"


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the caller owns signals (kiln llm serve) or there are none (a thread)
        yield


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP: asyncio then sets TCP_NODELAY on accepted sockets (no ~40 ms Nagle/delayed-ACK stalls
    # between an SSE chunk's header and body)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class LLMServer:
    def __init__(self, options: ServerOptions):
        self.options = options
        self.model_name = options.served_model_name or Path(options.model).resolve().name
        self.metrics: LLMMetrics | None = None
        engine = LLMEngine(options.model, options.engine, observer=lambda event, f: self.metrics.observe(event, f))
        self.metrics = LLMMetrics(engine, self.model_name)
        self.llm = AsyncLLM(engine)
        self.app = build_app(self.llm, self.model_name, self.metrics, options.max_pending)
        self._socket = _listen(options.host, options.port)
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(self.app, log_level=options.log_level, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5)
        self._uvicorn = _Uvicorn(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.options.host}:{self.port}"

    async def serve(self) -> None:
        self.llm.start()
        timer = None
        if self.options.max_lifetime is not None:
            timer = asyncio.get_running_loop().call_later(self.options.max_lifetime, self.request_stop)
        try:
            await self._uvicorn.serve(sockets=[self._socket])
        finally:
            if timer is not None:
                timer.cancel()
            self.llm.stop()

    async def serve_forever(self, started=None) -> None:
        """serve() until SIGINT/SIGTERM (or max_lifetime); `started(self)` once it listens."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_stop)
        task = asyncio.ensure_future(self.serve())
        while not self._uvicorn.started and not task.done():
            await asyncio.sleep(0.05)
        if started is not None and self._uvicorn.started:
            started(self)
        await task

    def request_stop(self) -> None:
        self._uvicorn.should_exit = True

    def start_in_thread(self, timeout: float = 60.0) -> LLMServer:
        self._thread = threading.Thread(target=lambda: asyncio.run(self.serve()), name="kiln-llm-server", daemon=True)
        self._thread.start()
        for _ in range(int(timeout * 20)):
            if self._uvicorn.started:
                return self
            if not self._thread.is_alive():
                raise RuntimeError("kiln llm server thread exited before it started")
            threading.Event().wait(0.05)
        raise TimeoutError(f"kiln llm server did not start within {timeout} s")

    def stop(self, timeout: float = 30.0) -> None:
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)
