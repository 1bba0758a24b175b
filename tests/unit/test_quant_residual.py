"""Residual blocks quantized whole on the CPU's int8 path (kiln/quant/residual.py): a post-activation Add -> Relu
between quantized convolutions gets Q/DQ on both inputs, so the optimizer fuses QConv with an 8-bit output and
a QAdd; Adds without a Relu, or feeding a float layer, stay float. Outputs against onnxruntime's fp32 run of the
same model within what 8-bit activations allow; fresh random weights and inputs."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.frontend import onnx as onnx_frontend
from kiln.quant import residual


def _resnet(relu_after_add: bool = True, seed: int = 0, pooled_sum: bool = False) -> bytes:
    """stem conv -> relu -> [conv -> relu -> conv] + x -> (relu) -> conv -> relu -> [conv -> relu -> conv] + y
    -> (relu) -> conv -> global pool -> gemm: two residual blocks; `pooled_sum`: without the last conv, the
    second block's sum feeding only the pool (a ResNet's last block)."""
    rng = np.random.default_rng(seed)

    def w(name, *shape, scale=0.25):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    inits = [w("w0", 8, 3, 3, 3, scale=0.4), w("wa", 8, 8, 3, 3), w("wb", 8, 8, 3, 3), w("wc", 8, 8, 3, 3),
             w("wd", 8, 8, 3, 3), w("we", 8, 8, 3, 3), w("wf", 5, 8, scale=1.0), w("bf", 5, scale=0.1)]
    pads = dict(pads=[1, 1, 1, 1])
    act = "Relu" if relu_after_add else "Identity"
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], name="stem", **pads),
             helper.make_node("Relu", ["c0"], ["r0"], name="stem_relu"),
             helper.make_node("Conv", ["r0", "wa"], ["ca"], name="conv_a", **pads),
             helper.make_node("Relu", ["ca"], ["ra"], name="relu_a"),
             helper.make_node("Conv", ["ra", "wb"], ["cb"], name="conv_b", **pads),
             helper.make_node("Add", ["cb", "r0"], ["s1"], name="add1"),
             helper.make_node(act, ["s1"], ["y1"], name="after1"),
             helper.make_node("Conv", ["y1", "wc"], ["cc"], name="conv_c", **pads),
             helper.make_node("Relu", ["cc"], ["rc"], name="relu_c"),
             helper.make_node("Conv", ["rc", "wd"], ["cd"], name="conv_d", **pads),
             helper.make_node("Add", ["cd", "y1"], ["s2"], name="add2"),
             helper.make_node(act, ["s2"], ["y2"], name="after2"),
             helper.make_node("Conv", ["y2", "we"], ["ce"], name="conv_e", **pads),
             helper.make_node("GlobalAveragePool", ["y2" if pooled_sum else "ce"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "wf", "bf"], ["out"], name="fc", transB=1)]
    if pooled_sum:
        nodes = [n for n in nodes if n.name != "conv_e"]
        inits = [i for i in inits if i.name != "we"]
    graph = helper.make_graph(nodes, "resnet", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 5])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]).SerializeToString()


def _batches(n, seed):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((1, 3, 16, 16), dtype=np.float32)} for _ in range(n)]


def test_the_plan_takes_post_activation_adds_between_quantized_layers_only():
    graph = onnx_frontend.load(_resnet()).graph
    assert [n.name for n in residual.plan(graph)] == ["add1", "add2"]  # both sums feed quantized convs only
    assert residual.activations(residual.plan(graph)) == {"cb", "r0", "cd", "y1"}
    # conv_c kept float: add1's sum feeds a float layer, so add1 stays float; add2's sum still feeds conv_e only
    assert [n.name for n in residual.plan(graph, exclude={"conv_c"})] == ["add2"]
    # conv_e kept float: add2's sum feeds it, so add2 stays float, and add1's sum feeds add2 (now float): float too
    assert residual.plan(graph, exclude={"conv_e"}) == []
    plain = onnx_frontend.load(_resnet(relu_after_add=False)).graph
    assert residual.plan(plain) == []  # no Relu after the Add (a linear bottleneck): float


def test_an_int8_resnet_block_runs_qconv_and_qadd_and_matches_onnxruntime():
    model = _resnet()
    engine = kiln.build(model, precision="int8", calibration=_batches(8, seed=1), calibrator="minmax")
    q = engine.plan.header["quantization"]
    assert q["residual_adds"] == ["add1", "add2"]
    ops = [s.op_type for s in engine.plan.program.steps]
    assert ops.count("QAdd") == 2 and "Add" not in ops and "Elementwise" not in ops
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    for feeds in _batches(4, seed=9):
        want = session.run(None, feeds)[0]
        got = engine.run(feeds)["out"]
        assert np.abs(got - want).max() < 0.08 * np.abs(want).max() + 1e-3, (got, want)


def test_the_last_blocks_sum_read_by_the_global_pool_is_quantized_too():
    # the pool averages the 8-bit sum (its own calibrated pair): both Adds run as QAdd, nothing float between
    model = _resnet(pooled_sum=True)
    graph = onnx_frontend.load(model).graph
    assert [n.name for n in residual.plan(graph)] == ["add1", "add2"]
    assert residual.activations(residual.plan(graph)) == {"cb", "r0", "cd", "y1", "y2"}
    engine = kiln.build(model, precision="int8", calibration=_batches(8, seed=1), calibrator="minmax")
    assert engine.plan.header["quantization"]["residual_adds"] == ["add1", "add2"]
    ops = [s.op_type for s in engine.plan.program.steps]
    assert ops.count("QAdd") == 2 and "Add" not in ops and "Elementwise" not in ops, ops
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    for feeds in _batches(4, seed=9):
        want = session.run(None, feeds)[0]
        got = engine.run(feeds)["out"]
        assert np.abs(got - want).max() < 0.08 * np.abs(want).max() + 1e-3, (got, want)


def test_adds_without_a_relu_stay_float():
    model = _resnet(relu_after_add=False)
    engine = kiln.build(model, precision="int8", calibration=_batches(8, seed=1), calibrator="minmax")
    assert engine.plan.header["quantization"]["residual_adds"] == []
    assert "QAdd" not in [s.op_type for s in engine.plan.program.steps]
