"""KServe v2 inference requests and responses over HTTP: JSON tensors and Triton's binary extension.

A request body is a JSON object, optionally followed by raw tensor bytes: the header
`Inference-Header-Content-Length: N` says the JSON is the first N bytes, and each input whose
parameters carry `binary_data_size` takes that many of the bytes after it, in input order. A
response carries outputs as JSON lists, or as bytes after the JSON when the request asked for
binary outputs (`binary_data_output`, or an output's `binary_data`), with the same header.
Everything the client declares (sizes, shapes, datatypes, lengths) is checked against what it
sent; every mismatch is an InvalidRequest naming the tensor.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from kiln.serve import datatypes
from kiln.serve.core import InferRequest, InferResponse
from kiln.serve.errors import InvalidRequest, ServeError
from kiln.serve.shared_memory import SharedMemoryRegistry, SharedTensor, TensorPlace, output_parameters, tensor_place

try:  # the serve extras' JSON parser (pyproject.toml): 3-4x the standard library's json.loads on an infer body
    import orjson
except ImportError:  # kiln serve without its extras: the standard library's parser alone
    orjson = None

HEADER_LENGTH = "Inference-Header-Content-Length"


@dataclass
class OutputOptions:
    """How the client wants each output back: binary or JSON, top-k classification, or into shared memory."""

    binary_default: bool = False
    binary: dict[str, bool] = field(default_factory=dict)
    classification: dict[str, int] = field(default_factory=dict)
    places: dict[str, TensorPlace] = field(default_factory=dict)

    def is_binary(self, name: str) -> bool:
        return self.binary.get(name, self.binary_default)

    def engine_places(self) -> dict[str, TensorPlace] | None:
        """The outputs the engine may write into shared memory itself (not those classified first)."""
        places = {n: p for n, p in self.places.items() if n not in self.classification}
        return places or None


def _object(value: object, what: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidRequest(f"{what} must be a JSON object")
    return value


def _int(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidRequest(f"{what} must be a non-negative integer, given {value!r}")
    return value


def _bool(value: object, what: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{what} must be true or false, given {value!r}")
    return value


def parse_json_header(data: bytes | memoryview) -> dict:
    try:
        header = json.loads(bytes(data))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"the request is not valid JSON: {e}") from None
    return _object(header, "the request")


class _Reparse(Exception):
    """A request orjson parsed that the standard library's parse might read otherwise: decode it again with that."""


# orjson reads an integer outside int64 and uint64 as the nearest float, where json.loads keeps the int; such a
# float is at least this large. A float input whose values reach it is decoded again from json.loads' parse.
_HUGE = float(1 << 63)
_SMALL = 64  # a tensor of up to this many elements is checked (_huge, _json_data) as a list; a larger one by numpy


def _parse_fast(data: bytes | memoryview) -> dict | None:
    """The request's JSON by orjson, or None where orjson refuses it. json.loads accepts some JSON orjson refuses
    (NaN, Infinity, 1e400, lone surrogates, a UTF-8 BOM, UTF-16 and UTF-32 bodies) and words the errors the 400s
    quote: those bodies take json.loads, whose answers they got before. Where orjson accepts, it reads what
    json.loads reads, but integers past 64 bits (floats, see _HUGE); decode_request handles those."""
    try:
        header = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return header if isinstance(header, dict) else None


class _Layout:
    """What a JSON header decoded to, but the tensors: its request's id, timeout, outputs and output options, and
    each input's name, datatype, shape and span of the binary data after the header (start, stop), or for an input
    sent as JSON, None and the index of its "data" among the header's (see _cut)."""

    __slots__ = ("request_id", "timeout", "outputs", "options", "inputs", "binary_size")

    def __init__(self, request_id, timeout, outputs, options, inputs, binary_size):
        self.request_id, self.timeout, self.outputs, self.options = request_id, timeout, outputs, options
        self.inputs: list[tuple[str, datatypes.Datatype, list[int], int | None, int]] = inputs
        self.binary_size = binary_size


_DATA = re.compile(rb'"data"\s*:\s*\[')
_BRACKETS = re.compile(rb'[\[\]"]')


