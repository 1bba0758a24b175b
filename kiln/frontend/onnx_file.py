"""An ONNX file read without copying its large weights through protobuf: they become external data of the file
itself, and each is read once, straight into an array of its own.

Parsing a model with protobuf copies every initializer's `raw_data` into the message, and the file's bytes are
read first: ~2x the weights before onnx_ir wraps them, then the build copies each into an array it owns (the
message's arena is freed as a whole only): ResNet-50's import peaked at 2.4x its 97 MiB of weights over the
process (bench/results/mem6-2026-12-05.md). Here the file is walked at the protobuf wire level (model -> graph ->
initializer -> raw_data: tags and lengths only, the weights' pages untouched), the message is parsed from a
skeleton whose large initializers point at their own bytes in the file (ONNX's external-data fields, location =
the file itself), and after the import each external tensor, these and a model's real external data alike, is
read into a numpy array of its own by `readinto` (no mapping of the file stays resident, no second copy).

Anything the walk does not expect (a truncated file, groups, a tensor in segments) gives up the walk, and the
file is parsed whole as before, so a broken file fails with the same error.
"""

from __future__ import annotations

import mmap
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

_MODEL_GRAPH = 7  # ModelProto.graph
_GRAPH_INITIALIZER = 5  # GraphProto.initializer
_TENSOR_SEGMENT = 3  # TensorProto.segment
_TENSOR_RAW_DATA = 9  # TensorProto.raw_data
_TENSOR_EXTERNAL_DATA = 13  # TensorProto.external_data (StringStringEntryProto: key = 1, value = 2)
_TENSOR_DATA_LOCATION = 14  # TensorProto.data_location

_LENGTH_DELIMITED, _VARINT, _FIXED64, _FIXED32 = 2, 0, 1, 5


class _NotWalkable(Exception):
    """The bytes are not a protobuf message this walk understands: parse the file whole instead."""


@dataclass
class Skeleton:
    """The model's bytes with its large initializers' raw_data left in the file, and how many were."""

    data: bytes
    in_file: int  # initializers whose bytes stay in the file
    in_file_bytes: int


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= end or shift > 63:
            raise _NotWalkable("varint past the end")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _fields(buf, start: int, end: int):
    """(field number, wire type, field start, value start, value end) of each field of the message in [start, end)."""
    pos = start
    while pos < end:
        field_start = pos
        tag, pos = _varint(buf, pos, end)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise _NotWalkable("field number 0")
        if wire == _VARINT:
            _, value_end = _varint(buf, pos, end)
            value_start = pos
        elif wire == _LENGTH_DELIMITED:
            length, value_start = _varint(buf, pos, end)
            value_end = value_start + length
        elif wire == _FIXED64:
            value_start, value_end = pos, pos + 8
        elif wire == _FIXED32:
            value_start, value_end = pos, pos + 4
        else:  # groups (3, 4): not in ONNX's schema
            raise _NotWalkable(f"wire type {wire}")
        if value_end > end:
            raise _NotWalkable("field past the end of its message")
        yield number, wire, field_start, value_start, value_end
        pos = value_end


def _delimited(number: int, payload: bytes) -> bytes:
    return _encode_varint(number << 3 | _LENGTH_DELIMITED) + _encode_varint(len(payload)) + payload


def _entry(key: str, value: str) -> bytes:
    return _delimited(_TENSOR_EXTERNAL_DATA, _delimited(1, key.encode()) + _delimited(2, value.encode()))


def _tensor(buf, start: int, end: int, location: str, threshold: int) -> tuple[bytes, int]:
    """The initializer's bytes, its raw_data replaced by a pointer into the file when that is `threshold` or more
    (and the bytes it left in the file, else 0)."""
    fields = list(_fields(buf, start, end))
    numbers = {f[0] for f in fields}
    raw = [f for f in fields if f[0] == _TENSOR_RAW_DATA and f[1] == _LENGTH_DELIMITED]
    if len(raw) != 1 or raw[0][4] - raw[0][3] < threshold or numbers & {_TENSOR_SEGMENT, _TENSOR_EXTERNAL_DATA,
                                                                         _TENSOR_DATA_LOCATION}:
        return bytes(buf[start:end]), 0
    _, _, _, offset, stop = raw[0]
    out = bytearray()
    for number, _wire, field_start, _value_start, value_end in fields:
        if number != _TENSOR_RAW_DATA:
            out += buf[field_start:value_end]
    out += _entry("location", location) + _entry("offset", str(offset)) + _entry("length", str(stop - offset))
    out += _encode_varint(_TENSOR_DATA_LOCATION << 3 | _VARINT) + _encode_varint(onnx.TensorProto.EXTERNAL)
    return bytes(out), stop - offset


