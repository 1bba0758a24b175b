"""Explicitly quantized layers -> kiln::QConv / kiln::QGemm / kiln::QAdd (kiln/ops/quantized.py).

    DQ(x_q) -> Conv | Gemm | MatMul (DQ(w_q), [bias]) [-> + b] [-> Relu | Clip] [-> Q(s_y, z_y)]
        =>  QConv | QGemm (x_q, s_x, z_x, w_q, s_w, 0, [s_y, z_y], bias_q)

    bias_q = round(b / (s_x·s_w))  (a DQ'd int32 bias at exactly that scale comes back unchanged)

The layer reads the 8-bit tensor itself and, when one Q reads its result, writes the 8-bit result
(else float, for the readers that want float). Weights must be symmetric (zero point 0), int8 or
float8, per tensor or per output channel: what INT8/FP8 kernels compute.

    DQ(a) + DQ(b) [-> Relu] -> Q(s_y, z_y)  =>  QAdd(a, s_a, z_a, b, s_b, z_b, s_y, z_y)

Per-channel activation scales (a depthwise convolution's input, kiln/quant/qdq.py), folded so that
every kernel still sees one scale per activation tensor:

    DQ(x_q; s_x[C], z, axis 1) -> depthwise Conv     =>  QConv(x_q, s0, z, w_q, s_w[o]·s_x[c(o)]/s0, ...)
        output channel o reads input channel c(o) = o·C/O only: Σ s_x[c]·x·s_w[o]·w = s0·(s_w[o]·s_x[c]/s0)·Σ x·w
    layer -> [Relu | Clip] -> Q(s_y[O], z, axis 1)    =>  QConv(..., w_scale = s_w[o]·s0/s_y[o], y_scale = s0)
        round(r[o]/s_y[o]) = round((r[o]·s0/s_y[o]) / s0): the output scale moves into the weight scale,
        the int32 bias (accumulator units) is unchanged; Relu commutes with the positive factor, a Clip
        only where the quantization's own saturation makes it redundant (a ReLU6 whose every channel's
        range is <= 6: then Q clamps at [0, 255·s_y[o]] within [0, 6] already)

s0 = max(s): one zero point for every channel (uniform) is required.

An activation behind a quantize-dequantize pair of the output's own parameters, `-> Q(s, z) -> DQ(s, z)
-> Relu | Clip -> Q(s, z)` (onnxruntime's FP8 models keep their Relus so), is absorbed as if it followed
directly: exact (_activation_behind_round_trip).

a residual Add between quantized tensors (QLinearAdd-style), one pass over 8-bit tensors instead of
two dequantizations, a float add and a quantization.

On CUDA builds, the image's quantization into the stem (fold_quantize_into_stem):

    Q(x; s, z) -> QConv(·, s, z, ...)  =>  QConv(x, s, z, ...)     x float, at most 4 channels, Q read by it alone

the QConv of a float x quantizes it itself (kiln/ops/quantized.py): its space-to-depth kernel in the same pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from kiln.passes._rewrite import (
    KILN_DOMAIN,
    PassReport,
    attr,
    const,
    const_scalar,
    is_op,
    new_initializer,
    only_user,
    other_input,
    producer,
    replace_with,
)
from kiln.passes.fusion.qdq_propagate import QParams, dequantized, qparams, quantized_type

RULE_LAYER = "fuse_quantized_layers"
RULE_ADD = "fuse_quantized_add"
ACTIVATION_TYPES = (ir.DataType.UINT8, ir.DataType.INT8, ir.DataType.FLOAT8E4M3FN)
# a W8A16 layer's input (kiln/quant/qdq.py insert's `wide`): a convolution only, the CPU's two-byte int8 kernel's
WIDE_TYPES = (ir.DataType.UINT16, ir.DataType.INT16)
WEIGHT_TYPES = (ir.DataType.INT8, ir.DataType.FLOAT8E4M3FN)
INT32_LIMIT = 2**31 - 1


@dataclass
class _Weight:
    q: np.ndarray  # QConv: [O, C/g, *k]; QGemm: [N, K]
    scale: np.ndarray  # scalar or [O]/[N]
    dq: ir.Node


def _weight(node: ir.Node, report: PassReport) -> _Weight | str:
    """The layer's weight as the fused op stores it, or why it cannot be."""
    found = dequantized(node.inputs[1])
    if found is None:
        return "the weight is not a DequantizeLinear of constants"
    dq, p = found
    w = const(dq.inputs[0])
    if w is None:
        return "the quantized weight is computed at run time"
    if quantized_type(dq.inputs[0]) not in WEIGHT_TYPES:
        return f"weights of type {quantized_type(dq.inputs[0])}: the kernels take int8 (or float8e4m3fn) weights"
    if np.any(p.zero_point.astype(np.float32) != 0):
        return "the weight's zero point is not 0 (asymmetric weights: no kernel takes them)"
    if node.op_type == "Conv":
        axis = 0
    elif node.op_type == "MatMul":
        if w.ndim != 2:
            return f"the weight is {w.ndim}-D, not a matrix"
        axis = 1
    else:
        axis = 0 if attr(node, "transB", 0) else 1
    if not p.per_tensor and (p.axis % w.ndim != axis or p.scale.size != w.shape[axis]):
        return f"the weight's scales run along axis {p.axis}, not its output channels"
    if axis == 1:  # [K, N] -> [N, K]
        w = np.ascontiguousarray(w.T)
    return _Weight(w, p.scale.reshape(-1) if not p.per_tensor else p.scale.reshape(()), dq)


