"""SmoothQuant (Xiao et al., 2023): move the quantization difficulty of activations with outlier channels
into the weights, leaving the float model unchanged.

A transformer's LayerNorm output has a few channels 10-100x larger than the others: one per-tensor int8
scale spends its levels on them and the other channels round to a handful of steps. For a consumer
y = X·W (X [..., K], W [K, N]) and any s > 0 per input channel j,

    y = (X · diag(s)⁻¹) · (diag(s) · W)
    s_j = max|X_j|^α / max|W_j|^(1-α)        α in [0, 1]; max|W_j| over row j of every consumer's weight

evens the channels' ranges out (α = 0.5: both X' and W' have range √(max|X_j| · max|W_j|) on channel j).
X·diag(s)⁻¹ is folded into the producer, so the graph gains no op:

    LayerNormalization (also com.microsoft's SkipLayerNormalization)   γ' = γ / s,  β' = β / s
    SimplifiedLayerNormalization, RMSNormalization                     γ' = γ / s
    MatMul(x, W_p), Gemm(x, B, C)       W_p[:, j] /= s_j (B's output channels),  C[..., j] /= s_j
    Mul(a, c), c constant               c' = c / s
    Add(a, c), c constant               c' = c / s, and a's producer takes 1/s (recursively): a decomposed
                                        LayerNorm's Mul(γ) -> Add(β), a Linear's MatMul -> Add(bias)

and diag(s)·W into every consumer's weight rows. Consumers reading one activation (Q, K, V) share one s.
An activation that another op reads too (a post-LN BERT's residual Add reads its LayerNorm's output),
or whose producer has no per-channel scale to fold into (Gelu, the attention's Softmax·V, a Reshape), is
left as it is, and each of its layers says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
import torch

from kiln.errors import KilnError
from kiln.quant.qdq import Target, targets

# (domain, normalization) -> input index of its per-channel scale γ, of its shift β (None: it has none)
NORMALIZATIONS = {("", "LayerNormalization"): (1, 2), ("", "SimplifiedLayerNormalization"): (1, None),
                  ("", "RMSNormalization"): (1, None), ("com.microsoft", "SkipLayerNormalization"): (2, 3),
                  ("com.microsoft", "SkipSimplifiedLayerNormalization"): (2, None)}
FOLDS_INTO = ("LayerNormalization, SimplifiedLayerNormalization, RMSNormalization, SkipLayerNormalization, "
              "MatMul/Gemm with a constant weight, Mul by a constant, Add of a constant to one of these")
FLOOR = 1e-5  # the smallest channel maximum a factor is formed from (SmoothQuant's clamp)


def check_alpha(alpha: object) -> float | None:
    """The migration strength as a float, None when smoothing is off; a clear error otherwise."""
    if alpha is None or alpha is False:
        return None
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0:
        raise KilnError(f"smoothquant={alpha!r}: the migration strength alpha is a number in [0, 1] "
                        "(0.5 is SmoothQuant's default; larger moves more of the activations' range into the "
                        "weights), or None to leave the activations as they are")
    return float(alpha)


class ChannelMax:
    """max |x| per channel (the last axis) over every calibration batch."""

    def __init__(self):
        self._max: torch.Tensor | None = None

    def observe(self, x: torch.Tensor) -> None:
        if not x.numel() or x.dim() == 0:
            return
        m = x.detach().abs().float().reshape(-1, x.shape[-1]).amax(0)  # [K]
        self._max = m if self._max is None else torch.maximum(self._max, m)

    def value(self) -> np.ndarray:
        return np.zeros(0, np.float32) if self._max is None else self._max.numpy().astype(np.float32)


@dataclass
class Group:
    """One activation and every layer reading it: one smoothing factor s for all of them."""

    activation: ir.Value  # X [..., K]
    producer: ir.Node  # where 1/s is folded
    consumers: list[Target]  # MatMul/Gemm with a constant weight, X their input 0: where s is folded


@dataclass
class Plan:
    groups: list[Group] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # layer name -> why its input is not smoothed


def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None or value.is_graph_input():
        return None
    return value.const_value.numpy()


def _input_axis(t: Target) -> int:
    """The weight's input-channel axis (K): MatMul's W [K, N] rows, Gemm's B rows or, with transB, columns."""
    return 1 - t.channel_axis


def _domain(node: ir.Node) -> str:
    return "" if node.domain == "ai.onnx" else node.domain


def _constant_operand(node: ir.Node) -> int | None:
    """Which input of a binary node is the constant one, when exactly one is."""
    if len(node.inputs) != 2:
        return None
    constant = [_const(v) is not None for v in node.inputs]
    return constant.index(True) if constant.count(True) == 1 else None