def _array_end(text: bytes, start: int) -> int | None:
    """Where the array opening at text[start] ends (past its "]"), or None where it holds a string (a quote: BYTES
    data) or does not end."""
    close = text.find(b"]", start)
    if close < 0:
        return None
    if text.find(b"[", start + 1, close) < 0:  # flat: a tensor's usual data
        return None if text.find(b'"', start, close) >= 0 else close + 1
    depth = 0
    for found in _BRACKETS.finditer(text, start):
        char = text[found.start()]
        if char == 0x22:
            return None
        depth += 1 if char == 0x5B else -1
        if depth == 0:
            return found.end()
    return None


def _cut(text: bytes) -> tuple[tuple[bytes, ...], list[tuple[int, int]]] | None:
    """A JSON header cut around the array after each `"data":` in it: the pieces between, and the arrays' spans;
    None where one of them holds a string or does not end. In valid JSON each span is an array value (the second
    quote of `"data"` ends a string, so the colon and "[" after it are outside strings); whether they are the
    inputs' data is HeaderLayouts.learn_json's check."""
    pieces, spans, at = [], [], 0
    while (found := _DATA.search(text, at)) is not None:
        start = found.end() - 1
        stop = _array_end(text, start)
        if stop is None:
            return None
        pieces.append(text[at:start])
        spans.append((start, stop))
        at = stop
    pieces.append(text[at:])
    return tuple(pieces), spans


class _Unparsed(Exception):
    """A JSON tensor's data that its parser refused alone: the whole request takes the full decode."""


def _parse_data(text: bytes, fast: bool) -> list:
    try:
        return orjson.loads(text) if fast else json.loads(text)
    except (ValueError, RecursionError):  # orjson's and json's JSONDecodeError are ValueErrors
        raise _Unparsed from None


class HeaderLayouts:
    """JSON headers that a client repeats byte for byte but for its tensors, remembered decoded.

    A client at concurrency 1 sends the same header every call (tritonclient.http: same names, shapes,
    datatypes, binary_data_size or JSON tensors, outputs); only the tensors differ: the bytes after the header
    (binary tensor extension), or the "data" arrays in it (JSON tensors). A header whose outputs name no shared
    memory region is kept, with what decode_request made of it: by its exact bytes (under MAX_BYTES) where every
    input came as binary data; else by its pieces around the JSON tensors' "data" arrays (_cut: together under
    MAX_BYTES, the arrays holding no string, so not BYTES). A later body whose header is the same bytes, or the
    same pieces around other arrays (a dict lookup: an exact compare, never a guess), and whose binary data is as
    long, is that request with other tensors: its binary inputs are views of its own body, as decode_request's,
    its JSON inputs each its array parsed alone and read by datatypes.from_json, with no parse of the rest and no
    checks to repeat. Since the pieces are the same and the arrays hold no quote, the header parses as the one
    remembered with those arrays as its data: the same request, and the same error where an array is not what
    its input needs; an array its parser refuses sends the body to the full decode (its error names a place in
    the whole body). Anything else (shared memory, another length, BYTES as JSON) takes the full decode. At most
    MAX_LAYOUTS kept: a client whose every header differs (a fresh id per call) empties them when full, at the cost
    of a dict store a request. Shared memory is left out because its answer depends on the registry's state, not
    on the header alone."""

    MAX_BYTES = 4096
    MAX_LAYOUTS = 256

    def __init__(self):
        self.known: dict[bytes | tuple[bytes, ...], _Layout] = {}

    def decode(self, text: bytes, binary: memoryview, model: str, version: str,
               fast: bool = False) -> tuple[InferRequest, OutputOptions] | None:
        """`text`: the JSON header; `fast`: JSON tensors' arrays parsed by orjson, else by json.loads."""
        data = None
        if b'"data"' in text:
            cut = _cut(text)
            if cut is None:
                return None
            pieces, spans = cut
            if spans:
                layout = self.known.get(pieces)
                if layout is None or len(binary) != layout.binary_size:
                    return None
                try:  # every array parsed before any is read, as the full decode parses the whole header first
                    data = [_parse_data(text[start:stop], fast) for start, stop in spans]
                except _Unparsed:
                    return None
        if data is None:
            layout = self.known.get(text) if len(text) <= self.MAX_BYTES else None
            if layout is None or len(binary) != layout.binary_size:
                return None
        inputs = {}
        for name, datatype, shape, start, stop in layout.inputs:
            if start is None:
                inputs[name] = array = datatypes.from_json(data[stop], datatype, shape, name)
                if fast and _huge(data[stop], array):
                    return None  # the full decode: it reads the request again from json.loads' parse
            elif datatype.v2 == "BYTES":
                inputs[name] = datatypes.from_bytes(binary[start:stop], datatype, shape, name)
            else:
                inputs[name] = np.frombuffer(binary[start:stop], dtype=datatype.numpy).reshape(shape)
        outputs = layout.outputs
        request = InferRequest(model=model, version=version, id=layout.request_id, inputs=inputs,
                               outputs=None if outputs is None else list(outputs), timeout_us=layout.timeout)
        return request, layout.options

    def learn(self, key: bytes | tuple[bytes, ...], layout: _Layout) -> None:
        if len(self.known) >= self.MAX_LAYOUTS:
            self.known.clear()
        self.known[key] = layout

    def learn_json(self, text: bytes, header: dict, items: list[dict], layout: _Layout) -> None:
        """Keeps `layout` by `text`'s pieces around its JSON tensors' arrays, where those arrays are exactly the
        data of `items` (the JSON inputs, in order; `header`: text parsed, which this spoils): the header with a
        string in each array's place parses to `header` with those strings as the items' data."""
        cut = _cut(text)
        if cut is None:
            return
        pieces, spans = cut
        if len(spans) != len(items) or sum(map(len, pieces)) > self.MAX_BYTES:
            return
        marks = [json.dumps(_marker(k)).encode() for k in range(len(items))]
        try:
            probed = json.loads(pieces[0] + b"".join(mark + piece for mark, piece in zip(marks, pieces[1:])))
        except (ValueError, RecursionError):
            return
        for item, mark in zip(items, marks):
            item["data"] = json.loads(mark)
        if probed == header:
            self.learn(pieces, layout)


