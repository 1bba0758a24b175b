"""fuse_swiglu: a gated MLP's gate GEMM (SiLU), up GEMM and their Mul become one FusedGemm on
[W_gate; W_up] with activation "SwiGLU". Structure (golden op counts, firing counts) and outputs
against onnxruntime on the unoptimized model, random inputs, fp32 tolerances stated per test."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from kiln.ops.fused import fused_gemm
from kiln.ops.registry import OpContext
from kiln.passes import fusion
from kiln.plan.spec import StepSpec
from kiln.tactics import registry
from kiln.tactics.tactic import InputMeta
from tests.unit.test_passes_cleanup import assert_same_as_onnxruntime, make_model, optimized

F = TensorProto.FLOAT
rng = np.random.default_rng(11)


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def value(name, shape):
    return helper.make_tensor_value_info(name, F, shape)


def gated_mlp(b=2, s=5, k=16, n=24, gate_bias=False, up_bias=True, up_is_output=False) -> onnx.ModelProto:
    """y = (silu(x·Wg [+ bg]) * (x·Wu [+ bu]))·Wd: Llama's MLP, SiLU written as x·sigmoid(x)."""
    nodes = [helper.make_node("MatMul", ["x", "wg"], ["g0"]), helper.make_node("MatMul", ["x", "wu"], ["u0"])]
    inits = [("wg", randn(k, n)), ("wu", randn(k, n)), ("wd", randn(n, k))]
    g, u = "g0", "u0"
    if gate_bias:
        nodes.append(helper.make_node("Add", ["g0", "bg"], ["g"]))
        inits.append(("bg", randn(n)))
        g = "g"
    if up_bias:
        nodes.append(helper.make_node("Add", ["u0", "bu"], ["u"]))
        inits.append(("bu", randn(n)))
        u = "u"
    nodes += [helper.make_node("Sigmoid", [g], ["sig"]), helper.make_node("Mul", [g, "sig"], ["act"]),
              helper.make_node("Mul", ["act", u], ["h"]), helper.make_node("MatMul", ["h", "wd"], ["y"])]
    outputs = [value("y", [b, s, k])] + ([value(u, [b, s, n])] if up_is_output else [])
    return make_model(nodes, [value("x", [b, s, k])], outputs, inits)


@pytest.mark.parametrize("gate_bias,up_bias", [(False, False), (False, True), (True, True)])
def test_gate_up_and_mul_become_one_swiglu_gemm(gate_bias, up_bias):
    proto = gated_mlp(gate_bias=gate_bias, up_bias=up_bias)
    model, report, ops = optimized(proto)
    assert report.fired["fuse_swiglu"] == 1
    assert ops == {"kiln::FusedGemm": 2}  # gate|up with SwiGLU, then the down projection
    swiglu = next(n for n in model.graph if n.attributes.get_string("activation", "") == "SwiGLU")
    assert list(swiglu.inputs[1].const_value.numpy().shape) == [48, 16]  # [2N, K]: gate rows, then up rows
    assert (len(swiglu.inputs) > 2) == (gate_bias or up_bias)
    assert list(swiglu.outputs[0].shape) == [2, 5, 24]
    x = randn(2, 5, 16)
    assert_same_as_onnxruntime(proto, {"x": x}, rtol=1e-4, atol=1e-4)  # fp32, K = 16 and N = 24 sums


def test_an_up_projection_read_elsewhere_stays_apart():
    proto = gated_mlp(up_is_output=True)
    _, report, ops = optimized(proto)
    assert "fuse_swiglu" not in report.fired
    assert ops == {"kiln::FusedGemm": 3, "Mul": 1}
    assert_same_as_onnxruntime(proto, {"x": randn(2, 5, 16)}, rtol=1e-4, atol=1e-4)


def test_swiglu_wins_over_merging_the_up_gemm_with_another_plain_gemm(monkeypatch):
    # x also feeds a plain projection: merge_parallel_gemms would put the up GEMM behind a Split
    proto = gated_mlp()
    proto.graph.node.append(helper.make_node("MatMul", ["x", "wo"], ["o"]))
    proto.graph.initializer.append(onnx.numpy_helper.from_array(randn(16, 8), "wo"))
    proto.graph.output.append(value("o", [2, 5, 8]))
    _, report, ops = optimized(proto)
    assert report.fired["fuse_swiglu"] == 1 and "merge_parallel_gemms" not in report.fired
    assert ops == {"kiln::FusedGemm": 3}
    assert_same_as_onnxruntime(proto, {"x": randn(2, 5, 16)}, rtol=1e-4, atol=1e-4)
    # the order is what decides it: with the rule after merge_parallel_gemms, the Split hides the pair
    swiglu = next(entry for entry in fusion.RULES if entry[0] == "fuse_swiglu")
    rules = [entry for entry in fusion.RULES if entry is not swiglu]
    at = [name for name, _ in rules].index("merge_parallel_gemms") + 1
    monkeypatch.setattr(fusion, "RULES", [*rules[:at], swiglu, *rules[at:]])
    _, report, _ = optimized(proto)
    assert report.fired["merge_parallel_gemms"] == 1 and "fuse_swiglu" not in report.fired


