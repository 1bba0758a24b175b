"""Activations: Relu, Sigmoid, Tanh, LeakyRelu, Gelu, ..."""

from __future__ import annotations

import torch

from kiln.ops.registry import register


@register("Relu")
def relu(ctx, x):
    return torch.relu(x)
