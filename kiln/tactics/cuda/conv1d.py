"""CUDA 1-D convolutions with long kernels as one batched GEMM over the unfolded input; InstanceNormalization.

    cuda.conv1d.unfold_bmm   kiln::FusedConv on 3-D input [N, C, L], kernel >= 16 taps, any group count;
                             bias, activation and residual by the op's own epilogue
    cuda.instance_norm.group_norm   InstanceNormalization on torch's group_norm kernel

Wav2Vec2's positional convolution (768 channels, 16 groups, 128 taps, 49 frames a second of audio) took
1.70 ms of the model's 2.2 ms on the H200 with cuDNN (torch's conv1d, fp16): cuDNN has no good algorithm
for a 128-tap grouped 1-D filter on a short sequence. Here the padded input is unfolded (a strided view:
each output position's window of K taps), copied once into [G, N·L', Cg·K] rows, and multiplied by the
weight as [G, Cg·K, Cout/G] in one torch.bmm (cuBLAS, tensor cores): G GEMMs of L' x Cg·K x Cout/G.
The copy is K/stride times the input; the tactic refuses kernels under 16 taps, where that copy costs
more than the convolution and cuDNN's direct kernels are good.

Plain torch: the CPU runs the same code (the tests compare it with the op there); nothing waits on the
host (pads and sizes are host arithmetic on shapes). The autotuner times it against cuDNN per layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kiln.ops.fused import _epilogue
from kiln.plan.spec import StepSpec
from kiln.tactics.cuda.conv import _geometry as _conv_geometry
from kiln.tactics.cuda.conv import _output_size
from kiln.tactics.cuda.library import _broadcasts_to, _epilogue_args
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic
from kiln.tactics.tactic import attribute as _attr
from kiln.tactics.tactic import tensor_input as _input

MIN_TAPS = 16


def _geometry(step: StepSpec, shape: tuple[int, ...], taps: int) -> tuple[int, int, int, int]:
    """(stride, dilation, pad_begin, pad_end) of the layer for an input of this shape, auto_pad resolved."""
    strides, dilations, pads = _conv_geometry(step, torch.empty(shape, device="meta"), [taps])
    return int(strides[0]), int(dilations[0]), int(pads[0]), int(pads[1])


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    x, w, b, residual = inputs[0], _input(inputs, 1), _input(inputs, 2), _input(inputs, 3)
    if x.shape is None or len(x.shape) != 3:
        return "only 1-D convolutions (3-D input [N, C, L])"
    if w is None or not w.constant or w.shape is None or len(w.shape) != 3:
        return "the weight is not a constant 3-D tensor of the engine"
    if w.dtype != x.dtype:
        return f"weight dtype {w.dtype} differs from input dtype {x.dtype}"
    groups = int(_attr(step, "group", 1))
    cout, cin_g, taps = (int(d) for d in w.shape)
    if x.shape[1] != cin_g * groups or cout % groups:
        return f"{x.shape[1]} input channels, {cout} output channels and {groups} groups do not match the weight"
    if taps < MIN_TAPS:
        return f"{taps} taps: below {MIN_TAPS} the unfolded copy costs more than cuDNN's direct convolution"
    kernel = _attr(step, "kernel_shape", None)
    if kernel is not None and list(kernel) != [taps]:
        return f"kernel_shape {list(kernel)} differs from the weight's {taps} taps"
    if b is not None and (b.dtype != x.dtype or b.shape is None or len(b.shape) != 1 or b.shape[0] != cout):
        return f"bias is not one {x.dtype} value per output channel ({cout})"
    stride, dilation, begin, end = _geometry(step, tuple(x.shape), taps)
    out = _output_size(x.shape[2], taps, stride, begin, end, dilation)
    if out <= 0:
        return "the kernel does not fit the padded input"
    if residual is not None and residual.shape is not None and not _broadcasts_to(tuple(residual.shape),
                                                                                  (x.shape[0], cout, out)):
        return f"residual of shape {list(residual.shape)} does not broadcast to the output {[x.shape[0], cout, out]}"
    return True


def _prepare(step: StepSpec, constants: list[Any], device: torch.device):
    weight = constants[1].to(device)
    groups = int(_attr(step, "group", 1))
    cout, cin_g, taps = (int(d) for d in weight.shape)
    cout_g = cout // groups
    # [Cout, Cg, K] -> [G, Cg·K, Cout/G]: row (c, k) of group g multiplies tap k of input channel g·Cg + c
    w_groups = weight.reshape(groups, cout_g, cin_g * taps).transpose(1, 2).contiguous()
    epilogue = _epilogue_args(step, 0)  # FusedConv adds its residual before the activation by default

    def launch(ctx, x, w=None, b=None, residual=None, **_attributes):
        n, _, length = x.shape
        stride, dilation, begin, end = _geometry(step, tuple(x.shape), taps)  # host arithmetic on x's shape
        padded = F.pad(x, (begin, end)) if begin or end else x
        span = dilation * (taps - 1) + 1
        windows = padded.unfold(2, span, stride)  # [N, C, L', span], a view
        if dilation > 1:
            windows = windows[..., ::dilation]  # [N, C, L', K]
        out = windows.shape[2]
        # [N, G, Cg, L', K] -> [G, N, L', Cg, K] -> [G, N·L', Cg·K]: the one copy
        rows = windows.reshape(n, groups, cin_g, out, taps).permute(1, 0, 3, 2, 4).reshape(groups, n * out, cin_g * taps)
        y = torch.bmm(rows, w_groups)  # [G, N·L', Cout/G]
        y = y.reshape(groups, n, out, cout_g).permute(1, 0, 3, 2).reshape(n, cout, out)  # [N, Cout, L']
        if b is not None:
            y = y.add_(b.reshape(1, cout, 1))
        return _epilogue(y, residual, epilogue["activation"], epilogue["alpha"], epilogue["beta"],
                         epilogue["residual_after_activation"])

    return launch


register(Tactic(
    name="cuda.conv1d.unfold_bmm", op_type="FusedConv", domain="kiln", device="cuda",
    dtypes=(torch.float16, torch.bfloat16, torch.float32), supports=_supports, prepare=_prepare,
    description="1-D convolution with a long kernel (>= 16 taps, grouped or not) as one batched GEMM over the "
                "unfolded input (cuBLAS); bias, activation and residual by the op's epilogue",
))


# -- InstanceNormalization as torch's group_norm kernel (one pass over each channel) ---------------------------
# Wav2Vec2's feature encoder normalises its first convolution's 512 channels of 3,199 frames (GroupNorm with a
# group per channel, exported as InstanceNormalization): the op's own code upcasts, then mean, var, subtract,
# divide, scale and shift as separate kernels (0.43 ms eager on the H200, fp16). torch's group_norm does it
# in one reduction kernel and one elementwise pass, accumulating in fp32 for fp16/bf16 inputs.

def _instance_norm_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    x, scale, bias = inputs[0], _input(inputs, 1), _input(inputs, 2)
    if x.shape is None or len(x.shape) < 3:
        return "InstanceNormalization needs [N, C, spatial...]"
    for name, t in (("scale", scale), ("bias", bias)):
        if t is None or t.shape is None or len(t.shape) != 1 or t.shape[0] != x.shape[1]:
            return f"{name} is not one value per channel ({x.shape[1]})"
    return True


def _instance_norm_prepare(step: StepSpec, constants: list[Any], device: torch.device):
    epsilon = float(_attr(step, "epsilon", 1e-5))

    def launch(ctx, x, scale, bias, **_attributes):
        return F.group_norm(x, x.shape[1], scale.to(x.dtype), bias.to(x.dtype), epsilon)

    return launch


register(Tactic(
    name="cuda.instance_norm.group_norm", op_type="InstanceNormalization", domain="", device="cuda",
    dtypes=(torch.float16, torch.bfloat16, torch.float32), supports=_instance_norm_supports,
    prepare=_instance_norm_prepare,
    description="InstanceNormalization on torch's group_norm kernel (a group per channel, fp32 statistics)",
))
