"""tactic.conv_operands_refusal and conv_geometry: the CPU convolution tactics' shared check of a convolution's
attributes against its input and weight. oneDNN's float tactics (kiln/tactics/cpu/onednn.py) and its 8-bit ones
(quantized.py) refuse the same layers in the same words; the geometry is read as ONNX defines Conv's attributes."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.cpu import onednn
from kiln.plan.spec import StepSpec
from kiln.tactics import registry
from kiln.tactics.tactic import InputMeta, conv_geometry, conv_operands_refusal

pytestmark = pytest.mark.skipif(not onednn.available(), reason="libdnnl.so.3 not installed (onednn-cpu-gomp)")

FLOAT = ["cpu.conv.onednn_direct", "cpu.conv.onednn_silu", "cpu.conv.winograd"]
QUANTIZED = ["cpu.qconv.onednn", "cpu.qconv.dequantized"]

# x [N, C, H, W], w [O, C/group, kH, kW], attributes -> the refusal
REFUSED = [
    ((1, 16, 8, 8), (32, 16, 3, 3), {"auto_pad": "SAME_UPPER"}, "auto_pad=SAME_UPPER (pads depend on the input size)"),
    ((1, 16, 8, 8), (32, 16, 3, 3), {"kernel_shape": [5, 5]}, "kernel_shape [5, 5] differs from the weight's [3, 3]"),
    ((1, 16, 8, 8), (32, 8, 3, 3), {}, "channels 16 do not match the weight [32, 8, 3, 3] in 1 groups"),
    ((1, 16, 8, 8), (30, 4, 3, 3), {"group": 4}, "channels 16 do not match the weight [30, 4, 3, 3] in 4 groups"),
]


def _layer(name: str, x: tuple[int, ...], w: tuple[int, ...], attributes: dict) -> tuple[StepSpec, list[InputMeta]]:
    """The tactic's op on x and w: FusedConv with a SiLU (float32; onednn_silu runs only those), or QConv with a
    Relu (uint8 x, int8 w, per-tensor parameters)."""
    if name in FLOAT:
        metas = [InputMeta(x, torch.float32, False), InputMeta(w, torch.float32, True),
                 InputMeta((w[0],), torch.float32, True)]
        step = StepSpec("FusedConv", "conv", ["x", "w", "b"], ["y"],
                        {"pads": [1, 1, 1, 1], "activation": "SiLU", **attributes}, domain="kiln")
        return step, metas
    scalar = InputMeta((), torch.float32, True)
    metas = [InputMeta(x, torch.uint8, False), scalar, InputMeta((), torch.uint8, True), InputMeta(w, torch.int8, True),
             scalar, InputMeta((), torch.int8, True), InputMeta(None, None, False), InputMeta(None, None, False),
             InputMeta((w[0],), torch.int32, True)]
    step = StepSpec("QConv", "qconv", ["x", "xs", "xz", "w", "ws", "wz", "", "", "b"], ["y"],
                    {"pads": [1, 1, 1, 1], "activation": "Relu", "output_dtype": 1, **attributes}, domain="kiln")
    return step, metas


@pytest.mark.parametrize("name", FLOAT + QUANTIZED)
@pytest.mark.parametrize("x, w, attributes, refusal", REFUSED, ids=["auto_pad", "kernel_shape", "channels", "groups"])
def test_float_and_8_bit_tactics_refuse_alike(name, x, w, attributes, refusal):
    step, metas = _layer(name, x, w, attributes)
    assert conv_operands_refusal(step, metas[0], metas[1 if name in FLOAT else 3]) == refusal
    assert registry.get(name).check(step, metas) == refusal


@pytest.mark.parametrize("name", ["cpu.conv.onednn_direct", "cpu.conv.onednn_silu"] + QUANTIZED)
@pytest.mark.parametrize("x, w, group", [((2, 16, 9, 7), (32, 16, 3, 3), 1), ((1, 16, 8, 8), (32, 4, 3, 3), 4),
                                         ((1, 24, 8, 8), (24, 1, 3, 3), 24)], ids=["dense", "grouped", "depthwise"])
def test_fitting_operands_are_taken(name, x, w, group):
    step, metas = _layer(name, x, w, {"group": group, "kernel_shape": [3, 3]})
    assert conv_operands_refusal(step, metas[0], metas[1 if name in FLOAT else 3]) is None
    assert registry.get(name).check(step, metas) is True


@pytest.mark.parametrize("attributes, geometry", [
    ({}, ([0, 0, 0, 0], [1, 1], [1, 1])),  # ONNX's defaults
    ({"auto_pad": "VALID", "pads": [1, 2, 3, 4]}, ([0, 0, 0, 0], [1, 1], [1, 1])),  # VALID: no padding
    ({"auto_pad": "NOTSET", "pads": [0, 1, 2, 3], "strides": [2, 3], "dilations": [3, 2]},
     ([0, 1, 2, 3], [2, 3], [3, 2])),
    ({"pads": None, "strides": None, "kernel_shape": [3, 5]}, ([0, 0, 0, 0], [1, 1], [1, 1])),  # None: not given
])
def test_geometry_is_read_as_onnx_defines_it(attributes, geometry):
    step = StepSpec("FusedConv", "conv", ["x", "w"], ["y"], attributes, domain="kiln")
    assert conv_geometry(step, (8, 4, 3, 5)) == geometry
