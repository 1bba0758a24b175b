"""kiln/serve/grpc_wire.py: a ModelInferRequest split into its other fields and views of its tensor bytes,
checked against protobuf's own parse of the whole message (the oracle): fresh random messages, tensor
sizes at the varint length boundaries, fields in any order (concatenated messages merge), truncations;
the views are into the received bytes (no copy); a malformed message over gRPC is INVALID_ARGUMENT.
ResponseEncoder's answers are byte for byte what protobuf serializes for the same message."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import rng
from tritonclient.grpc import service_pb2 as pb

from kiln.serve.grpc_wire import ResponseEncoder, parse_infer_request, split_raw_contents

SIZES = [0, 1, 16, 127, 128, 16383, 16384, 300_000]  # 1, 2 and 3-byte length varints


def _message(g: np.random.Generator, raw_sizes: list[int]) -> pb.ModelInferRequest:
    m = pb.ModelInferRequest(model_name="m" * int(g.integers(1, 40)), id=str(g.integers(1 << 60)))
    if g.random() < 0.5:
        m.model_version = str(g.integers(1, 9))
    if g.random() < 0.5:
        m.parameters["timeout"].int64_param = int(g.integers(1 << 40))
    for k, size in enumerate(raw_sizes):
        t = m.inputs.add(name=f"in{k}", datatype="UINT8", shape=[size])
        if g.random() < 0.3:
            t.parameters["p"].string_param = "v"
        m.raw_input_contents.append(g.integers(0, 256, size, dtype=np.uint8).tobytes())
    if g.random() < 0.5:
        m.outputs.add(name="out").parameters["classification"].int64_param = 3
    return m


def _check_same(data: bytes) -> None:
    """parse_infer_request(data) says what protobuf says of data."""
    try:
        full = pb.ModelInferRequest.FromString(data)
    except Exception:  # noqa: BLE001 - protobuf refuses: so must we
        full = None
    parsed = parse_infer_request(data)
    if full is None:
        assert parsed.message is None and "not a valid inference.ModelInferRequest" in parsed.error
        return
    assert parsed.message is not None, parsed.error
    assert [bytes(r) for r in parsed.raw] == list(full.raw_input_contents)
    full.ClearField("raw_input_contents")
    parsed.message.ClearField("raw_input_contents")
    assert parsed.message == full


@pytest.mark.parametrize("seed", range(20))
def test_split_equals_protobufs_parse(seed):
    g = np.random.default_rng(seed + int(rng().integers(1 << 30)))
    sizes = [int(s) for s in g.choice(SIZES, size=int(g.integers(0, 4)))]
    data = _message(g, sizes).SerializeToString()
    _check_same(data)
    others, raw = split_raw_contents(data)
    assert [len(r) for r in raw] == sizes
    assert all(r.obj is data for r in raw)  # views of the received bytes: no copy
    assert len(others) < 200 + 20 * len(sizes)  # the tensors are not in it


def test_fields_in_any_order():
    # protobuf merges concatenated messages: raw contents before the inputs, between them, twice a name
    g = rng()
    a, b = _message(g, [16, 128]), _message(g, [300_000])
    raw_first = pb.ModelInferRequest(raw_input_contents=[b"x" * 5]).SerializeToString()
    for data in (raw_first + a.SerializeToString(), a.SerializeToString() + b.SerializeToString(),
                 a.SerializeToString() + raw_first + b.SerializeToString()):
        _check_same(data)


def test_truncated_and_garbage_messages():
    data = _message(rng(), [16, 300, 128]).SerializeToString()
    for cut in sorted({*range(0, 40), *rng().integers(0, len(data), 40).tolist(), len(data) - 1}):
        _check_same(data[:cut])
    for garbage in (b"\xff", b"\x3a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x3b\x00", b"\x0b"):
        _check_same(garbage)


def test_response_encoder_writes_what_protobuf_writes():
    g = rng()
    encoder = ResponseEncoder()
    for _ in range(60):  # few models and shapes, as a server sees: most answers reuse kept parts
        model, version = f"m{g.integers(3)}", str(g.integers(1, 3)) if g.random() < 0.7 else ""
        # ids past one length byte too, and ids of non-ASCII characters (their UTF-8 bytes counted, not characters)
        request_id = "" if g.random() < 0.5 else str(g.choice(["r", "é", "✓"])) * int(g.integers(1, 200))
        outputs = []
        for k in range(int(g.integers(0, 4))):
            shape = tuple(int(d) for d in g.integers(0, 3, int(g.integers(0, 4))))
            data = g.integers(0, 256, int(g.choice(SIZES[:6])), dtype=np.uint8).tobytes()
            outputs.append((f"out{k}", str(g.choice(["FP32", "INT64", "BYTES"])), shape, data))
        expected = pb.ModelInferResponse(model_name=model, model_version=version, id=request_id,
                                         raw_output_contents=[o[3] for o in outputs])
        for name, datatype, shape, _ in outputs:
            expected.outputs.add(name=name, datatype=datatype, shape=shape)
        assert encoder.encode(model, version, request_id, outputs) == expected.SerializeToString()


def test_large_answers_are_parts_viewing_the_arrays():
    """Outputs adding up to PARTS_BYTES or more: the encoder's Parts, joined, are protobuf's bytes; each large
    tensor's piece is a view of its array (datatypes.raw_view), a small or non-contiguous one a copy."""
    from kiln.serve import datatypes
    from kiln.serve.grpc_wire import PARTS_BYTES, Parts

    g = rng()
    big = g.standard_normal((128, 768)).astype(np.float32)  # BERT-base's hidden state of one request
    small = g.standard_normal((1, 4)).astype(np.float16)
    strided = g.standard_normal((64, 64)).astype(np.float32)[:, ::2]
    outputs = [(name, dt, a.shape, datatypes.raw_view(a))
               for name, dt, a in (("h", "FP32", big), ("s", "FP16", small), ("t", "FP32", strided))]
    answer = ResponseEncoder().encode("bert", "1", "r-7", outputs)
    assert type(answer) is Parts and answer.size == sum(map(len, answer)) >= PARTS_BYTES
    expected = pb.ModelInferResponse(model_name="bert", model_version="1", id="r-7",
                                     raw_output_contents=[big.tobytes(), small.tobytes(), strided.tobytes()])
    for name, datatype, shape, _ in outputs:
        expected.outputs.add(name=name, datatype=datatype, shape=shape)
    assert b"".join(answer) == expected.SerializeToString()
    assert np.shares_memory(np.frombuffer(outputs[0][3], np.uint8), big)
    assert type(outputs[1][3]) is bytes and type(outputs[2][3]) is bytes
    small_answer = ResponseEncoder().encode("bert", "1", "", outputs[1:2])
    assert type(small_answer) is bytes


