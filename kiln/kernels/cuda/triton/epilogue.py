"""The GEMM / convolution epilogue as one kernel, for outputs of cuBLAS and cuDNN:

    y = layer(x)                                   (already computed by the library)
    out = act(y + bias) + residual                 residual_after_activation = True  (FusedGemm, BERT)
    out = act(y + bias + residual)                 residual_after_activation = False (FusedConv, ResNet)

One read of y (and the residual), one write: torch would take up to three passes. `bias` runs
along one axis of y (the last for a GEMM, the channel axis 1 for a convolution); y is walked
in its memory order, so a channels-last convolution output stays channels-last.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.cuda.triton import device_math as dm
from kiln.kernels.cuda.triton.elementwise import FLOAT_DTYPES

BLOCK = 1024


@triton.jit
def _bias_activation_kernel(y_ptr, bias_ptr, res_ptr, out_ptr, numel, inner, channels, alpha, beta,
                            HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ACTIVATION: tl.constexpr,
                            RES_AFTER: tl.constexpr, INDEX64: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if INDEX64:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        channel = (offs // inner) % channels
        y += tl.load(bias_ptr + channel, mask=mask, other=0.0).to(tl.float32)
    residual = y
    if HAS_RES:
        residual = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = dm.epilogue(y, residual, ACTIVATION, alpha, beta, HAS_RES, RES_AFTER)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _memory_order(y: torch.Tensor) -> list[int]:
    """y's dims outermost-first in memory (identity for a contiguous tensor)."""
    return sorted(range(y.dim()), key=lambda d: -y.stride(d))


def bias_activation(y: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None, *,
                    activation: str = "", alpha: float = 0.0, beta: float = 0.0,
                    residual_after_activation: bool = True, axis: int = -1, inplace: bool = False) -> torch.Tensor:
    """act(y + bias) [+ residual], or act(y + bias + residual), in y's dtype and layout.

    bias: `y.shape[axis]` elements (any shape with that many, e.g. [C] or [1, C, 1, 1]).
    residual: broadcastable to y. activation: one of device_math.ACTIVATIONS ("" for none);
    alpha/beta as in kiln::FusedGemm (Clip min/max, LeakyRelu slope, HardSigmoid). inplace=True
    writes into y (it must then be dense) and returns it.
    """
    if activation not in dm.ACTIVATIONS:
        raise ValueError(f"triton bias_activation: unknown activation {activation!r} (known: {dm.ACTIVATIONS})")
    if y.dtype not in FLOAT_DTYPES:
        raise TypeError(f"triton bias_activation: expected a float16/bfloat16/float32 tensor, got {y.dtype}")
    axis = axis + y.dim() if axis < 0 else axis
    order = _memory_order(y)
    if not y.permute(order).is_contiguous():  # not dense (a slice): work on a compact copy
        if inplace:
            raise ValueError(f"triton bias_activation: inplace needs a dense y, got strides {y.stride()}")
        y, order = y.contiguous(), list(range(y.dim()))
    out = y if inplace else torch.empty_like(y)
    numel = y.numel()
    if numel == 0:
        return out
    channels = y.shape[axis] if y.dim() else 1
    inner = 1
    for d in order[order.index(axis) + 1:] if y.dim() else []:
        inner *= y.shape[d]
    if bias is not None:
        if bias.numel() not in (1, channels):
            raise ValueError(f"triton bias_activation: bias has {bias.numel()} elements, y has {channels} along "
                             f"axis {axis} (shape {tuple(y.shape)})")
        bias = bias.reshape(-1).expand(channels).contiguous()
    if residual is not None:
        residual = residual.expand(y.shape).permute(order).contiguous()  # y's memory order, as out
    index64 = numel + BLOCK >= 2**31
    _bias_activation_kernel[(triton.cdiv(numel, BLOCK),)](
        y, bias if bias is not None else y, residual if residual is not None else y, out, numel, inner, channels,
        float(alpha), float(beta), HAS_BIAS=bias is not None, HAS_RES=residual is not None, ACTIVATION=activation,
        RES_AFTER=bool(residual_after_activation), INDEX64=index64, BLOCK=BLOCK, num_warps=4)
    return out
