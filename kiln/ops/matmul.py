"""MatMul, Gemm and their integer variants."""

from __future__ import annotations

import torch

from kiln.ops.registry import register


@register("MatMul")
def matmul(ctx, a, b):
    return torch.matmul(a, b)
