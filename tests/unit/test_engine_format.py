"""The .kiln file: weights of every dtype round-trip bit for bit; the header says what a user needs."""

from __future__ import annotations

import os
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.plan import file as engine_file
from kiln.plan.spec import FORMAT_VERSION, EnginePlan
from kiln.plan.spec import ProgramSpec


def _torch_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    floats = torch.randn(3, 5, generator=gen)
    floats[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    weights = {
        "float32": floats,
        "float64": torch.randn(4, generator=gen, dtype=torch.float64),
        "float16": floats.to(torch.float16),
        "bfloat16": floats.to(torch.bfloat16),
        "int8": torch.tensor([-128, -1, 0, 1, 127], dtype=torch.int8),
        "int16": torch.tensor([-(2**15), 0, 2**15 - 1], dtype=torch.int16),
        "int32": torch.tensor([-(2**31), 0, 2**31 - 1], dtype=torch.int32),
        "int64": torch.tensor([-(2**63), -5, 2**63 - 1], dtype=torch.int64),
        "uint8": torch.tensor([0, 1, 255], dtype=torch.uint8),
        "bool": torch.rand(2, 3, generator=gen) < 0.5,
        "complex64": torch.randn(3, generator=gen, dtype=torch.complex64),
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 3),
        "non_contiguous": torch.randn(4, 6, generator=gen).t(),
        "layer.0/weight:0#2": torch.randn(2, generator=gen),  # names as exporters write them
    }
    for bits in (16, 32, 64):
        dtype = getattr(torch, f"uint{bits}", None)
        if dtype is not None:
            weights[f"uint{bits}"] = torch.tensor([0, 1, 2**bits - 1], dtype=dtype)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
        dtype = getattr(torch, name, None)
        if dtype is not None:
            weights[name] = (floats[1:] * 4).to(dtype)
    return weights


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()) if t.numel() else b""


def _round_trip(weights: dict, tmp_path: Path) -> EnginePlan:
    plan = EnginePlan(header={"format_version": FORMAT_VERSION, "inputs": [], "outputs": []},
                      program=ProgramSpec(inputs=[], outputs=[], steps=[]), weights=weights)
    path = tmp_path / "weights.kiln"
    engine_file.save(plan, path)
    return engine_file.load(path)


def test_torch_weights_round_trip_bit_exact(tmp_path):
    weights = _torch_weights()
    loaded = _round_trip(weights, tmp_path).weights
    assert set(loaded) == set(weights)
    for name, want in weights.items():
        got = loaded[name]
        assert isinstance(got, torch.Tensor), name
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        assert _bits(got) == _bits(want), name  # bit for bit: NaN payloads, -0.0, extremes


def test_saving_writes_each_contiguous_weight_from_its_own_memory():
    """The weights section is written part by part, each contiguous weight's part a view of its own bytes: a save
    copies only what is not contiguous. Before, every weight was copied to bytes and the copies joined twice (256 MiB
    of weights saved at +770 MiB peak RSS; now +2)."""
    weights = _torch_weights()
    weights["numpy"] = np.arange(12, dtype=np.int32).reshape(3, 4)
    parts, _ = engine_file._pack_weights(weights)
    addresses = {w.ctypes.data if isinstance(w, np.ndarray) else w.data_ptr() for w in weights.values()}
    copied = sum(part.nbytes for part in parts[1:] if part.ctypes.data not in addresses)  # parts[0]: length, JSON
    assert copied == weights["non_contiguous"].nbytes  # the transposed weight alone (made contiguous to be written)
    assert sum(p.nbytes for p in parts[1:]) == sum(w.nbytes for w in weights.values())


def test_numpy_only_weights_round_trip(tmp_path):
    """Strings and sub-byte types stay numpy arrays (torch cannot hold them)."""
    rng = np.random.default_rng()
    weights = {
        "strings": np.array([["héllo", ""], ["kiln", "a,b\nc"]], dtype=object),
        "one_string": np.array("scalar", dtype=object),
        "int4": rng.integers(-8, 8, size=(3, 4)).astype(ml_dtypes.int4),
        "uint4": rng.integers(0, 16, size=(5,)).astype(ml_dtypes.uint4),
        "float4": rng.standard_normal(6).astype(ml_dtypes.float4_e2m1fn),
    }
    loaded = _round_trip(weights, tmp_path).weights
    for name, want in weights.items():
        got = loaded[name]
        assert isinstance(got, np.ndarray), name
        assert got.dtype == want.dtype and got.shape == want.shape, name
        if want.dtype == object:
            assert got.tolist() == want.tolist(), name
        else:
            assert got.view(np.uint8).tobytes() == want.view(np.uint8).tobytes(), name


