"""The wire between kiln serve's front-end processes and its engine process (`--frontends N`).

One Unix-socket connection per front end carries frames both ways:

    [u32 pickle bytes][u32 buffer count][u64 size per buffer ...][pickle][buffer ...]

The pickle (protocol 5) holds one message below; the numpy arrays it holds travel out of band,
their bytes written to the socket as they are (no copy into the pickle) and read back as views
into the received frame. Front end -> engine: Hello, then Calls and InferCalls; engine -> front end:
Views (the model table a front end answers health, metadata and config from without a round trip),
Replies and InferAnswers; Start once, answering Hello.

InferCall and InferAnswer, one per request, are pickled as a tuple of plain values (names, dtype
strings, shapes) and rebuilt here: pickling the dataclasses and arrays themselves cost ~4x the time
(78 against 21 us a request both ways on the 2-core VM), on the engine's loop, which every front end
shares. One holding an array of objects (BYTES) or of a dtype without a plain code is pickled whole.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from dataclasses import dataclass, field

import numpy as np

from kiln.serve import errors
from kiln.serve.config import ModelConfig
from kiln.serve.core import InferRequest, InferResponse
from kiln.serve.errors import ServeError
from kiln.serve.options import ServeOptions
from kiln.serve.repository import ModelRepository

_HEAD = struct.Struct("<II")


@dataclass
class Hello:
    """A front end's first message: who it is, so the engine can tell its connection and process apart."""

    pid: int


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
    """The engine's model table and readiness, sent to every front end whenever either changes."""

    ready: bool
    entries: list[EntryView]


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


_CALL, _ANSWER = 0, 1  # the first field of a flat InferCall / InferAnswer


def _flat_tensors(tensors) -> tuple[list, list[memoryview]] | None:
    """(name, dtype code, shape) per array and their bytes; None when an array has no plain dtype code."""
    specs, views = [], []
    for name, array in tensors:
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
        flat = _flat_tensors(r.inputs.items())
        if flat is not None:
            return (_CALL, message.id, r.model, r.version, r.id, r.outputs, r.timeout_us, flat[0]), flat[1]
    elif type(message) is InferAnswer:
        r = message.response
        flat = _flat_tensors(r.outputs)
        if flat is not None:
            return (_ANSWER, message.id, r.model, r.version, r.id, flat[0]), flat[1]
    return None


def _unflatten(fields: tuple, buffers: list[memoryview]):
    tensors = [(name, np.frombuffer(data, dtype).reshape(shape))  # read-only views into the frame
               for (name, dtype, shape), data in zip(fields[-1], buffers)]
    if fields[0] == _CALL:
        _, call_id, model, version, request_id, outputs, timeout_us, _ = fields
        return InferCall(call_id, InferRequest(model, version, request_id, dict(tensors), outputs, timeout_us))
    _, call_id, model, version, response_id, _ = fields
    return InferAnswer(call_id, InferResponse(model, version, response_id, tensors))


def write_message(writer: asyncio.StreamWriter, message) -> None:
    """Queue one frame on the connection (no drain: the frames in flight are bounded by the requests in flight)."""
    flat = _flatten(message)
    if flat is not None:
        data = pickle.dumps(flat[0], protocol=5)
        views = flat[1]
    else:
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
        views = [b.raw() for b in buffers]
    head = _HEAD.pack(len(data), len(views)) + struct.pack(f"<{len(views)}Q", *(v.nbytes for v in views))
    writer.writelines([head, data, *views])


async def read_message(reader: asyncio.StreamReader):
    """The next frame's message (raises asyncio.IncompleteReadError at the end of the connection)."""
    size, count = _HEAD.unpack(await reader.readexactly(_HEAD.size))
    sizes = struct.unpack(f"<{count}Q", await reader.readexactly(8 * count)) if count else ()
    body = memoryview(await reader.readexactly(size + sum(sizes)))
    buffers, offset = [], size
    for n in sizes:
        buffers.append(body[offset:offset + n])
        offset += n
    message = pickle.loads(body[:size], buffers=buffers)
    return _unflatten(message, buffers) if type(message) is tuple else message
