"""Tensor element types on the wire, and tensors to and from the wire's two encodings.

The KServe v2 protocol names types "FP32", "INT64", "BYTES"...; Triton's model config spells
them "TYPE_FP32"...; kiln's bindings use ONNX names ("float"). One table maps the three and
numpy. A tensor travels either as raw little-endian bytes (HTTP binary extension, gRPC
raw_input_contents; BYTES elements each prefixed by a 4-byte length) or as a JSON list.
Every decoder checks the size the client declared against the data it sent and raises
InvalidRequest naming the tensor: a malformed request is the client's error, never the server's.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from kiln.serve.errors import InvalidRequest


@dataclass(frozen=True)
class Datatype:
    v2: str  # the protocol's name: "FP32"
    onnx: str  # kiln's binding dtype: "float"
    numpy: np.dtype  # object for BYTES

    @property
    def config(self) -> str:
        """Triton's model-config spelling: TYPE_FP32 (TYPE_STRING for BYTES)."""
        return "TYPE_STRING" if self.v2 == "BYTES" else f"TYPE_{self.v2}"


_TABLE = [
    Datatype("BOOL", "bool", np.dtype(np.bool_)),
    Datatype("UINT8", "uint8", np.dtype(np.uint8)),
    Datatype("UINT16", "uint16", np.dtype(np.uint16)),
    Datatype("UINT32", "uint32", np.dtype(np.uint32)),
    Datatype("UINT64", "uint64", np.dtype(np.uint64)),
    Datatype("INT8", "int8", np.dtype(np.int8)),
    Datatype("INT16", "int16", np.dtype(np.int16)),
    Datatype("INT32", "int32", np.dtype(np.int32)),
    Datatype("INT64", "int64", np.dtype(np.int64)),
    Datatype("FP16", "float16", np.dtype(np.float16)),
    Datatype("FP32", "float", np.dtype(np.float32)),
    Datatype("FP64", "double", np.dtype(np.float64)),
    Datatype("BF16", "bfloat16", np.dtype(ml_dtypes.bfloat16)),
    Datatype("BYTES", "string", np.dtype(object)),
]

BY_V2: dict[str, Datatype] = {d.v2: d for d in _TABLE}
BY_ONNX: dict[str, Datatype] = {d.onnx: d for d in _TABLE}
BY_CONFIG: dict[str, Datatype] = {d.config: d for d in _TABLE}
BY_NUMPY: dict[np.dtype, Datatype] = {d.numpy: d for d in _TABLE if d.v2 != "BYTES"}


def from_v2(name: str, tensor: str) -> Datatype:
    try:
        return BY_V2[name]
    except (KeyError, TypeError):
        raise InvalidRequest(f"tensor {tensor!r}: unknown datatype {name!r}; "
                             f"the protocol's datatypes are {sorted(BY_V2)}") from None


def of_array(array: np.ndarray) -> Datatype:
    if array.dtype == object:
        return BY_V2["BYTES"]
    return BY_NUMPY[array.dtype]


def element_count(shape: list[int], tensor: str) -> int:
    count = 1
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise InvalidRequest(f"tensor {tensor!r}: shape {shape} must be a list of non-negative integers")
        count *= d
    return count


# ---- raw bytes ------------------------------------------------------------------------------------

def to_bytes(array: np.ndarray) -> bytes:
    """The tensor's raw encoding: little-endian elements in row-major order; BYTES length-prefixed."""
    if array.dtype == object:
        parts = []
        for item in array.reshape(-1):
            data = item if isinstance(item, bytes) else str(item).encode()
            parts.append(struct.pack("<I", len(data)))
            parts.append(data)
        return b"".join(parts)
    return array.tobytes()  # row-major whatever the array's strides (one numpy call, no contiguous copy first)


# tensors smaller than this are copied out by to_bytes even where a view would do: the copy costs less than the view
VIEW_BYTES = 4096


def raw_view(array: np.ndarray) -> bytes | memoryview:
    """to_bytes(array) without the copy where the array is C-contiguous, of a fixed-size type and not small: its
    own memory as a flat byte view, which keeps the array alive (nobody may write into the array afterwards: an
    answer's outputs are the engine call's own arrays, or views of a received frame). BERT-base's 393 KB answer
    was copied four or five times between the engine call and the socket (bench/results/serve-cpu-2026-12-06.md)."""
    if array.nbytes < VIEW_BYTES or array.dtype == object or not array.flags.c_contiguous:
        return to_bytes(array)
    return memoryview(array.reshape(-1).view(np.uint8))


