"""The plan fields of an 8-bit output's requantization in kiln's C kernels (qdepthwise.c, i8gemm.c): where Relu/Clip
can run on the packed int16 words instead of the floats.

    y = saturate(round_half_even(act_q(scale_q·t)) + y_zero)        act_q: Relu/Clip with its bounds over y_scale

Every step after the multiply is monotone (round, the saturating packs, the saturating zero-point add), and a monotone
map f commutes with a clamp: f(clamp(q, a, b)) = clamp(f(q), f(a), f(b)). So the kernels round q as it is and clamp
the words to [f(a), f(b)]: two integer ops per 16 channels instead of two float ops per 8, and none where the 8-bit
saturation is the clamp already (MobileNetV2's ReLU6 into the range [0, 6]: bounds 0 and 255). That needs q to
convert without overflow: `bounded`, every |scale_q·t| below 2^30 for the sums the layer can reach.
"""

from __future__ import annotations

import numpy as np
import torch

WORD_MIN, WORD_MAX = -32768, 32767
BYTE_RANGE = {torch.uint8: (0, 255), torch.int8: (-128, 127)}
CONVERTS = 2.0**30  # |q| below this converts to int32 exactly, with room for float32's rounding of the product


def _word(q: float, y_zero: int) -> int:
    """f(q) up to the 8-bit saturation: round half to even, saturated to int16, the zero point added saturating."""
    rounded = int(np.clip(np.rint(np.float32(q)), WORD_MIN, WORD_MAX))
    return int(np.clip(rounded + y_zero, WORD_MIN, WORD_MAX))


def word_fields(scale_q: torch.Tensor, sum_bound: torch.Tensor, y_dtype: torch.dtype, y_zero: int, activation: str,
                alpha: float, beta: float, y_scale: float) -> dict[str, int]:
    """bounded / clamp_words / lo_word / hi_word of a layer: scale_q [C] float32 as the kernel multiplies, sum_bound
    [C] the largest |t| of each channel; activation "" / "Relu" / "Clip" (alpha, beta: Clip's bounds)."""
    off = dict(bounded=0, clamp_words=0, lo_word=WORD_MIN, hi_word=WORD_MAX)
    if y_dtype not in BYTE_RANGE:
        return off
    reach = float((scale_q.to(torch.float64).abs() * sum_bound.to(torch.float64)).max()) if scale_q.numel() else 0.0
    if not reach < CONVERTS:
        return off
    if activation == "Relu":
        lo, hi = _word(0.0, y_zero), WORD_MAX
    elif activation == "Clip":  # the bounds as the kernel holds them: float32 of alpha / y_scale
        lo, hi = _word(alpha / y_scale, y_zero), _word(beta / y_scale, y_zero)
    elif activation == "":
        return dict(off, bounded=1)
    else:  # an activation the words cannot apply (GELU: on the floats, before the requantization)
        return off
    low, high = BYTE_RANGE[y_dtype]
    return dict(bounded=1, clamp_words=int(lo > low or hi < high), lo_word=lo, hi_word=hi)
