"""Fold BatchNormalization, and Mul/Add by constants, into the preceding Conv/Gemm/MatMul.

BatchNormalization at inference is a per-channel affine map:

    y = (x - μ) · γ/σ + β,   σ = sqrt(var + ε)

and after a linear layer x = W∗a + b it is absorbed into the layer's weights:

    W' = W · γ/σ  (per output channel),   b' = (b - μ) · γ/σ + β

The same algebra folds a later Mul by a per-channel constant s (W' = W·s, b' = b·s) and a
later Add of a per-channel constant t (b' = b + t). A MatMul's bias is an Add of its own, so a scale
after it is folded through that Add: (x·W + b)·s = x·(W·s) + b·s (ConvNeXt's layer scale). These are exact in real arithmetic; in
floating point they round once more, like the original computation, in a different place.

A BatchNormalization no layer can absorb (after a Concat or a pool, or a Conv whose output is read elsewhere:
DenseNet's BN-ReLU-Conv, a pre-activation ResNet's) becomes that affine map as a Mul and an Add by per-channel
constants (`batchnorm_as_affine`, a CPU fusion rule run just before the elementwise chains are fused): its ReLU and
whatever else follows joins them in one kiln::Elementwise, which the CPU runs inside its native segments.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.passes._rewrite import (
    PassReport,
    attr,
    bypass,
    bypass_refusal,
    const,
    is_op,
    new_initializer,
    only_user,
    other_input,
    producer,
    record_absorbed,
    replace_with,
    run_rule,
)


def _channel_vector(c: np.ndarray, out_rank: int, channel_axis: int, channels: int) -> np.ndarray | None:
    """c as one value per output channel, if c broadcasts along `channel_axis` only."""
    if c.ndim > out_rank:
        return None
    padded = (1,) * (out_rank - c.ndim) + c.shape
    if any(n != 1 for i, n in enumerate(padded) if i != channel_axis) or padded[channel_axis] not in (1, channels):
        return None
    return np.broadcast_to(c.reshape(-1), (channels,)).astype(np.float64)


def _layer(value: ir.Value) -> tuple[ir.Node, int, int] | None:
    """(Conv/Gemm/MatMul node, channel axis of its output, channels) whose constant weights can absorb a scale."""
    node = producer(value)
    if node is None or node.domain != "" or only_user(value) is None or value.shape is None:
        return None
    rank = len(value.shape)
    if node.op_type == "Conv" and const(node.inputs[1]) is not None:
        if len(node.inputs) > 2 and node.inputs[2] is not None and const(node.inputs[2]) is None:
            return None
        return node, 1, const(node.inputs[1]).shape[0]
    if node.op_type == "Gemm" and const(node.inputs[1]) is not None and rank == 2:
        if len(node.inputs) > 2 and node.inputs[2] is not None and const(node.inputs[2]) is None:
            return None
        w = const(node.inputs[1])
        return node, 1, w.shape[0] if attr(node, "transB", 0) else w.shape[1]
    if node.op_type == "MatMul" and const(node.inputs[1]) is not None and const(node.inputs[1]).ndim == 2:
        return node, rank - 1, const(node.inputs[1]).shape[1]
    return None


def _scale_layer(layer: ir.Node, scale: np.ndarray | None, shift: np.ndarray | None) -> None:
    """layer(x) -> layer(x)·scale + shift, by rewriting its weights (per output channel)."""
    graph = layer.graph
    w = const(layer.inputs[1])
    dtype = w.dtype
    if scale is not None:
        if layer.op_type == "Conv":
            w = w * scale.reshape((-1,) + (1,) * (w.ndim - 1))
        elif layer.op_type == "Gemm" and attr(layer, "transB", 0):
            w = w * scale[:, None]
        else:  # Gemm without transB, MatMul: W is [K, N]
            w = w * scale[None, :]
        layer.replace_input_with(1, new_initializer(graph, f"{layer.inputs[1].name}_folded", w.astype(dtype)))
    if layer.op_type == "MatMul":
        return
    bias = const(layer.inputs[2]) if len(layer.inputs) > 2 and layer.inputs[2] is not None else None
    if bias is None and shift is None and scale is not None:
        return
    b = np.zeros(1) if bias is None else bias.astype(np.float64)
    if layer.op_type == "Gemm":
        b = b * attr(layer, "beta", 1.0)
        layer.attributes["beta"] = ir.AttrFloat32("beta", 1.0)
    if scale is not None:
        b = b * scale
    if shift is not None:
        b = b + shift
    if layer.op_type == "Conv" and b.shape != (scale if scale is not None else shift).shape:
        b = np.broadcast_to(b, (const(layer.inputs[1]).shape[0],))
    name = layer.inputs[2].name if bias is not None else f"{layer.name}_bias"
    b_value = new_initializer(graph, f"{name}_folded", b.astype(dtype))
    if len(layer.inputs) > 2:
        layer.replace_input_with(2, b_value)
    else:
        layer.resize_inputs(3)
        layer.replace_input_with(2, b_value)


def _affine(node: ir.Node, params: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The BatchNormalization `node` as y = x·scale + shift per channel, from its constant γ, β, μ, var (float64)."""
    gamma, beta, mean, var = (p.astype(np.float64) for p in params)
    scale = gamma / np.sqrt(var + attr(node, "epsilon", 1e-5))
    return scale, beta - mean * scale