def _huge(values: list, array: np.ndarray) -> bool:
    """Whether a float input's values (`values` read as `array`) reach _HUGE (or are not finite): orjson may have
    read a 65-bit integer. A short flat list is looked at as it is (numpy's calls cost more there)."""
    if array.dtype.kind in "biuO":
        return False
    if len(values) <= _SMALL:
        try:
            return not (-_HUGE < min(values) and max(values) < _HUGE)
        except (TypeError, ValueError):  # nested lists (compared with floats), or none
            pass
    return bool(array.size) and not float(np.abs(array).max()) < _HUGE


def decode_request(body: bytes, header_length: str | None, model: str, version: str,
                   shared_memory: SharedMemoryRegistry,
                   layouts: HeaderLayouts | None = None) -> tuple[InferRequest, OutputOptions]:
    """The request in `body`. `layouts`: headers seen before, decoded (HeaderLayouts), consulted and taught when
    the body uses the binary tensor extension.

    The JSON is parsed by orjson where installed; a body orjson refuses, or whose decode by orjson's parse fails in
    any way or meets a float orjson may have made of a 65-bit integer, is decoded again from json.loads' parse:
    the answer (a request, or a ServeError's message) is json.loads' in every case."""
    if orjson is not None:
        try:
            return _decode(body, header_length, model, version, shared_memory, layouts, True)
        except (ServeError, _Reparse):
            pass
    return _decode(body, header_length, model, version, shared_memory, layouts, False)


