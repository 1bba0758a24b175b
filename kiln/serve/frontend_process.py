"""A front-end process of `kiln serve --frontends N` (kiln/serve/frontends.py says why and how).

    python -m kiln.serve.frontend_process ENGINE_SOCKET     # started by the engine's FrontendPool

It connects to the engine, gets its options and the model table (ipc.Start), runs kiln serve's own
HTTP and gRPC servers on the shared ports over a RemoteCore, and says it serves. SIGTERM: graceful
stop (not ready, no new connections, what it holds answered); SIGINT is the engine's to handle (a
terminal's Ctrl-C reaches every process of the group). It exits when the engine's connection closes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from dataclasses import replace

import numpy as np

from kiln.serve.core import InferRequest, InferResponse, ModelEntry, ServerCore
from kiln.serve.errors import Unavailable
from kiln.serve.frontdoors import Frontdoors
from kiln.serve.ipc import (
    Call,
    Connection,
    Hello,
    InferAnswer,
    InferCall,
    Reply,
    StagingOffer,
    Start,
    View,
    raise_error,
)
from kiln.serve.metrics import MetricsExporter
from kiln.serve.repository import ModelRepository
from kiln.serve.shared_memory import ForwardingRegistry
from kiln.serve.server import run
from kiln.serve.staging import StagingArena

log = logging.getLogger("kiln.serve")


class RemoteCore(ServerCore):
    """ServerCore's frontend interface (what the HTTP and gRPC servers call) over the engine's connection:
    health, metadata, config and the index from the engine's View; the rest are Calls."""

    def __init__(self, repository: ModelRepository, view: View, connection: Connection):
        super().__init__(repository)
        self.shared_memory = ForwardingRegistry()  # inputs in shared memory go to the engine as regions, not bytes
        self._connection = connection
        self._pending: dict[int, asyncio.Future] = {}
        self._next_id = 0
        self._engine_ready = False
        self.apply(view)
        self.started = True
        self.lost = asyncio.Event()  # the engine's connection closed
        self.staging: StagingArena | None = None  # once the engine mapped it
        self.staging_min_bytes = 0  # tensors this large or larger go through it

    async def offer_staging(self, byte_size: int, min_bytes: int) -> None:
        """A staging arena for large input tensors, used once the engine has mapped it (else: none, and the
        tensors go over the socket)."""
        try:
            arena = StagingArena(byte_size)
        except OSError as e:
            log.warning("front end %d: no staging arena (%s); tensors go over the engine's socket", os.getpid(), e)
            return
        try:
            await self._send(lambda call_id: StagingOffer(call_id, arena.key, byte_size))
        except Exception as e:  # noqa: BLE001 - the engine said why (and logged it): serve without
            log.warning("front end %d: the engine did not map the staging arena (%s)", os.getpid(), e)
            return
        finally:
            arena.unlink()  # mapped on both sides, or not used: the name is not needed any more
        self.staging, self.staging_min_bytes = arena, min_bytes

    @property
    def ready(self) -> bool:
        return self._engine_ready and self.accepting

    def apply(self, view: View) -> None:
        self._engine_ready = view.ready
        self.models = {e.name: ModelEntry(e.name, e.state, e.reason, dict(e.versions)) for e in view.entries}
        self.shared_memory.apply(view.regions)

    def received(self, message: View | Reply | InferAnswer) -> None:
        if type(message) is View:
            self.apply(message)
        else:
            self._settle(message)

    def connection_lost(self, connection: Connection) -> None:
        """The engine's connection closed: every call waiting fails (503) and the front end stops."""
        if self.accepting:  # not at this front end's own stop
            log.warning("front end %d: the engine's connection closed", os.getpid())
        self.accepting = False
        self.lost.set()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(Unavailable("the server's engine process is gone"))
        self._pending.clear()

    def _settle(self, reply: Reply | InferAnswer) -> None:
        if self.staging is not None:
            self.staging.release(reply.id)  # whoever waits or not: the engine is done with the call's tensors
        future = self._pending.pop(reply.id, None)
        if future is None or future.done():
            return  # its caller gave up (a cancelled request)
        if type(reply) is InferAnswer:
            future.set_result(reply.response)
            return
        if reply.error is not None:
            try:
                raise_error(reply.error)
            except Exception as e:  # noqa: BLE001 - handed to the caller's future
                future.set_exception(e)
            return
        future.set_result(reply.value)

    async def call(self, method: str, *args):
        """The engine's answer to ServerCore.`method`(*args) (its error raised here as the engine raised it)."""
        return await self._send(lambda call_id: Call(call_id, method, args))

    async def _send(self, message_with_id):
        if self.lost.is_set():
            raise Unavailable("the server's engine process is gone")
        self._next_id += 1
        call_id = self._next_id
        future = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        self._connection.send(message_with_id(call_id))
        try:
            return await future
        except asyncio.CancelledError:  # the client gave up: the engine's reply will find no one waiting
            self._pending.pop(call_id, None)
            raise

    async def infer(self, request: InferRequest, model=None) -> InferResponse:
        if not self.accepting:
            raise Unavailable("the server is shutting down")
        if model is None:
            self.model(request.model, request.version)  # unknown or unavailable: 404/503 without a round trip
        return await self._send(lambda call_id: InferCall(call_id, self._staged(call_id, request)))

    def _staged(self, call_id: int, request: InferRequest) -> InferRequest:
        """The request with its large plain tensors put in the staging arena (those that fit)."""
        arena = self.staging
        if arena is None:
            return request
        inputs = None
        for name, array in request.inputs.items():
            if type(array) is np.ndarray and array.nbytes >= self.staging_min_bytes and array.dtype.kind in "biuf":
                staged = arena.put(call_id, array)
                if staged is not None:
                    if inputs is None:
                        inputs = dict(request.inputs)
                    inputs[name] = staged
        return request if inputs is None else replace(request, inputs=inputs)

    async def statistics_json(self, name: str = "", version: str = "") -> list[dict]:
        return await self.call("statistics", name, version)

    async def load(self, name: str, config_json: str | dict | None = None) -> None:
        await self.call("load", name, config_json)

    async def unload(self, name: str) -> None:
        await self.call("unload", name)

    async def register_system_shared_memory(self, name: str, key: str, offset: int, byte_size: int) -> None:
        await self.call("register_system_shared_memory", name, key, offset, byte_size)

    async def unregister_system_shared_memory(self, name: str = "") -> None:
        await self.call("unregister_system_shared_memory", name)

    async def close(self) -> None:
        self.accepting = False


