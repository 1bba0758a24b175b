"""The elementwise chain that reads an FP8 QGemm's E4M3 output, into the QGemm's epilogue (CUDA builds).

    QGemm(x_q, ..., s_p, 0) ─ Elementwise["Dequantize i<p> i<s_p>", ["Add t0 i<b>"], [act | "Mul t i<m>"],
                                          ["Quantize t i<s_y>"]]
        =>  QGemm(x_q, ..., [s_y, 0], int_bias, s_p, 0, b; activation=act, multiplier=m)

Why: onnxruntime's FP8 QDQ transformers quantize each MatMul's output and add the bias after its DequantizeLinear
(y = DQ(Q(x·W)) + b), then quantize again for the next GEMM (q, v, the FFN's Gelu) or hand the float to a
LayerNorm (k before its transpose, the attention output, the FFN down). After fuse_dequantize_into_elementwise and
fuse_quantize_into_elementwise each such linear is two kernels: the GEMM writing E4M3, and a chain reading it back
(bench/results/gpu-s21-2026-12-06.md section 5: 72 of them in BERT-base). Here the chain moves into the GEMM's
epilogue, which has the tile in registers: one kernel, E4M3 in, E4M3 (or the float a LayerNorm reads) out.

The key projection's chain stops at the float bias Add (its head Reshape and Transpose stand between the Add and
the Mul by the attention's scale share and the Quantize, which fuse_elementwise left a chain of their own):

    QGemm(...; float out) ─ Reshape ─ Transpose ─ Elementwise["Mul i0 i<c>", "Quantize t0 i<s_y>"]
        =>  QGemm(...; s_y, multiplier=c) ─ Reshape ─ Transpose   (moving E4M3 values)

exact as well: a Mul by a scalar and a per-tensor Quantize act on each value alone, so they commute with the ops
that only move values (fuse_quantize_through_layout_into_qgemm); the attention then takes the head transpose into
its k_perm (absorb_attention_reshapes, run again after this rule).

Exact: the fused QGemm keeps the product's E4M3 rounding (product_scale, kiln/ops/quantized.py), then computes
DQ, the bias Add, the activation and the Mul in float32 as the chain did, and quantizes with the chain's
Quantize (IEEE division, saturation, nearest-even). The chain's lines must read in that order, each the result of
the one before, with constant operands: a per-column bias [N], a scalar multiplier, a scalar output scale.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.passes._rewrite import (
    KILN_DOMAIN,
    PassReport,
    attr,
    const,
    const_scalar,
    consumers,
    dtype_of,
    new_initializer,
    replace_with,
)

RULE = "fuse_elementwise_into_qgemm"
RULE_LAYOUT = "fuse_quantize_through_layout_into_qgemm"
LAYOUT_OPS = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten")
FP8 = ir.DataType.FLOAT8E4M3FN
ACTIVATIONS = {"Relu": "Relu", "Gelu": "Gelu", "GeluTanh": "GeluTanh"}  # Elementwise line -> QGemm activation
PRODUCT_INPUTS = 9  # a QGemm with more inputs has its product quantized already


class _Chain:
    """What an Elementwise program after `Dequantize` does, read line by line: its bias, activation, multiplier
    and output scale as constants, or why it cannot go into a GEMM's epilogue (`refusal`)."""

    def __init__(self, node: ir.Node, code: list[str], channels: int):
        self.bias: np.ndarray | None = None
        self.activation = ""
        self.multiplier = 1.0
        self.output_scale: ir.Value | None = None
        self.refusal = ""
        stage = 0  # lines seen so far: 0 none, 1 the Add, 2 an activation, 3 the Mul (each at most once, in order)
        for k, line in enumerate(code[1:], start=1):
            op, *operands = line.split()
            previous = f"t{k - 1}"
            if previous not in operands:
                self.refusal = f"line {k} {line!r} does not read the line before it"
                return
            others = [o for o in operands if o != previous]
            if op == "Add" and stage == 0 and len(others) == 1:
                self.bias = self._bias(node, others[0], channels)
                stage = 1
            elif op in ACTIVATIONS and stage <= 1 and not others:
                self.activation = ACTIVATIONS[op]
                stage = 2
            elif op == "Mul" and stage <= 2 and len(others) == 1:
                self.multiplier = const_scalar(self._value(node, others[0]))
                if self.multiplier is None:
                    self.refusal = f"line {k} {line!r}: the multiplier is not a constant scalar"
                    return
                stage = 3
            elif op == "Quantize" and k == len(code) - 1 and len(others) == 1:
                if const_scalar(self._value(node, others[0])) is None:
                    self.refusal = f"line {k} {line!r}: the output scale is not a constant scalar"
                    return
                self.output_scale = node.inputs[int(others[0][1:])]
            else:
                self.refusal = f"line {k} {line!r}: not the bias Add, an activation, a scalar Mul or the Quantize " \
                               "of a GEMM's epilogue, in that order"
                return
            if self.refusal:
                return

    def _value(self, node: ir.Node, operand: str) -> ir.Value | None:
        """The node input an operand `i<k>` names; None for a line's result `t<k>`."""
        return node.inputs[int(operand[1:])] if operand.startswith("i") else None

    def _bias(self, node: ir.Node, operand: str, channels: int) -> np.ndarray | None:
        value = const(self._value(node, operand))
        if value is None or value.size != channels or any(d != 1 for d in value.shape[:-1]):
            self.refusal = f"the Add's operand {operand} is not a constant bias, one per output column ({channels})"
            return None
        return value.reshape(-1).astype(np.float32)