def _why_not_foldable(value: ir.Value, channels: int) -> str | None:
    """None when 1/s per channel (the last axis, `channels` wide) folds into the constants of the node
    producing `value`, else why not. An Add of a constant folds when its other operand does (recursively):
    (a + c)/s = a/s + c/s, the decomposed LayerNorm's Mul(γ) -> Add(β), a Linear's MatMul -> Add(bias)."""
    node = value.producer()
    if node is None:
        return "it is a graph input: no producer to fold 1/s into"
    where = f"{node.op_type} {node.name!r}"
    if node.outputs[0] is not value:
        return f"it is output {value.index()} of {where}, which has no per-channel scale"
    key = (_domain(node), node.op_type)
    if key in NORMALIZATIONS:
        scale, shift = NORMALIZATIONS[key]
        if len(node.inputs) <= scale or _const(node.inputs[scale]) is None:
            return f"{where}'s scale is not a constant"
        if shift is not None and len(node.inputs) > shift and node.inputs[shift] is not None \
                and _const(node.inputs[shift]) is None:
            return f"{where}'s bias is not a constant"
        return None
    if key in (("", "MatMul"), ("", "Gemm")):
        weight = _const(node.inputs[1]) if len(node.inputs) > 1 else None
        if weight is None or weight.ndim != 2 or _const(node.inputs[0]) is not None:
            return f"{where} has no constant 2-D weight as its second input"
        if node.op_type == "Gemm" and len(node.inputs) > 2 and node.inputs[2] is not None \
                and _const(node.inputs[2]) is None:
            return f"{where}'s C is not a constant"
        return None
    if key in (("", "Mul"), ("", "Add")):
        k = _constant_operand(node)
        c = None if k is None else _const(node.inputs[k])
        if c is None or (c.ndim and c.shape[-1] not in (1, channels)):
            return f"it comes from {where}, which has no constant per-channel operand to fold 1/s into"
        if node.op_type == "Mul":
            return None
        a = node.inputs[1 - k]
        if a.is_graph_output() or len(a.uses()) != 1:
            return f"{where} adds a constant to {a.name!r}, which is read elsewhere too"
        if a.shape is None or not a.shape.rank() or a.shape[-1] != channels:
            return f"{where} adds a constant to {a.name!r}, whose last axis is not the {channels} channels"
        why = _why_not_foldable(a, channels)
        return None if why is None else f"{where} adds a constant to {a.name!r}: {why}"
    return f"it comes from {where}, which has no per-channel scale to fold 1/s into (kiln folds into {FOLDS_INTO})"


def plan(graph: ir.Graph) -> Plan:
    """The activations SmoothQuant can smooth, and why each other MatMul/Gemm input cannot be."""
    found = Plan()
    by_activation: dict[str, list[Target]] = {}
    values: dict[str, ir.Value] = {}
    for t in targets(graph):  # pinned layers too: they absorb s in float as well
        if t.node.op_type in ("MatMul", "Gemm"):
            by_activation.setdefault(t.activation.name, []).append(t)
            values[t.activation.name] = t.activation
    for name, consumers in by_activation.items():
        x = values[name]
        readers = {id(t.node) for t in consumers}
        others = [u.node for u in x.uses() if id(u.node) not in readers or u.idx != 0]
        channels = {t.weight.const_value.shape[_input_axis(t)] for t in consumers}
        if x.is_graph_output():
            why = "it is also a graph output, which would be divided by s"
        elif others:
            why = (f"{others[0].op_type} {others[0].name!r} reads it too (not a MatMul/Gemm with a constant "
                   f"weight), and would see it divided by s")
        elif len(channels) != 1:
            why = "its readers' weights disagree on its channel count"
        else:
            why = _why_not_foldable(x, channels.pop())
        if why is None:
            found.groups.append(Group(x, x.producer(), consumers))
        else:
            for t in consumers:
                found.skipped[t.node.name] = f"not smoothed: its input {name!r}: {why}"
    return found


def factors(group: Group, channel_max: np.ndarray, alpha: float) -> np.ndarray:
    """s [K] = max|X_j|^α / max|W_j|^(1-α); 1 on a channel that was 0 on every batch (or whose weights are)."""
    x_max = np.asarray(channel_max, np.float64)
    w_max = np.zeros_like(x_max)
    for t in group.consumers:
        w = np.abs(t.weight.const_value.numpy().astype(np.float64))
        row_max = w.max(axis=t.channel_axis)  # [K]: over the output channels
        if row_max.shape != x_max.shape:
            raise KilnError(f"smoothquant: layer {t.node.name!r} reads {group.activation.name!r} with {row_max.size} "
                            f"input channels, but calibration measured {x_max.size}")
        w_max = np.maximum(w_max, row_max)
    s = np.maximum(x_max, FLOOR) ** alpha / np.maximum(w_max, FLOOR) ** (1.0 - alpha)
    return np.where((x_max > 0) & (w_max > 0), s, 1.0)