def _decode(body: bytes, header_length: str | None, model: str, version: str, shared_memory: SharedMemoryRegistry,
            layouts: HeaderLayouts | None, fast: bool) -> tuple[InferRequest, OutputOptions]:
    if header_length is not None:
        try:
            length = int(header_length)
        except ValueError:
            raise InvalidRequest(f"{HEADER_LENGTH} {header_length!r} is not an integer") from None
        if not 0 <= length <= len(body):
            raise InvalidRequest(f"{HEADER_LENGTH} {length} is outside the body's {len(body)} bytes")
    else:
        length = len(body)
    view = memoryview(body)
    binary, offset = view[length:], 0
    text = None  # the JSON header's bytes, where layouts are kept
    if layouts is not None:
        text = body if length == len(body) and type(body) is bytes else bytes(view[:length])
        known = layouts.decode(text, binary, model, version, fast)
        if known is not None:
            return known
    header = _parse_fast(view[:length]) if fast else None
    if header is None:
        fast = False
        header = parse_json_header(view[:length])

    request_id = header.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidRequest("the request's 'id' must be a string")
    params = _object(header.get("parameters", {}), "the request's 'parameters'")
    timeout = params.get("timeout")
    if timeout is not None:
        timeout = _int(timeout, "parameter 'timeout' (microseconds)")
    options = OutputOptions(_bool(params.get("binary_data_output", False), "parameter 'binary_data_output'"))

    raw_inputs = header.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidRequest("the request's 'inputs' must be a non-empty list of tensors")
    inputs: dict[str, np.ndarray] = {}
    spans = []  # each input's (name, datatype, shape, start, stop) (_Layout.inputs); None with shared memory
    json_items = []  # the inputs sent as JSON tensors
    for k, item in enumerate(raw_inputs):
        item = _object(item, f"inputs[{k}]")
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(f"inputs[{k}] needs a 'name' string")
        if name in inputs:
            raise InvalidRequest(f"input {name!r} is given twice")
        shape = item.get("shape")
        if not isinstance(shape, list):
            raise InvalidRequest(f"input {name!r} needs a 'shape' list")
        datatypes.element_count(shape, name)
        datatype = datatypes.from_v2(item.get("datatype"), name)
        tensor_params = _object(item.get("parameters", {}), f"input {name!r} 'parameters'")
        place = tensor_place(tensor_params, name)
        size = tensor_params.get("binary_data_size")
        if place is not None:
            if size is not None or "data" in item:
                raise InvalidRequest(f"input {name!r} names a shared memory region and carries data too; send one")
            inputs[name] = shared_memory.read(place, datatype, shape, name)
            spans = None
        elif size is not None:
            size = _int(size, f"input {name!r} binary_data_size")
            if "data" in item:
                raise InvalidRequest(f"input {name!r} has both binary_data_size and JSON 'data'; send one")
            if offset + size > len(binary):
                raise InvalidRequest(f"input {name!r}: binary_data_size {size} runs past the {len(binary) - offset} "
                                     "bytes of binary data left in the body")
            inputs[name] = datatypes.from_bytes(binary[offset:offset + size], datatype, shape, name)
            if spans is not None:
                spans.append((name, datatype, list(shape), offset, offset + size))
            offset += size
        elif "data" in item:
            inputs[name] = array = datatypes.from_json(item["data"], datatype, shape, name)
            if fast and _huge(item["data"], array):
                raise _Reparse
            if spans is not None:
                spans.append((name, datatype, list(shape), None, len(json_items)))
                json_items.append(item)
        else:
            raise InvalidRequest(f"input {name!r} has neither 'data' nor binary_data_size")
    if offset != len(binary):
        raise InvalidRequest(f"the body holds {len(binary) - offset} bytes of binary data that no input's "
                             "binary_data_size accounts for")

    outputs = None
    if "outputs" in header:
        raw_outputs = header["outputs"]
        if not isinstance(raw_outputs, list):
            raise InvalidRequest("the request's 'outputs' must be a list")
        outputs = []
        for k, item in enumerate(raw_outputs):
            item = _object(item, f"outputs[{k}]")
            name = item.get("name")
            if not isinstance(name, str) or not name:
                raise InvalidRequest(f"outputs[{k}] needs a 'name' string")
            out_params = _object(item.get("parameters", {}), f"output {name!r} 'parameters'")
            place = tensor_place(out_params, name)
            if place is not None:
                shared_memory.check(place, name)  # an unknown region or window: refused before the model runs
                options.places[name] = place
            if "binary_data" in out_params:
                options.binary[name] = _bool(out_params["binary_data"], f"output {name!r} binary_data")
            if "classification" in out_params:
                options.classification[name] = _int(out_params["classification"], f"output {name!r} classification")
            outputs.append(name)
    request = InferRequest(model=model, version=version, id=request_id, inputs=inputs, outputs=outputs,
                           timeout_us=timeout, output_places=options.engine_places())
    if text is not None and spans is not None and not options.places:
        layout = _Layout(request_id, timeout, None if outputs is None else list(outputs), options, spans, len(binary))
        if json_items:
            layouts.learn_json(text, header, json_items, layout)
        elif header_length is not None and length <= HeaderLayouts.MAX_BYTES:
            layouts.learn(text, layout)
    return request, options


