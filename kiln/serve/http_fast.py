"""POST /v2/models/{m}[/versions/{v}]/infer on raw ASGI messages, in front of the FastAPI app.

kiln serve's HTTP port runs this ahead of http_app(): an infer request is read, decoded, run and
answered here; every other request (and an infer with another method) goes on to FastAPI. The
FastAPI infer route stays: it documents the route in the OpenAPI document and answers under Ray
Serve's ingress, which mounts http_app() alone. Both share the codec (kiln/serve/http_codec.py),
the body limit and inflation, and the error answers ({"error": ...} with the ServeError's status and
Retry-After), so a client sees the same answers from either. Under httptools, kiln serve's HTTP/1.1
protocol (kiln/serve/http_protocol.py) reads most infer requests itself and calls `answer` with the body,
with no ASGI between; this ASGI path answers the others (pipelined behind another request, a query
string, h11 where httptools is missing).

Why: for an empty model at concurrency 64 on a 2-core VM, FastAPI and Starlette's layers (the
middleware stack, routing, dependency solving, the Request and Response objects) took about 60% of
the server's Python samples (py-spy), more than kiln's decode, batching and encode together.
"""

from __future__ import annotations

import json
import logging
import re

from kiln.serve.core import ServerCore
from kiln.serve.errors import PayloadTooLarge, ServeError
from kiln.serve.http_codec import HeaderLayouts, decode_request, encode_response_pieces
from kiln.serve.http_server import check_length, inflate

log = logging.getLogger("kiln.serve")

_INFER = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")
_JSON = b"application/json"
_BINARY = b"application/octet-stream"


class ClientGone(Exception):
    """The client disconnected before its request body arrived: nobody to answer."""


