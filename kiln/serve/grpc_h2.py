"""kiln serve's own gRPC transport: HTTP/2 (RFC 9113) on the event loop's protocol callbacks, as uvicorn's
HTTP/1.1 is, serving the method handlers grpcio's server is given (grpc_server.method_handlers: the same
deserializers, servicer methods and serializers). grpc.aio spends ~300-450 us of server CPU on a call
answered with a constant (its Cython server, completion queue, poller thread and several loop wake-ups);
kiln serve's whole ModelInfer of an empty model costs ~70 us over this transport at concurrency 64, ~510 over
grpc.aio (bench/results/serve-grpc-2026-12-04.md).

    server = GrpcServer(SERVICE, method_handlers(InferenceServicer(core)), max_message_bytes)
    await server.start(sock)       # a listening socket (frontdoors.listen); TLS when options.tls
    await server.stop(grace)       # GOAWAY on every connection; streams in flight finish within `grace` s

Frames and header blocks are written by kiln/serve/h2_frames.py; a call's state and the context its
servicer method gets are kiln/serve/grpc_call.py's Call. Request headers are decoded by the hpack library.
The production options (kiln/serve/grpc_options.py, tritonserver's flags): TLS through asyncio's ssl transport
(ALPN h2), message compression (kiln/serve/grpc_compression.py), keepalive pings and the policing of clients'
pings (kiln/serve/h2_keepalive.py).

HTTP/2 in brief: the client opens with a 24-byte preface and SETTINGS; every frame is a 9-byte header
(24-bit length, type, flags, 31-bit stream id) and its payload. A gRPC call is one client-opened stream:
HEADERS (:path /package.Service/Method, grpc-timeout, ...; HPACK-compressed against a per-connection
dynamic table), DATA carrying messages (each a 5-byte prefix: compressed flag, 32-bit length), the last
frame with END_STREAM; the answer is HEADERS (:status 200), DATA, and trailers (grpc-status, grpc-message)
with END_STREAM, or the trailers alone for an error. DATA is flow-controlled per stream and per
connection: a sender may send what the receiver's windows allow, and the receiver gives them back with
WINDOW_UPDATE. Faults of the peer are connection errors (GOAWAY with a code, then close) or stream errors
(RST_STREAM); a fault of a call (bad message, unknown method) is a gRPC status in its trailers.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import hpack

from kiln.serve.grpc_call import MESSAGE_PREFIX, Call, CallFailed, RequestHead, Requests, unparsable
from kiln.serve.grpc_compression import ACCEPT_ENCODING, compress
from kiln.serve.eager import run_eagerly
from kiln.serve.grpc_options import GrpcOptions
from kiln.serve.h2_frames import (ACK, COMPRESSION_ERROR, CONTINUATION, DATA, DEFAULT_FRAME_SIZE, DEFAULT_WINDOW,
                                  ENABLE_PUSH, END_HEADERS, END_STREAM, ENHANCE_YOUR_CALM, FLOW_CONTROL_ERROR, FRAME,
                                  FRAME_SIZE_ERROR, GOAWAY, GOAWAY_PAYLOAD, HEADERS, INITIAL_WINDOW_SIZE,
                                  INTERNAL_ERROR, MAX_CONCURRENT_STREAMS, MAX_FRAME_SIZE, MAX_WINDOW, NO_ERROR,
                                  OK_TRAILERS, PING, PREFACE, PRIORITY, PRIORITY_FLAG, PROTOCOL_ERROR, PUSH_PROMISE,
                                  REFUSED_STREAM, RESPONSE_HEADERS, RST_STREAM, SETTING, SETTINGS, STREAM_CLOSED,
                                  WINDOW_UPDATE, WORD, ConnectionFault, frame, literal, percent_encode, unpad)
from kiln.serve.h2_keepalive import Keepalive

log = logging.getLogger("kiln.serve")

# what this server asks of its clients
STREAM_WINDOW = 1 << 22  # bytes a client may send on a stream before a WINDOW_UPDATE
CONNECTION_WINDOW = 1 << 24
RECEIVE_FRAME_SIZE = 1 << 20  # larger DATA frames: fewer passes through data_received for large tensors
MAX_STREAMS = 1024  # concurrent calls per connection (past it: REFUSED_STREAM; clients queue)
MAX_HEADER_BLOCK = 1 << 16  # bytes of one header block, CONTINUATIONs included (past it: ENHANCE_YOUR_CALM)
HEADER_CACHE_SIZE = 64
# unary answers this large are compressed on a thread (zlib lets the GIL go), not on the event loop: a 600 KB FP32
# tensor takes 20-35 ms (bench/results/serve-grpc-2026-12-04c.md), all other connections waiting meanwhile
COMPRESS_IN_THREAD_BYTES = 1 << 16
# the response headers of a call whose answers are compressed, per grpc-encoding
COMPRESSED_HEADERS = {encoding: RESPONSE_HEADERS + literal(b"grpc-encoding", encoding.encode())
                      for encoding in ("gzip", "deflate")}


class GrpcConnection(asyncio.Protocol):
    def __init__(self, server: GrpcServer):
        self.server = server
        self._loop: asyncio.AbstractEventLoop | None = None  # looked up once: asking costs a getpid() call on 3.11
        self.handlers = server.handlers
        self.limit = server.max_message_bytes
        self.compression_level = server.options.infer_response_compression_level
        self.keepalive = Keepalive(server.options, self._send_ping, self._keepalive_timed_out, self._has_calls)
        self.transport: asyncio.Transport | None = None
        self.held: list[bytes] = []  # received bytes not yet a whole frame, joined once they are
        self.held_size = 0
        self.needed = 0  # bytes the first held frame needs (0: not known yet, a header short)
        self.preface = False
        self.out: list[bytes] = []
        self.receiving = False  # inside data_received: what it writes goes out at its end, in one write
        self.flush_pending = False
        self.calls: dict[int, Call] = {}
        self.last_stream = 0  # the highest stream id the client opened
        self.last_taken = 0  # the highest it opened that this server took (not refused after its GOAWAY)
        self.continuing: tuple[int, int, list[bytes], int] | None = None  # a header block awaiting CONTINUATION
        self.decoder = hpack.Decoder()
        self.heads: dict[bytes, RequestHead] = {}  # header block -> its RequestHead, while the dynamic table stands
        self.receive_window = CONNECTION_WINDOW
        self.received = 0  # bytes received since the connection's last WINDOW_UPDATE
        self.send_window = DEFAULT_WINDOW
        self.peer_window = DEFAULT_WINDOW  # the client's SETTINGS_INITIAL_WINDOW_SIZE: each new stream's send window
        self.peer_frame_size = DEFAULT_FRAME_SIZE
        self.blocked: dict[int, Call] = {}  # calls with DATA waiting for a window, in order
        self.closing = False  # GOAWAY sent or received: no new streams, closed once the last call ends
        self.dispatch = {DATA: self._data, HEADERS: self._headers, PRIORITY: self._priority,
                         RST_STREAM: self._reset_by_peer, SETTINGS: self._settings, PUSH_PROMISE: self._push_promise,
                         PING: self._ping, GOAWAY: self._goaway, WINDOW_UPDATE: self._window_update,
                         CONTINUATION: self._continuation}

    # ---- the socket ----

    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        settings = b"".join(SETTING.pack(k, v) for k, v in (
            (ENABLE_PUSH, 0), (MAX_CONCURRENT_STREAMS, MAX_STREAMS), (INITIAL_WINDOW_SIZE, STREAM_WINDOW),
            (MAX_FRAME_SIZE, RECEIVE_FRAME_SIZE)))
        transport.write(frame(SETTINGS, 0, 0, settings) +
                        frame(WINDOW_UPDATE, 0, 0, WORD.pack(CONNECTION_WINDOW - DEFAULT_WINDOW)))
        self.keepalive.start()

    def pause_writing(self) -> None:
        """The socket's send buffer is full (a client not reading its answers): its requests wait too."""
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()

    def connection_lost(self, exc) -> None:
        self.transport = None
        self.keepalive.stop()
        for call in list(self.calls.values()):
            self._drop(call)
        self.server.connection_closed(self)

    def data_received(self, data: bytes) -> None:
        if self.held:  # a large frame arrives over many reads: its pieces are joined once, not at every read
            self.held.append(data)
            self.held_size += len(data)
            if self.held_size < self.needed:
                return
            data = b"".join(self.held)
            self.held, self.held_size = [], 0
        self.receiving = True
        try:
            self._receive(data)
        except ConnectionFault as fault:
            self.close(fault.code, str(fault))
        except Exception as e:  # noqa: BLE001 - a fault of this server: this connection ends, the others go on
            log.exception("gRPC connection: internal error", exc_info=e)
            self.close(INTERNAL_ERROR, "internal error")
        finally:
            self.receiving = False
            self._flush()

    def _receive(self, buffer: bytes) -> None:
        if not self.preface:
            if len(buffer) < len(PREFACE):
                if not PREFACE.startswith(buffer):
                    raise ConnectionFault(PROTOCOL_ERROR, "not the HTTP/2 connection preface")
                self.held, self.held_size, self.needed = [buffer], len(buffer), len(PREFACE)
                return
            if not buffer.startswith(PREFACE):
                raise ConnectionFault(PROTOCOL_ERROR, "not the HTTP/2 connection preface")
            buffer = buffer[len(PREFACE):]
            self.preface = True
        pos, end = 0, len(buffer)
        while end - pos >= 9 and self.transport is not None:
            high, low, kind, flags, stream = FRAME.unpack_from(buffer, pos)
            length = high << 8 | low
            if length > RECEIVE_FRAME_SIZE:
                raise ConnectionFault(FRAME_SIZE_ERROR, f"a frame of {length} bytes (at most {RECEIVE_FRAME_SIZE})")
            if end - pos < 9 + length:
                self.needed = 9 + length
                break
            payload = buffer[pos + 9:pos + 9 + length]
            pos += 9 + length
            stream &= 0x7FFFFFFF
            if self.continuing is not None and kind != CONTINUATION:
                raise ConnectionFault(PROTOCOL_ERROR, "a header block interrupted before its END_HEADERS")
            handle = self.dispatch.get(kind)
            if handle is not None:  # unknown frame types are ignored (RFC 9113 section 4.1)
                handle(flags, stream, payload)
        if pos < end:
            rest = buffer[pos:]
            if end - pos < 9:
                self.needed = 9
            self.held, self.held_size = [rest], len(rest)
        if self.received >= CONNECTION_WINDOW // 2:
            self.out.append(frame(WINDOW_UPDATE, 0, 0, WORD.pack(self.received)))
            self.receive_window += self.received
            self.received = 0

    def write(self, data: bytes) -> None:
        """Out with the next flush: at the end of data_received, or at the loop's next turn (answers finished
        together leave in one write)."""
        self.out.append(data)
        if not self.receiving and not self.flush_pending:
            self.flush_pending = True
            self.loop().call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_pending = False
        if self.out and self.transport is not None:
            self.transport.write(b"".join(self.out))
        self.out = []
        if self.closing and not self.calls and self.transport is not None:
            self.transport.close()

    def close(self, code: int, reason: str = "") -> None:
        """GOAWAY(code) and close: a connection error, or the end of a graceful close (NO_ERROR)."""
        if self.transport is None:
            return
        self.out.append(frame(GOAWAY, 0, 0, GOAWAY_PAYLOAD.pack(self.last_taken, code) + reason.encode()[:256]))
        self.transport.write(b"".join(self.out))
        self.out = []
        self.transport.close()
        self.transport = None
        for call in list(self.calls.values()):
            self._drop(call)

    def shut(self) -> None:
        """Graceful: GOAWAY naming the last stream taken; the calls open finish, then the connection closes."""
        if self.transport is None or self.closing:
            return
        self.closing = True
        self.write(frame(GOAWAY, 0, 0, GOAWAY_PAYLOAD.pack(self.last_taken, NO_ERROR)))

    # ---- frames ----

    def _headers(self, flags: int, stream: int, payload: bytes) -> None:
        if stream == 0:
            raise ConnectionFault(PROTOCOL_ERROR, "HEADERS on stream 0")
        block = unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            if len(block) < 5:
                raise ConnectionFault(FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            block = block[5:]
        if flags & END_HEADERS:
            self._header_block(stream, flags, block)
        else:
            self.continuing = (stream, flags, [block], len(block))

    def _continuation(self, flags: int, stream: int, payload: bytes) -> None:
        if self.continuing is None:
            raise ConnectionFault(PROTOCOL_ERROR, "CONTINUATION without a header block to continue")
        first, first_flags, blocks, size = self.continuing
        if stream != first:
            raise ConnectionFault(PROTOCOL_ERROR, f"CONTINUATION on stream {stream} in stream {first}'s header block")
        size += len(payload)
        if size > MAX_HEADER_BLOCK:
            raise ConnectionFault(ENHANCE_YOUR_CALM, f"a header block over {MAX_HEADER_BLOCK} bytes")
        blocks.append(payload)
        self.continuing = (first, first_flags, blocks, size)
        if flags & END_HEADERS:
            self.continuing = None
            self._header_block(stream, first_flags, b"".join(blocks))

    def _decode(self, block: bytes) -> RequestHead:
        """The block's RequestHead. A block decoded before is looked up, not decoded again, while the dynamic
        table is the one it was decoded against: only blocks that left the table as they found it (nothing
        added, evicted or resized) are kept, and any block that changes the table empties the cache, so a
        block found in it would decode to the same headers and change nothing."""
        head = self.heads.get(block)
        if head is not None:
            return head
        table = self.decoder.header_table
        entries = table.dynamic_entries
        size, first, maxsize = len(entries), entries[0] if entries else None, table.maxsize
        try:
            headers = self.decoder.decode(block, raw=True)
        except hpack.HPACKError as e:
            raise ConnectionFault(COMPRESSION_ERROR, f"header block: {e}") from None
        head = RequestHead(headers, self.compression_level)
        # an entry added is a new tuple at the front; evictions and resizes change the length or the size
        if len(entries) == size and table.maxsize == maxsize and (entries[0] if entries else None) is first:
            if len(self.heads) >= HEADER_CACHE_SIZE:
                self.heads.clear()
            self.heads[block] = head
        else:
            self.heads.clear()
        return head

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

    def _settings(self, flags: int, stream: int, payload: bytes) -> None:
        if stream != 0:
            raise ConnectionFault(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ConnectionFault(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise ConnectionFault(FRAME_SIZE_ERROR, f"SETTINGS of {len(payload)} bytes (a multiple of 6)")
        for at in range(0, len(payload), 6):
            key, value = SETTING.unpack_from(payload, at)
            if key == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ConnectionFault(FLOW_CONTROL_ERROR, f"SETTINGS_INITIAL_WINDOW_SIZE {value}")
                delta, self.peer_window = value - self.peer_window, value
                for call in self.calls.values():
                    call.send_window += delta
            elif key == MAX_FRAME_SIZE:
                if not DEFAULT_FRAME_SIZE <= value <= (1 << 24) - 1:
                    raise ConnectionFault(PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE {value}")
                self.peer_frame_size = value
            elif key == ENABLE_PUSH and value > 1:
                raise ConnectionFault(PROTOCOL_ERROR, f"SETTINGS_ENABLE_PUSH {value}")
            # HEADER_TABLE_SIZE: this server never indexes what it sends; the rest are advice
        self.write(frame(SETTINGS, ACK, 0))
        self._send_blocked()

    def _window_update(self, flags: int, stream: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionFault(FRAME_SIZE_ERROR, "WINDOW_UPDATE of other than 4 bytes")
        increment = WORD.unpack(payload)[0] & 0x7FFFFFFF
        if stream == 0:
            if increment == 0:
                raise ConnectionFault(PROTOCOL_ERROR, "WINDOW_UPDATE of 0 on the connection")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise ConnectionFault(FLOW_CONTROL_ERROR, "the connection's window past 2^31-1")
            self._send_blocked()
            return
        call = self.calls.get(stream)
        if call is None:
            if stream > self.last_stream:
                raise ConnectionFault(PROTOCOL_ERROR, f"WINDOW_UPDATE on stream {stream}, never opened")
            return
        if increment == 0:
            self._reset(call, PROTOCOL_ERROR)
            return
        call.send_window += increment
        if call.send_window > MAX_WINDOW:
            self._reset(call, FLOW_CONTROL_ERROR)
            return
        if call.outbox:
            self._send(call)

    def _ping(self, flags: int, stream: int, payload: bytes) -> None:
        if stream != 0:
            raise ConnectionFault(PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise ConnectionFault(FRAME_SIZE_ERROR, "PING of other than 8 bytes")
        if flags & ACK:
            self.keepalive.ack_received(payload)
            return
        if self.keepalive.ping_received():
            raise ConnectionFault(ENHANCE_YOUR_CALM, "too_many_pings")  # gRPC core's words, which clients look for
        self.write(frame(PING, ACK, 0, payload))

    def _has_calls(self) -> bool:
        return bool(self.calls)

    def _send_ping(self, payload: bytes) -> None:
        self.write(frame(PING, 0, 0, payload))

    def _keepalive_timed_out(self) -> None:
        """Its PING went unanswered: the peer (or the path to it) is gone; what is buffered for it is dropped."""
        transport = self.transport
        self.close(NO_ERROR, "keepalive watchdog timeout")
        if transport is not None:
            transport.abort()

    def _goaway(self, flags: int, stream: int, payload: bytes) -> None:
        if stream != 0:
            raise ConnectionFault(PROTOCOL_ERROR, "GOAWAY on a stream")
        self.closing = True  # the client opens no more streams; the ones open are answered

    def _reset_by_peer(self, flags: int, stream: int, payload: bytes) -> None:
        if stream == 0 or len(payload) != 4:
            raise ConnectionFault(PROTOCOL_ERROR if stream == 0 else FRAME_SIZE_ERROR, "malformed RST_STREAM")
        if stream > self.last_stream:
            raise ConnectionFault(PROTOCOL_ERROR, f"RST_STREAM on stream {stream}, never opened")
        call = self.calls.get(stream)
        if call is not None:
            self._drop(call)

    def _priority(self, flags: int, stream: int, payload: bytes) -> None:
        if stream == 0 or len(payload) != 5:
            raise ConnectionFault(PROTOCOL_ERROR if stream == 0 else FRAME_SIZE_ERROR, "malformed PRIORITY")

    def _push_promise(self, flags: int, stream: int, payload: bytes) -> None:
        raise ConnectionFault(PROTOCOL_ERROR, "PUSH_PROMISE from a client")

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

    def _answer_whole(self, call: Call, body: bytes) -> bool:
        """The common unary answer (status OK, no trailing metadata, uncompressed) whose message fits the send
        windows and one frame: its headers, message and trailers written at once, what _send_message, _send, _end
        and _trailers would write, in a fraction of the calls. False (nothing written): the general path."""
        size = len(body) + MESSAGE_PREFIX.size
        if call.code is not grpc.StatusCode.OK or call.details or call.trailing or call.headers_sent or call.outbox \
                or size > call.send_window or size > self.send_window or size > self.peer_frame_size:
            return False
        stream = call.id
        call.send_window -= size
        self.send_window -= size
        self.keepalive.data_sent()
        call.headers_sent = call.finished = True
        if call.timer is not None:
            call.timer.cancel()
        self.write(b"".join((frame(HEADERS, END_HEADERS, stream, RESPONSE_HEADERS),
                             FRAME.pack(size >> 8, size & 0xFF, DATA, 0, stream), MESSAGE_PREFIX.pack(0, len(body)), body,
                             frame(HEADERS, END_HEADERS | END_STREAM, stream, OK_TRAILERS))))
        if not call.remote_closed:  # answered before the request ended: the client need send no more
            self.write(frame(RST_STREAM, 0, stream, WORD.pack(NO_ERROR)))
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

    def _send(self, call: Call) -> None:
        """As much of the call's outbox as the windows let go, then its trailers once it is empty and ended."""
        outbox, sent = call.outbox, call.sent
        view = memoryview(outbox)  # frames cut from it without copying the rest each time
        while sent < len(outbox):
            n = min(len(outbox) - sent, call.send_window, self.send_window, self.peer_frame_size)
            if n <= 0:
                break
            self.write(frame(DATA, 0, call.id, view[sent:sent + n]))
            sent += n
            call.send_window -= n
            self.send_window -= n
            self.keepalive.data_sent()
        if sent < len(outbox):
            call.sent = sent
            self.blocked[call.id] = call
            return
        call.outbox, call.sent = b"", 0
        self.blocked.pop(call.id, None)
        if call.finished:
            self._trailers(call)

    def _send_blocked(self) -> None:
        for call in list(self.blocked.values()):
            if self.send_window <= 0:
                return
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

    def _header_frames(self, stream: int, block: bytes, end_stream: bool) -> None:
        """HEADERS, and CONTINUATIONs for a block larger than the client's frame size."""
        self.keepalive.data_sent()
        size = self.peer_frame_size
        flags = END_STREAM if end_stream else 0
        if len(block) <= size:
            self.write(frame(HEADERS, flags | END_HEADERS, stream, block))
            return
        pieces = [block[at:at + size] for at in range(0, len(block), size)]
        self.write(frame(HEADERS, flags, stream, pieces[0]))
        for piece in pieces[1:-1]:
            self.write(frame(CONTINUATION, 0, stream, piece))
        self.write(frame(CONTINUATION, END_HEADERS, stream, pieces[-1]))

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

    def _reset(self, call: Call, code: int) -> None:
        """A stream error: RST_STREAM(code), the call dropped."""
        self.write(frame(RST_STREAM, 0, call.id, WORD.pack(code)))
        self._drop(call)

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


class GrpcServer:
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

