"""kiln serve's own gRPC transport: HTTP/2 (RFC 9113) on the event loop's protocol callbacks, as uvicorn's
HTTP/1.1 is, serving the method handlers grpcio's server is given (grpc_server.method_handlers: the same
deserializers, servicer methods and serializers). grpc.aio spends ~300-450 us of server CPU on a call
answered with a constant (its Cython server, completion queue, poller thread and several loop wake-ups);
kiln serve's whole ModelInfer of an empty model costs ~70 us over this transport at concurrency 64, ~510 over
grpc.aio (bench/results/serve-grpc-2026-12-04.md).

    server = GrpcServer(SERVICE, method_handlers(InferenceServicer(core)), max_message_bytes)
    await server.start(sock)       # a listening socket (frontdoors.listen); TLS when options.tls
    await server.stop(grace)       # GOAWAY on every connection; streams in flight finish within `grace` s

The HTTP/2 connection (frames, HPACK, SETTINGS, flow control, PING and keepalive, GOAWAY) is
kiln/serve/h2_connection.py's H2Connection; GrpcConnection here makes each of its streams a gRPC call: the
request's messages cut and handed to the method's handler (its first step run at once: kiln/serve/eager.py),
the answer's message and trailers written back. A call's state and the context its servicer method gets are
kiln/serve/grpc_call.py's Call. The production options (kiln/serve/grpc_options.py, tritonserver's flags): TLS
through asyncio's ssl transport (ALPN h2), message compression (kiln/serve/grpc_compression.py), keepalive pings
and the policing of clients' pings (kiln/serve/h2_keepalive.py).

gRPC over HTTP/2: a call is one client-opened stream: HEADERS (:path /package.Service/Method, grpc-timeout,
...), DATA carrying messages (each a 5-byte prefix: compressed flag, 32-bit length), the last frame with
END_STREAM; the answer is HEADERS (:status 200), DATA, and trailers (grpc-status, grpc-message) with
END_STREAM, or the trailers alone for an error. A fault of a call (bad message, unknown method) is a gRPC
status in its trailers; faults of HTTP/2 are the connection's.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from kiln.serve.eager import run_eagerly
from kiln.serve.grpc_call import MESSAGE_PREFIX, Call, CallFailed, RequestHead, Requests, unparsable
from kiln.serve.grpc_compression import ACCEPT_ENCODING, compress
from kiln.serve.grpc_options import GrpcOptions
from kiln.serve.grpc_wire import Parts
from kiln.serve.h2_connection import MAX_STREAMS, STREAM_WINDOW, H2Connection, H2Server
from kiln.serve.h2_frames import (DATA, END_HEADERS, END_STREAM, FLOW_CONTROL_ERROR, FRAME, HEADERS, NO_ERROR,
                                  OK_TRAILERS, PROTOCOL_ERROR, REFUSED_STREAM, RESPONSE_HEADERS, RST_STREAM,
                                  STREAM_CLOSED, WINDOW_UPDATE, WORD, ConnectionFault, frame, literal, percent_encode,
                                  unpad)

log = logging.getLogger("kiln.serve")

# unary answers this large are compressed on a thread (zlib lets the GIL go), not on the event loop: a 600 KB FP32
# tensor takes 20-35 ms (bench/results/serve-grpc-2026-12-04c.md), all other connections waiting meanwhile
COMPRESS_IN_THREAD_BYTES = 1 << 16
# the response headers of a call whose answers are compressed, per grpc-encoding
COMPRESSED_HEADERS = {encoding: RESPONSE_HEADERS + literal(b"grpc-encoding", encoding.encode())
                      for encoding in ("gzip", "deflate")}


class GrpcConnection(H2Connection):
    """An HTTP/2 connection whose streams are gRPC calls of the server's method handlers."""

    def __init__(self, server: GrpcServer):
        super().__init__(server)
        self.handlers = server.handlers
        self.limit = server.max_message_bytes
        self.compression_level = server.options.infer_response_compression_level

    def _head(self, headers: list[tuple[bytes, bytes]]) -> RequestHead:
        return RequestHead(headers, self.compression_level)

    # ---- requests ----

    def _header_block(self, stream: int, flags: int, block: bytes) -> None:
        head = self._decode(block)  # always: the dynamic table must follow every block
        call = self.calls.get(stream)
        if call is not None:  # trailers from the client: only to end its stream
            if not flags & END_STREAM:
                self._reset(call, PROTOCOL_ERROR)
                return
            self._end_of_request(call)
            return
        if stream % 2 == 0 or stream <= self.last_stream:
            raise ConnectionFault(PROTOCOL_ERROR, f"HEADERS opening stream {stream} (after {self.last_stream})")
        self.last_stream = stream
        if self.closing:
            self.write(frame(RST_STREAM, 0, stream, WORD.pack(REFUSED_STREAM)))  # past the GOAWAY: retry elsewhere
            return
        self.last_taken = stream
        if len(self.calls) >= MAX_STREAMS:
            self.write(frame(RST_STREAM, 0, stream, WORD.pack(REFUSED_STREAM)))
            return
        handler = self.handlers.get(head.path)
        call = Call(stream, handler, head, STREAM_WINDOW, self.peer_window)
        self.calls[stream] = call
        if flags & END_STREAM:
            call.remote_closed = True
        if head.error is not None:
            if head.encoding is not None:  # gRPC's compression.md: say which encodings would do
                call.trailing = (("grpc-accept-encoding", ACCEPT_ENCODING),)
            self._fail(call, head.error)
        elif handler is None:
            self._fail(call, CallFailed(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {head.path}"))
        else:
            if head.timeout is not None:
                call.timer = self.loop().call_later(head.timeout, self._deadline, call)
            if call.requests is not None:
                call.task = self.loop().create_task(self._stream_call(call))
                call.task.add_done_callback(lambda task: self._task_done(call, task))
            if call.remote_closed:
                self._end_of_request(call)

    def _data(self, flags: int, stream: int, payload: bytes) -> None:
        size = len(payload)
        if size > self.receive_window:
            raise ConnectionFault(FLOW_CONTROL_ERROR, "DATA past the connection's window")
        self.receive_window -= size
        self.received += size
        call = self.calls.get(stream)
        if call is None:
            if stream == 0 or stream > self.last_stream:
                raise ConnectionFault(PROTOCOL_ERROR, f"DATA on stream {stream}, never opened")
            return  # a stream this server ended (reset or answered early): ignored, its bytes counted above
        if call.remote_closed:
            self._reset(call, STREAM_CLOSED)
            return
        if size > call.receive_window:
            self._reset(call, FLOW_CONTROL_ERROR)
            return
        call.receive_window -= size
        data = unpad(flags, payload)
        if call.finished:  # answered early (an error) while the client still sends: its bytes are dropped
            pass
        elif data:
            call.chunks.append(data)
            call.held += len(data)
            try:
                messages = call.cut_messages(self.limit)
            except CallFailed as failure:
                self._fail(call, failure)
                return
            for message in messages:
                self._message(call, message)
        if flags & END_STREAM:
            self._end_of_request(call)
        elif not call.finished:
            call.received += size
            if call.received >= STREAM_WINDOW // 2:
                self.write(frame(WINDOW_UPDATE, 0, stream, WORD.pack(call.received)))
                call.receive_window += call.received
                call.received = 0

    def _message(self, call: Call, message: bytes) -> None:
        if call.requests is None:
            if call.messages:
                self._fail(call, CallFailed(grpc.StatusCode.UNIMPLEMENTED, "a unary call with more than one request"))
                return
            call.messages.append(message)
            return
        try:
            request = call.handler.request_deserializer(message)
        except Exception as e:  # noqa: BLE001 - the client's message: answered as its call's status
            self._fail(call, unparsable(call, e))
            return
        call.requests.put_nowait(request)

    def _end_of_request(self, call: Call) -> None:
        call.remote_closed = True
        if call.finished:
            self._forget(call)
            return
        if call.held:
            self._fail(call, CallFailed(grpc.StatusCode.INTERNAL, f"the request ended inside a message "
                                                                  f"({call.held} bytes of it)"))
            return
        if call.requests is not None:
            call.requests.put_nowait(None)
            return
        if not call.messages:
            self._fail(call, CallFailed(grpc.StatusCode.UNIMPLEMENTED, "a unary call without its request"))
            return
        handler = call.handler
        try:
            request = handler.request_deserializer(call.messages.pop())
        except Exception as e:  # noqa: BLE001 - the client's message: answered as its call's status
            self._fail(call, unparsable(call, e))
            return
        try:
            answer = handler.unary_unary(request, call)
        except Exception as e:  # noqa: BLE001 - a plain function's failure (the base class's "not implemented")
            self._answer(call, None, e)
            return
        if not asyncio.iscoroutine(answer):
            self._answer(call, answer, None)
            return
        # its first step now: an answer that needs no waiting goes out with this read's write (kiln/serve/eager.py)
        call.task = run_eagerly(answer, self.loop(), lambda result, error: self._handler_done(call, result, error))

    # ---- answers ----

    def _task_done(self, call: Call, task: asyncio.Task) -> None:
        if not call.finished and not task.cancelled():
            error = task.exception()
            self._answer(call, None if error else task.result(), error)

    def _handler_done(self, call: Call, result, error: BaseException | None) -> None:
        if not call.finished:
            self._answer(call, result, error)

    def _answer(self, call: Call, result, error: BaseException | None) -> None:
        """The handler returned (its answer, for a unary call; the end of its stream of answers) or failed."""
        if error is None:
            if call.requests is None:
                if type(result) is Parts and call.head.response_encoding is None and self._answer_parts(call, result):
                    return
                try:
                    body = call.handler.response_serializer(result)
                except Exception as e:  # noqa: BLE001 - the call's status
                    log.exception("gRPC %s: serializing the answer", call.head.path, exc_info=e)
                    call.code, call.details = grpc.StatusCode.INTERNAL, f"serializing the answer: {e}"
                else:
                    encoding = call.head.response_encoding
                    if encoding is None and self._answer_whole(call, body):
                        return
                    if encoding is not None and len(body) >= COMPRESS_IN_THREAD_BYTES:
                        packing = self.loop().run_in_executor(None, compress, body, encoding)
                        packing.add_done_callback(lambda done: self._compressed(call, body, done))
                        return
                    self._send_message(call, body)
        elif call.code is grpc.StatusCode.OK:  # failed with no status set (abort, set_code): a fault of the server
            log.exception("gRPC %s: internal error", call.head.path, exc_info=error)
            call.code, call.details = grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}"
        self._end(call)

    def _claim_whole(self, call: Call, size: int) -> bool:
        """Whether a unary answer of `size` bytes (message and prefix) can leave at once, with its headers and
        trailers (status OK, no details or trailing metadata, nothing sent or queued yet, both send windows hold
        it); if so, the windows taken and the call marked answered, for _answer_whole and _answer_parts to write."""
        if call.code is not grpc.StatusCode.OK or call.details or call.trailing or call.headers_sent or call.outbox \
                or size > call.send_window or size > self.send_window:
            return False
        call.send_window -= size
        self.send_window -= size
        self.keepalive.data_sent()
        call.headers_sent = call.finished = True
        if call.timer is not None:
            call.timer.cancel()
        return True

    def _answer_whole(self, call: Call, body: bytes) -> bool:
        """The common unary answer (status OK, no trailing metadata, uncompressed) whose message fits the send
        windows and one frame: its headers, message and trailers written at once, what _send_message, _send, _end
        and _trailers would write, in a fraction of the calls. False (nothing written): the general path."""
        size = len(body) + MESSAGE_PREFIX.size
        if size > self.peer_frame_size or not self._claim_whole(call, size):
            return False
        stream = call.id
        self.write(b"".join((frame(HEADERS, END_HEADERS, stream, RESPONSE_HEADERS),
                             FRAME.pack(size >> 8, size & 0xFF, DATA, 0, stream), MESSAGE_PREFIX.pack(0, len(body)), body,
                             frame(HEADERS, END_HEADERS | END_STREAM, stream, OK_TRAILERS))))
        if not call.remote_closed:  # answered before the request ended: the client need send no more
            self.write(frame(RST_STREAM, 0, stream, WORD.pack(NO_ERROR)))
        self._forget(call)
        return True

    def _answer_parts(self, call: Call, parts: Parts) -> bool:
        """_answer_whole for a large answer left in its Parts (grpc_wire.ResponseEncoder): the DATA frames' payloads
        are cut from the parts as views, not copied out of a joined message, and leave with the headers and trailers
        in one writelines (H2Connection.write_views). False (nothing written) where the send windows do not hold the
        whole message: the general path then sends it joined, as the windows open."""
        size = parts.size + MESSAGE_PREFIX.size
        if not self._claim_whole(call, size):
            return False
        stream = call.id
        out = [frame(HEADERS, END_HEADERS, stream, RESPONSE_HEADERS)]
        pieces = iter([MESSAGE_PREFIX.pack(0, parts.size), *parts])
        piece, at = memoryview(next(pieces)), 0
        left, limit = size, self.peer_frame_size
        while left:
            n = min(left, limit)
            left -= n
            out.append(FRAME.pack(n >> 8, n & 0xFF, DATA, 0, stream))
            while n:
                if at == len(piece):
                    piece, at = memoryview(next(pieces)), 0
                    continue
                take = min(n, len(piece) - at)
                out.append(piece[at:at + take])
                at += take
                n -= take
        out.append(frame(HEADERS, END_HEADERS | END_STREAM, stream, OK_TRAILERS))
        if not call.remote_closed:  # answered before the request ended: the client need send no more
            out.append(frame(RST_STREAM, 0, stream, WORD.pack(NO_ERROR)))
        self.write_views(out)
        self._forget(call)
        return True

    def _compressed(self, call: Call, body: bytes, done: asyncio.Future) -> None:
        """A large unary answer back from its compression thread: sent, then its trailers; nothing when the call
        ended meanwhile (reset, deadline passed, connection lost)."""
        if call.finished or self.calls.get(call.id) is not call:
            return
        packed = body  # no smaller than body: sent uncompressed
        if done.cancelled() or done.exception() is not None:  # the thread pool shut down, or a fault of zlib
            log.warning("gRPC %s: compressing the answer failed (%s): sent uncompressed", call.head.path,
                        "cancelled" if done.cancelled() else done.exception())
        else:
            packed = done.result()
        self._send_message(call, body, packed)
        self._end(call)

    async def _stream_call(self, call: Call) -> None:
        handler = call.handler
        async for response in handler.stream_stream(Requests(call), call):
            self._send_message(call, handler.response_serializer(response))

    def _send_message(self, call: Call, body: bytes, packed: bytes | None = None) -> None:
        """One message of the answer; `packed`: body already compressed with the call's encoding (None: done
        here, when the call's answers are compressed)."""
        if call.finished:
            return
        encoding = call.head.response_encoding
        if not call.headers_sent:
            self._header_frames(call.id, RESPONSE_HEADERS if encoding is None else COMPRESSED_HEADERS[encoding],
                                end_stream=False)
            call.headers_sent = True
        if packed is None and encoding is not None:
            packed = compress(body, encoding)
        if packed is not None and len(packed) < len(body):
            message = MESSAGE_PREFIX.pack(1, len(packed)) + packed
        else:  # uncompressed, or no smaller compressed (gRPC core sends those as they are, flag 0)
            message = MESSAGE_PREFIX.pack(0, len(body)) + body
        call.outbox = call.outbox[call.sent:] + message if call.outbox else message
        call.sent = 0
        self._send(call)

    def _end(self, call: Call) -> None:
        """The call's status is known: trailers after its DATA (now, or once the windows let that go)."""
        call.finished = True
        if call.timer is not None:
            call.timer.cancel()
        if not call.outbox:
            self._trailers(call)

    def _trailers(self, call: Call) -> None:
        block = literal(b"grpc-status", b"%d" % call.code.value[0]) if call.code is not grpc.StatusCode.OK \
            else OK_TRAILERS
        if call.details:
            block += literal(b"grpc-message", percent_encode(call.details))
        for key, value in call.trailing:
            block += literal(key.encode("latin-1"), value if isinstance(value, bytes) else value.encode())
        if not call.headers_sent:  # trailers only
            block = RESPONSE_HEADERS + block
        self._header_frames(call.id, block, end_stream=True)
        if call.remote_closed:
            self._forget(call)
        else:  # answered before the request ended: the client need send no more
            self.write(frame(RST_STREAM, 0, call.id, WORD.pack(NO_ERROR)))
            self._forget(call)

    def _fail(self, call: Call, failure: CallFailed) -> None:
        """The call ends with this status now; its handler, if running, is cancelled."""
        if call.finished:
            return
        call.code, call.details = failure.code, str(failure)
        call.outbox, call.sent = b"", 0  # the status replaces an answer not yet sent
        call.cancel()
        self._end(call)

    def _deadline(self, call: Call) -> None:
        call.timer = None
        self._fail(call, CallFailed(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def _drop(self, call: Call) -> None:
        """The call ends unanswered (reset by either side, or the connection is gone)."""
        call.finished = True
        call.cancel()
        if call.timer is not None:
            call.timer.cancel()
        self._forget(call)

    def _forget(self, call: Call) -> None:
        self.calls.pop(call.id, None)
        self.blocked.pop(call.id, None)
        if self.closing and not self.calls:
            self.write(b"")  # the flush closes the connection


class GrpcServer(H2Server):
    """Serves `handlers` (grpc's RpcMethodHandler per method name, as grpc_server.method_handlers makes them) of
    `service` over HTTP/2: the unary and the bidirectional-streaming calls (what GRPCInferenceService has)."""

    def __init__(self, service: str, handlers: dict, max_message_bytes: int, options: GrpcOptions | None = None):
        for name, handler in handlers.items():
            if handler.request_streaming != handler.response_streaming:
                raise ValueError(f"{service}/{name}: only unary and bidirectional-streaming calls are served")
        self.handlers = {f"/{service}/{name}": handler for name, handler in handlers.items()}
        self.max_message_bytes = max_message_bytes
        self.options = options or GrpcOptions()
        self.ssl = self.options.ssl_context()  # None: plaintext (h2c)
        self.connections: set[GrpcConnection] = set()
        self._server: asyncio.Server | None = None
        self._idle = asyncio.Event()

    async def start(self, sock) -> None:
        self._server = await asyncio.get_running_loop().create_server(self._connection, sock=sock, ssl=self.ssl)

    def _connection(self) -> GrpcConnection:
        return GrpcConnection(self)

    def connection_closed(self, connection: GrpcConnection) -> None:
        self.connections.discard(connection)
        if not self.connections:
            self._idle.set()

    async def stop(self, grace: float | None) -> None:
        """No new connections; GOAWAY on each open one, whose calls finish within `grace` seconds (then they
        are cut)."""
        if self._server is None:
            return
        self._server.close()
        if self.connections:
            self._idle.clear()
            for connection in list(self.connections):
                connection.shut()
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except TimeoutError:
                for connection in list(self.connections):
                    connection.close(NO_ERROR, "shutdown: the grace period is over")
        await self._server.wait_closed()
        self._server = None

