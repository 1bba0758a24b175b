"""Activations: Relu, Sigmoid, Tanh, LeakyRelu, Elu, Selu, Celu, Gelu, Swish, SwiGLU, ...

Definitions follow onnx/defs (math/defs.cc); each docstring holds the formula.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.registry import register


@register("Relu")
def relu(ctx, x):
    return torch.relu(x)


@register("Sigmoid")
def sigmoid(ctx, x):
    return torch.sigmoid(x)


@register("Tanh")
def tanh(ctx, x):
    return torch.tanh(x)


@register("LeakyRelu")
def leaky_relu(ctx, x, *, alpha=0.01):
    """y = x if x >= 0 else alpha * x"""
    return F.leaky_relu(x, alpha)


@register("Elu")
def elu(ctx, x, *, alpha=1.0):
    """y = x if x > 0 else alpha * (exp(x) - 1)"""
    return F.elu(x, alpha)


@register("Selu")
def selu(ctx, x, *, alpha=1.67326319217681884765625, gamma=1.05070102214813232421875):
    """y = gamma * (x if x > 0 else alpha * (exp(x) - 1))"""
    return gamma * torch.where(x > 0, x, alpha * torch.expm1(x))


@register("Celu")
def celu(ctx, x, *, alpha=1.0):
    """y = max(0, x) + min(0, alpha * (exp(x / alpha) - 1))"""
    return F.celu(x, alpha)


@register("Gelu")
def gelu(ctx, x, *, approximate="none"):
    """none: x * Phi(x) with the exact normal CDF; tanh: the tanh approximation."""
    approximate = approximate.decode() if isinstance(approximate, bytes) else approximate
    if approximate not in ("none", "tanh"):
        raise ValueError(f"Gelu approximate must be 'none' or 'tanh', got {approximate!r}")
    return F.gelu(x, approximate=approximate)


@register("HardSigmoid")
def hard_sigmoid(ctx, x, *, alpha=0.2, beta=0.5):
    """y = max(0, min(1, alpha * x + beta))"""
    return torch.clamp(alpha * x + beta, 0.0, 1.0)


@register("HardSwish")
def hard_swish(ctx, x):
    """y = x * max(0, min(1, x / 6 + 0.5))"""
    return F.hardswish(x)


@register("Softplus")
def softplus(ctx, x):
    """y = ln(1 + exp(x)); torch returns x itself past x = 20, where the two agree in fp32"""
    return F.softplus(x)


@register("Softsign")
def softsign(ctx, x):
    """y = x / (1 + |x|)"""
    return x / (1 + torch.abs(x))


@register("Mish")
def mish(ctx, x):
    """y = x * tanh(softplus(x))"""
    return F.mish(x)


@register("PRelu")
def prelu(ctx, x, slope):
    """y = x if x >= 0 else slope * x, with `slope` broadcast to x (integers allowed)."""
    return torch.where(x < 0, x * slope, x).to(x.dtype)


@register("ThresholdedRelu")
def thresholded_relu(ctx, x, *, alpha=1.0):
    """y = x if x > alpha else 0"""
    return torch.where(x > alpha, x, torch.zeros((), dtype=x.dtype, device=x.device))


@register("Shrink")
def shrink(ctx, x, *, bias=0.0, lambd=0.5):
    """y = x - bias if x > lambd; x + bias if x < -lambd; else 0 (in x's type, integers too)"""
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(x < -lambd, x + bias, torch.where(x > lambd, x - bias, zero)).to(x.dtype)


def _swish(x: torch.Tensor, alpha: float) -> torch.Tensor:
    return x * torch.sigmoid(alpha * x)


@register("Swish")
def swish(ctx, x, *, alpha=1.0):
    """y = x * sigmoid(alpha * x)"""
    return _swish(x, alpha)


@register("SwiGLU")
def swiglu(ctx, a, b, *, alpha=1.0):
    """y = Swish_alpha(a) * b; a (gate) and b (value) have one shape, no broadcasting."""
    if a.shape != b.shape:
        raise ValueError(
            f"SwiGLU needs inputs A and B of one shape (no broadcasting), got "
            f"{list(a.shape)} and {list(b.shape)}"
        )
    return _swish(a, alpha) * b
