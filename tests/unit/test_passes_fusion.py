"""BatchNorm/affine folding and the fusions: structural (rule fired N times, ops left,
fused_from recorded) and numerical (outputs equal onnxruntime's on the unoptimized model)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.frontend import onnx as onnx_frontend
from kiln.passes import why_not
from tests.unit.test_passes_cleanup import assert_same_as_onnxruntime, make_model, optimized

F = TensorProto.FLOAT
rng = np.random.default_rng(0)


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def conv_bn_relu_residual(with_add: bool = True):
    x = helper.make_tensor_value_info("x", F, [1, 4, 8, 8])
    y = helper.make_tensor_value_info("y", F, [1, 4, 8, 8])
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["bn"], epsilon=1e-3, name="bn"),
        helper.make_node("Add", ["bn", "x"] if with_add else ["bn", "zero"], ["sum"], name="residual"),
        helper.make_node("Relu", ["sum"], ["y"], name="relu"),
    ]
    inits = [("w", randn(4, 4, 3, 3)), ("gamma", rng.uniform(0.5, 2, 4).astype(np.float32)), ("beta", randn(4)),
             ("mean", randn(4)), ("var", rng.uniform(0.5, 2, 4).astype(np.float32)),
             ("zero", np.zeros((1, 4, 8, 8), np.float32))]
    return make_model(nodes, [x], [y], inits)


def test_batchnorm_folds_and_conv_fuses_residual_and_relu():
    proto = conv_bn_relu_residual()
    model, report, ops = optimized(proto)
    assert report.fired["fold_batchnorm"] == 1 and report.fired["fuse_conv"] == 1
    assert ops == {"kiln::FusedConv": 1}
    node = model.graph.node(0)
    assert node.attributes["activation"].value == "Relu" and node.attributes["residual_after_activation"].value == 0
    steps = kiln.build(proto).plan.program.steps
    assert steps[0].fused_from == ["conv", "bn", "residual", "relu"]
    assert_same_as_onnxruntime(proto, {"x": randn(1, 4, 8, 8)}, rtol=1e-4, atol=1e-4)


def test_batchnorm_alone_at_level_1_is_kept():
    _, report, ops = optimized(conv_bn_relu_residual(), level=1)
    assert "fold_batchnorm" not in report.fired and ops["BatchNormalization"] == 1


def test_mul_add_by_per_channel_constants_fold_into_conv_weights():
    x = helper.make_tensor_value_info("x", F, [1, 3, 6, 6])
    y = helper.make_tensor_value_info("y", F, [1, 5, 6, 6])
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["c", "s"], ["m"]), helper.make_node("Add", ["m", "t"], ["y"])]
    inits = [("w", randn(5, 3, 3, 3)), ("b", randn(5)), ("s", randn(5, 1, 1)), ("t", randn(1, 5, 1, 1))]
    proto = make_model(nodes, [x], [y], inits)
    _, report, ops = optimized(proto)
    assert report.fired["fold_constant_mul_add"] == 2 and ops == {"kiln::FusedConv": 1}
    assert_same_as_onnxruntime(proto, {"x": randn(1, 3, 6, 6)}, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bias_first", [True, False])
def test_a_layer_scale_after_a_matmul_bias_folds_into_the_weights(bias_first):
    """ConvNeXt's MLP tail on [N, H, W, C] rows: (x·W + b)·γ -> one FusedGemm, W' = W·γ, b' = b·γ."""
    x = helper.make_tensor_value_info("x", F, [1, 3, 4, 8])
    y = helper.make_tensor_value_info("y", F, [1, 3, 4, 6])
    add = helper.make_node("Add", ["b", "mm"] if bias_first else ["mm", "b"], ["z"])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), add, helper.make_node("Mul", ["gamma", "z"], ["y"])]
    inits = [("w", randn(8, 6)), ("b", randn(6)), ("gamma", randn(1, 1, 1, 6))]
    proto = make_model(nodes, [x], [y], inits)
    _, report, ops = optimized(proto)
    assert report.fired["fold_scale_through_matmul_bias"] == 1 and ops == {"kiln::FusedGemm": 1}
    assert_same_as_onnxruntime(proto, {"x": randn(1, 3, 4, 8)}, rtol=1e-5, atol=1e-5)


