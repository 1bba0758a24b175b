"""The epilogue a Conv/Gemm can absorb: bias Add, one activation, one residual Add.

Matched forward from the layer's output along single-use edges:

    y = layer(x) [+ bias]  ->  act(y) [+ r]   or   act(y + r)

`absorb_epilogue` returns what it took and the nodes it covers; when the next node looks
absorbable but is not (its input is read elsewhere, shapes broadcast), it says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from kiln.passes._rewrite import (
    PassReport,
    attr,
    const,
    const_scalar,
    consumers,
    is_op,
    only_user,
    other_input,
    same_shape,
)

SIMPLE_ACTIVATIONS = {"Relu": "Relu", "Sigmoid": "Sigmoid", "Tanh": "Tanh", "HardSwish": "HardSwish"}


@dataclass
class Epilogue:
    output: ir.Value  # the value the fused node will produce
    nodes: list[ir.Node] = field(default_factory=list)
    bias: np.ndarray | None = None
    activation: str = ""
    alpha: float = 0.0
    beta: float = 0.0
    residual: ir.Value | None = None
    residual_after_activation: int = 0

    def attributes(self) -> list[ir.Attr]:
        return [ir.AttrString("activation", self.activation), ir.AttrFloat32("alpha", self.alpha),
                ir.AttrFloat32("beta", self.beta),
                ir.AttrInt64("residual_after_activation", self.residual_after_activation)]


def activation_of(v: ir.Value) -> tuple[str, float, float, list[ir.Node], ir.Value] | None:
    """(name, alpha, beta, nodes, output) if the reader(s) of v apply one activation to it."""
    users = consumers(v)
    if v.is_graph_output():
        return None
    if len(users) == 2:  # SiLU: v * sigmoid(v)
        sig = next((n for n in users if is_op(n, "Sigmoid")), None)
        mul = next((n for n in users if is_op(n, "Mul")), None)
        if sig and mul and only_user(sig.outputs[0]) is mul and set(mul.inputs) == {v, sig.outputs[0]}:
            return "SiLU", 0.0, 0.0, [sig, mul], mul.outputs[0]
        return None
    node = only_user(v)
    if node is None:
        return None
    if is_op(node, *SIMPLE_ACTIVATIONS):
        return SIMPLE_ACTIVATIONS[node.op_type], 0.0, 0.0, [node], node.outputs[0]
    if is_op(node, "Gelu") or is_op(node, "Gelu", domain="kiln"):
        name = "GeluTanh" if attr(node, "approximate", "none") == "tanh" else "Gelu"
        return name, 0.0, 0.0, [node], node.outputs[0]
    if is_op(node, "LeakyRelu"):
        return "LeakyRelu", attr(node, "alpha", 0.01), 0.0, [node], node.outputs[0]
    if is_op(node, "HardSigmoid"):
        return "HardSigmoid", attr(node, "alpha", 0.2), attr(node, "beta", 0.5), [node], node.outputs[0]
    if is_op(node, "Clip") and node.inputs[0] is v:
        bounds = []
        for i, default in ((1, "min"), (2, "max")):
            bound = node.inputs[i] if len(node.inputs) > i else None
            if bound is None:
                bounds.append(attr(node, default, -np.inf if default == "min" else np.inf))
            elif const_scalar(bound) is None:
                return None
            else:
                bounds.append(const_scalar(bound))
        return "Clip", float(bounds[0]), float(bounds[1]), [node], node.outputs[0]
    return None


def _feeds_layer_norm(v: ir.Value) -> bool:
    return any(is_op(n, "LayerNormalization") and n.inputs[0] is v for n in consumers(v))


def _residual(v: ir.Value, leave_to_norm: bool = False) -> tuple[ir.Node, ir.Value] | None:
    node = only_user(v)
    if not is_op(node, "Add"):
        return None
    r = other_input(node, v)
    if r is None or r is v or const(r) is not None or not same_shape(node.outputs[0], v):
        return None
    if leave_to_norm and _feeds_layer_norm(node.outputs[0]):
        return None  # fuse_skip_layer_norm adds it inside the norm's pass over the row: one pass fewer
    return node, r


def _bias(v: ir.Value, channels: int, channel_axis: int) -> tuple[ir.Node, np.ndarray] | None:
    node = only_user(v)
    if not is_op(node, "Add"):
        return None
    c = const(other_input(node, v))
    if c is None or v.shape is None or c.ndim > len(v.shape):
        return None
    padded = (1,) * (len(v.shape) - c.ndim) + c.shape
    rank = len(padded)
    if any(n != 1 for i, n in enumerate(padded) if i != channel_axis % rank) or padded[channel_axis] not in (1, channels):
        return None
    return node, np.broadcast_to(c.reshape(-1), (channels,))


def absorb_epilogue(value: ir.Value, channels: int, channel_axis: int, take_bias: bool,
                    rule: str, layer: ir.Node, report: PassReport, leave_residual_to_norm: bool = False) -> Epilogue:
    ep = Epilogue(output=value)
    if take_bias and (found := _bias(value, channels, channel_axis)):
        ep.nodes.append(found[0])
        ep.bias = found[1]
        ep.output = found[0].outputs[0]
    for _ in range(2):
        if not ep.activation and (act := activation_of(ep.output)):
            ep.activation, ep.alpha, ep.beta, nodes, ep.output = act
            ep.nodes += nodes
            continue
        if ep.residual is None and (res := _residual(ep.output, leave_residual_to_norm and not ep.activation)):
            ep.nodes.append(res[0])
            ep.residual = res[1]
            ep.residual_after_activation = int(bool(ep.activation))
            ep.output = res[0].outputs[0]
            continue
        break
    users = consumers(ep.output)
    blocked = len(users) > 1 or ep.output.is_graph_output()
    if blocked and any(is_op(n, "Relu", "Sigmoid", "Clip", "Gelu", "Tanh", "LeakyRelu") for n in users):
        readers = ", ".join(n.op_type for n in users) + (", a graph output" if ep.output.is_graph_output() else "")
        report.refuse(rule, layer, f"{ep.output.name!r} is read by {readers}: the activation cannot be "
                      "absorbed while another reader needs the value before it")
    elif len(users) == 1 and is_op(users[0], "Add") and ep.residual is None and _residual(ep.output):
        report.refuse(rule, layer, f"Add {users[0].name!r} left to fuse_skip_layer_norm: the LayerNorm that "
                      "reads the sum adds it in its own pass")
    elif len(users) == 1 and is_op(users[0], "Add") and ep.residual is None:
        report.refuse(rule, layer, f"Add {users[0].name!r} not absorbed as residual: its other input is "
                      "a constant that is not per-channel, or the Add broadcasts the layer output")
    return ep
