"""Drop an attention mask that masks nothing.

An exporter that builds the additive mask from an all-ones `attention_mask` leaves a constant
of zeros after folding (BERT called with input_ids only):

    softmax(q·kᵀ·s + 0)·v = softmax(q·kᵀ·s)·v            # additive mask of zeros
    Where(True, scores, -inf) = scores                    # boolean mask of all True

Without the mask tensor, SDPA may take its fastest (flash) kernel, and no row can be fully
masked, so the NaN guard after the softmax has nothing to do either.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.passes._rewrite import PassReport, attr, const, is_op

RULE = "drop_empty_attention_mask"


def drop_empty_attention_mask(node: ir.Node, report: PassReport) -> bool:
    if not is_op(node, "Attention", domain="kiln") or len(node.inputs) < 4 or node.inputs[3] is None:
        return False
    mask = const(node.inputs[3])
    if mask is None:
        return False  # computed at run time (a padding mask from an input): keep it
    empty = bool(mask.all()) if mask.dtype == np.bool_ else not np.any(mask)
    if not empty:
        report.refuse(RULE, node, "the constant mask masks some positions")
        return False
    node.replace_input_with(3, None)
    if attr(node, "nan_to_zero", 0) and not attr(node, "is_causal", 0):
        node.attributes["nan_to_zero"] = ir.AttrInt64("nan_to_zero", 0)
    return True
