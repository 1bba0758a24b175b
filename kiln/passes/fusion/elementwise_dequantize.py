"""An FP8 DequantizeLinear into the elementwise chain that reads it (CUDA builds): the chain's Triton kernel loads
the E4M3 tensor and multiplies by its scale in registers.

    q (E4M3) ─ DequantizeLinear(s) ─ Add(bias) ─ ...     =>     Elementwise["Dequantize i0 i1", "Add t0 i2", ...]

Why: onnxruntime's FP8 QDQ transformer quantizes every MatMul's output and adds the bias after its
DequantizeLinear (y = DQ(Q(x·W)) + b), so a CUDA build of BERT-base kept 72 standalone DequantizeLinear layers
and 48 single bias Adds on torch's kernel (bench/results/gpu-s21-2026-12-06.md section 5): two passes over the
tensor and a float intermediate where one pass reading 8 bits does. Exact: DQ(q) = float32(q)·s for E4M3 (zero
point 0), which is what the kernel computes before the chain's first op, in fp32 as the chain's other lines.
CUDA only (fusion.CUDA_RULES); int8/uint8 Q/DQ (a zero point) have CPU rules of their own below
(fuse_int8_*: the CPU's native Elementwise reads and writes 8 bits, kiln/kernels/cpu/elementwise.c).

    chain ─ QuantizeLinear(s, E4M3 0)     =>     Elementwise[..., "Quantize t<last> i<s>"]   (output E4M3)

The same for the QuantizeLinear after a chain (q/k/v before the attention, the FFN's Gelu before the down GEMM:
48 standalone layers in BERT-base): the kernel divides by the scale (IEEE), saturates and rounds onto the E4M3
grid as kiln's other fp8 kernels (qmath.round_to_e4m3) and stores 8 bits. The chain is no longer rounded to the
storage dtype before the division (fp32 registers): a near-tie may land one E4M3 step the other way, as the
builder's check allows a quantized output (kiln/builder/accuracy.py integer_steps).
"""

from __future__ import annotations

import re

import numpy as np
import onnx_ir as ir

from kiln.passes._rewrite import (KILN_DOMAIN, PassReport, attr, const, consumers, dtype_of, new_initializer,
                                  replace_with)
from kiln.passes.fusion.elementwise import _op_name
from kiln.passes.fusion.qdq_propagate import dequantized, qparams

RULE = "fuse_dequantize_into_elementwise"
RULE_QUANTIZE = "fuse_quantize_into_elementwise"
FP8_TYPES = (ir.DataType.FLOAT8E4M3FN,)


def _program(node: ir.Node) -> list[str] | None:
    """The node as an Elementwise program: its own code, or one line for a single elementwise ONNX op."""
    if node.op_type == "Elementwise" and node.domain == KILN_DOMAIN:
        return list(attr(node, "code", []))
    name = _op_name(node)
    return None if name is None else [" ".join([name, *(f"i{k}" for k in range(len(node.inputs)))])]


def _with_input_dequantized(code: list[str], k: int, n_inputs: int) -> list[str]:
    """The program with input i<k> replaced by `Dequantize i<n-1> i<n>` (the quantized tensor and its scale,
    appended after the other inputs, which shift down past k) as its first line; results t<j> become t<j+1>."""
    def operand(match: re.Match) -> str:
        kind, index = match.group(1), int(match.group(2))
        if kind == "t":
            return f"t{index + 1}"
        if index == k:
            return "t0"
        return f"i{index - 1 if index > k else index}"

    body = [re.sub(r"\b([it])(\d+)\b", operand, line) for line in code]
    return [f"Dequantize i{n_inputs - 1} i{n_inputs}", *body]


def fuse_dequantize_into_elementwise(node: ir.Node, report: PassReport) -> bool:
    # Elementwise(.., DQ(q, s), ..) -> Elementwise(.., q, s)    one DQ a firing; the rule runs to a fixed point
    code = _program(node)
    if code is None:
        return False
    out_dtype = dtype_of(node.outputs[0])
    for k, value in enumerate(node.inputs):
        found = dequantized(value)
        if found is None:
            continue
        dq, params = found
        x = dq.inputs[0]
        if x is None or x.dtype not in FP8_TYPES:
            continue  # int8 activations stay on their own DequantizeLinear (a zero point, another rounding)
        why = None
        if not params.per_tensor:
            why = "the DequantizeLinear is per channel"
        elif np.any(params.zero_point.astype(np.float32) != 0):
            why = "an E4M3 zero point other than 0"
        elif consumers(value) != [node] or value.is_graph_output():
            why = "the dequantized tensor has other readers: it stays a tensor of its own"
        elif dtype_of(value) != out_dtype or dtype_of(value) != ir.DataType.from_numpy(params.scale.dtype):
            why = f"the DequantizeLinear writes {dtype_of(value)}, the chain {out_dtype} (a rounding between)"
        elif const(x) is not None:
            why = "a constant (weights are folded, not fused)"
        if why is not None:
            report.refuse(RULE, node, why)
            continue
        inputs = [v for j, v in enumerate(node.inputs) if j != k] + [x, params.scale_value]
        fused_code = _with_input_dequantized(code, k, len(inputs) - 1)
        # the storage type, which the program's float32 scales no longer give (the builder's precision lowers it)
        attributes = [ir.AttrStrings("code", fused_code), ir.AttrInt64("output_dtype", int(out_dtype))]
        fused = ir.Node(KILN_DOMAIN, "Elementwise", inputs, attributes, name=node.name)
        replace_with([dq, node], fused, node.outputs[0], insert_before=node)
        return True
    return False


