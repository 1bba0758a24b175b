"""ONNX files read with their large weights left in the file until each is read into an array of its own
(kiln/frontend/onnx_file.py): the same values as onnx's own reader, the same engine outputs as onnxruntime, the
same errors for broken files, and the weights' bytes never parsed by protobuf."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_ir as ir

import kiln
from kiln.errors import ModelError
from kiln.frontend import onnx as onnx_frontend
from kiln.frontend import onnx_file

BIG = onnx_frontend.WEIGHT_BYTES


def _model(rng: np.random.Generator) -> onnx.ModelProto:
    """y = relu(x @ w1 + b) @ w2 + shift, with weights above and below the threshold, and a large int64 and a
    large float16 and bfloat16 initializer no node reads (they are imported all the same)."""
    w1 = rng.standard_normal((64, 512)).astype(np.float32) * 0.1  # 128 KiB: left in the file
    w2 = rng.standard_normal((512, 32)).astype(np.float32) * 0.1  # 64 KiB: left in the file (>= the threshold)
    b = rng.standard_normal(512).astype(np.float32)  # 2 KiB: parsed with the message
    shift = rng.standard_normal(32).astype(np.float32)
    ids = rng.integers(-2**40, 2**40, size=BIG // 8 + 3, dtype=np.int64)
    half = rng.standard_normal(BIG).astype(np.float16)
    brain = helper.make_tensor("brain", TensorProto.BFLOAT16, [BIG],
                               rng.standard_normal(BIG).astype(ml_dtypes.bfloat16).view(np.uint16).tobytes(), raw=True)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["m"]),
             helper.make_node("Add", ["m", "shift"], ["y"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 32])],
                              [numpy_helper.from_array(a, n) for a, n in
                               [(w1, "w1"), (w2, "w2"), (b, "b"), (shift, "shift"), (ids, "ids"), (half, "half")]]
                              + [brain])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _expected(path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def _assert_same_weights(model: ir.Model, want: dict[str, np.ndarray]) -> None:
    got = {name: value.const_value for name, value in model.graph.initializers.items()}
    assert set(got) == set(want)
    for name, tensor in got.items():
        array = np.asarray(tensor.numpy())
        assert array.dtype == want[name].dtype and array.shape == want[name].shape, name
        assert np.array_equal(array.view(np.uint8), want[name].view(np.uint8)), name  # bit for bit (NaN-safe)


def test_large_weights_are_read_from_the_file_into_arrays_of_their_own(tmp_path):
    rng = np.random.default_rng()
    path = tmp_path / "mlp.onnx"
    onnx.save(_model(rng), path)
    skeleton = onnx_file.skeleton(path, BIG)
    large = {"w1", "w2", "ids", "half", "brain"}
    assert skeleton is not None and skeleton.in_file == len(large)
    want = _expected(path)
    assert skeleton.in_file_bytes == sum(want[n].nbytes for n in large)
    # what protobuf parses holds none of the large weights' bytes
    assert len(skeleton.data) < path.stat().st_size - skeleton.in_file_bytes + 1024
    model = onnx_frontend.load(path)
    _assert_same_weights(model, want)
    for name in large:
        tensor = model.graph.initializers[name].const_value
        assert type(tensor) is ir.Tensor and tensor.numpy().flags.writeable  # its own, not a view of a mapping


def test_engine_from_a_file_with_weights_in_place_matches_onnxruntime(tmp_path):
    rng = np.random.default_rng()
    path = tmp_path / "mlp.onnx"
    onnx.save(_model(rng), path)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = kiln.build(str(path)).run({"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # float32 GEMMs, K = 64 and 512


def test_external_data_is_read_once_small_tensors_into_the_message(tmp_path):
    rng = np.random.default_rng()
    model = _model(rng)
    want = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    onnx.save(model, tmp_path / "ext.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="ext.weights", size_threshold=0)  # (moves the model's tensors out, in place)
    imported = onnx_frontend.load(tmp_path / "ext.onnx")
    _assert_same_weights(imported, want)
    assert not any(isinstance(v.const_value, ir.ExternalTensor) for v in imported.graph.initializers.values())
    x = rng.standard_normal((4, 64)).astype(np.float32)
    reference = ort.InferenceSession(str(tmp_path / "ext.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(kiln.build(str(tmp_path / "ext.onnx")).run({"x": x})["y"],
                               reference.run(None, {"x": x})[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threshold", [0, BIG], ids=["small-read-by-onnx", "large-read-by-kiln"])
def test_external_data_outside_the_models_folder_is_refused(tmp_path, threshold):
    folder = tmp_path / "model"
    folder.mkdir()
    model = _model(np.random.default_rng())
    onnx.save(model, tmp_path / "outside.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="outside.weights", size_threshold=threshold)
    moved = onnx.load(str(tmp_path / "outside.onnx"), load_external_data=False)
    for t in moved.graph.initializer:
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = "../outside.weights"
    onnx.save(moved, folder / "escape.onnx")
    with pytest.raises(ModelError, match="external data cannot be loaded"):
        onnx_frontend.load(folder / "escape.onnx")


def test_a_file_cut_inside_a_weight_is_a_model_error(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(_model(np.random.default_rng()), path)
    data = path.read_bytes()
    cut = tmp_path / "cut.onnx"
    for size in (len(data) - 1, len(data) // 2, len(data) // 7, 40):
        cut.write_bytes(data[:size])
        assert onnx_file.skeleton(cut, BIG) is None  # the walk gives up: the file is parsed whole, as before
        with pytest.raises(ModelError, match="cut.onnx"):
            onnx_frontend.load(cut)
