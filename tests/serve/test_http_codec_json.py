"""JSON tensors in kiln/serve/http_codec.py read by orjson and written through remembered headers, against the
standard library's json as the oracle: every request of a corpus (valid: each datatype, flat and nested data,
binary and JSON inputs mixed; invalid: bad JSON, NaN/Infinity literals, 65-bit integers, lone surrogates, a BOM,
UTF-16) must decode to the same request, or fail with the same error, as decode_request with json.loads alone; and
every answer's body must be the bytes json.dumps of the whole header writes (the previous encoder)."""

from __future__ import annotations

import json
import zlib

import ml_dtypes
import numpy as np
import pytest

from kiln.serve import datatypes, http_codec
from kiln.serve.core import InferResponse
from kiln.serve.errors import ServeError
from kiln.serve.shared_memory import SharedMemoryRegistry

orjson = pytest.importorskip("orjson")  # a serve extra: CI installs it


def _rng(case: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(case.encode()))


def _body(inputs: list[dict], **extra) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


def _corpus() -> list[tuple[str, bytes]]:
    r = _rng("corpus")
    cases = []
    for v2, values in [("FP32", r.standard_normal(6).astype(np.float32).tolist()),
                       ("FP16", r.standard_normal(6).astype(np.float16).tolist()),
                       ("BF16", r.standard_normal(6).astype(np.float32).tolist()),
                       ("FP64", r.standard_normal(6).tolist()),
                       ("INT64", r.integers(-2**62, 2**62, 6).tolist()),
                       ("UINT64", [2**64 - 1, 0, 5, 2**63, 7, 8]),
                       ("INT8", [-128, 127, 0, 1, 2, 3]),
                       ("BOOL", [True, False, True, True, False, False]),
                       ("BYTES", ["a", "é", "\u2603", "", "x y", "\\"])]:
        cases.append((f"{v2} flat", _body([{"name": "x", "shape": [2, 3], "datatype": v2, "data": values}])))
        nested = [values[:3], values[3:]]
        cases.append((f"{v2} nested", _body([{"name": "x", "shape": [2, 3], "datatype": v2, "data": nested}])))
    cases += [
        ("ints to FP32", _body([{"name": "x", "shape": [3], "datatype": "FP32", "data": [1, 2, 3]}])),
        ("bools to FP32", _body([{"name": "x", "shape": [2], "datatype": "FP32", "data": [True, 2.5]}])),
        ("1e19 to FP32 (a float past 2**63, read again by json.loads)",
         _body([{"name": "x", "shape": [2], "datatype": "FP32", "data": [1e19, 2.0]}])),
        ("1e300 to FP16", _body([{"name": "x", "shape": [1], "datatype": "FP16", "data": [1e300]}])),
        ("65-bit int to FP32", b'{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":[1.5,'
                               b'123456789012345678901234567890]}]}'),
        ("65-bit int alone to FP64", b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP64",'
                                     b'"data":[-9223372036854775809]}]}'),
        ("65-bit int to INT64", b'{"inputs":[{"name":"x","shape":[1],"datatype":"INT64",'
                                b'"data":[18446744073709551616]}]}'),
        ("65-bit int with a string", b'{"inputs":[{"name":"x","shape":[2],"datatype":"FP32",'
                                     b'"data":["a",123456789012345678901234567890]}]}'),
        ("65-bit shape", b'{"inputs":[{"name":"x","shape":[123456789012345678901],"datatype":"FP32","data":[1]}]}'),
        ("65-bit timeout", b'{"parameters":{"timeout":123456789012345678901},"inputs":[{"name":"x","shape":[1],'
                           b'"datatype":"FP32","data":[1]}]}'),
        ("65-bit ignored parameter", b'{"parameters":{"mine":123456789012345678901},"inputs":[{"name":"x",'
                                     b'"shape":[1],"datatype":"FP32","data":[1]}]}'),
        ("NaN literal", b'{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":[NaN,1]}]}'),
        ("Infinity literal", b'{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":[Infinity,-Infinity]}]}'),
        ("1e400", b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP64","data":[1e400]}]}'),
        ("lone surrogate escape", b'{"id":"\\ud800","inputs":[{"name":"x","shape":[1],"datatype":"FP32",'
                                  b'"data":[1]}]}'),
        ("lone surrogate bytes", b'{"id":"\xed\xa0\x80","inputs":[{"name":"x","shape":[1],"datatype":"FP32",'
                                 b'"data":[1]}]}'),
        ("BOM", b'\xef\xbb\xbf{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}'),
        ("UTF-16", '{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1]}]}'.encode("utf-16")),
        ("invalid UTF-8", b'{"id":"\xff","inputs":[]}'),
        ("truncated", b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1'),
        ("trailing comma", b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1,]}]}'),
        ("empty", b''),
        ("a list", b'[1,2]'),
        ("a number", b'5'),
        ("duplicate keys", b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[1],"data":[2]}]}'),
        ("deep", b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":' + b'[' * 3000 + b']' * 3000
                 + b'}]}'),
        ("ragged", _body([{"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [[1, 2], [3]]}])),
        ("wrong count", _body([{"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [1, 2, 3]}])),
        ("floats to INT32", _body([{"name": "x", "shape": [1], "datatype": "INT32", "data": [1.5]}])),
        ("out of INT8", _body([{"name": "x", "shape": [1], "datatype": "INT8", "data": [300]}])),
        ("unknown datatype", _body([{"name": "x", "shape": [1], "datatype": "FP8", "data": [1]}])),
        ("outputs and id", _body([{"name": "x", "shape": [1], "datatype": "FP32", "data": [0.5]}], id="abc",
                                 outputs=[{"name": "y", "parameters": {"binary_data": False}}],
                                 parameters={"binary_data_output": True, "timeout": 100})),
        ("whitespace", b' \n{ "inputs" : [ { "name" : "x" , "shape" : [ 1 ] , "datatype" : "FP32" , '
                       b'"data" : [ 2.5e-3 ] } ] }\t'),
    ]
    return cases


CORPUS = _corpus()


def _decode(body: bytes, header_length: str | None = None):
    try:
        request, options = http_codec.decode_request(body, header_length, "m", "1", SharedMemoryRegistry())
    except (ServeError, RecursionError) as e:
        return type(e).__name__, str(e)
    inputs = {n: (a.dtype, a.shape, a.tobytes() if a.dtype != object else list(a.reshape(-1)))
              for n, a in request.inputs.items()}
    return (request.id, request.outputs, request.timeout_us, inputs, options.binary_default, options.binary,
            options.classification)


@pytest.mark.parametrize("case,body", CORPUS, ids=[c for c, _ in CORPUS])
def test_decode_as_json_loads(case, body, monkeypatch):
    fast = _decode(body)
    monkeypatch.setattr(http_codec, "orjson", None)
    assert fast == _decode(body)


def test_decode_mixed_binary_and_json(monkeypatch):
    x = _rng("mixed").standard_normal(4).astype(np.float32)
    header = _body([{"name": "a", "shape": [4], "datatype": "FP32", "parameters": {"binary_data_size": 16}},
                    {"name": "b", "shape": [2], "datatype": "INT64", "data": [7, -9]}]).decode().encode()
    body = header + x.tobytes()
    fast = _decode(body, str(len(header)))
    assert fast[3]["a"][2] == x.tobytes()
    monkeypatch.setattr(http_codec, "orjson", None)
    assert fast == _decode(body, str(len(header)))


def test_decode_takes_orjson(monkeypatch):
    """The fast path is taken for a plain JSON body (not json.loads every time behind the equality above)."""
    calls, loads = [], json.loads
    monkeypatch.setattr(http_codec.json, "loads", lambda *a, **k: calls.append(a) or loads(*a, **k))
    assert _decode(CORPUS[0][1])[3]["x"][1] == (2, 3)
    assert calls == []
    _decode(b'{"inputs":[{"name":"x","shape":[1],"datatype":"FP32","data":[NaN]}]}')
    assert len(calls) == 1


def _oracle(response: InferResponse, options: http_codec.OutputOptions) -> list[bytes]:
    """The previous encoder: one json.dumps of the whole header, the binary outputs' bytes after it."""
    outputs, chunks = [], []
    for name, array in response.outputs:
        entry = {"name": name, "datatype": datatypes.of_array(array).v2, "shape": list(array.shape)}
        if options.is_binary(name):
            data = datatypes.to_bytes(array)
            entry["parameters"] = {"binary_data_size": len(data)}
            chunks.append(data)
        else:
            entry["data"] = datatypes.to_json(array)
        outputs.append(entry)
    body = {"model_name": response.model, "model_version": response.version, "outputs": outputs}
    if response.id:
        body["id"] = response.id
    return [json.dumps(body, separators=(",", ":")).encode(), *chunks]


def _special(r: np.random.Generator, n: int) -> np.ndarray:
    """Values across every float formatting regime: exponents both ways, the 1e-4 and 1e16 edges, subnormals,
    zeros of both signs, NaN and infinities."""
    edges = np.array([0.0, -0.0, 1e-4, np.nextafter(1e-4, 0), 1e16, np.nextafter(1e16, 0), 1e-5, 5e-324,
                      1.5e300, np.nan, np.inf, -np.inf, 123456789012345.6, 1.0, -2.0])
    scaled = r.standard_normal(n) * 10.0 ** r.integers(-12, 22, n)
    return np.concatenate([edges, scaled])


def _f32(values: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return values.astype(np.float32)


def _outputs(case: str) -> list[tuple[str, np.ndarray]]:
    r = _rng(case)
    arrays = {
        "FP32": r.standard_normal((2, 3)).astype(np.float32),
        "FP32 large": r.standard_normal((3, 50)).astype(np.float32),
        "FP16": r.standard_normal(5).astype(np.float16),
        "FP16 large": (r.standard_normal(100) * 100).astype(np.float16),
        "BF16": r.standard_normal(5).astype(ml_dtypes.bfloat16),
        "BF16 large": r.standard_normal(200).astype(ml_dtypes.bfloat16),
        "FP64 special": _special(r, 40),
        "FP64 special large": _special(r, 3000),
        "FP32 special large": _f32(_special(r, 3000)),
        "FP64 positional large": r.standard_normal(500) * 1e3,
        "FP64 non-contiguous": r.standard_normal((20, 10))[:, ::3],
        "INT64": r.integers(-2**63, 2**63 - 1, 70, dtype=np.int64),
        "UINT64": np.array([2**64 - 1, 0, 2**63] * 30, dtype=np.uint64),
        "INT8": r.integers(-128, 127, 10, dtype=np.int8),
        "BOOL": r.random(90) < 0.5,
        "BOOL small": np.array([True, False]),
        "BYTES": np.array([b"a", "é".encode(), b"\xff", b""], dtype=object),
        "empty": np.zeros((0, 4), np.float32),
    }
    return list(arrays.items()) if case == "all" else [(case, arrays[case])]


OUTPUT_CASES = ["FP32", "FP32 large", "FP16", "FP16 large", "BF16", "BF16 large", "FP64 special", "FP64 special large",
                "FP32 special large", "FP64 positional large", "FP64 non-contiguous", "INT64", "UINT64", "INT8",
                "BOOL", "BOOL small", "BYTES", "empty", "all"]


@pytest.mark.parametrize("case", OUTPUT_CASES)
@pytest.mark.parametrize("binary", ["json", "binary", "mixed"])
@pytest.mark.parametrize("request_id", ["", "id-1", json.loads('"\\u0000kiln-data-0"')])
def test_encode_as_json_dumps(case, binary, request_id, monkeypatch):
    monkeypatch.setattr(http_codec, "_HEADERS", {})
    outputs = _outputs(case)
    options = http_codec.OutputOptions(binary_default=binary == "binary")
    if binary == "mixed":
        options.binary = {name: k % 2 == 0 for k, (name, _) in enumerate(outputs)}
    for round_ in range(3):  # a miss, then the remembered header, then again with other values
        if round_ == 2:
            outputs = [(n, a[::-1].copy() if a.ndim else a) for n, a in outputs]
        response = InferResponse("model", "1", request_id, outputs)
        pieces, header_length = http_codec.encode_response_pieces(response, options, True, SharedMemoryRegistry())
        expected = _oracle(response, options)
        assert [bytes(p) for p in pieces] == expected
        assert header_length == (None if len(expected) == 1 else len(expected[0]))


def test_marker_in_an_id_takes_no_template(monkeypatch):
    monkeypatch.setattr(http_codec, "_HEADERS", {})
    response = InferResponse("model", "1", json.loads('"\\u0000kiln-data-0"'), _outputs("FP32"))
    options = http_codec.OutputOptions()
    pieces, _ = http_codec.encode_response_pieces(response, options, True, SharedMemoryRegistry())
    assert pieces == _oracle(response, options)
    assert http_codec._HEADERS == {}


def test_json_data_as_json_dumps_across_floats():
    """_json_data against json.dumps over many floats of every magnitude (float32's values as doubles included)."""
    r = _rng("floats")
    bits = r.integers(0, 2**63, 20000, dtype=np.int64).view(np.float64)
    for values in (bits, _special(r, 20000), _f32(_special(r, 20000)), -bits):
        for chunk in (values[:40], values):
            expected = json.dumps(datatypes.to_json(chunk), separators=(",", ":")).encode()
            assert http_codec._json_data(chunk) == expected


@pytest.mark.parametrize("edge", [1e-4, np.nextafter(1e-4, 0), np.nextafter(1e-4, 1), 5e-5, 1e-5, 1e16,
                                  np.nextafter(1e16, 0), 1e17, 5e-324, -0.0, np.nan, np.inf])
@pytest.mark.parametrize("size", [3, 300])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, ml_dtypes.bfloat16])
def test_json_data_at_the_edges(edge, size, dtype):
    """One value at an edge of orjson's like-json.dumps range among ordinary ones: the same bytes."""
    with np.errstate(over="ignore"):
        values = np.full(size, 1.5).astype(dtype)
        values[size // 2] = edge
    expected = json.dumps(datatypes.to_json(values), separators=(",", ":")).encode()
    assert http_codec._json_data(values) == expected


def _families() -> list[tuple[str, object, bool]]:
    """(case, a function of a generator giving one body, whether its header is learned): JSON headers a client
    repeats with fresh data."""
    def plain(g):
        return _body([{"name": "x", "shape": [1, 4], "datatype": "FP32",
                       "data": g.standard_normal(4).astype(np.float32).tolist()}],
                     outputs=[{"name": "y", "parameters": {"binary_data": False}}])

    def compact(g):
        return json.dumps({"id": "c", "inputs": [
            {"name": "a", "shape": [2, 2], "datatype": "INT64", "data": g.integers(-9, 9, (2, 2)).tolist()},
            {"name": "b", "shape": [3], "datatype": "BOOL", "data": (g.random(3) < 0.5).tolist()},
            {"name": "c", "shape": [2], "datatype": "FP16", "data": g.standard_normal(2).tolist()}]},
            separators=(",", ":")).encode()

    def tricky_id(g):  # an id holding `"data": [`
        return json.dumps({"id": 'x"data": [1]', "inputs": [
            {"name": "x", "shape": [2], "datatype": "FP64", "data": g.standard_normal(2).tolist()}]}).encode()

    def tricky_parameters(g):  # request parameters with a "data" list and a key ending in `"data`: not learned
        return json.dumps({"parameters": {'a"data': [1, 2], "data": [3]}, "inputs": [
            {"name": "x", "shape": [2], "datatype": "FP64", "data": g.standard_normal(2).tolist()}]}).encode()

    def tensor_parameter(g):  # an input's parameters with a "data" list: not its data
        return json.dumps({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "parameters": {"data": [1]},
                                       "data": g.standard_normal(2).tolist()}]}).encode()

    def twice(g):  # "data" twice in one input: the last one counts
        v = g.standard_normal(2).tolist()
        return (b'{"inputs":[{"name":"x","shape":[2],"datatype":"FP32","data":[9,9],"data":' +
                json.dumps(v).encode() + b'}]}')

    def bytes_json(g):
        return _body([{"name": "s", "shape": [2], "datatype": "BYTES", "data": [str(g.integers(9)), "q"]}])

    def mixed(g):  # one binary input, one JSON
        header = _body([{"name": "a", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": 8}},
                        {"name": "b", "shape": [2], "datatype": "INT32", "data": g.integers(-5, 5, 2).tolist()}])
        return header, header + g.standard_normal(2).astype(np.float32).tobytes()

    return [("plain", plain, True), ("compact", compact, True), ("tricky id", tricky_id, True),
            ("tricky parameters", tricky_parameters, False),
            ("tensor parameter", tensor_parameter, False), ("twice", twice, False), ("BYTES", bytes_json, False),
            ("mixed", mixed, True)]


def _variants(body: bytes) -> list[bytes]:
    """The same header with data its input cannot take or its parser refuses: each must answer as the full decode."""
    start = body.index(b'"data"')
    start = body.index(b"[", start)
    stop = body.index(b"]", start) + 1
    return [body[:start] + bad + body[stop:] for bad in
            (b"[1, 2, 3, 4, 5]", b"[1,,2]", b"[NaN, 1, 2, 3]", b"[1e400, 1, 2, 3]", b"[[1, 2], [3, 4]]",
             b"[123456789012345678901234567890, 1, 2, 3]", b"[1e19, 1, 2, 3]", b"[true, false, 1, 2.5]", b"[]",
             b"[1, 2, 3, 4.5e-7]", b"[1, 2, 3, 4] ")]


@pytest.mark.parametrize("case,make,learned", _families(), ids=[c for c, _, _ in _families()])
def test_json_layouts_decode_as_json_loads(case, make, learned, monkeypatch):
    """decode_request through one HeaderLayouts, body by body (fresh data, then data of every kind of wrong), as
    decode_request with json.loads alone and no layouts; a learnable header is parsed whole once."""
    g = _rng(f"layouts {case}")
    layouts, registry = http_codec.HeaderLayouts(), SharedMemoryRegistry()
    bodies = []
    for _ in range(4):
        made = make(g)
        bodies.append((made[1], str(len(made[0]))) if isinstance(made, tuple) else (made, None))
    bodies += [(v, length) for body, length in bodies[1:2] if length is None for v in _variants(body)]
    parsed = []
    parse = http_codec._parse_fast
    monkeypatch.setattr(http_codec, "_parse_fast", lambda data: parsed.append(1) or parse(data))

    def decoded(body, length, layouts):
        try:
            request, options = http_codec.decode_request(body, length, "m", "1", registry, layouts)
        except ServeError as e:
            return type(e).__name__, str(e)
        return (request.id, request.outputs, request.timeout_us,
                [(n, a.dtype, a.shape, a.tolist() if a.dtype == object else a.tobytes())
                 for n, a in request.inputs.items()], options.binary_default,
                options.binary)

    got = [decoded(body, length, layouts) for body, length in bodies]
    full_parses = len(parsed)
    monkeypatch.setattr(http_codec, "orjson", None)
    want = [decoded(body, length, None) for body, length in bodies]
    for k, (a, b) in enumerate(zip(got, want)):
        assert a == b, (k, bodies[k][0][:200])
    if learned:
        first = bodies[0][0][:int(bodies[0][1])] if bodies[0][1] else bodies[0][0]
        assert http_codec._cut(first)[0] in layouts.known
        assert full_parses <= len(bodies) - 3  # the 3 repeats of the first header decoded from its layout
    else:
        assert len(layouts.known) == 0


@pytest.mark.parametrize("where", ["first", "last", "first two", "last two", "adjacent", "a tenth", "a fifth",
                                   "all"])
def test_json_data_with_a_few_other_values(where):
    """A large float output with values orjson writes otherwise (tiny, huge, NaN, infinite) at its ends, side by
    side, or spread (under and over the share _json_data splits around): the bytes of json.dumps."""
    r = _rng(f"others {where}")
    n = 500
    values = r.standard_normal(n) * 10
    at = {"first": [0], "last": [n - 1], "first two": [0, 1], "last two": [n - 2, n - 1], "adjacent": [7, 8, 9],
          "a tenth": r.choice(n, n // 10, replace=False), "a fifth": r.choice(n, n // 5, replace=False),
          "all": np.arange(n)}[where]
    values[at] = r.choice([1e-7, -3e-5, 2.5e17, np.nan, np.inf, -np.inf, 5e-324], len(at))
    for dtype in (np.float64, np.float32):
        with np.errstate(over="ignore"):
            array = values.astype(dtype).reshape(5, 100)
        expected = json.dumps(datatypes.to_json(array), separators=(",", ":")).encode()
        assert http_codec._json_data(array) == expected
