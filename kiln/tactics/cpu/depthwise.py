"""CPU tactic for a depthwise kiln::FusedConv on kiln's C kernel (kiln/kernels/cpu/depthwise.py), a native-segment
member.

    cpu.conv.depthwise_native   a KxK convolution with one filter per channel (K <= 8, any stride and padding, no
                                dilation), bias and ReLU / Clip (ReLU6) / SiLU in the same pass, NHWC activations

Why: oneDNN's jit_dw (cpu.conv.onednn_direct's depthwise kernel) is behind onnxruntime's MLAS on some of
MobileNetV2's and EfficientNet-B0's layers under the AVX2 cap (stride 2; SiLU through its swish post-op), and ahead
on others. Neither is chosen by a rule: the autotuner times this tactic against cpu.conv.onednn_direct (and
onednn_silu) per layer on the machine and keeps the faster. The kernel is built for the CPU it runs on (AVX-512 or
AVX2 vectors: native_loop.build's -march=native, or x86-64-v3 under KILN_CPU_ISA=avx2).

Refused: a residual input or a final activation (the layers of MobileNetV2 / EfficientNet have neither), other
activations, dilations, grouped convolutions that are not depthwise. A kernel is bound per input size (another
batch: one more on first sight, no JIT: only the plan's sizes change).
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.kernels.cpu import depthwise
from kiln.plan.spec import StepSpec
from kiln.tactics.cpu.native_member import (direct_conv_prepared, direct_conv_refusal, input_size_config,
                                            not_built_refusal)
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic

_F32 = torch.float32


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if (refusal := not_built_refusal(depthwise, "depthwise")) is not None:
        return refusal
    return direct_conv_refusal(step, inputs, depthwise, "depthwise")


def _prepare(step: StepSpec, constants: list[Any], device: torch.device):
    return direct_conv_prepared(step, constants, depthwise.DepthwiseConv)


register(Tactic(
    name="cpu.conv.depthwise_native", op_type="FusedConv", domain="kiln", device="cpu", dtypes=(_F32,),
    supports=_supports, configure=input_size_config, prepare=_prepare, layout="channels_last",
    available=depthwise.available, native=True,
    description="depthwise KxK convolution + bias + ReLU/Clip/SiLU in kiln's C (AVX-512 or AVX2 by the CPU), "
                "NHWC, a native-segment member",
))