def skeleton(path: Path, threshold: int) -> Skeleton | None:
    """The model at `path` with each main-graph initializer of `threshold` bytes or more left in the file as its
    external data; None where the walk gives up (the caller parses the file whole) or nothing would be left."""
    if sys.byteorder != "little":  # raw_data is little-endian: read in place only where the machine is too
        return None
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return None
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        model, in_file, in_file_bytes = bytearray(), 0, 0
        for number, wire, field_start, value_start, value_end in _fields(buf, 0, size):
            if number != _MODEL_GRAPH or wire != _LENGTH_DELIMITED:
                model += buf[field_start:value_end]
                continue
            graph = bytearray()
            for g_number, g_wire, g_start, g_value_start, g_value_end in _fields(buf, value_start, value_end):
                if g_number == _GRAPH_INITIALIZER and g_wire == _LENGTH_DELIMITED:
                    tensor, left = _tensor(buf, g_value_start, g_value_end, path.name, threshold)
                    graph += _delimited(_GRAPH_INITIALIZER, tensor)
                    in_file += left > 0
                    in_file_bytes += left
                else:
                    graph += buf[g_start:g_value_end]
            model += _delimited(_MODEL_GRAPH, bytes(graph))
    except _NotWalkable:
        return None
    finally:
        buf.close()
    return Skeleton(bytes(model), in_file, in_file_bytes) if in_file else None


def _tensors(model: ir.Model):
    """(owner, key, tensor) of every tensor the model holds: initializers and tensor attributes, every graph."""
    for graph in [model.graph, *model.graph.subgraphs()]:
        for value in graph.initializers.values():
            if value.const_value is not None:
                yield value, None, value.const_value
        for node in graph:
            for name, attr in node.attributes.items():
                if attr.type == ir.AttributeType.TENSOR:
                    yield node, name, attr.value


def read_external(model: ir.Model, base: Path, own_file: str | None) -> None:
    """Every external tensor of `model` (its data in a file under `base`) as an array of its own, read straight
    from the file; `own_file`: the model file's name, whose in-place weights `skeleton` made external."""
    root = os.path.realpath(base)
    for owner, key, tensor in list(_tensors(model)):
        if not isinstance(tensor, ir.ExternalTensor):
            continue
        tensor.base_dir = base
        path = os.path.realpath(tensor.path)
        if str(tensor.location) != own_file and os.path.commonpath([root, path]) != root:
            raise ValueError(f"tensor {tensor.name!r}: external data {str(tensor.location)!r} lies outside the "
                             f"model's folder {str(base)!r}")
        owned = ir.Tensor(_read(tensor), dtype=tensor.dtype, name=tensor.name)
        if key is None:
            owner.const_value = owned
        else:
            owner.attributes[key] = ir.AttrTensor(key, owned)


def _read(tensor: ir.ExternalTensor) -> np.ndarray:
    """The tensor's values in an array of its own: read into it where the bytes are the array's (no mapping)."""
    dtype = tensor.dtype
    if dtype.bitwidth % 8 or dtype == ir.DataType.STRING:  # packed 4-/2-bit types: onnx_ir unpacks them
        array = tensor.numpy().copy()
        tensor.release()
        return array
    array = np.empty(tensor.shape.numpy(), dtype=dtype.numpy())
    length = tensor.length if tensor.length is not None else array.nbytes
    if length != array.nbytes:
        raise ValueError(f"tensor {tensor.name!r}: {length} bytes of external data for {array.nbytes} "
                         f"({dtype.name} {list(array.shape)})")
    with open(tensor.path, "rb") as f:
        f.seek(tensor.offset or 0)
        got = f.readinto(array.reshape(-1).view(np.uint8)) if array.nbytes else 0
    if got != array.nbytes:
        raise ValueError(f"tensor {tensor.name!r}: the file {str(tensor.path)!r} ends {array.nbytes - got} bytes "
                         "short of its data")
    return array