def test_a_scale_that_varies_along_rows_is_not_folded_through_a_matmul_bias():
    x = helper.make_tensor_value_info("x", F, [3, 4, 8])
    y = helper.make_tensor_value_info("y", F, [3, 4, 6])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["z"]),
             helper.make_node("Mul", ["z", "s"], ["y"])]
    inits = [("w", randn(8, 6)), ("b", randn(6)), ("s", randn(4, 1))]  # one scale per row: not W's columns
    proto = make_model(nodes, [x], [y], inits)
    _, report, ops = optimized(proto)
    assert "fold_scale_through_matmul_bias" not in report.fired and ops["Mul"] == 1
    assert_same_as_onnxruntime(proto, {"x": randn(3, 4, 8)}, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act, expected", [("Relu", "Relu"), ("Sigmoid", "Sigmoid"), ("SiLU", "SiLU"),
                                           ("Clip", "Clip"), ("Gelu", "Gelu")])
def test_matmul_bias_activation_becomes_fused_gemm(act, expected):
    x = helper.make_tensor_value_info("x", F, [2, 5, 8])
    y = helper.make_tensor_value_info("y", F, [2, 5, 6])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["z"])]
    if act == "SiLU":
        nodes += [helper.make_node("Sigmoid", ["z"], ["s"]), helper.make_node("Mul", ["z", "s"], ["y"])]
    elif act == "Clip":
        nodes += [helper.make_node("Clip", ["z", "lo", "hi"], ["y"])]
    else:
        nodes += [helper.make_node(act, ["z"], ["y"])]
    inits = [("w", randn(8, 6)), ("b", randn(6)), ("lo", np.array(0, np.float32)), ("hi", np.array(6, np.float32))]
    proto = make_model(nodes, [x], [y], inits, opset=20)
    model, report, ops = optimized(proto)
    assert report.fired["fuse_gemm"] == 1 and ops == {"kiln::FusedGemm": 1}
    assert model.graph.node(0).attributes["activation"].value == expected
    assert_same_as_onnxruntime(proto, {"x": randn(2, 5, 8)}, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("then_norm", [True, False])
def test_a_residual_read_by_a_layer_norm_is_left_to_the_norm(then_norm):
    """x@W + b + r -> LayerNorm: the GEMM takes the bias, the norm the residual (one pass fewer);
    without a norm after it, the GEMM epilogue takes the residual."""
    x = helper.make_tensor_value_info("x", F, [2, 5, 8])
    r = helper.make_tensor_value_info("r", F, [2, 5, 6])
    y = helper.make_tensor_value_info("y", F, [2, 5, 6])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["z"]),
             helper.make_node("Add", ["z", "r"], ["s" if then_norm else "y"])]
    if then_norm:
        nodes.append(helper.make_node("LayerNormalization", ["s", "g", "beta"], ["y"], axis=-1, epsilon=1e-5))
    inits = [("w", randn(8, 6)), ("b", randn(6)), ("g", randn(6)), ("beta", randn(6))]
    proto = make_model(nodes, [x, r], [y], inits, opset=20)
    model, report, ops = optimized(proto)
    gemm = next(n for n in model.graph if n.op_type == "FusedGemm")
    if then_norm:
        assert ops == {"kiln::FusedGemm": 1, "kiln::LayerNorm": 1} and report.fired["fuse_skip_layer_norm"] == 1
        assert len(gemm.inputs) == 3  # x, w, bias: no residual
        assert any("left to fuse_skip_layer_norm" in line for line in report.refused)
    else:
        assert ops == {"kiln::FusedGemm": 1} and len(gemm.inputs) == 4
    assert_same_as_onnxruntime(proto, {"x": randn(2, 5, 8), "r": randn(2, 5, 6)}, rtol=1e-5, atol=1e-5)


def test_gemm_alpha_beta_transb_fold_into_fused_gemm():
    a = helper.make_tensor_value_info("a", F, [3, 4])
    y = helper.make_tensor_value_info("y", F, [3, 5])
    nodes = [helper.make_node("Gemm", ["a", "w", "c"], ["y"], alpha=0.5, beta=2.0, transB=1)]
    proto = make_model(nodes, [a], [y], [("w", randn(5, 4)), ("c", randn(5))])
    _, report, ops = optimized(proto)
    assert ops == {"kiln::FusedGemm": 1}
    assert_same_as_onnxruntime(proto, {"a": randn(3, 4)})


