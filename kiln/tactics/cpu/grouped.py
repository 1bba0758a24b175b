"""CPU tactic for a grouped kiln::FusedConv of few channels a group on kiln's C kernel (kiln/kernels/cpu/grouped.py),
a native-segment member.

    cpu.conv.grouped_native   a KxK convolution of G = 2, 4, 8, 16 or 32 channels a group in and out (K <= 7, any
                              stride and padding, no dilation), bias and ReLU in the same pass, NHWC, AVX2 builds

Why: under the AVX2 cap oneDNN runs ResNeXt-50 32x4d's grouped 3x3 layers as an im2col GEMM (4 channels a group) or
on jit:avx2 (8), 1.1-2.3x onnxruntime's MLAS (bench/grouped_conv_avx2.py). Not chosen by a rule: the autotuner times
this tactic against cpu.conv.onednn_direct per layer on the machine and keeps the faster.

Refused: a residual input or a final activation, other activations, dilations, depthwise layers (depthwise.py's),
groups of other sizes, an AVX-512 build (oneDNN's AVX-512 kernels there).
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.kernels.cpu import grouped
from kiln.plan.spec import StepSpec
from kiln.tactics.cpu.native_member import direct_conv_prepared, direct_conv_refusal, input_size_config
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if not grouped.available():
        return f"kiln's grouped convolution kernel is not built for AVX2 here: {grouped.reason() or 'an AVX-512 build'}"
    return direct_conv_refusal(step, inputs, grouped, "grouped convolution")


def _prepare(step: StepSpec, constants: list[Any], device: torch.device):
    return direct_conv_prepared(step, constants, grouped.GroupedConv)


register(Tactic(
    name="cpu.conv.grouped_native", op_type="FusedConv", domain="kiln", device="cpu", dtypes=(torch.float32,),
    supports=_supports, configure=input_size_config, prepare=_prepare, layout="channels_last",
    available=grouped.available, native=True,
    description="grouped KxK convolution of 2-32 channels a group + bias + ReLU in kiln's C (AVX2), NHWC, "
                "a native-segment member",
))
