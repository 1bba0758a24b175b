"""CPU tactics for the 8-bit values of a Q/DQ graph between its quantized layers (quantized.py): per-tensor
QuantizeLinear / DequantizeLinear, and the ops kept on 8-bit values (kiln::QAdd, kiln/ops/quantized.py; MaxPool).

    cpu.qadd.onednn    kiln::QAdd of same-size operands as one oneDNN binary add on 8-bit tensors
    cpu.qadd.torch     kiln::QAdd in float32 torch ops (any broadcast)
    cpu.pool.onednn_int8.MaxPool   MaxPool on 8-bit values (torch's uint8 max_pool2d fails on NHWC)
    cpu.quantize.onednn / cpu.dequantize.onednn   per-tensor Q / DQ as one scaled oneDNN reorder
    cpu.quantize.native / cpu.dequantize.native   per-tensor Q / DQ of rank 1-3 in kiln's C (elementwise.c), a
                       native-segment member: one pass, ONNX's rounding of x / s (BERT's QDQ model runs ~170)
    cpu.quantize.onednn_per_channel   per-channel (axis 1) Q of a 4-D activation, one zero point, as one oneDNN
                       reorder with per-channel scales, a native-segment member (a float layer's output feeding a
                       depthwise int8 layer: an accuracy target's boundary)
    cpu.quantize.torch_per_channel    the same in torch ops, any zero points, outside segments
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

from kiln.kernels.cpu import elementwise as elementwise_kernels
from kiln.kernels.cpu import onednn, onednn_int8
from kiln.kernels.cpu import transformer as transformer_kernels
from kiln.plan.spec import StepSpec
from kiln.tactics.cpu.native_member import prepared_native, sizes_config
from kiln.tactics.cpu.onednn import _pool_supports
from kiln.tactics.cpu.quantized import _CACHED_SHAPES, _CL, _QUANTIZED, _activation, _built
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, NativeStep, Tactic, resizable, same_primitive
from kiln.tactics.tactic import attribute as _attr


# ---- QAdd --------------------------------------------------------------------------------------

def _qadd_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if len(inputs) < 8 or any(inputs[i].shape is None or not inputs[i].constant for i in (1, 2, 4, 5, 6, 7)):
        return "the scales and zero points (output's included) are not constants of the engine"
    if inputs[3].dtype not in _QUANTIZED or inputs[7].dtype not in _QUANTIZED:
        return "an input or the output is not uint8/int8"
    if _attr(step, "activation", "") not in ("", "Relu", "Clip"):
        return f"activation {_attr(step, 'activation', '')!r}"
    return True


def _prepare_qadd(step: StepSpec, constants: list[Any], device: torch.device):
    ka, kb, offset, low, high, out = _qadd_coefficients(step, constants)
    info = torch.iinfo(out)

    def launch(ctx, a, a_s, a_z, b, *_inputs, **_attributes):
        y = torch.mul(a, ka)  # float32, a's layout
        y.add_(b, alpha=kb).add_(offset)
        if low is not None:
            y.clamp_(low, high)
        return y.round_().clamp_(info.min, info.max).to(out)  # round half to even, saturate

    return launch


register(Tactic(
    name="cpu.qadd.torch", op_type="QAdd", domain="kiln", device="cpu", dtypes=_QUANTIZED,
    supports=_qadd_supports, prepare=_prepare_qadd,
    description="quantized Add in float32 torch ops: r/s_y = k_a·a + k_b·b + offset, rounded and saturated",
))


def _qadd_onednn_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if not onednn.available():
        return "libdnnl.so.3 cannot be loaded"
    base = _qadd_supports(step, inputs)
    if base is not True:
        return base
    a, b = inputs[0], inputs[3]
    if a.shape != b.shape or not 1 <= len(a.shape) <= 4:
        return "the operands' shapes differ (broadcast) or their rank is not 1 to 4"
    return True


def _qadd_coefficients(step: StepSpec, constants: list[Any]) -> tuple[float, float, float, float | None,
                                                                       float | None, torch.dtype]:
    """(k_a, k_b, offset, low, high, output dtype): y = clip(k_a·a + k_b·b + offset, low, high) in output
    units, the activation's bounds (None: the type's) before rounding."""
    a_scale, a_zero, _, b_scale, b_zero, y_scale, y_zero = (c.reshape(()) if c is not None else None
                                                             for c in constants[1:8])
    ka, kb = float(a_scale) / float(y_scale), float(b_scale) / float(y_scale)
    offset = float(y_zero) - ka * float(a_zero) - kb * float(b_zero)
    activation, alpha, beta = _activation(step)
    low = float(y_zero) if activation == "Relu" else alpha / float(y_scale) + float(y_zero) \
        if activation == "Clip" else None
    high = beta / float(y_scale) + float(y_zero) if activation == "Clip" else None
    return ka, kb, offset, low, high, y_zero.dtype


def _prepare_qadd_onednn(step: StepSpec, constants: list[Any], device: torch.device):
    ka, kb, offset, low, high, out = _qadd_coefficients(step, constants)
    primitives: dict = {}
    lock = threading.Lock()

    def built(size: tuple[int, ...], a_dtype: torch.dtype, b_dtype: torch.dtype) -> onednn_int8.QAddBinary:
        key = (tuple(size), a_dtype, b_dtype)
        with lock:
            primitive = primitives.get(key)
            if primitive is None:
                if len(primitives) > _CACHED_SHAPES:
                    primitives.pop(next(iter(primitives)))
                primitive = primitives[key] = onednn_int8.QAddBinary(list(size), a_dtype, b_dtype, out, ka, kb,
                                                                     offset, low, high)
        return primitive

    def launch(ctx, a, a_s, a_z, b, *_inputs, **_attributes):
        layout = _CL if a.dim() == 4 else torch.contiguous_format
        a, b = a.contiguous(memory_format=layout), b.contiguous(memory_format=layout)
        return built(tuple(a.shape), a.dtype, b.dtype)(a, b)

    dtypes = step.tactic_config.get("dtypes")
    if dtypes:  # inside a native segment: b is the binary primitive's "residual", of a's size
        a_dtype, b_dtype = (getattr(torch, d) for d in dtypes)

        @resizable

        def native_at(size: tuple[int, ...]) -> NativeStep:
            primitive = built(tuple(size), a_dtype, b_dtype)
            return NativeStep(tuple(size), tuple(size), same_primitive(primitive), residual_input=3,
                              output_dtype=out, input_dtype=a_dtype, residual_dtype=b_dtype)

        launch.native = native_at(tuple(step.tactic_config["input_size"]))
    return launch


def _qadd_configure(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    return {"input_size": list(inputs[0].shape),
            "dtypes": [str(inputs[i].dtype).removeprefix("torch.") for i in (0, 3)]}


register(Tactic(
    name="cpu.qadd.onednn", op_type="QAdd", domain="kiln", device="cpu", dtypes=_QUANTIZED,
    supports=_qadd_onednn_supports, configure=_qadd_configure, prepare=_prepare_qadd_onednn, layout="channels_last",
    available=onednn.available, native=True,
    description="quantized Add as one oneDNN binary add on 8-bit tensors: scales, offset and activation as attributes",
))


# ---- MaxPool on 8-bit values -------------------------------------------------------------------

def _prepare_max_pool(step: StepSpec, constants: list[Any], device: torch.device):
    kernel = [int(k) for k in _attr(step, "kernel_shape", [])]
    pads = [0, 0, 0, 0] if _attr(step, "auto_pad", "NOTSET") == "VALID" else \
        [int(p) for p in _attr(step, "pads", [0, 0, 0, 0])]
    strides = [int(s) for s in _attr(step, "strides", [1, 1])]
    dilations = [int(d) for d in _attr(step, "dilations", [1, 1])]
    tuned = tuple(step.tactic_config["input_size"])
    dtype = torch.uint8 if step.tactic_config.get("dtype", "uint8") == "uint8" else torch.int8

    def build(size: tuple[int, ...]) -> onednn_int8.MaxPool2d:
        return onednn_int8.MaxPool2d(list(size), dtype, kernel, strides, pads, dilations)

    primitives = {tuned: build(tuned)}
    lock = threading.Lock()

    def launch(ctx, x, *_inputs, **_attributes):
        x = x.contiguous(memory_format=_CL)  # [N, C, H, W], NHWC in memory
        with lock:
            primitive = _built(primitives, tuple(x.shape), build, tuned)
        return primitive(x)

    @resizable

    def native_at(size: tuple[int, ...]) -> NativeStep:
        with lock:
            primitive = _built(primitives, tuple(size), build, tuned)
        return NativeStep(tuple(size), primitive.output_size, same_primitive(primitive),
                          output_dtype=dtype, input_dtype=dtype)

    launch.native = native_at(tuned)
    return launch


def _pool_configure(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    return {"input_size": list(inputs[0].shape), "dtype": str(inputs[0].dtype).removeprefix("torch.")}


register(Tactic(
    name="cpu.pool.onednn_int8.MaxPool", op_type="MaxPool", domain="", device="cpu", dtypes=_QUANTIZED,
    supports=_pool_supports, configure=_pool_configure, prepare=_prepare_max_pool, layout="channels_last",
    available=onednn.available, native=True,
    description="MaxPool on uint8/int8 NHWC values (a Q/DQ pair moved past it) as a oneDNN pooling primitive",
))


# ---- QuantizeLinear / DequantizeLinear per tensor -------------------------------------------------

def _scaled_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if not onednn.available():
        return "libdnnl.so.3 cannot be loaded"
    return _per_tensor_supports(step, inputs)


def _per_tensor_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    """What both per-tensor Q/DQ kernels (oneDNN's scaled reorder, kiln's C) take: rank 1-4, one constant scale and
    8-bit zero point, no blocks, saturating."""
    x = inputs[0]
    if x.shape is None or not 1 <= len(x.shape) <= 4:
        return "only tensors of rank 1 to 4"
    if len(inputs) < 2 or inputs[1].shape is None or not inputs[1].constant or math.prod(inputs[1].shape) != 1:
        return "the scale is not one constant of the engine (per tensor)"
    zero = inputs[2] if len(inputs) > 2 else None
    if zero is None or zero.shape is None or not zero.constant or zero.dtype not in _QUANTIZED:
        return "the zero point is not a uint8/int8 constant of the engine"
    if int(_attr(step, "block_size", 0)) or int(_attr(step, "output_dtype", 0)) not in (0, 2, 3):
        return "blocked quantization or another output type"
    if step.op_type == "QuantizeLinear" and not int(_attr(step, "saturate", 1)):
        return "saturate=0"
    return True


def _scaled_configure(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    return {"input_size": list(inputs[0].shape)}


def _prepare_scaled(step: StepSpec, constants: list[Any], device: torch.device):
    scale, zero = float(constants[1].reshape(-1)[0]), constants[2]
    quantize = step.op_type == "QuantizeLinear"
    src, dst = (torch.float32, zero.dtype) if quantize else (zero.dtype, torch.float32)
    z = int(zero.reshape(-1)[0])
    primitives: dict = {}

    def launch(ctx, x, *_inputs, **_attributes):
        channels_last = x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=_CL)
        if not channels_last:
            x = x.contiguous()
        key = (tuple(x.shape), channels_last)
        with lock:
            primitive = primitives.get(key)
            if primitive is None:
                if len(primitives) > _CACHED_SHAPES:
                    primitives.pop(next(iter(primitives)))
                primitive = primitives[key] = onednn_int8.ScaledReorder(list(x.shape), src, dst, scale, z,
                                                                        channels_last)
        return primitive(x)  # 4-D: channels-last

    @resizable

    def native_at(size: tuple[int, ...]) -> NativeStep:
        # inside a segment a 4-D input is NHWC already (an image is laid out by the segment's own reorder)
        key = (tuple(size), len(size) == 4)
        with lock:
            primitive = primitives.get(key)
            if primitive is None:
                primitive = primitives[key] = onednn_int8.ScaledReorder(list(size), src, dst, scale, z, len(size) == 4)
        return NativeStep(tuple(size), tuple(size), same_primitive(primitive), output_dtype=dst, input_dtype=src)

    lock = threading.Lock()
    launch.native = native_at(tuple(step.tactic_config["input_size"]))
    return launch


for _op, _dtypes in (("QuantizeLinear", (torch.float32,)), ("DequantizeLinear", _QUANTIZED)):
    register(Tactic(
        name=f"cpu.{'quantize' if _op == 'QuantizeLinear' else 'dequantize'}.onednn", op_type=_op, domain="",
        device="cpu", dtypes=_dtypes, supports=_scaled_supports, configure=_scaled_configure,
        prepare=_prepare_scaled, layout="channels_last", available=onednn.available, native=True,
        description=f"{_op} per tensor as one oneDNN reorder with scale/zero-point attributes (NCHW -> NHWC too)",
    ))


def _native_scaled_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if not transformer_kernels.available():
        return f"kiln's C kernels are not built: {transformer_kernels.reason()}"
    found = _per_tensor_supports(step, inputs)
    if isinstance(found, str):
        return found
    if len(inputs[0].shape) > 3:
        return "rank 4: a segment's 4-D values are NHWC in memory (cpu.quantize.onednn lays them out)"
    return True


def _prepare_native_scaled(step: StepSpec, constants: list[Any], device: torch.device):
    scale, zero = float(constants[1].reshape(-1)[0]), constants[2]
    quantize = step.op_type == "QuantizeLinear"
    source = torch.float32 if quantize else zero.dtype
    return prepared_native(step, lambda sizes: {0: source}, lambda sizes: elementwise_kernels.Quantize(
        sizes[0], quantize, scale, int(zero.reshape(-1)[0]), zero.dtype), max_rank=3)


for _op, _dtypes in (("QuantizeLinear", (torch.float32,)), ("DequantizeLinear", _QUANTIZED)):
    register(Tactic(
        name=f"cpu.{'quantize' if _op == 'QuantizeLinear' else 'dequantize'}.native", op_type=_op, domain="",
        device="cpu", dtypes=_dtypes, supports=_native_scaled_supports, configure=sizes_config,
        prepare=_prepare_native_scaled, available=transformer_kernels.available, native=True,
        description=f"{_op} per tensor in kiln's C (one pass, ONNX's rounding), a native-segment member",
    ))


# ---- QuantizeLinear per channel ------------------------------------------------------------------

def _per_channel_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    """A per-channel QuantizeLinear along axis 1 of an activation (a depthwise convolution's input, kiln/quant/qdq.py)
    with constant scales and 8-bit zero points, one per channel."""
    x = inputs[0]
    if x.shape is None or len(x.shape) < 2:
        return "only tensors of rank 2 or more"
    axis = int(_attr(step, "axis", 1))
    if axis not in (1, 1 - len(x.shape)):
        return f"axis {axis}: per channel along axis 1 only"
    if len(inputs) < 3 or any(i is None or i.shape is None or not i.constant for i in inputs[1:3]):
        return "the scales and zero points are not constants of the engine"
    if inputs[1].shape != (x.shape[1],) or inputs[2].shape != (x.shape[1],) or inputs[2].dtype not in _QUANTIZED:
        return "not one scale and one uint8/int8 zero point per channel (axis 1)"
    if int(_attr(step, "block_size", 0)) or int(_attr(step, "output_dtype", 0)) not in (0, 2, 3):
        return "blocked quantization or another output type"
    if not int(_attr(step, "saturate", 1)):
        return "saturate=0"
    return True


def _prepare_per_channel(step: StepSpec, constants: list[Any], device: torch.device):
    scale, zero = constants[1].to(torch.float32), constants[2]
    info = torch.iinfo(zero.dtype)
    zero_point = zero.to(torch.float32)

    def launch(ctx, x, *_inputs, **_attributes):
        if x.dim() == 4:  # NHWC rows of C channels: the scales along the contiguous axis, channels-last out as
            # QConv reads it. MobileNetV2's 4 such steps took 2.0 ms together (bench/results/quantacc4-2026-12-06.md);
            # a [1, C, 1, 1] broadcast over the same NHWC memory times alike standalone (96x112x112, one Zen 4 core:
            # 1.10 ms against these rows' 1.14), not the ~10 ms a commit message said
            n, c, h, w = x.shape
            rows = x.contiguous(memory_format=_CL).permute(0, 2, 3, 1).reshape(-1, c)  # [N·H·W, C], a view
            y = torch.div(rows, scale)  # ONNX: round(x / s) + zero point, half to even, saturated
            y.round_().add_(zero_point).clamp_(info.min, info.max)
            return y.to(zero.dtype).view(n, h, w, c).permute(0, 3, 1, 2)  # [N, C, H, W], NHWC in memory
        shape = [1, -1] + [1] * (x.dim() - 2)  # [1, C, 1, ...]: broadcast along axis 1
        y = torch.div(x, scale.view(shape))
        y.round_().add_(zero_point.view(shape)).clamp_(info.min, info.max)
        return y.to(zero.dtype)

    return launch


register(Tactic(
    name="cpu.quantize.torch_per_channel", op_type="QuantizeLinear", domain="", device="cpu", dtypes=(torch.float32,),
    supports=_per_channel_supports, prepare=_prepare_per_channel, layout="channels_last",
    description="QuantizeLinear per channel (axis 1) in float32 torch ops over NHWC rows: a depthwise "
                "convolution's input written by a float layer (an accuracy target's) is quantized so",
))


def _per_channel_onednn_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if not onednn.available():
        return "libdnnl.so.3 cannot be loaded"
    found = _per_channel_supports(step, inputs)
    if isinstance(found, str):
        return found
    if len(inputs[0].shape) != 4:
        return "only 4-D activations (NCHW, NHWC in memory)"
    return True


def _prepare_per_channel_onednn(step: StepSpec, constants: list[Any], device: torch.device):
    """One oneDNN reorder with one scale per channel (mask 1 << 1): a native-segment member, so that a float layer
    feeding a depthwise int8 layer (an accuracy target's boundary) does not end the segment. oneDNN takes zero
    points per tensor only at execution (a per-channel mask builds, then fails to run: measured, oneDNN 3), so
    channels of different zero points run cpu.quantize.torch_per_channel's torch ops instead, outside segments."""
    scale, zero = constants[1].to(torch.float32).reshape(-1), constants[2].reshape(-1)
    if bool((zero != zero[0]).any()):
        return _prepare_per_channel(step, constants, device)
    z = int(zero[0])
    tuned = tuple(step.tactic_config["input_size"])
    primitives: dict = {}
    lock = threading.Lock()

    def built(size: tuple[int, ...]) -> onednn_int8.ScaledReorder:
        with lock:
            primitive = primitives.get(size)
            if primitive is None:
                if len(primitives) > _CACHED_SHAPES:
                    primitives.pop(next(iter(primitives)))
                primitive = primitives[size] = onednn_int8.ScaledReorder(list(size), torch.float32, zero.dtype,
                                                                         scale, z, True)
        return primitive

    def launch(ctx, x, *_inputs, **_attributes):
        x = x.contiguous(memory_format=_CL)  # [N, C, H, W], NHWC in memory
        return built(tuple(x.shape))(x)

    @resizable

    def native_at(size: tuple[int, ...]) -> NativeStep:
        primitive = built(tuple(size))
        return NativeStep(tuple(size), tuple(size), same_primitive(primitive), output_dtype=zero.dtype)

    launch.native = native_at(tuned)
    return launch


register(Tactic(
    name="cpu.quantize.onednn_per_channel", op_type="QuantizeLinear", domain="", device="cpu",
    dtypes=(torch.float32,), supports=_per_channel_onednn_supports, configure=_scaled_configure,
    prepare=_prepare_per_channel_onednn, layout="channels_last", available=onednn.available, native=True,
    description="QuantizeLinear per channel (axis 1) of a 4-D activation as one oneDNN reorder with per-channel "
                "scales (one zero point), a native-segment member",
))
