"""Cross-layer equalization of activation ranges (after Nagel et al. 2019, "Data-Free Quantization through
Weight Equalization and Bias Correction", section 4.1), the float model unchanged on the calibration data.

MobileNetV2's depthwise convolution feeds its 1x1 projection through a ReLU6 whose channels span orders of
magnitude (some reach 6, some never pass 0.1); the projection's input is quantized per tensor (uint8 over
[0, amax]), so the narrow channels round to a few steps. For a pair

    y = Conv_1(x)  ->  a = f(y)  ->  Conv_2(a)          f = Relu or Clip(0, c)

and any s > 0 per channel i of y, f(y_i / s_i) = f(y_i) / s_i as long as f is positively homogeneous on
the values y takes (Relu always; Clip(0, c) where y_i / s_i <= c, i.e. wherever y_i <= s_i·c), so

    Conv_1':  W_1[i] / s_i,  b_1[i] / s_i           Conv_2':  W_2[:, i] · s_i   (its input channel i)

computes the same function. With a_i the largest value channel i of a took on the calibration data and A
their maximum,

    s_i = (a_i / A)^α        α in (0, 1]; s_i = 1 on a channel that was 0 throughout

grows every narrow channel towards A (α = 1: onto A) and never shrinks one: the channels that reach a
Clip's bound keep s = 1, the others satisfy y_i <= a_i <= s_i·c, so the Clip stays exact on the
calibration data (the paper replaces ReLU6 by Relu instead, which changes the float model). What it costs:
Conv_2's weight column i shrinks by s_i, so its per-output-channel int8 step is coarser relative to that
column; α = 0.5 splits the range between the activation and that column (SmoothQuant's balance), α = 1
gives it all to the activation. Conv_1's weights are quantized per output channel: dividing a row by
s_i does not change its relative rounding.

Measured on MobileNetV2 (bench/results/quantacc-2026-12-05d.md): kiln's per-channel weights and per-channel
depthwise inputs already hold what equalization buys a per-tensor scheme, and growing the projection's input
costs its weights as much as it saves; so it is off by default (BuildConfig.equalize, --equalize).

A pair qualifies when Conv_1 has constant weights (and bias), its output is read by f alone, and f's output
is read only as input 0 of convolutions with constant weights (grouped ones included: input channel i is
channel i mod C/g of group i div C/g), and is no graph output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import torch

from kiln.errors import KilnError
from kiln.quant.smoothquant import channel_spread, replace_constant

ALPHA = 0.5
ACTIVATIONS = ("Relu", "Clip")


@dataclass(frozen=True)
class Pair:
    """Conv_1 -> f -> the convolutions reading f's output (Conv_2), one factor per channel of f."""

    first: ir.Node  # Conv_1: its output channels are divided by s
    activation: ir.Node  # f: Relu, or Clip with constant bounds 0 and c > 0
    consumers: tuple[ir.Node, ...]  # Conv_2 (one or more): their input channels are multiplied by s


class ChannelMax:
    """max x per channel (axis 1 of an NCHW activation) over every calibration batch; f's outputs are >= 0."""

    def __init__(self):
        self._max: torch.Tensor | None = None

    def observe(self, x: torch.Tensor) -> None:
        if x.dim() < 2 or not x.numel():
            return
        m = x.detach().float().transpose(0, 1).reshape(x.shape[1], -1).amax(1)  # [C]
        self._max = m if self._max is None else torch.maximum(self._max, m)

    def value(self) -> np.ndarray:
        return np.zeros(0) if self._max is None else self._max.double().numpy()


def check_alpha(alpha: object) -> float | None:
    """The strength as a float, None when equalization is off; a clear error otherwise."""
    if alpha is None or alpha is False:
        return None
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 < float(alpha) <= 1.0:
        raise KilnError(f"equalize={alpha!r}: the strength alpha is a number in (0, 1] (0.5 splits each narrow "
                        "channel's range between the activation and the next layer's weights; 1 grows the "
                        "activation onto the widest channel), or None for no equalization")
    return float(alpha)


def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None or value.is_graph_input():
        return None
    return value.const_value.numpy()


