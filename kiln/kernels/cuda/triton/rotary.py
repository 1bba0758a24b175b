"""Rotary position embedding (kiln::Rotary) in one pass: each program rotates BLOCK_R rows of D.

x is read through its strides (a q or k sliced out of a packed q|k|v projection is a strided view:
no copy), cos and sin through theirs after broadcasting to x (a table shared by every head has
stride 0 there). For each pair (a, b) of a row, rotate-half pairs j with j + D/2, interleaved
(GPT-J) pairs 2j with 2j + 1:

    y[a] = x[a]·cos[a] − x[b]·sin[a]        y[b] = x[b]·cos[b] + x[a]·sin[b]

which is x·cos + rotate_half(x)·sin with rotate_half(x) = (−x[D/2:], x[:D/2]). Rows of heads at or
past `rotate_heads` pass through (a packed q|k|v's v). Math in fp32, one store per element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 16


@triton.jit
def _rotary_kernel(x_ptr, c_ptr, s_ptr, y_ptr, rows, B, H, half, rotate_heads,
                   sx0, sx1, sx2, sx3, sc0, sc1, sc2, sc3, ss0, ss1, ss2, ss3,
                   INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # [BR] rows of [A, B, H]
    h = r % H
    t = r // H
    b = t % B
    a = t // B
    j = tl.arange(0, BLOCK_H)  # [BH] pair index
    if INTERLEAVED:
        first = 2 * j
        second = 2 * j + 1
    else:
        first = j
        second = j + half
    mask = (r < rows)[:, None] & (j < half)[None, :]
    x_row = (a * sx0 + b * sx1 + h * sx2)[:, None]
    c_row = (a * sc0 + b * sc1 + h * sc2)[:, None]
    s_row = (a * ss0 + b * ss1 + h * ss2)[:, None]
    xa = tl.load(x_ptr + x_row + first[None, :] * sx3, mask=mask, other=0.0).to(tl.float32)
    xb = tl.load(x_ptr + x_row + second[None, :] * sx3, mask=mask, other=0.0).to(tl.float32)
    ca = tl.load(c_ptr + c_row + first[None, :] * sc3, mask=mask, other=1.0).to(tl.float32)
    cb = tl.load(c_ptr + c_row + second[None, :] * sc3, mask=mask, other=1.0).to(tl.float32)
    sa = tl.load(s_ptr + s_row + first[None, :] * ss3, mask=mask, other=0.0).to(tl.float32)
    sb = tl.load(s_ptr + s_row + second[None, :] * ss3, mask=mask, other=0.0).to(tl.float32)
    rotate = (h < rotate_heads)[:, None]
    ya = tl.where(rotate, xa * ca - xb * sa, xa)
    yb = tl.where(rotate, xb * cb + xa * sb, xb)
    y_row = (r * (2 * half))[:, None]  # y is contiguous [rows, D]
    tl.store(y_ptr + y_row + first[None, :], ya.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + y_row + second[None, :], yb.to(y_ptr.dtype.element_ty), mask=mask)


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, num_heads: int = 0,
           interleaved: bool = False, rotate_heads: int = 0) -> torch.Tensor:
    """kiln::Rotary (kiln/ops/fused.py rotary): the same shapes out, x read in place through its strides."""
    heads_view = bool(num_heads) and x.dim() == 3
    viewed = x.unflatten(-1, (num_heads, -1)) if heads_view else x  # [B, S, H, D]
    x4 = _as_4d(viewed)  # [A, B, H, D]: a view (leading ones)
    cos4 = torch.broadcast_to(_as_4d(cos), x4.shape)
    sin4 = torch.broadcast_to(_as_4d(sin), x4.shape)
    A, B, H, D = x4.shape
    y = torch.empty((A, B, H, D), dtype=x.dtype, device=x.device)
    rows = A * B * H
    if rows and D:
        half = D // 2
        _rotary_kernel[(triton.cdiv(rows, BLOCK_ROWS),)](
            x4, cos4, sin4, y, rows, B, H, half, rotate_heads if rotate_heads and heads_view else H,
            *x4.stride(), *cos4.stride(), *sin4.stride(),
            INTERLEAVED=bool(interleaved), BLOCK_R=BLOCK_ROWS, BLOCK_H=triton.next_power_of_2(max(half, 1)),
            num_warps=4)
    if rotate_heads and heads_view:
        return y.reshape(x.shape)  # [B, S, H·D], as the op keeps a packed q|k|v whole
    return y.reshape(viewed.shape)
