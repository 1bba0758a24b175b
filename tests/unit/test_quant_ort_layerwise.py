"""kiln and onnxruntime on one Q/DQ graph, layer by layer (issue 12): each of kiln's steps is fed onnxruntime's
values of its inputs (kiln.tools.accuracy.replay), so a layer is judged alone, not through what its
predecessors' float32 rounding made of its inputs (through 50 layers, one flipped rounding grows into whole
quantization steps everywhere: bench/results/quant-accuracy-2026-12-02b.md).

The graph is kiln's own quantization (kiln.builder.calibration.quantize) of a small MobileNet-like net, so it
holds what kiln's MobileNetV2 graph holds: int8 input, per-channel uint8 Q/DQ on a depthwise convolution's input
(axis 1), uint8 after ReLU6, int8 on a projection's signed output, per-channel int8 weights, float biases
(bias-corrected), a residual Add (float in emulation), a Gemm. The input carries exact rounding ties of its QuantizeLinear (x / s is k +
0.5 in float32: half to even, not x·(1/s)) and values far past the range (saturation).

    unfused (the Q/DQ graph as written): every QuantizeLinear equals onnxruntime's bit for bit; every float
        layer within float32 summation-order error
    fused (kiln::QConv/QGemm, int32 bias): every quantized output within one step of onnxruntime's
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import helper

from kiln.builder.calibration import quantize
from kiln.builder.config import BuildConfig
from kiln.builder.lower import lower
from kiln.passes import PassOptions, optimize
from kiln.runtime.program import Program
from kiln.tools.accuracy import _all_outputs_model, replay

FLOAT32_RTOL = 1e-5  # a convolution's float32 sum in another order: ~1e-6 of the output's scale at these sizes


def _net(rng: np.random.Generator) -> onnx.ModelProto:
    """stem 3x3 3->8 + ReLU6 (channel ranges 0.02..3) -> depthwise 3x3 + ReLU6 -> project 1x1 8->8 (signed)
    -> 1x1 8->8, + project (residual) -> global pool -> Gemm 8->5."""
    spread = np.geomspace(0.02, 3, 8, dtype=np.float32)[:, None, None, None]
    arrays = {"w1": rng.normal(size=(8, 3, 3, 3)).astype(np.float32) * spread,
              "b1": rng.normal(size=8).astype(np.float32) * 0.1,
              "w2": rng.normal(size=(8, 1, 3, 3)).astype(np.float32) * 2, "b2": rng.normal(size=8).astype(np.float32),
              "w3": rng.normal(size=(8, 8, 1, 1)).astype(np.float32) * 0.5, "b3": rng.normal(size=8).astype(np.float32),
              "w4": rng.normal(size=(8, 8, 1, 1)).astype(np.float32) * 0.5,
              "wf": rng.normal(size=(5, 8)).astype(np.float32), "bf": rng.normal(size=5).astype(np.float32),
              "lo": np.array(0, np.float32), "hi": np.array(6, np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="stem", pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c1", "lo", "hi"], ["r1"], name="relu6_1"),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="depthwise", group=8, pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c2", "lo", "hi"], ["r2"], name="relu6_2"),
             helper.make_node("Conv", ["r2", "w3", "b3"], ["p"], name="project"),
             helper.make_node("Conv", ["p", "w4"], ["e"], name="expand"),
             helper.make_node("Add", ["e", "p"], ["s"], name="residual"),
             helper.make_node("GlobalAveragePool", ["s"], ["g"], name="pool"),
             helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "wf", "bf"], ["y"], name="classifier", transB=1)]
    graph = helper.make_graph(nodes, "mobile", [helper.make_tensor_value_info("x", 1, [1, 3, 12, 12])],
                              [helper.make_tensor_value_info("y", 1, [1, 5])],
                              [onnx.numpy_helper.from_array(a, n) for n, a in arrays.items()])
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def _ties(x: np.ndarray, scale: np.float32, rng: np.random.Generator, count: int) -> np.ndarray:
    """x with `count` of its elements replaced by values whose float32 x / scale is exactly k + 0.5."""
    flat = x.reshape(-1).copy()
    found = []
    for k in rng.integers(-100, 100, 20 * count):
        guess = np.float32((k + 0.5) * float(scale))
        for candidate in (guess, np.nextafter(guess, np.float32(np.inf)), np.nextafter(guess, np.float32(-np.inf))):
            if np.float32(candidate) / scale == np.float32(k + 0.5):
                found.append(candidate)
                break
        if len(found) == count:
            break
    assert len(found) == count, "too few exact ties found for this scale"
    flat[rng.choice(flat.size, count, replace=False)] = found
    return flat.reshape(x.shape)


@pytest.fixture(scope="module")
def qdq_graph():
    """(kiln's int8 Q/DQ model, an input with ties and saturation, onnxruntime's value of every tensor)."""
    rng = np.random.default_rng(12)
    calibration = [{"x": rng.normal(size=(1, 3, 12, 12)).astype(np.float32)} for _ in range(6)]
    config = BuildConfig(precision="int8", quantization="emulate", calibration=calibration, calibrator="minmax")
    model, _ = quantize(ir.from_proto(_net(rng)), config, lambda _m: None)
    x_scale = next(n for n in model.graph if n.op_type == "QuantizeLinear" and n.inputs[0].name == "x")
    scale = np.float32(x_scale.inputs[1].const_value.numpy())
    x = rng.normal(size=(1, 3, 12, 12)).astype(np.float32)
    x = _ties(x, scale, rng, 40)
    x.reshape(-1)[:6] = np.array([9, -9, 1e3, -1e3, 200 * scale, -200 * scale], np.float32)  # past the range
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the Q/DQ as written
    session = ort.InferenceSession(_all_outputs_model(ir.to_proto(model)).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    reference = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x})))
    return model, x, reference


def _replayed(model: ir.Model, x: np.ndarray, reference: dict, fused: bool) -> dict:
    model = ir.from_proto(ir.to_proto(model))
    if fused:
        model = optimize(model, PassOptions(unsigned_activations=True))
    program, weights, _, _ = lower(model)
    return replay(Program(program, weights), reference, [torch.from_numpy(x)])


def _steps_apart(got: torch.Tensor, want: torch.Tensor) -> int:
    return int((got.to(torch.int64) - want.to(torch.int64)).abs().max())


def test_the_graph_holds_the_cases(qdq_graph):
    model, x, reference = qdq_graph
    quantizers = {n.inputs[0].name: n for n in model.graph if n.op_type == "QuantizeLinear"}
    assert quantizers["r1"].inputs[1].const_value.numpy().shape == (8,)  # the depthwise input, per channel
    assert quantizers["r1"].outputs[0].dtype == ir.DataType.UINT8
    assert quantizers["p"].outputs[0].dtype == ir.DataType.INT8  # the projection's signed output
    scale = np.float32(quantizers["x"].inputs[1].const_value.numpy())
    quotient = x / scale
    assert int((quotient == np.floor(quotient) + 0.5).sum()) >= 40  # exact ties of the input's rounding
    assert (np.abs(reference["x_q"]) == 127).sum() + (reference["x_q"] == -128).sum() >= 6  # saturated


def test_unfused_qdq_graph_equals_onnxruntime_layer_by_layer(qdq_graph):
    model, x, reference = qdq_graph
    compared = _replayed(model, x, reference, fused=False)
    quantized = [n for n, (got, _) in compared.items() if got.dtype in (torch.int8, torch.uint8)]
    assert sorted(quantized) == ["f_q", "p_q", "r1_q", "r2_q", "x_q"]  # each quantized layer's input
    for name, (got, want) in compared.items():
        if got.dtype in (torch.int8, torch.uint8):
            assert torch.equal(got, want), f"{name}: {int((got != want).sum())} of {got.numel()} elements differ"
        else:
            scale = float(want.abs().max()) or 1.0
            error = float((got.double() - want.double()).abs().max())
            assert error <= FLOAT32_RTOL * scale, f"{name}: max |kiln - onnxruntime| {error:.3g} at scale {scale:.3g}"


def test_fused_quantized_layers_are_onnxruntime_within_one_step(qdq_graph):
    model, x, reference = qdq_graph
    compared = _replayed(model, x, reference, fused=True)
    quantized = {n: pair for n, pair in compared.items() if pair[0].dtype in (torch.int8, torch.uint8)}
    assert {"x_q", "r1_q", "r2_q", "p_q"} <= set(quantized), sorted(quantized)
    for name, (got, want) in quantized.items():
        # the fused layer sums exact integers with an int32 bias where onnxruntime sums float32 products and a
        # float bias: a value near a rounding tie may land one step away, never two
        assert _steps_apart(got, want) <= 1, f"{name}: {_steps_apart(got, want)} steps from onnxruntime"
    assert torch.equal(*quantized["x_q"])  # the input's quantization: ties and saturation exactly