def fuse_elementwise_into_qgemm(node: ir.Node, report: PassReport) -> bool:
    # Elementwise(Dequantize(QGemm(..) ; s_p), ..) -> QGemm(.., product_scale=s_p, product_bias=b, ...)
    if node.op_type != "Elementwise" or node.domain != KILN_DOMAIN:
        return False
    code = list(attr(node, "code", []))
    first = code[0].split() if code else []
    if len(first) != 3 or first[0] != "Dequantize" or not first[1].startswith("i") or not first[2].startswith("i"):
        return False
    value = node.inputs[int(first[1][1:])]
    gemm = value.producer() if value is not None else None
    if gemm is None or gemm.op_type != "QGemm" or gemm.domain != KILN_DOMAIN or value.dtype != FP8:
        return False
    why = None
    weight = const(gemm.inputs[3]) if len(gemm.inputs) > 3 else None
    channels = weight.shape[0] if weight is not None else None
    chain = _Chain(node, code, channels) if channels is not None else None
    product_scale = const(gemm.inputs[6]) if len(gemm.inputs) > 6 and gemm.inputs[6] is not None else None
    zero = const(gemm.inputs[7]) if len(gemm.inputs) > 7 and gemm.inputs[7] is not None else None
    dequantize_scale = const(node.inputs[int(first[2][1:])])
    if len(gemm.inputs) > PRODUCT_INPUTS:
        why = "the QGemm's product is quantized already (a chain is in its epilogue)"
    elif consumers(value) != [node] or value.is_graph_output():
        why = "the QGemm's E4M3 output has other readers: it stays a tensor of its own"
    elif attr(gemm, "activation", ""):
        why = f"the QGemm has an activation of its own ({attr(gemm, 'activation', '')}) before its quantization"
    elif chain is None:
        why = "the QGemm's weight is not a constant"
    elif chain.refusal:
        why = chain.refusal
    elif product_scale is None or zero is None or product_scale.size != 1 or np.any(zero.astype(np.float32) != 0):
        why = "the QGemm's output is not quantized per tensor with zero point 0"
    elif dequantize_scale is None or dequantize_scale.size != 1 or \
            np.float32(dequantize_scale.reshape(-1)[0]) != np.float32(product_scale.reshape(-1)[0]):
        why = "the chain dequantizes with another scale than the GEMM quantized with (a rescale between them)"
    if why is not None:
        report.refuse(RULE, node, why)
        return False
    graph = node.graph
    inputs: list[ir.Value | None] = list(gemm.inputs[:6])
    if chain.output_scale is not None:
        inputs += [chain.output_scale, gemm.inputs[7]]  # E4M3 zero point 0: the GEMM's own
    else:
        inputs += [None, None]
    inputs.append(gemm.inputs[8] if len(gemm.inputs) > 8 else None)
    inputs += [gemm.inputs[6], gemm.inputs[7]]  # the product's quantization: what the GEMM wrote before
    if chain.bias is not None:
        inputs.append(new_initializer(graph, f"{gemm.name}_product_bias", chain.bias))
    # a float output: the chain's own type (the builder's precision lowers a float32 one); else the GEMM's attribute
    float_dtype = int(dtype_of(node.outputs[0]) or 1) if chain.output_scale is None else \
        int(attr(gemm, "output_dtype", 1))
    out_dtype = FP8 if chain.output_scale is not None else ir.DataType(float_dtype)
    attributes = [ir.AttrString("activation", chain.activation), ir.AttrFloat32("alpha", 0.0),
                  ir.AttrFloat32("beta", 0.0), ir.AttrInt64("output_dtype", float_dtype),
                  ir.AttrFloat32("multiplier", chain.multiplier)]
    fused = ir.Node(KILN_DOMAIN, "QGemm", inputs, attributes, name=gemm.name)
    replace_with([gemm, node], fused, node.outputs[0], insert_before=node)
    fused.outputs[0].type = ir.TensorType(out_dtype)
    return True


