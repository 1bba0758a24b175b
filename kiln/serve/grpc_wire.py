"""A ModelInferRequest off the wire with its tensor bytes left where they arrived, and a ModelInferResponse
put on it from parts serialized once.

protobuf hands every `raw_input_contents` element out as a new bytes object, a copy of the tensor
(600 KB for a 224x224 FP32 image), made on the event loop while it holds the GIL. gRPC's ModelInfer
here takes the serialized message instead (request_deserializer below) and walks its top-level
fields: each raw_input_contents element (field 7, length-delimited) becomes a memoryview into the
received bytes, the request's numpy arrays are views of those, and protobuf parses only the rest
(names, shapes, parameters: a few hundred bytes). The walk skips over a tensor's bytes by its
length, never touching them. Anything it cannot walk (a truncated message, an unknown wire type)
is parsed by protobuf as a whole, which then names the problem.

The common answer (every output raw, no parameters) is written as bytes (ResponseEncoder): the model's
name and version and each output's name, datatype and shape serialized by protobuf once and kept, then
joined with the request's id and the tensors' bytes, in field order, as protobuf itself writes them.

Wire format (protobuf encoding): a field is a varint key (field number << 3 | wire type) and a
value: wire type 0 a varint, 1 eight bytes, 2 a varint length and that many bytes, 5 four bytes.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from kiln.serve import datatypes

RAW_INPUT_CONTENTS = 7  # ModelInferRequest.raw_input_contents' field number (Triton's grpc_service.proto)
# ModelInferResponse's keys (field number << 3 | 2: length-delimited): id 3, outputs 5, raw_output_contents 6
ID_KEY = bytes([3 << 3 | 2])
OUTPUTS_KEY = bytes([5 << 3 | 2])
RAW_OUTPUT_CONTENTS_KEY = bytes([6 << 3 | 2])


class WireRequest:
    """A ModelInferRequest as the ModelInfer handler gets it: the message without its raw tensor bytes,
    those bytes as views into the received message, or the reason it could not be parsed. Or, for a small request
    laid out as one seen before (QuickLayouts), no message at all: `layout` says what it holds and where in `data`
    its tensors' bytes are."""

    __slots__ = ("message", "raw", "error", "layout", "data")

    def __init__(self, message: pb.ModelInferRequest | None, raw: list, error: str = "",
                 layout: QuickLayout | None = None, data: bytes = b""):
        self.message = message
        self.raw = raw
        self.error = error
        self.layout = layout
        self.data = data


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


# Messages smaller than this are parsed by protobuf whole: its copies of their tensors cost less than the walk
# in Python (~2.5 us against ~5.5 for an empty model's 16 bytes; equal near 20 KB on the 2-core VM)
WALK_FROM_BYTES = 16 << 10


class QuickLayout:
    """A small ModelInferRequest's layout: every field but the tensors' bytes (`others`, serialized as received),
    then each tensor's raw_input_contents field, in order, its key and length (`heads`: (bytes, offset)) and its
    bytes. `inputs`: (name, numpy dtype, element count, offset of its bytes, shape) of each tensor, what
    grpc_server._decode_quickly would make of the message; model, version, id: its other fields that ModelInfer
    reads. A message of these bytes with other tensor bytes of the same sizes parses to the same message but for
    those bytes (protobuf's fields are self-delimiting: `others` parses alone, with no tensor in it)."""

    __slots__ = ("others", "heads", "size", "model", "version", "id", "inputs")

    def __init__(self, others: bytes, heads: tuple, size: int, model: str, version: str, id: str, inputs: tuple):
        self.others, self.heads, self.size = others, heads, size
        self.model, self.version, self.id, self.inputs = model, version, id, inputs

    def matches(self, data: bytes) -> bool:
        if not data.startswith(self.others):
            return False
        for head, at in self.heads:
            if not data.startswith(head, at):
                return False
        return True


