"""1-D convolutions as 2-D ones of height 1, so they run where the CPU's 2-D convolutions run.

    FusedConv1d(x, W, b, r)  ->  Squeeze(FusedConv2d(Unsqueeze(x, 2), W[:, :, None, :], b, Unsqueeze(r, 2)), 2)
    Unsqueeze(Squeeze(z, 2), 2)  ->  z                       (z [N, C, 1, W]: between two such layers)
    ReduceMean(Squeeze(z, 2), time axis)  ->  Reshape(ReduceMean(z, [2, 3], keepdims=1), its shape)

A sensor model's Conv1d stack ([N, C, W]) is a 2-D stack of height 1: same arithmetic, same order of
accumulation per output, same epilogue. As 2-D layers the CPU binds them once as oneDNN primitives
on channels-last memory (N, W, C: what a [batch, steps, features] window already is) and runs the
stack inside a native segment, as it runs an image CNN's; a 1-D convolution otherwise goes through
torch.conv1d, which builds a oneDNN primitive on every call. The global mean over time that such a
classifier ends in becomes the whole-image average the segment runs too, and a Reshape to the
[N, C] the head reads moves no byte.

Only on the CPU (fusion.CPU_RULES): the CUDA path was measured on the 1-D layers as they are.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.passes._rewrite import (
    KILN_DOMAIN,
    PassReport,
    attr,
    const,
    consumers,
    is_op,
    new_initializer,
    producer,
    reduce_axes,
    replace_with,
    static_shape,
)

RULE = "conv1d_as_conv2d"
RULE_MEAN = "conv1d_mean_as_global_pool"


def _rank(value: ir.Value | None) -> int | None:
    return None if value is None or value.shape is None else len(value.shape)


def _ints(node: ir.Node, name: str, default: list[int]) -> list[int]:
    return [int(v) for v in attr(node, name, None) or default]


def _axes_input(graph: ir.Graph, name: str) -> ir.Value:
    return new_initializer(graph, name, np.array([2], np.int64))


def _height_axis(node: ir.Node) -> bool:
    """Whether a Squeeze / Unsqueeze node's constant axes are [2] alone (a [N, C, W] <-> [N, C, 1, W] move)."""
    axes = const(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
    return axes is not None and [int(a) % 4 for a in axes.reshape(-1)] == [2]


def _as_4d(node: ir.Node, value: ir.Value, name: str) -> tuple[ir.Value, ir.Node | None]:
    """value [N, C, W] as [N, C, 1, W]: the 4-D value it was squeezed from, the Unsqueeze another layer reading it
    already made (a block's input read by its first convolution and its 1x1 downsample: one copy, not two), or a
    new Unsqueeze (not yet in the graph)."""
    source = producer(value, "Squeeze")
    if source is not None and _height_axis(source):
        x = source.inputs[0]
        if _rank(x) == 4 and x.shape[2] == 1:
            return x, None
    made = next((n for n in consumers(value) if is_op(n, "Unsqueeze") and n.inputs[0] is value and _height_axis(n)),
                None)
    if made is not None:
        return made.outputs[0], None
    unsqueeze = ir.Node("", "Unsqueeze", [value, _axes_input(node.graph, f"{name}_axes")], name=name)
    out = unsqueeze.outputs[0]
    out.type = value.type
    if value.shape is not None:
        dims = list(value.shape)
        out.shape = ir.Shape([dims[0], dims[1], 1, dims[2]])
    return out, unsqueeze


def _opset(node: ir.Node) -> int:
    return int(node.graph.opset_imports.get("", 0))


def conv1d_as_conv2d(node: ir.Node, report: PassReport) -> bool:
    if not (is_op(node, "FusedConv", domain=KILN_DOMAIN) or is_op(node, "Conv")):
        return False
    x, w = node.inputs[0], node.inputs[1]
    if _rank(x) != 3:
        return False
    if _opset(node) < 13:
        report.refuse(RULE, node, f"opset {_opset(node)}: Squeeze/Unsqueeze take their axes as an attribute")
        return False
    weight = const(w)
    if weight is None or weight.ndim != 3:
        report.refuse(RULE, node, "the weight is not a constant [O, C/group, k]")
        return False
    if attr(node, "auto_pad", "NOTSET") not in ("NOTSET", "", "VALID"):
        report.refuse(RULE, node, f"auto_pad={attr(node, 'auto_pad')}: the pads depend on the input size")
        return False
    b = node.inputs[2] if len(node.inputs) > 2 else None
    residual = node.inputs[3] if len(node.inputs) > 3 else None
    if residual is not None and _rank(residual) != 3:
        report.refuse(RULE, node, "the residual is not a [N, O, W] tensor")
        return False
    if len(node.outputs) != 1:
        return False

    graph = node.graph
    name = node.name or "conv1d"
    pads = [0, 0] if attr(node, "auto_pad", "NOTSET") == "VALID" else _ints(node, "pads", [0, 0])
    x4, x_node = _as_4d(node, x, f"{name}_as_2d")
    r4, r_node = (None, None) if residual is None else _as_4d(node, residual, f"{name}_residual_as_2d")
    w4 = new_initializer(graph, f"{w.name}_2d", weight[:, :, None, :])
    changed = {"kernel_shape": [1, int(weight.shape[2])], "strides": [1, *_ints(node, "strides", [1])],
               "dilations": [1, *_ints(node, "dilations", [1])], "pads": [0, pads[0], 0, pads[1]]}
    attrs = [a for a in node.attributes.values() if a.name not in changed and a.name != "auto_pad"]
    attrs += [ir.AttrInt64s(k, v) for k, v in changed.items()]
    inputs = [x4, w4, b] + ([r4] if residual is not None else [])
    conv = ir.Node(KILN_DOMAIN, "FusedConv", inputs, attrs, name=f"{name}_2d")
    y = node.outputs[0]
    y4 = conv.outputs[0]
    y4.type = y.type
    if y.shape is not None:
        dims = list(y.shape)
        y4.shape = ir.Shape([dims[0], dims[1], 1, dims[2]])
    squeeze = ir.Node("", "Squeeze", [y4, _axes_input(graph, f"{name}_squeeze_axes")], name=name)
    for new in (x_node, r_node, conv):
        if new is not None:
            graph.insert_before(node, new)
    conv.metadata_props.update(node.metadata_props)
    replace_with([node], squeeze, y)
    return True


def conv1d_mean_as_global_pool(node: ir.Node, report: PassReport) -> bool:
    """ReduceMean over the time axis of a squeezed [N, C, 1, W] -> the 4-D whole-image mean + Reshape."""
    if not is_op(node, "ReduceMean"):
        return False
    squeeze = producer(node.inputs[0], "Squeeze")
    if squeeze is None or len(squeeze.inputs) < 2 or squeeze.inputs[1] is None:
        return False
    z = squeeze.inputs[0]
    axes = const(squeeze.inputs[1])
    if axes is None or [int(a) % 4 for a in axes.reshape(-1)] != [2] or _rank(z) != 4 or z.shape[2] != 1:
        return False
    mean_axes = reduce_axes(node)
    if mean_axes is None or [a % 3 for a in mean_axes] != [2]:
        return False  # not the time axis alone
    out_shape = static_shape(node.outputs[0])
    if out_shape is None:
        report.refuse(RULE_MEAN, node, "the output's shape is not static: no constant Reshape restores it")
        return False
    graph = node.graph
    keepdims = ir.AttrInt64("keepdims", 1)
    if _opset(node) >= 18:  # the axes an input
        pooled = ir.Node("", "ReduceMean", [z, new_initializer(graph, f"{node.name}_axes", np.array([2, 3], np.int64))],
                         [keepdims], name=f"{node.name}_2d")
    else:
        pooled = ir.Node("", "ReduceMean", [z], [keepdims, ir.AttrInt64s("axes", [2, 3])], name=f"{node.name}_2d")
    pooled.outputs[0].type = node.outputs[0].type
    pooled.outputs[0].shape = ir.Shape([z.shape[0], z.shape[1], 1, 1])
    reshape = ir.Node("", "Reshape", [pooled.outputs[0],
                                      new_initializer(graph, f"{node.name}_shape", np.array(out_shape, np.int64))],
                      name=node.name)
    graph.insert_before(node, pooled)
    replace_with([node], reshape, node.outputs[0])
    return True