def _scalar_program(node: ir.Node) -> tuple[float, ir.Value] | None:
    """(multiplier, output scale) of an Elementwise that is `[Mul i0 i<c>,] Quantize t|i i<s>` on its input 0 with
    constant scalars, else None."""
    code = [line.split() for line in attr(node, "code", [])]
    multiplier, last = 1.0, "i0"
    if len(code) == 2 and code[0][0] == "Mul" and len(code[0]) == 3 and "i0" in code[0][1:]:
        other = [o for o in code[0][1:] if o != "i0"]
        value = const_scalar(node.inputs[int(other[0][1:])]) if len(other) == 1 and other[0].startswith("i") else None
        if value is None:
            return None
        multiplier, last, code = value, "t0", code[1:]
    if len(code) != 1 or code[0][0] != "Quantize" or len(code[0]) != 3 or code[0][1] != last:
        return None
    scale_value = node.inputs[int(code[0][2][1:])] if code[0][2].startswith("i") else None
    return (multiplier, scale_value) if const_scalar(scale_value) is not None else None


def fuse_quantize_through_layout_into_qgemm(node: ir.Node, report: PassReport) -> bool:
    # Elementwise[Mul c, Quantize s](layout(QGemm(..; float))) -> layout(QGemm(..; s, multiplier=c))
    if node.op_type != "Elementwise" or node.domain != KILN_DOMAIN or not node.inputs:
        return False
    program = _scalar_program(node)
    if program is None:
        return False
    movers, value = [], node.inputs[0]
    while value is not None and value.producer() is not None and value.producer().op_type in LAYOUT_OPS \
            and value.producer().domain == "":
        movers.append(value.producer())
        value = movers[-1].inputs[0]
    gemm = value.producer() if value is not None else None
    if not movers or gemm is None or gemm.op_type != "QGemm" or gemm.domain != KILN_DOMAIN:
        return False
    why = None
    if len(gemm.inputs) <= PRODUCT_INPUTS or gemm.inputs[PRODUCT_INPUTS] is None:
        why = "the QGemm's product is not quantized (no chain of the QDQ model in its epilogue)"
    elif len(gemm.inputs) > 6 and gemm.inputs[6] is not None:
        why = "the QGemm's output is quantized already"
    elif float(attr(gemm, "multiplier", 1.0)) != 1.0:
        why = "the QGemm multiplies by a scalar already"
    elif any(consumers(v) != [reader] or v.is_graph_output() for v, reader in  # QGemm -> movers -> the chain
             zip([value] + [m.outputs[0] for m in reversed(movers)], [*reversed(movers), node])):
        why = "a tensor between the QGemm and the chain has other readers"
    if why is not None:
        report.refuse(RULE_LAYOUT, node, why)
        return False
    multiplier, output_scale = program
    inputs = list(gemm.inputs)
    inputs[6], inputs[7] = output_scale, gemm.inputs[PRODUCT_INPUTS + 1]  # the product's E4M3 zero point: 0
    attributes = [a for a in gemm.attributes.values() if a.name != "multiplier"]
    attributes.append(ir.AttrFloat32("multiplier", multiplier))
    fused = ir.Node(KILN_DOMAIN, "QGemm", inputs, attributes, name=gemm.name)
    replace_with([gemm], fused, value)
    fused.outputs[0].type = ir.TensorType(FP8)
    for mover in movers:  # now moving E4M3 values
        mover.outputs[0].type = ir.TensorType(FP8)
    out = node.outputs[0]
    ir.convenience.replace_all_uses_with(out, movers[0].outputs[0], replace_graph_outputs=True)
    node.graph.remove(node, safe=True)
    return True