def _real_bias(value: ir.Value | None, channels: int) -> np.ndarray | None | str:
    """A bias input as float64 [channels] (a DQ'd one dequantized), None when absent, else why not."""
    if value is None:
        return None
    found = dequantized(value)
    if found is not None:
        dq, p = found
        b = const(dq.inputs[0])
        if b is None:
            return "the bias is quantized at run time"
        real = (b.astype(np.float64) - p.zero_point.astype(np.float64)) * p.scale.astype(np.float64)
    else:
        real = const(value)
        if real is None:
            return "the bias is computed at run time"
        real = real.astype(np.float64)
    if real.size != channels or real.squeeze().ndim > 1:
        return f"the bias has shape {list(real.shape)}, not one per output channel ({channels})"
    return real.reshape(-1)


def _bias_after(value: ir.Value, channels: int) -> tuple[ir.Node, np.ndarray] | None:
    """An Add of a constant (or DQ'd constant) [N] bias right after a MatMul: what exporters write for
    a Linear, and onnxruntime's QDQ models keep with the bias DQ'd from int32."""
    add = only_user(value)
    if not is_op(add, "Add") or value.shape is None:
        return None
    other = other_input(add, value)
    shape = other.shape if other is not None else None
    if shape is None or len(shape) > len(value.shape) or any(d != 1 for d in list(shape)[:-1]):
        return None  # not a per-column bias: it would broadcast the layer's output
    real = _real_bias(other, channels)
    return None if real is None or isinstance(real, str) else (add, real)


def _activation(value: ir.Value, gelu: bool = False) -> tuple[ir.Node, str, float, float] | None:
    """Relu or Clip (any layer); Gelu too for a QConv/QGemm (`gelu`): the transformer FFN's up projection."""
    node = only_user(value)
    if is_op(node, "Relu"):
        return node, "Relu", 0.0, 0.0
    if gelu and (is_op(node, "Gelu") or is_op(node, "Gelu", domain=KILN_DOMAIN)):
        return node, "GeluTanh" if attr(node, "approximate", "none") == "tanh" else "Gelu", 0.0, 0.0
    if is_op(node, "Clip") and node.inputs[0] is value:
        bounds = []
        for i, name, default in ((1, "min", -np.inf), (2, "max", np.inf)):
            v = node.inputs[i] if len(node.inputs) > i else None
            bound = attr(node, name, default) if v is None else const_scalar(v)
            if bound is None:
                return None
            bounds.append(float(bound))
        return node, "Clip", bounds[0], bounds[1]
    return None