def _homogeneous(node: ir.Node) -> bool:
    """Relu, or Clip with constant bounds 0 (the lower) and c > 0 (the upper, or none)."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ACTIVATIONS:
        return False
    if node.op_type == "Relu":
        return True
    low = _const(node.inputs[1]) if len(node.inputs) > 1 else None
    high = _const(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] is not None else None
    if low is None or low.size != 1 or float(low.reshape(-1)[0]) != 0.0:
        return False
    return len(node.inputs) < 3 or node.inputs[2] is None or (high is not None and high.size == 1
                                                               and float(high.reshape(-1)[0]) > 0.0)


def _conv_with_constants(node: ir.Node) -> bool:
    if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return False
    weight_ok = _const(node.inputs[1]) is not None and _const(node.inputs[0]) is None
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    return weight_ok and (bias is None or _const(bias) is not None)


def find(graph: ir.Graph) -> list[Pair]:
    """Every Conv_1 -> f -> Conv_2 pair whose channels can be rescaled (the module docstring's conditions)."""
    found = []
    for node in graph:
        if not _conv_with_constants(node) or len(node.outputs[0].uses()) != 1 or node.outputs[0].is_graph_output():
            continue
        activation = node.outputs[0].uses()[0].node
        if not _homogeneous(activation) or activation.inputs[0] is not node.outputs[0]:
            continue
        a = activation.outputs[0]
        uses = a.uses()
        if not uses or a.is_graph_output() or any(u.idx != 0 or not _conv_with_constants(u.node) for u in uses):
            continue
        found.append(Pair(node, activation, tuple(dict.fromkeys(u.node for u in uses))))
    return found


def factors(channel_max: np.ndarray, alpha: float = ALPHA) -> np.ndarray:
    """s_i = (a_i / A)^α, 1 where a_i = 0; in (0, 1]."""
    a = np.asarray(channel_max, np.float64)
    top = a.max(initial=0.0)
    if top <= 0:
        return np.ones_like(a)
    return np.where(a > 0, (a / top) ** alpha, 1.0)


def _scale_input_channels(graph: ir.Graph, conv: ir.Node, s: np.ndarray) -> None:
    """Conv_2's input channel i multiplied by s_i: weight [O, C/g, *k] of group j reads channels j·C/g ...."""
    w = _const(conv.inputs[1]).astype(np.float64)
    group = conv.attributes.get_int("group", 1)
    out, per_group = w.shape[0], w.shape[1]
    by_group = s.reshape(group, 1, per_group)  # [g, 1, C/g]
    scaled = w.reshape(group, out // group, per_group, -1) * by_group[..., None]
    replace_constant(graph, conv, 1, scaled.reshape(w.shape), "equalized_weight")


def apply(graph: ir.Graph, pair: Pair, s: np.ndarray) -> None:
    """Fold 1/s into Conv_1's output channels and s into its readers' input channels (in place)."""
    w = _const(pair.first.inputs[1]).astype(np.float64)
    replace_constant(graph, pair.first, 1, w / s.reshape((-1,) + (1,) * (w.ndim - 1)), "equalized_weight")
    if len(pair.first.inputs) > 2 and pair.first.inputs[2] is not None:
        replace_constant(graph, pair.first, 2, _const(pair.first.inputs[2]).astype(np.float64) / s, "equalized_bias")
    for conv in pair.consumers:
        _scale_input_channels(graph, conv, s)


def equalize(model: ir.Model, pairs: list[Pair], channel_max: dict[str, np.ndarray], alpha: float = ALPHA) -> dict:
    """Equalize every pair (in place) from its activation's channel maxima; the header record: per
    activation the spread of its channel maxima (max / median) before and after."""
    spread: dict[str, list[float]] = {}
    for pair in pairs:
        name = pair.activation.outputs[0].name
        a = channel_max[name]
        s = factors(a, alpha)
        apply(model.graph, pair, s)
        spread[name] = [round(channel_spread(a), 2), round(channel_spread(a / s), 2)]
    return {"alpha": alpha, "pairs": len(pairs), "spread": spread}

