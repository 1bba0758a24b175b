"""Linear layers (x @ Wᵀ + b, W stored [N, K]) on packed weights: oneDNN and MKL.

Both libraries copy W into an internal blocked layout on every plain call; packing it once
at engine load removes that copy. oneDNN also fuses the activation (and a residual add when
there is no activation) as post-ops. MKL's packed GEMM (cblas_sgemm_compute) is packed for
one row count M; other M fall back to the plain weight inside the op. Neither packed form
can be serialized (MKL's depends on its own address), so both are built at load.
"""

from __future__ import annotations

import torch

from kiln.kernels.cpu.conv import PostOp, apply_post_op_

_LINEAR_UNARY = ("none", "relu", "gelu", "sigmoid", "tanh", "swish", "hardtanh", "leaky_relu", "hardswish")


def pack_linear_onednn(w: torch.Tensor, rows: int | None) -> torch.Tensor:
    """W [N, K] -> oneDNN's blocked layout for a [rows, K] input."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows)


def linear_onednn(x: torch.Tensor, packed_w: torch.Tensor, b: torch.Tensor | None, residual: torch.Tensor | None,
                  op: PostOp, residual_after_activation: bool) -> torch.Tensor:
    """x: [..., K] -> [..., N]: unary(x Wᵀ + b), the residual fused when no activation sits between."""
    mkldnn = torch.ops.mkldnn
    if residual is not None and op.attr == "none" and residual.shape[:-1] == x.shape[:-1]:
        # y = x Wᵀ + b + residual in one primitive
        return mkldnn._linear_pointwise.binary(x, residual.contiguous(), packed_w, b, "add")
    if residual is not None and not residual_after_activation:  # y = act(x Wᵀ + b + residual)
        y = mkldnn._linear_pointwise(x, packed_w, b, "none", [], None)
        return apply_post_op_(_add_(y, residual), op)
    if op.attr in _LINEAR_UNARY:
        y = mkldnn._linear_pointwise(x, packed_w, b, op.attr, list(op.scalars), op.algorithm or None)
    else:
        y = apply_post_op_(mkldnn._linear_pointwise(x, packed_w, b, "none", [], None), op)
    return y if residual is None else _add_(y, residual)


def pack_linear_mkl(w: torch.Tensor, rows: int) -> torch.Tensor:
    """W [N, K] -> MKL's packed matrix for a [rows, K] input (cblas_sgemm_pack)."""
    return torch.ops.mkl._mkl_reorder_linear_weight(w.contiguous(), rows)


def linear_mkl(x: torch.Tensor, packed_w: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, rows: int,
               residual: torch.Tensor | None, op: PostOp, residual_after_activation: bool) -> torch.Tensor:
    """x: [..., K] -> [..., N] on MKL's packed GEMM; the epilogue runs in place after it."""
    lead = x.shape[:-1]
    y = torch.ops.mkl._mkl_linear(x.reshape(-1, x.shape[-1]), packed_w, w, b, rows)  # [M, N]
    y = y.reshape(*lead, w.shape[0])
    if residual is not None and not residual_after_activation:  # y = act(x Wᵀ + b + residual)
        return apply_post_op_(_add_(y, residual), op)
    y = apply_post_op_(y, op)
    return y if residual is None else _add_(y, residual)


def _add_(y: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return y.add_(residual) if y.shape == residual.shape else y + residual
