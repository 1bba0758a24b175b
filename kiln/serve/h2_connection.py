"""HTTP/2 (RFC 9113) on the event loop's protocol callbacks, as uvicorn's HTTP/1.1 is: the connection of kiln's
own gRPC transport (kiln/serve/grpc_h2.py, whose GrpcConnection makes each stream a gRPC call). Here: the preface,
frames read across socket reads, header blocks (HPACK-decoded by the hpack library, CONTINUATIONs joined),
SETTINGS, PING and the keepalive (kiln/serve/h2_keepalive.py), GOAWAY and RST_STREAM, flow control both ways
(the client's windows given back with WINDOW_UPDATE, this side's DATA sent as the client's windows allow), and
one write per socket read. Frames and header blocks are written by kiln/serve/h2_frames.py.

HTTP/2 in brief: the client opens with a 24-byte preface and SETTINGS; every frame is a 9-byte header
(24-bit length, type, flags, 31-bit stream id) and its payload. A stream opens with a HEADERS frame
(HPACK-compressed against a per-connection dynamic table) and carries DATA, the last frame of each side with
END_STREAM. DATA is flow-controlled per stream and per connection: a sender may send what the receiver's
windows allow, and the receiver gives them back with WINDOW_UPDATE. Faults of the peer are connection errors
(GOAWAY with a code, then close) or stream errors (RST_STREAM).
"""

from __future__ import annotations

import asyncio
import logging

from kiln.serve.grpc_call import Call, RequestHead
from kiln.serve.grpc_options import GrpcOptions
from kiln.serve.h2_frames import (ACK, CONTINUATION, DATA, DEFAULT_FRAME_SIZE, DEFAULT_WINDOW, ENABLE_PUSH,
                                  END_HEADERS, END_STREAM, ENHANCE_YOUR_CALM, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR,
                                  GOAWAY, GOAWAY_PAYLOAD, HEADERS, INITIAL_WINDOW_SIZE, INTERNAL_ERROR,
                                  MAX_CONCURRENT_STREAMS, MAX_FRAME_SIZE, MAX_WINDOW, NO_ERROR, PING, PREFACE, PRIORITY,
                                  PRIORITY_FLAG, PROTOCOL_ERROR, PUSH_PROMISE, RST_STREAM, SETTING, SETTINGS,
                                  WINDOW_UPDATE, WORD, ConnectionFault, FrameReader, HeaderBlocks, frame, unpad)
from kiln.serve.h2_keepalive import Keepalive

log = logging.getLogger("kiln.serve")

# what this server asks of its clients
STREAM_WINDOW = 1 << 22  # bytes a client may send on a stream before a WINDOW_UPDATE
CONNECTION_WINDOW = 1 << 24
RECEIVE_FRAME_SIZE = 1 << 20  # larger DATA frames: fewer passes through data_received for large tensors
MAX_STREAMS = 1024  # concurrent calls per connection (past it: REFUSED_STREAM; clients queue)
MAX_HEADER_BLOCK = 1 << 16  # bytes of one header block, CONTINUATIONs included (past it: ENHANCE_YOUR_CALM)

class H2Server:
    """What a connection needs of its server: its options (keepalive) and the set of open connections."""

    options: GrpcOptions
    connections: set

    def connection_closed(self, connection: H2Connection) -> None:
        raise NotImplementedError


class H2Connection(asyncio.Protocol):
    """One client's HTTP/2 connection. Streams are the subclass's: `calls` by stream id, each with the send state
    _send reads (id, send_window, outbox, sent, finished). The subclass gives what a request means:
    _head (what a header block says, cached while the HPACK table stands), _header_block (a complete block: a
    stream opened, or its trailers), _data (a DATA frame), _trailers (a stream's end, once its DATA is out) and
    _drop (a stream ended unanswered)."""

    def __init__(self, server: H2Server):
        self.server = server
        self._loop: asyncio.AbstractEventLoop | None = None  # looked up once: asking costs a getpid() call on 3.11
        self.keepalive = Keepalive(server.options, self._send_ping, self._keepalive_timed_out, self._has_calls)
        self.transport: asyncio.Transport | None = None
        self.reader = FrameReader(RECEIVE_FRAME_SIZE)
        self.preface = False
        self.out: list[bytes] = []
        self.gather = False  # self.out holds views of large answers (write_views): written with writelines
        self.receiving = False  # inside data_received: what it writes goes out at its end, in one write
        self.flush_pending = False
        self.calls: dict[int, Call] = {}
        self.last_stream = 0  # the highest stream id the client opened
        self.last_taken = 0  # the highest it opened that this server took (not refused after its GOAWAY)
        self.continuing: tuple[int, int, list[bytes], int] | None = None  # a header block awaiting CONTINUATION
        self._decode = HeaderBlocks(self._head)  # a header block -> its RequestHead
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

    # ---- what the subclass says a stream is ----

    def _head(self, headers: list[tuple[bytes, bytes]]) -> RequestHead:
        raise NotImplementedError

    def _header_block(self, stream: int, flags: int, block: bytes) -> None:
        raise NotImplementedError

    def _data(self, flags: int, stream: int, payload: bytes) -> None:
        raise NotImplementedError

    def _trailers(self, call: Call) -> None:
        raise NotImplementedError

    def _drop(self, call: Call) -> None:
        raise NotImplementedError

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
        data = self.reader.whole(data)  # a large frame arrives over many reads: its pieces are joined once
        if data is None:
            return
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
        start = 0
        if not self.preface:
            if len(buffer) < len(PREFACE):
                if not PREFACE.startswith(buffer):
                    raise ConnectionFault(PROTOCOL_ERROR, "not the HTTP/2 connection preface")
                self.reader.hold(buffer, len(PREFACE))
                return
            if not buffer.startswith(PREFACE):
                raise ConnectionFault(PROTOCOL_ERROR, "not the HTTP/2 connection preface")
            start = len(PREFACE)
            self.preface = True
        for kind, flags, stream, payload in self.reader.frames(buffer, start):
            if self.transport is None:  # closed by a frame before
                break
            if self.continuing is not None and kind != CONTINUATION:
                raise ConnectionFault(PROTOCOL_ERROR, "a header block interrupted before its END_HEADERS")
            handle = self.dispatch.get(kind)
            if handle is not None:  # unknown frame types are ignored (RFC 9113 section 4.1)
                handle(flags, stream, payload)
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

    def write_views(self, pieces: list) -> None:
        """write() for an answer's pieces, some of them views of large tensors: they leave in one writelines (uvloop
        gathers them into the socket with writev; asyncio's transports join them) instead of being joined here."""
        self.out.extend(pieces)
        self.gather = True
        if not self.receiving and not self.flush_pending:
            self.flush_pending = True
            self.loop().call_soon(self._flush)

    def _flush(self) -> None:
        self.flush_pending = False
        if self.out and self.transport is not None:
            if self.gather:
                self.transport.writelines(self.out)
            else:
                self.transport.write(b"".join(self.out))
        self.out = []
        self.gather = False
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

    # ---- sending ----

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

    def _reset(self, call: Call, code: int) -> None:
        """A stream error: RST_STREAM(code), the call dropped."""
        self.write(frame(RST_STREAM, 0, call.id, WORD.pack(code)))
        self._drop(call)
