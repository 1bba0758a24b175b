"""kiln::LayerNorm (or ONNX LayerNormalization) -> QuantizeLinear (per tensor) => one kiln::LayerNormQuantize
writing the 8-bit tensor.

    y = LayerNorm(x [+ residual])·γ + β;   y_q = QuantizeLinear(y, s, z)
        =>  y_q, [y] = LayerNormQuantize(x, γ, β, [residual], s, z)

A transformer's quantized GEMMs (QKV, FFN up) read the LayerNorm's output quantized; the float y is
still written when something else reads it (the next block's residual). The quantization happens on
the row while it is in registers: no separate pass reads y back (24,576 x 768 fp16 per LayerNorm at
BERT-base batch 64 x 384). y is rounded to its storage dtype before it is quantized, as the unfused Q
reads it, so the fused op is the unfused pair exactly.

The residual a transformer adds there is the previous LayerNorm's output, which onnxruntime's FP8 QDQ models
quantize for the GEMMs and dequantize for the residual path: a DequantizeLinear of its own per norm (24 in
BERT-base, bench/results/gpu-s21-2026-12-06.md section 5). fuse_dequantize_into_layer_norm_quantize lets the norm
read that E4M3 tensor and its scale itself:

    LayerNormQuantize(x, γ, β, DQ(r_q; s_r), s, z)  =>  LayerNormQuantize(x, γ, β, r_q, s, z, s_r)

exact: the kernel forms float32(r_q)·s_r rounded to x's dtype, the value the DequantizeLinear wrote (E4M3, zero
point 0, per tensor, its output of x's dtype).

CUDA builds (fusion.CUDA_RULES): the op's CUDA tactic is the Triton LayerNorm with the quantizing store
(kiln/tactics/cuda/quant_norm.py). CPU builds have rules of their own below (fuse_int8_*: uint8/int8 only, y_q
the only output, the residual's DequantizeLinear with its zero point), on kiln/kernels/cpu/transformer.c.
"""

from __future__ import annotations

import json

import onnx_ir as ir

from kiln.passes._rewrite import (
    FUSED_FROM,
    KILN_DOMAIN,
    PassReport,
    attr,
    const,
    consumers,
    dtype_of,
    fused_from,
    is_op,
    replace_with,
)
from kiln.passes.fusion.elementwise_dequantize import _zero_value
from kiln.passes.fusion.qdq_propagate import QParams, dequantized, quantized_type

RULE = "fuse_layer_norm_quantize"
RULE_RESIDUAL = "fuse_dequantize_into_layer_norm_quantize"
QUANTIZED_TYPES = (ir.DataType.FLOAT8E4M3FN, ir.DataType.INT8, ir.DataType.UINT8)


def _refusal(norm: ir.Node, quantize: ir.Node) -> str | None:
    """Why the QuantizeLinear cannot move into the LayerNorm's store (None: it can)."""
    if len(norm.outputs) != 1:
        return "the LayerNorm also writes its residual sum (or its mean / inverse deviation)"
    if norm.domain == "" and int(attr(norm, "stash_type", 1)) != 1:
        return "stash_type is not float32"
    if len(quantize.inputs) < 3 or quantize.inputs[2] is None:
        return "the QuantizeLinear has no zero point (its output type is implicit)"
    scale, zero = const(quantize.inputs[1]), const(quantize.inputs[2])
    if scale is None or zero is None or scale.size != 1 or zero.size != 1:
        return "the quantization is not per tensor with constant scale and zero point"
    if quantized_type(quantize.inputs[2]) not in QUANTIZED_TYPES:
        return f"quantized to {quantized_type(quantize.inputs[2])}: the kernel writes float8e4m3fn, int8 or uint8"
    if int(attr(quantize, "block_size", 0) or 0) or not int(attr(quantize, "saturate", 1)):
        return "blocked or non-saturating quantization"
    if float(scale.reshape(-1)[0]) <= 0:
        return "the scale is not positive"
    return None


