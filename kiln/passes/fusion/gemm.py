"""MatMul/Gemm with a constant weight + bias + activation + residual -> kiln::FusedGemm.

    y = act(x @ W + b) [+ r]         W stored transposed, [N, K], once at build

kiln::FusedGemm runs torch.nn.functional.linear (one BLAS call with the bias in its
epilogue); Gemm's alpha/beta fold into the stored weight and bias:
alpha·A@B + beta·C = A @ (alpha·B) + (beta·C).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.passes._rewrite import KILN_DOMAIN, PassReport, attr, const, is_op, new_initializer, replace_with
from kiln.passes.fusion.epilogue import absorb_epilogue

RULE = "fuse_gemm"


def _weight_and_bias(node: ir.Node, report: PassReport) -> tuple[np.ndarray, np.ndarray | None] | None:
    """W as [N, K] and the bias as [N] (or None), or None with a reason reported."""
    w = const(node.inputs[1])
    if w is None:
        if is_op(node, "Gemm"):
            report.refuse(RULE, node, "the weight B is computed at run time, not a constant")
        return None  # a MatMul of two activations (attention) is not a linear layer
    if w.ndim != 2:
        report.refuse(RULE, node, f"the weight is {w.ndim}-D, not a 2-D matrix")
        return None
    if node.op_type == "MatMul":
        if node.inputs[0].shape is None or len(node.inputs[0].shape) < 2:
            report.refuse(RULE, node, "the input rank is unknown or 1")
            return None
        return w.T, None
    if attr(node, "transA", 0):
        report.refuse(RULE, node, "transA=1 is not fused")
        return None
    alpha, beta = attr(node, "alpha", 1.0), attr(node, "beta", 1.0)
    w = (w if attr(node, "transB", 0) else w.T) * np.asarray(alpha, w.dtype)
    c = node.inputs[2] if len(node.inputs) > 2 else None
    if c is None:
        return w, None
    if const(c) is None:
        report.refuse(RULE, node, "the bias C is computed at run time")
        return None
    bias = const(c)
    if bias.size not in (1, w.shape[0]) or (bias.ndim == 2 and bias.shape[0] != 1):
        report.refuse(RULE, node, f"the bias C has shape {list(bias.shape)}, not one value per output column")
        return None
    return w, np.broadcast_to(bias.reshape(-1) * np.asarray(beta, bias.dtype), (w.shape[0],))


def fuse_gemm(node: ir.Node, report: PassReport) -> bool:
    if not is_op(node, "MatMul", "Gemm"):
        return False
    found = _weight_and_bias(node, report)
    if found is None:
        return False
    w, bias = found
    n = w.shape[0]
    ep = absorb_epilogue(node.outputs[0], n, -1, take_bias=True, rule=RULE, layer=node, report=report)
    if ep.bias is not None:
        bias = ep.bias if bias is None else bias + ep.bias
    graph = node.graph
    inputs = [node.inputs[0], new_initializer(graph, f"{node.inputs[1].name}_t", np.ascontiguousarray(w))]
    inputs.append(None if bias is None else new_initializer(graph, f"{node.name}_bias", bias.astype(w.dtype)))
    inputs.append(ep.residual)
    while inputs[-1] is None:
        inputs.pop()
    fused = ir.Node(KILN_DOMAIN, "FusedGemm", inputs, ep.attributes(), name=node.name)
    replace_with([node, *ep.nodes], fused, ep.output)
    return True
