"""Front-end processes (`kiln serve --frontends N`): HTTP and gRPC past one Python event loop.

The engine process (the one Server runs in) keeps the models, their batchers and instances (one CUDA
context) and the metrics port. N front-end processes (kiln/serve/frontend_process.py) each run the
HTTP and gRPC servers on the same ports, bound with SO_REUSEPORT (the engine holds each port bound,
not listening, so a port 0 resolves to one number for all), decode the requests, send them here over
a Unix socket (kiln/serve/ipc.py: tensors out of band, no pickling copy) and encode the answers. The
batchers here merge the requests of every front end.

    engine process: ServerCore, batchers, instances, /metrics port, this FrontendPool
        └─ Unix socket ─ front end k: uvicorn + gRPC (kiln/serve/grpc_h2.py or grpc.aio) on the shared ports,
                         RemoteCore

Health, metadata, config, the repository index and the shared-memory status are answered by each front
end from a View of the engine's model table and shared-memory regions, sent at start and after every
load, unload, register and unregister; statistics, /metrics on the HTTP port, infer, load, unload,
register and unregister are forwarded. A request's shared-memory tensors are checked by the front end
against the regions and handed on as regions (kiln/serve/shared_memory.py's SharedTensor): the engine
reads the inputs and writes the outputs in its own mappings, and their bytes never cross the socket. A front end that dies (killed, crashed) loses the
requests it held; the others serve on and the pool starts another in its place. stop(): the front
ends stop taking connections and finish what they hold (the engine answers all of it), then exit.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from kiln.serve.core import InferResponse, ServerCore
from kiln.serve.ipc import (
    Call,
    Connection,
    EntryView,
    Hello,
    InferAnswer,
    InferCall,
    Reply,
    StagingOffer,
    Start,
    VersionView,
    View,
    error_of,
)
from kiln.serve.metrics import MetricsExporter
from kiln.serve.options import ServeOptions
from kiln.serve.staging import StagingView, arena_bytes

log = logging.getLogger("kiln.serve")
_KILN_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding the kiln package, for the children
START_TIMEOUT_S = 300.0  # a front end imports kiln (torch): seconds on a loaded machine
RESTART_PAUSE_S = 1.0  # between a front end's death and its replacement
_CHANGES_VIEW = ("load", "unload", "register_system_shared_memory", "unregister_system_shared_memory")


@dataclass
class Frontend:
    """One front-end process as the engine sees it."""

    slot: int
    process: asyncio.subprocess.Process
    serving: asyncio.Event = field(default_factory=asyncio.Event)  # its ports are open
    connection: Connection | None = None  # once it said Hello
    answered: int = 0  # its infer calls answered (how the kernel spread the connections)


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound (SO_REUSEPORT, not listening: it takes no connections) that holds the port for the
    front ends and says which one port 0 became."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def view_of(core: ServerCore, ready: bool) -> View:
    entries = []
    for entry in core.models.values():
        versions = {}
        for number, v in entry.versions.items():
            described = {k: x for k, x in v.metadata([]).items() if k != "versions"}
            versions[number] = VersionView(v.name, v.version, v.config, described)
        entries.append(EntryView(entry.name, entry.state, entry.reason, versions))
    return View(ready, entries, list(core.shared_memory.regions.values()))


class FrontendPool:
    def __init__(self, core: ServerCore, metrics: MetricsExporter, options: ServeOptions):
        self.core = core
        self.metrics = metrics
        self.options = options
        self.frontends: list[Frontend] = []
        self._reserved: list[socket.socket] = []
        self._folder = ""
        self._listener: asyncio.AbstractServer | None = None
        self._linked: dict[Connection, Frontend] = {}
        self._watchers: set[asyncio.Task] = set()
        self._calls: set[asyncio.Task] = set()
        self._in_flight = 0  # infer calls queued and not answered yet (stop() waits for them)
        self._idle: asyncio.Event | None = None
        self._stopping = False
        self._child_options: ServeOptions | None = None

    @property
    def socket_path(self) -> str:
        return os.path.join(self._folder, "engine.sock")

    async def start(self) -> tuple[int | None, int | None]:
        """The ports reserved, the front ends started and serving; the ports (HTTP, gRPC)."""
        o = self.options
        http = grpc = None
        if o.http_port is not None:
            self._reserved.append(reserve_port(o.host, o.http_port))
            http = self._reserved[-1].getsockname()[1]
        if o.grpc_port is not None:
            self._reserved.append(reserve_port(o.host, o.grpc_port))
            grpc = self._reserved[-1].getsockname()[1]
        staging = arena_bytes(o.staging_bytes, o.frontends) if o.staging_bytes else 0
        if staging < o.staging_bytes:
            log.warning("staging arenas of %d bytes per front end, not %d: /dev/shm has too little free space for "
                        "%d front ends%s", staging, o.staging_bytes, o.frontends, " (tensors go over the socket)"
                        if not staging else "")
        self._child_options = replace(o, http_port=http, grpc_port=grpc, metrics_port=None, frontends=0,
                                      switch_interval_us=None, staging_bytes=staging)
        self._folder = tempfile.mkdtemp(prefix="kiln-serve-")
        self._listener = await asyncio.get_running_loop().create_unix_server(self._new_connection, self.socket_path)
        for slot in range(o.frontends):
            self.frontends.append(await self._spawn(slot))
        try:
            await asyncio.wait_for(self._all_serving(), START_TIMEOUT_S)
        except BaseException:
            await self.stop()
            raise
        return http, grpc

    async def _all_serving(self) -> None:
        for frontend in list(self.frontends):
            serving = asyncio.ensure_future(frontend.serving.wait())
            exited = asyncio.ensure_future(frontend.process.wait())
            await asyncio.wait([serving, exited], return_when=asyncio.FIRST_COMPLETED)
            serving.cancel()
            exited.cancel()
            if not frontend.serving.is_set():
                raise OSError(f"front-end process {frontend.slot} exited with {frontend.process.returncode} while "
                              "starting (its error is on stderr above)")

    async def _spawn(self, slot: int) -> Frontend:
        path = os.environ.get("PYTHONPATH", "")
        env = {**os.environ, "PYTHONPATH": _KILN_ROOT + (os.pathsep + path if path else "")}
        process = await asyncio.create_subprocess_exec(sys.executable, "-m", "kiln.serve.frontend_process",
                                                       self.socket_path, env=env)
        frontend = Frontend(slot, process)
        watcher = asyncio.ensure_future(self._watch(frontend))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        return frontend

    async def _watch(self, frontend: Frontend) -> None:
        """Replace a front end that dies while the server runs (its requests in flight are lost with it)."""
        code = await frontend.process.wait()
        if self._stopping:
            return
        if not frontend.serving.is_set():  # at start, start() says so; a replacement that fails is not retried
            log.warning("front-end process %d exited with %s before it served; not started again (its error is "
                        "on stderr above)", frontend.slot, code)
            return
        log.warning("front-end process %d (pid %d) exited with %s; starting another", frontend.slot,
                    frontend.process.pid, code)
        await asyncio.sleep(RESTART_PAUSE_S)
        if not self._stopping:
            self.frontends[frontend.slot] = await self._spawn(frontend.slot)

    # ---- a front end's connection -------------------------------------------------------------

    def _new_connection(self) -> Connection:
        connection = Connection(None, self._lost)
        connection.on_message = lambda message: self._received(connection, message)
        connection.on_flush = self._flushed
        return connection

    def _flushed(self, messages: list, ns: int) -> None:
        """One write of answers to a front end: its time (pickling the run of answers and the socket's copy of their
        tensors) shared by the answers in it, recorded in their models' call phases (CallPhases.send)."""
        answers = [m.response for m in messages if type(m) is InferAnswer]
        if not answers:
            return
        share = ns // len(messages)
        for response in answers:
            entry = self.core.models.get(response.model)
            version = entry.versions.get(response.version) if entry is not None else None
            if version is not None:
                version.stats.phases.send.add(share)

    def _received(self, connection: Connection, message) -> None:
        frontend = self._linked.get(connection)
        if frontend is not None:
            self._dispatch(frontend, message)
            return
        frontend = next((f for f in self.frontends if type(message) is Hello and f.process.pid == message.pid), None)
        if frontend is None:
            log.warning("a connection to the engine socket that is not a front end's (%r first); closed",
                        type(message).__name__)
            connection.close()
            return
        self._linked[connection] = frontend
        frontend.connection = connection
        connection.send(Start(self._child_options, self.core.repository, self._view()))

    def _lost(self, connection: Connection) -> None:
        """A front end's connection closed: its process is gone or going (its watcher replaces it); replies
        still due to it are dropped."""
        frontend = self._linked.pop(connection, None)
        if frontend is not None:
            log.info("front-end process %d's connection to the engine closed", frontend.slot)

    def _dispatch(self, frontend: Frontend, call: Call | InferCall | StagingOffer) -> None:
        if type(call) is StagingOffer:
            self._map_staging(frontend, call)
            return
        if type(call) is InferCall:  # queued now, answered from its future's callback (ServerCore.infer_soon)
            self._in_flight += 1
            self.core.infer_soon(call.request, functools.partial(self._infer_answered, frontend, call.id))
            return
        # create_task, not ensure_future: its checks showed in py-spy's samples
        task = asyncio.get_running_loop().create_task(self._answer(frontend, call))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    def _map_staging(self, frontend: Frontend, offer: StagingOffer) -> None:
        """The front end's staging arena mapped: its frames may name tensors there from now on."""
        try:
            if offer.byte_size > self._child_options.staging_bytes:
                raise ValueError(f"a staging arena of {offer.byte_size} bytes, past the "
                                 f"{self._child_options.staging_bytes} offered")
            frontend.connection.staging = StagingView(offer.key, offer.byte_size)
        except (OSError, ValueError) as e:
            log.warning("front-end process %d's staging arena not mapped (its tensors go over the socket): %s",
                        frontend.slot, e)
            self._reply(frontend, Reply(offer.id, error=error_of(e)))
            return
        self._reply(frontend, Reply(offer.id))

    def _infer_answered(self, frontend: Frontend, call_id: int, outcome: InferResponse | Exception) -> None:
        if isinstance(outcome, Exception):
            answer = Reply(call_id, error=error_of(outcome))  # its status code kept
        else:
            answer = InferAnswer(call_id, outcome)
        frontend.answered += 1
        self._reply(frontend, answer)
        self._in_flight -= 1
        if not self._in_flight and self._idle is not None:
            self._idle.set()

    async def _answer(self, frontend: Frontend, call: Call) -> None:
        if call.method == "serving":
            frontend.serving.set()
            self._reply(frontend, Reply(call.id))
            return
        try:
            value = await self._run(call)
        except Exception as e:  # noqa: BLE001 - answered to the front end (its status code kept)
            reply = Reply(call.id, error=error_of(e))
        else:
            reply = Reply(call.id, value)
        if call.method in _CHANGES_VIEW:
            self._broadcast()  # before the reply: the caller's next request sees the new table, through any front end
        self._reply(frontend, reply)

    async def _run(self, call: Call):
        core = self.core
        if call.method == "statistics":
            return await core.statistics_json(*call.args)
        if call.method == "metrics":
            return self.metrics.render()
        if call.method == "load":
            return await core.load(*call.args)
        if call.method == "unload":
            return await core.unload(*call.args)
        if call.method == "register_system_shared_memory":
            return await core.register_system_shared_memory(*call.args)
        if call.method == "unregister_system_shared_memory":
            return await core.unregister_system_shared_memory(*call.args)
        raise ValueError(f"a front end called {call.method!r}, which the engine does not answer")

    @staticmethod
    def _reply(frontend: Frontend, reply: Reply | InferAnswer) -> None:
        if frontend.connection is not None:
            frontend.connection.send(reply)

    def _view(self) -> View:
        return view_of(self.core, self.core.ready and not self._stopping)

    def _broadcast(self) -> None:
        view = self._view()
        for frontend in self.frontends:
            if frontend.connection is not None:
                frontend.connection.send(view)

    # ---- shutdown -----------------------------------------------------------------------------

    async def stop(self) -> None:
        """Graceful: the front ends say not ready, stop taking connections and finish what they hold
        (the engine answers all of it), then exit; one that outlives the shutdown timeout is killed."""
        self._stopping = True
        self._broadcast()
        for frontend in self.frontends:
            if frontend.process.returncode is None:
                frontend.process.terminate()
        grace = self.options.shutdown_timeout + 5.0
        for frontend in self.frontends:
            try:
                await asyncio.wait_for(frontend.process.wait(), grace)
            except TimeoutError:
                log.warning("front-end process %d did not stop within %.0f s; killed", frontend.slot, grace)
                frontend.process.kill()
                await frontend.process.wait()
        for task in list(self._watchers):
            task.cancel()
        if self._calls:
            await asyncio.gather(*self._calls, return_exceptions=True)
        if self._in_flight:
            self._idle = asyncio.Event()
            await self._idle.wait()
        if self._listener is not None:
            self._listener.close()
        for sock in self._reserved:
            sock.close()
        shutil.rmtree(self._folder, ignore_errors=True)
