"""The online-softmax step of kiln's paged attention kernels (paged_decode.py's split and packed kernels,
paged_prefill.py): scores of a tile, the running max / sum update, the rescaled accumulation. Triton inlines
them: each kernel compiles to the TTGIR it had with the lines written out (checked for the decode kernels
at sm_90: the same ops in the same order, 2026-12-04)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def scores(q, k, scale, IEEE: tl.constexpr, F16_DOT: tl.constexpr):
    """q·kᵀ of a tile, scaled (F16_DOT: q came in prescaled)."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if not F16_DOT:
        s = s * scale
    return s


@triton.jit
def softmax_step(s, m, l):
    """The online softmax over one more tile of masked scores s: (p, alpha, l, m) for the running max m and sum l."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked tile: no NaN from -inf - -inf
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    l = l * alpha + tl.sum(p, 1)
    return p, alpha, l, m_new


@triton.jit
def accumulate(acc, alpha, p, v, IEEE: tl.constexpr):
    """acc rescaled by alpha plus p·v."""
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc
