"""The residual add fused into a quantized convolution's epilogue (kiln::QConv inputs 9-13, kiln/ops/
quantized.py), host side: its parameters, fixed at prepare.

The reference rounds twice: the convolution's own 8-bit result c, then the sum

    c = saturate(round_half_even(fp32(a·s64) / conv_scale) + conv_zero)       a = acc + bias, s64 = x_scale·w_scale
    y = saturate(round_half_even(fp32(act((c − z_c)·s_c + (res − z_r)·s_r)) / y_scale) + y_zero)

A float32 epilogue lands within fp32 rounding of each value, so a near-tie may round either way. For the
sum that is the one step the contract allows every quantized kernel; for c it is a step of c, which the
sum multiplies by s_c / y_scale: ResNet-50's blocks have s_c > y_scale, two steps of the sum, and the
builder's one-step check rejected every such kernel on the H200 (bench/results/qadd-2026-12-03.md). So
the kernel computes c exactly (qmath.exact_integer_result: its fast path, and the reference's float64
arithmetic in the tiles that hold a near-tie), for which it needs s64 per output channel (ExactRounding).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kiln.kernels.cuda.triton.qgemm import INT_RANGE, Epilogue

ACTIVATIONS = ("", "Relu")


def float32(value: float) -> float:
    """value as the float32 number a kernel receives (the contract's scales are float32 already)."""
    return float(torch.tensor(value, dtype=torch.float32))


@dataclass(frozen=True)
class ExactRounding:
    """What rounding a layer's 8-bit result exactly as the reference needs (qmath.exact_integer_result), at
    prepare: x_scale·w_scale per output channel in float64 (exact: the reference's _channel_scale), on the
    layer's device, and the result's own y_scale (the Epilogue may hold it folded into its scale)."""

    channel_scale: torch.Tensor  # float64 [C]
    y_scale: float

    def check(self, epilogue: Epilogue, channels: int, device: torch.device) -> None:
        if epilogue.out_dtype not in INT_RANGE or epilogue.activation != "":
            raise ValueError(f"triton qconv2d: exact rounding is for an int8/uint8 result with no activation, got "
                             f"{epilogue.out_dtype}, activation {epilogue.activation!r}")
        s = self.channel_scale
        if s.dtype != torch.float64 or s.numel() != channels or s.device != device or not s.is_contiguous():
            raise ValueError(f"triton qconv2d: exact rounding needs x_scale·w_scale as {channels} contiguous float64 "
                             f"values on {device}, got {s.dtype}[{s.numel()}] on {s.device}")
        if not (epilogue.prescaled or float32(epilogue.y_scale) == float32(self.y_scale)):
            raise ValueError(f"triton qconv2d: the epilogue writes at scale {epilogue.y_scale}, exact rounding "
                             f"at {self.y_scale}")


@dataclass(frozen=True)
class ResidualAdd:
    """What the epilogue adds after the layer's own 8-bit result c (the Epilogue, no activation), fixed at
    prepare: c's scale/zero point (a), the residual's (b), the sum's output and activation; float32 numbers.
    c itself is rounded exactly (qconv2d's ExactRounding)."""

    a_scale: float
    a_zero: float
    b_scale: float
    b_zero: float
    out_dtype: torch.dtype  # int8 / uint8
    y_scale: float
    y_zero: float
    activation: str = ""  # "" | "Relu"

    @property
    def qrange(self) -> tuple[int, int]:
        return INT_RANGE[self.out_dtype]

    @property
    def multipliers(self) -> tuple[float, float]:
        """s_a / y_scale, s_b / y_scale in float64, rounded once to fp32: a multiply per term, no division."""
        y = float32(self.y_scale)
        return float32(float32(self.a_scale) / y), float32(float32(self.b_scale) / y)

    def check(self, epilogue: Epilogue, out_shape: tuple[int, ...], residual: torch.Tensor) -> None:
        """What a launch needs (qconv2d): the epilogue writes c (int8/uint8, no activation, c's zero point),
        the residual is the output's shape."""
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