def _constants_model() -> onnx.ModelProto:
    """Initializers of assorted types passed straight to the outputs through Identity."""
    rng = np.random.default_rng()
    constants = {
        "f32": rng.standard_normal((2, 3)).astype(np.float32),
        "f16": rng.standard_normal(4).astype(np.float16),
        "i64": rng.integers(-(2**40), 2**40, size=5),
        "i8": rng.integers(-128, 128, size=(2, 2)).astype(np.int8),
        "u8": rng.integers(0, 256, size=3).astype(np.uint8),
        "b": rng.random(4) < 0.5,
        "s": np.array(["kiln", "engine", "ünïcode"], dtype=object),
    }
    inits = [numpy_helper.from_array(v, f"c_{k}") for k, v in constants.items()]
    bf16 = rng.standard_normal(3).astype(np.float32)
    inits.append(helper.make_tensor("c_bf16", TensorProto.BFLOAT16, [3],
                                    bf16.astype(ml_dtypes.bfloat16).view(np.uint16).tolist()))
    names = [*constants, "bf16"]
    nodes = [helper.make_node("Identity", [f"c_{k}"], [f"out_{k}"], name=f"id_{k}") for k in names]
    nodes.append(helper.make_node("Add", ["x", "x"], ["out_x"], name="double"))
    outputs = [helper.make_tensor_value_info(f"out_{k}", t.data_type, list(t.dims)) for k, t in zip(names, inits)]
    outputs.append(helper.make_tensor_value_info("out_x", TensorProto.FLOAT, [2]))
    graph = helper.make_graph(nodes, "constants", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("opt_level", [0, 2])
def test_built_engine_constants_survive_save_and_load(tmp_path, opt_level):
    model = _constants_model()
    expected = {f"out_{t.name[2:]}": numpy_helper.to_array(t) for t in model.graph.initializer}
    path = tmp_path / "constants.kiln"
    kiln.build(model, opt_level=opt_level).save(path)
    outputs = kiln.load(path).run({"x": np.array([1.5, -2.0], np.float32)})
    np.testing.assert_array_equal(outputs["out_x"], [3.0, -4.0])
    for name, want in expected.items():
        got = outputs[name]
        if want.dtype == object:
            assert [str(s) for s in got.ravel()] == [s.decode() if isinstance(s, bytes) else s for s in want.ravel()]
            continue
        if name == "out_bf16":  # onnx.numpy_helper gives bfloat16 as ml_dtypes.bfloat16
            want = np.asarray(want).astype(ml_dtypes.bfloat16)
        assert got.dtype == want.dtype, name
        assert got.tobytes() == want.tobytes(), name


def test_header_fields(tmp_path):
    model = _constants_model()
    onnx.save(model, tmp_path / "constants.onnx")
    path = tmp_path / "constants.kiln"
    kiln.build(str(tmp_path / "constants.onnx")).save(path)
    header = kiln.load(path).plan.header
    assert header["format_version"] == FORMAT_VERSION
    assert header["kiln_version"] == kiln.__version__
    assert header["torch_version"] == torch.__version__
    assert header["device"]["type"] == "cpu"
    assert header["build_config"]["opt_level"] == 2
    assert header["source"] == {"path": str((tmp_path / "constants.onnx").resolve()), "name": "constants.onnx"}
    assert [b["name"] for b in header["inputs"]] == ["x"]
    assert header["inputs"][0] == {"name": "x", "dtype": "float", "shape": [2], "kind": "tensor"}
    assert {b["name"] for b in header["outputs"]} >= {"out_x", "out_s", "out_bf16"}
    assert {"peak_bytes", "naive_bytes"} <= set(header["memory"])
    assert header["weights_bytes"] > 0
    assert "created" in header and "value_types" in header


def test_failed_save_leaves_no_file(tmp_path, monkeypatch):
    plan = EnginePlan(header={"inputs": [], "outputs": []}, program=ProgramSpec([], [], []),
                      weights={"w": torch.ones(3)})
    target = tmp_path / "engine.kiln"

    def fail(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(engine_file.os, "replace", fail)
    with pytest.raises(OSError):
        engine_file.save(plan, target)
    assert list(tmp_path.iterdir()) == []