def replace_constant(graph: ir.Graph, node: ir.Node, index: int, array: np.ndarray, suffix: str) -> None:
    """The node's input `index` becomes a new initializer holding `array` (the old one is kept for other
    readers, and dropped when it has none)."""
    old = node.inputs[index]
    name = f"{node.name or old.name}_{suffix}"
    while name in graph.initializers:
        name += "_"
    tensor = ir.tensor(array.astype(old.const_value.numpy().dtype), name=name)
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
    graph.register_initializer(value)
    node.replace_input_with(index, value)
    if not old.uses() and old.name in graph.initializers and not old.is_graph_output():
        graph.initializers.pop(old.name)


def _per_last_axis(array: np.ndarray, size: int) -> np.ndarray:
    """`array` broadcast to `size` on its last axis (a scalar or [..., 1] scale becomes per channel)."""
    shape = array.shape[:-1] + (size,) if array.ndim else (size,)
    return np.broadcast_to(array.astype(np.float64), shape)


def _divide_output(graph: ir.Graph, node: ir.Node, s: np.ndarray) -> None:
    """The node's output 0 divided by s per channel, through its constants (what _why_not_foldable allowed)."""
    key = (_domain(node), node.op_type)
    if key in NORMALIZATIONS:  # γ' = γ/s, β' = β/s
        scale, shift = NORMALIZATIONS[key]
        replace_constant(graph, node, scale, _per_last_axis(_const(node.inputs[scale]), s.size) / s, "smoothed_scale")
        if shift is not None and len(node.inputs) > shift and node.inputs[shift] is not None:
            replace_constant(graph, node, shift, _per_last_axis(_const(node.inputs[shift]), s.size) / s,
                              "smoothed_bias")
    elif node.op_type in ("MatMul", "Gemm"):  # its output channels are W_p's columns (B's rows with transB)
        trans_b = node.op_type == "Gemm" and bool(node.attributes.get_int("transB", 0))
        w = _const(node.inputs[1]).astype(np.float64)
        replace_constant(graph, node, 1, w / (s[:, None] if trans_b else s[None, :]), "smoothed_weight")
        if node.op_type == "Gemm" and len(node.inputs) > 2 and node.inputs[2] is not None:
            replace_constant(graph, node, 2, _per_last_axis(_const(node.inputs[2]), s.size) / s, "smoothed_bias")
    else:  # Mul(a, c): c/s;  Add(a, c): a/s + c/s
        k = _constant_operand(node)
        replace_constant(graph, node, k, _per_last_axis(_const(node.inputs[k]), s.size) / s, "smoothed_constant")
        if node.op_type == "Add":
            _divide_output(graph, node.inputs[1 - k].producer(), s)


def apply(graph: ir.Graph, group: Group, s: np.ndarray) -> None:
    """Fold 1/s into the producer's output channels and s into the consumers' weight rows (in place)."""
    _divide_output(graph, group.producer, s)
    for t in group.consumers:
        w = t.weight.const_value.numpy().astype(np.float64)
        shape = [1, 1]
        shape[_input_axis(t)] = -1
        replace_constant(graph, t.node, 1, w * s.reshape(shape), "smoothed_weight")


def smooth(model: ir.Model, found: Plan, channel_max: dict[str, np.ndarray], alpha: float) -> dict:
    """Smooth every planned group (in place) and return the header record: per layer what its input was
    smoothed with, or why not; per activation its channel range spread (max/median of the channel
    maxima) before and after. Every factor is formed from the weights as they were: the groups commute."""
    alpha = check_alpha(alpha)
    scaled = [(g, factors(g, channel_max[g.activation.name], alpha)) for g in found.groups]
    smoothed: dict[str, str] = {}
    spread: dict[str, list[float]] = {}
    for group, s in scaled:
        apply(model.graph, group, s)
        x_max = np.asarray(channel_max[group.activation.name], np.float64)
        spread[group.activation.name] = [round(channel_spread(x_max), 2), round(channel_spread(x_max / s), 2)]
        for t in group.consumers:
            smoothed[t.node.name] = (f"smoothed (alpha {alpha:g}): 1/s folded into {group.producer.op_type} "
                                     f"{group.producer.name!r}, shared by {len(group.consumers)} layer(s)")
    return {"alpha": alpha, "smoothed": smoothed, "skipped": dict(found.skipped), "spread": spread}


def channel_spread(channel_max: np.ndarray) -> float:
    median = float(np.median(channel_max))
    return float(channel_max.max()) / median if median > 0 else float("inf")
