"""CPU tactics: kiln::FusedConv and kiln::FusedGemm on oneDNN / MKL with weights packed at load.

    cpu.conv.onednn_nhwc   oneDNN conv, blocked weight, bias/activation/residual as post-ops, NHWC
    cpu.conv.torch_nhwc    torch conv2d on channels-last activations and weights: less fixed cost per
                           call than the oneDNN post-op entry point (~40 µs here), so small layers win
    cpu.conv.onednn_1x1    1x1 stride-1 conv as oneDNN's linear over the NHWC pixels (no conv set-up),
                           packed weight, activation as a post-op
    cpu.conv.onednn_graph  oneDNN Graph partition compiled once at load (TorchScript LLGA): no per-call
                           primitive set-up (kiln/kernels/cpu/conv_graph.py)
    cpu.gemm.onednn        oneDNN linear on a packed weight, activation/residual as post-ops
    cpu.gemm.mkl           MKL packed GEMM (cblas_sgemm_compute), epilogue in place after it

The NHWC convolutions turn their input channels-last (free when it already is) and give a
channels-last output, so a conv stack converts once at its input; every other op sees a
tensor of the same shape, only its strides differ (torch ops are layout-agnostic).

Retired, with the measurement that retired each: docs/retired-tactics.md (cpu.conv.mkl_1x1).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kiln.kernels.cpu import mkl_available, onednn_available
from kiln.kernels.cpu.conv import conv2d_onednn, pack_conv_weight, pixels_as_rows, post_op, rows_as_pixels
from kiln.kernels.cpu.conv_graph import GraphConv, graph_activation_supported, graph_available
from kiln.kernels.cpu.gemm import linear_mkl, linear_onednn, pack_linear_mkl, pack_linear_onednn
from kiln.ops.fused import fused_conv
from kiln.plan.spec import StepSpec
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic
from kiln.tactics.tactic import attribute as _attr

_FP32 = (torch.float32,)
_CL = torch.channels_last


# ---- convolution -------------------------------------------------------------------------------

def _conv_geometry(step: StepSpec, w_shape: tuple[int, ...]) -> tuple[list[int], list[int], list[int]] | str:
    """(padding, stride, dilation) of a 2-D FusedConv with symmetric explicit pads, or a reason."""
    auto_pad = _attr(step, "auto_pad", "NOTSET")
    if auto_pad not in ("NOTSET", "", "VALID"):
        return f"auto_pad={auto_pad} (pads depend on the input size)"
    pads = list(_attr(step, "pads", [0, 0, 0, 0])) if auto_pad != "VALID" else [0, 0, 0, 0]
    if pads[:2] != pads[2:]:
        return f"asymmetric pads {pads}"
    kernel = list(_attr(step, "kernel_shape", list(w_shape[2:])))
    if kernel != list(w_shape[2:]):
        return f"kernel_shape {kernel} differs from the weight's {list(w_shape[2:])}"
    return pads[:2], list(_attr(step, "strides", [1, 1])), list(_attr(step, "dilations", [1, 1]))


def _conv_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    x, w = inputs[0], inputs[1] if len(inputs) > 1 else None
    if x.shape is None or len(x.shape) != 4:
        return "only 2-D convolutions (4-D input)"
    if w is None or not w.constant or w.shape is None:
        return "the weight is not a constant of the engine"
    if w.dtype != x.dtype:
        return f"weight dtype {w.dtype} differs from input dtype {x.dtype}"
    geometry = _conv_geometry(step, w.shape)
    if isinstance(geometry, str):
        return geometry
    if post_op(_attr(step, "activation", ""), _attr(step, "alpha", 0.0), _attr(step, "beta", 0.0)) is None:
        return f"activation {_attr(step, 'activation', '')!r} has no oneDNN post-op"
    if _attr(step, "final_activation", ""):
        return "a final activation: torch's fused convolution applies one (cpu.conv.onednn_direct takes both)"
    residual = inputs[3] if len(inputs) > 3 else None
    if residual is not None and residual.shape is not None:
        padding, stride, dilation = geometry
        out = [x.shape[0], w.shape[0]] + [
            (x.shape[2 + i] + 2 * padding[i] - dilation[i] * (w.shape[2 + i] - 1) - 1) // stride[i] + 1
            for i in range(2)]
        if list(residual.shape) != out:
            return f"residual shape {list(residual.shape)} is broadcast to the output {out}"
    return True


def _conv_configure(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    return {"input_size": list(inputs[0].shape)}


def _prepare_conv_onednn(step: StepSpec, constants: list[Any], device: torch.device):
    w = constants[1]
    padding, stride, dilation = _conv_geometry(step, tuple(w.shape))
    groups = int(_attr(step, "group", 1))
    op = post_op(_attr(step, "activation", ""), _attr(step, "alpha", 0.0), _attr(step, "beta", 0.0))
    after = bool(_attr(step, "residual_after_activation", 0))
    packed = pack_conv_weight(w, padding, stride, dilation, groups, step.tactic_config.get("input_size"))

    def launch(ctx, x, w=None, b=None, residual=None, **_attributes):
        x = x.contiguous(memory_format=_CL)  # x: [N, C, H, W] channels-last; no copy when it already is
        return conv2d_onednn(x, packed, b, residual, padding, stride, dilation, groups, op, after)

    return launch


def _prepare_conv_torch_nhwc(step: StepSpec, constants: list[Any], device: torch.device):
    w_cl = constants[1].contiguous(memory_format=_CL)

    def launch(ctx, x, w=None, b=None, residual=None, **attributes):
        return fused_conv(ctx, x.contiguous(memory_format=_CL), w_cl, b, residual, **attributes)

    return launch


def _torch_nhwc_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    x, w = inputs[0], inputs[1] if len(inputs) > 1 else None
    if x.shape is None or len(x.shape) != 4:
        return "only 2-D convolutions (4-D input)"
    if w is None or not w.constant:
        return "the weight is not a constant of the engine"
    return True


register(Tactic(
    name="cpu.conv.onednn_nhwc", op_type="FusedConv", domain="kiln", device="cpu", dtypes=_FP32,
    supports=_conv_supports, configure=_conv_configure, prepare=_prepare_conv_onednn,
    layout="channels_last", available=onednn_available,
    description="oneDNN convolution, weight packed at load, epilogue as post-ops, NHWC activations",
))
register(Tactic(
    name="cpu.conv.torch_nhwc", op_type="FusedConv", domain="kiln", device="cpu", dtypes=_FP32,
    supports=_torch_nhwc_supports, prepare=_prepare_conv_torch_nhwc, layout="channels_last",
    description="torch conv2d with channels-last activations and weights",
))


# ---- oneDNN Graph --------------------------------------------------------------------------------

def _graph_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if not graph_activation_supported(_attr(step, "activation", "")):
        return f"activation {_attr(step, 'activation', '')!r} is not one the traced layer knows"
    return _conv_supports(step, inputs)


def _graph_configure(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    residual = inputs[3] if len(inputs) > 3 else None
    return {"input_size": list(inputs[0].shape), "residual": residual is not None and residual.shape is not None}


def _prepare_conv_graph(step: StepSpec, constants: list[Any], device: torch.device):
    w, b = constants[1], constants[2] if len(constants) > 2 else None
    padding, stride, dilation = _conv_geometry(step, tuple(w.shape))
    layer = GraphConv(w, b, padding, stride, dilation, int(_attr(step, "group", 1)), _attr(step, "activation", ""),
                      float(_attr(step, "alpha", 0.0)), float(_attr(step, "beta", 0.0)),
                      bool(_attr(step, "residual_after_activation", 0)), step.tactic_config["input_size"],
                      bool(step.tactic_config.get("residual")))

    def launch(ctx, x, w_=None, b_=None, residual=None, **_attributes):
        return layer(x, residual)  # x: [N, C, H, W] -> [N, O, H', W'] channels-last

    return launch


# ---- 1x1 convolutions as GEMMs (kiln/kernels/cpu/conv.py says why) ------------------------------

def _pointwise_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    ok = _conv_supports(step, inputs)
    if ok is not True:
        return ok
    padding, stride, dilation = _conv_geometry(step, inputs[1].shape)
    if tuple(inputs[1].shape[2:]) != (1, 1) or stride != [1, 1] or padding != [0, 0]:
        return f"not a 1x1 stride-1 unpadded convolution (kernel {list(inputs[1].shape[2:])}, stride {stride}, " \
               f"pads {padding})"
    if int(_attr(step, "group", 1)) != 1:
        return "grouped convolution"
    return True


def _pointwise_configure(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    n, _c, h, w = inputs[0].shape
    return {"rows": n * h * w}  # pixels: the GEMM's M


def _prepare_pointwise(step: StepSpec, constants: list[Any], device: torch.device):
    w = constants[1].reshape(constants[1].shape[0], -1).contiguous()  # [O, C, 1, 1] -> [O, C]
    op, after = post_op(_attr(step, "activation", ""), _attr(step, "alpha", 0.0), _attr(step, "beta", 0.0)), \
        bool(_attr(step, "residual_after_activation", 0))
    packed = pack_linear_onednn(w, int(step.tactic_config["rows"]))

    def launch(ctx, x, w_=None, b=None, residual=None, **_attributes):
        n, _c, h, w_px = x.shape
        x_rows = pixels_as_rows(x.contiguous(memory_format=_CL))  # [N·H·W, C], a view
        r_rows = None if residual is None else pixels_as_rows(residual)  # [N·H·W, O]
        y = linear_onednn(x_rows, packed, b, r_rows, op, after)
        return rows_as_pixels(y, n, h, w_px)  # [N, O, H, W] channels-last

    return launch


register(Tactic(
    name="cpu.conv.onednn_1x1", op_type="FusedConv", domain="kiln", device="cpu", dtypes=_FP32,
    supports=_pointwise_supports, configure=_pointwise_configure,
    level=3,  # opt_level 3+: it wins a 1x1 layer now and then, within noise of the conv tactics
              # (measured: docs/retired-tactics.md, which retired its MKL twin cpu.conv.mkl_1x1)
    prepare=_prepare_pointwise,
    layout="channels_last", available=onednn_available,
    description="1x1 convolution as a oneDNN linear over NHWC pixels, activation/residual as post-ops",
))

register(Tactic(
    name="cpu.conv.onednn_graph", op_type="FusedConv", domain="kiln", device="cpu", dtypes=_FP32,
    supports=_graph_supports, configure=_graph_configure, prepare=_prepare_conv_graph,
    layout="channels_last", available=graph_available,
    description="oneDNN Graph partition (conv + epilogue) compiled once at load, NHWC activations",
))


# ---- linear layers -----------------------------------------------------------------------------

def _gemm_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    x, w = inputs[0], inputs[1] if len(inputs) > 1 else None
    if x.shape is None or len(x.shape) < 2:
        return "the input is not a matrix or a batch of rows"
    if w is None or not w.constant or w.shape is None or len(w.shape) != 2:
        return "the weight is not a constant 2-D matrix"
    if w.dtype != x.dtype:
        return f"weight dtype {w.dtype} differs from input dtype {x.dtype}"
    if _attr(step, "activation", "") == "SwiGLU":
        return "activation 'SwiGLU' halves the output's last dim: no post-op gates it, the default implementation does"
    if post_op(_attr(step, "activation", ""), _attr(step, "alpha", 0.0), _attr(step, "beta", 0.0)) is None:
        return f"activation {_attr(step, 'activation', '')!r} is not one the CPU kernels apply"
    return True


def _gemm_configure(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    return {"rows": math.prod(inputs[0].shape[:-1])}  # x: [..., K] -> M rows


def _gemm_epilogue(step: StepSpec):
    op = post_op(_attr(step, "activation", ""), _attr(step, "alpha", 0.0), _attr(step, "beta", 0.0))
    return op, bool(_attr(step, "residual_after_activation", 1))


def _prepare_gemm_onednn(step: StepSpec, constants: list[Any], device: torch.device):
    packed = pack_linear_onednn(constants[1], step.tactic_config.get("rows"))
    op, after = _gemm_epilogue(step)

    def launch(ctx, x, w=None, b=None, residual=None, **_attributes):
        return linear_onednn(x.contiguous(), packed, b, residual, op, after)  # x: [..., K] -> [..., N]

    return launch


def _prepare_gemm_mkl(step: StepSpec, constants: list[Any], device: torch.device):
    w = constants[1].contiguous()
    rows = int(step.tactic_config["rows"])
    packed = pack_linear_mkl(w, rows)
    op, after = _gemm_epilogue(step)

    def launch(ctx, x, w_=None, b=None, residual=None, **_attributes):
        return linear_mkl(x, packed, w, b, rows, residual, op, after)  # x: [..., K] -> [..., N]

    return launch


register(Tactic(
    name="cpu.gemm.onednn", op_type="FusedGemm", domain="kiln", device="cpu", dtypes=_FP32,
    supports=_gemm_supports, configure=_gemm_configure, prepare=_prepare_gemm_onednn, available=onednn_available,
    description="oneDNN linear on a weight packed at load, activation/residual as post-ops",
))
register(Tactic(
    name="cpu.gemm.mkl", op_type="FusedGemm", domain="kiln", device="cpu", dtypes=_FP32,
    supports=_gemm_supports, configure=_gemm_configure, prepare=_prepare_gemm_mkl, available=mkl_available,
    description="MKL packed GEMM (weight packed at load for the tuned row count), epilogue in place",
))