class RemoteMetrics(MetricsExporter):
    """/metrics on a front end's HTTP port: the engine's exporter's text."""

    def __init__(self, core: RemoteCore):
        super().__init__(list)
        self.core = core

    async def scrape(self) -> bytes:
        return await self.core.call("metrics")


async def _connect(socket_path: str) -> tuple[Connection, Start, list]:
    """The engine's connection, its Start, and any messages that came with it (handed to the core once made)."""
    loop = asyncio.get_running_loop()
    first = loop.create_future()
    early: list = []

    def received(message) -> None:
        if first.done():
            early.append(message)
        else:
            first.set_result(message)

    def lost(_connection: Connection) -> None:
        if not first.done():
            first.set_exception(ConnectionError("the engine closed the connection before it said what to serve"))

    connection = Connection(received, lost)
    await loop.create_unix_connection(lambda: connection, socket_path)
    connection.send(Hello(os.getpid()))
    return connection, await first, early


async def serve(socket_path: str) -> None:
    connection, start, early = await _connect(socket_path)
    logging.basicConfig(level=start.options.log_level.upper(), format="kiln serve (front end): %(message)s")
    core = RemoteCore(start.repository, start.view, connection)
    connection.on_message, connection.on_lost = core.received, core.connection_lost
    for message in early:
        core.received(message)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, lambda: None)  # the engine decides (it sends SIGTERM)
    doors = Frontdoors(start.options)
    if start.options.staging_bytes:
        await core.offer_staging(start.options.staging_bytes, start.options.staging_min_bytes)
    await doors.serve(core, RemoteMetrics(core), reuse_port=True)
    await core.call("serving")
    lost = asyncio.ensure_future(core.lost.wait())
    await asyncio.wait([asyncio.ensure_future(stop.wait()), lost], return_when=asyncio.FIRST_COMPLETED)
    core.accepting = False
    await doors.stop()
    connection.close()


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python -m kiln.serve.frontend_process ENGINE_SOCKET (started by kiln serve --frontends N)",
              file=sys.stderr)
        return 2
    run(serve(sys.argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
