"""The Q/DQ passes (kiln/passes/fusion/qdq_propagate.py, qdq_layers.py): a graph written as
onnxruntime's quantize_static writes one (uint8 activations, per-channel int8 weights, int32 biases
as DQ'd constants, a Q/DQ pair after every layer) becomes QuantizeLinear -> QConv -> MaxPool on
uint8 -> QConv -> QAdd -> Reshape on uint8 -> QGemm. Structure: the rules fire as counted and the
step list is the expected one. Numbers: kiln's engine against onnxruntime running the Q/DQ graph as
written (its optimizations off), within one step of the last quantized tensor through the classifier.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.frontend import onnx as onnx_frontend
from kiln.passes import PassOptions, PassReport, optimize

rng = np.random.default_rng(4)
U8, F = TensorProto.UINT8, TensorProto.FLOAT


def _qdq_model(activation_type: int = U8, wmax: int = 64):
    inits: dict[str, np.ndarray] = {}
    nodes = []
    zero_type = np.uint8 if activation_type == U8 else np.int8

    def pair(x: str, tag: str, scale: float, zero: int) -> str:
        inits[f"{tag}_s"], inits[f"{tag}_z"] = np.array(scale, np.float32), np.array(zero, zero_type)
        nodes.extend([helper.make_node("QuantizeLinear", [x, f"{tag}_s", f"{tag}_z"], [f"{tag}_q"], name=f"{tag}_Q"),
                      helper.make_node("DequantizeLinear", [f"{tag}_q", f"{tag}_s", f"{tag}_z"], [f"{tag}_dq"],
                                       name=f"{tag}_DQ")])
        return f"{tag}_dq"

    def weight(tag: str, shape: tuple, axis: int, x_scale: float, channels: int) -> tuple[str, str]:
        inits[f"{tag}_wq"] = rng.integers(-wmax, wmax + 1, shape).astype(np.int8)
        inits[f"{tag}_ws"] = rng.uniform(0.002, 0.01, channels).astype(np.float32)
        inits[f"{tag}_wz"] = np.zeros(channels, np.int8)
        bias_scale = (np.float32(x_scale) * inits[f"{tag}_ws"]).astype(np.float32)
        inits[f"{tag}_bq"] = rng.integers(-2000, 2000, channels).astype(np.int32)
        inits[f"{tag}_bs"], inits[f"{tag}_bz"] = bias_scale, np.zeros(channels, np.int32)
        nodes.extend([helper.make_node("DequantizeLinear", [f"{tag}_wq", f"{tag}_ws", f"{tag}_wz"], [f"{tag}_w"],
                                       axis=axis, name=f"{tag}_wDQ"),
                      helper.make_node("DequantizeLinear", [f"{tag}_bq", f"{tag}_bs", f"{tag}_bz"], [f"{tag}_b"],
                                       axis=0, name=f"{tag}_bDQ")])
        return f"{tag}_w", f"{tag}_b"

    z = 128 if activation_type == U8 else 0
    x = pair("x", "x", 0.04, z)
    w, b = weight("c1", (8, 4, 3, 3), 0, 0.04, 8)
    nodes += [helper.make_node("Conv", [x, w, b], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
              helper.make_node("Relu", ["c1"], ["r1"], name="relu1")]
    r1 = pair("r1", "r1", 0.05, z - 128 if activation_type != U8 else 0)
    nodes.append(helper.make_node("MaxPool", [r1], ["p"], kernel_shape=[2, 2], strides=[2, 2], name="pool"))
    p = pair("p", "r1b", 0.05, z - 128 if activation_type != U8 else 0)  # the same scale: a round trip
    w, b = weight("c2", (8, 8, 3, 3), 0, 0.05, 8)
    nodes.append(helper.make_node("Conv", [p, w, b], ["c2"], pads=[1, 1, 1, 1], name="conv2"))
    c2 = pair("c2", "c2", 0.08, 10 if activation_type == U8 else -5)
    nodes += [helper.make_node("Add", [c2, p], ["s"], name="add"),
              helper.make_node("Relu", ["s"], ["rs"], name="relu2")]
    rs = pair("rs", "rs", 0.07, 0 if activation_type == U8 else -128)
    inits["shape"] = np.array([1, -1], np.int64)
    nodes.append(helper.make_node("Reshape", [rs, "shape"], ["flat"], name="flatten"))
    flat = pair("flat", "rs2", 0.07, 0 if activation_type == U8 else -128)
    w, b = weight("fc", (128, 6), 1, 0.07, 6)
    nodes.append(helper.make_node("MatMul", [flat, w], ["m"], name="fc"))
    nodes.append(helper.make_node("Add", ["m", b], ["y"], name="fc_bias"))
    graph = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", F, [1, 4, 8, 8])],
                              [helper.make_tensor_value_info("y", F, [1, 6])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), inits


@pytest.mark.parametrize("activation_type", [U8, TensorProto.INT8], ids=["u8", "s8"])
def test_the_qdq_graph_becomes_quantized_layers(activation_type):
    model, _ = _qdq_model(activation_type)
    report = PassReport()
    graph = optimize(onnx_frontend.load(model.SerializeToString()), PassOptions(unsigned_activations=True), report)
    steps = [(n.domain, n.op_type) for n in graph.graph]
    assert steps == [("", "QuantizeLinear"), ("kiln", "QConv"), ("", "MaxPool"), ("kiln", "QConv"), ("kiln", "QAdd"),
                     ("", "Reshape"), ("kiln", "QGemm")], steps
    # the Qs after MaxPool and the Reshape rise above them (hoist_quantize runs before sink_dequantize)
    assert report.fired["hoist_quantize"] == 2 and "sink_dequantize" not in report.fired
    assert report.fired["remove_qdq_round_trips"] == 2
    assert report.fired["fuse_quantized_layers"] == 3 and report.fired["fuse_quantized_add"] == 1
    if activation_type == TensorProto.INT8:  # every activation pair made uint8 (zero point + 128)
        assert report.fired["unsigned_activations"] == 6
    nodes = list(graph.graph)
    conv1, qgemm = nodes[1], nodes[6]
    assert conv1.attributes["activation"].value == "Relu" and conv1.outputs[0].dtype == TensorProto.UINT8
    assert conv1.inputs[8].const_value.dtype == TensorProto.INT32  # the DQ'd int32 bias, unchanged
    assert qgemm.inputs[6] is None and qgemm.outputs[0].name == "y"  # the float output, bias absorbed
    assert list(qgemm.inputs[3].shape) == [6, 128]  # [N, K]


@pytest.mark.parametrize("activation_type, wmax", [(U8, 64), (TensorProto.INT8, 64), (U8, 127)],
                         ids=["u8-7bit", "s8-7bit", "u8-8bit"])
def test_the_quantized_engine_is_onnxruntime_on_the_qdq_graph_within_a_step(activation_type, wmax):
    model, inits = _qdq_model(activation_type, wmax)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    engine = kiln.build(model.SerializeToString())
    chosen = {v["tactic"] for v in engine.plan.header["tactics"]["layers"].values()}
    if wmax == 64:  # 7-bit weights: the int8 kernels are exact here; full-range ones: the float layer
        assert "cpu.qconv.onednn" in chosen or "cpu.qconv.dequantized" in chosen
    # a few steps of the flattened tensor through the classifier's largest weight: how far roundings that
    # flipped upstream (float32 near a tie, here or in onnxruntime) move y; none flip on most inputs
    w = inits["fc_wq"].astype(np.float64) * inits["fc_ws"]
    bound = 4 * 0.07 * np.abs(w).max() + 1e-4
    fresh = np.random.default_rng(activation_type + wmax)
    for _ in range(4):
        x = fresh.standard_normal((1, 4, 8, 8), dtype=np.float32) * 2
        got, want = engine.run({"x": x})["y"], session.run(None, {"x": x})[0]
        assert np.abs(got - want).max() <= bound, (np.abs(got - want).max(), bound)
        assert np.abs(want).max() > 10 * bound  # the comparison means something


def _float_stem_model():
    """A ResNet stem as kiln's own calibration writes it: the pool is no quantized layer, so its output
    is quantized for the next convolution and the stem's convolution reads the quantized input."""
    def const(name: str, value: np.ndarray) -> str:
        inits[name] = value
        return name

    inits: dict[str, np.ndarray] = {}
    nodes = [helper.make_node("QuantizeLinear", ["x", const("xs", np.float32(0.03)), const("xz", np.uint8(128))],
                              ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"])]
    for tag, shape in (("c1", (8, 3, 3, 3)), ("c2", (6, 8, 3, 3))):
        inits[f"{tag}_wq"] = rng.integers(-64, 65, shape).astype(np.int8)
        nodes.append(helper.make_node("DequantizeLinear", [f"{tag}_wq", const(f"{tag}_ws", rng.uniform(
            0.002, 0.01, shape[0]).astype(np.float32)), const(f"{tag}_wz", np.zeros(shape[0], np.int8))],
            [f"{tag}_w"], axis=0))
        const(f"{tag}_b", rng.standard_normal(shape[0]).astype(np.float32) * 0.1)
    nodes += [helper.make_node("Conv", ["xd", "c1_w", "c1_b"], ["c1"], pads=[1, 1, 1, 1]),
              helper.make_node("Relu", ["c1"], ["r1"]),
              helper.make_node("MaxPool", ["r1"], ["p"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
              helper.make_node("QuantizeLinear", ["p", const("ps", np.float32(0.02)), const("pz", np.uint8(0))],
                               ["pq"]),
              helper.make_node("DequantizeLinear", ["pq", "ps", "pz"], ["pd"]),
              helper.make_node("Conv", ["pd", "c2_w", "c2_b"], ["y"], pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "stem", [helper.make_tensor_value_info("x", F, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", F, [1, 6, 8, 8])],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), inits


def test_the_quantize_after_a_float_maxpool_rises_into_the_convolution_before_it():
    # Q(MaxPool(x)) = MaxPool(Q(x)) (Q is non-decreasing): the stem's QConv writes uint8, the pool runs on it
    model, inits = _float_stem_model()
    report = PassReport()
    graph = optimize(onnx_frontend.load(model.SerializeToString()), PassOptions(unsigned_activations=True), report)
    nodes = list(graph.graph)
    assert [(n.domain, n.op_type) for n in nodes] == [("", "QuantizeLinear"), ("kiln", "QConv"), ("", "MaxPool"),
                                                      ("kiln", "QConv")], nodes
    assert report.fired["hoist_quantize"] == 1
    assert nodes[1].outputs[0].dtype == TensorProto.UINT8 and nodes[2].outputs[0].dtype == TensorProto.UINT8
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    engine = kiln.build(model.SerializeToString())
    bound = 4 * 0.02 * np.abs(inits["c2_wq"] * inits["c2_ws"][:, None, None, None]).max() + 1e-4  # a few flips
    fresh = np.random.default_rng(12)
    for _ in range(4):
        x = fresh.standard_normal((1, 3, 16, 16), dtype=np.float32) * 2
        got, want = engine.run({"x": x})["y"], session.run(None, {"x": x})[0]
        assert np.abs(got - want).max() <= bound, (np.abs(got - want).max(), bound)
        assert np.abs(want).max() > 10 * bound


# ---- the residual QAdd into its QConv's epilogue (kiln/passes/fusion/qdq_residual.py, CUDA builds) -------------

@pytest.mark.parametrize("activation_type", [U8, TensorProto.INT8], ids=["u8", "s8"])
def test_a_cuda_build_moves_the_residual_add_into_the_convolution(activation_type):
    model, _ = _qdq_model(activation_type)
    report = PassReport()
    graph = optimize(onnx_frontend.load(model.SerializeToString()), PassOptions(cuda_rules=True), report)
    steps = [(n.domain, n.op_type) for n in graph.graph]
    # (the input's QuantizeLinear folded into the first QConv, 4 channels: fold_quantize_into_stem, below)
    assert steps == [("kiln", "QConv"), ("", "MaxPool"), ("kiln", "QConv"), ("", "Reshape"), ("kiln", "QGemm")], steps
    assert report.fired["fuse_quantized_add"] == 1 and report.fired["fuse_quantized_residual"] == 1
    conv2 = list(graph.graph)[2]
    inputs = list(conv2.inputs)
    assert len(inputs) == 14 and inputs[9] is list(graph.graph)[1].outputs[0]  # the residual: the pooled tensor
    # the sum's quantization is the layer's output; the convolution's own (c2) moved to conv_scale/zero point
    assert inputs[6].const_value.numpy() == np.float32(0.07) and inputs[12].const_value.numpy() == np.float32(0.08)
    assert inputs[10].const_value.numpy() == np.float32(0.05)
    assert conv2.attributes["activation"].value == "Relu"
    assert conv2.outputs[0].dtype == inputs[7].const_value.dtype


def test_the_residual_stays_a_qadd_on_cpu_builds_and_where_the_convolution_has_other_readers():
    model, _ = _qdq_model(U8)
    report = PassReport()
    graph = optimize(onnx_frontend.load(model.SerializeToString()), PassOptions(cpu_rules=True), report)
    assert "QAdd" in [n.op_type for n in graph.graph] and "fuse_quantized_residual" not in report.fired
    # the convolution's 8-bit result also a graph output: it must still be written, the add stays
    model.graph.output.append(helper.make_tensor_value_info("c2_q", U8, None))
    report = PassReport()
    graph = optimize(onnx_frontend.load(model.SerializeToString()), PassOptions(cuda_rules=True), report)
    assert "QAdd" in [n.op_type for n in graph.graph]
    assert any("fuse_quantized_residual" in line and "other readers" in line for line in report.refused), report.refused


def test_the_fused_residual_on_the_reference_is_onnxruntime_within_a_step(monkeypatch):
    """A CPU build with the CUDA rule (the fused QConv runs as the op's reference: the CPU tactics refuse the
    residual) against onnxruntime on the Q/DQ graph, as the unfused engine above."""
    import dataclasses

    from kiln.builder import build as build_module

    plain = build_module.pass_options
    monkeypatch.setattr(build_module, "pass_options", lambda config: dataclasses.replace(plain(config), cuda_rules=True))
    model, inits = _qdq_model(U8, 64)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    engine = kiln.build(model.SerializeToString())
    assert "QAdd" not in [s.op_type for s in engine.plan.program.steps]
    w = inits["fc_wq"].astype(np.float64) * inits["fc_ws"]
    bound = 4 * 0.07 * np.abs(w).max() + 1e-4
    fresh = np.random.default_rng(11)
    for _ in range(4):
        x = fresh.standard_normal((1, 4, 8, 8), dtype=np.float32) * 2
        got, want = engine.run({"x": x})["y"], session.run(None, {"x": x})[0]
        assert np.abs(got - want).max() <= bound, (np.abs(got - want).max(), bound)
        assert np.abs(want).max() > 10 * bound


# ---- the image's QuantizeLinear into the stem's QConv (fold_quantize_into_stem, CUDA builds) ---------------------

def test_a_cuda_build_folds_the_image_quantization_into_the_stem():
    model, _ = _float_stem_model()
    report = PassReport()
    graph = optimize(onnx_frontend.load(model.SerializeToString()), PassOptions(cuda_rules=True), report)
    nodes = list(graph.graph)
    assert [(n.domain, n.op_type) for n in nodes] == [("kiln", "QConv"), ("", "MaxPool"), ("kiln", "QConv")], nodes
    assert report.fired["fold_quantize_into_stem"] == 1
    stem = nodes[0]
    assert stem.inputs[0].name == "x" and stem.inputs[0].dtype == TensorProto.FLOAT  # the graph's float input
    assert stem.inputs[1].const_value.numpy() == np.float32(0.03) and stem.inputs[2].const_value.dtype == U8
    # CPU builds keep the QuantizeLinear (their QConv kernels read 8-bit x only)
    report = PassReport()
    graph = optimize(onnx_frontend.load(model.SerializeToString()), PassOptions(cpu_rules=True), report)
    assert [n.op_type for n in graph.graph][0] == "QuantizeLinear" and "fold_quantize_into_stem" not in report.fired


def test_the_image_quantization_stays_where_the_8bit_image_has_other_readers_or_many_channels():
    model, _ = _float_stem_model()
    model.graph.output.append(helper.make_tensor_value_info("xq", U8, None))  # the 8-bit image is an output too
    report = PassReport()
    graph = optimize(onnx_frontend.load(model.SerializeToString()), PassOptions(cuda_rules=True), report)
    assert [n.op_type for n in graph.graph][0] == "QuantizeLinear"
    assert any("fold_quantize_into_stem" in line and "other readers" in line for line in report.refused), \
        report.refused
    model, _ = _qdq_model(U8)  # a 4-channel first layer folds; widen the image to 5 channels and it does not
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 5
    for init in model.graph.initializer:
        if init.name == "c1_wq":
            w = numpy_helper.to_array(init)
            init.CopyFrom(numpy_helper.from_array(np.concatenate([w, w[:, :1]], axis=1), "c1_wq"))
    report = PassReport()
    graph = optimize(onnx_frontend.load(model.SerializeToString()), PassOptions(cuda_rules=True), report)
    assert [n.op_type for n in graph.graph][0] == "QuantizeLinear"
    assert any("fold_quantize_into_stem" in line and "at most 4 channels" in line for line in report.refused), \
        report.refused


def test_the_folded_stem_on_the_reference_is_onnxruntime_within_a_step(monkeypatch):
    """A CPU build with the CUDA rules (the CPU's QConv tactics refuse a float x: the folded stem runs as the op's
    reference, QuantizeLinear then the layer) against onnxruntime on the Q/DQ graph."""
    import dataclasses

    from kiln.builder import build as build_module

    plain = build_module.pass_options
    monkeypatch.setattr(build_module, "pass_options", lambda config: dataclasses.replace(plain(config), cuda_rules=True))
    model, inits = _float_stem_model()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    engine = kiln.build(model.SerializeToString())
    steps = engine.plan.program.steps
    assert "QuantizeLinear" not in [s.op_type for s in steps] and steps[0].inputs[0] == "x"
    bound = 4 * 0.02 * np.abs(inits["c2_wq"] * inits["c2_ws"][:, None, None, None]).max() + 1e-4  # a few flips
    fresh = np.random.default_rng(13)
    for _ in range(4):
        x = fresh.standard_normal((1, 3, 16, 16), dtype=np.float32) * 2
        x[0, 0, 0, :6] = (np.arange(6, dtype=np.float32) - 3 + 0.5) * np.float32(0.03)  # x / scale at ties
        got, want = engine.run({"x": x})["y"], session.run(None, {"x": x})[0]
        assert np.abs(got - want).max() <= bound, (np.abs(got - want).max(), bound)
        assert np.abs(want).max() > 10 * bound
