"""CUDA tactics for kiln::QConv (kiln/ops/quantized.py): INT8/FP8 convolutions with the requantizing epilogue.

    cuda.qconv.triton_igemm.<BMxBNxBK>   Triton implicit-GEMM convolution of int8 (int32 accumulator) or
                                         float8e4m3fn (fp32) NHWC activations, 2-D, groups 1; zero point,
                                         bias, per-channel scale, Relu/Clip and requantization on the tile
    cuda.qconv.triton_igemm.<tile>.space_to_depth
                                         the same kernel on a stride-2 stem of <= 4 channels (ResNet's 7x7/2
                                         on RGB) folded by space-to-depth into a dense 4x4/1 GEMM (qstem.py)
    cuda.qconv.dequantized               the float layer in fp16: x dequantized in one pass (channels-last),
                                         cuDNN fp16 convolution on the dequantized weight, one Triton pass
                                         for bias (fp32), activation and requantization. Any rank, any groups
                                         (depthwise included): what runs where the Triton kernel does not
    cuda.qconv.dequantized_fp32          the same in fp32 with TF32 off, for layers whose values fp16 cannot
                                         hold to one output step (large scales, wide sums)

A QConv whose x is float (the image's QuantizeLinear folded into the stem, kiln/passes/fusion/qdq_layers.py) runs on
every tactic here: the space-to-depth stem quantizes as it folds the image (one pass), the others run the quantize
kernel first (cuda.quantize.triton's, the two steps the graph had).

A QConv with a residual (inputs 9-13, made on CUDA builds by kiln/passes/fusion/qdq_residual.py; INT8 or FP8)
runs on every tactic here: the Triton kernel adds it in its epilogue, or (cuda.qconv.triton_igemm.<tile>.then_qadd)
writes the convolution's own 8-bit result and runs the QAdd kernel on it: the unfused pair, timed against
the fused epilogue; the dequantized tactics write it from a float convolution, then the QAdd kernel. Each
rounds c within a step and the sum within a step of what it makes of c: such a layer is judged by the unfused
pair's tolerance (Tactic.checker = quant_residual_check.residual_layer_checker), not by one step of the sum.

All are timed by the autotuner against the op's reference and each other (issue 12's H200 numbers:
no 8-bit convolution is assumed faster than FP16). layout "channels_last": timed on NHWC input, the
layout its neighbours hand it; outputs are NHWC. Every parameter is read at prepare: launches do
host arithmetic on shapes only, and run inside captured CUDA graphs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kiln.ops.nn import _conv, _conv_params
from kiln.ops.quantized import FLOAT_INPUTS
from kiln.plan.spec import StepSpec
from kiln.tactics.cuda.library import padded_tile
from kiln.tactics.cuda.quant_common import FP8, QUANTIZED, QuantizedLayer, Residual, check_layer, check_residual, \
    kernels, name_of, triton_available
from kiln.tactics.cuda.quant_residual_check import residual_layer_checker
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic
from kiln.tactics.tactic import attribute as _attr

_CL = torch.channels_last


def _geometry(step: StepSpec, x: Any, kernel: list[int]) -> tuple[list[int], list[int], list[int]]:
    """strides, dilations, pads (ONNX order) for x (real or meta: only its shape is read), auto_pad resolved."""
    return _conv_params(x, kernel, _attr(step, "auto_pad", "NOTSET"), _attr(step, "dilations", None),
                        _attr(step, "pads", None), _attr(step, "strides", None))


def _output_size(size: int, kernel: int, stride: int, pad_begin: int, pad_end: int, dilation: int) -> int:
    return (size + pad_begin + pad_end - dilation * (kernel - 1) - 1) // stride + 1


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    """Any 1-D to 3-D QConv with constant parameters (the dequantized tactics)."""
    x = inputs[0]
    if x.shape is None or not 3 <= len(x.shape) <= 5:
        return "x is not the input of a 1-D to 3-D convolution"
    common = check_layer(step, inputs, len(x.shape))
    if common is not True:
        return common
    residual = check_residual(step, inputs)
    if residual is not True:
        return residual
    if len(inputs) > 9 and inputs[9].shape is not None and len(x.shape) != 4:
        return "a residual add of a convolution other than 2-D (the QAdd kernel walks 4-D)"
    w, groups = inputs[3], int(_attr(step, "group", 1))
    if x.shape[1] != w.shape[1] * groups or w.shape[0] % groups:
        return f"channels {x.shape[1]} do not match the weight {list(w.shape)} in {groups} groups"
    return True


def _as_quantized(inputs: list[InputMeta]) -> list[InputMeta] | str:
    """inputs with a float x seen as the 8-bit tensor its folded QuantizeLinear makes (x_zero_point's type), or
    why the layer's quantization cannot be run here."""
    x, zero = inputs[0], inputs[2] if len(inputs) > 2 else None
    if x.dtype not in FLOAT_INPUTS:
        return inputs
    if zero is None or zero.dtype not in (torch.int8, torch.uint8):
        return f"a float x quantized to {name_of(zero.dtype) if zero else 'nothing'}: the folded quantization " \
               "is int8 / uint8"
    return [dataclasses.replace(x, dtype=zero.dtype), *inputs[1:]]


def _reading_float(tactic: Tactic) -> Tactic:
    """`tactic` also for a QConv of float x (module docstring): its launch runs the quantize kernel on x first,
    QuantizeLinear's arithmetic exactly (kiln/kernels/cuda/triton/qelementwise.py), then the 8-bit layer."""
    def supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
        quantized = _as_quantized(inputs)
        return quantized if isinstance(quantized, str) else tactic.supports(step, quantized)

    def prepare(step: StepSpec, constants: list[Any], device: torch.device):
        launch = tactic.prepare(step, constants, device)
        quantize = kernels("qelementwise").quantize
        scale, zero = float(constants[1].reshape(-1)[0]), float(constants[2].reshape(-1)[0].to(torch.float32))
        dtype = constants[2].dtype

        def launch_quantized(ctx, x, *inputs, **attributes):
            if x.dtype in FLOAT_INPUTS:
                x = quantize(x, scale, zero, dtype)  # x's layout
            return launch(ctx, x, *inputs, **attributes)

        return launch_quantized

    return dataclasses.replace(tactic, dtypes=tactic.dtypes + FLOAT_INPUTS, supports=supports, prepare=prepare)


@dataclass(frozen=True)
class IgemmTile:
    """One config of the Triton kernel (its QConvConfig, built at prepare: the kernel module imports triton)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    mma_f16: bool = False  # int8 layers on fp16 tensor cores (fp32 accumulator: wgmma kept in flight)
    fp8_fast_accumulation: bool = False  # FP8: Hopper's own accumulation, no fp32 promotion every K step
    persistent: int = 0  # 1x1 stride-1 layers: that many programs per SM walking the tiles

    @property
    def name(self) -> str:
        flags = [f for f, on in (("int8_on_fp16", self.mma_f16), ("fp8_fast_acc", self.fp8_fast_accumulation),
                                 (f"persistent{self.persistent}", self.persistent)) if on]
        tile = f"{self.block_m}x{self.block_n}x{self.block_k}w{self.num_warps}s{self.num_stages}"
        return "cuda.qconv.triton_igemm." + ".".join([tile, *flags])


FP8_WIDE_K, FP8_WIDE_K_FROM = 128, 256  # FP8 layers of >= 256 input channels take 128-wide K steps only


def _igemm_refusal(tile: IgemmTile, step: StepSpec, inputs: list[InputMeta]) -> str | None:
    """Why this config is no candidate for the layer (None: it is)."""
    x, w = inputs[0], inputs[3]
    fp8 = x.dtype == FP8
    if tile.mma_f16 and fp8:
        return "fp16 tensor cores are for int8 layers (FP8 layers have their own)"
    if tile.fp8_fast_accumulation and not fp8:
        return "fast accumulation is an FP8 option"
    kernel = list(_attr(step, "kernel_shape", w.shape[2:]))
    if kernel != list(w.shape[2:]):
        return f"kernel_shape {kernel} differs from the weight's {list(w.shape[2:])}"
    strides, dilations, pads = _geometry(step, torch.empty(x.shape, device="meta"), kernel)
    if tile.persistent and (kernel != [1, 1] or list(strides) != [1, 1] or any(pads)):
        return "the persistent loop is the 1x1 stride-1 GEMM's (other layers run the tiled kernel)"
    ho = _output_size(x.shape[2], kernel[0], strides[0], pads[0], pads[2], dilations[0])
    wo = _output_size(x.shape[3], kernel[1], strides[1], pads[1], pads[3], dilations[1])
    if ho <= 0 or wo <= 0:
        return "the kernel does not fit the padded input"
    rows = x.shape[0] * ho * wo
    if padded_tile(tile.block_m, rows):
        return f"{tile.block_m}-pixel tiles for {rows} output pixels: mostly padding"
    if tile.block_m < 128 and (rows // 128) * max(1, w.shape[0] // 128) >= 512:
        return f"{rows} output pixels fill the GPU with 128-row tiles (the 64-row tile is for small batches)"
    if padded_tile(tile.block_n, w.shape[0]):
        return f"{tile.block_n}-channel tiles for {w.shape[0]} output channels: mostly padding"
    if x.shape[1] % 64 == 0 and tile.block_k > x.shape[1]:  # the configs of 64-wide K steps run its channel loop
        return f"{tile.block_k}-wide K steps over {x.shape[1]} input channels: the per-element K loop"
    if fp8 and tile.block_k < FP8_WIDE_K and x.shape[1] >= FP8_WIDE_K_FROM and w.shape[0] > 64 and rows > 64:
        # the FP8 kernel promotes its partial sums to fp32 every K step: a 64-wide step pays that twice as often.
        # On the H200 (bench/results/qconv-2026-12-02.md run 2) the best 64-wide tile was 3-59% slower than the best
        # 128-wide one on each of the 15 ResNet-50 FP8 layers of >= 256 input and > 64 output channels
        return (f"FP8 over {x.shape[1]} input channels: {FP8_WIDE_K}-wide K steps (half the fp32 promotions) win "
                "there (bench/results/qconv-2026-12-02.md)")
    return None


def _igemm_tactic(tile: IgemmTile, level: int, then_qadd: bool = False) -> Tactic:
    """The Triton implicit GEMM at `tile`; a residual add fused in its epilogue, or with `then_qadd` (layers
    with a residual only) the convolution's own 8-bit result written and the QAdd kernel run on it:
    the unfused pair as one candidate, timed against the fused one (the add's pass costs a read-read-write
    of 8-bit tensors, the fused epilogue its instructions: which wins depends on the layer)."""
    def supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
        common = check_layer(step, inputs, 4)
        if common is not True:
            return common
        residual = check_residual(step, inputs)
        if residual is not True:
            return residual
        if then_qadd and (len(inputs) <= 9 or inputs[9].shape is None):
            return "no residual: the plain tactic of this tile runs it"
        x, w = inputs[0], inputs[3]
        if len(x.shape) != 4:
            return "only 2-D convolutions (4-D input)"
        if int(_attr(step, "group", 1)) != 1:
            return f"group {_attr(step, 'group', 1)}: the implicit GEMM reduces over all input channels"
        if x.shape[1] != w.shape[1]:
            return f"x has {x.shape[1]} channels, the weight takes {w.shape[1]}"
        return _igemm_refusal(tile, step, inputs) or True

    def prepare(step: StepSpec, constants: list[Any], device: torch.device):
        qconv = kernels("qconv")
        config = qconv.QConvConfig(tile.block_m, tile.block_n, tile.block_k, num_warps=tile.num_warps,
                                   num_stages=tile.num_stages, fp8_precise=not tile.fp8_fast_accumulation,
                                   mma_f16=tile.mma_f16, persistent=tile.persistent)
        layer = QuantizedLayer.of(step, constants, device)
        residual = Residual.of(constants)
        residual_add = add_after = None
        if residual is not None:  # the convolution's own result c, then the add (qresidual.py)
            residual_add = residual.add(layer)
            add_after = _qadd_after(residual, layer) if then_qadd else None
            layer = residual.convolution(layer)
            residual_add = None if then_qadd else residual_add
        kernel = tuple(int(k) for k in layer.w.shape[2:])
        w_packed = qconv.pack_weight(layer.w, fp16=tile.mma_f16)  # [Cout, KH·KW·Cin], K-major: once per layer
        epilogue = layer.integer_epilogue()
        if epilogue.out_kind != 0:
            # y_scale folded into the per-channel scale: a multiply per output where the division took
            # ~10 instructions (the same tile ran 1.5-3x slower with it on the H200, bench/results/
            # qconv-2026-12-02.md); one step off at near-ties, as the contract allows (a residual layer's c too:
            # the fused layer is judged by the unfused pair's tolerance, quant_residual_check.py)
            epilogue = epilogue.prescale()
        x_zero = layer.x_zero
        padding = qconv.padding_row(layer.x_dtype, x_zero, int(layer.w.shape[1]), device)  # what padded taps read

        def launch(ctx, x, *inputs, **_attributes):
            strides, dilations, pads = _geometry(step, x, list(kernel))  # host arithmetic on x's shape
            x = x.contiguous(memory_format=_CL)  # no copy when it already is NHWC (as it was timed)
            y = qconv.qconv2d(x, w_packed, kernel, epilogue, x_zero=x_zero, strides=tuple(strides),
                              pads=tuple(pads), dilations=tuple(dilations), config=config, padding=padding,
                              residual=None if residual_add is None else inputs[8], residual_add=residual_add)
            return y if add_after is None else add_after(y, inputs)

        return launch

    extras = "".join(f", {what}" for what, on in (("int8 on fp16 tensor cores (fp32 accumulator)", tile.mma_f16),
                                                  ("FP8 fast accumulation", tile.fp8_fast_accumulation),
                                                  (f"{tile.persistent} persistent programs per SM", tile.persistent))
                     if on)
    residual = "then the QAdd kernel on its 8-bit result (a residual layer unfused)" if then_qadd else \
        "and a residual add fused in the epilogue"
    return Tactic(
        name=tile.name + (".then_qadd" if then_qadd else ""), op_type="QConv", domain="kiln", device="cuda",
        dtypes=QUANTIZED, supports=supports, prepare=prepare, layout="channels_last", level=level,
        available=triton_available, checker=residual_layer_checker,
        description=f"Triton int8/fp8 implicit-GEMM convolution (NHWC), {tile.block_m}x{tile.block_n}x{tile.block_k} "
                    f"tiles, {tile.num_warps} warps, {tile.num_stages} stages{extras}; zero point / bias / scale / "
                    f"Relu / requantization (y_scale folded into the scale) {residual}",
    )


def _qadd_after(residual: Residual, sum_layer: QuantizedLayer):
    """c + the residual (inputs[8]) after a convolution that wrote c: QAdd's arithmetic in one Triton pass."""
    qelementwise = kernels("qelementwise")

    def add(c: torch.Tensor, inputs: tuple) -> torch.Tensor:
        return qelementwise.qadd(c, residual.conv_scale, residual.conv_zero, inputs[8], residual.residual_scale,
                                 residual.residual_zero, out_dtype=sum_layer.out_dtype, y_scale=sum_layer.y_scale,
                                 y_zero=sum_layer.y_zero, activation=sum_layer.activation)
    return add


# The configs the autotuner times, and the opt level each is tried from; each compiles a kernel per layer
# kind (1x1 GEMM, 3x3 taps, stride, flat stem, epilogue). Opt level 2: the four that a greedy pick over
# bench/qconv_sweep.py's second H200 run (bench/results/qconv-2026-12-02.md) needs for ResNet-50's 22 conv
# shapes at batch 256 (4.46 ms summed with all four, 4.44 with all 17 configs swept), and the small-batch tile.
IGEMM_TILES = (
    (IgemmTile(128, 64, 64, 4, 4), 2),  # the 64-channel layers and short-K 1x1s at 56x56 / 28x28
    (IgemmTile(256, 128, 128, 8, 3), 2),  # 3x3 128->128
    (IgemmTile(128, 256, 128, 8, 3), 2),  # the 14x14 and 7x7 stages
    (IgemmTile(128, 128, 128, 8, 3), 2),
    (IgemmTile(64, 64, 64, 4, 4), 2),  # small batches (refused where 128-row tiles fill the GPU)
    (IgemmTile(128, 128, 64, 4, 3, persistent=2), 3),  # short-K 1x1 layers: next tile's loads under this epilogue
    (IgemmTile(128, 128, 64, 4, 4, mma_f16=True), 3),
    (IgemmTile(128, 256, 64, 8, 3, mma_f16=True), 3),
    (IgemmTile(128, 128, 64, 4, 2), 3),  # short K (64-256): two stages, more CTAs per SM
    (IgemmTile(128, 256, 64, 8, 2), 3),
    (IgemmTile(128, 256, 128, 8, 4), 3),
    # FP8 fast accumulation: faster on some 1x1 layers, but beyond the noise bound on 5 of 18 layers
    # (run 2: up to 60 grid steps on 1.4% of the outputs): opt level 3 only, and checked at build like all
    (IgemmTile(128, 128, 128, 8, 3, fp8_fast_accumulation=True), 3),
    (IgemmTile(128, 256, 128, 8, 3, fp8_fast_accumulation=True), 3),
)
for _tile, _level in IGEMM_TILES:
    register(_reading_float(_igemm_tactic(_tile, level=_level)))
    register(_reading_float(_igemm_tactic(_tile, level=max(_level, 2), then_qadd=True)))


# ---- the stem: a stride-2 convolution of <= 4 channels by space-to-depth (kiln/kernels/cuda/triton/qstem.py) ----

_S2D_CHANNELS = 16  # qstem.CHANNELS: the folded pixel's bytes (qstem imports triton; this module may not)


def _space_to_depth_refusal(tile: IgemmTile, step: StepSpec, inputs: list[InputMeta]) -> str | None:
    x, w = inputs[0], inputs[3]
    kernel = list(_attr(step, "kernel_shape", w.shape[2:]))
    strides, dilations, _ = _geometry(step, torch.empty(x.shape, device="meta"), kernel)
    if list(strides) != [2, 2] or list(dilations) != [1, 1]:
        return f"strides {list(strides)}, dilations {list(dilations)}: space-to-depth is for stride 2, dilation 1"
    if kernel[0] != kernel[1]:
        return f"a {kernel[0]}x{kernel[1]} kernel (square only)"
    if 4 * x.shape[1] > _S2D_CHANNELS:
        return f"{x.shape[1]} input channels: the space-to-depth stem takes at most 4 (the plain kernel runs more)"
    row = -(-kernel[0] // 2) * _S2D_CHANNELS
    if row != tile.block_k:
        return f"a {kernel[0]}x{kernel[0]} kernel's tap row is {row} bytes, this tile's K step {tile.block_k}"
    return _igemm_refusal(tile, step, inputs)


def _space_to_depth_tactic(tile: IgemmTile, level: int) -> Tactic:
    """The Triton implicit GEMM at `tile` on the space-to-depth input: a 7x7/2 stem on 3 channels as a 4x4/1
    convolution whose K steps are 64 contiguous bytes (qstem.py), where the plain kernel gathers K element by
    element ("flat" loop: 3.4-3.6 ms for ResNet-50's stem at batch 256 on the H200)."""
    def supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
        inputs = _as_quantized(inputs)  # a float x: quantized in the fold
        if isinstance(inputs, str):
            return inputs
        common = check_layer(step, inputs, 4)
        if common is not True:
            return common
        if len(inputs) > 9 and inputs[9].shape is not None:
            return "a residual add (the space-to-depth stem writes its own output only)"
        x, w = inputs[0], inputs[3]
        if len(x.shape) != 4 or int(_attr(step, "group", 1)) != 1 or x.shape[1] != w.shape[1]:
            return "only 2-D convolutions of groups 1"
        return _space_to_depth_refusal(tile, step, inputs) or True

    def prepare(step: StepSpec, constants: list[Any], device: torch.device):
        qconv, qstem = kernels("qconv"), kernels("qstem")
        config = qconv.QConvConfig(tile.block_m, tile.block_n, tile.block_k, num_warps=tile.num_warps,
                                   num_stages=tile.num_stages)
        layer = QuantizedLayer.of(step, constants, device)
        kernel = int(layer.w.shape[2])
        w_packed = qstem.pack_weight(layer.w)  # [Cout, T·T·16]
        epilogue = layer.integer_epilogue()  # −z·Σw over the real weights: padded taps and channels hold z
        if epilogue.out_kind != 0:
            epilogue = epilogue.prescale()
        padding = qconv.padding_row(layer.x_dtype, layer.x_zero, tile.block_k, device)

        def launch(ctx, x, *inputs, **_attributes):
            _, _, pads = _geometry(step, x, [kernel, kernel])
            quantize = (layer.x_scale, layer.x_dtype) if x.dtype in FLOAT_INPUTS else None  # in the fold, one pass
            return qstem.qconv2d_space_to_depth(x, w_packed, kernel, epilogue, x_zero=layer.x_zero,
                                                pads=tuple(pads), config=config, padding=padding, quantize=quantize)

        return launch

    return Tactic(
        name=tile.name + ".space_to_depth", op_type="QConv", domain="kiln", device="cuda",
        dtypes=QUANTIZED + FLOAT_INPUTS,
        supports=supports, prepare=prepare, layout="channels_last", level=level, available=triton_available,
        checker=residual_layer_checker,
        description=f"Triton int8/fp8 implicit-GEMM convolution of a stride-2 stem (<= 4 channels) on its "
                    f"space-to-depth input (2x2 pixels folded into 16 channels: a k x k/2 kernel as ceil(k/2) "
                    f"tap rows of 64 contiguous bytes), {tile.block_m}x{tile.block_n}x{tile.block_k} tiles, "
                    f"{tile.num_warps} warps, {tile.num_stages} stages",
    )


for _tile, _level in IGEMM_TILES:
    if _tile.block_k == 64 and not (_tile.mma_f16 or _tile.fp8_fast_accumulation or _tile.persistent):
        register(_space_to_depth_tactic(_tile, level=_level))


# ---- the float layer ---------------------------------------------------------------------------------

def _dequantized(dtype: torch.dtype):
    def prepare(step: StepSpec, constants: list[Any], device: torch.device):
        qelementwise = kernels("qelementwise")
        layer = QuantizedLayer.of(step, constants, device)
        residual = Residual.of(constants)
        sum_layer = layer
        if residual is not None:  # the convolution's own 8-bit result first, then the QAdd kernel
            layer = residual.convolution(layer)
        w_real = layer.real_weight(dtype)  # [O, C/g, *k]
        if w_real.dim() == 4:
            w_real = w_real.contiguous(memory_format=_CL)
        epilogue = layer.real_epilogue()
        kernel = list(layer.w.shape[2:])
        groups = int(_attr(step, "group", 1))
        x_scale, x_zero = layer.x_scale, layer.x_zero

        add_after = None if residual is None else _qadd_after(residual, sum_layer)

        def add(c: torch.Tensor, inputs: tuple) -> torch.Tensor:
            return c if add_after is None else add_after(c, inputs)

        def launch(ctx, x, *inputs, **_attributes):
            strides, dilations, pads = _geometry(step, x, kernel)
            if x.dim() == 4:
                x = x.contiguous(memory_format=_CL)
            xf = qelementwise.dequantize(x, x_scale, x_zero, dtype)  # real values, x's layout
            n = len(kernel)
            if pads[:n] == pads[n:]:  # symmetric: cuDNN pads, no padded copy
                acc = F.conv2d(xf, w_real, None, strides, pads[:n], dilations, groups) if n == 2 else \
                    _conv(xf, w_real, None, strides, dilations, pads, groups)
            else:
                acc = _conv(xf, w_real, None, strides, dilations, pads, groups)  # zero padding: real 0
            return add(qelementwise.requantize(acc, epilogue, 1), inputs)

        if dtype != torch.float32:
            return launch

        def launch_without_tf32(ctx, x, *inputs, **attributes):
            allowed = torch.backends.cudnn.allow_tf32  # a host-side flag: nothing is launched to set it
            torch.backends.cudnn.allow_tf32 = False
            try:
                return launch(ctx, x, *inputs, **attributes)
            finally:
                torch.backends.cudnn.allow_tf32 = allowed

        return launch_without_tf32

    return prepare


for _suffix, _dtype, _what in (("", torch.float16, "fp16"), ("_fp32", torch.float32, "fp32 (TF32 off)")):
    register(_reading_float(Tactic(
        name=f"cuda.qconv.dequantized{_suffix}", op_type="QConv", domain="kiln", device="cuda", dtypes=QUANTIZED,
        supports=_supports, prepare=_dequantized(_dtype), layout="channels_last", available=triton_available,
        checker=residual_layer_checker,
        description=f"the float layer in {_what}: x dequantized in one pass, cuDNN convolution on the dequantized "
                    "weight, bias (fp32) / Relu / requantization in one Triton pass",
    )))
