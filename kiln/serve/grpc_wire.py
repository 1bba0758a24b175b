"""A ModelInferRequest off the wire with its tensor bytes left where they arrived.

protobuf hands every `raw_input_contents` element out as a new bytes object, a copy of the tensor
(600 KB for a 224x224 FP32 image), made on the event loop while it holds the GIL. gRPC's ModelInfer
here takes the serialized message instead (request_deserializer below) and walks its top-level
fields: each raw_input_contents element (field 7, length-delimited) becomes a memoryview into the
received bytes, the request's numpy arrays are views of those, and protobuf parses only the rest
(names, shapes, parameters: a few hundred bytes). The walk skips over a tensor's bytes by its
length, never touching them. Anything it cannot walk (a truncated message, an unknown wire type)
is parsed by protobuf as a whole, which then names the problem.

Wire format (protobuf encoding): a field is a varint key (field number << 3 | wire type) and a
value: wire type 0 a varint, 1 eight bytes, 2 a varint length and that many bytes, 5 four bytes.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

RAW_INPUT_CONTENTS = 7  # ModelInferRequest.raw_input_contents' field number (Triton's grpc_service.proto)


class WireRequest:
    """A ModelInferRequest as the ModelInfer handler gets it: the message without its raw tensor bytes,
    those bytes as views into the received message, or the reason it could not be parsed."""

    __slots__ = ("message", "raw", "error")

    def __init__(self, message: pb.ModelInferRequest | None, raw: list, error: str = ""):
        self.message = message
        self.raw = raw
        self.error = error


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]  # IndexError past the end: the caller's "cannot walk"
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def split_raw_contents(data: bytes) -> tuple[bytes, list[memoryview]] | None:
    """(the message's other fields, serialized; its raw_input_contents as views), or None when the
    message cannot be walked. The other fields keep their order; field 7 is left out of them."""
    view = memoryview(data)
    end = len(data)
    raw: list[memoryview] = []
    rest: list[memoryview] = []
    kept_from = 0  # start of the run of other fields not yet added to rest
    pos = 0
    try:
        while pos < end:
            start = pos
            key, pos = _varint(data, pos)
            wire = key & 7
            if wire == 2:
                length, pos = _varint(data, pos)
                stop = pos + length
                if stop > end:
                    return None
                if key >> 3 == RAW_INPUT_CONTENTS:
                    if kept_from < start:
                        rest.append(view[kept_from:start])
                    raw.append(view[pos:stop])
                    kept_from = stop
                pos = stop
            elif wire == 0:
                _, pos = _varint(data, pos)
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            else:
                return None  # groups (3, 4) and invalid types: protobuf's to refuse
        if pos != end:
            return None
    except (IndexError, ValueError):
        return None
    if not raw:
        return data, raw
    if kept_from < end:
        rest.append(view[kept_from:end])
    others = bytes(rest[0]) if len(rest) == 1 else b"".join(rest)  # the fields before the tensors: small
    return others, raw


def parse_infer_request(data: bytes) -> WireRequest:
    """ModelInfer's request_deserializer: never raises (a malformed message is answered INVALID_ARGUMENT
    by the handler, naming protobuf's complaint)."""
    split = split_raw_contents(data)
    try:
        if split is None:
            message = pb.ModelInferRequest.FromString(data)
            return WireRequest(message, list(message.raw_input_contents))
        others, raw = split
        message = pb.ModelInferRequest.FromString(others)
    except DecodeError as e:
        return WireRequest(None, [], f"the request is not a valid inference.ModelInferRequest: {e}")
    return WireRequest(message, raw)
