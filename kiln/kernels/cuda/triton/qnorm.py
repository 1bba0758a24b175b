"""LayerNorm whose store quantizes (kiln::LayerNormQuantize): one pass over each row writes the 8-bit
tensor the next quantized GEMMs read and, when asked, the float y for the residual path.

    s   = x (+ residual, rounded to x's dtype as the unfused Add; the residual may repeat over leading dims; an E4M3
          residual is dequantized first, float32(r)·residual_scale rounded to x's dtype, as its DequantizeLinear)
    y   = (s − mean) / sqrt(var + eps) · γ + β        fp32 statistics, rounded to x's dtype
    y_q = saturate(round(y / y_scale) + y_zero)       int8 / uint8, or onto the E4M3 grid (qmath)

y is quantized after its rounding to the storage dtype, as the QuantizeLinear it replaces reads it, so y_q is
that QuantizeLinear of the y written, bit for bit (y itself may differ from kiln's LayerNorm kernel in a last bit:
the sums are taken in another order). One row per program, the whole row in registers: BERT's 768 (rows longer
than MAX_ROW_BLOCK are refused by the tactic), or `RowsConfig.rows` rows per program ([ROWS, BLOCK] in registers;
γ and β loaded once for them: 2 rows of 4 warps took 0.0365 ms at BERT-base 64 x 384 on the H200, one row 0.0383,
kiln's fp16 LayerNorm 0.0301 for a byte less per element).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.kernels.cuda.triton import qmath
from kiln.kernels.cuda.triton.elementwise import FLOAT_DTYPES
from kiln.kernels.cuda.triton.normalization import MAX_ROW_BLOCK, _block, _param, _rows
from kiln.kernels.cuda.triton.qgemm import INT_RANGE

QUANTIZED_OUTPUTS = (torch.float8_e4m3fn, torch.int8, torch.uint8)


@triton.jit
def _layer_norm_quantize_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, q_ptr, rows, n, row_stride, r_row_stride, r_rows,
                                eps, y_scale, y_zero, r_scale, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                                HAS_R: tl.constexpr, R_QUANTIZED: tl.constexpr, WRITE_Y: tl.constexpr,
                                OUT: tl.constexpr, QMIN: tl.constexpr,
                                QMAX: tl.constexpr, HARDWARE_E4M3: tl.constexpr, ROWS: tl.constexpr,
                                BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [R]
    cols = tl.arange(0, BLOCK)  # [B]
    col_ok = cols < n
    mask = (row < rows)[:, None] & col_ok[None, :]  # [R, B]
    x = tl.load(x_ptr + row[:, None] * row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_R:
        r_row = (row % r_rows)[:, None] * r_row_stride
        r = tl.load(r_ptr + r_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if R_QUANTIZED:  # the E4M3 residual's DequantizeLinear, written in x's dtype
            r = (r * r_scale).to(x_ptr.dtype.element_ty).to(tl.float32)
        x = (x + r).to(x_ptr.dtype.element_ty).to(tl.float32)
    xc = tl.where(mask, x - (tl.sum(x, axis=1) / n)[:, None], 0.0)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(xc * xc, axis=1) / n + eps)  # [R]
    y = xc * rstd[:, None]
    if HAS_W:  # γ and β read once for the program's rows
        y = y * tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = y.to(x_ptr.dtype.element_ty)  # the stored y: what the unfused QuantizeLinear reads
    offs = row[:, None] * n + cols[None, :]
    if WRITE_Y:
        tl.store(y_ptr + offs, y, mask=mask)
    v = qmath.requantize(y.to(tl.float32), y_scale, y_zero, 0.0, 0.0, "", OUT, QMIN, QMAX, HARDWARE_E4M3)
    tl.store(q_ptr + offs, v.to(q_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class RowsConfig:
    """How the kernel covers the rows: `rows` per program (γ and β read once for them), `num_warps` each."""
    rows: int = 1
    num_warps: int = 4


def fits(row: int) -> bool:
    """Whether a row of this many elements is held in registers (the only form of this kernel)."""
    return row <= MAX_ROW_BLOCK


def residual_broadcasts(residual: tuple[int, ...] | list[int], x: tuple[int, ...] | list[int]) -> bool:
    """Whether the residual is x's shape or x's trailing dims behind leading ones (BERT's position embeddings
    [1, S, H] added to every sequence of [B, S, H]): its rows then repeat every residual.numel() / H rows of x."""
    dims = list(residual)
    while len(dims) > 1 and dims[0] == 1:
        dims.pop(0)
    return len(dims) <= len(x) and dims == list(x)[len(x) - len(dims):]


def layer_norm_quantize(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                        y_scale: float, y_zero: float, out_dtype: torch.dtype, *, residual: torch.Tensor | None = None,
                        residual_scale: float | None = None, write_y: bool = True,
                        config: RowsConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y_q, y) of LayerNorm over the last axis of x (+ residual of x's shape and dtype, or E4M3 with its
    `residual_scale`); y is None unless write_y.
    `config`: rows per program and warps (default: one row, the warps normalization._block gives its length)."""
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"triton layer_norm_quantize: x is float16/bfloat16/float32, got {x.dtype}")
    if out_dtype not in QUANTIZED_OUTPUTS:
        raise TypeError(f"triton layer_norm_quantize: the output is float8e4m3fn/int8/uint8, got {out_dtype}")
    residual_dtype = torch.float8_e4m3fn if residual_scale is not None else x.dtype
    if residual is not None and (not residual_broadcasts(residual.shape, x.shape) or residual.dtype != residual_dtype):
        raise ValueError(f"triton layer_norm_quantize: the residual {residual.dtype}{list(residual.shape)} must have "
                         f"x's shape {list(x.shape)} (or its trailing dims) and dtype {residual_dtype}")
    n = x.shape[-1] if x.dim() else 1
    if not fits(n):
        raise ValueError(f"triton layer_norm_quantize: rows of {n} elements; at most {MAX_ROW_BLOCK}")
    q = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if write_y else None
    if q.numel() == 0:
        return q, y
    x2 = _rows(x, n, "layer_norm_quantize")
    if residual is None:
        r2 = x2
    elif residual_scale is not None:  # E4M3 rows (_rows takes float tensors only)
        r2 = residual.reshape(-1, n)
        r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    else:
        r2 = _rows(residual, n, "layer_norm_quantize")
    w, b = _param(weight, [n]), _param(bias, [n])
    block, _, warps = _block(n)
    config = config or RowsConfig(1, warps)
    qmin, qmax = INT_RANGE.get(out_dtype, (0, 0))
    out_kind = qmath.OUT_FP8 if out_dtype == torch.float8_e4m3fn else qmath.OUT_INT
    rows = x2.shape[0]
    _layer_norm_quantize_kernel[(triton.cdiv(rows, config.rows),)](
        x2, w if w is not None else x2, b if b is not None else x2, r2, y if y is not None else q, q, rows, n,
        x2.stride(0), r2.stride(0), r2.shape[0], float(eps), float(y_scale), float(y_zero),
        float(residual_scale if residual_scale is not None else 1.0), HAS_W=w is not None, HAS_B=b is not None,
        HAS_R=residual is not None, R_QUANTIZED=residual is not None and residual_scale is not None, WRITE_Y=write_y,
        OUT=out_kind, QMIN=qmin,
        QMAX=qmax, HARDWARE_E4M3=x.is_cuda, ROWS=config.rows, BLOCK=block,  # on the GPU the fp8 store rounds (qmath)
        num_warps=config.num_warps)
    return q, y
