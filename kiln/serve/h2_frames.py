"""HTTP/2 (RFC 9113) as kiln's gRPC transport (kiln/serve/grpc_h2.py) writes it: frame types, flags, error
codes and settings; frames; header blocks of literals (HPACK, RFC 7541) that never touch the client's dynamic
table; gRPC's response headers and percent-encoded grpc-message; header blocks decoded once while the peer's
dynamic table stands (HeaderBlocks: the server's requests, kiln perf's answers); frames read across socket reads
(FrameReader: both sides).

A connection starts with the client's 24-byte preface; every frame is a 9-byte header (24-bit length, type,
flags, 31-bit stream id) and its payload.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
# error codes (RFC 9113 section 7)
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x8, 0x9
ENHANCE_YOUR_CALM = 0xB
# SETTINGS parameters
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE = 0x1, 0x2, 0x3, 0x4, 0x5
MAX_WINDOW = (1 << 31) - 1
DEFAULT_WINDOW = 65535
DEFAULT_FRAME_SIZE = 16384
LARGEST_FRAME = (1 << 24) - 1  # the 24-bit length field's limit

FRAME = struct.Struct(">HBBBI")  # the frame header: the 24-bit length as 16 + 8 bits, type, flags, stream id
SETTING = struct.Struct(">HI")
WORD = struct.Struct(">I")
GOAWAY_PAYLOAD = struct.Struct(">II")


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return FRAME.pack(n >> 8, n & 0xFF, kind, flags, stream) + payload


def _integer(value: int) -> bytes:
    """HPACK's integer with a 7-bit prefix (RFC 7541 section 5.1), the H bit clear: a plain string's length."""
    if value < 0x7F:
        return bytes((value,))
    out = [0x7F]
    value -= 0x7F
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """A header field as a literal without indexing, new name, plain strings: nothing enters the client's
    dynamic table, so every block this server writes decodes alike whatever was written before."""
    return b"\x00" + _integer(len(name)) + name + _integer(len(value)) + value


def percent_encode(message: str) -> bytes:
    """grpc-message's encoding (gRPC's PROTOCOL-HTTP2.md): UTF-8, then every byte outside 0x20-0x7E, and %, as %XX."""
    return b"".join(bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in message.encode())


RESPONSE_HEADERS = b"\x88" + literal(b"content-type", b"application/grpc")  # 0x88: static entry 8, :status 200
OK_TRAILERS = literal(b"grpc-status", b"0")


class ConnectionFault(Exception):
    """The peer broke HTTP/2: the connection ends with GOAWAY(code)."""

    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code = code


T = TypeVar("T")
HEADER_CACHE_SIZE = 64


class HeaderBlocks(Generic[T]):
    """A connection's received header blocks, HPACK-decoded and made into `make(headers)`. A block decoded before is
    looked up, not decoded again, while the dynamic table is the one it was decoded against: only blocks that left
    the table as they found it (nothing added, evicted or resized) are kept, and any block that changes the table
    empties the cache, so a block found in it would decode to the same headers and change nothing."""

    def __init__(self, make: Callable[[list[tuple[bytes, bytes]]], T]):
        self.decoder = hpack.Decoder()
        self.make = make
        self.made: dict[bytes, T] = {}

    def __call__(self, block: bytes) -> T:
        made = self.made.get(block)
        if made is not None:
            return made
        table = self.decoder.header_table
        entries = table.dynamic_entries
        size, first, maxsize = len(entries), entries[0] if entries else None, table.maxsize
        try:
            headers = self.decoder.decode(block, raw=True)
        except hpack.HPACKError as e:
            raise ConnectionFault(COMPRESSION_ERROR, f"header block: {e}") from None
        made = self.make(headers)
        # an entry added is a new tuple at the front; evictions and resizes change the length or the size
        if len(entries) == size and table.maxsize == maxsize and (entries[0] if entries else None) is first:
            if len(self.made) >= HEADER_CACHE_SIZE:
                self.made.clear()
            self.made[block] = made
        else:
            self.made.clear()
        return made


class FrameReader:
    """The frames of a connection's received bytes, read in pieces. The bytes after the last whole frame of a read
    are held; a frame over many reads is held in its pieces and joined once, when it is whole, not at every read.
    DATA payloads are views of the bytes read (a request's tensors are not copied again to be cut out); the others
    are bytes."""

    def __init__(self, max_length: int = LARGEST_FRAME):
        self.max_length = max_length
        self.held: list[bytes] = []  # received bytes not yet a whole frame
        self.held_size = 0
        self.needed = 0  # bytes the first held frame needs: 9 while its header is short

    def whole(self, data: bytes) -> bytes | None:
        """`data`, after the bytes held if any; None while they are still short of what the held frame needs."""
        if not self.held:
            return data
        self.held.append(data)
        self.held_size += len(data)
        if self.held_size < self.needed:
            return None
        data = b"".join(self.held)
        self.held, self.held_size = [], 0
        return data

    def hold(self, rest: bytes, needed: int) -> None:
        """`rest` kept until `needed` bytes are there (a connection's preface, say)."""
        self.held, self.held_size, self.needed = [rest], len(rest), needed

    def frames(self, data: bytes, pos: int = 0) -> Iterator[tuple[int, int, int, bytes | memoryview]]:
        """Each whole frame of `data` from `pos` on as (type, flags, stream, payload); the rest is held."""
        end = len(data)
        view = memoryview(data)
        while end - pos >= 9:
            high, low, kind, flags, stream = FRAME.unpack_from(data, pos)
            length = high << 8 | low
            if length > self.max_length:
                raise ConnectionFault(FRAME_SIZE_ERROR, f"a frame of {length} bytes (at most {self.max_length})")
            if end - pos < 9 + length:
                self.hold(data[pos:], 9 + length)
                return
            start, pos = pos + 9, pos + 9 + length
            yield kind, flags, stream & 0x7FFFFFFF, view[start:pos] if kind == DATA else data[start:pos]
        if pos < end:
            self.hold(data[pos:], 9)


def unpad(flags: int, payload: bytes) -> bytes:
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise ConnectionFault(PROTOCOL_ERROR, "padding as long as the frame")
    return payload[1:len(payload) - payload[0]]


