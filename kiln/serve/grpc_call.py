"""One gRPC call of kiln's own transport (kiln/serve/grpc_h2.py): what its request headers say, its request
cut into messages as DATA arrives, and the context its servicer method gets.

gRPC over HTTP/2 (gRPC's PROTOCOL-HTTP2.md): a call is one client-opened stream; the request is HEADERS
(:path /package.Service/Method, content-type application/grpc, grpc-timeout, ...) and DATA carrying
messages, each a 5-byte prefix (compressed flag, 32-bit length) and the message.
"""

from __future__ import annotations

import asyncio
import struct

import grpc

from kiln.serve.grpc_compression import WBITS, CompressionFailed, accepted, decompress, response_encoding

MESSAGE_PREFIX = struct.Struct(">BI")  # gRPC's: compressed flag, length
TIMEOUT_UNITS = {ord("H"): 3600.0, ord("M"): 60.0, ord("S"): 1.0, ord("m"): 1e-3, ord("u"): 1e-6, ord("n"): 1e-9}


class CallFailed(Exception):
    """A call ends with this gRPC status before its handler runs (unknown method, malformed message, ...)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code


class RequestHead:
    """What a call's request headers say that the transport acts on; decoded once per distinct header block.
    `compression_level`: the server's --grpc-infer-response-compression-level, which with the client's
    grpc-accept-encoding gives `response_encoding` (kiln/serve/grpc_compression.py)."""

    __slots__ = ("path", "timeout", "encoding", "response_encoding", "error")

    def __init__(self, headers: list[tuple[bytes, bytes]], compression_level: str = "none"):
        self.path = self.encoding = self.response_encoding = None
        self.timeout: float | None = None
        self.error: CallFailed | None = None
        method = content_type = None
        accepts: tuple[str, ...] = ()
        for name, value in headers:
            if name == b":path":
                self.path = value.decode("latin-1")
            elif name == b":method":
                method = value
            elif name == b"content-type":
                content_type = value
            elif name == b"grpc-timeout":
                self.timeout = _timeout(value)
                if self.timeout is None:
                    self.error = CallFailed(grpc.StatusCode.INVALID_ARGUMENT, f"malformed grpc-timeout {value!r}")
            elif name == b"grpc-encoding" and value != b"identity":
                self.encoding = value.decode("latin-1")
            elif name == b"grpc-accept-encoding":
                accepts = accepted(value)
        if compression_level != "none":
            self.response_encoding = response_encoding(compression_level, accepts)
        if self.encoding is not None and self.encoding not in WBITS:
            self.error = CallFailed(grpc.StatusCode.UNIMPLEMENTED, f"grpc-encoding {self.encoding!r} is not "
                                    "supported: send gzip, deflate or identity")
        if method != b"POST" or self.path is None:
            self.error = CallFailed(grpc.StatusCode.UNIMPLEMENTED, "a gRPC call is a POST with a :path")
        elif content_type is None or not content_type.startswith(b"application/grpc"):
            self.error = CallFailed(grpc.StatusCode.INVALID_ARGUMENT, f"content-type {content_type!r} is not gRPC's")


def _timeout(value: bytes) -> float | None:
    """grpc-timeout: up to 8 digits and a unit (H M S m u n), in seconds; None when malformed."""
    digits = value[:-1]
    if not 1 <= len(digits) <= 8 or not digits.isdigit() or value[-1] not in TIMEOUT_UNITS:
        return None
    return int(digits) * TIMEOUT_UNITS[value[-1]]


class Call:
    """One gRPC call, one HTTP/2 stream: its request as it arrives, its handler's task, its answer's bytes
    waiting for send windows. It is also the context the servicer's methods get: of grpc.aio's
    ServicerContext, the part kiln's servicer and the generated base class use (abort, set_trailing_metadata;
    set_code, set_details)."""

    __slots__ = ("id", "handler", "head", "chunks", "held", "messages", "requests", "receive_window", "received",
                 "remote_closed", "send_window", "outbox", "sent", "headers_sent", "finished", "task", "timer",
                 "code", "details", "trailing")

    def __init__(self, stream_id: int, handler, head: RequestHead, receive_window: int, send_window: int):
        self.id = stream_id
        self.handler = handler
        self.head = head
        self.chunks: list[bytes | memoryview] = []  # request bytes not yet cut into messages
        self.held = 0
        self.messages: list[bytes] = []  # a unary call's message, until END_STREAM
        self.requests: asyncio.Queue | None = asyncio.Queue() if handler and handler.request_streaming else None
        self.receive_window = receive_window
        self.received = 0  # bytes received since this stream's last WINDOW_UPDATE
        self.remote_closed = False
        self.send_window = send_window
        self.outbox = b""  # DATA not yet sent for want of window: outbox[sent:]
        self.sent = 0
        self.headers_sent = False
        self.finished = False  # its trailers are written (or waiting in outbox's wake), or it was reset
        self.task: asyncio.Task | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.code = grpc.StatusCode.OK
        self.details = ""
        self.trailing: tuple = ()

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: tuple = ()) -> None:
        self.code, self.details = code, details
        if trailing_metadata:
            self.trailing = tuple(trailing_metadata)
        raise grpc.aio.AbortError()

    def set_trailing_metadata(self, trailing_metadata) -> None:
        self.trailing = tuple(trailing_metadata)

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def cut_messages(self, limit: int) -> list[bytes | memoryview]:
        """The complete messages among the bytes received so far (views of the received DATA where a message
        arrived in one frame), decompressed; CallFailed for one over `limit`
        bytes (told from its prefix before its body arrives, or while it is inflated), or compressed without a
        grpc-encoding."""
        out = []
        while self.held >= 5:
            if len(self.chunks[0]) < 5:
                self.chunks = [b"".join(self.chunks)]
            compressed, size = MESSAGE_PREFIX.unpack_from(self.chunks[0])
            if compressed and self.head.encoding is None:
                raise CallFailed(grpc.StatusCode.INTERNAL, "a message flagged compressed on a call without "
                                 "grpc-encoding")
            if size > limit:
                raise CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"received message larger than max ({size} vs. {limit})")
            if self.held < 5 + size:
                break
            whole = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
            message = whole[5:5 + size]
            if compressed:
                try:
                    message = decompress(message, self.head.encoding, limit)
                except CompressionFailed as failure:
                    raise CallFailed(failure.code, str(failure)) from None
            out.append(message)
            rest = whole[5 + size:]
            self.chunks = [rest] if rest else []
            self.held = len(rest)
        return out


class Requests:
    """A streaming call's requests as the servicer iterates them: messages deserialized as they arrive."""

    def __init__(self, call: Call):
        self.call = call

    def __aiter__(self):
        return self

    async def __anext__(self):
        message = await self.call.requests.get()
        if message is None:
            raise StopAsyncIteration
        return message


def unparsable(call: Call, e: Exception) -> CallFailed:
    return CallFailed(grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse the request of {call.head.path}: "
                                                        f"{type(e).__name__}: {e}")


