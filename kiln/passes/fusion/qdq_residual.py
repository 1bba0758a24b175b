"""A residual QAdd into the epilogue of the QConv that produces one of its inputs (TensorRT's conv +
residual fusion, on the 8-bit graph that fuse_quantized_layers / fuse_quantized_add leave):

    QConv(x, ..., s_c, z_c, bias) ─┐                                   QConv(x, ..., s_y, z_y, bias,
    residual_q ────────────────────┴─ QAdd(.., s_y, z_y) [Relu]   =>         residual_q, s_r, z_r, s_c, z_c)
                                                                          activation = the QAdd's

The fused layer keeps the convolution's own rounding to (s_c, z_c) before the add (kiln/ops/quantized.py):
it computes exactly what QConv followed by QAdd did, so it stays as close to onnxruntime's QDQ graph as the
unfused pair (which is what onnxruntime's QLinearConv -> QLinearAdd rounds too); the cost is a few
instructions per output in the epilogue, where the unfused graph paid a read-read-write pass of 8-bit
tensors per residual block (2.56 ms of 8.61 in ResNet-50 batch 256 on the H200, bench/results/
qconv-2026-12-02.md). INT8 (int8/uint8 throughout) and FP8 (float8e4m3fn throughout); a kernel of the fused
layer is judged by the unfused pair's tolerance (kiln/tactics/cuda/quant_residual_check.py): an FP8 kernel's
c cannot round as the reference's at every element, and one step of c is many of the sum where the residual
cancels it.

CUDA builds only (fusion.CUDA_RULES): every CUDA tactic of QConv takes the residual (the Triton implicit
GEMM in its epilogue, cuda.qconv.dequantized* as their conv then the QAdd kernel); the CPU tactics
(oneDNN) do not, and a CPU build keeps QConv -> QAdd.

Checks (each refusal says why): the QConv writes 8-bit (int8/uint8, or float8e4m3fn from float8e4m3fn x) with
no activation of its own, the QAdd is its only reader, the QAdd reads it with the parameters it was written
with, the residual is 8-bit of the output's shape (no broadcasting), the sum is 8-bit, all three int8/uint8 or
all float8e4m3fn, and the activation is Relu or none; a 2-D convolution (4-D tensors: what the kernels' NHWC
epilogue and the QAdd kernel walk).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.passes._rewrite import KILN_DOMAIN, PassReport, attr, const, dtype_of, is_op, only_user, replace_with, \
    same_shape

RULE = "fuse_quantized_residual"
RULE_FP8 = "fuse_quantized_residual_fp8"
OTHER_RULE = ""  # _refusal: the layer is the other rule's (E4M3 or integer), not refused
INTEGER_TYPES = (ir.DataType.UINT8, ir.DataType.INT8)
FP8 = ir.DataType.FLOAT8E4M3FN
EIGHT_BIT_TYPES = INTEGER_TYPES + (FP8,)
ACTIVATIONS = ("", "Relu")


def _same_constant(a: ir.Value | None, b: ir.Value | None) -> bool:
    ca, cb = const(a), const(b)
    return ca is not None and cb is not None and ca.dtype == cb.dtype and ca.size == cb.size == 1 and \
        np.array_equal(ca.reshape(-1), cb.reshape(-1))


def _refusal(conv: ir.Node, add: ir.Node, index: int, fp8: bool) -> str | None:
    """Why QAdd input `index` (0: a, 3: b), which conv writes, cannot move into conv's epilogue (None: it can);
    `fp8`: the rule for E4M3 layers (RULE_FP8), else the int8/uint8 one."""
    out = conv.outputs[0]
    inputs = list(conv.inputs)
    if (dtype_of(out) == FP8) != fp8:  # the FP8 rule passes over integer layers in silence
        return "an FP8 layer: fuse_quantized_residual_fp8 fuses it, from opt_level 3 (not yet measured on a GPU)" \
            if not fp8 else OTHER_RULE
    if len(inputs) > 9:
        return "the convolution has a residual already"
    if len(inputs) < 8 or inputs[6] is None or inputs[7] is None or dtype_of(out) not in EIGHT_BIT_TYPES:
        return "the convolution does not write an int8/uint8/float8e4m3fn tensor"
    if attr(conv, "activation", "") != "":
        return f"the convolution has its own activation {attr(conv, 'activation', '')!r} before the add"
    if out.shape is None or len(out.shape) != 4:
        return "not a 2-D convolution (4-D output)"
    if not (_same_constant(add.inputs[index + 1], inputs[6]) and _same_constant(add.inputs[index + 2], inputs[7])):
        return "the add reads the convolution's output with other parameters than it was written with"
    residual = add.inputs[3 - index]
    if dtype_of(residual) not in EIGHT_BIT_TYPES:
        return "the residual is not int8/uint8/float8e4m3fn"
    if not (same_shape(residual, out) and same_shape(add.outputs[0], out)):
        return "the residual does not have the convolution's output shape (a broadcast add)"
    if any(const(v) is None or const(v).size != 1 for v in add.inputs[4 - index:6 - index]):
        return "the residual is not quantized per tensor by constants"
    if len(add.inputs) < 8 or add.inputs[6] is None or dtype_of(add.outputs[0]) not in EIGHT_BIT_TYPES:
        return "the sum is not quantized to int8/uint8/float8e4m3fn"
    kinds = [dtype_of(v) == FP8 for v in (inputs[0], out, residual, add.outputs[0])]
    if any(kinds) and not all(kinds):
        return "FP8 and integer tensors mixed (the kernels add int8/uint8 throughout or float8e4m3fn throughout)"
    if attr(add, "activation", "") not in ACTIVATIONS:
        return f"activation {attr(add, 'activation', '')!r} after the add (the epilogue applies Relu or none)"
    return None


def fuse_quantized_residual(node: ir.Node, report: PassReport) -> bool:
    """node: a kiln::QAdd; one of its inputs written by a kiln::QConv read by nothing else (int8/uint8)."""
    return _fuse(node, report, fp8=False)


def fuse_quantized_residual_fp8(node: ir.Node, report: PassReport) -> bool:
    """The same for E4M3 layers: from opt_level 3 (fusion.LEVEL3_RULES) until the fused FP8 layer is measured on
    the GPU (its kernels pass the CPU interpreter's tests and compile for sm_90; the H200 call of 2026-12-04c was
    cut before its FP8 case)."""
    return _fuse(node, report, fp8=True)


def _fuse(node: ir.Node, report: PassReport, fp8: bool) -> bool:
    if not is_op(node, "QAdd", domain=KILN_DOMAIN):
        return False
    reasons = []
    for index in (0, 3):
        conv = node.inputs[index].producer() if node.inputs[index] is not None else None
        if conv is None or not is_op(conv, "QConv", domain=KILN_DOMAIN):
            continue
        reason = _refusal(conv, node, index, fp8)
        if reason is None and (only_user(conv.outputs[0]) is not node or node.inputs[0] is node.inputs[3]):
            reason = "the convolution's output has other readers (it must still be written)"
        if reason is not None:
            if reason != OTHER_RULE:
                reasons.append(reason)
            continue
        residual = node.inputs[3 - index]
        inputs = list(conv.inputs) + [None] * (9 - len(conv.inputs))  # bias slot kept (None: absent)
        conv_scale, conv_zero = inputs[6], inputs[7]
        inputs[6], inputs[7] = node.inputs[6], node.inputs[7]  # the sum's quantization: the layer's output
        inputs += [residual, node.inputs[4 - index], node.inputs[5 - index], conv_scale, conv_zero]
        attributes = [a for name, a in conv.attributes.items() if name not in ("activation", "alpha", "beta")]
        attributes += [ir.AttrString("activation", attr(node, "activation", "")), ir.AttrFloat32("alpha", 0.0),
                       ir.AttrFloat32("beta", 0.0)]
        fused = ir.Node(KILN_DOMAIN, "QConv", inputs, attributes, name=conv.name)
        out = node.outputs[0]
        # at the add's place: the residual is computed by then
        replace_with([conv, node], fused, out, insert_before=node)
        fused.outputs[0].type = ir.TensorType(dtype_of(out))
        return True
    for reason in reasons:
        report.refuse(RULE_FP8 if fp8 else RULE, node, reason)
    return False