def _activation_behind_round_trip(value: ir.Value) -> tuple[list[ir.Node], tuple[ir.Node, str, float, float]] | None:
    """`value -> Q(s, z) -> DQ(s, z) -> Relu | Clip -> Q(s, z)`: the activation as if it read `value`.

    What onnxruntime's quantize_static writes when it keeps the activation (FP8, symmetric activations,
    QDQKeepRemovableActivations). Exact: Q is nondecreasing with Q(DQ(q)) = q, so
    Q(act(DQ(Q(r)))) = act_q(Q(r)) = Q(act(r)) for act = max(·, 0) or clamp(·, a, b), where act_q applies
    the same bounds to the quantized value (max(q, z); clamp(q, Q(a), Q(b))). Only with the same s, z
    on both Q: a requantization between them rounds twice."""
    q = only_user(value)
    params = qparams(q) if is_op(q, "QuantizeLinear") else None
    dq = only_user(q.outputs[0]) if params is not None else None
    if not is_op(dq, "DequantizeLinear") or not params.per_tensor:
        return None
    inner = qparams(dq)
    act = _activation(dq.outputs[0])
    after = _quantized_output(act[0].outputs[0]) if act is not None else None
    if inner is None or not inner.same(params) or after is None or not after[1].same(params):
        return None
    return [q, dq], act


def _quantized_output(value: ir.Value, channels: int | None = None) -> tuple[ir.Node, QParams] | None:
    """The QuantizeLinear alone reading `value`: per tensor, or (channels: a convolution's output channels)
    per channel along axis 1 with one zero point for all. Not a 16-bit one (a W8A16 layer's input): no kernel
    writes 16 bits; it stays its own step, folded into its readers (fold_wide_quantize_into_layer)."""
    q = only_user(value)
    p = qparams(q) if is_op(q, "QuantizeLinear") else None
    if p is None or p.zero_value is None or attr(q, "saturate", 1) != 1 or p.zero_point.dtype in (np.uint16, np.int16):
        return None
    if not p.per_tensor and (channels is None or not _per_channel_along(p, value, 1, channels)):
        return None
    return q, p


def _per_channel_along(p: QParams, value: ir.Value, axis: int, channels: int) -> bool:
    """Scales one per channel of `axis`, the zero point the same for all."""
    rank = len(value.shape) if value.shape is not None else None
    along = p.axis == axis if rank is None else rank > axis and p.axis % rank == axis
    return (along and p.scale.size == channels
            and np.all(p.zero_point.reshape(-1) == p.zero_point.reshape(-1)[0]))


