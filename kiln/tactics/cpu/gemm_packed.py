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
from kiln.tactics.tactic import (InputMeta, NativeStep, PlanRule, SizedPlan, Tactic, gemm_operands_refusal, resizable,
                                 same_primitive)
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