def test_answers_in_parts_over_either_transport(grpc_server, monkeypatch):
    """With PARTS_BYTES and VIEW_BYTES lowered so the mlp's answers go as Parts (kiln's transport: framed from the
    views; grpcio's: joined by serialize_response), tritonclient gets each request's own rows."""
    from kiln.serve import datatypes, grpc_wire

    monkeypatch.setattr(grpc_wire, "PARTS_BYTES", 64)
    monkeypatch.setattr(datatypes, "VIEW_BYTES", 16)
    _infer_mlp_rows(grpc_server)


def _infer_mlp_rows(grpc_server) -> None:
    """tritonclient.grpc sends the mlp 1, 3 and 16 rows; each answer is its own request's (z = 2x, y of 4 columns)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_server.ports.grpc}")
    try:
        for rows in (1, 3, 16):
            x = rng().standard_normal((rows, 8)).astype(np.float32)
            given = grpcclient.InferInput("x", list(x.shape), "FP32")
            given.set_data_from_numpy(x)
            answer = client.infer("mlp", [given])
            np.testing.assert_array_equal(answer.as_numpy("z"), 2 * x)
            assert answer.as_numpy("y").shape == (rows, 4)
    finally:
        client.close()


def test_arrays_are_views_of_the_request(grpc_server):
    """Over gRPC: the answer is right for tensors of every length class (the views decode as the bytes)."""
    _infer_mlp_rows(grpc_server)


def test_malformed_message_is_invalid_argument(grpc_server):
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{grpc_server.ports.grpc}") as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        with pytest.raises(grpc.RpcError) as e:
            call(b"\x3a\xff\xff\xff\x0f", timeout=30)  # raw_input_contents of 4 GB that is not there
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid inference.ModelInferRequest" in e.value.details()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int64", "bool"])
def test_raw_view_is_to_bytes_without_the_copy(dtype):
    """datatypes.raw_view: the bytes to_bytes gives, for every fixed-size type; a large C-contiguous array's own
    memory (a view), small, strided and BYTES ones copied (to_bytes)."""
    import ml_dtypes

    from kiln.serve import datatypes

    numpy_type = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    g = rng()
    large = (g.standard_normal((64, 128)) * 100).astype(numpy_type)
    view = datatypes.raw_view(large)
    assert type(view) is memoryview and bytes(view) == datatypes.to_bytes(large) and len(view) == large.nbytes
    assert np.shares_memory(np.frombuffer(view, np.uint8), large)
    rows = large[8:40]  # the batcher's split: a request's rows of a batch's output
    assert np.shares_memory(np.frombuffer(datatypes.raw_view(rows), np.uint8), large)
    assert bytes(datatypes.raw_view(rows)) == rows.tobytes()
    for copied in (large[:1, :4], large[:, ::2], np.array([b"ab", b"c"], dtype=object)):
        assert type(datatypes.raw_view(copied)) is bytes and datatypes.raw_view(copied) == datatypes.to_bytes(copied)


# ---- QuickLayouts: small requests of a layout seen before skip protobuf's parse ----

QUICK_TYPES = [("FP32", np.float32), ("FP16", np.float16), ("INT64", np.int64), ("UINT8", np.uint8),
               ("BOOL", np.bool_), ("INT8", np.int8)]


def _quick_message(g: np.random.Generator, described: list, request_id: str = "", model: str = "m",
                   version: str = "") -> tuple[pb.ModelInferRequest, list[np.ndarray]]:
    """A ModelInferRequest of `described` ((name, datatype, numpy dtype, shape) per input) with fresh random tensors."""
    m = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    arrays = []
    for name, datatype, dtype, shape in described:
        m.inputs.add(name=name, datatype=datatype, shape=shape)
        a = (g.standard_normal(shape) * 100).astype(dtype)
        arrays.append(a)
        m.raw_input_contents.append(a.tobytes())
    return m, arrays


def _decoded(data: bytes):
    """What ModelInfer decodes `data` to: _decode_layout's request where parse_infer_request found a layout, else
    _decode_quickly's of protobuf's message."""
    from kiln.serve.grpc_server import _decode_layout, _decode_quickly

    wire = parse_infer_request(data)
    if wire.layout is not None:
        return True, _decode_layout(wire.layout, wire.data)
    return False, _decode_quickly(wire.message, wire.raw)


def _expected(data: bytes):
    """The oracle: protobuf's own parse of the whole message, then _decode_quickly of it."""
    from kiln.serve.grpc_server import _decode_quickly

    full = pb.ModelInferRequest.FromString(data)
    return _decode_quickly(full, list(full.raw_input_contents))