class QuickLayouts:
    """The layouts of small requests seen lately, by message size. A client that sends one model the same shapes
    (tritonclient at concurrency 1: the same names, datatypes, shapes and id each call) sends one layout over and
    over: a request that matches one (a compare of its leading bytes and of each tensor's key and length) skips
    protobuf's parse, its copies of the tensors and the walk over its inputs' protobuf fields (~12 us of the ~70 of
    kiln's own CPU a c=1 request in process on the 2-core VM; bench/results/serve-c1-2026-12-06.md). Learned from
    messages protobuf parsed (parse_infer_request's small path), only those _decode_quickly's answer covers. A
    client whose every request differs (a fresh id each call) would only fill the table: after MISSES_BEFORE_REST
    layouts learned without a match, the next REST eligible messages are not learned."""

    CAPACITY = 64  # layouts kept (all dropped when full: a server sees few)
    PER_SIZE = 16  # of one message size (the newest first): kiln perf's wire client cycles 8 requests of one size
    MISSES_BEFORE_REST = 128
    REST = 4096

    def __init__(self):
        self.by_size: dict[int, tuple[QuickLayout, ...]] = {}
        self.count = 0
        self.unused = 0  # layouts learned since the last match
        self.resting = 0

    def find(self, data: bytes) -> QuickLayout | None:
        found = self.by_size.get(len(data))
        if found is not None:
            for layout in found:
                if layout.matches(data):
                    self.unused = 0
                    return layout
        return None

    def learn(self, data: bytes, message: pb.ModelInferRequest, raw: list[bytes]) -> None:
        """Remember `data`'s layout (protobuf's `message` of it, `raw` its raw_input_contents) where it has one."""
        if self.resting:
            self.resting -= 1
            return
        tensors = message.inputs
        if not raw or len(raw) != len(tensors) or message.parameters or message.outputs:
            return
        described = []
        for tensor, blob in zip(tensors, raw):  # what _decode_quickly accepts, nothing else
            datatype = datatypes.BY_V2.get(tensor.datatype)
            name = tensor.name
            if datatype is None or datatype.v2 == "BYTES" or not name or tensor.parameters \
                    or any(name == d[0] for d in described):
                return
            shape = tuple(tensor.shape)
            count = 1
            for d in shape:
                count *= d
            if count <= 0 or min(shape, default=0) < 0 or len(blob) != count * datatype.numpy.itemsize:
                return
            described.append((name, datatype.numpy, count, shape))
        keys = [RAW_INPUT_CONTENTS_KEY + _varint_bytes(len(blob)) for blob in raw]
        at = len(data) - sum(len(key) + len(blob) for key, blob in zip(keys, raw))
        if at < 0:
            return
        others = data[:at]
        heads, inputs = [], []
        for key, blob, (name, dtype, count, shape) in zip(keys, raw, described):  # the tensors last, in order
            if not data.startswith(key, at) or data[at + len(key):at + len(key) + len(blob)] != blob:
                return
            heads.append((key, at))
            at += len(key)
            inputs.append((name, dtype, count, at, shape))
            at += len(blob)
        try:
            alone = pb.ModelInferRequest.FromString(others)
        except DecodeError:
            return
        if alone.raw_input_contents:  # a tensor among the other fields: not this layout
            return
        layout = QuickLayout(others, tuple(heads), len(data), message.model_name, message.model_version, message.id,
                             tuple(inputs))
        if self.count >= self.CAPACITY:
            self.by_size, self.count = {}, 0  # replaced, not cleared: another thread may be reading it
        self.by_size[len(data)] = (layout, *self.by_size.get(len(data), ())[:self.PER_SIZE - 1])
        self.count += 1
        self.unused += 1
        if self.unused >= self.MISSES_BEFORE_REST:
            self.unused, self.resting = 0, self.REST


QUICK_LAYOUTS = QuickLayouts()  # one per process: parse_infer_request is a plain function (grpc's deserializer)
RAW_INPUT_CONTENTS_KEY = bytes([RAW_INPUT_CONTENTS << 3 | 2])


