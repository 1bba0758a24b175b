"""CUDA pooling tactics on channels-last activations: kiln's Triton kernels (kiln/kernels/cuda/triton/pool.py).

    cuda.pool.max.triton                            MaxPool 2-D (values only), NHWC in, NHWC out
    cuda.pool.avg.triton                            AveragePool 2-D, NHWC in, NHWC out
    cuda.reduce_mean_hw.triton                      ReduceMean over axes (2, 3) of a 4-D tensor, fp32 sum
    cuda.reduce_mean_hw.triton.global_average_pool  GlobalAveragePool of a 4-D tensor, the same kernel

All four declare layout "channels_last": in a ResNet/MobileNet the pool sits between NHWC
convolutions (cuda.conv.channels_last*), so the autotuner times it on NHWC input and the pooled
output is allocated NHWC — no layout conversion on either side. The kernels read any strides,
so a layer handed NCHW input is still correct, only slower.

Triton is imported when a tactic is prepared, not here (a CPU-only deployment imports the
registry's device modules without the `triton` package). Nothing in a launch waits on the host:
the window geometry is host arithmetic on shapes, and the ReduceMean axes are read once, at prepare.
"""

from __future__ import annotations

import importlib
import math
from types import ModuleType
from typing import Any

import torch

from kiln.plan.spec import StepSpec
from kiln.tactics.cuda.library import triton_available
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic
from kiln.tactics.tactic import attribute as _attr

_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
# Window taps are unrolled at compile time (tl.static_range); beyond this a kernel per shape
# compiles slowly and spills, and such windows (whole-image averages) are global pools anyway.
MAX_TAPS = 64


def _pool() -> ModuleType:
    """kiln.kernels.cuda.triton.pool, imported on first use (it imports triton)."""
    return importlib.import_module("kiln.kernels.cuda.triton.pool")


def _four_d(inputs: list[InputMeta]) -> bool | str:
    x = inputs[0]
    if x.shape is None or len(x.shape) != 4:
        return f"input of shape {list(x.shape or [])} is not 4-D [N, C, H, W]: only 2-D pooling is written"
    return True


# ---- windowed pools ----------------------------------------------------------------------------

def _window(step: StepSpec) -> dict[str, Any]:
    """The pooling attributes as the kernels take them."""
    strides, pads, dilations = (_attr(step, k, None) for k in ("strides", "pads", "dilations"))
    return {"kernel": [int(k) for k in _attr(step, "kernel_shape", [])],
            "strides": [int(s) for s in strides] if strides else None,
            "pads": [int(p) for p in pads] if pads else None,
            "dilations": [int(d) for d in dilations] if dilations else None,
            "ceil_mode": bool(_attr(step, "ceil_mode", 0)), "auto_pad": str(_attr(step, "auto_pad", "NOTSET"))}


def _window_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    four_d = _four_d(inputs)
    if four_d is not True:
        return four_d
    if len(step.outputs) > 1:  # even an unused slot: the reference then returns (values, indices)
        return "MaxPool's Indices output is part of the layer: the Triton kernel computes values only"
    window = _window(step)
    kernel = window["kernel"]
    if len(kernel) != 2:
        return f"kernel_shape {kernel} is not 2-D"
    if math.prod(kernel) > MAX_TAPS:
        return f"a {kernel[0]}x{kernel[1]} window has more than the {MAX_TAPS} taps the kernel unrolls"
    for name in ("strides", "dilations"):
        if window[name] is not None and (len(window[name]) != 2 or min(window[name]) < 1):
            return f"{name} {window[name]} are not two positive values"
    if window["pads"] is not None and (len(window["pads"]) != 4 or min(window["pads"]) < 0):
        return f"pads {window['pads']} are not four non-negative values"
    from kiln.ops.nn import _pool_geometry  # the reference's geometry: the output the kernel must give
    meta = torch.empty(inputs[0].shape, device="meta")
    try:
        outs, *_ = _pool_geometry(meta, kernel, window["auto_pad"], int(window["ceil_mode"]), window["dilations"],
                                  window["pads"], window["strides"])
    except (ValueError, TypeError, ZeroDivisionError) as e:
        return f"the window geometry does not resolve: {e}"
    if min(outs) <= 0:
        return f"the {kernel} window gives an empty output {outs} for input {list(inputs[0].shape)}"
    return True


def _prepare_max_pool(step: StepSpec, constants: list[Any], device: torch.device):
    max_pool2d = _pool().max_pool2d
    window = _window(step)

    def launch(ctx, x, **_attributes):
        return max_pool2d(x, **window)  # [N, C, OH, OW], channels-last

    return launch


