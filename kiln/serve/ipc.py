"""The wire between kiln serve's front-end processes and its engine process (`--frontends N`).

One Unix-socket connection per front end carries frames both ways:

    [u32 pickle bytes][u32 buffer count][u64 size per buffer ...][pickle][buffer ...]

The pickle (protocol 5) holds one message below; the numpy arrays it holds travel out of band,
their bytes written to the socket as they are (no copy into the pickle) and read back as views
into the received frame. Front end -> engine: Hello, then Calls and InferCalls; engine -> front end:
Views (the model table a front end answers health, metadata and config from without a round trip),
Replies and InferAnswers; Start once, answering Hello.

A front end's large input tensors go through its staging arena (kiln/serve/staging.py) where the engine
accepted one: the frame names (offset, dtype, shape) and the engine reads them in its mapping (read-only
views, valid until the call is answered), their bytes never on the socket.

InferCall and InferAnswer, one per request, are pickled as a tuple of plain values (names, dtype
strings, shapes) and rebuilt here: pickling the dataclasses and arrays themselves cost ~4x the time
(78 against 21 us a request both ways on the 2-core VM), on the engine's loop, which every front end
shares. One holding an array of objects (BYTES) or of a dtype without a plain code, a tensor left in
shared memory (SharedTensor) or outputs for the engine to write there is pickled whole. A loop turn's
runs of flat InferCalls / InferAnswers share one frame (encode_all).
"""

from __future__ import annotations

import asyncio
import pickle
import struct
import time
from dataclasses import dataclass, field

import numpy as np

from kiln.serve import errors
from kiln.serve.config import ModelConfig
from kiln.serve.core import InferRequest, InferResponse
from kiln.serve.errors import ServeError
from kiln.serve.options import ServeOptions
from kiln.serve.repository import ModelRepository
from kiln.serve.shared_memory import Region, SharedTensor
from kiln.serve.staging import Staged, StagingView

_HEAD = struct.Struct("<II")


@dataclass
class Hello:
    """A front end's first message: who it is, so the engine can tell its connection and process apart."""

    pid: int


@dataclass
class StagingOffer:
    """A front end's staging arena (kiln/serve/staging.py), offered once it has Start; Reply(id) when mapped."""

    id: int
    key: str
    byte_size: int


@dataclass
class Call:
    """A ServerCore method the front end cannot answer from its View: infer, statistics, load, unload, metrics
    (or `serving`: the front end's ports are open)."""

    id: int
    method: str
    args: tuple = ()


@dataclass
class Reply:
    """The answer to Call `id`: its value, or the ServeError it raised (the class's name and message)."""

    id: int
    value: object = None
    error: tuple[str, str] | None = None


@dataclass
class InferCall:
    id: int
    request: InferRequest


@dataclass
class InferAnswer:
    id: int
    response: InferResponse


@dataclass
class VersionView:
    """A served version as a front end knows it: what the routes read of a ModelVersion."""

    name: str
    version: str
    config: ModelConfig
    described: dict  # ModelVersion.metadata() without its versions

    def metadata(self, versions: list[str]) -> dict:
        return {**self.described, "versions": versions}


@dataclass
class EntryView:
    name: str
    state: str
    reason: str
    versions: dict[str, VersionView] = field(default_factory=dict)


@dataclass
class View:
    """The engine's model table, readiness and shared-memory regions, sent to every front end whenever one
    changes (a region registered through one front end serves requests through any)."""

    ready: bool
    entries: list[EntryView]
    regions: list[Region] = field(default_factory=list)


@dataclass
class Start:
    """The engine's answer to Hello: what to serve (ports resolved, `frontends` 0) and the first View."""

    options: ServeOptions
    repository: ModelRepository
    view: View


def error_of(e: Exception) -> tuple[str, str]:
    """A raised exception as a Reply carries it: a ServeError keeps its class (and so its status codes);
    anything else is the server's fault (ServeError: 500, INTERNAL)."""
    if isinstance(e, ServeError):
        return type(e).__name__, str(e)
    return "ServeError", f"internal error: {type(e).__name__}: {e}"