def fuse_quantize_into_elementwise(node: ir.Node, report: PassReport) -> bool:
    # Q(Elementwise(..), s, 0 E4M3) -> Elementwise(.., s)[.., "Quantize t<last> i<s>"]
    if node.op_type != "QuantizeLinear" or node.domain not in ("", "ai.onnx"):
        return False
    params = qparams(node)
    chain = node.inputs[0].producer() if node.inputs[0] is not None else None
    code = _program(chain) if chain is not None else None
    if params is None or code is None or ir.DataType.from_numpy(params.zero_point.dtype) not in FP8_TYPES:
        return False
    why = None
    if not params.per_tensor:
        why = "the QuantizeLinear is per channel"
    elif np.any(params.zero_point.astype(np.float32) != 0) or attr(node, "saturate", 1) != 1:
        why = "an E4M3 zero point other than 0, or no saturation"
    elif consumers(node.inputs[0]) != [node] or node.inputs[0].is_graph_output():
        why = "the chain's float result has other readers: it stays a tensor of its own"
    elif any(line.split()[0] == "Quantize" for line in code):
        why = "the chain already ends in a Quantize"
    if why is not None:
        report.refuse(RULE_QUANTIZE, node, why)
        return False
    inputs = [*chain.inputs, params.scale_value]
    fused_code = [*code, f"Quantize t{len(code) - 1} i{len(inputs) - 1}"]
    attributes = [ir.AttrStrings("code", fused_code), ir.AttrInt64("output_dtype", int(ir.DataType.FLOAT8E4M3FN))]
    fused = ir.Node(KILN_DOMAIN, "Elementwise", inputs, attributes, name=chain.name)
    replace_with([chain, node], fused, node.outputs[0])
    return True


# ---- int8 / uint8 (CPU builds) ---------------------------------------------------------------------------------
INT8_RULE = "fuse_int8_dequantize_into_elementwise"
INT8_RULE_QUANTIZE = "fuse_int8_quantize_into_elementwise"
INT8_TYPES = (ir.DataType.UINT8, ir.DataType.INT8)


def _zero_value(node: ir.Node, params) -> ir.Value:
    """The Q/DQ's zero point as a value (an initializer of its own where the node leaves it out: uint8 0)."""
    if params.zero_value is not None:
        return params.zero_value
    return new_initializer(node.graph, f"{node.name}_zero_point", params.zero_point.reshape(()))


def fuse_int8_dequantize_into_elementwise(node: ir.Node, report: PassReport) -> bool:
    """An int8/uint8 DequantizeLinear into the elementwise chain that reads it (CPU builds: the native Elementwise
    dequantizes an 8-bit input as it reads it):

        q (uint8) ─ DequantizeLinear(s, z) ─ Add(bias) ─ ...  =>  Elementwise["Dequantize i0 i1 i2", "Add t0 i3", ...]

    Why: onnxruntime's QDQ transformers (quantize_static) dequantize every quantized GEMM's output before its bias
    Add, Gelu or residual Add and quantize the result again for the next GEMM: BERT-tiny's CPU engine ran 16
    DequantizeLinear and 12 QuantizeLinear steps of 64, each a pass over the tensor in memory. Exact: the kernel
    computes (float32(q) - z)·s, DequantizeLinear's float32 result, before the chain's first line."""
    # Elementwise(.., DQ(q, s, z), ..) -> Elementwise(.., q, s, z)    one DQ a firing; the rule runs to a fixed point
    code = _program(node)
    if code is None or (node.op_type == "Elementwise" and attr(node, "output_dtype", 0) not in
                        (0, ir.DataType.FLOAT, *INT8_TYPES)):
        return False
    for k, value in enumerate(node.inputs):
        found = dequantized(value)
        if found is None:
            continue
        dq, params = found
        x = dq.inputs[0]
        if x is None or x.dtype not in INT8_TYPES:
            continue
        why = None
        if not params.per_tensor:
            why = "the DequantizeLinear is per channel"
        elif consumers(value) != [node] or value.is_graph_output():
            why = "the dequantized tensor has other readers: it stays a tensor of its own"
        elif dtype_of(value) != ir.DataType.FLOAT:
            why = f"the DequantizeLinear writes {dtype_of(value)}: the native chain computes in float32"
        elif const(x) is not None:
            why = "a constant (weights are folded, not fused)"
        if why is not None:
            report.refuse(INT8_RULE, node, why)
            continue
        inputs = [v for j, v in enumerate(node.inputs) if j != k] + [x, params.scale_value, _zero_value(dq, params)]
        fused_code = _with_input_dequantized(code, k, len(inputs) - 2)
        fused_code[0] += f" i{len(inputs) - 1}"  # Dequantize q s z
        output_dtype = attr(node, "output_dtype", 0) or int(ir.DataType.FLOAT)
        attributes = [ir.AttrStrings("code", fused_code), ir.AttrInt64("output_dtype", int(output_dtype))]
        fused = ir.Node(KILN_DOMAIN, "Elementwise", inputs, attributes, name=node.name)
        replace_with([dq, node], fused, node.outputs[0], insert_before=node)
        return True
    return False


