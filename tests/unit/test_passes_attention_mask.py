"""drop_empty_attention_mask: structural (fired once, mask gone) and numerical (same outputs)."""

import numpy as np
import onnx
from onnx import TensorProto, helper

import kiln
from kiln.frontend import onnx as onnx_frontend
from kiln.passes import PassOptions, PassReport, optimize


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
    optimized = optimize(onnx_frontend.load(proto), PassOptions(), report)
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
    optimized = optimize(onnx_frontend.load(_model(mask)), PassOptions(), report)
    assert "drop_empty_attention_mask" not in report.fired
    assert _attention_inputs(optimized)[0][3] == "m"
    assert any("masks some positions" in line for line in report.refused)


def _materialised_mask_model(keep: np.ndarray, batch: int = 2, seq: int = 5) -> onnx.ModelProto:
    """The dynamo exporter's BERT mask: Where(Expand(keep, [B, 1, S, T]), 0, -big), computed at run time."""
    q = helper.make_tensor_value_info("q", TensorProto.FLOAT, [batch, 3, seq, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    inits = [
        helper.make_tensor("keep", TensorProto.BOOL, list(keep.shape), keep.ravel().tolist()),
        helper.make_tensor("shape", TensorProto.INT64, [4], [batch, 1, seq, seq]),
        helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
        helper.make_tensor("big", TensorProto.FLOAT, [], [-3.0e38]),
    ]
    nodes = [
        helper.make_node("Expand", ["keep", "shape"], ["keep_full"], name="expand"),
        helper.make_node("Where", ["keep_full", "zero", "big"], ["mask"], name="where"),
        helper.make_node("Attention", ["q", "q", "q", "mask"], ["y"], domain="kiln", name="attn", scale=0.35),
    ]
    graph = helper.make_graph(nodes, "g", [q], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("kiln", 1)])


def test_a_materialised_all_keep_mask_is_dropped(monkeypatch):
    from kiln.passes import fold

    monkeypatch.setattr(fold, "SIZE_LIMIT", 4)  # as if the mask were too large to fold (BERT b64 s384: 9.4M)
    proto = _materialised_mask_model(np.ones((1, 1, 1, 5), bool))
    report = PassReport()
    optimized = optimize(onnx_frontend.load(proto), PassOptions(), report)
    assert report.fired.get("drop_empty_attention_mask") == 1
    assert _attention_inputs(optimized)[0][3:] in ([], [""])
    assert not [n for n in optimized.graph if n.op_type in ("Expand", "Where")]  # the mask subgraph is dead
    x = np.random.default_rng(1).standard_normal((2, 3, 5, 8)).astype(np.float32)
    np.testing.assert_allclose(kiln.build(proto).run({"q": x})["y"], kiln.build(proto, opt_level=0).run({"q": x})["y"],
                               rtol=1e-6, atol=1e-6)


def test_a_materialised_padding_mask_is_replaced_by_its_broadcast_form(monkeypatch):
    from kiln.passes import fold

    monkeypatch.setattr(fold, "SIZE_LIMIT", 4)
    keep = np.ones((1, 1, 1, 5), bool)
    keep[..., 3:] = False  # the last two keys are padding
    proto = _materialised_mask_model(keep)
    report = PassReport()
    optimized = optimize(onnx_frontend.load(proto), PassOptions(), report)
    assert report.fired.get("attention_mask_broadcast") == 1
    assert "drop_empty_attention_mask" not in report.fired
    mask_name = _attention_inputs(optimized)[0][3]
    mask = optimized.graph.initializers[mask_name].const_value.numpy()
    assert mask.shape == (1, 1, 1, 5) and mask.dtype == np.float32
    np.testing.assert_array_equal(mask[..., :3], 0.0)
    assert (mask[..., 3:] < -1e38).all()
    assert not [n for n in optimized.graph if n.op_type in ("Expand", "Where")]
    x = np.random.default_rng(2).standard_normal((2, 3, 5, 8)).astype(np.float32)
    np.testing.assert_allclose(kiln.build(proto).run({"q": x})["y"], kiln.build(proto, opt_level=0).run({"q": x})["y"],
                               rtol=1e-5, atol=1e-6)


def test_a_mask_computed_from_an_input_is_kept():
    from kiln.passes.fusion.attention_mask import broadcast_constant

    proto = _materialised_mask_model(np.ones((1, 1, 1, 5), bool))
    proto.graph.input.append(helper.make_tensor_value_info("keep", TensorProto.BOOL, [1, 1, 1, 5]))
    graph = onnx_frontend.load(proto).graph
    attention = next(n for n in graph if n.op_type == "Attention")
    assert broadcast_constant(attention.inputs[3]) is None  # `keep` is an input now: its values are not known