def _same_request(got, expected, by_layout: bool = False) -> None:
    """`got` decodes as protobuf's parse does; by a layout (`by_layout`) its tensors are writable arrays of its own
    (over a copy of the message: the batcher hands them to the engine uncopied), else read-only views of the
    message's bytes (the batcher copies those)."""
    assert (got.model, got.version, got.id, got.outputs) == (expected.model, expected.version, expected.id, None)
    assert list(got.inputs) == list(expected.inputs)
    for name, array in expected.inputs.items():
        mine = got.inputs[name]
        assert mine.dtype == array.dtype and mine.shape == array.shape and mine.flags.writeable == by_layout
        np.testing.assert_array_equal(mine, array)


def test_quick_layouts_give_protobufs_answer_for_every_request(monkeypatch):
    """Requests of a few layouts (1-3 tensors of several dtypes and shapes, ids and versions), each with fresh
    tensors, sent over and over and mixed: the first of a layout is parsed by protobuf and learned, the rest match
    it and are decoded from the layout; every request's decoded tensors are its own bytes (protobuf's parse of that
    request, the oracle), never an earlier request's of the same layout."""
    import zlib

    from kiln.serve import grpc_wire

    monkeypatch.setattr(grpc_wire, "QUICK_LAYOUTS", grpc_wire.QuickLayouts())
    g = np.random.default_rng(zlib.crc32(b"quick-layouts"))
    layouts = []
    for k in range(6):
        described = [(f"in{j}", *QUICK_TYPES[int(g.integers(len(QUICK_TYPES)))],
                      [int(d) for d in g.integers(1, 5, int(g.integers(1, 4)))]) for j in range(1 + k % 3)]
        layouts.append((described, "" if k % 2 else f"req-{k}", f"model{k % 4}", "" if k < 3 else str(k)))
    hits = 0
    for step in range(120):
        described, request_id, model, version = layouts[int(g.integers(len(layouts)))]
        message, arrays = _quick_message(g, described, request_id, model, version)
        data = message.SerializeToString()
        hit, got = _decoded(data)
        hits += hit
        _same_request(got, _expected(data), by_layout=hit)
        for (name, *_), array in zip(described, arrays):
            np.testing.assert_array_equal(got.inputs[name], array)
        if hit:  # the engine may write them: never into the received bytes
            for tensor in got.inputs.values():
                assert not np.shares_memory(tensor, np.frombuffer(data, np.uint8))
    assert hits >= 120 - len(layouts)  # all but each layout's first


