"""kiln::QConv on kiln's own int8 kernels.

    cpu.qconv.kiln_i8   a 1x1 convolution at stride 1 with no padding as kiln's int8 GEMM (kiln/kernels/cpu/i8gemm.c):
                        an NHWC activation [N, C, H, W] is the row-major matrix [N·H·W, C], so the layer is
                        [N·H·W, C] x [C, O] with the zero point, bias, scale, Relu/Clip and the requantization fused
                        on the int32 sums; NHWC out; runnable inside native segments
    cpu.qconv.kiln_dw   a depthwise KxK convolution (K <= 8, any stride and padding) in kiln's C
                        (kiln/kernels/cpu/qdepthwise.c): bytes widened to float32, exact integer sums, the zero point,
                        bias, scale, Relu/Clip and requantization in the same pass; NHWC; a native-segment member

Why: on AVX2 without VNNI oneDNN's int8 1x1 convolutions ran MobileNetV2's expand layers at 0.86x its fp32 ones
(16->96 at 112², bench/results/quant-cpu-2026-12-07.md) while i8gemm.c runs GEMMs at 92-95% of the core's u8s8
ceiling (bench/results/int8-gemm-avx2-2026-12-07.md). A candidate beside cpu.qconv.onednn and cpu.qconv.dequantized:
the tuner times them per layer and keeps the fastest (bench/results/int8-mnv2-avx2-2026-12-07.md). Likewise oneDNN's
int8 depthwise convolutions, 1.27-1.89x its float ones there: qdepthwise.c runs the float kernel's FMAs on a quarter of
its input bytes.

Refused with the reason: kernels other than 1x1, strides, padding, groups; a weight whose adjacent pairs (input
channels 2j, 2j + 1 of one output channel) could saturate vpmaddubsw (|w1| + |w2| > 128; i8gemm.weight_refusal, at
prepare: 7-bit weights, reduce_range, always pass); a non-zero weight zero point; a per-channel input scale; a residual
(CUDA's fused add). The depthwise kernel takes any int8 weight (its float sums are exact), refuses dilations, kernels
past 8 taps a side and activations other than Relu/Clip.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from kiln.kernels.cpu import i8gemm, qdepthwise
from kiln.plan.spec import StepSpec
from kiln.tactics.cpu.qgemm_kiln import scales_refusal
from kiln.tactics.cpu.quantized import (_built, _configure, _constants_refusal, _residual_refusal, conv_launch,
                                        qconv_parts)
from kiln.tactics.registry import register
from kiln.tactics.tactic import (InputMeta, NativeStep, PlanRule, SizedPlan, Tactic, conv_geometry, resizable,
                                 same_primitive)
from kiln.tactics.tactic import attribute as _attr

_CL = torch.channels_last


def _pointwise_refusal(step: StepSpec, w_shape: tuple[int, ...]) -> str | None:
    """Why the QConv is not a 1x1 convolution at stride 1 without padding (the GEMM its NHWC rows are), or None."""
    if int(_attr(step, "group", 1)) != 1:
        return f"{int(_attr(step, 'group', 1))} groups: a 1x1 convolution of one group only"
    if tuple(w_shape[2:]) != (1, 1):
        return f"kernel {list(w_shape[2:])}: 1x1 only (the rows of an NHWC activation)"
    pads, strides, _dilations = conv_geometry(step, tuple(w_shape))
    if any(p != 0 for p in pads) or any(s != 1 for s in strides):
        return f"pads {list(pads)}, strides {list(strides)}: stride 1 without padding only"
    return None


def _operands_refusal(step: StepSpec, inputs: list[InputMeta], activations: dict[str, int]) -> str | None:
    """Why kiln's int8 kernels cannot take this QConv's operands whatever its geometry: an 8-bit source quantized
    per tensor, an int8 4-D weight, the output quantized per tensor (or float32), one of `activations`; or None."""
    if (refusal := _residual_refusal(inputs) or _constants_refusal(inputs)) is not None:
        return refusal
    x, w = inputs[0], inputs[3]
    if x.dtype not in i8gemm.SOURCES:
        return f"source {str(x.dtype).removeprefix('torch.')}: uint8/int8 only"
    if w.dtype != torch.int8 or len(w.shape) != 4 or len(x.shape) != 4:
        return "only 2-D convolutions (4-D input) of an int8 weight"
    if (refusal := scales_refusal(step, inputs)) is not None:
        return refusal
    if _attr(step, "activation", "") not in activations:
        return f"activation {_attr(step, 'activation', '')!r}: the kernel applies {sorted(activations)}"
    return None


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if (refusal := _operands_refusal(step, inputs, i8gemm.ACTIVATIONS)) is not None:
        return refusal
    x, w = inputs[0], inputs[3]
    if (refusal := _pointwise_refusal(step, tuple(w.shape))) is not None:
        return refusal
    if x.shape[1] != w.shape[1]:
        return f"input {list(x.shape)} does not match the weight {list(w.shape)}"
    if not i8gemm.available():
        return f"kiln's i8gemm kernel: {i8gemm.reason()}"
    if not i8gemm.vector_products():
        return "kiln's i8gemm kernel was compiled without AVX2 (its plain C form is for tests)"
    return True


def _prepare(step: StepSpec, constants: list[Any], device: torch.device):
    p = qconv_parts(step, constants, byte_pairs=False)  # the weight's zero point; its pairs: i8gemm's own check
    if (refusal := i8gemm.weight_refusal(p.w.reshape(p.w.shape[0], -1))) is not None:
        raise ValueError(refusal)
    o, c = int(p.w.shape[0]), int(p.w.shape[1])
    n, _c, h, wd = p.tuned
    first = i8gemm.I8Gemm(p.w.reshape(o, c), p.w_scale, p.bias, n * h * wd, p.x_dtype, p.x_scale, p.x_zero, p.y,
                          *p.activation)
    layers = {p.tuned: first}
    lock = threading.Lock()

    def build(size: tuple[int, ...]) -> i8gemm.I8Gemm:
        rows = rows_of(size)
        return first.at_rows(rows)  # the packed weight shared: another size costs a plan

    def rows_of(size: tuple[int, ...]) -> int:
        if len(size) != 4 or size[1] != c:
            raise ValueError(f"a 1x1 int8 convolution of {c} input channels, given {list(size)}")
        return int(size[0]) * int(size[2]) * int(size[3])

    def sized(size: tuple[int, ...]) -> SizedPlan:  # a segment's view at other sizes: the plan's row fields
        return SizedPlan(((size[0], o, size[2], size[3]),), first.row_fields(rows_of(size)))

    plan_rule = PlanRule(sized, ("kiln_i8 1x1", c, o, first.wanted_threads))  # NCHW sizes, not QGemm's rows

    def launch(ctx, x, *_inputs, **_attributes):
        if x.dtype != p.x_dtype:
            raise ValueError(f"a 1x1 int8 convolution of {p.x_dtype} rows, given {x.dtype}")
        x = x.contiguous(memory_format=_CL)  # [N, C, H, W], NHWC in memory: rows [N·H·W, C]
        with lock:
            layer = _built(layers, tuple(x.shape), build, p.tuned)
        nb, _, hb, wb = x.shape
        # [N, O, H, W] channels-last: the GEMM's [N·H·W, O] rows
        y = torch.empty_strided((nb, o, hb, wb), (hb * wb * o, 1, wb * o, o), dtype=layer.out_dtype)
        layer.run_into(x.data_ptr(), y.data_ptr())
        return y

    @resizable

    def native_at(size: tuple[int, ...]) -> NativeStep:  # NHWC in and out: the rows the GEMM reads and writes
        with lock:
            layer = _built(layers, tuple(size), build, p.tuned)
        return NativeStep(tuple(size), (size[0], o, size[2], size[3]), same_primitive(layer),
                          output_dtype=layer.out_dtype, input_dtype=p.x_dtype, plan_at=plan_rule)

    launch.native = native_at(p.tuned)
    return launch


register(Tactic(
    name="cpu.qconv.kiln_i8", op_type="QConv", domain="kiln", device="cpu", dtypes=i8gemm.SOURCES,
    supports=_supports, configure=_configure, prepare=_prepare, layout="channels_last",
    available=i8gemm.available, native=True,
    description="a 1x1 QConv as kiln's AVX2 int8 GEMM on its NHWC rows: vpmaddubsw pair sums, requantize fused",
))


# ---- depthwise ---------------------------------------------------------------------------------

def _depthwise_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if (refusal := _operands_refusal(step, inputs, qdepthwise.ACTIVATIONS)) is not None:
        return refusal
    x, w = inputs[0], inputs[3]
    pads, strides, dilations = conv_geometry(step, tuple(w.shape))
    if (refusal := qdepthwise.refusal(tuple(w.shape), tuple(x.shape), int(_attr(step, "group", 1)), pads, strides,
                                      dilations)) is not None:
        return refusal
    if not qdepthwise.available():
        return f"kiln's int8 depthwise kernel is not built: {qdepthwise.reason()}"
    return True


def _prepare_depthwise(step: StepSpec, constants: list[Any], device: torch.device):
    p = qconv_parts(step, constants, byte_pairs=False)  # no byte pairs: any int8 weight is exact

    def build(size: tuple[int, ...]) -> qdepthwise.QDepthwiseConv:
        return qdepthwise.QDepthwiseConv(p.w, p.w_scale, p.bias, size, p.strides, p.pads, p.x_dtype, p.x_scale,
                                         p.x_zero, p.y, *p.activation, dilations=p.dilations)

    return conv_launch(build, p.tuned, p.x_dtype)


register(Tactic(
    name="cpu.qconv.kiln_dw", op_type="QConv", domain="kiln", device="cpu", dtypes=qdepthwise.SOURCES,
    supports=_depthwise_supports, configure=_configure, prepare=_prepare_depthwise, layout="channels_last",
    available=qdepthwise.available, native=True,
    description="an 8-bit depthwise KxK QConv in kiln's C: bytes widened to float32 FMAs (exact integer sums), "
                "requantize fused, NHWC, a native-segment member",
))
