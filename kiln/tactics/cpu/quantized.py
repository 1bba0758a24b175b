"""CPU tactics for kiln's quantized layers (kiln/ops/quantized.py: QConv, QGemm) on oneDNN.

    cpu.qconv.onednn   kiln::QConv as one oneDNN int8 convolution primitive built at load (u8 source,
                       s8 weights reordered once, scales and zero points as attributes, Relu/Clip as a
                       post-op, the output requantized or float), NHWC activations
    cpu.qgemm.onednn   kiln::QGemm as a oneDNN int8 matmul over the rows of x [..., K]
    cpu.qconv.dequantized / cpu.qgemm.dequantized   the float layer (dequantize, float kernel, quantize)

The 8-bit ops between these layers (QAdd, MaxPool, per-tensor Q/DQ) are qdq.py's.

They refuse what their kernels would get wrong, with the reason (`kiln inspect`): signed sources
(oneDNN shifts them and halves the weights on a CPU without VNNI: thousands of accumulator units
off, measured), weights whose pair sums can saturate vpmaddubsw's int16 on such a CPU (any two
weights of one output channel with |w1| + |w2| > 128: ORT's and PyTorch's `reduce_range` keeps
weights within that), non-zero weight zero points.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kiln.kernels.cpu import onednn, onednn_int8, onednn_primitives
from kiln.kernels.cpu.cpu_features import has_int8_dot_product
from kiln.plan.spec import StepSpec
from kiln.tactics.registry import register
from kiln.tactics.tactic import (InputMeta, NativeStep, Tactic, built_at, conv_geometry, conv_operands_refusal,
                                 resizable, same_primitive)
from kiln.tactics.tactic import attribute as _attr
from kiln.tactics.tactic import tensor_input as _input

_CL = torch.channels_last
_QUANTIZED = (torch.uint8, torch.int8)
_CACHED_SHAPES = 8


def _constants_refusal(inputs: list[InputMeta]) -> str | None:
    """Why a QConv or QGemm cannot run on oneDNN at all: the library, and its quantization parameters and weight
    (inputs 1-5) as constants of the engine; None when they are."""
    if not onednn.available():
        return "libdnnl.so.3 cannot be loaded"
    for i, name in enumerate(("x_scale", "x_zero_point", "w", "w_scale", "w_zero_point"), start=1):
        if i >= len(inputs) or inputs[i].shape is None or not inputs[i].constant:
            return f"{name} is not a constant of the engine"
    if len(inputs) > 9 and inputs[9] is not None and inputs[9].shape is not None and inputs[0].dtype != torch.uint8:
        return "a QGemm with its product quantized (the FP8 chain in its epilogue): CUDA's kernels only"
    return None


def _common(step: StepSpec, inputs: list[InputMeta], w_rank: int) -> bool | str:
    """What QConv and QGemm on oneDNN's int8 primitives both need."""
    if (refusal := _constants_refusal(inputs)) is not None:
        return refusal
    x, w = inputs[0], inputs[3]
    if x.dtype != torch.uint8:
        return (f"source {str(x.dtype).removeprefix('torch.')}: only uint8 (oneDNN's signed sources are inexact "
                "without VNNI; CPU builds make activations uint8)")
    if w.dtype != torch.int8 or len(w.shape) != w_rank:
        return f"the weight is not an int8 {w_rank}-D tensor"
    y_scale = inputs[6] if len(inputs) > 6 else None
    if y_scale is not None and y_scale.shape is not None:
        y_zero = inputs[7] if len(inputs) > 7 else None
        if not y_scale.constant or y_zero is None or not y_zero.constant or y_zero.dtype not in _QUANTIZED:
            return "the output scale and zero point are not uint8/int8 constants of the engine"
    elif int(_attr(step, "output_dtype", 1)) != 1:
        return "a float output other than float32"
    if isinstance(onednn.eltwise_for(*_activation(step)), str):
        return f"activation {_attr(step, 'activation', '')!r} has no oneDNN post-op"
    return True


