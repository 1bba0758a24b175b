"""GEMMs reading the same input -> one kiln::FusedGemm on concatenated weights + Split.

    [x·W₁ᵀ + b₁, x·W₂ᵀ + b₂, x·W₃ᵀ + b₃] = split(x·[W₁; W₂; W₃]ᵀ + [b₁; b₂; b₃])

The Q, K and V projections of attention read one normalised input: one larger GEMM makes
one launch instead of three and uses the device better; the Split is views (no copy), and
the attention absorbs it when Q, K and V go straight in (`absorb_attention_reshapes`).
Only plain layers merge (no activation, no residual): the epilogues must be the same.

kiln::QGemm layers (FP8/INT8, kiln/ops/quantized.py) merge the same way when they read one quantized x with
one x_scale and zero point, write float of one dtype, and share one per-tensor weight scale (kiln's FP8
quantization gives the weights of one input a common scale, kiln/quant/qdq.py): the int32 biases are at the
same scale x_scale·w_scale, so weights and biases concatenate as they are.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.passes._rewrite import (
    KILN_DOMAIN,
    PassReport,
    attr,
    const,
    dtype_of,
    is_op,
    new_initializer,
    record_absorbed,
)

RULE = "merge_parallel_gemms"


def _plain(node: ir.Node, x: ir.Value) -> bool:
    """A FusedGemm reading x with a constant weight, no activation and no residual."""
    return is_op(node, "FusedGemm", domain=KILN_DOMAIN) and node.inputs[0] is x and len(node.inputs) <= 3 \
        and attr(node, "activation", "") == "" and const(node.inputs[1]) is not None


def _plain_quantized(node: ir.Node, x: ir.Value, first: ir.Node) -> bool:
    """A QGemm reading x as `first` does (same scale and zero point values), float output of the same type, no
    activation, constant weight and one weight scale equal to `first`'s."""
    if not is_op(node, "QGemm", domain=KILN_DOMAIN) or node.inputs[0] is not x:
        return False
    inputs = list(node.inputs) + [None] * (9 - len(node.inputs))
    if inputs[6] is not None or inputs[7] is not None or attr(node, "activation", "") != "":
        return False
    if inputs[1] is not first.inputs[1] or inputs[2] is not first.inputs[2]:
        return False
    if attr(node, "output_dtype", 1) != attr(first, "output_dtype", 1):
        return False
    w, scale, zero = const(inputs[3]), const(inputs[4]), const(inputs[5])
    first_scale = const(first.inputs[4])
    return w is not None and scale is not None and zero is not None and scale.size == 1 and \
        first_scale is not None and first_scale.size == 1 and float(scale.reshape(-1)[0]) == \
        float(first_scale.reshape(-1)[0]) and not zero.any()


def _merge_quantized(node: ir.Node, x: ir.Value) -> bool:
    group = [n for n in dict.fromkeys(u.node for u in x.uses()) if _plain_quantized(n, x, node)]
    if node not in group or group[0] is not node or len(group) < 2:
        return False
    if len({(w.dtype, w.shape[1]) for w in (const(n.inputs[3]) for n in group)}) != 1:
        return False
    stacked = _stacked(group, weight_at=3, bias_at=8, bias_dtype=np.int32)
    if stacked is None:
        return False  # a bias computed at run time
    weight, widths, bias = stacked
    graph = node.graph
    inputs = list(node.inputs[:3]) + [new_initializer(graph, f"{node.inputs[3].name}_merged", weight),
                                      node.inputs[4], node.inputs[5], None, None]
    inputs.append(None if bias is None else new_initializer(graph, f"{node.name}_bias_merged", bias))
    merged = ir.Node(KILN_DOMAIN, "QGemm", inputs, list(node.attributes.values()), name=f"{node.name}_merged")
    _split_into(node, group, merged, widths)
    return True


