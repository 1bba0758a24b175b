"""A convolution whose last output steps a Slice cuts off: the same convolution with less padding at the end.

    Slice(Conv(x, pads=[.., p_end]), axis -1, [0, -c))  ->  Conv(x, pads=[.., p_end - c])      (stride 1, c <= p_end)

Output j of a stride-1 convolution reads inputs j - p_begin .. j - p_begin + d·(k-1); the output length is
W + p_begin + p_end - d·(k-1). Cutting the last c outputs leaves outputs 0 .. that length - c - 1, which are exactly
the outputs of the convolution with c less end padding: the same sums, in the same order. This is how a causal
convolution is written in the TCN reference code and the sensor models built from it (Conv1d(padding=(k-1)·d)
then a "chomp" of the last (k-1)·d steps): each chomp is a copy, and on the CPU it sits between the convolution
and its ReLU (no epilogue fusion) and forces the activations out of the convolutions' channels-last layout and back.
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.passes._rewrite import KILN_DOMAIN, PassReport, attr, const, is_op, only_user, producer, static_shape

RULE = "causal_conv_pads"


def _cut_at_end(node: ir.Node, rank: int) -> int | None:
    """The steps a Slice cuts off the end of the last axis and nothing else (starts 0, step 1), or None."""
    inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
    starts, ends, axes, steps = (const(v) for v in inputs[1:5])
    if starts is None or ends is None or starts.size != 1 or ends.size != 1 or int(starts.reshape(-1)[0]) != 0:
        return None
    if inputs[3] is not None and (axes is None or axes.size != 1 or int(axes.reshape(-1)[0]) % rank != rank - 1):
        return None
    if inputs[3] is None and rank != 1:
        return None  # no axes: every axis from the first, here only the first
    if inputs[4] is not None and (steps is None or steps.size != 1 or int(steps.reshape(-1)[0]) != 1):
        return None
    end = int(ends.reshape(-1)[0])
    if end < 0:
        return -end
    length = static_shape(node.inputs[0])
    return None if length is None or end > length[-1] else length[-1] - end


def trim_conv_padding(node: ir.Node, report: PassReport) -> bool:
    if not is_op(node, "Slice"):
        return False
    conv = producer(node.inputs[0], "Conv") or producer(node.inputs[0], "FusedConv", domain=KILN_DOMAIN)
    if conv is None or len(conv.outputs) != 1 or only_user(conv.outputs[0]) is not node:
        return False
    y = conv.outputs[0]
    if y.shape is None:
        return False
    rank = len(y.shape)
    cut = _cut_at_end(node, rank)
    if cut is None or cut == 0:
        return False
    spatial = rank - 2
    pads = [int(p) for p in attr(conv, "pads", None) or [0] * (2 * spatial)]
    strides = [int(s) for s in attr(conv, "strides", None) or [1] * spatial]
    if attr(conv, "auto_pad", "NOTSET") not in ("NOTSET", ""):
        report.refuse(RULE, conv, f"auto_pad={attr(conv, 'auto_pad')}: the pads follow the input size")
        return False
    if strides[-1] != 1:
        report.refuse(RULE, conv, f"stride {strides[-1]} on the sliced axis: only stride 1 drops whole pads")
        return False
    if pads[-1] < cut:
        report.refuse(RULE, conv, f"the Slice cuts {cut} steps, past the end padding {pads[-1]}")
        return False
    pads[-1] -= cut
    conv.attributes["pads"] = ir.AttrInt64s("pads", pads)
    out = node.outputs[0]
    y.shape = out.shape
    name = out.name
    ir.convenience.replace_all_uses_with(out, y, replace_graph_outputs=True)
    node.graph.remove(node, safe=True)
    out.name = f"{name}__replaced"
    y.name = name
    return True