def _depthwise_input_factors(node: ir.Node, px: QParams, w_shape: tuple[int, ...]) -> np.ndarray | str:
    """Per output channel, s_x[c(o)] / max(s_x): the per-channel input scales a depthwise convolution folds
    into its weight scales; or why it cannot."""
    if node.op_type != "Conv":
        return "the input is quantized per channel and the layer is not a convolution"
    group = attr(node, "group", 1)
    channels = px.scale.size
    if group != channels or w_shape[1] != 1 or w_shape[0] % channels:
        return (f"the input is quantized per channel ({channels} scales) and the convolution is not depthwise "
                f"(group {group}, weight {list(w_shape)}): its output channels read several input channels")
    if not _per_channel_along(px, node.inputs[0], 1, channels):
        return "the input's per-channel scales are not along its channel axis or its zero points differ"
    s = px.scale.astype(np.float64).reshape(-1)
    return np.repeat(s / s.max(), w_shape[0] // channels)  # output o reads input channel o // multiplier


def _folded_activation(activation: str, alpha: float, beta: float, p: QParams) -> tuple[str, float, float] | None:
    """The activation to run on r·s0/s_y[o] before quantizing with s0 (per-channel output scales folded):
    Relu as it is; Clip(alpha, beta) where the quantization's saturation range, [(qmin - z)·s_y[o],
    (qmax - z)·s_y[o]] for every o, lies inside [alpha, beta] (then Q clamps as tightly: the Clip is
    redundant), or inside [-inf, beta] with alpha = 0 (a Relu); None when neither holds (Gelu, a Clip
    that bites)."""
    if activation in ("", "Relu"):
        return activation, alpha, beta
    if activation != "Clip":
        return None
    z = float(p.zero_point.reshape(-1)[0])
    if p.zero_point.dtype in (np.uint8, np.int8):
        info = np.iinfo(p.zero_point.dtype)
        low, high = (info.min - z) * p.scale.astype(np.float64), (info.max - z) * p.scale.astype(np.float64)
    else:  # float8e4m3fn, zero point 0
        low, high = -448.0 * p.scale.astype(np.float64), 448.0 * p.scale.astype(np.float64)
    if np.all(high <= beta) and np.all(low >= alpha):
        return "", 0.0, 0.0
    if np.all(high <= beta) and alpha == 0.0:
        return "Relu", 0.0, 0.0
    return None


def _scalar(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    return new_initializer(graph, name, np.asarray(array).reshape(()))


def fuse_quantized_layer(node: ir.Node, report: PassReport) -> bool:
    if not is_op(node, "Conv", "Gemm", "MatMul") or len(node.inputs) < 2:
        return False
    found = dequantized(node.inputs[0])
    if found is None:
        return False  # a float layer
    dq_x, px = found
    x_q = dq_x.inputs[0]
    if quantized_type(x_q) not in ACTIVATION_TYPES and not (
            quantized_type(x_q) in WIDE_TYPES and node.op_type == "Conv" and px.per_tensor):
        report.refuse(RULE_LAYER, node, "the input is quantized to a type no kernel reads")
        return False
    weight = _weight(node, report)
    if isinstance(weight, str):
        report.refuse(RULE_LAYER, node, weight)
        return False
    channels = weight.q.shape[0]
    x_scale = px.scale.astype(np.float64).reshape(-1).max()  # s0: the scale the kernel is given
    if not px.per_tensor:  # a depthwise convolution's per-channel input scales, into its weight scales
        factors = _depthwise_input_factors(node, px, weight.q.shape)
        if isinstance(factors, str):
            report.refuse(RULE_LAYER, node, factors)
            return False
        weight = _Weight(weight.q, (weight.scale.astype(np.float64) * factors).astype(np.float32), weight.dq)
    if node.op_type == "Gemm" and (attr(node, "transA", 0) or attr(node, "alpha", 1.0) != 1.0
                                   or (len(node.inputs) > 2 and node.inputs[2] is not None
                                       and attr(node, "beta", 1.0) != 1.0)):
        report.refuse(RULE_LAYER, node, "Gemm with transA, alpha or beta other than 0, 1, 1")
        return False
    if node.op_type == "MatMul" and (node.inputs[0].shape is None or len(node.inputs[0].shape) < 2):
        report.refuse(RULE_LAYER, node, "the input rank is unknown or 1")
        return False
    bias = _real_bias(node.inputs[2] if len(node.inputs) > 2 else None, channels)
    if isinstance(bias, str):
        report.refuse(RULE_LAYER, node, bias)
        return False
    absorbed: list[ir.Node] = [node]
    out = node.outputs[0]
    if bias is None and node.op_type == "MatMul" and (after := _bias_after(out, channels)):
        absorbed.append(after[0])
        bias, out = after[1], after[0].outputs[0]
    activation, alpha, beta = "", 0.0, 0.0
    if act := _activation(out, gelu=True):
        absorbed.append(act[0])
        activation, alpha, beta, out = act[1], act[2], act[3], act[0].outputs[0]
    elif found := _activation_behind_round_trip(out):
        absorbed += found[0] + [found[1][0]]
        activation, alpha, beta, out = found[1][1], found[1][2], found[1][3], found[1][0].outputs[0]
    scale = x_scale * weight.scale.astype(np.float64)  # scalar or [O]: the accumulator's unit
    bias_q = None if bias is None else np.round(bias / scale)
    if bias_q is not None and np.abs(bias_q).max(initial=0) > INT32_LIMIT:
        report.refuse(RULE_LAYER, node, "the bias does not fit int32 at the scale x_scale·w_scale")
        return False
    output = _quantized_output(out, channels if node.op_type == "Conv" else None)
    y_scale = None
    if output is not None and not output[1].per_tensor:  # per-channel output scales, into the weight scales
        folded = _folded_activation(activation, alpha, beta, output[1])
        if folded is None:
            output = None  # the layer writes float; the QuantizeLinear stays
        else:
            activation, alpha, beta = folded
            s_y = output[1].scale.astype(np.float64).reshape(-1)
            weight = _Weight(weight.q, (weight.scale.astype(np.float64) * s_y.max() / s_y).astype(np.float32),
                             weight.dq)
            y_scale = s_y.max()
    # decided: the graph changes from here on
    graph = node.graph
    zero_point = px.zero_point.reshape(-1)[0].reshape(())
    x_params = [px.scale_value, px.zero_value or _scalar(graph, f"{x_q.name}_zero", zero_point)] if px.per_tensor \
        else [_scalar(graph, f"{node.name}_x_scale", np.float32(x_scale)),
              _scalar(graph, f"{node.name}_x_zero", zero_point)]
    inputs: list[ir.Value | None] = [x_q, *x_params]
    inputs += [new_initializer(graph, f"{node.name}_weight_q", weight.q),
               new_initializer(graph, f"{node.name}_weight_scale", weight.scale.astype(np.float32)),
               new_initializer(graph, f"{node.name}_weight_zero",
                               np.zeros(weight.scale.shape, quantized_type(weight.dq.inputs[0]).numpy()))]
    if output is not None:
        absorbed.append(output[0])
        if y_scale is None:
            inputs += [output[1].scale_value, output[1].zero_value]
        else:
            inputs += [_scalar(graph, f"{node.name}_y_scale", np.float32(y_scale)),
                       _scalar(graph, f"{node.name}_y_zero", output[1].zero_point.reshape(-1)[0].reshape(()))]
        out = output[0].outputs[0]
    else:
        inputs += [None, None]
    if bias_q is not None:
        inputs.append(new_initializer(graph, f"{node.name}_bias_q", bias_q.astype(np.int32)))
    while inputs[-1] is None:
        inputs.pop()
    attributes = [a for a in node.attributes.values()] if node.op_type == "Conv" else []
    float_type = node.outputs[0].dtype or ir.DataType.FLOAT
    attributes += [ir.AttrString("activation", activation), ir.AttrFloat32("alpha", alpha),
                   ir.AttrFloat32("beta", beta), ir.AttrInt64("output_dtype", int(float_type))]
    op = "QConv" if node.op_type == "Conv" else "QGemm"
    fused = ir.Node(KILN_DOMAIN, op, inputs, attributes, name=node.name)
    replace_with(absorbed, fused, out)
    if output is not None:  # the quantized type, whatever the Q's output declared
        fused.outputs[0].type = ir.TensorType(ir.DataType.from_numpy(output[1].zero_point.dtype))
    return True


def fuse_quantized_add(node: ir.Node, report: PassReport) -> bool:
    if not is_op(node, "Add"):
        return False
    a, b = (dequantized(v) for v in node.inputs[:2])
    if a is None or b is None:
        return False
    if not (a[1].per_tensor and b[1].per_tensor):
        report.refuse(RULE_ADD, node, "an input is quantized per channel")
        return False
    out = node.outputs[0]
    absorbed = [node]
    activation, alpha, beta = "", 0.0, 0.0
    if act := _activation(out):
        absorbed.append(act[0])
        activation, alpha, beta, out = act[1], act[2], act[3], act[0].outputs[0]
    elif found := _activation_behind_round_trip(out):
        absorbed += found[0] + [found[1][0]]
        activation, alpha, beta, out = found[1][1], found[1][2], found[1][3], found[1][0].outputs[0]
    output = _quantized_output(out)
    if output is None:
        report.refuse(RULE_ADD, node, "its result is not quantized by one QuantizeLinear: the Add stays in float")
        return False
    absorbed.append(output[0])
    graph = node.graph
    inputs = []
    for dq, p in (a, b):
        inputs += [dq.inputs[0], p.scale_value, p.zero_value or _scalar(graph, f"{dq.inputs[0].name}_zero",
                                                                        p.zero_point)]
    inputs += [output[1].scale_value, output[1].zero_value]
    attributes = [ir.AttrString("activation", activation), ir.AttrFloat32("alpha", alpha),
                  ir.AttrFloat32("beta", beta), ir.AttrInt64("output_dtype", int(out.dtype or ir.DataType.FLOAT))]
    fused = ir.Node(KILN_DOMAIN, "QAdd", inputs, attributes, name=node.name)
    replace_with(absorbed, fused, output[0].outputs[0])
    fused.outputs[0].type = ir.TensorType(ir.DataType.from_numpy(output[1].zero_point.dtype))
    return True


RULE_STEM = "fold_quantize_into_stem"
FLOAT_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
STEM_CHANNELS = 4  # the space-to-depth stem's most input channels (kiln/kernels/cuda/triton/qstem.py)


def fold_quantize_into_stem(node: ir.Node, report: PassReport) -> bool:
    # QConv(Q(x; s, z), s, z, ...) -> QConv(x, s, z, ...)    x float: the layer quantizes it (kiln/ops/quantized.py)
    """The image's QuantizeLinear into the stem's QConv (CUDA builds): the space-to-depth kernel quantizes as it lays
    the image out, one pass over the float image where the Q step read it, wrote 8 bits, and the fold read those
    again. Only a stem of at most 4 channels: a wider layer reads its 8-bit input tap by tap, several times over,
    where a float read costs 2-4x the bytes."""
    if not is_op(node, "QConv", domain=KILN_DOMAIN):
        return False
    q = producer(node.inputs[0], "QuantizeLinear")
    if q is None:
        return False
    x, params = q.inputs[0], qparams(q)
    if x is None or x.dtype not in FLOAT_TYPES or const(x) is not None:
        return False
    why = None
    if only_user(node.inputs[0]) is not node:
        why = "the 8-bit input has other readers: it stays a tensor of its own"
    elif params is None or not params.per_tensor or params.zero_point.dtype not in (np.int8, np.uint8):
        why = "the input is not quantized per tensor to int8 / uint8"
    elif len(node.inputs) > 9 and node.inputs[9] is not None:
        why = "a residual layer (the folded quantization is the stem's)"
    elif x.shape is None or len(x.shape) != 4 or not isinstance(x.shape[1], int) or x.shape[1] > STEM_CHANNELS:
        why = f"input {x.shape}: not a stem of at most {STEM_CHANNELS} channels (the space-to-depth kernel's)"
    elif not (np.array_equal(const(node.inputs[1]), params.scale) and
              np.array_equal(const(node.inputs[2]), params.zero_point)):
        why = "the layer's x scale / zero point are not the QuantizeLinear's"
    return _fold_quantize(node, q, x, RULE_STEM, why, report)


RULE_WIDE = "fold_wide_quantize_into_layer"


def fold_wide_quantize_into_layer(node: ir.Node, report: PassReport) -> bool:
    # QConv(Q16(x; s, z), s, z, ...) -> QConv(x, s, z, ...)    x float: the layer quantizes it (kiln/ops/quantized.py)
    """A W8A16 layer's 16-bit QuantizeLinear into the layer (CPU builds): its kernel (kiln/tactics/cpu/w8a16.py)
    splits the float input into the 16-bit value's two bytes in one pass, so the 16-bit tensor is never stored and
    read again. Every reader of the 16-bit tensor is a QConv of the same scale and zero point (the 16-bit pairs
    qdq.insert makes are one per activation, read by the W8A16 layers alone); each then reads the float x."""
    if not is_op(node, "QConv", domain=KILN_DOMAIN):
        return False
    q = producer(node.inputs[0], "QuantizeLinear")
    if q is None:
        return False
    x, params = q.inputs[0], qparams(q)
    if x is None or x.dtype != ir.DataType.FLOAT or const(x) is not None:
        return False
    if params is None or params.zero_point.dtype not in (np.int16, np.uint16):
        return False  # an 8-bit input: fold_quantize_into_stem's, on CUDA
    why = None
    if not params.per_tensor:
        why = "the 16-bit input is quantized per channel"
    elif node.inputs[0].is_graph_output() or \
            any(not is_op(use.node, "QConv", domain=KILN_DOMAIN) for use in node.inputs[0].uses()):
        why = "the 16-bit input has readers other than QConv layers: it stays a tensor of its own"
    elif len(node.inputs) > 9 and node.inputs[9] is not None:
        why = "a residual layer"
    elif not (np.array_equal(const(node.inputs[1]), params.scale) and
              np.array_equal(const(node.inputs[2]), params.zero_point)):
        why = "the layer's x scale / zero point are not the QuantizeLinear's"
    return _fold_quantize(node, q, x, RULE_WIDE, why, report)


def _fold_quantize(node: ir.Node, q: ir.Node, x: ir.Value, rule: str, why: str | None, report: PassReport) -> bool:
    """The layer reads the float x its QuantizeLinear q read (the layer quantizes it), or `why` not, refused for
    `rule`; q goes once nothing reads it (fold_quantize_into_stem's and fold_wide_quantize_into_layer's end)."""
    if why is not None:
        report.refuse(rule, node, why)
        return False
    node.replace_input_with(0, x)
    if not q.outputs[0].uses():
        node.graph.remove(q, safe=True)
    return True
