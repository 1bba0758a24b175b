"""The server: one event loop running the HTTP frontend (uvicorn), the gRPC frontend (kiln's own HTTP/2
transport, kiln/serve/grpc_h2.py, or grpc.aio),
the metrics endpoint and every model's batcher, over one ServerCore; or, with `frontends` N, the
metrics endpoint and the batchers here and HTTP and gRPC in N front-end processes (kiln/serve/frontends.py).

    server = Server(ServeOptions(repository="models/"))
    await server.start()      # loads the models, binds the ports (0: free ones; see server.ports)
    await server.stop()       # graceful: not ready, no new connections, every request in flight answered

`ServerThread` runs one on a background thread (tests, benchmarks, notebooks); `kiln serve` runs
one on the main thread until SIGINT/SIGTERM. Everything binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
from dataclasses import dataclass, field

from kiln.runtime.heap import static_heap
from kiln.serve.core import ServerCore
from kiln.serve.frontdoors import Frontdoors
from kiln.serve.frontends import FrontendPool
from kiln.serve.metrics import MetricsExporter
from kiln.serve.options import ServeOptions, repository_of

log = logging.getLogger("kiln.serve")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed (uvicorn's standard extra brings it), else asyncio's: the gRPC
    transport and the batcher's callbacks run on it, and on a 2-core VM uvloop took about a quarter off the
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
class Ports:
    http: int | None = None
    grpc: int | None = None
    metrics: int | None = None


@dataclass
class Server:
    options: ServeOptions
    ports: Ports = field(default_factory=Ports)

    def __post_init__(self):
        self.repository = repository_of(self.options)
        self.core = ServerCore(self.repository, self.options.max_queue_size, self.options.warm_up,
                               self.options.cuda_sync, self.options.batch_buckets)
        self.metrics = MetricsExporter(lambda: [v.stats for v in self.core.ready_versions()])
        self._doors = Frontdoors(self.options)
        self.frontends: FrontendPool | None = None
        self._switch_interval = False  # this server set it (restored when the last server stops)
        self.stopped = asyncio.Event()

    async def start(self) -> None:
        o = self.options
        if o.switch_interval_us is not None:
            _SWITCH.enter(o.switch_interval_us)
            self._switch_interval = True
        await self.core.start(o.load_models)
        if o.frontends > 0:
            self.frontends = FrontendPool(self.core, self.metrics, o)
            self.ports.http, self.ports.grpc = await self.frontends.start()
        else:
            self.ports.http, self.ports.grpc = await self._doors.serve(self.core, self.metrics)
        self.ports.metrics = await self._doors.serve_metrics(self.metrics)

    async def stop(self) -> None:
        """Graceful: not ready from now; frontends stop taking connections and finish what they
        hold; batchers run everything queued; then the instances' threads stop. Front-end processes
        stop first (the engine serves what they forward until they are gone)."""
        if self.frontends is not None:
            await self.frontends.stop()
        self.core.accepting = False
        await self._doors.stop()
        await self.core.close()
        if self._switch_interval:
            _SWITCH.leave()
            self._switch_interval = False
        self.stopped.set()

    async def serve_forever(self, on_started=None) -> None:
        """Start, run until SIGINT/SIGTERM, stop gracefully (the main thread's way: `kiln serve`, which owns its
        process). While it serves, the heap alive once the models are loaded (torch's modules, the engines) is
        out of the garbage collector's full passes (kiln.static_heap): a CPU engine binding new input shapes
        keeps a few hundred objects a shape, and each full pass scanned the whole process (~110 ms with BERT-base
        loaded, bench/results/first-calls-2026-12-03b.md). A ServerThread inside someone else's process does not
        freeze that process's heap."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await self.start()
        with static_heap():
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
