"""Drop an attention mask that masks nothing; hand SDPA a materialised mask in its broadcast form.

An exporter that builds the additive mask from an all-ones `attention_mask` leaves a constant
of zeros after folding (BERT called with input_ids only):

    softmax(q·kᵀ·s + 0)·v = softmax(q·kᵀ·s)·v            # additive mask of zeros
    Where(True, scores, -inf) = scores                    # boolean mask of all True

Without the mask tensor, SDPA may take its fastest (flash) kernel, and no row can be fully
masked, so the NaN guard after the softmax has nothing to do either.

Constant folding stops at SIZE_LIMIT elements (kiln/passes/fold.py), and the dynamo exporter
materialises the mask at full size: BERT at batch 64, seq 384 computes

    mask = Where(Expand(C, [64, 1, 384, 384]), 0, -inf)        # C: a small constant, [1, 1, 1, 384]

so the mask is 9.4M elements computed at run time, and SDPA reads all of them in every layer.
`broadcast_constant` evaluates such a mask on its pre-broadcast constants (Expand is a broadcast,
and elementwise ops commute with broadcasting), which decides emptiness from C alone; a mask
that does mask something is replaced by that small constant, which the attention broadcasts
(`use_broadcast_attention_mask`, a rule of its own: `drop_empty_attention_mask` only drops, and a
mask it keeps leaves the graph as it was).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.passes._rewrite import PassReport, attr, const, is_op, new_initializer
from kiln.passes.fold import evaluate

RULE = "drop_empty_attention_mask"

_MAX_DEPTH = 8
# Elementwise ops a mask subgraph is made of: each commutes with broadcasting its inputs, so it may
# be evaluated (by kiln's own op, as constant folding does) on the pre-broadcast constants. The comparisons:
# transformers' mask functions compare positions, kv_idx <= q_idx (LessOrEqual) for the causal triangle, and
# at batch 8 x 512 the dynamo export's [8, 1, 512, 512] result is too large to fold (Phi-3, Qwen2 prefill):
# without them the triangle went unrecognised and every layer's attention read a materialised mask.
_ELEMENTWISE = frozenset({"Where", "Not", "And", "Or", "Equal", "Neg", "Add", "Sub", "Mul", "Cast",
                          "Less", "LessOrEqual", "Greater", "GreaterOrEqual"})


def broadcast_constant(value: ir.Value | None, depth: int = 0) -> np.ndarray | None:
    """A constant whose broadcast to `value`'s shape is `value`, or None if `value` depends on an input.

    Sees through Expand and the elementwise ops above; gives up (None) where the op's result type
    disagrees with the value's declared one, as folding does.
    """
    array = const(value)
    if array is not None:
        return array
    node = value.producer() if value is not None else None
    if node is None or depth > _MAX_DEPTH or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Expand":
        return broadcast_constant(node.inputs[0], depth + 1)
    if node.op_type not in _ELEMENTWISE or any(v is None for v in node.inputs):
        return None
    args = [broadcast_constant(v, depth + 1) for v in node.inputs]
    if any(a is None for a in args):
        return None
    opset = node.graph.opset_imports.get("", 21) if node.graph is not None else 21
    results = evaluate(node, opset, [ir.tensor(np.ascontiguousarray(a).reshape(np.shape(a))) for a in args])
    if not results:
        return None
    result = results[node.outputs.index(value)]
    return result if value.dtype is None or result.dtype == value.dtype.numpy() else None


def evaluate_on_constants(op_type: str, arrays: list[np.ndarray], dtype: ir.DataType | None,
                          opset: int) -> np.ndarray | None:
    """Output 0 of an `op_type` node whose output is of `dtype`, run by kiln's own op on `arrays`, as
    `broadcast_constant` would compute it, or None where it gives up; the graph is not touched (the
    node is detached and its inputs are not wired, so no value gains a use)."""
    node = ir.Node("", op_type, [None] * len(arrays))
    node.outputs[0].dtype = dtype
    results = evaluate(node, opset, [ir.tensor(np.ascontiguousarray(a).reshape(np.shape(a))) for a in arrays])
    if not results:
        return None
    return results[0] if dtype is None or results[0].dtype == dtype.numpy() else None


def _is_empty(mask: np.ndarray) -> bool:
    return bool(mask.all()) if mask.dtype == np.bool_ else not np.any(mask)  # all True / all 0: hides no key


def drop_empty_attention_mask(node: ir.Node, report: PassReport) -> bool:
    # Attention(q, k, v, M) with M hiding no key -> Attention(q, k, v)
    if not is_op(node, "Attention", domain="kiln") or len(node.inputs) < 4 or node.inputs[3] is None:
        return False
    mask = broadcast_constant(node.inputs[3])
    if mask is None:
        return False  # computed from an input (a padding mask): keep it
    if not _is_empty(mask):
        report.refuse(RULE, node, "the constant mask masks some positions" if const(node.inputs[3]) is not None
                      else "the mask, computed at run time from constants, masks some positions "
                           "(attention_mask_broadcast hands the op its small constant form)")
        return False
    node.replace_input_with(3, None)
    if attr(node, "nan_to_zero", 0) and not attr(node, "is_causal", 0):
        node.attributes["nan_to_zero"] = ir.AttrInt64("nan_to_zero", 0)
    return True


def use_broadcast_attention_mask(node: ir.Node, report: PassReport) -> bool:
    # Attention(q, k, v, f(Expand(C))) -> Attention(q, k, v, f(C)): the same values, broadcast by the op
    if not is_op(node, "Attention", domain="kiln") or len(node.inputs) < 4 or node.inputs[3] is None:
        return False
    value = node.inputs[3]
    if const(value) is not None or node.graph is None:
        return False  # already a constant: nothing is computed at run time
    mask = broadcast_constant(value)
    if mask is None or _is_empty(mask):
        return False  # from an input (kept as is), or empty (drop_empty_attention_mask drops it)
    rank = len(value.shape) if value.shape is not None else mask.ndim
    small = mask.reshape((1,) * max(rank - mask.ndim, 0) + mask.shape)
    node.replace_input_with(3, new_initializer(node.graph, f"{value.name or 'mask'}_broadcast", small))
    return True
