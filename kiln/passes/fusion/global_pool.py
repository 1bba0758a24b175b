"""An AveragePool whose one window covers its whole input -> GlobalAveragePool.

    AveragePool(x, kernel k >= x's spatial size, no padding, one output position) = mean over x's spatial axes

transformers' EfficientNet ends in AvgPool2d(1280, ceil_mode=True) over a 7x7 map: one window,
hanging past the input, whose divisor counts the taps inside the input only (no padding is given, and
a ceil_mode tail is never counted, in onnxruntime and in kiln's op: kiln/ops/nn.py). That is the global
mean, which every device runs as a plain reduction and the CPU inside a native segment (oneDNN's
pooling primitive refuses ceil_mode, so the head used to leave the segment for torch).
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.passes._rewrite import PassReport, attr, is_op, replace_with, static_shape

RULE = "global_average_pool"


def pool_as_global_mean(node: ir.Node, report: PassReport) -> bool:
    if not is_op(node, "AveragePool"):
        return False
    x = static_shape(node.inputs[0])
    kernel = [int(k) for k in attr(node, "kernel_shape", []) or []]
    if x is None or len(x) < 3 or len(kernel) != len(x) - 2:
        return False
    if any(k < d for k, d in zip(kernel, x[2:])):
        return False  # windows smaller than the input: a pooling, not a mean
    if any(int(p) != 0 for p in attr(node, "pads", None) or []) or attr(node, "auto_pad", "NOTSET") not in (
            "NOTSET", "VALID"):
        report.refuse(RULE, node, "the window covers the input but the layer pads it: the divisor may count padding")
        return False
    if any(int(d) != 1 for d in attr(node, "dilations", None) or []):
        report.refuse(RULE, node, "the window covers the input with dilations: not every tap is read")
        return False
    strides = [int(s) for s in attr(node, "strides", None) or [1] * len(kernel)]
    ceil = int(attr(node, "ceil_mode", 0))
    # windows per axis: (d - k) / s + 1, rounded up in ceil_mode (no padding: none starts in it)
    counts = [-((k - d) // s) + 1 if ceil else (d - k) // s + 1 for d, k, s in zip(x[2:], kernel, strides)]
    if counts != [1] * len(kernel) or len(node.outputs) > 1:
        report.refuse(RULE, node, f"{counts} windows per spatial axis, not one")
        return False
    fused = ir.Node("", "GlobalAveragePool", [node.inputs[0]], [], name=node.name)
    replace_with([node], fused, node.outputs[0])
    return True