def merge_parallel_gemms(node: ir.Node, report: PassReport) -> bool:
    if is_op(node, "QGemm", domain=KILN_DOMAIN):
        return _merge_quantized(node, node.inputs[0])
    if not is_op(node, "FusedGemm", domain=KILN_DOMAIN):
        return False
    x = node.inputs[0]
    group = [n for n in dict.fromkeys(u.node for u in x.uses()) if _plain(n, x)]
    if node not in group or group[0] is not node or len(group) < 2:
        return False  # the first plain reader of x does the merge
    weights = [const(n.inputs[1]) for n in group]
    if len({(w.dtype, w.shape[1]) for w in weights}) != 1 or len({dtype_of(n.outputs[0]) for n in group}) != 1:
        report.refuse(RULE, node, "the GEMMs reading this input differ in weight dtype or input width")
        return False
    stacked = _stacked(group, weight_at=1, bias_at=2, bias_dtype=weights[0].dtype)
    if stacked is None:
        return False  # a bias computed at run time
    weight, widths, bias = stacked
    graph = node.graph
    inputs = [x, new_initializer(graph, f"{node.inputs[1].name}_merged", weight)]
    if bias is not None:
        inputs.append(new_initializer(graph, f"{node.name}_bias_merged", bias))
    merged = ir.Node(KILN_DOMAIN, "FusedGemm", inputs, list(node.attributes.values()), name=f"{node.name}_merged")
    _split_into(node, group, merged, widths)
    return True


def _stacked(group: list[ir.Node], weight_at: int, bias_at: int,
             bias_dtype: np.dtype) -> tuple[np.ndarray, list[int], np.ndarray | None] | None:
    """The group's constant weights stacked along the output axis, each one's width, and their biases stacked the
    same way in bias_dtype (zeros for a layer without one; None where no layer has one). None where a bias is
    computed at run time."""
    weights = [const(n.inputs[weight_at]) for n in group]
    widths = [w.shape[0] for w in weights]
    biases = []
    for n, width in zip(group, widths):
        value = n.inputs[bias_at] if len(n.inputs) > bias_at else None
        bias = None if value is None else const(value)
        if value is not None and bias is None:
            return None
        biases.append(np.zeros(width, bias_dtype) if bias is None else bias.reshape(width).astype(bias_dtype))
    has_bias = any(len(n.inputs) > bias_at and n.inputs[bias_at] is not None for n in group)
    return np.concatenate(weights, axis=0), widths, np.concatenate(biases) if has_bias else None


def _split_into(node: ir.Node, group: list[ir.Node], merged: ir.Node, widths: list[int]) -> None:
    """`merged` in place of `group`, its output split back into theirs along the last axis."""
    graph = node.graph
    record_absorbed(merged, group)
    out = merged.outputs[0]
    out.type = group[0].outputs[0].type
    shape = group[0].outputs[0].shape
    if shape is not None:
        out.shape = ir.Shape([*list(shape)[:-1], sum(widths)])
    if graph.opset_imports.get("", 18) >= 13:  # the sizes became an input in opset 13
        sizes = new_initializer(graph, f"{node.name}_split", np.array(widths, np.int64))
        split = ir.Node("", "Split", [out, sizes], [ir.AttrInt64("axis", -1)], num_outputs=len(group),
                        name=f"{node.name}_split")
    else:
        split = ir.Node("", "Split", [out], [ir.AttrInt64("axis", -1), ir.AttrInt64s("split", widths)],
                        num_outputs=len(group), name=f"{node.name}_split")
    first = min(group, key=lambda n: list(graph).index(n))
    graph.insert_before(first, [merged, split])
    for old, new in zip(group, split.outputs):
        name = old.outputs[0].name
        new.type, new.shape = old.outputs[0].type, old.outputs[0].shape
        ir.convenience.replace_all_uses_with(old.outputs[0], new, replace_graph_outputs=True)
        old.outputs[0].name = f"{name}__merged"
        new.name = name
    graph.remove(group, safe=True)