def fuse_layer_norm_quantize(node: ir.Node, report: PassReport) -> bool:
    """node: a QuantizeLinear whose input a kiln::LayerNorm writes."""
    if not is_op(node, "QuantizeLinear"):
        return False
    norm = node.inputs[0].producer() if node.inputs[0] is not None else None
    if not (is_op(norm, "LayerNorm", domain=KILN_DOMAIN) or is_op(norm, "LayerNormalization")):
        return False
    reason = _refusal(norm, node)
    if reason is not None:
        report.refuse(RULE, node, reason)
        return False
    y = norm.outputs[0]
    keep_float = y.is_graph_output() or consumers(y) != [node]
    inputs = list(norm.inputs) + [None] * (4 - len(norm.inputs)) + [node.inputs[1], node.inputs[2]]
    attributes = [ir.AttrInt64("axis", attr(norm, "axis", -1)), ir.AttrFloat32("epsilon", attr(norm, "epsilon", 1e-5))]
    fused = ir.Node(KILN_DOMAIN, "LayerNormQuantize", inputs, attributes, num_outputs=2 if keep_float else 1,
                    name=norm.name)
    q = node.outputs[0]
    absorbed = fused_from([norm, node])
    if not keep_float:
        replace_with([norm, node], fused, q, insert_before=norm)
        fused.outputs[0].type = q.type
        return True
    # the float y goes on as output 1, under its own name, for its other readers
    out_y = fused.outputs[1]
    out_y.type, out_y.shape = y.type, y.shape
    replace_with([node], fused, q, insert_before=norm)
    fused.outputs[0].type = q.type
    name = y.name
    ir.convenience.replace_all_uses_with(y, out_y, replace_graph_outputs=True)
    norm.graph.remove(norm, safe=True)
    y.name = f"{name}__fused"
    out_y.name = name
    fused.metadata_props[FUSED_FROM] = json.dumps(absorbed)
    return True


def fuse_dequantize_into_layer_norm_quantize(node: ir.Node, report: PassReport) -> bool:
    # LayerNormQuantize(x, γ, β, DQ(r_q; s_r), s, z) -> LayerNormQuantize(x, γ, β, r_q, s, z, s_r)
    """The E4M3 residual's DequantizeLinear into the LayerNormQuantize that adds it (module docstring)."""
    found = _dequantized_residual(node)
    if found is None:
        return False
    dq, params, r_q, value = found
    why = None
    if r_q is None or r_q.dtype != ir.DataType.FLOAT8E4M3FN:
        why = "the residual is not dequantized from float8e4m3fn"
    elif not params.per_tensor or float(params.zero_point.astype("float32").reshape(-1)[0]) != 0.0:
        why = "the residual's DequantizeLinear is per channel or has a zero point"
    elif consumers(value) != [node] or value.is_graph_output():
        why = "the dequantized residual has other readers: it stays a tensor of its own"
    elif dtype_of(value) != dtype_of(node.inputs[0]):
        why = f"the DequantizeLinear writes {dtype_of(value)}, x is {dtype_of(node.inputs[0])}"
    if why is not None:
        report.refuse(RULE_RESIDUAL, node, why)
        return False
    _take_residual(node, dq, r_q, [params.scale_value])
    return True


def _dequantized_residual(node: ir.Node) -> tuple[ir.Node, QParams, ir.Value | None, ir.Value] | None:
    """A LayerNormQuantize of six inputs whose residual comes from a DequantizeLinear: (the DQ, its parameters, its
    quantized input, the dequantized residual), else None. Both residual rules (E4M3 and int8) start here."""
    if not is_op(node, "LayerNormQuantize", domain=KILN_DOMAIN) or len(node.inputs) != 6 or node.inputs[3] is None:
        return None
    found = dequantized(node.inputs[3])
    if found is None:
        return None
    dq, params = found
    return dq, params, dq.inputs[0], node.inputs[3]


def _take_residual(node: ir.Node, dq: ir.Node, r_q: ir.Value, parameters: list[ir.Value]) -> None:
    """The norm reads the quantized residual `r_q` and the DQ's `parameters` (inputs 6, ...) in place of the DQ's
    output; the DQ is recorded as fused and removed once nothing else reads it."""
    node.replace_input_with(3, r_q)
    node.resize_inputs(6 + len(parameters))
    for k, value in enumerate(parameters, 6):
        node.replace_input_with(k, value)
    node.metadata_props[FUSED_FROM] = json.dumps(json.loads(node.metadata_props.get(FUSED_FROM, "[]"))
                                                 + fused_from([dq]))
    if not dq.outputs[0].uses():
        node.graph.remove(dq, safe=True)


# ---- int8 / uint8 (CPU builds) ---------------------------------------------------------------------------------
INT8_RULE = "fuse_int8_layer_norm_quantize"
INT8_RULE_RESIDUAL = "fuse_int8_dequantize_into_layer_norm_quantize"
INT8_TYPES = (ir.DataType.UINT8, ir.DataType.INT8)