def fold_batchnorm(node: ir.Node, report: PassReport) -> bool:
    # BN(Conv(x, W, b)) -> Conv(x, W·γ/σ, (b - μ)·γ/σ + β)
    if not is_op(node, "BatchNormalization") or len(node.outputs) > 1 and any(v.uses() for v in node.outputs[1:]):
        return False
    if attr(node, "training_mode", 0):
        return False
    found = _layer(node.inputs[0])
    if found is None:
        return False
    layer, axis, channels = found
    if layer.op_type == "MatMul" or axis != 1:
        report.refuse("fold_batchnorm", node, f"the producer {layer.name!r} is a {layer.op_type}, not Conv/Gemm")
        return False
    params = [const(v) for v in node.inputs[1:5]]
    if any(p is None for p in params):
        report.refuse("fold_batchnorm", node, "scale/bias/mean/var are not all constants")
        return False
    if (reason := bypass_refusal(node, node.inputs[0])) is not None:
        report.refuse("fold_batchnorm", node, f"the BatchNormalization cannot be removed: {reason}")
        return False  # decided before the weights change: a kept BN must not apply on scaled weights
    _scale_layer(layer, *_affine(node, params))
    record_absorbed(layer, [node])
    return bypass(node, node.inputs[0])


def fold_constant_mul_add(node: ir.Node, report: PassReport) -> bool:
    # Conv/Gemm/MatMul(x)·s -> with W' = W·s, b' = b·s;  Conv/Gemm(x) + t -> with b' = b + t
    if not is_op(node, "Mul", "Add"):
        return False
    for value in node.inputs:
        found = _layer(value)
        if found is None:
            continue
        layer, axis, channels = found
        c = const(other_input(node, value))
        if c is None or not np.issubdtype(c.dtype, np.floating):
            continue
        if node.op_type == "Add" and layer.op_type == "MatMul":
            continue  # a MatMul's bias Add becomes the FusedGemm bias instead
        vector = _channel_vector(c, len(value.shape), axis, channels)
        if vector is None or bypass_refusal(node, value) is not None:
            continue
        if node.op_type == "Mul":
            _scale_layer(layer, vector, None)
        else:
            _scale_layer(layer, None, vector)
        record_absorbed(layer, [node])
        return bypass(node, value)
    return False