def test_swiglu_activation_gates_the_two_halves():
    x, w, b = torch.randn(3, 7, 16), torch.randn(48, 16), torch.randn(48)
    ctx = OpContext(name="g", op_type="FusedGemm", domain="kiln", opset=1, num_inputs=3, num_outputs=1)
    h = torch.nn.functional.linear(x, w, b)
    want = torch.nn.functional.silu(h[..., :24]) * h[..., 24:]
    torch.testing.assert_close(fused_gemm(ctx, x, w, b, activation="SwiGLU"), want, rtol=1e-6, atol=1e-6)
    r = torch.randn(3, 7, 24)
    torch.testing.assert_close(fused_gemm(ctx, x, w, b, r, activation="SwiGLU"), want + r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tactic", ["cpu.gemm.onednn", "cpu.gemm.mkl", "cuda.gemm.cublas_addmm_act",
                                    "cuda.gemm.cublas_triton_epilogue", "cuda.gemm.triton.16x64x64"])
def test_gemm_tactics_leave_swiglu_to_the_default(tactic):
    step = StepSpec("FusedGemm", "g", ["x", "w"], ["y"], {"activation": "SwiGLU"}, domain="kiln")
    dtype = torch.float16 if ".triton." in tactic else torch.float32
    inputs = [InputMeta((4, 32), dtype, False), InputMeta((48, 32), dtype, True)]
    reason = registry.get(tactic).supports(step, inputs)
    assert isinstance(reason, str) and "SwiGLU" in reason


def test_llama_tiny_runs_its_mlps_as_one_gemm_each(monkeypatch):
    from kiln import zoo

    exported = zoo.export("llama_tiny")
    proto = onnx.load(str(exported.path))
    model, report, ops = optimized(proto)
    assert report.fired["fuse_swiglu"] == 2  # one per layer
    assert "Mul" not in ops
    feeds = zoo.random_inputs("llama_tiny", exported, seed=3)
    assert_same_as_onnxruntime(proto, feeds, rtol=1e-4, atol=1e-4)  # fp32, as the zoo step-budget test
    # the same pipeline without the rule: two more steps per layer (gate, up and Mul apart)
    monkeypatch.setattr(fusion, "RULES", [(name, rule) for name, rule in fusion.RULES if name != "fuse_swiglu"])
    _, _, without = optimized(proto)
    assert sum(ops.values()) == sum(without.values()) - 4 == 19  # 23 before fuse_packed_rotary ran for every device


def merged_gated_mlp(b=2, s=5, k=16, n=24, bias=True, up_is_output=False) -> onnx.ModelProto:
    """Phi-3's MLP: h = x·[Wg | Wu] (+ b), gate, up = Split(h, 2), y = (gate·sigmoid(gate)·up)·Wd."""
    nodes = [helper.make_node("MatMul", ["x", "wgu"], ["h0"])]
    inits = [("wgu", randn(k, 2 * n)), ("wd", randn(n, k))]
    h = "h0"
    if bias:
        nodes.append(helper.make_node("Add", ["h0", "bgu"], ["h"]))
        inits.append(("bgu", randn(2 * n)))
        h = "h"
    nodes += [helper.make_node("Split", [h], ["g", "u"], axis=-1, num_outputs=2),
              helper.make_node("Sigmoid", ["g"], ["sig"]), helper.make_node("Mul", ["g", "sig"], ["act"]),
              helper.make_node("Mul", ["u", "act"], ["m"]), helper.make_node("MatMul", ["m", "wd"], ["y"])]
    outputs = [value("y", [b, s, k])] + ([value("u", [b, s, n])] if up_is_output else [])
    return make_model(nodes, [value("x", [b, s, k])], outputs, inits)


def optimized_for_the_cpu(proto: onnx.ModelProto):
    """As a CPU build optimizes (fusion.CPU_RULES included)."""
    import collections

    from kiln.frontend import onnx as onnx_frontend
    from kiln.passes import PassOptions, PassReport, optimize

    report = PassReport()
    model = optimize(onnx_frontend.load(proto), PassOptions(opt_level=2, cpu_rules=True), report)
    ops = collections.Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in model.graph)
    return model, report, ops


@pytest.mark.parametrize("bias", [False, True])
def test_a_merged_gate_up_gemm_split_in_halves_becomes_one_swiglu_gemm(bias):
    proto = merged_gated_mlp(bias=bias)
    _, gpu_report, _ = optimized(proto)
    assert gpu_report.fired["fuse_split_swiglu"] == 1  # every device's (CUDA: kiln/tactics/cuda/swiglu.py)
    model, report, ops = optimized_for_the_cpu(proto)
    assert report.fired["fuse_split_swiglu"] == 1
    assert ops == {"kiln::FusedGemm": 2}  # gate|up with SwiGLU, then the down projection
    swiglu = next(n for n in model.graph if n.attributes.get_string("activation", "") == "SwiGLU")
    assert list(swiglu.inputs[1].const_value.numpy().shape) == [48, 16]  # the merged weight as it was, [2N, K]
    assert list(swiglu.outputs[0].shape) == [2, 5, 24]
    assert_same_as_onnxruntime(proto, {"x": randn(2, 5, 16)}, rtol=1e-4, atol=1e-4)  # fp32, K = 16 and N = 24 sums


def test_a_merged_gate_up_whose_up_half_is_read_elsewhere_stays_apart():
    proto = merged_gated_mlp(up_is_output=True)
    _, report, ops = optimized_for_the_cpu(proto)
    assert "fuse_split_swiglu" not in report.fired and ops["Slice"] == 2  # the Split, as slices (split_as_slices)
    assert any("up half is read elsewhere" in line for line in report.refused)
    assert_same_as_onnxruntime(proto, {"x": randn(2, 5, 16)}, rtol=1e-4, atol=1e-4)
