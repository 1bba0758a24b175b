"""HTTP/2 (RFC 9113) as kiln's gRPC transport (kiln/serve/grpc_h2.py) writes it: frame types, flags, error
codes and settings; frames; header blocks of literals (HPACK, RFC 7541) that never touch the client's dynamic
table; gRPC's response headers and percent-encoded grpc-message; header blocks decoded once while the peer's
dynamic table stands (HeaderBlocks: the server's requests, kiln perf's answers).

A connection starts with the client's 24-byte preface; every frame is a 9-byte header (24-bit length, type,
flags, 31-bit stream id) and its payload.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
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


def unpad(flags: int, payload: bytes) -> bytes:
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise ConnectionFault(PROTOCOL_ERROR, "padding as long as the frame")
    return payload[1:len(payload) - payload[0]]