def from_bytes(data: bytes | memoryview, datatype: Datatype, shape: list[int], tensor: str) -> np.ndarray:
    count = element_count(shape, tensor)
    if datatype.v2 == "BYTES":
        return _bytes_elements(data, count, shape, tensor)
    expected = count * datatype.numpy.itemsize
    if len(data) != expected:
        raise InvalidRequest(
            f"input {tensor!r}: {len(data)} bytes of data given, but shape {shape} of {datatype.v2} needs "
            f"{expected} ({count} elements x {datatype.numpy.itemsize} bytes)")
    # read-only over the request's buffer: the batcher copies it where an engine call needs its own
    # (merged batches are new arrays anyway), on the instance's thread rather than the event loop
    return np.frombuffer(data, dtype=datatype.numpy).reshape(shape)


def _bytes_elements(data: bytes | memoryview, count: int, shape: list[int], tensor: str) -> np.ndarray:
    view = memoryview(data)
    items, offset = [], 0
    while offset < len(view):
        if offset + 4 > len(view):
            raise InvalidRequest(f"input {tensor!r}: BYTES data ends inside an element's 4-byte length")
        (length,) = struct.unpack_from("<I", view, offset)
        offset += 4
        if offset + length > len(view):
            raise InvalidRequest(f"input {tensor!r}: a BYTES element of {length} bytes runs past the data")
        items.append(bytes(view[offset:offset + length]))
        offset += length
    if len(items) != count:
        raise InvalidRequest(f"input {tensor!r}: {len(items)} BYTES elements given, shape {shape} needs {count}")
    array = np.empty(count, dtype=object)
    array[:] = items
    return array.reshape(shape)


# ---- JSON -----------------------------------------------------------------------------------------

_JSON_KINDS = {"b": "b", "u": "bui", "i": "bui", "f": "buif"}  # target kind -> element kinds accepted


def from_json(data: object, datatype: Datatype, shape: list[int], tensor: str) -> np.ndarray:
    """A JSON tensor (flat or nested row-major list) -> array; no silent truncation or wrap-around."""
    count = element_count(shape, tensor)
    if not isinstance(data, list):
        raise InvalidRequest(f"input {tensor!r}: 'data' must be a list of {datatype.v2} values")
    if datatype.v2 == "BYTES":
        flat = _flatten(data, tensor)
        if not all(isinstance(x, str) for x in flat):
            raise InvalidRequest(f"input {tensor!r}: BYTES data in JSON must be strings")
        array = np.empty(len(flat), dtype=object)
        array[:] = [x.encode() for x in flat]
    else:
        try:
            given = np.asarray(data)
        except (ValueError, TypeError):
            raise InvalidRequest(f"input {tensor!r}: 'data' is not a regular list of numbers") from None
        kinds = _JSON_KINDS[datatype.numpy.kind if datatype.v2 != "BF16" else "f"]
        if given.size and given.dtype.kind not in kinds:
            raise InvalidRequest(f"input {tensor!r}: JSON values of kind {given.dtype.name} cannot be {datatype.v2}")
        if datatype.numpy.kind in "iu" and given.size:
            info = np.iinfo(datatype.numpy)
            if given.min() < info.min or given.max() > info.max:
                raise InvalidRequest(f"input {tensor!r}: values outside {datatype.v2}'s range {info.min}..{info.max}")
        array = given.astype(datatype.numpy).reshape(-1)
    if array.size != count:
        raise InvalidRequest(f"input {tensor!r}: {array.size} values given, shape {shape} needs {count}")
    return array.reshape(shape)


def _flatten(data: list, tensor: str) -> list:
    flat: list = []
    stack = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            flat.append(item)
        else:
            stack.pop()
    return flat


def to_json(array: np.ndarray) -> list:
    """Flat row-major list; BYTES as UTF-8 strings (Triton's JSON form); BF16 as floats."""
    if array.dtype == object:
        return [x.decode(errors="replace") if isinstance(x, bytes) else str(x) for x in array.reshape(-1)]
    if array.dtype == ml_dtypes.bfloat16:
        array = array.astype(np.float32)
    return array.reshape(-1).tolist()
