"""Q/DQ propagation: the 8-bit tensor travels through the ops that only move or pick values, and
quantize-dequantize round trips that change nothing disappear.

    op(DQ(q; s, z)) = DQ(op(q); s, z)       op ∈ MaxPool, Reshape, Flatten, Transpose, Squeeze,
                                            Unsqueeze (per-tensor s, z: they commute with every
                                            value-moving op; MaxPool because DQ is increasing, s > 0)
    Concat(DQ(q1; s, z), DQ(q2; s, z)) = DQ(Concat(q1, q2); s, z)
    Q(DQ(q; s, z); s, z) = q                rounding s·(q − z)/s + z gives q back; in range already

So a quantized model's `DQ -> MaxPool -> Q -> DQ -> Conv` becomes `MaxPool(q) -> DQ -> Conv`, which
kiln/passes/fusion/qdq_layers.py then turns into a MaxPool on the 8-bit tensor feeding a QConv.

The other way, a QuantizeLinear rises above the head split/merge of attention (as onnxruntime's own QDQ
propagation does), taking a scale by a scalar with it, and above a MaxPool:

    Q(op(x); s, z) = op(Q(x; s, z))                  op ∈ Reshape, Transpose, MaxPool (per-tensor s, z;
                                                     MaxPool because Q is non-decreasing)
    Q(op(x)·c; s, z) = op(Q(x·c; s, z))              c a scalar constant (> 0 for MaxPool)

(8-bit integers and E4M3FN alike: the op moves values, Q rounds each the same wherever it stands; MaxPool on
integers only, as below)

so `linear -> Reshape -> Transpose -> Mul(c) -> Q -> DQ -> MatMul` (an exported BERT's Q and Kᵀ) becomes
`linear -> Mul(c) -> Q -> Reshape -> Transpose -> DQ -> MatMul`: the 8-bit tensor moves, the scale joins the
bias Add in one elementwise step, and kiln/passes/fusion/attention.py finds the head transposes next to
the attention it absorbs them into.
A ResNet stem calibrated by kiln (`Conv -> Relu -> MaxPool -> Q -> DQ -> Conv`: the pool is no quantized
layer) becomes `Conv -> Relu -> Q -> MaxPool -> DQ -> Conv`: the stem's QConv writes 8 bits (a quarter of
the bytes of its 112x112x64 float output) and the pool runs on them, as in onnxruntime's QDQ model.

`use_unsigned_activations` (CPU builds): an int8 activation pair becomes a uint8 one, exactly
(Q(x; s, z, int8) + 128 = Q(x; s, z + 128, uint8): both clamp the same integer, shifted). On an
AVX2 CPU without VNNI, oneDNN's int8 kernels are exact only for uint8 sources (signed sources
are shifted and their weights halved: measured thousands of accumulator units off at K = 4608).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from kiln.passes._rewrite import (
    PassReport,
    attr,
    bypass,
    const,
    const_scalar,
    consumers,
    is_op,
    new_initializer,
    only_user,
    other_input,
    producer,
)

RULE_SINK = "sink_dequantize"
RULE_PAIRS = "remove_qdq_round_trips"
RULE_UNSIGNED = "unsigned_activations"
RULE_HOIST = "hoist_quantize"
HOISTED_MOVERS = ("Reshape", "Transpose", "MaxPool")
MOVERS = ("MaxPool", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze")
INT8_TYPES = (ir.DataType.INT8, ir.DataType.UINT8)


@dataclass(frozen=True)
class QParams:
    """A Q/DQ node's constant scale and zero point (the zero point's dtype is the quantized type)."""

    scale: np.ndarray
    zero_point: np.ndarray
    axis: int
    scale_value: ir.Value
    zero_value: ir.Value | None  # None: absent (uint8 zeros for DQ of uint8, per ONNX)

    @property
    def per_tensor(self) -> bool:
        return self.scale.size == 1

    def same(self, other: QParams) -> bool:
        """The same quantization, value for value (exact: a round trip is removed only then)."""
        return (self.scale.dtype == other.scale.dtype and self.zero_point.dtype == other.zero_point.dtype
                and self.scale.shape == other.scale.shape and np.array_equal(self.scale, other.scale)
                and np.array_equal(self.zero_point, other.zero_point)
                and (self.per_tensor or self.axis == other.axis))


def qparams(node: ir.Node | None) -> QParams | None:
    """A QuantizeLinear/DequantizeLinear's constant parameters, or None (computed, blocked, absent node)."""
    if node is None or not is_op(node, "QuantizeLinear", "DequantizeLinear") or attr(node, "block_size", 0):
        return None
    scale = const(node.inputs[1])
    zero_value = node.inputs[2] if len(node.inputs) > 2 else None
    if scale is None or scale.dtype != np.float32 or not np.all(scale > 0):
        return None
    if zero_value is not None:
        zero = const(zero_value)
        if zero is None:
            return None
    elif node.op_type == "DequantizeLinear" and quantized_type(node.inputs[0]) in INT8_TYPES:
        zero = np.zeros(scale.shape, quantized_type(node.inputs[0]).numpy())
    elif node.op_type == "QuantizeLinear" and attr(node, "output_dtype", 0) in (0, ir.DataType.UINT8):
        zero = np.zeros(scale.shape, np.uint8)
    else:
        return None
    if attr(node, "output_dtype", 0) and zero_value is not None and attr(node, "output_dtype") != \
            ir.DataType.from_numpy(zero.dtype):
        return None
    return QParams(scale, zero, int(attr(node, "axis", 1)), node.inputs[1], zero_value)


