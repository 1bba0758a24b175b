"""A squeeze-and-excitation block -> one kiln::SqueezeExcite.

    s = GlobalAveragePool(x)                 (or ReduceMean over every spatial axis, keepdims)
    h = act(Conv1x1(s, W1) + b1)             kiln::FusedConv (after fuse_conv)
    g = gate(Conv1x1(h, W2) + b2)            kiln::FusedConv, gate Sigmoid or HardSigmoid
    y = x * g                                g broadcast over x's spatial axes
      ->  y = SqueezeExcite(x, W1 [R, C], b1, W2 [C, R], b2)

EfficientNet, MobileNetV3 and RegNetY run one per block. Unfused, the block is four steps around
two 1x1 convolutions on a 1x1 map, and its channel scale (a Mul) splits the CPU's native segment
(no oneDNN primitive scales by a per-image vector); fused, it is one call of kiln's C kernel
(kiln/kernels/cpu/se.py) inside the segment. The rule runs after fuse_conv, so the activations it
reads are the convolutions' fused epilogues. Only CPU builds ask for it (PassOptions.squeeze_excite):
on CUDA the four steps stay cuDNN/torch layers captured in the engine's graph, as measured there.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.passes._rewrite import (
    KILN_DOMAIN,
    PassReport,
    attr,
    const,
    is_op,
    new_initializer,
    only_user,
    producer,
    reduce_axes,
    replace_with,
)

RULE = "fuse_squeeze_excite"
GATES = ("Sigmoid", "HardSigmoid")


def _pool_of(value: ir.Value) -> ir.Node | None:
    """The GlobalAveragePool / spatial keepdims ReduceMean producing `value`."""
    node = producer(value)
    if is_op(node, "GlobalAveragePool"):
        return node
    if not is_op(node, "ReduceMean") or attr(node, "keepdims", 1) != 1:
        return None
    x = node.inputs[0]
    rank = len(x.shape) if x.shape is not None else None
    axes = reduce_axes(node)
    if rank is None or rank < 3 or axes is None:
        return None
    return node if sorted(a % rank for a in axes) == list(range(2, rank)) else None


def _pointwise_refusal(conv: ir.Node, what: str) -> str | None:
    """Why `conv` is not a 1x1 FusedConv of constant weights without residual, or None."""
    w = const(conv.inputs[1])
    if w is None or w.ndim < 3 or any(d != 1 for d in w.shape[2:]):
        return f"the {what} convolution's weight is not a constant 1x1 kernel"
    if len(conv.inputs) > 2 and conv.inputs[2] is not None and const(conv.inputs[2]) is None:
        return f"the {what} convolution's bias is computed at run time"
    if len(conv.inputs) > 3 and conv.inputs[3] is not None:
        return f"the {what} convolution adds a residual"
    if int(attr(conv, "group", 1)) != 1:
        return f"the {what} convolution is grouped"
    if any(int(s) != 1 for s in attr(conv, "strides", None) or []) or any(
            int(d) != 1 for d in attr(conv, "dilations", None) or []):
        return f"the {what} convolution has strides or dilations"
    if any(int(p) != 0 for p in attr(conv, "pads", None) or []) or attr(conv, "auto_pad", "NOTSET") not in (
            "NOTSET", "VALID"):
        return f"the {what} convolution pads its input"
    return None


def _bias(conv: ir.Node) -> np.ndarray | None:
    return const(conv.inputs[2]) if len(conv.inputs) > 2 and conv.inputs[2] is not None else None


def _match(node: ir.Node) -> tuple[ir.Value, ir.Node, ir.Node, ir.Node] | None:
    """(x, pool, squeeze conv, excite conv) when `node` is Mul(x, gate(...pool(x)...)), either order."""
    if not is_op(node, "Mul") or len(node.inputs) != 2:
        return None
    for k in (0, 1):
        x, g = node.inputs[1 - k], node.inputs[k]
        excite = producer(g, "FusedConv", KILN_DOMAIN)
        if excite is None or attr(excite, "activation", "") not in GATES:
            continue
        squeeze = producer(excite.inputs[0], "FusedConv", KILN_DOMAIN)
        pool = _pool_of(squeeze.inputs[0]) if squeeze is not None else None
        if pool is not None and pool.inputs[0] is x:
            return x, pool, squeeze, excite
    return None


def _refusal(node: ir.Node, x: ir.Value, pool: ir.Node, squeeze: ir.Node, excite: ir.Node) -> str | None:
    for value, reader, what in ((excite.outputs[0], node, "the gate"), (squeeze.outputs[0], excite, "the squeeze"),
                                (pool.outputs[0], squeeze, "the pooled mean")):
        if only_user(value) is not reader:
            return f"{what} {value.name!r} is read elsewhere too (or is a graph output): it must stay a tensor"
    for conv, what in ((squeeze, "squeeze"), (excite, "excite")):
        if (reason := _pointwise_refusal(conv, what)) is not None:
            return reason
    w1, w2 = const(squeeze.inputs[1]), const(excite.inputs[1])  # [R, C, 1, 1], [C, R, 1, 1]
    shape = x.shape
    channels = shape[1] if shape is not None and len(shape) >= 3 else None
    if not isinstance(channels, int):
        return "the input's channel count is not static"
    if w1.shape[1] != channels or w2.shape[0] != channels or w2.shape[1] != w1.shape[0]:
        return (f"weights {list(w1.shape)} and {list(w2.shape)} do not squeeze {channels} channels and excite them "
                "back: the Mul would broadcast")
    out = node.outputs[0].shape
    if out is None or list(out) != list(shape):
        return "the Mul's output is not the input's shape"
    return None


def fuse_squeeze_excite(node: ir.Node, report: PassReport) -> bool:
    found = _match(node)
    if found is None:
        return False
    x, pool, squeeze, excite = found
    if (reason := _refusal(node, x, pool, squeeze, excite)) is not None:
        report.refuse(RULE, node, reason)
        return False
    graph = node.graph
    w1, w2 = const(squeeze.inputs[1]), const(excite.inputs[1])
    r, c = w1.shape[0], w2.shape[0]
    b1, b2 = _bias(squeeze), _bias(excite)
    inputs = [x, new_initializer(graph, f"{squeeze.inputs[1].name}_se", w1.reshape(r, c)),
              None if b1 is None else squeeze.inputs[2],
              new_initializer(graph, f"{excite.inputs[1].name}_se", w2.reshape(c, r)),
              None if b2 is None else excite.inputs[2]]
    while inputs[-1] is None:
        inputs.pop()
    attributes = [ir.AttrString("activation", attr(squeeze, "activation", "")),
                  ir.AttrFloat32("alpha", float(attr(squeeze, "alpha", 0.0))),
                  ir.AttrFloat32("beta", float(attr(squeeze, "beta", 0.0))),
                  ir.AttrString("gate", attr(excite, "activation")),
                  ir.AttrFloat32("gate_alpha", float(attr(excite, "alpha", 0.0))),
                  ir.AttrFloat32("gate_beta", float(attr(excite, "beta", 0.0)))]
    fused = ir.Node(KILN_DOMAIN, "SqueezeExcite", inputs, attributes, name=f"{node.name}_squeeze_excite")
    replace_with([pool, squeeze, excite, node], fused, node.outputs[0], insert_before=pool)
    return True