def _matmul_bias(value: ir.Value) -> tuple[ir.Node, ir.Node, ir.Value, int] | None:
    """(Add, MatMul, the Add's constant input, channels) when value = MatMul(x, W) + c, W a constant matrix, c
    constant, each value read only along this chain."""
    add = producer(value)
    if not is_op(add, "Add") or only_user(value) is None or value.shape is None:
        return None
    for mm_value in add.inputs:
        found = _layer(mm_value)
        if found is None or found[0].op_type != "MatMul":
            continue
        c_value = other_input(add, mm_value)
        c = const(c_value)
        if c is None or not np.issubdtype(c.dtype, np.floating) or c_value.is_graph_input():
            continue
        return add, found[0], c_value, found[2]
    return None


def fold_scale_through_matmul_bias(node: ir.Node, report: PassReport) -> bool:
    # (MatMul(x, W) + c)·s -> MatMul(x, W·s) + c·s,   s per output channel
    if not is_op(node, "Mul"):
        return False
    for value in node.inputs:
        found = _matmul_bias(value)
        if found is None:
            continue
        add, matmul, c_value, channels = found
        s = const(other_input(node, value))
        if s is None or not np.issubdtype(s.dtype, np.floating):
            continue
        vector = _channel_vector(s, len(value.shape), len(value.shape) - 1, channels)
        c = const(c_value)
        if vector is None or c.ndim > len(value.shape) or (c.ndim and c.shape[-1] not in (1, channels)):
            report.refuse("fold_scale_through_matmul_bias", node, "the scale or the bias is not per output channel")
            continue
        if (reason := bypass_refusal(node, value)) is not None:
            report.refuse("fold_scale_through_matmul_bias", node, f"the Mul cannot be removed: {reason}")
            continue
        _scale_layer(matmul, vector, None)
        scaled = (c.astype(np.float64) * vector).astype(c.dtype)  # broadcasts over the last axis
        add.replace_input_with(list(add.inputs).index(c_value),
                               new_initializer(add.graph, f"{c_value.name}_scaled", scaled))
        record_absorbed(matmul, [node])
        return bypass(node, value)
    return False


def fold_batchnorm_and_affine(model: ir.Model, report: PassReport) -> int:
    return (run_rule(model, "fold_batchnorm", fold_batchnorm, report)
            + run_rule(model, "fold_constant_mul_add", fold_constant_mul_add, report)
            + run_rule(model, "fold_scale_through_matmul_bias", fold_scale_through_matmul_bias, report))


def batchnorm_as_affine(node: ir.Node, report: PassReport) -> bool:
    # BN(x) -> Add(Mul(x, γ/σ), β - μ·γ/σ), the constants [C, 1, ...] (x: [N, C, ...])
    if not is_op(node, "BatchNormalization") or attr(node, "training_mode", 0):
        return False
    if any(v.uses() or v.is_graph_output() for v in node.outputs[1:]):
        return False
    x = node.inputs[0]
    params = [const(v) for v in node.inputs[1:5]]
    if x.shape is None or len(x.shape) < 2 or x.dtype is None or any(p is None for p in params):
        report.refuse("batchnorm_as_affine", node, "an input of unknown rank or dtype, or parameters computed at run "
                                                   "time")
        return False
    scale, shift = _affine(node, params)
    dtype = x.dtype.numpy()
    broadcast = (-1,) + (1,) * (len(x.shape) - 2)  # along axis 1 of x
    graph = node.graph
    mul = ir.Node("", "Mul", [x, new_initializer(graph, f"{node.name}_scale", scale.astype(dtype).reshape(broadcast))],
                  name=f"{node.name}_scale")
    mul.outputs[0].type, mul.outputs[0].shape = x.type, x.shape
    graph.insert_before(node, mul)
    add = ir.Node("", "Add", [mul.outputs[0],
                              new_initializer(graph, f"{node.name}_shift", shift.astype(dtype).reshape(broadcast))],
                  name=node.name)
    replace_with([node], add, node.outputs[0])
    return True