def classify(array: np.ndarray, k: int, batched: bool) -> np.ndarray:
    """Triton's classification extension: the top k of each row as "score:index" BYTES."""
    rows = array.reshape(array.shape[0], -1) if batched else array.reshape(1, -1)
    k = min(k, rows.shape[1])
    order = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :k]
    out = np.empty((rows.shape[0], k), dtype=object)
    for r in range(rows.shape[0]):
        out[r] = [f"{float(rows[r, i]):f}:{int(i)}".encode() for i in order[r]]
    return out if batched else out.reshape(k)


def encode_response(response: InferResponse, options: OutputOptions, batched: bool,
                    shared_memory: SharedMemoryRegistry) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when binary outputs follow it."""
    pieces, header_length = encode_response_pieces(response, options, batched, shared_memory)
    return (pieces[0] if len(pieces) == 1 else b"".join(pieces)), header_length


def encode_response_pieces(response: InferResponse, options: OutputOptions, batched: bool,
                           shared_memory: SharedMemoryRegistry) -> tuple[list[bytes | memoryview], int | None]:
    """encode_response's body in its pieces, not joined: the JSON header, then each binary output's bytes, large
    ones as views of their arrays (datatypes.raw_view). The infer fast path (kiln/serve/http_fast.py) writes them
    as they are."""
    key = _header_key(response, options)
    if key is not None:
        template = _HEADERS.get(key)
        if template is None:
            template = _template(response, options)
            if template is not None:
                if len(_HEADERS) >= MAX_HEADERS:
                    _HEADERS.clear()
                _HEADERS[key] = template
        if template is not None:
            return _from_template(template, response, options)
    return _encode_pieces(response, options, batched, shared_memory)


# The JSON header of an answer whose outputs are plain arrays (none classified or in shared memory) is a function of
# the model, version, id and each output's name, dtype, shape and form (binary: binary_data_size is the array's
# nbytes; JSON: its "data" list) alone, but for the JSON outputs' data: a client at concurrency 1 gets the same
# header every call, with other data. It is json.dumps'd once with a marker for each JSON output's data and kept,
# cut at the markers (at most MAX_HEADERS): an answer is then its pieces with each output's data json.dumps'd
# between them (json.dumps of the whole header writes each list as json.dumps of the list alone: the same bytes).
_HEADERS: dict[tuple, tuple[bytes, ...]] = {}
MAX_HEADERS = 256
_ENCODER = json.JSONEncoder(separators=(",", ":"))  # json.dumps(..., separators=(",", ":")) without its set-up


def _header_key(response: InferResponse, options: OutputOptions) -> tuple | None:
    """The answer's key in _HEADERS, or None when an output is not a plain array (classified, shared memory, a
    SharedTensor) or is BYTES sent binary (its binary_data_size is its elements' lengths)."""
    if options.classification or options.places:
        return None
    key = [response.model, response.version, response.id]
    for name, array in response.outputs:
        if type(array) is not np.ndarray:
            return None
        binary = options.is_binary(name)
        if binary and array.dtype == object:
            return None
        key.append((name, array.dtype, array.shape, binary))
    return tuple(key)


def _marker(k: int) -> str:
    return f"\0kiln-data-{k}"


def _template(response: InferResponse, options: OutputOptions) -> tuple[bytes, ...] | None:
    """The answer's JSON header cut where each JSON output's data goes (as _encode_pieces writes it, with a
    marker string as the data); None where a marker's bytes are found more than once (an id or name holding
    one): no template for that answer."""
    outputs, markers = [], []
    for name, array in response.outputs:
        entry = {"name": name, "datatype": datatypes.of_array(array).v2, "shape": list(array.shape)}
        if options.is_binary(name):
            entry["parameters"] = {"binary_data_size": array.nbytes}
        else:
            entry["data"] = _marker(len(markers))
            markers.append(_ENCODER.encode(entry["data"]).encode())
        outputs.append(entry)
    body = {"model_name": response.model, "model_version": response.version, "outputs": outputs}
    if response.id:
        body["id"] = response.id
    header = _ENCODER.encode(body).encode()
    pieces = []
    for marker in markers:
        if header.count(marker) != 1:
            return None
        before, _, header = header.partition(marker)
        pieces.append(before)
    pieces.append(header)
    return tuple(pieces)


# orjson writes a float as json.dumps does (its shortest round-trip digits, positional, ".0" for a whole number)
# from 1e-4 up to 1e16, where json.dumps writes no exponent; outside it, their exponents differ (1e-05 / 0.00001)
_POSITIONAL = (1e-4, 1e16)


def _json_data(array: np.ndarray) -> bytes:
    """json.dumps(datatypes.to_json(array), separators=(",", ":")): written by orjson where its bytes are the same
    (integers, booleans, finite floats whose magnitudes are 0 or in _POSITIONAL), a large array without making it
    a list first, its few other values (NaN, infinities, tiny or huge magnitudes) each by json.dumps; else by
    json.dumps. Python's float repr is slow on the 17 digits a float32's value takes as a double (~1 us each);
    orjson's is not."""
    if orjson is None or array.dtype == object:
        return _ENCODER.encode(datatypes.to_json(array)).encode()
    if array.size <= _SMALL:
        values = datatypes.to_json(array)
        if array.dtype.kind in "biu":
            return orjson.dumps(values)
        low, high = _POSITIONAL
        for v in values:
            if not (low <= abs(v) < high or v == 0):
                return _ENCODER.encode(values).encode()
        return orjson.dumps(values)
    flat = np.ascontiguousarray(array.reshape(-1))
    if flat.dtype.kind in "biu":
        return orjson.dumps(flat, option=orjson.OPT_SERIALIZE_NUMPY)
    flat = flat.astype(np.float32) if flat.dtype == ml_dtypes.bfloat16 else flat
    flat = flat.astype(np.float64)
    magnitude = np.abs(flat)
    others = np.flatnonzero(~((magnitude >= _POSITIONAL[0]) & (magnitude < _POSITIONAL[1]) | (flat == 0)))
    if len(others) > len(flat) // 8:
        return _ENCODER.encode(datatypes.to_json(array)).encode()
    # runs of values orjson writes as json.dumps does, and between them each other value as json.dumps writes it
    # (a trained model's float outputs hold a few values under 1e-4 among many)
    parts, at = [], 0
    for k in others.tolist():
        if k > at:
            parts.append(orjson.dumps(flat[at:k], option=orjson.OPT_SERIALIZE_NUMPY)[1:-1])
        parts.append(_ENCODER.encode(float(flat[k])).encode())
        at = k + 1
    if at < len(flat) or not parts:
        parts.append(orjson.dumps(flat[at:], option=orjson.OPT_SERIALIZE_NUMPY)[1:-1])
    return b"[" + b",".join(parts) + b"]"


def _from_template(template: tuple[bytes, ...], response: InferResponse,
                   options: OutputOptions) -> tuple[list[bytes | memoryview], int | None]:
    if len(template) == 1:  # every output binary
        header = template[0]
    else:
        parts = [template[0]]
        for name, array in response.outputs:
            if not options.is_binary(name):
                parts.append(_json_data(array))
                parts.append(template[len(parts) // 2])
        header = b"".join(parts)
    chunks = [datatypes.raw_view(array) for name, array in response.outputs if options.is_binary(name)]
    if not chunks:
        return [header], None
    return [header, *chunks], len(header)


def _encode_pieces(response: InferResponse, options: OutputOptions, batched: bool,
                   shared_memory: SharedMemoryRegistry) -> tuple[list[bytes | memoryview], int | None]:
    outputs, chunks = [], []
    for name, array in response.outputs:
        if type(array) is SharedTensor:  # the engine process wrote it into its region
            outputs.append({"name": name, "datatype": array.datatype, "shape": list(array.shape),
                            "parameters": output_parameters(options.places[name], array.place.byte_size)})
            continue
        if name in options.classification:
            array = classify(array, options.classification[name], batched)
        entry = {"name": name, "datatype": datatypes.of_array(array).v2, "shape": list(array.shape)}
        place = options.places.get(name)
        if place is not None:
            entry["parameters"] = output_parameters(place, shared_memory.write(place, array, name))
        elif options.is_binary(name):
            data = datatypes.raw_view(array)
            entry["parameters"] = {"binary_data_size": len(data)}
            chunks.append(data)
        else:
            entry["data"] = datatypes.to_json(array)
        outputs.append(entry)
    body = {"model_name": response.model, "model_version": response.version, "outputs": outputs}
    if response.id:
        body["id"] = response.id
    header = _ENCODER.encode(body).encode()
    if not chunks:
        return [header], None
    return [header, *chunks], len(header)