def _prepare_avg_pool(step: StepSpec, constants: list[Any], device: torch.device):
    avg_pool2d = _pool().avg_pool2d
    window = _window(step) | {"count_include_pad": bool(_attr(step, "count_include_pad", 0))}

    def launch(ctx, x, **_attributes):
        return avg_pool2d(x, **window)  # [N, C, OH, OW], channels-last, fp32 sum and divisor

    return launch


register(Tactic(
    name="cuda.pool.max.triton", op_type="MaxPool", domain="", device="cuda", dtypes=_FLOAT + (torch.int8, torch.uint8),
    supports=_window_supports, prepare=_prepare_max_pool, layout="channels_last", available=triton_available,
    description="Triton MaxPool 2-D on NHWC: a program per output-pixel block x channel block, taps unrolled, "
                "NaN-propagating max, NHWC output",
))
register(Tactic(
    name="cuda.pool.avg.triton", op_type="AveragePool", domain="", device="cuda", dtypes=_FLOAT,
    supports=_window_supports, prepare=_prepare_avg_pool, layout="channels_last", available=triton_available,
    description="Triton AveragePool 2-D on NHWC: fp32 sum, ONNX divisor (count_include_pad, ceil_mode tail), "
                "NHWC output",
))


# ---- the global mean over H, W -----------------------------------------------------------------

def _spatial_not_empty(inputs: list[InputMeta]) -> bool | str:
    h, w = inputs[0].shape[2:]
    return True if h * w > 0 else f"empty spatial dims {h}x{w} (the mean of nothing is NaN: the default's case)"


def _norm_axes(axes: list[int]) -> list[int]:
    return sorted({a + 4 if a < 0 else a for a in axes})


def _reduce_mean_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    four_d = _four_d(inputs)
    if four_d is not True:
        return four_d
    axes_input = inputs[1] if len(inputs) > 1 and inputs[1].shape is not None else None
    if axes_input is not None:
        # Opset 18+: the axes are an input. Its values are only known at prepare, which refuses
        # anything but (2, 3); here we check what the metadata can tell.
        if not axes_input.constant:
            return "the axes input is computed at run time, not a constant of the engine"
        if tuple(axes_input.shape) != (2,):
            return f"the axes input has shape {list(axes_input.shape)}, not two axes (H, W)"
    else:
        axes = _attr(step, "axes", None)
        if not axes:
            return "no axes: the mean is over every axis, not H, W"
        if _norm_axes([int(a) for a in axes]) != [2, 3]:
            return f"axes {list(axes)} are not (2, 3): the kernel reduces H and W"
    return _spatial_not_empty(inputs)


def _prepare_reduce_mean(step: StepSpec, constants: list[Any], device: torch.device):
    mean_hw = _pool().mean_hw
    axes_value = constants[1] if len(constants) > 1 else None
    if len(step.inputs) > 1 and step.inputs[1]:
        if axes_value is None:
            raise ValueError("the axes input is not a constant of the engine")
        axes = [int(a) for a in torch.as_tensor(axes_value).reshape(-1).tolist()]  # at load, never in a launch
    else:
        axes = [int(a) for a in _attr(step, "axes", [])]
    if _norm_axes(axes) != [2, 3]:
        raise ValueError(f"axes {axes} are not (2, 3): the kernel reduces H and W of a 4-D tensor")
    keepdims = bool(_attr(step, "keepdims", 1))

    def launch(ctx, x, axes_input=None, **_attributes):
        return mean_hw(x, keepdims)  # [N, C, 1, 1] or [N, C]

    return launch


def _global_average_pool_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    four_d = _four_d(inputs)
    return _spatial_not_empty(inputs) if four_d is True else four_d


def _prepare_global_average_pool(step: StepSpec, constants: list[Any], device: torch.device):
    mean_hw = _pool().mean_hw

    def launch(ctx, x, **_attributes):
        return mean_hw(x, True)  # [N, C, 1, 1]

    return launch


register(Tactic(
    name="cuda.reduce_mean_hw.triton", op_type="ReduceMean", domain="", device="cuda", dtypes=_FLOAT,
    supports=_reduce_mean_supports, prepare=_prepare_reduce_mean, layout="channels_last",
    available=triton_available,
    description="Triton mean over H, W of a 4-D tensor (NHWC: channels contiguous), fp32 sum, one kernel",
))
register(Tactic(
    name="cuda.reduce_mean_hw.triton.global_average_pool", op_type="GlobalAveragePool", domain="", device="cuda",
    dtypes=_FLOAT, supports=_global_average_pool_supports, prepare=_prepare_global_average_pool,
    layout="channels_last", available=triton_available,
    description="Triton mean over H, W of a 4-D tensor (NHWC: channels contiguous), fp32 sum, one kernel",
))
