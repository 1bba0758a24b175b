"""The server's errors: each carries its HTTP status and gRPC code, so both frontends answer alike.

A malformed request is always a 4xx (INVALID_ARGUMENT / NOT_FOUND); only a fault of the server
itself is a 5xx. Back-pressure says when to come back (Retry-After).
"""

from __future__ import annotations

from kiln.errors import KilnError


class ServeError(KilnError):
    http_status = 500
    grpc_code = "INTERNAL"  # the name of a grpc.StatusCode member (grpc is imported by its frontend only)
    retry_after: int | None = None  # seconds, sent as Retry-After


class InvalidRequest(ServeError):
    """The request is malformed or does not fit the model (names, datatypes, shapes, sizes)."""

    http_status = 400
    grpc_code = "INVALID_ARGUMENT"


class PayloadTooLarge(InvalidRequest):
    http_status = 413


class NotSupported(ServeError):
    """A protocol extension kiln serve does not implement (CUDA shared memory): a 4xx, the client's to avoid."""

    http_status = 400
    grpc_code = "UNIMPLEMENTED"


class NotFound(ServeError):
    """Unknown model or version."""

    http_status = 404
    grpc_code = "NOT_FOUND"


class QueueFull(ServeError):
    """The model's queue is at its bound: come back later (429, RESOURCE_EXHAUSTED)."""

    http_status = 429
    grpc_code = "RESOURCE_EXHAUSTED"
    retry_after = 1


class Unavailable(ServeError):
    """The model is loading, unloading or the server is shutting down."""

    http_status = 503
    grpc_code = "UNAVAILABLE"
    retry_after = 1


class RequestTimeout(ServeError):
    """The request's timeout passed before it could run (Triton answers UNAVAILABLE over HTTP too)."""

    http_status = 503
    grpc_code = "DEADLINE_EXCEEDED"
    retry_after = 1


class ModelLoadError(ServeError):
    """A model of the repository cannot be loaded: its config, files or engine are wrong."""

    http_status = 400
    grpc_code = "INVALID_ARGUMENT"