def raise_error(error: tuple[str, str]) -> None:
    """Reply.error raised again on the front end as the class the engine raised."""
    name, message = error
    kind = getattr(errors, name, None)
    if not (isinstance(kind, type) and issubclass(kind, ServeError)):
        kind = ServeError
    raise kind(message)


_CALL, _ANSWER, _MANY = 0, 1, 2  # the first field of a flat InferCall / InferAnswer / run of them


def _flat_tensors(tensors) -> tuple[list, list[memoryview]] | None:
    """(name, dtype code, shape) per array and their bytes ((name, dtype code, shape, offset) for one staged, with
    no bytes); None when an array has no plain dtype code."""
    specs, views = [], []
    for name, array in tensors:
        if type(array) is Staged:
            specs.append((name, array.dtype.str, array.shape, array.offset))
            continue
        if type(array) is SharedTensor:  # an input left in shared memory: the message pickled whole (no bytes)
            return None
        dtype = array.dtype
        if dtype.kind not in "biuf":  # objects (BYTES), ml_dtypes' bfloat16 ("V"): pickled whole
            return None
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        specs.append((name, dtype.str, array.shape))
        views.append(memoryview(array.reshape(-1)).cast("B"))
    return specs, views


def _flatten(message) -> tuple[tuple, list[memoryview]] | None:
    if type(message) is InferCall:
        r = message.request
        if r.output_places:  # outputs into shared memory: pickled whole (the flat tuple has no room for them)
            return None
        flat = _flat_tensors(r.inputs.items())
        if flat is not None:
            return (_CALL, message.id, r.model, r.version, r.id, r.outputs, r.timeout_us, flat[0]), flat[1]
    elif type(message) is InferAnswer:
        r = message.response
        flat = _flat_tensors(r.outputs)
        if flat is not None:
            return (_ANSWER, message.id, r.model, r.version, r.id, flat[0]), flat[1]
    return None


def _unflatten(fields: tuple, buffers: list[memoryview], staging: StagingView | None):
    tensors, next_buffer = [], 0
    for spec in fields[-1]:
        if len(spec) == 4:  # staged: a view of the sender's arena (it reuses the slot once the call is answered)
            if staging is None:
                raise ValueError(f"a frame names a staged tensor {spec[0]!r}, but no staging arena was mapped")
            tensors.append((spec[0], staging.take(spec[3], spec[1], spec[2])))
        else:  # a read-only view into the frame
            tensors.append((spec[0], np.frombuffer(buffers[next_buffer], spec[1]).reshape(spec[2])))
            next_buffer += 1
    if fields[0] == _CALL:
        _, call_id, model, version, request_id, outputs, timeout_us, _ = fields
        return InferCall(call_id, InferRequest(model, version, request_id, dict(tensors), outputs, timeout_us))
    _, call_id, model, version, response_id, _ = fields
    return InferAnswer(call_id, InferResponse(model, version, response_id, tensors))


def encode(message) -> list:
    """One message as a frame's parts (bytes and memoryviews of the tensors), ready for writelines."""
    flat = _flatten(message)
    if flat is not None:
        return _frame(pickle.dumps(flat[0], protocol=5), flat[1])
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
    return _frame(data, [b.raw() for b in buffers])


def encode_all(messages: list) -> list:
    """Messages in order as frames' parts, each run of InferCalls / InferAnswers in one frame: one pickle and
    one header for the run (a merged batch's answers, a busy front end's requests), not one per request."""
    parts: list = []
    run: list[tuple] = []
    views: list[memoryview] = []

    def close_run() -> None:
        if run:
            parts.extend(_frame(pickle.dumps(run[0] if len(run) == 1 else (_MANY, run), protocol=5), views))
            run.clear()
            views.clear()

    for message in messages:
        flat = _flatten(message)
        if flat is None:
            close_run()
            parts.extend(encode(message))
        else:
            run.append(flat[0])
            views.extend(flat[1])
    close_run()
    return parts


def _frame(data: bytes, views: list[memoryview]) -> list:
    head = _HEAD.pack(len(data), len(views)) + struct.pack(f"<{len(views)}Q", *(v.nbytes for v in views))
    return [head, data, *views]


