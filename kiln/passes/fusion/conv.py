"""Conv + bias + activation + residual Add -> kiln::FusedConv, and the activation of that sum.

    y = act(Conv(x, W, b) + r)   or   y = act(Conv(x, W, b)) + r                 (fuse_conv)
    final(FusedConv(x, W, b, r))  ->  FusedConv(x, W, b, r, final_activation)   (fuse_conv_final_activation)
    act(layout(FusedConv(x, W, b)))  ->  layout(FusedConv(x, W, b, act))       (fuse_conv_activation_through_layout)

One step instead of up to four; the epilogue runs in place on the convolution's output. The second rule takes the
activation a residual block applies after its sum when the convolution's own activation came before it: a TCN block
(Bai, Kolter and Koltun 2018) is relu(relu(conv2(h)) + x). Left out, that ReLU is a step of its own between two
convolutions; on the CPU it also splits the native segment (bench/results/tcn-2026-12-05c.md). Only the CPU asks
for it (fusion.CPU_RULES): its convolution tactics apply the activation as one more oneDNN post-op.

The third takes an activation applied after Reshapes and Transposes of the convolution's output: an activation is
elementwise, so it commutes with any chain that only moves elements. A YOLO detector's heads are
sigmoid(reshape(transpose(reshape(conv(h))))) per scale; left there, the Sigmoid is a step of its own reading and
writing the head's whole output (~0.28 ms a call of YOLOv5n at 416, one Zen 4 thread), where as the convolution's
post-op it runs on the tile just computed (bench/results/yolo-heads-zen4-2026-12-07d.md). CPU only, as the second.
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.passes._rewrite import (
    KILN_DOMAIN,
    PassReport,
    attr,
    bypass_refusal,
    const,
    is_op,
    new_initializer,
    only_user,
    replace_with,
)
from kiln.passes.fusion.epilogue import absorb_epilogue, activation_of

RULE = "fuse_conv"
RULE_FINAL = "fuse_conv_final_activation"
RULE_THROUGH_LAYOUT = "fuse_conv_activation_through_layout"
LAYOUT_MOVERS = ("Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze")  # ops that only move elements


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


def _layout_chain_end(value: ir.Value) -> ir.Value | None:
    """The last output of the chain of element movers reading `value` alone, each output read by one node and
    no graph output; None when `value` is not read by such a chain."""
    end = None
    while (reader := only_user(value)) is not None and is_op(reader, *LAYOUT_MOVERS) and reader.inputs[0] is value:
        end = value = reader.outputs[0]
        if value.is_graph_output():
            return None
    return end


def fuse_conv_activation_through_layout(node: ir.Node, report: PassReport) -> bool:
    if not is_op(node, "FusedConv", domain=KILN_DOMAIN) or node.outputs[0].is_graph_output():
        return False
    end = _layout_chain_end(node.outputs[0])
    act = activation_of(end) if end is not None else None
    if act is None:
        return False
    name, alpha, beta, nodes, output = act
    if attr(node, "activation", ""):
        report.refuse(RULE_THROUGH_LAYOUT, node, f"{name} after the layout of a convolution that already applies "
                      f"{attr(node, 'activation', '')}: one activation a convolution")
        return False
    if len(node.inputs) > 3 and node.inputs[3] is not None:
        report.refuse(RULE_THROUGH_LAYOUT, node, f"{name} after the layout of a convolution with a residual: its "
                      "activation comes before the Add")
        return False
    if (why := bypass_refusal(nodes[-1], end)) is not None:
        report.refuse(RULE_THROUGH_LAYOUT, node, why)
        return False
    attrs = [a for a in node.attributes.values() if a.name not in ("activation", "alpha", "beta")]
    attrs += [ir.AttrString("activation", name), ir.AttrFloat32("alpha", alpha), ir.AttrFloat32("beta", beta)]
    replace_with([node], ir.Node(KILN_DOMAIN, "FusedConv", list(node.inputs), attrs, name=node.name), node.outputs[0])
    graph, out_name = end.graph, output.name
    ir.convenience.replace_all_uses_with(output, end, replace_graph_outputs=True)
    graph.remove(nodes, safe=True)
    if end.is_graph_output():
        output.name = f"{out_name}__removed"
        end.name = out_name
    return True
