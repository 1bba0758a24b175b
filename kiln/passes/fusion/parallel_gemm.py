"""GEMMs reading the same input -> one kiln::FusedGemm on concatenated weights + Split.

    [x·W₁ᵀ + b₁, x·W₂ᵀ + b₂, x·W₃ᵀ + b₃] = split(x·[W₁; W₂; W₃]ᵀ + [b₁; b₂; b₃])

The Q, K and V projections of attention read one normalised input: one larger GEMM makes
one launch instead of three and uses the device better; the Split is views (no copy), and
the attention absorbs it when Q, K and V go straight in (`absorb_attention_reshapes`).
Only plain layers merge (no activation, no residual): the epilogues must be the same.
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


def merge_parallel_gemms(node: ir.Node, report: PassReport) -> bool:
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
    widths = [w.shape[0] for w in weights]
    biases = [const(n.inputs[2]) if len(n.inputs) > 2 and n.inputs[2] is not None else None for n in group]
    if any(len(n.inputs) > 2 and n.inputs[2] is not None and b is None for n, b in zip(group, biases)):
        return False  # a bias computed at run time
    graph = node.graph
    inputs = [x, new_initializer(graph, f"{node.inputs[1].name}_merged", np.concatenate(weights, axis=0))]
    if any(b is not None for b in biases):
        bias = np.concatenate([np.zeros(n, weights[0].dtype) if b is None else b.reshape(n)
                               for b, n in zip(biases, widths)])
        inputs.append(new_initializer(graph, f"{node.name}_bias_merged", bias.astype(weights[0].dtype)))
    merged = ir.Node(KILN_DOMAIN, "FusedGemm", inputs, list(node.attributes.values()), name=f"{node.name}_merged")
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
    return True
