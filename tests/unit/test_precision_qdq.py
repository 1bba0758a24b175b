"""A half-precision build of an explicitly quantized model (kiln/builder/precision.py): the Q/DQ graph is honoured
exactly, so its quantization scales stay float32 (rounded to fp16 each moved every requantized value by up to 5e-4
of itself), and a DequantizeLinear still writes the engine's storage type. Against onnxruntime on the Q/DQ graph:
8-bit values exactly, the float output within fp16's rounding of it."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln

rng = np.random.default_rng(21)


def _stem_with_a_dequantized_output():
    """Q(x) -> DQ -> Conv (per-channel int8 weights) -> Relu -> Q -> DQ: the engine's output is a DequantizeLinear
    of a QConv's 8-bit result. Scales with long mantissas (fp16 rounds each)."""
    inits = {"xs": np.float32(0.0312345), "xz": np.int8(-3), "ys": np.float32(0.0213579), "yz": np.int8(-128),
             "wq": rng.integers(-127, 128, (16, 3, 3, 3)).astype(np.int8),
             "ws": rng.uniform(0.002, 0.01, 16).astype(np.float32), "wz": np.zeros(16, np.int8)}
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], axis=0),
             helper.make_node("Conv", ["xd", "w"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("QuantizeLinear", ["r", "ys", "yz"], ["rq"]),
             helper.make_node("DequantizeLinear", ["rq", "ys", "yz"], ["y"])]
    graph = helper.make_graph(nodes, "stem", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16, 8, 8])],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), inits


def test_a_half_precision_build_keeps_the_quantization_scales_float32():
    model, inits = _stem_with_a_dequantized_output()
    engine = kiln.build(model.SerializeToString(), precision="fp16")
    steps = engine.plan.program.steps
    scales = {v for s in steps if s.op_type in ("QuantizeLinear", "DequantizeLinear", "QConv")
              for i, v in enumerate(s.inputs) if v and (s.op_type != "QConv" and i == 1 or
                                                         s.op_type == "QConv" and i in (1, 4, 6))}
    key_of = dict(engine.plan.program.constants)
    stored = {v: engine.plan.weights[key_of.get(v, v)] for v in scales}
    assert stored and all(w.dtype == torch.float32 for w in stored.values()), {v: w.dtype for v, w in stored.items()}
    dq = [s for s in steps if s.op_type == "DequantizeLinear"]
    assert dq and all(s.attributes.get("output_dtype") == TensorProto.FLOAT16 for s in dq)

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    step = float(inits["ys"])
    for seed in range(3):
        x = np.random.default_rng(seed).standard_normal((2, 3, 16, 16), dtype=np.float32) * 2
        # the engine quantizes the image as its boundary cast hands it over, in fp16 (runtime/engine.py): onnxruntime
        # on that image is the same Q/DQ arithmetic, so every 8-bit value matches (with fp16 scales: 1% of them
        # one or two steps off)
        got = engine.run({"x": x})["y"]
        want = session.run(None, {"x": x.astype(np.float16).astype(np.float32)})[0]
        steps_off = np.rint(np.abs(got.astype(np.float64) - want) / step)
        assert steps_off.max() == 0, (steps_off.max(), (steps_off > 0).mean())
        # the float output: y_scale·(q − z) rounded to fp16 by the DequantizeLinear (half an ulp of |y| <= 5.5)
        assert np.abs(got - want).max() <= 2.0**-11 * np.abs(want).max()
        assert np.abs(want).max() > 50 * step  # outputs spread over the range: the comparison means something
