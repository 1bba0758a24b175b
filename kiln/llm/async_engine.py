"""AsyncLLM: the engine on its own thread, for asyncio front ends (the OpenAI server).

The engine is only ever touched by its thread: requests and cancellations arrive through a queue,
and each step's outputs go back to every request's asyncio.Queue with call_soon_threadsafe. While
nothing is running the thread sleeps on an event. A request whose consumer goes away (the client
disconnected, the iterator was closed) is aborted, so its KV blocks are free for the next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kiln.llm.engine import LLMEngine
from kiln.llm.outputs import RequestOutput
from kiln.llm.sampling_params import SamplingParams
from kiln.runtime.heap import static_heap

log = logging.getLogger("kiln.llm")


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue


class EngineDeadError(RuntimeError):
    """The engine's step raised: every request in flight fails with this, and the engine stops."""


class AsyncLLM:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._streams: dict[str, _Add] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="kiln-llm-engine", daemon=True)
        self.dead: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the engine makes them; raises what add_request raised (LLMError)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.dead}")
        outputs: asyncio.Queue = asyncio.Queue()
        self._send(_Add(request_id, prompt, params, asyncio.get_running_loop(), outputs))
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        with static_heap():  # the server's startup heap out of the collector's scans while it serves
            self._loop()

    def _loop(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._wake.clear()
            self._drain()
            if not engine.has_unfinished():
                self._wake.wait()
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a failed step leaves the cache in an unknown state: fail everything
                log.exception("kiln llm: the engine step failed")
                self.dead = e
                for request_id, stream in list(self._streams.items()):
                    engine.abort(request_id)
                    self._deliver(stream, EngineDeadError(f"the engine step failed: {e}"))
                self._streams.clear()
                self._stopping = True
                return
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    self._deliver(stream, output)
                    if output.finished:
                        del self._streams[output.request_id]
        for request_id, stream in self._streams.items():  # shutting down: end every stream
            engine.abort(request_id)
            self._deliver(stream, EngineDeadError("the server is shutting down"))

    def _drain(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                try:
                    self.engine.add_request(command.prompt, command.params, request_id=command.request_id)
                except Exception as e:  # refused (LLMError: too long, bad ids...): the caller raises it
                    self._deliver(command, e)
                    continue
                self._streams[command.request_id] = command
            else:
                _, request_id = command
                if self._streams.pop(request_id, None) is not None:
                    self.engine.abort(request_id)

    @staticmethod
    def _deliver(stream: _Add, item) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed
            pass