def _safe_weight(w: torch.Tensor, w_zero: torch.Tensor, byte_pairs: bool = True, groups: int = 1) -> bool | str:
    """byte_pairs: the kernel multiplies u8·s8 pairs (oneDNN's int8 kernels; not w16gemm's int16 products);
    groups: a convolution's (a depthwise one pairs no bytes)."""
    if bool((w_zero != 0).any()):
        return "the weight's zero point is not 0"
    if byte_pairs and not has_int8_dot_product() and onednn_int8.pair_overflow_possible(w, torch.uint8, groups):
        return ("two weights of one output channel sum past 128 in magnitude: vpmaddubsw would saturate on this "
                "CPU without VNNI (quantize weights to 7 bits, reduce_range, for its int8 kernels)")
    return True


def _y(constants: list[Any]) -> tuple[torch.dtype, float, int] | None:
    y_scale = constants[6] if len(constants) > 6 else None
    if y_scale is None:
        return None
    y_zero = constants[7]
    return y_zero.dtype, float(y_scale.reshape(-1)[0]), int(y_zero.reshape(-1)[0])


def _built(cache: dict, key: Any, build: Callable[[Any], Any], tuned: Any) -> Any:
    """built_at with the tuned shape's entry kept, at most _CACHED_SHAPES others."""
    return built_at(cache, key, build, lambda k: k == tuned, _CACHED_SHAPES)


# ---- QConv -------------------------------------------------------------------------------------

def _residual_refusal(inputs: list[InputMeta]) -> str | None:
    """A QConv with a residual (inputs 9-13) is made for CUDA builds only (fusion.CUDA_RULES): oneDNN's
    tactics here do not add it, so they refuse it (the reference op runs it)."""
    return "a residual input: the add fused into the convolution is CUDA's" if _input(inputs, 9) is not None else None


def _qconv_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if (refusal := _residual_refusal(inputs)) is not None:
        return refusal
    common = _common(step, inputs, 4)
    if common is not True:
        return common
    x, w = inputs[0], inputs[3]
    if len(x.shape) != 4:
        return "only 2-D convolutions (4-D input)"
    return conv_operands_refusal(step, x, w) or True


def _qconv_float_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if (refusal := _residual_refusal(inputs) or _constants_refusal(inputs)) is not None:
        return refusal
    x, w = inputs[0], inputs[3]
    if len(x.shape) != 4 or w.dtype not in _QUANTIZED or len(w.shape) != 4:
        return "only 2-D convolutions of an int8/uint8 weight"
    if int(_attr(step, "output_dtype", 1)) != 1 and (len(inputs) <= 6 or inputs[6].shape is None):
        return "a float output other than float32"
    if (refusal := conv_operands_refusal(step, x, w)) is not None:
        return refusal
    if isinstance(onednn.eltwise_for(*_activation(step)), str):
        return f"activation {_attr(step, 'activation', '')!r}"
    return True


