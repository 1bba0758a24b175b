"""drop_empty_attention_mask: structural (fired once, mask gone) and numerical (same outputs)."""

import numpy as np
import onnx
from onnx import TensorProto, helper

import kiln
from kiln.engine.config import BuildConfig
from kiln.frontend import onnx as onnx_frontend
from kiln.passes import PassReport, optimize


def _model(mask: np.ndarray) -> onnx.ModelProto:
    q = helper.make_tensor_value_info("q", TensorProto.FLOAT, [2, 3, 5, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    m = helper.make_tensor("m", TensorProto.FLOAT, list(mask.shape), mask.ravel())
    node = helper.make_node("Attention", ["q", "q", "q", "m"], ["y"], domain="kiln", name="attn",
                            scale=0.35, nan_to_zero=1)
    graph = helper.make_graph([node], "g", [q], [y], [m])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("kiln", 1)])


def _attention_inputs(model):
    return [[v.name if v is not None else "" for v in n.inputs] for n in model.graph if n.op_type == "Attention"]


def test_zero_mask_is_dropped_and_outputs_are_unchanged():
    proto = _model(np.zeros((1, 1, 5, 5), np.float32))
    report = PassReport()
    optimized = optimize(onnx_frontend.load(proto), BuildConfig(), report)
    assert report.fired.get("drop_empty_attention_mask") == 1
    assert _attention_inputs(optimized) == [["q", "q", "q"]] or _attention_inputs(optimized) == [["q", "q", "q", ""]]
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 8)).astype(np.float32)
    before = kiln.build(proto, opt_level=0).run({"q": x})["y"]
    after = kiln.build(proto).run({"q": x})["y"]
    np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)


def test_a_mask_that_masks_something_is_kept():
    mask = np.zeros((1, 1, 5, 5), np.float32)
    mask[..., 0] = -1e9
    report = PassReport()
    optimized = optimize(onnx_frontend.load(_model(mask)), BuildConfig(), report)
    assert "drop_empty_attention_mask" not in report.fired
    assert _attention_inputs(optimized)[0][3] == "m"
    assert any("masks some positions" in line for line in report.refused)