def test_quick_layouts_learn_only_what_decode_quickly_covers(monkeypatch):
    """Messages _decode_quickly refuses (parameters, requested outputs, BYTES, a tensor among the other fields,
    a size that disagrees with the shape, an empty tensor) are never learned: the next of the same bytes is parsed
    by protobuf again. Same-size messages that differ past the tensors' keys (another id, model, shape of the same
    byte count) do not match a learned layout."""
    import zlib

    from kiln.serve import grpc_wire

    quick = grpc_wire.QuickLayouts()
    monkeypatch.setattr(grpc_wire, "QUICK_LAYOUTS", quick)
    g = np.random.default_rng(zlib.crc32(b"quick-layouts-refused"))
    x = [("x", "FP32", np.float32, [2, 3])]

    def twice(data: bytes) -> bool:
        parse_infer_request(data)
        return parse_infer_request(data).layout is not None

    m, _ = _quick_message(g, x)
    m.parameters["timeout"].int64_param = 5
    assert not twice(m.SerializeToString())
    m, _ = _quick_message(g, x)
    m.outputs.add(name="y")
    assert not twice(m.SerializeToString())
    m = pb.ModelInferRequest(model_name="m", raw_input_contents=[b"\x01\x00\x00\x00a"])
    m.inputs.add(name="s", datatype="BYTES", shape=[1])
    assert not twice(m.SerializeToString())
    m, _ = _quick_message(g, x)
    raw_first = pb.ModelInferRequest(raw_input_contents=[bytes(24)]).SerializeToString()
    m.ClearField("raw_input_contents")
    assert not twice(raw_first + m.SerializeToString())  # the tensor before the other fields
    m, _ = _quick_message(g, x)
    m.raw_input_contents[0] = bytes(20)  # 20 bytes for 6 FP32s
    assert not twice(m.SerializeToString())
    m = pb.ModelInferRequest(model_name="m", raw_input_contents=[b""])
    m.inputs.add(name="e", datatype="FP32", shape=[0, 3])
    assert not twice(m.SerializeToString())
    assert quick.count == 0
    # learned, then same-size messages that differ outside the tensors' bytes
    m, _ = _quick_message(g, x, "id-1", "ma")
    assert twice(m.SerializeToString()) and quick.count == 1
    for other_id, model, shape in (("id-2", "ma", [2, 3]), ("id-1", "mb", [2, 3]), ("id-1", "ma", [3, 2])):
        m, _ = _quick_message(g, [("x", "FP32", np.float32, shape)], other_id, model)
        data = m.SerializeToString()
        wire = parse_infer_request(data)
        assert wire.layout is None  # learned now, matched from the next one on
        hit, got = _decoded(data)
        assert hit
        _same_request(got, _expected(data), by_layout=True)


def test_quick_layouts_rest_when_nothing_repeats(monkeypatch):
    """A client whose every request differs (a fresh id each) fills no table for long: after MISSES_BEFORE_REST
    layouts learned without a match, REST eligible messages go unlearned; a match resets the count."""
    from kiln.serve import grpc_wire

    quick = grpc_wire.QuickLayouts()
    monkeypatch.setattr(grpc_wire, "QUICK_LAYOUTS", quick)
    g = np.random.default_rng(7)
    x = [("x", "FP32", np.float32, [1, 4])]
    for k in range(quick.MISSES_BEFORE_REST):
        assert parse_infer_request(_quick_message(g, x, f"{k:08d}")[0].SerializeToString()).layout is None
    assert quick.resting == quick.REST and quick.count <= quick.CAPACITY
    parse_infer_request(_quick_message(g, x, "again")[0].SerializeToString())
    assert quick.resting == quick.REST - 1


def test_quick_layouts_keep_several_of_one_size(monkeypatch):
    """Requests of one size that differ in their ids only (kiln perf's wire client cycles 8 such) all match once
    learned; each still decodes to its own tensors."""
    import zlib

    from kiln.serve import grpc_wire

    quick = grpc_wire.QuickLayouts()
    monkeypatch.setattr(grpc_wire, "QUICK_LAYOUTS", quick)
    g = np.random.default_rng(zlib.crc32(b"quick-layouts-one-size"))
    x = [("x", "FP32", np.float32, [1, 4])]
    for turn in range(3):
        for k in range(8):
            message, (array,) = _quick_message(g, x, str(k))
            data = message.SerializeToString()
            hit, got = _decoded(data)
            assert hit == (turn > 0) and got.id == str(k)
            np.testing.assert_array_equal(got.inputs["x"], array)
    assert quick.count == 8
