"""The graph side of the FP8 encoder (issue 12):

- fuse_layer_norm_quantize (kiln/passes/fusion/layernorm_quantize.py): a LayerNorm whose output a per-tensor
  QuantizeLinear reads becomes one kiln::LayerNormQuantize (CUDA builds). Structural: the rule fires once per
  such norm, no QuantizeLinear is left reading a norm, the float y stays an output when something else reads it.
  Numerical: on the reference ops the fused engine is the unfused one bit for bit (the op is the pair).
- merge_parallel_gemms on kiln::QGemm (Q, K, V of one fp8 input with one weight scale): structural, and the
  engine against onnxruntime on the same Q/DQ model.
- half-precision storage: a quantized layer's float output is written in it (kiln/builder/precision.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.builder import build as build_module
from kiln.frontend import onnx as onnx_frontend
from kiln.passes.pipeline import PassOptions, optimize

F8 = TensorProto.FLOAT8E4M3FN


def _block(zero_type: int, other_reader: bool) -> onnx.ModelProto:
    """(x + r) -> LayerNormalization -> Q -> DQ -> MatMul, and (when other_reader) the norm's output + 1 too."""
    rng = np.random.default_rng(0)
    zero = helper.make_tensor("z", zero_type, [], [0] if zero_type != F8 else [0.0])
    inits = [numpy_helper.from_array(a, n) for n, a in (
        ("g", (rng.random(16) + 0.5).astype(np.float32)), ("b", rng.standard_normal(16).astype(np.float32) * 0.1),
        ("s", np.array(0.03, np.float32)), ("w", rng.standard_normal((16, 12)).astype(np.float32)),
        ("one", np.array(1.0, np.float32)))] + [zero]
    nodes = [helper.make_node("Add", ["x", "r"], ["sum"], name="add"),
             helper.make_node("LayerNormalization", ["sum", "g", "b"], ["ln"], name="ln", axis=-1),
             helper.make_node("QuantizeLinear", ["ln", "s", "z"], ["q"], name="q"),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["dq"], name="dq"),
             helper.make_node("MatMul", ["dq", "w"], ["y"], name="mm")]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, 12])]
    if other_reader:
        nodes.append(helper.make_node("Add", ["ln", "one"], ["y2"], name="add2"))
        outputs.append(helper.make_tensor_value_info("y2", TensorProto.FLOAT, [2, 5, 16]))
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 5, 16]) for n in ("x", "r")]
    graph = helper.make_graph(nodes, "block", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize("zero_type", [F8, TensorProto.INT8], ids=["fp8", "int8"])
@pytest.mark.parametrize("other_reader", [False, True], ids=["q only", "y read too"])
def test_layer_norm_then_quantize_fuses_on_cuda_builds(zero_type, other_reader):
    for cuda in (False, True):
        m = optimize(onnx_frontend.load(_block(zero_type, other_reader)), PassOptions(cuda_rules=cuda))
        ops = [(n.domain, n.op_type) for n in m.graph]
        fired = m.meta["kiln.pass_report"].fired.get("fuse_layer_norm_quantize", 0)
        if not cuda:  # the CPU's kernels were measured unfused
            assert fired == 0 and ("", "QuantizeLinear") in ops, ops
            continue
        assert fired == 1, ops
        assert ("", "QuantizeLinear") not in ops and ("kiln", "LayerNorm") not in ops, ops
        fused = next(n for n in m.graph if n.op_type == "LayerNormQuantize")
        assert len(fused.outputs) == (2 if other_reader else 1)
        assert fused.inputs[3] is not None  # the residual Add joined the norm first (fuse_skip_layer_norm)


@pytest.mark.parametrize("zero_type", [F8, TensorProto.INT8], ids=["fp8", "int8"])
def test_the_fused_engine_is_the_unfused_one_on_the_reference_ops(tmp_path, monkeypatch, zero_type):
    path = str(tmp_path / "block.onnx")
    onnx.save(_block(zero_type, other_reader=True), path)
    unfused = kiln.build(path, device="cpu")
    plain = build_module.pass_options
    monkeypatch.setattr(build_module, "pass_options", lambda config: dataclasses.replace(plain(config), cuda_rules=True))
    fused = kiln.build(path, device="cpu")
    assert "LayerNormQuantize" in [s.op_type for s in fused.plan.program.steps]
    engines = []
    for engine in (unfused, fused):
        for step in engine.plan.program.steps:
            step.tactic, step.tactic_config = "", {}
        engines.append(kiln.Engine(engine.plan))
    rng = np.random.default_rng(1)
    for _ in range(3):
        feed = {n: (rng.standard_normal((2, 5, 16)) * 2).astype(np.float32) for n in ("x", "r")}
        want, got = engines[0].run(feed), engines[1].run(feed)
        for name in ("y", "y2"):
            assert np.array_equal(got[name], want[name]), name


# ---- merge_parallel_gemms on kiln::QGemm: attention's Q, K, V projections of one fp8 input ---------------------

def _qkv(shared_scale: bool) -> onnx.ModelProto:
    """Q(x) -> DQ -> three MatMuls on DQ'd float8 weights (+ bias): what kiln's FP8 quantization writes."""
    import ml_dtypes

    rng = np.random.default_rng(2)
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"], name="xq"),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xdq"], name="xdq")]
    inits = [numpy_helper.from_array(np.array(0.01, np.float32), "xs"),
             helper.make_tensor("xz", F8, [], [0.0])]
    outputs = []
    for i, name in enumerate("qkv"):
        w = rng.standard_normal((16, 8)).astype(np.float32)
        scale = 0.004 if shared_scale else 0.004 * (i + 1)
        wq = np.clip(w / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
        inits += [helper.make_tensor(f"w{name}", F8, [16, 8], wq.view(np.uint8).tobytes(), raw=True),
                  numpy_helper.from_array(np.array(scale, np.float32), f"s{name}"),
                  helper.make_tensor(f"z{name}", F8, [], [0.0]),
                  numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), f"b{name}")]
        nodes += [helper.make_node("DequantizeLinear", [f"w{name}", f"s{name}", f"z{name}"], [f"w{name}dq"],
                                   name=f"w{name}dq"),
                  helper.make_node("MatMul", ["xdq", f"w{name}dq"], [f"m{name}"], name=f"mm{name}"),
                  helper.make_node("Add", [f"m{name}", f"b{name}"], [name], name=f"add{name}")]
        outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 5, 8]))
    graph = helper.make_graph(nodes, "qkv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 16])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize("shared_scale", [True, False], ids=["one weight scale", "three scales"])
def test_quantized_gemms_of_one_input_merge_when_their_weight_scale_is_one(tmp_path, shared_scale):
    import onnxruntime as ort

    model = _qkv(shared_scale)
    m = optimize(onnx_frontend.load(model), PassOptions())
    gemms = [n for n in m.graph if n.op_type == "QGemm"]
    assert m.meta["kiln.pass_report"].fired.get("merge_parallel_gemms", 0) == (1 if shared_scale else 0)
    assert len(gemms) == (1 if shared_scale else 3)
    path = str(tmp_path / "qkv.onnx")
    onnx.save(model, path)
    engine = kiln.build(path, device="cpu")
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    x = (np.random.default_rng(3).standard_normal((2, 5, 16)) * 0.5).astype(np.float32)
    got, want = engine.run({"x": x}), dict(zip("qkv", session.run(None, {"x": x})))
    for i, name in enumerate("qkv"):
        # float outputs of exact fp8 products: fp32 rounding, and the bias kiln rounds to int32 at x_scale·w_scale
        # (the QGemm contract, as QLinearMatMul's): half of that step
        half_step = 0.5 * 0.01 * 0.004 * (1 if shared_scale else i + 1)
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=half_step + 1e-6)


def test_half_precision_storage_writes_a_quantized_layers_float_output_in_half():
    """An fp16 engine's QGemm with a float output wrote float32 (its output_dtype stayed 1): the next LayerNorm
    then met fp32 x with fp16 γ (on the H200: "expected scalar type Float but found Half")."""
    from kiln.builder.precision import lower_precision
    from kiln.plan.spec import ProgramSpec, StepSpec

    float_out = StepSpec(op_type="QGemm", name="g", inputs=["x", "xs", "xz", "w", "ws", "wz", "", "", "b"],
                         outputs=["y"], attributes={"output_dtype": 1}, domain="kiln", output_dtypes=["float"])
    quantized_out = StepSpec(op_type="QGemm", name="h", inputs=["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"],
                             outputs=["z"], attributes={}, domain="kiln", output_dtypes=["float8e4m3fn"])
    program = ProgramSpec(inputs=["x"], outputs=["y", "z"], steps=[float_out, quantized_out])
    lower_precision(program, {}, "fp16")
    assert float_out.attributes["output_dtype"] == 10 and float_out.output_dtypes == ["float16"]
    assert quantized_out.output_dtypes == ["float8e4m3fn"]  # y_scale decides: the attribute is not read
