"""kiln serve's HTTP/1.1 protocol: uvicorn's httptools protocol, with POST /v2/models/{m}[/versions/{v}]/infer read,
run and answered on the parser's own callbacks, no ASGI between.

    config = uvicorn.Config(app, http=infer_protocol(InferFastPath(app, core, limit)), ...)

uvicorn parses every request as before (httptools: keep-alive, Content-Length and chunked bodies, pipelining,
malformed requests' 400); a request it would hand to the ASGI app goes on exactly so (its scope, its
RequestResponseCycle, FastAPI) unless it is a POST to an infer path while the connection answers nothing else.
That one is taken here: its headers read once the head is complete (Content-Length against the limit, Expect:
100-continue answered then), its body gathered from on_body, and at on_message_complete InferFastPath.answer (the
same decode, inflation, core.infer and encode as the ASGI fast path) runs at once (kiln/serve/eager.py): an answer
that needs no waiting (an empty model answered inline) is written within the same data_received, head and body in
one write. Its errors are the ASGI path's ({"error": ...}, the ServeError's status and Retry-After; 500 for a fault
of the server), its head uvicorn's (status line, uvicorn's default headers, then Content-Length, Content-Type,
Inference-Header-Content-Length, Retry-After, and Connection: close when the connection ends).

Why: at concurrency 1 over a socket uvicorn's own per-request work around kiln's (the scope dict, the
RequestResponseCycle and its asyncio.Event, the request's task and its turns of the loop, receive() and two
send()s) was the largest part of the HTTP path left after h-http1 (bench/results/serve-c1-2026-12-06.md).

Left to uvicorn (the ASGI path, InferFastPath there): a request pipelined behind one not yet answered, any URL
with a query string or percent-escapes, a connection whose writes are paused, uvicorn's limit_concurrency or a
root_path, an upgrade.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from kiln.serve.eager import run_eagerly
from kiln.serve.errors import PayloadTooLarge, ServeError
from kiln.serve.http_fast import GATHER_BYTES, InferFastPath, error_body
from kiln.serve.http_server import check_length

log = logging.getLogger("kiln.serve")

# printable ASCII but '/', '?', '#', '%' in the names: anything else (a query, an escape) goes the ASGI way
_INFER = re.compile(rb"/v2/models/([^/?#%\x00-\x20\x7f-\xff]+)(?:/versions/([^/?#%\x00-\x20\x7f-\xff]+))?/infer")
# the bytes that a request's head (request line and headers) may arrive in, at most (h11's
# h11_max_incomplete_event_size in frontdoors.start_http): past them the answer is a 400 and the connection closes
MAX_HEAD_BYTES = 1 << 20
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_JSON = b"application/json"
_BINARY = b"application/octet-stream"


class _NoEvent:
    """In the place of a RequestResponseCycle's message_event, which uvicorn's connection_lost sets."""

    @staticmethod
    def set() -> None:
        pass


class _Infer:
    """An infer request the protocol reads and answers itself, in the place uvicorn keeps its cycle (self.cycle):
    uvicorn's own code reads response_complete (pipelining, shutdown), sets keep_alive (shutdown) and
    disconnected (connection_lost)."""

    __slots__ = ("model", "version", "encoding", "header_length", "keep_alive", "chunks", "size",
                 "response_complete", "disconnected")
    message_event = _NoEvent

    def __init__(self, model: str, version: str, keep_alive: bool):
        self.model, self.version, self.keep_alive = model, version, keep_alive
        self.encoding: str | None = None
        self.header_length: str | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.response_complete = False
        self.disconnected = False


class InferProtocol(HttpToolsProtocol):
    """uvicorn's HttpToolsProtocol whose infer requests `fast` answers on the parser's callbacks (the module's
    docstring says which)."""

    def __init__(self, *args, fast: InferFastPath, **kwargs):
        super().__init__(*args, **kwargs)
        self.fast = fast
        self.limit = fast.limit
        self.direct = self.limit_concurrency is None and not self.root_path
        self.reading_head = False  # between on_message_begin and on_headers_complete
        self.head_bytes = 0  # the data received meanwhile
        self.idle_since: float | None = None  # the loop's time when the last answer left, until data comes

    # ---- keep-alive: one timer a connection, not one a request ----
    # uvicorn arms a timer (call_later) after every answer and cancels it at the next data_received: under uvloop a
    # libuv timer made, started, stopped and closed per request. Here the connection keeps one: armed after an
    # answer when none is, and when it fires it closes the connection only if no data came since an answer at least
    # timeout_keep_alive seconds ago, else it is armed again for what is left (or dropped while a request is read
    # or answered, and armed again after its answer). The same connections close, at the same times.

    def _unset_keepalive_if_required(self) -> None:  # uvicorn's data_received: data came
        self.idle_since = None

    def on_response_complete(self) -> None:
        # uvicorn's, but for the timer
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            self.idle_since = None
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self.idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    def timeout_keep_alive_handler(self) -> None:
        self.timeout_keep_alive_task = None
        if self.idle_since is None or self.transport.is_closing():
            return
        left = self.idle_since + self.timeout_keep_alive - self.loop.time()
        if left > 0:
            self.timeout_keep_alive_task = self.loop.call_later(left, self.timeout_keep_alive_handler)
            return
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None

    # ---- the connection's data ----

    def data_received(self, data: bytes) -> None:
        if self.reading_head:  # httptools keeps a header's name and value whole until it ends: bounded here
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD_BYTES:
                self._unset_keepalive_if_required()
                self.logger.warning("A request's head past %d bytes.", MAX_HEAD_BYTES)
                self.send_400_response(f"The request's head is longer than {MAX_HEAD_BYTES} bytes.")
                return
        super().data_received(data)

    # ---- the parser's callbacks ----

    def on_message_begin(self) -> None:
        # uvicorn builds the request's ASGI scope here: only a request that goes to the app needs one (_to_app)
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self.scope = None
        self.head_bytes = 0
        self.reading_head = True

    def on_headers_complete(self) -> None:
        self.reading_head = False
        parser = self.parser
        cycle = self.cycle
        if self.direct and parser.get_method() == b"POST" and (cycle is None or cycle.response_complete) \
                and not self.flow.write_paused and not self.transport.is_closing():
            match = _INFER.fullmatch(self.url)
            if match is not None and not parser.should_upgrade():
                try:
                    self._begin(match)
                except Exception as e:  # noqa: BLE001 - never out of the parser's callback: a 500
                    self._answered(self.cycle, None, e)
                return
        self._to_app()

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if type(cycle) is not _Infer:
            super().on_body(body)
            return
        if cycle.response_complete:  # answered early (413): the rest of its body is read and dropped
            return
        cycle.size += len(body)
        if cycle.size > self.limit:
            self._fail(cycle, PayloadTooLarge(f"the request body exceeds the server's limit of {self.limit} bytes"))
            return
        cycle.chunks.append(body)

    def on_message_complete(self) -> None:
        cycle = self.cycle
        if type(cycle) is not _Infer:
            super().on_message_complete()
            return
        if cycle.response_complete:
            return
        chunks = cycle.chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)  # b"" for none: decode_request's 400
        cycle.chunks = []
        answer = self.fast.answer(body, cycle.model, cycle.version, cycle.encoding, cycle.header_length)
        try:
            task = run_eagerly(answer, self.loop, functools.partial(self._answered, cycle))
        except asyncio.CancelledError as e:  # a future it awaited was cancelled: a 500, as uvicorn answers the app's
            self._answered(cycle, None, e)
            return
        if task is not None:  # it waits (a queued batch, a front end's engine): uvicorn's shutdown waits for it too
            self.tasks.add(task)
            task.add_done_callback(functools.partial(self._waited, cycle))

    def _waited(self, cycle: _Infer, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if task.cancelled():  # run_eagerly reports no cancelled task: answered here (else the client waits forever)
            self._answered(cycle, None, asyncio.CancelledError())

    # ---- the request ----

    def _to_app(self) -> None:
        """The request goes to the ASGI app as uvicorn sends any: its scope made as uvicorn's on_message_begin
        makes it (with the URL and headers read meanwhile), then uvicorn's on_headers_complete."""
        url, headers, expect = self.url, self.headers, self.expect_100_continue
        super().on_message_begin()
        self.url, self.expect_100_continue = url, expect
        self.headers = self.scope["headers"] = headers
        super().on_headers_complete()

    def _begin(self, match: re.Match) -> None:
        parser = self.parser
        keep_alive = parser.get_http_version() != "1.0" and parser.should_keep_alive()
        version = match.group(2)
        cycle = self.cycle = _Infer(match.group(1).decode("ascii"), "" if version is None else version.decode("ascii"),
                                    keep_alive)
        length = None
        for name, value in self.headers:
            if name == b"content-length":
                length = value.decode("latin-1")
            elif name == b"content-encoding":
                cycle.encoding = value.decode("latin-1")
            elif name == b"inference-header-content-length":
                cycle.header_length = value.decode("latin-1")
        try:
            check_length(length, self.limit)
        except PayloadTooLarge as e:  # answered before its body is read, which is read and dropped (as uvicorn does)
            self._fail(cycle, e)
            return
        if self.expect_100_continue:
            self.transport.write(_CONTINUE)

    def _answered(self, cycle: _Infer, result, error: BaseException | None) -> None:
        """run_eagerly's done: the answer written (never raises: it runs in the parser's callback or a task's)."""
        if error is None:
            pieces, header_length = result
            self._respond(cycle, 200, pieces, _JSON if header_length is None else _BINARY, None, header_length)
        elif isinstance(error, ServeError):
            self._fail(cycle, error)
        else:
            log.error("internal error answering an infer of model %r version %r", cycle.model, cycle.version,
                      exc_info=error)
            self._respond(cycle, 500, [error_body(f"internal error: {type(error).__name__}: {error}")], _JSON)

    def _fail(self, cycle: _Infer, error: ServeError) -> None:
        self._respond(cycle, error.http_status, [error_body(str(error))], _JSON, error.retry_after)

    def _respond(self, cycle: _Infer, status: int, pieces: list[bytes | memoryview], content_type: bytes,
                 retry_after: int | None = None, header_length: int | None = None) -> None:
        """The head and body in one write (writelines of the pieces for a large answer), then uvicorn's
        on_response_complete: the next pipelined request, or the keep-alive timer."""
        if cycle.response_complete:
            return
        cycle.response_complete = True
        transport = self.transport
        if cycle.disconnected or transport.is_closing():
            return
        size = sum(map(len, pieces)) if len(pieces) > 1 else len(pieces[0])
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:  # Date and Server, as uvicorn sends them
            head += (name, b": ", value, b"\r\n")
        head.append(b"content-length: %d\r\ncontent-type: %s\r\n" % (size, content_type))
        if header_length is not None:
            head.append(b"inference-header-content-length: %d\r\n" % header_length)
        if retry_after:
            head.append(b"retry-after: %d\r\n" % retry_after)
        if not cycle.keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        if size < GATHER_BYTES:
            transport.write(b"".join(head + pieces))  # one buffer: uvloop's fastest write
        else:
            transport.writelines([b"".join(head), *pieces])  # large outputs' views gathered by writev, not joined
        if not cycle.keep_alive:
            transport.close()
        self.on_response_complete()


def infer_protocol(fast: InferFastPath):
    """uvicorn.Config's `http`: InferProtocol over `fast` (uvicorn makes one per connection)."""
    return functools.partial(InferProtocol, fast=fast)
