"""MatMul/Gemm with a constant weight + bias + activation + residual -> kiln::FusedGemm.

    y = act(x @ W + b) [+ r]         W stored transposed, [N, K], once at build

kiln::FusedGemm runs torch.nn.functional.linear (one BLAS call with the bias in its
epilogue); Gemm's alpha/beta fold into the stored weight and bias:
alpha·A@B + beta·C = A @ (alpha·B) + (beta·C).

Exporters flatten activations to 2-D around a Gemm and restore them after (GPT-2's Conv1D):
Reshape(x, [M, K]) -> Gemm -> Reshape(·, [B, S, N]). linear works on any leading dims, so

    Reshape(Gemm(Reshape(x, [M, K])), [B, S, N]) = linear(Reshape(x, [B, S, K]))

and the input Reshape disappears too when x is already [B, S, K]. With the output Reshape
gone the epilogue (GELU, residual Add) sits right after the layer and is absorbed.

At a symbolic batch x sequence (GPT-2 exported for serving) the attention output's head merge and the flatten
are one Reshape of o [B, S, H, D] to [-1, H·D], and the unflatten's target is computed. The flatten is re-targeted
at [0, 0, H·D] (allowzero=0: B and S copied from o, a view), so the layer reads [B, S, H·D] and the attention
takes the merge (kiln/passes/fusion/attention_layout.py) instead of two torch steps between native segments:

    Reshape(Gemm(Reshape(o [B, S, H, D], [-1, H·D])), [B, S, N]) = linear(Reshape(o, [0, 0, H·D]))
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
    dims_equal,
    is_op,
    new_initializer,
    only_user,
    producer,
    replace_with,
)
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


@dataclass
class _Lift:
    """A 2-D Gemm between a flatten and an unflatten, read as an N-D linear layer."""

    source: ir.Value  # the N-D input [B, S, K] the layer reads
    unflatten: ir.Node  # the output Reshape the layer absorbs
    flatten: ir.Node | None = None  # when set: re-target this flatten at `shape` (source is its output)
    shape: list[int] | None = None
    dims: list | None = None  # the re-targeted flatten's output dims, where `shape` copies some (0, allowzero=0)

    def apply(self) -> ir.Value:
        """The layer's input, after re-targeting the flatten when that is needed (changes the graph)."""
        if self.flatten is not None:
            target = new_initializer(self.flatten.graph, f"{self.flatten.name}_shape", np.array(self.shape, np.int64))
            self.flatten.replace_input_with(1, target)
            if self.dims is not None:
                self.flatten.attributes["allowzero"] = ir.AttrInt64("allowzero", 0)
            self.source.shape = ir.Shape(self.dims if self.dims is not None else self.shape)
        return self.source


def _lift_reshapes(node: ir.Node, k: int, n: int) -> _Lift | None:
    """How to read node as N-D when it is a 2-D Gemm between a flatten and an unflatten (graph untouched)."""
    x, out = node.inputs[0], node.outputs[0]
    unflatten = only_user(out)
    if not is_op(unflatten, "Reshape") or x.shape is None or len(x.shape) != 2:
        return None
    target = unflatten.outputs[0].shape
    if target is None or len(target) < 2 or target[-1] != n:
        return None
    flatten = producer(x, "Reshape")
    source = flatten.inputs[0] if flatten is not None else None
    if source is not None and source.shape is not None and len(source.shape) == len(target) \
            and source.shape[-1] == k and dims_equal(list(source.shape)[:-1], list(target)[:-1]):
        return _Lift(source, unflatten)  # x was [B, S, K] before the flatten: read it directly
    if flatten is None or only_user(x) is not node:
        return None
    static = [d for d in target if isinstance(d, int)]
    if len(static) == len(target):
        # Re-target the flatten at [B, S, K] (same element order: only the leading dims regroup).
        return _Lift(x, unflatten, flatten, [*static[:-1], k])
    # A symbolic [B, S] the flatten's source begins with, its trailing dims K in all: [0, 0, K] copies B and S.
    lead = len(target) - 1
    if source is None or source.shape is None or len(source.shape) <= lead \
            or not dims_equal(list(source.shape)[:lead], list(target)[:lead]):
        return None
    rest = list(source.shape)[lead:]
    if not all(isinstance(d, int) for d in rest) or int(np.prod(rest)) != k:
        return None
    return _Lift(x, unflatten, flatten, [0] * lead + [k], [*list(target)[:lead], k])


def fuse_gemm(node: ir.Node, report: PassReport) -> bool:
    if not is_op(node, "MatMul", "Gemm"):
        return False
    found = _weight_and_bias(node, report)
    if found is None:
        return False
    w, bias = found
    n = w.shape[0]
    layer_nodes, layer_out = [node], node.outputs[0]
    if (lifted := _lift_reshapes(node, w.shape[1], n)) is not None:
        layer_nodes.append(lifted.unflatten)
        layer_out = lifted.unflatten.outputs[0]
    # A residual Add read by a LayerNorm is left to fuse_skip_layer_norm: the norm then adds it in its
    # own pass over the row, where a GEMM epilogue would write the sum for the norm to read back.
    ep = absorb_epilogue(layer_out, n, -1, take_bias=True, rule=RULE, layer=node, report=report,
                         leave_residual_to_norm=True)
    if ep.bias is not None:
        bias = ep.bias if bias is None else bias + ep.bias
    # Decided: from here on the graph changes.
    x = lifted.apply() if lifted is not None else node.inputs[0]
    graph = node.graph
    inputs = [x, new_initializer(graph, f"{node.inputs[1].name}_t", np.ascontiguousarray(w))]
    inputs.append(None if bias is None else new_initializer(graph, f"{node.name}_bias", bias.astype(w.dtype)))
    inputs.append(ep.residual)
    while inputs[-1] is None:
        inputs.pop()
    fused = ir.Node(KILN_DOMAIN, "FusedGemm", inputs, ep.attributes(), name=node.name)
    replace_with([*layer_nodes, *ep.nodes], fused, ep.output)
    return True
