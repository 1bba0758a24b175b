"""Conv + bias + activation + residual Add -> kiln::FusedConv.

    y = act(Conv(x, W, b) + r)   or   y = act(Conv(x, W, b)) + r

One step instead of up to three; the epilogue runs in place on the convolution's output.
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.passes._rewrite import KILN_DOMAIN, PassReport, const, is_op, new_initializer, replace_with
from kiln.passes.fusion.epilogue import absorb_epilogue

RULE = "fuse_conv"


def fuse_conv(node: ir.Node, report: PassReport) -> bool:
    if not is_op(node, "Conv"):
        return False
    w = node.inputs[1]
    b = node.inputs[2] if len(node.inputs) > 2 else None
    if w.shape is None or len(w.shape) not in (3, 4, 5):
        report.refuse(RULE, node, "the weight's rank is unknown or not 1-3 spatial dims")
        return False
    channels = w.shape[0]
    if not isinstance(channels, int):
        report.refuse(RULE, node, "the number of output channels is not static")
        return False
    ep = absorb_epilogue(node.outputs[0], channels, 1, take_bias=b is None or const(b) is not None,
                         rule=RULE, layer=node, report=report)
    graph = node.graph
    if ep.bias is not None:
        bias = ep.bias if b is None else const(b) + ep.bias
        dtype = const(w).dtype if const(w) is not None else bias.dtype
        b = new_initializer(graph, f"{node.name}_bias", bias.astype(dtype))
    inputs = [node.inputs[0], w, b, ep.residual]
    while inputs and inputs[-1] is None:
        inputs.pop()
    attrs = [a for a in node.attributes.values()] + ep.attributes()
    fused = ir.Node(KILN_DOMAIN, "FusedConv", inputs, attrs, name=node.name)
    replace_with([node, *ep.nodes], fused, ep.output)
    return True
