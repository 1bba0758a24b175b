"""cuda.conv1d.unfold_bmm and cuda.instance_norm.group_norm (kiln/tactics/cuda/conv1d.py) on CPU tensors against
the ops' registered implementations (FusedConv: torch's conv1d + the shared epilogue; InstanceNormalization:
kiln's own, tested against onnxruntime in the node suite). Both tactics are plain torch, so the CPU runs the
code a CUDA engine does; the autotuner's tolerance (`mismatch`) judges them, fresh random inputs each run."""

from __future__ import annotations

import pytest
import torch

from tests.unit.tactic_check import make_step, reason, run_against_reference

CONV = "cuda.conv1d.unfold_bmm"
NORM = "cuda.instance_norm.group_norm"


@pytest.mark.parametrize("channels, groups, taps, length, pads, stride, dilation", [
    (768, 16, 128, 49, [64, 64], 1, 1),  # Wav2Vec2's positional convolution (groups of 48 channels)
    (12, 3, 16, 40, [0, 0], 2, 1),       # strided, no padding
    (8, 1, 17, 33, [5, 11], 1, 2),       # dilated, asymmetric pads, one group
    (6, 6, 31, 20, [15, 15], 1, 1),      # depthwise (a group per channel)
])
def test_long_kernels_match_the_convolution(channels, groups, taps, length, pads, stride, dilation):
    x = torch.randn(2, channels, length)
    w = torch.randn(channels, channels // groups, taps) / (channels // groups * taps) ** 0.5
    b = torch.randn(channels)
    step = make_step("FusedConv", "kiln", 3, group=groups, kernel_shape=[taps], pads=pads, strides=[stride],
                     dilations=[dilation])
    got = run_against_reference(CONV, step, [x, w, b], {1, 2})
    span = dilation * (taps - 1) + 1
    assert got.shape == (2, channels, (length + sum(pads) - span) // stride + 1)


def test_epilogue_activation_and_residual():
    x, w = torch.randn(3, 16, 50), torch.randn(32, 4, 20) * 0.1
    step = make_step("FusedConv", "kiln", 4, group=4, kernel_shape=[20], pads=[10, 9], activation="Gelu")
    residual = torch.randn(3, 32, 50)
    run_against_reference(CONV, step, [x, w, torch.randn(32), residual], {1, 2})
    after = make_step("FusedConv", "kiln", 4, group=4, kernel_shape=[20], pads=[10, 9], activation="Relu",
                      residual_after_activation=1)
    run_against_reference(CONV, after, [x, w, None, residual], {1})


def test_half_precision():
    x, w = torch.randn(1, 32, 40).to(torch.bfloat16), (torch.randn(32, 8, 24) * 0.05).to(torch.bfloat16)
    step = make_step("FusedConv", "kiln", 2, group=4, kernel_shape=[24], pads=[12, 12])
    # the reference op is torch's conv1d: on AVX-512/AMX Xeons its oneDNN bf16 grouped convolution is wrong (2.6 off
    # on outputs of max 2.6 against float64; 0.004 without oneDNN), so the reference runs on torch's native kernel
    with torch.backends.mkldnn.flags(enabled=False):
        run_against_reference(CONV, step, [x, w], {1})


def test_refusals():
    x = torch.randn(1, 8, 30)
    short = make_step("FusedConv", "kiln", 2, group=1, kernel_shape=[3], pads=[1, 1])
    assert "taps" in reason(CONV, short, [x, torch.randn(8, 8, 3)], {1})
    step = make_step("FusedConv", "kiln", 2, group=1, kernel_shape=[16], pads=[0, 0])
    assert "constant" in reason(CONV, step, [x, torch.randn(8, 8, 16)], set())
    two_d = make_step("FusedConv", "kiln", 2, group=1, kernel_shape=[16, 16])
    assert "1-D" in reason(CONV, two_d, [torch.randn(1, 8, 30, 30), torch.randn(8, 8, 16, 16)], {1})
    assert "fit" in reason(CONV, step, [torch.randn(1, 8, 10), torch.randn(8, 8, 16)], {1})


@pytest.mark.parametrize("shape, dtype", [((2, 512, 300), torch.float32), ((1, 6, 7, 9), torch.float32),
                                          ((2, 16, 64), torch.bfloat16)])
def test_instance_norm_matches_the_op(shape, dtype):
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    scale, bias = torch.randn(shape[1]).to(dtype), torch.randn(shape[1]).to(dtype)
    step = make_step("InstanceNormalization", "", 3, epsilon=1e-5)
    run_against_reference(NORM, step, [x, scale, bias])


def test_instance_norm_refuses_other_scales():
    step = make_step("InstanceNormalization", "", 3)
    assert "scale" in reason(NORM, step, [torch.randn(1, 4, 5), torch.randn(3), torch.randn(4)])
