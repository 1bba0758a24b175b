"""Conv + bias + activation + residual Add -> kiln::FusedConv, and the activation of that sum.

    y = act(Conv(x, W, b) + r)   or   y = act(Conv(x, W, b)) + r                 (fuse_conv)
    final(FusedConv(x, W, b, r))  ->  FusedConv(x, W, b, r, final_activation)   (fuse_conv_final_activation)

One step instead of up to four; the epilogue runs in place on the convolution's output. The second rule takes the
activation a residual block applies after its sum when the convolution's own activation came before it: a TCN block
(Bai, Kolter and Koltun 2018) is relu(relu(conv2(h)) + x). Left out, that ReLU is a step of its own between two
convolutions; on the CPU it also splits the native segment (bench/results/tcn-2026-12-05c.md). Only the CPU asks
for it (fusion.CPU_RULES): its convolution tactics apply the activation as one more oneDNN post-op.
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.passes._rewrite import KILN_DOMAIN, PassReport, attr, const, is_op, new_initializer, replace_with
from kiln.passes.fusion.epilogue import absorb_epilogue, activation_of

RULE = "fuse_conv"
RULE_FINAL = "fuse_conv_final_activation"


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


def fuse_conv_final_activation(node: ir.Node, report: PassReport) -> bool:
    if not is_op(node, "FusedConv", domain=KILN_DOMAIN) or attr(node, "final_activation", ""):
        return False
    act = activation_of(node.outputs[0])
    if act is None:
        return False
    if len(node.inputs) < 4 or node.inputs[3] is None:
        report.refuse(RULE_FINAL, node, f"{act[0]} after a convolution without a residual: the epilogue's own "
                      "activation is taken first, a second one only after the residual Add")
        return False
    name, alpha, beta, nodes, output = act
    attrs = [*node.attributes.values(), ir.AttrString("final_activation", name),
             ir.AttrFloat32("final_alpha", alpha), ir.AttrFloat32("final_beta", beta)]
    fused = ir.Node(KILN_DOMAIN, "FusedConv", list(node.inputs), attrs, name=node.name)
    replace_with([node, *nodes], fused, output)
    return True