def parse_infer_request(data: bytes) -> WireRequest:
    """ModelInfer's request_deserializer: never raises (a malformed message is answered INVALID_ARGUMENT
    by the handler, naming protobuf's complaint)."""
    small = len(data) < WALK_FROM_BYTES
    if small:
        if type(data) is not bytes:
            data = bytes(data)  # a view of the received frame: small
        layout = QUICK_LAYOUTS.find(data)
        if layout is not None:
            return WireRequest(None, [], layout=layout, data=data)
    split = None if small else split_raw_contents(data)
    try:
        if split is None:
            message = pb.ModelInferRequest.FromString(data)
            raw = list(message.raw_input_contents)
            if small:
                QUICK_LAYOUTS.learn(data, message, raw)
            return WireRequest(message, raw)
        others, raw = split
        message = pb.ModelInferRequest.FromString(others)
    except DecodeError as e:
        return WireRequest(None, [], f"the request is not a valid inference.ModelInferRequest: {e}")
    return WireRequest(message, raw)


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _id_field(id: str) -> bytes:
    """ModelInferResponse's field 3 (id: a string), as protobuf writes it: ~0.2 us, where a message built and
    serialized per answer took ~1."""
    data = id.encode()
    return ID_KEY + _varint_bytes(len(data)) + data


def _kept(table: dict, key, value: bytes) -> bytes:
    """table[key] = value, the table emptied first when full (a server sees few models and output shapes)."""
    if len(table) >= 1024:
        table.clear()
    table[key] = value
    return value


# answers whose tensors add up to this many bytes or more are left in their parts (Parts), not joined
PARTS_BYTES = 64 << 10


class Parts(list):
    """A ModelInferResponse's bytes as the pieces they are made of, in order: the fields protobuf serialized and the
    outputs' raw contents, those views of the engine's arrays (datatypes.raw_view). kiln's own transport writes
    the pieces as they are, framed (grpc_h2's _answer_parts: the socket's writev gathers them); serialize_response
    joins them for grpcio's. `size`: their length in all."""

    __slots__ = ("size",)


class ResponseEncoder:
    """ModelInferResponse bytes for answers whose outputs are all raw and carry no parameters; what repeats
    from answer to answer is serialized once. ~2 us an answer where building the message and serializing it
    took ~4.5 (an empty model's, on the 2-core VM)."""

    def __init__(self):
        self._heads: dict[tuple[str, str], bytes] = {}  # fields 1 and 2: the model's name and version
        self._outputs: dict[tuple[str, str, tuple[int, ...]], bytes] = {}  # a field 5: one output's description

    def encode(self, model: str, version: str, id: str,
               outputs: list[tuple[str, str, tuple[int, ...], bytes | memoryview]]) -> bytes | Parts:
        """`outputs`: (name, datatype, shape, raw bytes: flat, one byte an item) of each, in the answer's order.
        The message's bytes, or its Parts where the tensors come to PARTS_BYTES or more."""
        head = self._heads.get((model, version))
        if head is None:
            head = _kept(self._heads, (model, version),
                         pb.ModelInferResponse(model_name=model, model_version=version).SerializeToString())
        parts = [head, _id_field(id)] if id else [head]
        contents = []
        raw = 0
        for name, datatype, shape, data in outputs:
            raw += len(data)
            tensor = self._outputs.get((name, datatype, shape))
            if tensor is None:
                body = pb.ModelInferResponse.InferOutputTensor(name=name, datatype=datatype,
                                                               shape=shape).SerializeToString()
                tensor = _kept(self._outputs, (name, datatype, shape), OUTPUTS_KEY + _varint_bytes(len(body)) + body)
            parts.append(tensor)
            contents += (RAW_OUTPUT_CONTENTS_KEY + _varint_bytes(len(data)), data)
        if raw < PARTS_BYTES:
            return b"".join(parts + contents)
        answer = Parts(parts + contents)
        answer.size = sum(map(len, answer))
        return answer