def quantized_type(value: ir.Value | None) -> ir.DataType | None:
    """A quantized tensor's element type: its declared type, a constant's, or the zero point's of the
    QuantizeLinear producing it (values created by passes may carry no type yet)."""
    if value is None:
        return None
    if value.dtype is not None:
        return value.dtype
    if value.const_value is not None:
        return value.const_value.dtype
    params = qparams(producer(value, "QuantizeLinear"))
    return ir.DataType.from_numpy(params.zero_point.dtype) if params is not None else None


def dequantized(value: ir.Value | None) -> tuple[ir.Node, QParams] | None:
    """(the DequantizeLinear producing `value`, its parameters) when they are constants."""
    dq = producer(value, "DequantizeLinear")
    params = qparams(dq)
    return (dq, params) if params is not None else None


def _dequantize_node(q: ir.Value, params: QParams, name: str) -> ir.Node:
    inputs = [q, params.scale_value] + ([params.zero_value] if params.zero_value is not None else [])
    return ir.node("DequantizeLinear", inputs, attributes={"axis": params.axis}, name=name, num_outputs=1)


def sink_dequantize(node: ir.Node, report: PassReport) -> bool:
    # op(DQ(q; s, z)) -> DQ(op(q); s, z) for value-moving ops, per-tensor s, z
    if not (is_op(node, *MOVERS) or is_op(node, "Concat")) or len(node.inputs) == 0:
        return False
    if any(v.uses() or v.is_graph_output() for v in node.outputs[1:]):
        return False  # MaxPool's Indices are read
    data = list(node.inputs) if node.op_type == "Concat" else [node.inputs[0]]
    found = [dequantized(v) for v in data]
    if not all(found):
        if node.op_type == "Concat" and any(found):
            report.refuse(RULE_SINK, node, "only some inputs are dequantized: the Concat stays in float")
        return False
    params = found[0][1]
    if not params.per_tensor:
        report.refuse(RULE_SINK, node, "the input is dequantized per channel: the op does not commute with it")
        return False
    if not all(p.same(params) for _, p in found[1:]):
        report.refuse(RULE_SINK, node, "its inputs are quantized with different scales or zero points")
        return False
    quantized = [dq.inputs[0] for dq, _ in found]
    if node.op_type == "MaxPool" and quantized_type(quantized[0]) not in INT8_TYPES:
        report.refuse(RULE_SINK, node, "MaxPool on float8 values: torch has no such kernel")
        return False
    graph = node.graph
    inputs = quantized + list(node.inputs[len(data):])
    moved = ir.Node(node.domain, node.op_type, inputs, list(node.attributes.values()), name=f"{node.name}_quantized",
                    num_outputs=1)
    out = node.outputs[0]
    moved.outputs[0].type = ir.TensorType(quantized_type(quantized[0])) if quantized_type(quantized[0]) else None
    moved.outputs[0].shape = out.shape
    moved.outputs[0].name = f"{out.name}_q"
    dq = _dequantize_node(moved.outputs[0], params, f"{node.name}_dequantize")
    dq.outputs[0].type, dq.outputs[0].shape = out.type, out.shape
    graph.insert_before(node, [moved, dq])
    name = out.name
    ir.convenience.replace_all_uses_with(out, dq.outputs[0], replace_graph_outputs=True)
    graph.remove(node, safe=True)
    out.name = f"{name}__replaced"
    dq.outputs[0].name = name
    return True


