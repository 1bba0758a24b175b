"""CPU linear-layer tactic on kiln's own packed GEMM (kiln/kernels/cpu/gemm.c).

    cpu.gemm.kiln_packed   kiln::FusedGemm as kiln's GEMM: the weight packed once at load for the
                           microkernel this CPU runs (AVX-512 8x48, AVX2 6x16), A packed per call,
                           bias/activation/residual applied to each tile in cache (SwiGLU's gating
                           too: gate and up rows interleaved per panel); runnable inside native
                           segments (rows of rank 2 or 3), at any row count (one packed weight serves
                           them all); rows of higher rank run as a step of their own

The autotuner times it against oneDNN (cpu.gemm.onednn_direct, cpu.gemm.onednn) and MKL
(cpu.gemm.mkl) per layer and keeps the fastest: on an AVX2 EPYC, MKL and oneDNN ran BERT-base's FFN
GEMM at 64% of the FMA peak, where onnxruntime's MLAS reached 90% (bench/gemm.py).

    cpu.conv.kiln_1x1      a 1x1 kiln::FusedConv (stride 1, no padding, one group) as the same GEMM on its NHWC rows
                           [N·H·W, C] (AVX2 builds): under the AVX2 cap 0.87-1.03x oneDNN's brgconv_1x1 on ResNeXt-50's
                           1x1 layers alone (bench/results/zoo-new-avx2-zen4-2026-12-07d.md); the autotuner times it
                           against cpu.conv.onednn_direct per layer

The kernel is picked when the engine loads (cpuid), not stored in it: an engine built on an AVX2
machine runs the AVX-512 kernel on an AVX-512 one.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kiln.kernels.cpu import gemm_native, onednn
from kiln.plan.spec import StepSpec
from kiln.tactics.registry import register
from kiln.tactics.tactic import (InputMeta, NativeStep, PlanRule, SizedPlan, Tactic, conv_geometry,
                                 conv_operands_refusal, gemm_operands_refusal, resizable, same_primitive)
from kiln.tactics.tactic import attribute as _attr


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if not gemm_native.available():
        return f"kiln's GEMM is not built: {gemm_native.reason()}"
    x = inputs[0]
    w = inputs[1] if len(inputs) > 1 else None
    b = inputs[2] if len(inputs) > 2 else None
    residual = inputs[3] if len(inputs) > 3 else None
    if x.shape is None or len(x.shape) < 2:
        return "only rows [..., K] of rank 2 or more"
    operands = gemm_operands_refusal(x, w, b)
    if operands is not None:
        return operands
    activation = _attr(step, "activation", "")
    if activation not in gemm_native.ACTIVATIONS:
        return f"activation {activation!r} is not one kiln's GEMM applies"
    n = w.shape[0]
    if activation == "SwiGLU":  # W = [W_gate; W_up]: the output is half as wide
        if n % 2:
            return f"SwiGLU needs an even number of weight rows (gate and up), given {list(w.shape)}"
        n //= 2
    if residual is not None and residual.shape is not None:
        if list(residual.shape) != [*x.shape[:-1], n] or residual.dtype != torch.float32:
            return f"residual {list(residual.shape)} is not a float32 [..., N] like the output"
    return True


def _configure(step: StepSpec, inputs: list[InputMeta]) -> dict[str, Any]:
    residual = inputs[3] if len(inputs) > 3 else None
    return {"input_size": list(inputs[0].shape), "residual": residual is not None and residual.shape is not None}


def _prepare(step: StepSpec, constants: list[Any], device: torch.device):
    w = constants[1]
    b = constants[2] if len(constants) > 2 else None
    with_residual = bool(step.tactic_config.get("residual"))
    layer = gemm_native.PackedLinear(
        w, b, _attr(step, "activation", ""), float(_attr(step, "alpha", 0.0)), float(_attr(step, "beta", 0.0)),
        residual=with_residual, residual_after_activation=bool(_attr(step, "residual_after_activation", 1)))
    tuned = tuple(step.tactic_config["input_size"])
    bound: dict[int, gemm_native.BoundRows] = {}

    def launch(ctx, x, w_=None, b_=None, residual=None, into=None, **_attributes):
        out = into[0] if into else None  # Program.run's: a bound output of exactly this output's form, written there
        if out is not None and (out.dtype != torch.float32 or not out.is_contiguous()
                                or tuple(out.shape) != (*x.shape[:-1], layer.n)):
            out = None
        return layer(x, residual if with_residual else None, out)  # x: [..., K] -> [..., N]

    launch.writes_into = True

    def rows_of(size: tuple[int, ...]) -> int:
        if len(size) not in (2, 3) or size[-1] != tuned[-1]:
            raise ValueError(f"kiln GEMM takes [..., {tuned[-1]}] inputs of rank 2 or 3, given {list(size)}")
        return math.prod(size[:-1])

    @resizable

    def native_at(size: tuple[int, ...]) -> NativeStep:
        rows = rows_of(size)
        at_size = bound.get(rows)
        if at_size is None or at_size.input_size != size:
            at_size = bound[rows] = layer.rows(size)
        return NativeStep(size, at_size.output_size, same_primitive(at_size),
                          residual_input=3 if with_residual else None, plan_at=plan_rule(layer.c_rows(rows)))

    rules: dict[int, PlanRule] = {}

    def plan_rule(c_rows: int) -> PlanRule:
        """The size rule of the layer bound at rows whose plan holds SwiGLU's C for `c_rows` rows (0: none): a
        SwiGLU layer's template past small_m rows (AVX2's 48 at small K: llama_tiny's grown MLP segments) is then
        rewritten at new rows up to its own, not bound at each."""
        rule = rules.get(c_rows)
        if rule is None:
            def sized(size: tuple[int, ...]) -> SizedPlan:  # native_at's sizes, without a BoundRows
                return SizedPlan(((*size[:-1], layer.n),), layer.row_fields(rows_of(size), c_rows))

            # row_fields follows these alone
            rule = rules[c_rows] = PlanRule(sized, ("kiln_gemm", layer.k, layer.n, layer.gemm_n, layer.small_m,
                                                    layer.pack_m, layer.swiglu, c_rows), traceable=True)
        return rule

    # a segment points oneDNN memory objects at each run's buffers; its 4-D values are NHWC in memory,
    # so rows of rank 4 ([N, H, W, C] after a Transpose: ConvNeXt's MLP) run outside segments
    if onednn.available() and len(tuned) in (2, 3):
        launch.native = native_at(tuned)
    return launch


register(Tactic(
    name="cpu.gemm.kiln_packed", op_type="FusedGemm", domain="kiln", device="cpu", dtypes=(torch.float32,),
    supports=_supports, configure=_configure, prepare=_prepare, available=gemm_native.available, native=True,
    description="kiln's packed GEMM (AVX2 6x16 / AVX-512 8x48 by cpuid), weight packed at load, epilogue fused",
))


# ---- a 1x1 convolution as the GEMM of its NHWC rows ---------------------------------------------

_CL = torch.channels_last


def _pointwise_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    """A 1x1 kiln::FusedConv at stride 1 without padding: inside a segment its NHWC input is the rows [N·H·W, C] of
    a GEMM whose output rows are the NHWC output."""
    if not gemm_native.available():
        return f"kiln's GEMM is not built: {gemm_native.reason()}"
    if not gemm_native.linear_kernel().name.startswith("avx2"):
        return (f"kiln's GEMM runs {gemm_native.linear_kernel().name!r} here: oneDNN's 1x1 convolutions were not "
                "measured against it (AVX2 only)")
    x = inputs[0]
    w = inputs[1] if len(inputs) > 1 else None
    b = inputs[2] if len(inputs) > 2 else None
    residual = inputs[3] if len(inputs) > 3 else None
    if x.shape is None or len(x.shape) != 4 or x.dtype != torch.float32:
        return "only float32 2-D convolutions (4-D input)"
    if w is None or not w.constant or w.shape is None or len(w.shape) != 4 or w.dtype != torch.float32:
        return "the weight is not a constant float32 4-D tensor of the engine"
    if (refusal := conv_operands_refusal(step, x, w)) is not None:
        return refusal
    pads, strides, dilations = conv_geometry(step, tuple(w.shape))
    if list(w.shape[2:]) != [1, 1] or int(_attr(step, "group", 1)) != 1 or strides != [1, 1] or any(pads):
        return (f"not a 1x1 convolution of one group at stride 1 without padding (kernel {list(w.shape[2:])}, "
                f"{int(_attr(step, 'group', 1))} groups, strides {strides}, pads {pads})")
    if b is not None and b.shape is not None and (not b.constant or b.dtype != torch.float32):
        return "the bias is not a float32 constant of the engine"
    activation = _attr(step, "activation", "")
    if activation not in gemm_native.ACTIVATIONS or activation == "SwiGLU":
        return f"activation {activation!r} is not one kiln's GEMM applies to a convolution"
    if _attr(step, "final_activation", ""):
        return "a final activation: kiln's GEMM applies one activation"
    if residual is not None and residual.shape is not None:
        out = [x.shape[0], w.shape[0], x.shape[2], x.shape[3]]
        if list(residual.shape) != out or residual.dtype != torch.float32:
            return f"residual {list(residual.shape)} is not a float32 {out} like the output"
    return True


def _prepare_pointwise(step: StepSpec, constants: list[Any], device: torch.device):
    w = constants[1]
    b = constants[2] if len(constants) > 2 else None
    o, c = int(w.shape[0]), int(w.shape[1])
    with_residual = bool(step.tactic_config.get("residual"))
    layer = gemm_native.PackedLinear(  # W [O, C]: the rows' K is the input's channels
        w.reshape(o, c), b, _attr(step, "activation", ""), float(_attr(step, "alpha", 0.0)),
        float(_attr(step, "beta", 0.0)), residual=with_residual,
        residual_after_activation=bool(_attr(step, "residual_after_activation", 0)))  # a conv's default
    tuned = tuple(step.tactic_config["input_size"])

    def rows(t: torch.Tensor) -> torch.Tensor:  # [N, C, H, W] channels-last -> its NHWC memory as [N·H·W, C]
        return t.contiguous(memory_format=_CL).permute(0, 2, 3, 1).reshape(-1, t.shape[1])

    def launch(ctx, x, w_=None, b_=None, residual=None, **_attributes):
        n, _, h, wd = x.shape
        y = torch.empty_strided((n, o, h, wd), (h * wd * o, 1, wd * o, o), dtype=torch.float32)  # channels-last
        layer(rows(x), rows(residual) if with_residual else None, y.permute(0, 2, 3, 1).reshape(-1, o))
        return y

    @resizable

    def native_at(size: tuple[int, ...]) -> NativeStep:  # NHWC in and out: the rows the GEMM reads and writes
        if len(size) != 4 or size[1] != c:
            raise ValueError(f"a 1x1 convolution of {c} input channels, given {list(size)}")
        bound = layer.rows((int(size[0]) * int(size[2]) * int(size[3]), c))
        return NativeStep(tuple(size), (size[0], o, size[2], size[3]), same_primitive(bound),
                          residual_input=3 if with_residual else None)

    if onednn.available():  # a segment's operands are oneDNN memory objects
        launch.native = native_at(tuned)
    return launch


register(Tactic(
    name="cpu.conv.kiln_1x1", op_type="FusedConv", domain="kiln", device="cpu", dtypes=(torch.float32,),
    supports=_pointwise_supports, configure=_configure, prepare=_prepare_pointwise, layout="channels_last",
    available=gemm_native.available, native=True,
    description="a 1x1 convolution as kiln's packed GEMM (AVX2 6x16) on its NHWC rows, bias/activation/residual "
                "in the tile epilogue, a native-segment member",
))
