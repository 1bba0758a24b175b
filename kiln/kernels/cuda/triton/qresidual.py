"""The residual add fused into a quantized convolution's epilogue (kiln::QConv inputs 9-13, kiln/ops/
quantized.py), host side: its parameters, fixed at prepare.

The reference rounds twice: the convolution's own 8-bit result c, then the sum

    c = saturate(round(fp32(a·s64) / conv_scale) + conv_zero)         a = acc + bias, s64 = x_scale·w_scale
    y = saturate(round(fp32(act((c − z_c)·s_c + (res − z_r)·s_r)) / y_scale) + y_zero)

(round: half to even onto the integers for int8/uint8, onto the E4M3 grid for float8e4m3fn). The kernel does both
in fp32 (c from the prescaled epilogue, then the add's multipliers): c within a step of the reference's, the sum
within a step of what the add makes of that c. The fused layer is judged by that composition, the unfused pair's
tolerance (kiln/tactics/cuda/quant_residual_check.py), not by one step of the sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.kernels.cuda.triton import qmath
from kiln.kernels.cuda.triton.qgemm import INT_RANGE, Epilogue

FP8 = torch.float8_e4m3fn
ACTIVATIONS = ("", "Relu")


def float32(value: float) -> float:
    """value as the float32 number a kernel receives (the contract's scales are float32 already)."""
    return float(torch.tensor(value, dtype=torch.float32))


@dataclass(frozen=True)
class ResidualAdd:
    """What the epilogue adds after the layer's own 8-bit result c (the Epilogue, no activation), fixed at
    prepare: c's scale/zero point (a), the residual's (b), the sum's output and activation; float32 numbers.
    int8/uint8 c, residual and sum, or all three float8e4m3fn."""

    a_scale: float
    a_zero: float
    b_scale: float
    b_zero: float
    out_dtype: torch.dtype  # int8 / uint8 / float8e4m3fn
    y_scale: float
    y_zero: float
    activation: str = ""  # "" | "Relu"

    @property
    def qrange(self) -> tuple[int, int]:
        return INT_RANGE.get(self.out_dtype, (0, 0))

    @property
    def out_kind(self) -> int:
        return qmath.OUT_FP8 if self.out_dtype == FP8 else qmath.OUT_INT

    @property
    def multipliers(self) -> tuple[float, float]:
        """s_a / y_scale, s_b / y_scale in float64, rounded once to fp32: a multiply per term, no division."""
        y = float32(self.y_scale)
        return float32(float32(self.a_scale) / y), float32(float32(self.b_scale) / y)

    def check(self, epilogue: Epilogue, out_shape: tuple[int, ...], residual: torch.Tensor) -> None:
        """What a launch needs (qconv2d): the epilogue writes c (no activation, c's scale and zero point), c, the
        residual and the sum all int8/uint8 or all float8e4m3fn, the residual of the output's shape."""
        fp8 = epilogue.out_dtype == FP8
        kinds_ok = (epilogue.out_dtype, self.out_dtype, residual.dtype) == (FP8,) * 3 if fp8 else \
            epilogue.out_dtype in INT_RANGE and self.out_dtype in INT_RANGE and residual.dtype in INT_RANGE
        if not kinds_ok:
            raise TypeError(f"triton qconv2d: a residual add takes the layer's 8-bit result and an 8-bit residual to "
                            f"an 8-bit sum, all int8/uint8 or all float8e4m3fn; got c {epilogue.out_dtype}, residual "
                            f"{residual.dtype}, sum {self.out_dtype}")
        if self.activation not in ACTIVATIONS or epilogue.activation != "":
            raise ValueError(f"triton qconv2d: with a residual the layer has no activation of its own and the sum "
                             f"Relu or none, got {epilogue.activation!r}, {self.activation!r}")
        if float32(epilogue.y_zero) != float32(self.a_zero) or \
                not (epilogue.prescaled or float32(epilogue.y_scale) == float32(self.a_scale)):
            raise ValueError(f"triton qconv2d: the epilogue writes c at scale {epilogue.y_scale}, zero point "
                             f"{epilogue.y_zero}; the residual add reads it at {self.a_scale}, {self.a_zero}")
        if tuple(residual.shape) != tuple(out_shape):
            raise ValueError(f"triton qconv2d: the residual must be {list(out_shape)} (the output's shape), got "
                             f"{residual.dtype}{list(residual.shape)}")