def fuse_int8_layer_norm_quantize(node: ir.Node, report: PassReport) -> bool:
    """The uint8/int8 QuantizeLinear after a float32 LayerNorm into the norm's store (CPU builds; the kernel is
    kiln/kernels/cpu/transformer.c kiln_layer_norm_quantize):

        LayerNorm(x, γ, β, [r]) ─ QuantizeLinear(s, z uint8)   =>   LayerNormQuantize(x, γ, β, [r], s, z)

    Why: onnxruntime's QDQ BERT (quantize_static) quantizes each LayerNorm's output for the next GEMMs: a step of
    its own reading the float tensor back (QDQ BERT-tiny: 4 of 44 steps). Exact: the kernel writes y to a row
    buffer as the LayerNorm writes it to memory and quantizes it with QuantizeLinear's own loop. Only where the
    float y has no other reader: the CPU kernel writes y_q alone."""
    # Q(LayerNorm(x, γ, β, [r]), s, z) -> LayerNormQuantize(x, γ, β, [r], s, z)
    if not is_op(node, "QuantizeLinear"):
        return False
    norm = node.inputs[0].producer() if node.inputs[0] is not None else None
    if not (is_op(norm, "LayerNorm", domain=KILN_DOMAIN) or is_op(norm, "LayerNormalization")):
        return False
    if len(node.inputs) < 3 or node.inputs[2] is None or quantized_type(node.inputs[2]) not in INT8_TYPES:
        return False  # E4M3 (a CUDA rule's) or an implicit uint8 (no zero point: _refusal says so)
    y = norm.outputs[0]
    why = _refusal(norm, node)
    if why is None and (y.is_graph_output() or consumers(y) != [node]):
        why = "the LayerNorm's float output has other readers: the CPU kernel writes the 8-bit tensor alone"
    elif why is None and dtype_of(y) != ir.DataType.FLOAT:
        why = f"the LayerNorm computes {dtype_of(y)}: the CPU kernel float32"
    elif why is None and int(attr(norm, "axis", -1)) != -1:
        why = "the norm's axis is not written -1 (the CPU kernel normalizes the last axis)"
    if why is not None:
        report.refuse(INT8_RULE, node, why)
        return False
    return fuse_layer_norm_quantize(node, report)


def fuse_int8_dequantize_into_layer_norm_quantize(node: ir.Node, report: PassReport) -> bool:
    """A uint8/int8 per-tensor DequantizeLinear of the residual into the LayerNormQuantize that adds it (CPU builds):

        LayerNormQuantize(x, γ, β, DQ(r_q; s_r, z_r), s, z)  =>  LayerNormQuantize(x, γ, β, r_q, s, z, s_r, z_r)

    Why: the residual a QDQ BERT block adds in its norm is the previous norm's quantized output dequantized again,
    a step of its own writing a float tensor the norm reads back (QDQ BERT-tiny: 3 of its 4 such DQs are read by
    a LayerNormQuantize). Exact: the kernel dequantizes the row into a buffer with DequantizeLinear's own
    expression, (float32(r_q) - z_r)·s_r, before the norm adds it."""
    # LayerNormQuantize(x, γ, β, DQ(r_q; s_r, z_r), s, z) -> LayerNormQuantize(x, γ, β, r_q, s, z, s_r, z_r)
    found = _dequantized_residual(node)
    if found is None:
        return False
    dq, params, r_q, value = found
    if r_q is None or r_q.dtype not in INT8_TYPES:
        return False
    why = None
    if not params.per_tensor:
        why = "the residual's DequantizeLinear is per channel"
    elif consumers(value) != [node] or value.is_graph_output():
        why = "the dequantized residual has other readers: it stays a tensor of its own"
    elif dtype_of(value) != ir.DataType.FLOAT or dtype_of(node.inputs[0]) != ir.DataType.FLOAT:
        why = f"the DequantizeLinear writes {dtype_of(value)}, x is {dtype_of(node.inputs[0])}: the kernel's float32"
    elif const(r_q) is not None:
        why = "a constant residual (folded, not fused)"
    if why is not None:
        report.refuse(INT8_RULE_RESIDUAL, node, why)
        return False
    _take_residual(node, dq, r_q, [params.scale_value, _zero_value(dq, params)])
    return True