def hoist_quantize(node: ir.Node, report: PassReport) -> bool:
    # Q(op(x)) -> op(Q(x)); Q(op(x)·c) -> op(Q(x·c))   op ∈ Reshape, Transpose, MaxPool; c a scalar constant
    if not is_op(node, "QuantizeLinear"):
        return False
    params = qparams(node)
    kind = quantized_type(node.outputs[0])
    # E4M3 too (onnxruntime's FP8 QDQ BERT: the head split's Q rises to the projection, kiln::Attention reads q8)
    if params is None or not params.per_tensor or kind not in (*INT8_TYPES, ir.DataType.FLOAT8E4M3FN):
        return False
    value, mul, factor = node.inputs[0], None, None
    found = producer(value, "Mul")
    if found is not None and only_user(value) is node:
        factor = next((v for v in found.inputs if const_scalar(v) is not None and v.shape is not None
                       and len(v.shape) == 0), None)
        if factor is not None and other_input(found, factor) is not None:
            mul, value = found, other_input(found, factor)
    mover = producer(value)
    if not is_op(mover, *HOISTED_MOVERS) or only_user(value) is not (mul or node) or value.is_graph_output():
        return False
    if any(v.uses() or v.is_graph_output() for v in mover.outputs[1:]):
        return False
    if mover.op_type == "MaxPool" and mul is not None and not const_scalar(factor) > 0:
        return False  # max(x)·c = max(x·c) only for c > 0
    if mover.op_type == "MaxPool" and kind not in INT8_TYPES:
        report.refuse(RULE_HOIST, node, "MaxPool on float8 values: torch has no such kernel")
        return False
    origin = mover.inputs[0]
    while is_op(producer(origin), *HOISTED_MOVERS):
        origin = producer(origin).inputs[0]
    if is_op(producer(origin), "MatMul"):  # attention's P·V and its head merge: fuse_attention absorbs them
        report.refuse(RULE_HOIST, node, "the Reshape/Transpose follow a MatMul: the attention fusion takes them")
        return False
    graph, x = node.graph, mover.inputs[0]
    new_nodes = []
    if mul is not None:
        scaled = ir.node("Mul", [x, factor], name=f"{x.name}_scale", num_outputs=1)
        scaled.outputs[0].type, scaled.outputs[0].shape = x.type, x.shape
        scaled.outputs[0].name = f"{x.name}_scaled"
        new_nodes.append(scaled)
        x = scaled.outputs[0]
    quantize = ir.Node(node.domain, "QuantizeLinear", [x, *node.inputs[1:]], list(node.attributes.values()),
                       name=f"{x.name}_quantize", num_outputs=1)
    quantize.outputs[0].type = node.outputs[0].type
    quantize.outputs[0].shape = x.shape
    quantize.outputs[0].name = f"{x.name}_q"
    moved = ir.Node(mover.domain, mover.op_type, [quantize.outputs[0], *mover.inputs[1:]],
                    list(mover.attributes.values()), name=f"{mover.name}_quantized", num_outputs=1)
    moved.outputs[0].type, moved.outputs[0].shape = node.outputs[0].type, node.outputs[0].shape
    graph.insert_before(mover, [*new_nodes, quantize, moved])
    out, name = node.outputs[0], node.outputs[0].name
    ir.convenience.replace_all_uses_with(out, moved.outputs[0], replace_graph_outputs=True)
    graph.remove([node, *([mul] if mul is not None else []), mover], safe=True)
    out.name = f"{name}__replaced"
    moved.outputs[0].name = name
    return True


def remove_qdq_round_trips(node: ir.Node, report: PassReport) -> bool:
    # Q(DQ(q; s, z); s, z) -> q
    if not is_op(node, "QuantizeLinear"):
        return False
    found = dequantized(node.inputs[0])
    params = qparams(node)
    if found is None or params is None:
        return False
    dq, inner = found
    if not inner.same(params) or quantized_type(dq.inputs[0]) != ir.DataType.from_numpy(params.zero_point.dtype):
        return False  # a requantization: it stays
    return bypass(node, dq.inputs[0])


def use_unsigned_activations(node: ir.Node, report: PassReport) -> bool:
    # Q(x; s, z, int8) -> DQ(·; s, z)  =>  Q(x; s, z + 128, uint8) -> DQ(·; s, z + 128)
    if not is_op(node, "QuantizeLinear"):
        return False
    params = qparams(node)
    q = node.outputs[0]
    if params is None or params.zero_point.dtype != np.int8 or not params.per_tensor or \
            const(node.inputs[0]) is not None:
        return False
    readers = consumers(q)
    if q.is_graph_output() or not readers:
        return False
    for reader in readers:
        found = qparams(reader) if is_op(reader, "DequantizeLinear") and reader.inputs[0] is q else None
        if found is None or not found.same(params):
            report.refuse(RULE_UNSIGNED, node, f"{reader.name!r} ({reader.op_type}) reads the int8 tensor itself")
            return False
    if any(len(n.inputs) < 3 for n in [node, *readers]):
        return False  # an int8 zero point is always given (else the type is uint8)
    shifted = (params.zero_point.astype(np.int16) + 128).astype(np.uint8)
    zero = new_initializer(node.graph, f"{q.name}_zero_point_u8", shifted)
    for n in [node, *readers]:
        n.replace_input_with(2, zero)
    node.attributes.pop("output_dtype", None)
    q.type = ir.TensorType(ir.DataType.UINT8)
    return True
