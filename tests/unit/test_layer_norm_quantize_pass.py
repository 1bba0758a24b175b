"""fuse_layer_norm_quantize (kiln/passes/fusion/layernorm_quantize.py): a LayerNorm whose output a per-tensor
QuantizeLinear reads becomes one kiln::LayerNormQuantize (CUDA builds). Structural: the rule fires once per such
norm, no QuantizeLinear is left reading a norm, and the float y stays an output when something else reads it.
Numerical: on the reference ops the fused engine is the unfused one bit for bit (the op is the pair)."""

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