def _gelu_erf_nodes():
    return [helper.make_node("Div", ["x", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
            helper.make_node("Add", ["e", "one"], ["a"]), helper.make_node("Mul", ["x", "a"], ["m"]),
            helper.make_node("Mul", ["m", "half"], ["y"])]


def _gelu_tanh_nodes():
    return [helper.make_node("Mul", ["x", "half"], ["hx"]), helper.make_node("Pow", ["x", "three"], ["p"]),
            helper.make_node("Mul", ["p", "k"], ["kp"]), helper.make_node("Add", ["x", "kp"], ["s"]),
            helper.make_node("Mul", ["s", "c"], ["sc"]), helper.make_node("Tanh", ["sc"], ["t"]),
            helper.make_node("Add", ["t", "one"], ["a"]), helper.make_node("Mul", ["hx", "a"], ["y"])]


@pytest.mark.parametrize("form", ["erf", "tanh"])
def test_decomposed_gelu_is_recognised(form):
    x = helper.make_tensor_value_info("x", F, [4, 16])
    y = helper.make_tensor_value_info("y", F, [4, 16])
    scalars = {"sqrt2": math.sqrt(2), "one": 1.0, "half": 0.5, "three": 3.0, "k": 0.044715,
               "c": math.sqrt(2 / math.pi)}
    nodes = _gelu_erf_nodes() if form == "erf" else _gelu_tanh_nodes()
    proto = make_model(nodes, [x], [y], [(k, np.array(v, np.float32)) for k, v in scalars.items()])
    model, report, ops = optimized(proto)
    assert report.fired["fuse_gelu"] == 1 and ops == {"kiln::Gelu": 1}
    assert model.graph.node(0).attributes["approximate"].value == ("none" if form == "erf" else "tanh")
    assert_same_as_onnxruntime(proto, {"x": randn(4, 16) * 3})


def test_decomposed_layer_norm_rms_norm_and_softmax():
    x = helper.make_tensor_value_info("x", F, [2, 3, 8])
    outs = [helper.make_tensor_value_info(n, F, [2, 3, 8]) for n in ("ln", "rms", "sm")]
    nodes = [  # LayerNorm
        helper.make_node("ReduceMean", ["x", "last"], ["mu"]), helper.make_node("Sub", ["x", "mu"], ["d"]),
        helper.make_node("Pow", ["d", "two"], ["d2"]), helper.make_node("ReduceMean", ["d2", "last"], ["var"]),
        helper.make_node("Add", ["var", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["sd"]),
        helper.make_node("Div", ["d", "sd"], ["n"]), helper.make_node("Mul", ["n", "gamma"], ["ng"]),
        helper.make_node("Add", ["ng", "beta"], ["ln"]),
        # RMSNorm
        helper.make_node("Pow", ["x", "two"], ["x2"]), helper.make_node("ReduceMean", ["x2", "last"], ["ms"]),
        helper.make_node("Add", ["ms", "eps"], ["mse"]), helper.make_node("Sqrt", ["mse"], ["rs"]),
        helper.make_node("Reciprocal", ["rs"], ["inv"]), helper.make_node("Mul", ["x", "inv"], ["xn"]),
        helper.make_node("Mul", ["gamma", "xn"], ["rms"]),
        # Softmax
        helper.make_node("ReduceMax", ["x", "last"], ["mx"]), helper.make_node("Sub", ["x", "mx"], ["xs"]),
        helper.make_node("Exp", ["xs"], ["ex"]), helper.make_node("ReduceSum", ["ex", "last"], ["se"]),
        helper.make_node("Div", ["ex", "se"], ["sm"]),
    ]
    inits = [("last", np.array([-1], np.int64)), ("two", np.array(2, np.float32)), ("eps", np.array(1e-5, np.float32)),
             ("gamma", randn(8)), ("beta", randn(8))]
    proto = make_model(nodes, [x], outs, inits)
    _, report, ops = optimized(proto)
    assert ops == {"kiln::LayerNorm": 1, "kiln::RMSNorm": 1, "kiln::Softmax": 1}
    assert report.fired["fuse_layer_norm"] == report.fired["fuse_rms_norm"] == report.fired["fuse_softmax"] == 1
    assert_same_as_onnxruntime(proto, {"x": randn(2, 3, 8)}, rtol=1e-4, atol=1e-5)


def attention_model(gqa: bool):
    """Q/K/V [B, S, H·D] -> heads -> softmax(q·kᵀ/√D + mask) -> v -> [B, S, H, D], torchlib style."""
    b, s, h, hk, d = 2, 5, 4, 2 if gqa else 4, 8
    q = helper.make_tensor_value_info("q", F, [b, s, h, d])
    k = helper.make_tensor_value_info("k", F, [b, s, hk, d])
    v = helper.make_tensor_value_info("v", F, [b, s, hk, d])
    mask = helper.make_tensor_value_info("mask", F, [1, 1, s, s])
    y = helper.make_tensor_value_info("y", F, [b, s, h, d])
    nodes = [helper.make_node("Transpose", [n], [n + "t"], perm=[0, 2, 1, 3]) for n in "qkv"]
    kk, vv = "kt", "vt"
    if gqa:
        for n in ("k", "v"):
            nodes += [helper.make_node("Unsqueeze", [n + "t", "axis2"], [n + "u"]),
                      helper.make_node("Expand", [n + "u", "rep_shape"], [n + "e"])]
        nodes += [helper.make_node("Reshape", ["ve", "heads"], ["vr"])]
        kk, vv = "ke", "vr"
    nodes += [
        helper.make_node("Reshape", [kk, "bh_s_d"], ["k3"]), helper.make_node("Transpose", ["k3"], ["k3t"], perm=[0, 2, 1]),
        helper.make_node("Reshape", ["k3t", "b_h_d_s"], ["k4t"]),
        helper.make_node("Mul", ["qt", "root_scale"], ["qs"]), helper.make_node("Mul", ["k4t", "root_scale"], ["ks"]),
        helper.make_node("MatMul", ["qs", "ks"], ["scores"]), helper.make_node("Add", ["scores", "mask"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["p"], axis=-1), helper.make_node("IsNaN", ["p"], ["nan"]),
        helper.make_node("Where", ["nan", "zero", "p"], ["p0"]),
        helper.make_node("MatMul", ["p0", vv], ["o"]), helper.make_node("Transpose", ["o"], ["y"], perm=[0, 2, 1, 3]),
    ]
    inits = [("bh_s_d", np.array([b * h, s, d], np.int64)), ("b_h_d_s", np.array([b, h, d, s], np.int64)),
             ("root_scale", np.array(d ** -0.25, np.float32)), ("zero", np.array(0, np.float32)),
             ("axis2", np.array([2], np.int64)), ("rep_shape", np.array([b, hk, h // hk, s, d], np.int64)),
             ("heads", np.array([b, h, s, d], np.int64))]
    return make_model(nodes, [q, k, v, mask], [y], inits), (b, s, h, hk, d)


@pytest.mark.parametrize("gqa", [False, True])
def test_attention_becomes_one_kiln_attention(gqa):
    proto, (b, s, h, hk, d) = attention_model(gqa)
    model, report, ops = optimized(proto)
    assert report.fired["fuse_attention"] == 1 and ops == {"kiln::Attention": 1}
    node = model.graph.node(0)
    assert node.attributes["gqa"].value == int(gqa)
    assert node.attributes["scale"].value == pytest.approx(d ** -0.5, rel=1e-6)
    causal = np.triu(np.full((s, s), -np.inf, np.float32), 1)[None, None]
    feeds = {"q": randn(b, s, h, d), "k": randn(b, s, hk, d), "v": randn(b, s, hk, d), "mask": causal}
    assert_same_as_onnxruntime(proto, feeds, rtol=1e-5, atol=1e-5)


def test_why_not_reports_a_refused_fusion():
    # Conv whose output is read by Relu and also by a graph output: the Relu cannot be absorbed.
    x = helper.make_tensor_value_info("x", F, [1, 2, 4, 4])
    outs = [helper.make_tensor_value_info(n, F, [1, 2, 4, 4]) for n in ("c", "y")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"), helper.make_node("Relu", ["c"], ["y"])]
    proto = make_model(nodes, [x], outs, [("w", randn(2, 2, 1, 1))])
    model = onnx_frontend.load(proto)
    reasons = why_not(model)
    assert any("fuse_conv at node 'conv'" in r and "Relu" in r for r in reasons), reasons
    assert [n.op_type for n in model.graph] == ["Conv", "Relu"]  # the caller's model is untouched


def test_elementwise_chain_becomes_one_step():
    # y = relu(a * b + c) - sigmoid(a): the intermediates are read only inside the chain
    ins = [helper.make_tensor_value_info(n, F, [3, 4]) for n in "abc"]
    y = helper.make_tensor_value_info("y", F, [3, 4])
    nodes = [helper.make_node("Mul", ["a", "b"], ["ab"]), helper.make_node("Add", ["ab", "c"], ["s"]),
             helper.make_node("Relu", ["s"], ["r"]), helper.make_node("Sigmoid", ["a"], ["g"]),
             helper.make_node("Sub", ["r", "g"], ["y"])]
    proto = make_model(nodes, ins, [y])
    model, report, ops = optimized(proto)
    assert report.fired["fuse_elementwise"] == 1 and ops == {"kiln::Elementwise": 1}
    assert list(model.graph.node(0).attributes["code"].value) == [
        "Mul i0 i1", "Add t0 i2", "Relu t1", "Sigmoid i0", "Sub t2 t3"]
    assert_same_as_onnxruntime(proto, {n: randn(3, 4) for n in "abc"})
