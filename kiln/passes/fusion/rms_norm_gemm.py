"""A pre-norm decoder's RMSNorm into the GEMM that reads it: RMSNorm + FusedGemm -> one kiln::RMSNormGemm.

(kiln::RMSNorm, or ai.onnx RMSNormalization over the last axis, which has the same semantics there.)

    FusedGemm(RMSNorm(x, γ, ε), W, b, r, ...)  =  RMSNormGemm(x, W·diag(γ), b, r, ..., epsilon=ε)

    since  (x / rms(x) · γ)·Wᵀ = (x / rms(x))·(W·diag(γ))ᵀ = (x·W'ᵀ) / rms(x),   rms(x) = sqrt(mean(x²) + ε)

Every Llama/Qwen2/Mistral/Phi-3 layer normalises the residual stream twice and only a GEMM reads each norm
(q|k|v, gate|up; the final norm feeds the LM head), so on CUDA the norm was a kernel of its own and a round
trip of the activations through memory per GEMM. Folded, the GEMM gathers each row's Σ x² from the x tiles its
K loop loads anyway and scales the finished row (kiln/kernels/cuda/triton/fused_gemm.py); a tactic that runs
the norm then cuBLAS keeps the unfused cost as the tuner's fallback (kiln/tactics/cuda/norm_gemm.py).

Taken when the norm is over the last axis with a constant 1-D scale (or none), and every reader of its output
is a FusedGemm reading it as x with a constant 2-D weight of its own (a weight shared with another layer
would be stored twice, once scaled). CUDA builds only (fusion.CUDA_RULES): the CPU's native segments run
RMSNorm as a member of their own.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.passes._rewrite import KILN_DOMAIN, PassReport, attr, const, consumers, is_op, new_initializer, replace_with

RULE = "fuse_rms_norm_into_gemm"


def _scale(norm: ir.Node) -> np.ndarray | None | bool:
    """γ as a 1-D array, None when the norm has no scale, False when it is not a constant vector."""
    if len(norm.inputs) < 2 or norm.inputs[1] is None:
        return None
    gamma = const(norm.inputs[1])
    return gamma.reshape(-1) if gamma is not None and gamma.size == max(gamma.shape or (1,)) else False


def _refusal(norm: ir.Node, readers: list[ir.Node]) -> str | None:
    x, y = norm.inputs[0], norm.outputs[0]
    rank = None if x.shape is None else len(x.shape)
    axis = int(attr(norm, "axis", -1))
    if rank is None or axis not in (-1, rank - 1) or len(norm.outputs) != 1:
        return "the norm is not over the last axis of a ranked input"
    if y.is_graph_output() or not readers:
        return "the norm's output is a graph output"
    for gemm in readers:
        if not is_op(gemm, "FusedGemm", domain=KILN_DOMAIN) or gemm.inputs[0] is not y or y in list(gemm.inputs)[1:]:
            return f"{gemm.name} reads the norm's output other than as a GEMM's x"
        w = gemm.inputs[1]
        if const(w) is None or const(w).ndim != 2 or len(consumers(w)) != 1 or w.is_graph_output():
            return f"{gemm.name}'s weight is not a 2-D constant of its own"
    return None


def fuse_rms_norm_into_gemm(node: ir.Node, report: PassReport) -> bool:
    if not (is_op(node, "RMSNorm", domain=KILN_DOMAIN) or is_op(node, "RMSNormalization")):  # kiln's or ONNX's (23+)
        return False
    gamma = _scale(node)
    if gamma is False:
        report.refuse(RULE, node, "the norm's scale is not a constant vector")
        return False
    readers = consumers(node.outputs[0])
    reason = _refusal(node, readers)
    if reason is not None:
        report.refuse(RULE, node, reason)
        return False
    if gamma is not None and any(const(g.inputs[1]).shape[1] != gamma.size for g in readers):
        report.refuse(RULE, node, "the norm's scale and a GEMM's K differ")
        return False
    epsilon = float(attr(node, "epsilon", 1e-6))
    for gemm in readers:
        w = const(gemm.inputs[1])  # [N, K]
        folded = w if gamma is None else (w.astype(np.float32) * gamma.astype(np.float32)[None, :]).astype(w.dtype)
        inputs = [node.inputs[0], new_initializer(node.graph, f"{gemm.inputs[1].name}_rms", folded),
                  *list(gemm.inputs)[2:]]
        attributes = [a for a in gemm.attributes.values()] + [ir.AttrFloat32("epsilon", epsilon)]
        fused = ir.Node(KILN_DOMAIN, "RMSNormGemm", inputs, attributes, name=f"{gemm.name}_rms")
        replace_with([gemm], fused, gemm.outputs[0])
    node.graph.remove(node, safe=True)  # its readers are gone
    return True
