"""CPU tactic for a network's first convolution (C_in <= 4: an RGB image) on kiln's C kernel
(kiln/kernels/cpu/stem.py), a native-segment member.

    cpu.conv.stem_native   a KxK convolution of <= 4 input channels (K <= 11, strides 1-4, any padding, no dilation,
                           one group), bias and ReLU / Clip in the same pass, NCHW in (the image: a segment
                           reads it where it lies, no relayout), NHWC out

Why: the stems of ResNet-tiny (7x7/2) and RegNetY-tiny (3x3/2) were the gap to onnxruntime on the Zen 3
(bench/results/zoo-cpu-zen3-all-2026-12-07.md); oneDNN's NHWC stem needs the image copied into NHWC at the segment's
entry, this kernel reads it NCHW. No rule picks it: the autotuner times it against the oneDNN tactics per layer on
the machine and keeps the faster (bench/results/stem-avx2-2026-12-07.md: picked for ResNet-tiny at 1 thread, -4%
on the engine).

Refused: more than 4 input channels, groups, dilations, a residual input, a final activation, activations other
than ReLU / Clip. A kernel is bound per input size (another batch: one more on first sight, no JIT).
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.kernels.cpu import stem
from kiln.plan.spec import StepSpec
from kiln.tactics.cpu.native_member import (direct_conv_prepared, direct_conv_refusal, input_size_config,
                                            not_built_refusal)
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic

_F32 = torch.float32


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    x = inputs[0]
    if x.shape is not None and len(x.shape) == 4 and x.dtype == _F32 and (
            not isinstance(x.shape[1], int) or x.shape[1] > stem.MAX_CHANNELS):
        return f"{x.shape[1]} input channels: the stem kernel takes at most {stem.MAX_CHANNELS}"
    if (refusal := not_built_refusal(stem, "stem")) is not None:
        return refusal
    return direct_conv_refusal(step, inputs, stem, "stem")


def _prepare(step: StepSpec, constants: list[Any], device: torch.device):
    # NCHW in (rows_input: a segment hands it the image as it arrives, no relayout), NHWC out
    return direct_conv_prepared(step, constants, stem.StemConv, rows_input=True)


register(Tactic(
    name="cpu.conv.stem_native", op_type="FusedConv", domain="kiln", device="cpu", dtypes=(_F32,),
    supports=_supports, configure=input_size_config, prepare=_prepare,
    available=stem.available, native=True,
    description="convolution of <= 4 input channels (a network's stem) + bias + ReLU/Clip in kiln's C (AVX2 "
                "vectors over output channels), NCHW in, NHWC out, a native-segment member",
))
