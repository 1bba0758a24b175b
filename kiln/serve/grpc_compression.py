"""gRPC message compression on kiln's transport (gRPC's compression.md): `grpc-encoding` names how a side's
messages are compressed (each message's prefix flag says whether it is), `grpc-accept-encoding` what a side can
read. gzip is RFC 1952, deflate is gRPC's name for the zlib format (RFC 1950), as gRPC core writes both.

Requests are decompressed whatever the server's level, never past the largest message allowed: a few KB of
gzip can hold gigabytes of zeros (a decompression bomb), so the inflater is asked for at most limit + 1 bytes and
the call fails RESOURCE_EXHAUSTED past the limit, as gRPC core answers, before more is allocated.

Responses are compressed at tritonserver's --grpc-infer-response-compression-level as gRPC core picks an
algorithm for a level: none: no compression; otherwise, of gzip and deflate (in that order) those the client
accepts, low the first, med the middle one, high the last (so low gzip, med and high deflate for a client
that accepts both); zlib's default level either way.
"""

from __future__ import annotations

import zlib

import grpc

# zlib's wbits: 16 + 15 the gzip container, 15 the zlib one
WBITS = {"gzip": 31, "deflate": 15}
ORDER = ("gzip", "deflate")  # gRPC core's ranking, least compression first
ACCEPT_ENCODING = b"identity,deflate,gzip"


class CompressionFailed(Exception):
    """A compressed message cannot be read: the call ends with `code`."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code


def accepted(value: bytes) -> tuple[str, ...]:
    """grpc-accept-encoding's algorithms this server can write, in gRPC core's order."""
    names = {name.strip().lower() for name in value.decode("latin-1").split(",")}
    return tuple(name for name in ORDER if name in names)


def response_encoding(level: str, accepts: tuple[str, ...]) -> str | None:
    """The algorithm answers are compressed with (None: uncompressed), as gRPC core picks it for a level."""
    if level == "none" or not accepts:
        return None
    if level == "low":
        return accepts[0]
    if level == "med":
        return accepts[len(accepts) // 2]
    return accepts[-1]


def compress(message: bytes, encoding: str) -> bytes:
    packer = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, WBITS[encoding])
    return packer.compress(message) + packer.flush()


def decompress(message: bytes, encoding: str, limit: int) -> bytes:
    """The message inflated; CompressionFailed RESOURCE_EXHAUSTED when it would pass `limit` bytes (found with
    at most limit + 1 bytes inflated), INTERNAL when it is not whole, valid `encoding` data."""
    inflater = zlib.decompressobj(WBITS[encoding])
    try:
        out = inflater.decompress(message, limit + 1)
    except zlib.error as e:
        raise CompressionFailed(grpc.StatusCode.INTERNAL, f"cannot decompress the {encoding} message: {e}") from None
    if len(out) > limit:
        raise CompressionFailed(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"decompressed message larger than max (more than {limit} bytes from "
                                f"{len(message)} of {encoding})")
    if not inflater.eof or inflater.unused_data:
        raise CompressionFailed(grpc.StatusCode.INTERNAL, f"the {encoding} message is truncated or has bytes after "
                                                          "its end")
    return out