def _image_add(chain: ir.Node, code: list[str]) -> bool:
    """Whether the chain is one Add of two computed 4-D tensors of one static shape (a convolutional network's
    residual Add): MobileNetV2's int8 CPU engine ran 5 of them fused with their quantize outside its native segments,
    0.07-0.32 ms each against 0.015 for the two members (bench/results/int8-mixed-speed-2026-12-07.md)."""
    if code != ["Add i0 i1"] or len(chain.inputs) != 2:
        return False
    shapes = [v.shape if v is not None else None for v in chain.inputs]
    return all(s is not None and len(s) == 4 and all(isinstance(d, int) for d in s) for s in shapes) and \
        list(shapes[0]) == list(shapes[1]) and all(const(v) is None for v in chain.inputs)


def fuse_int8_quantize_into_elementwise(node: ir.Node, report: PassReport) -> bool:
    """The int8/uint8 QuantizeLinear after an elementwise chain, into the chain (CPU builds): the kernel rounds the
    chain's float32 result as QuantizeLinear does, saturate(round_half_even(r / s) + z), and stores 8 bits.

        chain ─ QuantizeLinear(s, z uint8)   =>   Elementwise[..., "Quantize t<last> i<s> i<z>"]   (output uint8)

    Exact: the chain's last line is float32 in registers as it was in memory, and the division is IEEE's."""
    # Q(Elementwise(..), s, z) -> Elementwise(.., s, z)[.., "Quantize t<last> i<s> i<z>"]
    if node.op_type != "QuantizeLinear" or node.domain not in ("", "ai.onnx"):
        return False
    params = qparams(node)
    chain = node.inputs[0].producer() if node.inputs[0] is not None else None
    code = _program(chain) if chain is not None else None
    if params is None or code is None or ir.DataType.from_numpy(params.zero_point.dtype) not in INT8_TYPES:
        return False
    why = None
    if not params.per_tensor:
        why = "the QuantizeLinear is per channel"
    elif consumers(node.inputs[0]) != [node] or node.inputs[0].is_graph_output():
        why = "the chain's float result has other readers: it stays a tensor of its own"
    elif any(line.split()[0] == "Quantize" for line in code):
        why = "the chain already ends in a Quantize"
    elif dtype_of(node.inputs[0]) != ir.DataType.FLOAT:
        why = f"the chain computes {dtype_of(node.inputs[0])}: the native chain's rounding is float32's"
    elif _image_add(chain, code):
        why = ("a residual Add of two 4-D images: a native segment runs it (cpu.add.nhwc) and the quantize as members, "
               "the fused chain (3-D at most there) would be a step outside the segment")
    if why is not None:
        report.refuse(INT8_RULE_QUANTIZE, node, why)
        return False
    inputs = [*chain.inputs, params.scale_value, _zero_value(node, params)]
    fused_code = [*code, f"Quantize t{len(code) - 1} i{len(inputs) - 2} i{len(inputs) - 1}"]
    out_dtype = ir.DataType.from_numpy(params.zero_point.dtype)
    attributes = [ir.AttrStrings("code", fused_code), ir.AttrInt64("output_dtype", int(out_dtype))]
    fused = ir.Node(KILN_DOMAIN, "Elementwise", inputs, attributes, name=chain.name)
    replace_with([chain, node], fused, node.outputs[0])
    return True
