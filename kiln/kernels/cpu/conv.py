"""2-D convolution on oneDNN with a pre-packed weight and fused post-ops.

oneDNN runs a convolution fastest on its own blocked weight layout; torch's plain conv2d
re-lays the weight out on every call. `pack_conv_weight` does it once (for the input size the
engine was tuned at; other sizes still run, oneDNN reorders as needed). The epilogue of
kiln::FusedConv maps onto oneDNN post-ops:

    y = unary(conv(x, W) + b)                     _convolution_pointwise
    y = unary(conv(x, W) + b + residual)          _convolution_pointwise.binary ("add")

A residual added *after* the activation is not one oneDNN post-op chain: it is added after.
Activations work in either layout; channels-last (NHWC) input gives channels-last output,
so a stack of these convolutions stays NHWC between its boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# kiln epilogue activation -> (oneDNN unary attr, scalars, algorithm); see _activate_ in kiln/ops/fused.py
_UNARY = {
    "": ("none", (), ""),
    "Relu": ("relu", (), ""),
    "Sigmoid": ("sigmoid", (), ""),
    "Tanh": ("tanh", (), ""),
    "SiLU": ("swish", (), ""),
    "HardSwish": ("hardswish", (), ""),
    "Gelu": ("gelu", (), "none"),
    "GeluTanh": ("gelu", (), "tanh"),
}


@dataclass(frozen=True)
class PostOp:
    attr: str
    scalars: tuple[float, ...]
    algorithm: str


def post_op(activation: str, alpha: float, beta: float) -> PostOp | None:
    """The oneDNN unary post-op for a kiln epilogue activation, or None when it has none."""
    if activation == "Clip":  # clamp(alpha, beta), e.g. ReLU6
        return PostOp("hardtanh", (float(alpha), float(beta)), "")
    if activation == "LeakyRelu":
        return PostOp("leaky_relu", (float(alpha),), "")
    if activation in _UNARY:
        return PostOp(*_UNARY[activation])
    return None


_BINARY_UNARY = ("none", "relu")

_APPLY = {
    "relu": lambda y, op: y.relu_(),
    "hardtanh": lambda y, op: y.clamp_(op.scalars[0], op.scalars[1]),
    "sigmoid": lambda y, op: y.sigmoid_(),
    "tanh": lambda y, op: y.tanh_(),
    "swish": lambda y, op: F.silu(y, inplace=True),
    "hardswish": lambda y, op: F.hardswish(y, inplace=True),
    "gelu": lambda y, op: F.gelu(y, approximate=op.algorithm or "none"),
    "leaky_relu": lambda y, op: F.leaky_relu_(y, op.scalars[0]),
}


def apply_post_op_(y: torch.Tensor, op: PostOp) -> torch.Tensor:
    """The post-op as a separate (in-place where torch allows) pass over y."""
    return y if op.attr == "none" else _APPLY[op.attr](y, op)


def pack_conv_weight(w: torch.Tensor, padding: list[int], stride: list[int], dilation: list[int], groups: int,
                     input_size: list[int] | None) -> torch.Tensor:
    """W [O, I/groups, kH, kW] -> an opaque oneDNN tensor in the blocked layout the conv wants."""
    return torch.ops.mkldnn._reorder_convolution_weight(
        w.contiguous(), padding, stride, dilation, groups, input_size)


def conv2d_onednn(x: torch.Tensor, packed_w: torch.Tensor, b: torch.Tensor | None, residual: torch.Tensor | None,
                  padding: list[int], stride: list[int], dilation: list[int], groups: int, op: PostOp,
                  residual_after_activation: bool) -> torch.Tensor:
    """conv2d + bias + activation (+ residual), one oneDNN primitive where the epilogue allows."""
    mkldnn = torch.ops.mkldnn
    if residual is not None and (not residual_after_activation or op.attr == "none"):
        # x: [N, C, H, W], residual: [N, O, H', W'] -> y = unary(conv + b + residual)
        fused = op.attr in _BINARY_UNARY  # oneDNN chains only these after a binary post-op
        y = mkldnn._convolution_pointwise.binary(
            x, residual, packed_w, b, padding, stride, dilation, groups, "add", None,
            op.attr if fused and op.attr != "none" else None, list(op.scalars) if fused else [], None)
        return y if fused else apply_post_op_(y, op)
    y = mkldnn._convolution_pointwise(x, packed_w, b, padding, stride, dilation, groups, op.attr,
                                      list(op.scalars), op.algorithm)
    if residual is not None:
        y = y.add_(residual)
    return y


# ---- 1x1 convolutions as GEMMs -----------------------------------------------------------------
#
# A 1x1, stride-1, unpadded convolution on NHWC activations is one matrix product over the
# pixels: y[N·H·W, O] = x[N·H·W, C] · Wᵀ + b, and the channels-last tensors *are* those
# matrices (a view, no copy). A GEMM entry point skips oneDNN's convolution set-up, which costs
# ~30 µs per call here whatever the layer's size (the primitive descriptor is rebuilt on every
# call): MobileNetV2's small 1x1 layers at 14x14 and 7x7 took 40-70 µs as a convolution and
# 30-55 µs as an MKL packed GEMM. (The tactics built since, oneDNN Graph and the C API's bound
# primitives, have no such set-up: cpu.conv.onednn_1x1 now rarely wins, and its MKL twin is
# retired, docs/retired-tactics.md.)

def pixels_as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [N, C, H, W] (any layout) -> [N·H·W, C]: a view when x is channels-last."""
    n, c, h, w = x.shape
    return x.permute(0, 2, 3, 1).reshape(n * h * w, c)


def rows_as_pixels(y: torch.Tensor, n: int, h: int, w: int) -> torch.Tensor:
    """y [N·H·W, O] -> [N, O, H, W] channels-last, a view."""
    return y.view(n, h, w, y.shape[1]).permute(0, 3, 1, 2)
