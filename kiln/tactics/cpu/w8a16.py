"""kiln::QConv with a float input quantized to 16 bits (a W8A16 layer) on oneDNN's int8 convolutions.

    cpu.qconv.w8a16   QConv(x float32; x_scale, x_zero_point of uint16/int16; int8 w, ...): x split into the high
                      and low bytes of its 16-bit value in one pass (kiln/kernels/cpu/split16.c), then two u8·s8
                      convolutions summed in float32 by a post-op (onednn_int8.W8A16Conv2d: each exact in int32),
                      the activation after, the output float32 or requantized to 8 bits (a per-tensor reorder)
    cpu.qconv.w8a16_gemm   the same QConv where it is a 1x1 convolution of stride 1 (a GEMM over the NHWC rows):
                      one C pass (kiln/kernels/cpu/w16gemm.c), the float input quantized to int16 as it is read,
                      int16 x int8 (widened) products summed in int32 (AVX-512 VNNI vpdpwssd, AVX2 vpmaddwd), the
                      scale, bias, activation and 8-bit requantize on the sums; no byte split, no second pass over
                      the output. The tuner times it against cpu.qconv.w8a16 (on Zen 4 vpdpwssd does half the
                      multiply-adds of vpdpbusd a cycle: the one pass wins where the layer is memory-bound, the
                      split where its K is large; bench/results/quantacc6-2026-12-06.md)

Where such a layer comes from: the accuracy target's precision between int8 and float on an int8 CPU build
(kiln/quant/qdq.py insert's `wide`: the layer's input quantize-dequantize pair at 16 bits), fused into a QConv
with a 16-bit source (kiln/passes/fusion/qdq_layers.py) whose QuantizeLinear it then reads itself
(fold_wide_quantize_into_layer): the float tensor is read once, as the float layer before wrote it.

It refuses a signed 16-bit zero point other than 0 and a uint16 one other than 0 (W8A16Conv2d's byte split assumes
the symmetric int16 and the [0, amax] uint16 that qdq.insert makes), and on a CPU without VNNI the weights whose
pair sums can saturate (quantized.py's rule: both bytes are u8 sources); the GEMM does not (int16 products).
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.kernels.cpu import onednn, onednn_int8, split16, w16gemm, w8a16
from kiln.plan.spec import StepSpec
from kiln.tactics.cpu.quantized import _activation, _configure, _constants_refusal, _residual_refusal, conv_launch, \
    qconv_parts
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic, conv_geometry, conv_operands_refusal
from kiln.tactics.tactic import attribute as _attr

WIDE = (torch.uint16, torch.int16)  # the 16-bit activation types a W8A16 layer reads
TACTICS = ("cpu.qconv.w8a16", "cpu.qconv.w8a16_gemm")  # what a W8A16 layer runs as


def _supports_common(step: StepSpec, inputs: list[InputMeta]) -> str | None:
    """What both W8A16 tactics need: a 16-bit input of one scale, an int8 2-D weight, a per-tensor 8-bit or float32
    output, a oneDNN post-op activation."""
    if (refusal := _residual_refusal(inputs) or _constants_refusal(inputs)) is not None:
        return refusal
    x, x_zero, w = inputs[0], inputs[2], inputs[3]
    if x_zero.dtype not in WIDE:
        return f"x_zero_point {str(x_zero.dtype).removeprefix('torch.')}: a 16-bit (uint16/int16) input only"
    if len(x.shape) != 4 or w.dtype != torch.int8 or len(w.shape) != 4:
        return "only 2-D convolutions of an int8 weight"
    if len(inputs[1].shape) > 0 and inputs[1].shape != (1,):
        return "a per-channel input scale"
    y_scale = inputs[6] if len(inputs) > 6 else None
    if y_scale is not None and y_scale.shape is not None:
        if y_scale.shape not in ((), (1,)) or inputs[7].dtype not in (torch.uint8, torch.int8):
            return "the output is not quantized per tensor to uint8/int8"
    elif int(_attr(step, "output_dtype", 1)) != 1:
        return "a float output other than float32"
    if (refusal := conv_operands_refusal(step, x, w)) is not None:
        return refusal
    if isinstance(onednn.eltwise_for(*_activation(step)), str):
        return f"activation {_attr(step, 'activation', '')!r} has no oneDNN post-op"
    return None


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if (refusal := _supports_common(step, inputs)) is not None:
        return refusal
    if not split16.available():
        return f"kiln's split16 kernel: {split16.reason()}"
    return True


def _gemm_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if (refusal := _supports_common(step, inputs)) is not None:
        return refusal
    w = inputs[3]
    geometry = conv_geometry(step, tuple(w.shape))
    if isinstance(geometry, str):
        return geometry
    pads, strides, dilations = geometry
    if (refusal := w16gemm.pointwise_refusal(tuple(w.shape[2:]), strides, pads, dilations,
                                             int(_attr(step, "group", 1)))) is not None:
        return refusal
    if _attr(step, "activation", "") not in w16gemm.ACTIVATIONS:
        return f"activation {_attr(step, 'activation', '')!r}: w16gemm applies none, Relu and Clip"
    if not w16gemm.available():
        return f"kiln's w16gemm kernel: {w16gemm.reason()}"
    return True


def _prepare(step: StepSpec, constants: list[Any], device: torch.device):
    p = qconv_parts(step, constants)  # quantized.py's QConv reading: the weight rule, geometry, output, activation
    if p.x_zero != 0:
        raise ValueError(f"a 16-bit input's zero point {p.x_zero}: W8A16Conv2d splits symmetric int16 / [0, amax] "
                         "uint16")
    # the int32 bias at s_x·s_w as a real one: W8A16Conv2d's two convolutions see the input at 256·s_x and s_x
    real_bias = None if p.bias is None else p.bias.to(torch.float64) * onednn_int8.combined_scales(p.x_scale,
                                                                                                    p.w_scale)

    def build(size: tuple[int, ...]) -> w8a16.W8A16Layer:
        conv = onednn_int8.W8A16Conv2d(p.w, p.w_scale, real_bias, list(size), p.strides, p.pads, p.dilations,
                                       p.groups, p.x_scale, p.x_dtype == torch.int16, *p.activation)
        quantize = None if p.y is None else onednn_int8.ScaledReorder(list(conv.output_size), torch.float32,
                                                                        *p.y, True)
        return w8a16.W8A16Layer(conv, p.x_dtype, p.x_zero, quantize)

    return conv_launch(build, p.tuned, torch.float32)  # the float input, split inside the layer


def _prepare_gemm(step: StepSpec, constants: list[Any], device: torch.device):
    p = qconv_parts(step, constants, byte_pairs=False)  # int16 products: no pair sum saturates, VNNI or not
    if p.x_zero != 0:
        raise ValueError(f"a 16-bit input's zero point {p.x_zero}: w16gemm takes symmetric int16 / [0, amax] uint16")
    real_bias = None if p.bias is None else p.bias.to(torch.float64) * onednn_int8.combined_scales(p.x_scale,
                                                                                                    p.w_scale)

    def build(size: tuple[int, ...]) -> w16gemm.W16Gemm:
        return w16gemm.W16Gemm(p.w, p.w_scale, real_bias, list(size), p.x_scale, p.x_dtype, p.y, *p.activation)

    return conv_launch(build, p.tuned, torch.float32)  # the float input, quantized inside the layer


register(Tactic(
    name="cpu.qconv.w8a16", op_type="QConv", domain="kiln", device="cpu", dtypes=(torch.float32,),
    supports=_supports, configure=_configure, prepare=_prepare, layout="channels_last",
    available=onednn.available, native=True,
    description="a 16-bit input's two bytes (one C pass) through two oneDNN int8 convolutions summed in float32",
))

register(Tactic(
    name="cpu.qconv.w8a16_gemm", op_type="QConv", domain="kiln", device="cpu", dtypes=(torch.float32,),
    supports=_gemm_supports, configure=_configure, prepare=_prepare_gemm, layout="channels_last",
    available=w16gemm.available, native=True,
    description="a 1x1 W8A16 convolution in one C pass: int16 x int8 products in int32 (vpdpwssd), epilogue fused",
))
