"""kiln::QConv with a float input quantized to 16 bits (a W8A16 layer) on oneDNN's int8 convolutions.

    cpu.qconv.w8a16   QConv(x float32; x_scale, x_zero_point of uint16/int16; int8 w, ...): x split into the high
                      and low bytes of its 16-bit value in one pass (kiln/kernels/cpu/split16.c), then two u8·s8
                      convolutions summed in float32 by a post-op (onednn_int8.W8A16Conv2d: each exact in int32),
                      the activation after, the output float32 or requantized to 8 bits (a per-tensor reorder)

Where such a layer comes from: the accuracy target's precision between int8 and float on an int8 CPU build
(kiln/quant/qdq.py insert's `wide`: the layer's input quantize-dequantize pair at 16 bits), fused into a QConv
with a 16-bit source (kiln/passes/fusion/qdq_layers.py) whose QuantizeLinear it then reads itself
(fold_wide_quantize_into_layer): the float tensor is read once, as the float layer before wrote it.

It refuses a signed 16-bit zero point other than 0 and a uint16 one other than 0 (W8A16Conv2d's byte split assumes
the symmetric int16 and the [0, amax] uint16 that qdq.insert makes), and on a CPU without VNNI the weights whose
pair sums can saturate (quantized.py's rule: both bytes are u8 sources).
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.kernels.cpu import onednn, onednn_int8, split16, w8a16
from kiln.plan.spec import StepSpec
from kiln.tactics.cpu.quantized import _activation, _configure, _constants_refusal, _residual_refusal, conv_launch, \
    qconv_parts
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic, conv_operands_refusal
from kiln.tactics.tactic import attribute as _attr

WIDE = (torch.uint16, torch.int16)  # the 16-bit activation types a W8A16 layer reads


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
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
    if not split16.available():
        return f"kiln's split16 kernel: {split16.reason()}"
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


register(Tactic(
    name="cpu.qconv.w8a16", op_type="QConv", domain="kiln", device="cpu", dtypes=(torch.float32,),
    supports=_supports, configure=_configure, prepare=_prepare, layout="channels_last",
    available=onednn.available, native=True,
    description="a 16-bit input's two bytes (one C pass) through two oneDNN int8 convolutions summed in float32",
))
