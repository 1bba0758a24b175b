"""LayerNorm, RMSNorm and Softmax over the last axis: one row per program, statistics in fp32.

A row that fits in registers (≤ MAX_ROW_BLOCK elements) is loaded once and written once. A longer
row is walked in BLOCK-sized chunks: LayerNorm takes a mean pass, a centred variance pass and
a write pass (no E[x²] - E[x]² cancellation); Softmax an online max/sum pass (running max,
rescaled sum) and a write pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.cuda.triton.elementwise import FLOAT_DTYPES

MAX_ROW_BLOCK = 8192  # elements of one row held in registers at once


@triton.jit
def _layer_norm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, s_ptr, n, row_stride, r_row_stride, eps,
                       HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_R: tl.constexpr, WRITE_S: tl.constexpr,
                       RMS: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * row_stride
    y_row = y_ptr + row * n
    cols = tl.arange(0, BLOCK)
    if SINGLE:  # the whole row in registers
        mask = cols < n
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_R:  # skip-LayerNorm: s = x + r, rounded to the storage dtype as the unfused Add would
            r = tl.load(r_ptr + row * r_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
            x = (x + r).to(x_ptr.dtype.element_ty).to(tl.float32)
            if WRITE_S:
                tl.store(s_ptr + row * n + cols, x.to(s_ptr.dtype.element_ty), mask=mask)
        if RMS:
            xc = x
        else:
            xc = tl.where(mask, x - tl.sum(x, axis=0) / n, 0.0)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(xc * xc, axis=0) / n + eps)
        y = xc * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:  # chunked: mean, centred variance, write
        mean = 0.0
        if not RMS:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n, BLOCK):
                mask = start + cols < n
                acc += tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            mean = tl.sum(acc, axis=0) / n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n, BLOCK):
            mask = start + cols < n
            xc = tl.where(mask, tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32) - mean, 0.0)
            acc += xc * xc
        rstd = 1.0 / tl.sqrt_rn(tl.sum(acc, axis=0) / n + eps)
        for start in range(0, n, BLOCK):
            mask = start + cols < n
            y = (tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32) - mean) * rstd
            if HAS_W:
                y = y * tl.load(w_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_B:
                y = y + tl.load(b_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + start + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_kernel(x_ptr, y_ptr, n, row_stride, LOG: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * row_stride
    y_row = y_ptr + row * n
    cols = tl.arange(0, BLOCK)
    if SINGLE:
        mask = cols < n
        x = tl.load(x_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
        shifted = x - tl.max(x, axis=0)
        e = tl.where(mask, tl.exp(shifted), 0.0)
        total = tl.sum(e, axis=0)
        if LOG:
            y = shifted - tl.log(total)
        else:
            y = e / total
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:  # online: per-lane running max m and sum s of exp(x - m), merged at the end
        m = tl.full([BLOCK], -float("inf"), dtype=tl.float32)
        s = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n, BLOCK):
            mask = start + cols < n
            x = tl.load(x_row + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # lanes with nothing yet: no inf - inf
            s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
            m = m_new
        row_max = tl.max(m, axis=0)
        total = tl.sum(s * tl.exp(tl.where(m == -float("inf"), -float("inf"), m - row_max)), axis=0)
        for start in range(0, n, BLOCK):
            mask = start + cols < n
            x = tl.load(x_row + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
            if LOG:
                y = x - row_max - tl.log(total)
            else:
                y = tl.exp(x - row_max) / total
            tl.store(y_row + start + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor, n: int, what: str) -> torch.Tensor:
    """x as [rows, n] with unit stride along n (a copy only when x is not already laid out so)."""
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"triton {what}: expected a float16/bfloat16/float32 tensor, got {x.dtype}")
    x2 = x.reshape(-1, n)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _block(n: int) -> tuple[int, bool, int]:
    """(BLOCK, whole row at once?, num_warps) for a row of n elements."""
    block = min(triton.next_power_of_2(max(n, 1)), MAX_ROW_BLOCK)
    return block, n <= block, 4 if block <= 2048 else 8 if block <= 4096 else 16


def _param(p: torch.Tensor | None, shape: list[int]) -> torch.Tensor | None:
    if p is None:
        return None
    if list(p.shape) != shape:
        p = p.expand(shape)  # broadcastable scale/bias (kiln LayerNorm allows it)
    return p.contiguous().reshape(-1)


def _row_size(x: torch.Tensor, axis: int) -> int:
    n = 1
    for size in x.shape[(axis + x.dim() if axis < 0 else axis):]:
        n *= size
    return n


def _norm(x, weight, bias, eps, axis, rms, what, residual=None, return_sum=False):
    axis = axis + x.dim() if axis < 0 else axis
    shape = list(x.shape[axis:])
    n = _row_size(x, axis)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if return_sum else None
    if y.numel() == 0:
        return (y, s) if return_sum else y
    x2 = _rows(x, n, what)
    r2 = _rows(residual, n, what) if residual is not None else x2
    w, b = _param(weight, shape), _param(bias, shape)
    block, single, warps = _block(n)
    _layer_norm_kernel[(x2.shape[0],)](
        x2, w if w is not None else x2, b if b is not None else x2, y, r2, s if s is not None else y,
        n, x2.stride(0), r2.stride(0), float(eps),
        HAS_W=w is not None, HAS_B=b is not None, HAS_R=residual is not None, WRITE_S=s is not None,
        RMS=rms, BLOCK=block, SINGLE=single, num_warps=warps)
    return (y, s) if return_sum else y


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5, *, axis: int = -1, residual: torch.Tensor | None = None,
               return_sum: bool = False):
    """(s - mean) / sqrt(var + eps) · weight + bias over the dims from `axis` on (kiln::LayerNorm),
    s = x (+ residual). With `residual` of x's shape and dtype and a row that fits in registers the
    sum is formed in the kernel's one pass over the row (and written as a 2nd output when
    `return_sum`); else it is added first. Returns y, or (y, s) when `return_sum`."""
    if residual is None:
        y = _norm(x, weight, bias, eps, axis, rms=False, what="layer_norm")
        return (y, x) if return_sum else y
    fits = residual.shape == x.shape and residual.dtype == x.dtype
    if not fits or not _block(_row_size(x, axis))[1]:
        s = x + residual
        y = _norm(s, weight, bias, eps, axis, rms=False, what="layer_norm")
        return (y, s) if return_sum else y
    return _norm(x, weight, bias, eps, axis, rms=False, what="layer_norm", residual=residual, return_sum=return_sum)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
             axis: int = -1) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) · weight over the dims from `axis` on (kiln::RMSNorm)."""
    return _norm(x, weight, None, eps, axis, rms=True, what="rms_norm")


def softmax(x: torch.Tensor, axis: int = -1, *, log: bool = False) -> torch.Tensor:
    """softmax (or log-softmax) along `axis`; another axis than the last is moved last and back."""
    axis = axis + x.dim() if axis < 0 else axis
    if x.dim() and axis != x.dim() - 1:
        return softmax(x.movedim(axis, -1), -1, log=log).movedim(-1, axis).contiguous()
    n = x.shape[-1] if x.dim() else 1
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    x2 = _rows(x, n, "softmax")
    block, single, warps = _block(n)
    _softmax_kernel[(x2.shape[0],)](x2, y, n, x2.stride(0), LOG=log, BLOCK=block, SINGLE=single, num_warps=warps)
    return y