def _frame_size(data: memoryview, offset: int) -> int | None:
    """The size of the frame starting at `offset`, or None while its header is incomplete."""
    if len(data) - offset < _HEAD.size:
        return None
    size, count = _HEAD.unpack_from(data, offset)
    if len(data) - offset < _HEAD.size + 8 * count:
        return None
    return _HEAD.size + 8 * count + size + sum(struct.unpack_from(f"<{count}Q", data, offset + _HEAD.size))


def _take_staged(inputs: dict, staging: StagingView | None) -> None:
    for name, value in inputs.items():
        if type(value) is Staged:
            if staging is None:
                raise ValueError(f"a frame names a staged tensor {name!r}, but no staging arena was mapped")
            inputs[name] = staging.take(value.offset, value.dtype, value.shape)


def _buffer_count(fields: tuple) -> int:
    return sum(len(spec) == 3 for spec in fields[-1])


def decode(frame: memoryview, staging: StagingView | None = None):
    """A frame's message (a list of them for encode_all's runs); tensors are read-only views into `frame`, or
    read-only views of `staging` (the sender's arena) where the frame names them there."""
    size, count = _HEAD.unpack_from(frame, 0)
    start = _HEAD.size + 8 * count
    buffers, offset = [], start + size
    for n in struct.unpack_from(f"<{count}Q", frame, _HEAD.size):
        buffers.append(frame[offset:offset + n])
        offset += n
    message = pickle.loads(frame[start:start + size], buffers=buffers)
    if type(message) is InferCall:  # pickled whole (shared-memory outputs, BYTES): its staged inputs looked up
        _take_staged(message.request.inputs, staging)
    if type(message) is not tuple:
        return message
    if message[0] != _MANY:
        return _unflatten(message, buffers, staging)
    messages, first = [], 0
    for fields in message[1]:  # each takes as many buffers as it has tensors sent in the frame
        last = first + _buffer_count(fields)
        messages.append(_unflatten(fields, buffers[first:last], staging))
        first = last
    return messages


class Connection(asyncio.Protocol):
    """One end of the Unix socket: every complete frame received goes to `on_message` as its message(s), in
    order, from the loop's read callback (no coroutine per read); send() queues a message and the messages
    sent in one loop turn leave in one write, their infer calls and answers in one frame (encode_all)."""

    def __init__(self, on_message, on_lost=None):
        self.on_message = on_message
        self.on_lost = on_lost  # called with the connection once it closes
        self.on_flush = None  # called with the messages of each write and the ns it took (encoding them included)
        self.transport: asyncio.Transport | None = None
        self._partial: list[bytes] = []  # the start of a frame not complete yet
        self._partial_bytes = 0
        self._partial_need = 0  # its size once its header is known (0: not yet)
        self._outgoing: list = []  # messages sent this loop turn
        self.closed = False
        self.staging: StagingView | None = None  # the peer's staging arena, once mapped

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self._partial:
            self._partial.append(data)
            self._partial_bytes += len(data)
            if self._partial_bytes < self._partial_need:
                return
            data = b"".join(self._partial)
            self._partial, self._partial_bytes, self._partial_need = [], 0, 0
        view, offset = memoryview(data), 0
        while True:
            need = _frame_size(view, offset)
            if need is None or len(view) - offset < need:
                break
            message = decode(view[offset:offset + need], self.staging)
            if type(message) is list:
                for one in message:
                    self.on_message(one)
            else:
                self.on_message(message)
            offset += need
        if offset < len(data):
            self._partial = [data[offset:]]
            self._partial_bytes = len(data) - offset
            self._partial_need = need or 0

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.on_lost is not None:
            self.on_lost(self)

    def send(self, message) -> None:
        """Queue a message (dropped once the connection has closed: nobody is left to read it)."""
        if self.closed or self.transport is None:
            return
        if not self._outgoing:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outgoing.append(message)

    def _flush(self) -> None:
        messages, self._outgoing = self._outgoing, []
        if not self.closed and not self.transport.is_closing():
            start = time.monotonic_ns()
            self.transport.writelines(encode_all(messages))
            if self.on_flush is not None:  # the engine's call phases: what sending the answers cost its loop
                self.on_flush(messages, time.monotonic_ns() - start)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
