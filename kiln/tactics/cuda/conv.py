"""CUDA convolution tactics on kiln's Triton implicit-GEMM kernel (kiln/kernels/cuda/triton/conv.py).

    cuda.conv.triton_igemm.<BMxBNxBK>   kiln::FusedConv 2-D, groups 1, fp16/bf16, NHWC in and out; bias,
                                        activation and residual applied to the tile before its one store

One tactic per tile config (conv.CONV_CONFIGS), tried from the builder opt level in _LEVELS,
like the Triton GEMM configs in kiln/tactics/cuda/library.py: the autotuner checks each against the op
and times it on the layer's real shape. layout "channels_last": the tactic is timed on NHWC
input, the layout its cuDNN neighbours (cuda.conv.channels_last*) hand it, and its output is
NHWC. The weight is repacked once, at prepare, to the [KH·KW·Cin, Cout] matrix the kernel reads.

fp32 layers are left to cuDNN: without TF32 the kernel's fp32 product runs on CUDA cores
(tl.dot "ieee"), which cannot beat cuDNN's; the kernel itself takes fp32 (tests use it).
Triton is imported when a tactic is prepared, not here (a CPU-only deployment imports the
registry's device modules without the `triton` package). Nothing in a launch waits on the host:
pads and output sizes are host arithmetic on shapes.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from kiln.ops.nn import _conv_params
from kiln.plan.spec import StepSpec
from kiln.tactics.cuda.library import _conv_supports, _epilogue_args, _same_dtype, padded_tile, triton_available
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic
from kiln.tactics.tactic import attribute as _attr
from kiln.tactics.tactic import tensor_input as _input

_HALF = (torch.float16, torch.bfloat16)
_CL = torch.channels_last
# (block_m, block_n, block_k, num_warps, num_stages) -> the opt level it is tried from. The same
# tiles as conv.CONV_CONFIGS, written out so that registering does not import triton.
# From opt_level 3, not 2, until the H200 shows one winning a layer of a default build: cuDNN's
# fused graph (cuda.conv.cudnn_fused) already wins ResNet-50 there, and each config compiles a
# kernel per layer kind (taps, epilogue, specialised strides/pads) — seconds of build time each.
_LEVELS = {
    (128, 128, 64, 8, 3): 3,  # batch 256, Cout >= 128
    (128, 64, 64, 4, 4): 3,  # Cout = 64 (ResNet's first stage)
    (64, 64, 64, 4, 4): 3,  # batch 1: M = 49 .. 3136
    (256, 128, 64, 8, 3): 4,
    (64, 128, 32, 4, 4): 4,
}


def _conv() -> ModuleType:
    """kiln.kernels.cuda.triton.conv, imported on first use (it imports triton)."""
    return importlib.import_module("kiln.kernels.cuda.triton.conv")


def _output_size(size: int, kernel: int, stride: int, pad_begin: int, pad_end: int, dilation: int) -> int:
    return (size + pad_begin + pad_end - dilation * (kernel - 1) - 1) // stride + 1  # as conv.output_size


def _geometry(step: StepSpec, x: Any, kernel: list[int]) -> tuple[list[int], list[int], list[int]]:
    """strides, dilations, pads (ONNX order: top, left, bottom, right) of the layer for x (a tensor, real
    or meta: only its shape is read), auto_pad resolved."""
    return _conv_params(x, kernel, _attr(step, "auto_pad", "NOTSET"), _attr(step, "dilations", None),
                        _attr(step, "pads", None), _attr(step, "strides", None))


def _igemm_tactic(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int, level: int) -> Tactic:
    name = f"cuda.conv.triton_igemm.{block_m}x{block_n}x{block_k}"

    def supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
        common = _conv_supports(step, inputs, epilogue_kernel=True)  # 2-D, constant weight, epilogue, residual
        if common is not True:
            return common
        if int(_attr(step, "group", 1)) != 1:
            return f"group {_attr(step, 'group', 1)}: the implicit GEMM reduces over all input channels"
        residual_dtype = _same_dtype(inputs, (3,), "residual input")
        if residual_dtype is not True:
            return residual_dtype
        x, w = inputs[0], _input(inputs, 1)
        if x.shape[1] != w.shape[1]:
            return f"x has {x.shape[1]} channels, the weight takes {w.shape[1]}"
        kernel = list(_attr(step, "kernel_shape", w.shape[2:]))
        if kernel != list(w.shape[2:]):
            return f"kernel_shape {kernel} differs from the weight's {list(w.shape[2:])}"
        strides, dilations, pads = _geometry(step, torch.empty(x.shape, device="meta"), kernel)
        ho = _output_size(x.shape[2], kernel[0], strides[0], pads[0], pads[2], dilations[0])
        wo = _output_size(x.shape[3], kernel[1], strides[1], pads[1], pads[3], dilations[1])
        if ho <= 0 or wo <= 0:
            return "the kernel does not fit the padded input"
        rows = x.shape[0] * ho * wo
        if padded_tile(block_m, rows):
            return f"{block_m}-pixel tiles for {rows} output pixels: mostly padding"
        if padded_tile(block_n, w.shape[0]):
            return f"{block_n}-channel tiles for {w.shape[0]} output channels: mostly padding"
        return True

    def prepare(step: StepSpec, constants: list[Any], device: torch.device):
        conv = _conv()
        config = conv.ConvConfig(block_m, block_n, block_k, num_warps=num_warps, num_stages=num_stages)
        weight = constants[1]
        kernel = tuple(int(k) for k in weight.shape[2:])
        w_packed = conv.pack_weight(weight.to(device))  # [KH·KW·Cin, Cout], once per layer
        epilogue = _epilogue_args(step, 0)  # FusedConv adds its residual before the activation by default

        def launch(ctx, x, w=None, b=None, residual=None, **_attributes):
            strides, dilations, pads = _geometry(step, x, list(kernel))  # host arithmetic on x's shape
            x = x.contiguous(memory_format=_CL)  # no copy when it already is NHWC (as it was timed)
            return conv.conv2d(x, w_packed, kernel, b, residual, strides=tuple(strides), pads=tuple(pads),
                               dilations=tuple(dilations), config=config, **epilogue)

        return launch

    return Tactic(
        name=name, op_type="FusedConv", domain="kiln", device="cuda", dtypes=_HALF, supports=supports,
        prepare=prepare, layout="channels_last", level=level, available=triton_available,
        description=f"Triton implicit-GEMM convolution (NHWC, no im2col buffer), {block_m}x{block_n}x{block_k} "
                    f"tiles, {num_warps} warps, {num_stages} stages, bias/activation/residual fused in the epilogue",
    )


for _config, _level in _LEVELS.items():
    register(_igemm_tactic(*_config, level=_level))