class InferFastPath:
    """ASGI: infer requests here, everything else to `app`."""

    def __init__(self, app, core: ServerCore, max_request_bytes: int):
        self.app = app
        self.core = core
        self.limit = max_request_bytes
        self.layouts = HeaderLayouts()  # the binary extension's JSON headers seen before, decoded

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"].endswith("/infer"):
            match = _INFER.fullmatch(scope["path"])
            if match is not None:
                await self._infer(scope, receive, send, match.group(1), match.group(2) or "")
                return
        await self.app(scope, receive, send)

    async def _infer(self, scope, receive, send, model_name: str, model_version: str) -> None:
        try:
            payload, header_length = await self._answer(scope, receive, model_name, model_version)
        except ClientGone:
            return
        except ServeError as e:
            await _send(send, e.http_status, error_body(str(e)), _JSON, e.retry_after)
            return
        except Exception as e:  # noqa: BLE001 - a fault of the server: logged, answered 500
            log.exception("internal error answering POST %s", scope["path"])
            await _send(send, 500, error_body(f"internal error: {type(e).__name__}: {e}"), _JSON)
            return
        await _send(send, 200, payload, _JSON if header_length is None else _BINARY, None, header_length)

    async def _answer(self, scope, receive, model_name: str,
                      model_version: str) -> tuple[list[bytes | memoryview], int | None]:
        length = encoding = header_length = None
        for key, value in scope["headers"]:
            if key == b"content-length":
                length = value.decode("latin-1")
            elif key == b"content-encoding":
                encoding = value.decode("latin-1")
            elif key == b"inference-header-content-length":
                header_length = value.decode("latin-1")
        check_length(length, self.limit)
        return await self.answer(await self._body(receive), model_name, model_version, encoding, header_length)

    async def answer(self, body: bytes, model_name: str, model_version: str, encoding: str | None,
                     header_length: str | None) -> tuple[list[bytes | memoryview], int | None]:
        """A whole request body's answer: its body pieces, and the JSON header's length when binary outputs follow
        it; a ServeError for the client's faults. kiln's HTTP/1.1 protocol (kiln/serve/http_protocol.py) calls this
        with the body it read itself."""
        if encoding:
            body = inflate(body, encoding, self.limit)
        model = self.core.model(model_name, model_version)  # an unknown model is a 404 before the body is parsed
        shared_memory = self.core.shared_memory
        infer_request, options = decode_request(body, header_length, model_name, model_version, shared_memory,
                                                self.layouts)
        response = await self.core.infer(infer_request, model)
        return encode_response_pieces(response, options, model.config.max_batch_size > 0, shared_memory)

    async def _body(self, receive) -> bytes:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone
        body = message.get("body", b"")
        if not message.get("more_body", False):  # the whole body in one message: the common case
            if len(body) > self.limit:
                raise PayloadTooLarge(f"the request body exceeds the server's limit of {self.limit} bytes")
            return body
        chunks, size = [body], len(body)
        while message.get("more_body", False):
            message = await receive()
            if message["type"] != "http.request":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                raise PayloadTooLarge(f"the request body exceeds the server's limit of {self.limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)


def error_body(message: str) -> bytes:
    # as Starlette's JSONResponse renders {"error": ...} (http_server.error_response)
    return json.dumps({"error": message}, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


# an answer at least this large leaves as its pieces (writelines: no join, uvloop's writev); smaller ones joined
GATHER_BYTES = 64 << 10


class _Held:
    """A uvicorn response cycle's transport while the fast path sends one answer: the writes of the head
    (http.response.start) and of the body are kept, and leave together (_send)."""

    __slots__ = ("parts", "closed")

    def __init__(self):
        self.parts: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def close(self) -> None:  # a response with connection: close; closed once the writes have left
        self.closed = True


def _cycle(send):
    """uvicorn's response cycle (httptools' or h11's) whose bound method `send` is, when it writes through a
    `transport` attribute as uvicorn 0.2x-0.5x's do; else None (another server: ASGI messages only)."""
    cycle = getattr(send, "__self__", None)
    if type(cycle).__name__ == "RequestResponseCycle" and type(cycle).__module__.startswith("uvicorn.") \
            and getattr(cycle, "transport", None) is not None:
        return cycle
    return None


async def _send(send, status: int, payload: bytes | list[bytes | memoryview], content_type: bytes,
                retry_after: int | None = None, header_length: int | None = None) -> None:
    """The answer as ASGI messages, which uvicorn writes as it gets them: the head, then the body (`payload`: its
    bytes, or its pieces: joined into one message under GATHER_BYTES, else a message each, the large outputs views
    of their arrays), each a send(2) of its own and,
    with TCP_NODELAY, a segment of its own that wakes the client. Under uvicorn the writes are held and leave in
    one writelines (one system call, the pieces gathered by writev under uvloop, not joined here); uvicorn's own
    bookkeeping (keep-alive, the next pipelined request, Content-Length checks) runs as for any answer."""
    pieces = [payload] if type(payload) is bytes else payload
    size = sum(map(len, pieces))
    if len(pieces) > 1 and size < GATHER_BYTES:
        pieces = [b"".join(pieces)]  # a small answer's header and outputs: one body message (one send, not one each)
    headers = [(b"content-length", str(size).encode()), (b"content-type", content_type)]
    if header_length is not None:
        headers.append((b"inference-header-content-length", str(header_length).encode()))
    if retry_after:
        headers.append((b"retry-after", str(retry_after).encode()))
    start = {"type": "http.response.start", "status": status, "headers": headers}
    last = len(pieces) - 1
    bodies = [{"type": "http.response.body", "body": piece, "more_body": k < last} for k, piece in enumerate(pieces)]
    cycle = _cycle(send)
    if cycle is None:
        await send(start)
        for body in bodies:
            await send(body)
        return
    transport, held = cycle.transport, _Held()
    cycle.transport = held
    try:
        await send(start)
        for body in bodies:
            await send(body)
    finally:
        cycle.transport = transport
        if held.parts and not transport.is_closing():
            if sum(map(len, held.parts)) < GATHER_BYTES:
                transport.write(b"".join(held.parts))  # one buffer: uvloop's fastest write
            else:
                transport.writelines(held.parts)  # large outputs' views gathered by writev, not joined here
        if held.closed:
            transport.close()
