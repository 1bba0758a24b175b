"""Bad models, bad engine files and bad inputs: each gives ONE clear kiln error that names the thing."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.cli import main
from kiln.plan import file as engine_file
from kiln.plan.spec import FORMAT_VERSION
from kiln.errors import BindingError, EngineFormatError, KilnError, ModelError, UnsupportedModelError


def _graph_model(nodes, inputs=("x",), outputs=("y",), initializers=(), opsets=(("", 17),)) -> onnx.ModelProto:
    graph = helper.make_graph(
        list(nodes), "bad",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in outputs],
        list(initializers),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])


def _good_model() -> onnx.ModelProto:
    weight = numpy_helper.from_array(np.random.default_rng().standard_normal((2, 3)).astype(np.float32), "bias")
    return _graph_model([helper.make_node("Add", ["x", "bias"], ["s"], name="add_bias"),
                         helper.make_node("Relu", ["s"], ["y"], name="relu")], initializers=[weight])


@pytest.fixture
def good_onnx(tmp_path: Path) -> Path:
    path = tmp_path / "good.onnx"
    onnx.save(_good_model(), path)
    return path


@pytest.fixture
def good_engine(good_onnx: Path, tmp_path: Path) -> Path:
    path = tmp_path / "good.kiln"
    kiln.build(str(good_onnx)).save(path)
    return path


def _one_error(fn, kind: type[KilnError], *fragments: str) -> KilnError:
    with pytest.raises(kind) as info:
        fn()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return info.value


# ---------------------------------------------------------------------------- bad models


def test_random_bytes(tmp_path):
    path = tmp_path / "noise.onnx"
    path.write_bytes(b"\x0a\xff" + os.urandom(4096))
    _one_error(lambda: kiln.build(str(path)), ModelError, "noise.onnx", "not a readable ONNX model")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    _one_error(lambda: kiln.build(str(path)), ModelError, "empty.onnx", "empty")


def test_missing_file(tmp_path):
    _one_error(lambda: kiln.build(str(tmp_path / "nope.onnx")), ModelError, "nope.onnx", "no such")


def test_every_truncation_is_a_model_error(good_onnx, tmp_path):
    data = good_onnx.read_bytes()
    path = tmp_path / "cut.onnx"
    for size in range(1, len(data)):
        path.write_bytes(data[:size])
        with pytest.raises(ModelError) as info:
            kiln.build(str(path))
        assert "cut.onnx" in str(info.value), f"cut at {size} of {len(data)} bytes: {info.value}"


def test_missing_external_data(tmp_path):
    folder = tmp_path / "external"
    folder.mkdir()
    onnx.save(_good_model(), folder / "model.onnx", save_as_external_data=True,
              all_tensors_to_one_file=True, location="model.weights", size_threshold=0)
    (folder / "model.weights").unlink()
    _one_error(lambda: kiln.build(str(folder / "model.onnx")), ModelError, "model.weights", "'bias'", "missing")


def test_external_data_present_loads(tmp_path):
    onnx.save(_good_model(), tmp_path / "model.onnx", save_as_external_data=True,
              all_tensors_to_one_file=True, location="model.weights", size_threshold=0)
    engine = kiln.build(str(tmp_path / "model.onnx"))
    x = np.random.default_rng().standard_normal((2, 3)).astype(np.float32)
    assert engine.run({"x": x})["y"].shape == (2, 3)


def test_cycle_names_the_nodes():
    model = _graph_model([
        helper.make_node("Relu", ["b"], ["a"], name="first_of_cycle"),
        helper.make_node("Relu", ["a"], ["b"], name="second_of_cycle"),
        helper.make_node("Add", ["a", "x"], ["y"], name="reads_cycle"),
    ])
    _one_error(lambda: kiln.build(model), ModelError, "cycle", "first_of_cycle", "second_of_cycle")


def test_undefined_input_names_node_and_value():
    model = _graph_model([helper.make_node("Add", ["x", "ghost"], ["y"], name="adds_a_ghost")])
    _one_error(lambda: kiln.build(model), ModelError, "adds_a_ghost", "'ghost'", "not defined")


def test_unsupported_ops_all_listed_by_name():
    model = _graph_model(
        [
            helper.make_node("NoSuchOpAnywhere", ["x"], ["a"], name="first_unknown"),
            helper.make_node("Relu", ["a"], ["b"], name="fine"),
            helper.make_node("Frobnicate", ["b"], ["y"], name="second_unknown", domain="com.example"),
        ],
        opsets=(("", 17), ("com.example", 1)),
    )
    error = _one_error(lambda: kiln.build(model), UnsupportedModelError, "first_unknown", "NoSuchOpAnywhere",
                       "second_unknown", "com.example::Frobnicate", "2 node(s)")
    assert len(error.problems) == 2 and "'fine'" not in str(error)


def test_unknown_attribute_is_unsupported():
    model = _graph_model([helper.make_node("Relu", ["x"], ["y"], name="odd_relu", flavour=3)])
    _one_error(lambda: kiln.build(model), UnsupportedModelError, "odd_relu", "flavour")


@pytest.mark.parametrize("case", ["noise", "empty", "unsupported", "cycle"])
def test_cli_build_failure_leaves_no_file(tmp_path, capsys, case):
    source = tmp_path / f"{case}.onnx"
    if case == "noise":
        source.write_bytes(b"\x0a\xff" + os.urandom(512))
    elif case == "empty":
        source.write_bytes(b"")
    elif case == "unsupported":
        onnx.save(_graph_model([helper.make_node("NoSuchOp", ["x"], ["y"], name="mystery")]), source)
    else:
        onnx.save(_graph_model([helper.make_node("Relu", ["y"], ["y"], name="self_loop")]), source)
    out = tmp_path / "engines" / f"{case}.kiln"
    assert main(["build", str(source), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kiln build: error:") and "Traceback" not in err
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [source.name]


# ---------------------------------------------------------------------------- bad engine files


def _write_raw_engine(path: Path, doc: bytes, blob: bytes = b"", version: int = FORMAT_VERSION) -> None:
    """An engine file laid out by hand, with a valid checksum: only the content is wrong."""
    prefix = engine_file._PREFIX.pack(engine_file.MAGIC, version, 0, len(doc))
    pad = b"\0" * (-(len(prefix) + len(doc)) % engine_file._ALIGN)
    body = prefix + doc + pad + blob
    path.write_bytes(body + hashlib.blake2b(body, digest_size=engine_file._DIGEST_SIZE).digest())


def test_engine_of_another_format_version(good_engine, tmp_path, monkeypatch):
    plan = engine_file.load(good_engine)
    path = tmp_path / "future.kiln"
    monkeypatch.setattr(engine_file, "FORMAT_VERSION", FORMAT_VERSION + 1)
    engine_file.save(plan, path)  # a whole, well-formed file from a future kiln
    monkeypatch.undo()
    _one_error(lambda: kiln.load(path), EngineFormatError, "future.kiln",
               f"version {FORMAT_VERSION + 1}", f"reads version {FORMAT_VERSION}", "rebuild")


@pytest.mark.parametrize("where", [0.1, 0.5, 0.9, 0.999])
def test_engine_with_flipped_byte(good_engine, tmp_path, where):
    data = bytearray(good_engine.read_bytes())
    index = max(16, int(len(data) * where))  # past magic and version, which have their own errors
    data[index] ^= 0x5A
    path = tmp_path / "flipped.kiln"
    path.write_bytes(bytes(data))
    _one_error(lambda: kiln.load(path), EngineFormatError, "flipped.kiln")


def test_engine_truncated_anywhere(good_engine, tmp_path):
    data = good_engine.read_bytes()
    path = tmp_path / "short.kiln"
    for size in [0, 1, 8, 23, 24, 60, len(data) // 2, len(data) - 33, len(data) - 1]:
        path.write_bytes(data[:size])
        with pytest.raises(EngineFormatError) as info:
            kiln.load(path)
        assert "short.kiln" in str(info.value) and ("truncated" in str(info.value) or "corrupt" in str(info.value))


def test_not_an_engine(good_onnx, tmp_path):
    _one_error(lambda: kiln.load(good_onnx), EngineFormatError, "good.onnx", "not a kiln engine file")
    noise = tmp_path / "noise.kiln"
    noise.write_bytes(os.urandom(2048))
    _one_error(lambda: kiln.load(noise), EngineFormatError, "noise.kiln", "not a kiln engine file")
    _one_error(lambda: kiln.load(tmp_path / "absent.kiln"), EngineFormatError, "absent.kiln", "no such")
    _one_error(lambda: kiln.load(tmp_path), EngineFormatError, "no such engine file")


def test_whole_file_from_another_writer(tmp_path):
    path = tmp_path / "alien.kiln"
    _write_raw_engine(path, json.dumps({"something": "else"}).encode(), struct.pack("<Q", 2) + b"{}")
    _one_error(lambda: kiln.load(path), EngineFormatError, "alien.kiln", "rebuild")
    _write_raw_engine(path, b"\xff not json")
    _one_error(lambda: kiln.load(path), EngineFormatError, "alien.kiln", "unreadable header")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a CPU-only machine gives")
def test_engine_for_cuda_on_a_cpu_machine(good_engine, tmp_path):
    plan = engine_file.load(good_engine)
    plan.header["device"] = {"type": "cuda", "name": "NVIDIA H200", "capability": [9, 0]}
    path = tmp_path / "gpu.kiln"
    engine_file.save(plan, path)
    _one_error(lambda: kiln.load(path), EngineFormatError, "NVIDIA H200", "no CUDA device")


@pytest.mark.parametrize("verb", ["run", "inspect", "bench"])
def test_cli_bad_engine_is_one_message(tmp_path, capsys, verb):
    path = tmp_path / "noise.kiln"
    path.write_bytes(os.urandom(300))
    assert main([verb, str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kiln {verb}: error:") and "noise.kiln" in err and "Traceback" not in err


# ---------------------------------------------------------------------------- bad inputs at run


@pytest.fixture
def engine(good_engine):
    return kiln.load(good_engine)


def _x(shape=(2, 3), dtype=np.float32):
    return np.random.default_rng().standard_normal(shape).astype(dtype)


def test_wrong_input_name(engine):
    _one_error(lambda: engine.run({"X": _x()}), BindingError, "'X'", "'x'", "missing", "unknown")


def test_wrong_dtype(engine):
    _one_error(lambda: engine.run({"x": _x(dtype=np.float64)}), BindingError, "'x'", "expected dtype float",
               "given double")
    _one_error(lambda: engine.run({"x": torch.ones(2, 3, dtype=torch.int64)}), BindingError, "'x'", "float", "int64")


def test_wrong_shape(engine):
    _one_error(lambda: engine.run({"x": _x((2, 4))}), BindingError, "'x'", "[2, 3]", "[2, 4]", "axis 1")
    _one_error(lambda: engine.run({"x": _x((6,))}), BindingError, "'x'", "rank 2", "[6]")


def test_inconsistent_symbolic_dims():
    model = onnx.helper.make_model(
        helper.make_graph(
            [helper.make_node("Add", ["a", "b"], ["y"], name="add")], "sym",
            [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", 3]),
             helper.make_tensor_value_info("b", TensorProto.FLOAT, ["batch", 3])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    engine = kiln.build(model)
    _one_error(lambda: engine.run({"a": _x((2, 3)), "b": _x((5, 3))}), BindingError, "'batch'", "'a'", "'b'", "5", "2")
