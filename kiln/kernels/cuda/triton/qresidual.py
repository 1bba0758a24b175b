"""The residual add fused into a quantized convolution's epilogue (kiln::QConv inputs 9-13, kiln/ops/
quantized.py), host side: its parameters and the two tables that make the epilogue exact.

The reference rounds twice: the convolution's own 8-bit result c, then the sum

    c = saturate(round_half_even(fp32(a·s64) / conv_scale) + conv_zero)       a = acc + bias, s64 = x_scale·w_scale
    y = saturate(round_half_even(fp32(act((c − z_c)·s_c + (res − z_r)·s_r)) / y_scale) + y_zero)

A float32 epilogue lands within fp32 rounding of each value, so a near-tie may round either way: one step
of c, which the sum multiplies by s_c / y_scale (ResNet-50's blocks have s_c > y_scale: two steps of the
sum, and the builder's one-step check rejected every such kernel on the H200, bench/results/
qadd-2026-12-03.md). Recomputing every value exactly (float64, IEEE division) costs conversions that issue
at a quarter of the fp32 rate on Hopper. Instead the kernel keeps its fast path and reads the exact answer
where a value lies within qmath.TIE_WINDOW of a tie (about one in 10^5):

  - c: the reference rounds monotonically in the integer a, so per output channel the least a that
    gives each result b is a threshold (`rounding_thresholds`, [C, 256] int32): c >= b <=> a >= T[b];
  - the sum: c and res are 8-bit, so every pair's exact result is a 256x256 table (`sum_table`).

Both are made once at prepare with the reference's own arithmetic (float64 products, float32 division,
round half to even), on the layer's device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from kiln.kernels.cuda.triton.qgemm import INT_RANGE, Epilogue

ACTIVATIONS = ("", "Relu")
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def float32(value: float) -> float:
    """value as the float32 number a kernel receives (the contract's scales are float32 already)."""
    return float(torch.tensor(value, dtype=torch.float32))


def rounding_thresholds(channel_scale: torch.Tensor, y_scale: float, y_zero: float,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """T [C, 256] int32: T[o, j] is the least integer a with round_half_even(fp32(a·s[o]) / y_scale) >= lo + 1 + j,
    lo = qmin − y_zero (INT32_MAX where no int32 a reaches it), for j < 255; column 255 is padding. s: float64
    [C], x_scale·w_scale exactly (the reference's _channel_scale). A bisection over int32, all thresholds at once."""
    qmin, _ = INT_RANGE[out_dtype]
    s = channel_scale.to(torch.float64).reshape(-1, 1)  # [C, 1]
    target = (qmin - float32(y_zero)) + 1.0 + torch.arange(256, dtype=torch.float64, device=s.device)  # [256]
    y = torch.tensor(float32(y_scale), dtype=torch.float32, device=s.device)
    low = torch.full((s.shape[0], 256), INT32_MIN, dtype=torch.int64, device=s.device)
    high = torch.full_like(low, INT32_MAX)
    for _ in range(33):  # the interval halves each time: 2^32 -> 1
        middle = torch.div(low + high, 2, rounding_mode="floor")
        reached = torch.round((middle.to(torch.float64) * s).to(torch.float32) / y).to(torch.float64) >= target
        high = torch.where(reached, middle, high)
        low = torch.where(reached, low, middle + 1)
    return low.clamp(INT32_MIN, INT32_MAX).to(torch.int32).contiguous()


@dataclass(frozen=True)
class ResidualAdd:
    """What the epilogue adds after the layer's own 8-bit result c (the Epilogue, no activation), fixed at
    prepare: c's scale/zero point (a), the residual's (b), the sum's output and activation; float32 numbers.
    `with_tables` adds what makes the sum exact; a launch needs them."""

    a_scale: float
    a_zero: float
    b_scale: float
    b_zero: float
    out_dtype: torch.dtype  # int8 / uint8
    y_scale: float
    y_zero: float
    activation: str = ""  # "" | "Relu"
    a_dtype: torch.dtype | None = None  # c's (the Epilogue's out_dtype) and the residual's, with the tables
    b_dtype: torch.dtype | None = None
    thresholds: torch.Tensor | None = field(default=None, repr=False, compare=False)  # rounding_thresholds of c
    sums: torch.Tensor | None = field(default=None, repr=False, compare=False)  # [256·256] fp32: sum_table

    @property
    def qrange(self) -> tuple[int, int]:
        return INT_RANGE[self.out_dtype]

    @property
    def multipliers(self) -> tuple[float, float]:
        """s_a / y_scale, s_b / y_scale in float64, rounded once to fp32: a multiply per term, no division."""
        y = float32(self.y_scale)
        return float32(float32(self.a_scale) / y), float32(float32(self.b_scale) / y)

    def sum_table(self, a_dtype: torch.dtype, b_dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """[256·256] fp32: the reference's sum for c = A_MIN + i // 256, res = B_MIN + i % 256 (kiln::QAdd's
        arithmetic: float64 terms, activation, float32 division, round half to even, saturation)."""
        (a_min, a_max), (b_min, b_max) = INT_RANGE[a_dtype], INT_RANGE[b_dtype]
        c = torch.arange(a_min, a_max + 1, dtype=torch.float64, device=device)  # [256]
        res = torch.arange(b_min, b_max + 1, dtype=torch.float64, device=device)
        r = ((c - float32(self.a_zero)) * float32(self.a_scale))[:, None] + \
            ((res - float32(self.b_zero)) * float32(self.b_scale))[None, :]  # [256, 256]
        if self.activation == "Relu":
            r = r.relu()
        y = torch.round(r.to(torch.float32) / torch.tensor(float32(self.y_scale), dtype=torch.float32, device=device))
        qmin, qmax = self.qrange
        return (y + float32(self.y_zero)).clamp(qmin, qmax).reshape(-1).contiguous()

    def with_tables(self, channel_scale: torch.Tensor, a_dtype: torch.dtype, b_dtype: torch.dtype) -> ResidualAdd:
        """The add with its exact tables for c of `a_dtype` from a convolution whose per-channel scale is
        `channel_scale` (float64 x_scale·w_scale, on the layer's device) and a residual of `b_dtype`.
        Once per layer, at prepare."""
        if a_dtype not in INT_RANGE or b_dtype not in INT_RANGE or self.out_dtype not in INT_RANGE:
            raise TypeError(f"residual add: c, the residual and the sum are int8/uint8, got {a_dtype}, {b_dtype}, "
                            f"{self.out_dtype}")
        thresholds = rounding_thresholds(channel_scale, self.a_scale, self.a_zero, a_dtype)
        return dataclasses.replace(self, a_dtype=a_dtype, b_dtype=b_dtype, thresholds=thresholds,
                                   sums=self.sum_table(a_dtype, b_dtype, channel_scale.device))

    def check(self, epilogue: Epilogue, out_shape: tuple[int, ...], residual: torch.Tensor) -> None:
        """What a launch needs (qconv2d): the epilogue writes c (int8/uint8, no activation, c's zero point),
        the residual is the output's shape, the tables were made for these dtypes and channels."""
        if epilogue.out_dtype not in INT_RANGE or self.out_dtype not in INT_RANGE:
            raise TypeError(f"triton qconv2d: a residual add takes the layer's int8/uint8 result to an int8/uint8 "
                            f"sum, got {epilogue.out_dtype} -> {self.out_dtype}")
        if self.activation not in ACTIVATIONS or epilogue.activation != "":
            raise ValueError(f"triton qconv2d: with a residual the layer has no activation of its own and the sum "
                             f"Relu or none, got {epilogue.activation!r}, {self.activation!r}")
        if float32(epilogue.y_zero) != float32(self.a_zero) or \
                not (epilogue.prescaled or float32(epilogue.y_scale) == float32(self.a_scale)):
            raise ValueError(f"triton qconv2d: the epilogue writes c at scale {epilogue.y_scale}, zero point "
                             f"{epilogue.y_zero}; the residual add reads it at {self.a_scale}, {self.a_zero}")
        if tuple(residual.shape) != tuple(out_shape) or residual.dtype not in INT_RANGE:
            raise ValueError(f"triton qconv2d: the residual must be int8/uint8 {list(out_shape)} (the output's "
                             f"shape), got {residual.dtype}{list(residual.shape)}")
        channels = out_shape[1]
        if self.thresholds is None or self.sums is None:
            raise ValueError("triton qconv2d: the residual add has no exact tables: make it with "
                             "ResidualAdd.with_tables(channel_scale, c dtype, residual dtype) at prepare")
        if (self.a_dtype, self.b_dtype) != (epilogue.out_dtype, residual.dtype) or \
                tuple(self.thresholds.shape) != (channels, 256) or self.sums.numel() != 256 * 256 or \
                self.thresholds.device != residual.device or self.sums.device != residual.device:
            raise ValueError(f"triton qconv2d: the residual add's tables are for c {self.a_dtype}, residual "
                             f"{self.b_dtype}, {self.thresholds.shape[0]} channels on {self.thresholds.device}; "
                             f"the launch has c {epilogue.out_dtype}, residual {residual.dtype}, {channels} "
                             f"channels on {residual.device}")
