"""Elementwise arithmetic with numpy-style broadcasting: Add, Sub, Mul, Div, Pow, Mod, ..."""

from __future__ import annotations

import torch

from kiln.ops.registry import register


@register("Add")
def add(ctx, a, b):
    return a + b


@register("Sub")
def sub(ctx, a, b):
    return a - b


@register("Mul")
def mul(ctx, a, b):
    return a * b