def _configure(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    return {"input_size": list(inputs[0].shape)}


def _activation(step: StepSpec) -> tuple[str, float, float]:
    return _attr(step, "activation", ""), float(_attr(step, "alpha", 0.0)), float(_attr(step, "beta", 0.0))


@dataclass(frozen=True)
class QConvParts:
    """What a QConv's int8 oneDNN tactics (cpu.qconv.onednn here, cpu.qconv.w8a16 in w8a16.py) read from its step and
    constants: one reading, so that the two agree on the weight's refusal, the geometry, the output and the
    activation."""

    x_scale: float
    x_zero: int
    x_dtype: torch.dtype  # the activation's quantized type (uint8; uint16/int16 for a W8A16 layer)
    w: torch.Tensor  # int8 [O, C/g, kH, kW]
    w_scale: torch.Tensor
    bias: torch.Tensor | None  # int32 at x_scale·w_scale
    pads: list[int]
    strides: list[int]
    dilations: list[int]
    groups: int
    y: tuple[torch.dtype, float, int] | None  # the output's (dtype, scale, zero point); None: float32
    activation: tuple[str, float, float]
    tuned: tuple[int, ...]  # the input size the tactic was configured for


def qconv_parts(step: StepSpec, constants: list[Any], byte_pairs: bool = True) -> QConvParts:
    """The QConv's parts, its weight checked (_safe_weight: ValueError with the reason)."""
    x_scale, x_zero, w, w_scale, w_zero = constants[1:6]
    groups = int(_attr(step, "group", 1))
    safe = _safe_weight(w, w_zero, byte_pairs, groups)
    if safe is not True:
        raise ValueError(safe)
    pads, strides, dilations = conv_geometry(step, tuple(w.shape))
    return QConvParts(float(x_scale.reshape(-1)[0]), int(x_zero.reshape(-1)[0]), x_zero.dtype, w, w_scale,
                      constants[8] if len(constants) > 8 else None, pads, strides, dilations,
                      groups, _y(constants), _activation(step),
                      tuple(step.tactic_config["input_size"]))


def conv_launch(build: Callable[[tuple[int, ...]], Any], tuned: tuple[int, ...], input_dtype: torch.dtype):
    """A 2-D convolution layer's launch and its `native` (a native-segment member) from `build(input size)` -> an
    object with `__call__(x)`, `output_size`, `out_dtype` and `bind` (onednn_int8.QConv2d, w8a16.W8A16Layer): built
    at the tuned size now, at another on first use (at most _CACHED_SHAPES kept). input_dtype: the dtype of its
    source, which a segment entered at this layer must be given (NativeStep.input_dtype)."""
    layers = {tuned: build(tuned)}
    lock = threading.Lock()

    def launch(ctx, x, *_inputs, **_attributes):
        x = x.contiguous(memory_format=_CL)  # [N, C, H, W], NHWC in memory
        with lock:
            layer = _built(layers, tuple(x.shape), build, tuned)
        return layer(x)  # [N, O, H', W'] channels-last

    @resizable

    def native_at(size: tuple[int, ...]) -> NativeStep:  # inside a native segment (kiln/runtime/native.py)
        with lock:
            layer = _built(layers, tuple(size), build, tuned)
        return NativeStep(tuple(size), layer.output_size, same_primitive(layer), output_dtype=layer.out_dtype,
                          input_dtype=input_dtype)

    launch.native = native_at(tuned)
    return launch


def _prepare_qconv(step: StepSpec, constants: list[Any], device: torch.device):
    p = qconv_parts(step, constants)

    def build(size: tuple[int, ...]) -> onednn_int8.QConv2d:
        return onednn_int8.QConv2d(p.w, p.w_scale, p.bias, list(size), p.strides, p.pads, p.dilations, p.groups,
                                   torch.uint8, p.x_scale, p.x_zero, p.y, *p.activation)

    return conv_launch(build, p.tuned, torch.uint8)  # _common: uint8 sources


register(Tactic(
    name="cpu.qconv.onednn", op_type="QConv", domain="kiln", device="cpu", dtypes=(torch.uint8,),
    supports=_qconv_supports, configure=_configure, prepare=_prepare_qconv, layout="channels_last",
    available=onednn.available, native=True,
    description="oneDNN int8 convolution built at load: u8 source, s8 weights, scales/zero points as attributes",
))


def _dequantized_conv(step: StepSpec, constants: list[Any], device: torch.device):
    """QConv as its float layer: x dequantized, a float32 oneDNN convolution on the dequantized weight
    (what the Q/DQ graph means in float), the result quantized. Where int8 kernels are inexact (weights
    past 7 bits on a CPU without VNNI) or slower, this is what runs."""
    x_scale, x_zero, w, w_scale, w_zero = constants[1:6]
    bias = constants[8] if len(constants) > 8 else None
    pads, strides, dilations = conv_geometry(step, tuple(w.shape))
    groups = int(_attr(step, "group", 1))
    activation, alpha, beta = _activation(step)
    eltwise = onednn.eltwise_for(activation, alpha, beta)
    s_x, z_x = float(x_scale.reshape(-1)[0]), float(x_zero.reshape(-1)[0])
    scale = onednn_int8.combined_scales(s_x, w_scale)  # [O] or scalar, float64
    w_real = ((w.to(torch.float64) - w_zero.to(torch.float64).reshape(-1, 1, 1, 1)) *
              w_scale.to(torch.float64).reshape(-1, 1, 1, 1)).to(torch.float32)
    b_real = None if bias is None else (bias.to(torch.float64) * scale).to(torch.float32)
    y = _y(constants)
    x_dtype = x_zero.dtype
    tuned = tuple(step.tactic_config["input_size"])

    def build(size: tuple[int, ...]) -> tuple:
        # three primitives, three parallel regions: dequantizing reorder, float convolution, quantizing reorder
        # (on a loaded 2-core host every region's barrier may wait out a descheduled thread)
        conv = onednn_primitives.Conv2d(w_real, b_real, list(size), strides, pads, dilations, groups, eltwise,
                                        False, False)
        dequantize = onednn_int8.ScaledReorder(list(size), x_dtype, torch.float32, s_x, int(z_x), True)
        quantize = None if y is None else onednn_int8.ScaledReorder(list(conv.output_size), torch.float32, y[0],
                                                                      y[1], y[2], True)
        return dequantize, conv, quantize

    primitives = {tuned: build(tuned)}
    lock = threading.Lock()

    def launch(ctx, x, *_inputs, **_attributes):
        x = x.contiguous(memory_format=_CL)  # [N, C, H, W] 8-bit, NHWC in memory
        with lock:
            dequantize, conv, quantize = _built(primitives, tuple(x.shape), build, tuned)
            r = conv(dequantize(x))  # float32 NHWC, a view of the float primitives' pooled buffer
            return r.clone() if quantize is None else quantize(r)

    return launch


register(Tactic(
    name="cpu.qconv.dequantized", op_type="QConv", domain="kiln", device="cpu", dtypes=_QUANTIZED,
    supports=_qconv_float_supports, configure=_configure, prepare=_dequantized_conv, layout="channels_last",
    available=onednn.available,
    description="the float layer: dequantize, float32 oneDNN convolution of the dequantized weight, quantize",
))


# ---- QGemm -------------------------------------------------------------------------------------

def _qgemm_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    common = _common(step, inputs, 2)
    if common is not True:
        return common
    x, w = inputs[0], inputs[3]
    if len(x.shape) < 2 or x.shape[-1] != w.shape[1]:
        return f"input {list(x.shape)} does not match the weight [N, K] {list(w.shape)}"
    return True


def _prepare_qgemm(step: StepSpec, constants: list[Any], device: torch.device):
    x_scale, x_zero, w, w_scale, w_zero = constants[1:6]
    safe = _safe_weight(w, w_zero)
    if safe is not True:
        raise ValueError(safe)
    bias = constants[8] if len(constants) > 8 else None
    y = _y(constants)
    activation, alpha, beta = _activation(step)
    n = int(w.shape[0])
    tuned = math.prod(step.tactic_config["input_size"][:-1])

    def build(rows: int) -> onednn_int8.QMatMul:
        return onednn_int8.QMatMul(w, w_scale, bias, rows, torch.uint8, float(x_scale.reshape(-1)[0]),
                                   int(x_zero.reshape(-1)[0]), y, activation, alpha, beta)

    primitives = {tuned: build(tuned)}
    lock = threading.Lock()

    def launch(ctx, x, *_inputs, **_attributes):
        lead = x.shape[:-1]
        rows = math.prod(lead)
        with lock:
            primitive = _built(primitives, rows, build, tuned)
        return primitive(x.reshape(rows, x.shape[-1]).contiguous()).reshape(*lead, n)  # [..., N]

    @resizable

    def native_at(size: tuple[int, ...]) -> NativeStep:  # rows [B, S, K] bound as [B*S, K], as the float gemm
        if len(size) not in (2, 3) or size[-1] != int(w.shape[1]):
            raise ValueError(f"int8 matmul over [..., {int(w.shape[1])}] rows of rank 2 or 3, given {list(size)}")
        with lock:
            primitive = _built(primitives, math.prod(size[:-1]), build, tuned)
        return NativeStep(tuple(size), (*size[:-1], n), same_primitive(primitive),
                          output_dtype=primitive.out_dtype, input_dtype=torch.uint8)

    launch.native = native_at(tuple(step.tactic_config["input_size"]))
    return launch


register(Tactic(
    name="cpu.qgemm.onednn", op_type="QGemm", domain="kiln", device="cpu", dtypes=(torch.uint8,),
    supports=_qgemm_supports, configure=_configure, prepare=_prepare_qgemm, available=onednn.available, native=True,
    description="oneDNN int8 matmul built at load: u8 rows, s8 weights, scales/zero points as attributes",
))


def _qgemm_float_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if (refusal := _constants_refusal(inputs)) is not None:
        return refusal
    x, w = inputs[0], inputs[3]
    if len(w.shape) != 2 or w.dtype not in _QUANTIZED or len(x.shape) < 2 or x.shape[-1] != w.shape[1]:
        return f"input {list(x.shape)} and weight {list(w.shape)} are not [..., K] and an 8-bit [N, K]"
    if int(_attr(step, "output_dtype", 1)) != 1 and (len(inputs) <= 6 or inputs[6].shape is None):
        return "a float output other than float32"
    if isinstance(onednn.eltwise_for(*_activation(step)), str):
        return f"activation {_attr(step, 'activation', '')!r}"
    return True


def _dequantized_gemm(step: StepSpec, constants: list[Any], device: torch.device):
    """QGemm as its float layer: x dequantized, oneDNN's float32 inner product on the dequantized weight,
    the result quantized (weights past 7 bits on a CPU without VNNI; or wherever that is faster)."""
    x_scale, x_zero, w, w_scale, w_zero = constants[1:6]
    bias = constants[8] if len(constants) > 8 else None
    s_x, z_x = float(x_scale.reshape(-1)[0]), float(x_zero.reshape(-1)[0])
    scale = onednn_int8.combined_scales(s_x, w_scale)
    w_real = ((w.to(torch.float64) - w_zero.to(torch.float64).reshape(-1, 1)) *
              w_scale.to(torch.float64).reshape(-1, 1)).to(torch.float32)  # [N, K]
    b_real = None if bias is None else (bias.to(torch.float64) * scale).to(torch.float32)
    eltwise = onednn.eltwise_for(*_activation(step))
    y = _y(constants)
    n, k = int(w.shape[0]), int(w.shape[1])
    tuned = math.prod(step.tactic_config["input_size"][:-1])

    def build(rows: int) -> tuple:  # dequantizing reorder, float inner product, quantizing reorder
        dequantize = onednn_int8.ScaledReorder([rows, k], x_zero.dtype, torch.float32, s_x, int(z_x), False)
        quantize = None if y is None else onednn_int8.ScaledReorder([rows, n], torch.float32, y[0], y[1], y[2],
                                                                      False)
        return dequantize, onednn_primitives.InnerProduct(w_real, b_real, rows, eltwise, False, False), quantize

    primitives = {tuned: build(tuned)}
    lock = threading.Lock()

    def launch(ctx, x, *_inputs, **_attributes):
        lead = x.shape[:-1]
        rows = math.prod(lead)
        with lock:
            dequantize, gemm, quantize = _built(primitives, rows, build, tuned)
            r = gemm(dequantize(x.reshape(rows, k).contiguous()))  # [M, N] float32, a new tensor
            return (r if quantize is None else quantize(r)).reshape(*lead, n)

    return launch


register(Tactic(
    name="cpu.qgemm.dequantized", op_type="QGemm", domain="kiln", device="cpu", dtypes=_QUANTIZED,
    supports=_qgemm_float_supports, configure=_configure, prepare=_dequantized_gemm, available=onednn.available,
    description="the float layer: dequantize, float32 oneDNN inner product of the dequantized weight, quantize",
))
