"""CUDA tactics for kiln::RMSNormGemm (kiln/passes/fusion/rms_norm_gemm.py): a GEMM of RMS-normalised rows.

    cuda.rms_norm_gemm.triton.<BMxBNxBK>         kiln's Triton GEMM gathering each row's Σ x² in its K loop and
                                                 scaling the finished row: the norm costs no kernel and no pass
    cuda.rms_norm_gemm.swiglu.triton.<BMxBNxBK>  the same for a gated MLP's gate|up GEMM (two accumulators)
    cuda.rms_norm_gemm.norm_then_cublas          kiln's Triton RMSNorm kernel, then the cuBLAS tactic of the plain
                                                 layer (cuda.gemm.cublas_addmm_act, or for SwiGLU
                                                 cuda.gemm.swiglu.cublas_elementwise): the unfused layers' cost, so
                                                 the tuner never has to pick a slower fused form (cuBLAS's main loop
                                                 may win at large M, the LM head's 4096 x 32064 x 512)
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import torch

from kiln.plan.spec import StepSpec
from kiln.tactics.cuda import swiglu
from kiln.tactics.cuda.library import (
    _TRITON_ACTIVATIONS, _gemm_rows, _gemm_supports, _prepare_gemm_addmm, mm_stores_float32, triton_available,
)
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic
from kiln.tactics.tactic import attribute as _attr

_HALF = (torch.float16, torch.bfloat16)
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def _kernels():
    return importlib.import_module("kiln.kernels.cuda.triton")


def _epsilon(step: StepSpec) -> float:
    return float(_attr(step, "epsilon", 1e-6))


def _supports(step: StepSpec, inputs: list[InputMeta], swiglu_form: bool | None) -> bool | str:
    """As the plain layer's tactics check it; `swiglu_form`: True only SwiGLU, False only the others, None both."""
    gated = _attr(step, "activation", "") == "SwiGLU"
    if swiglu_form is not None and gated != swiglu_form:
        return "a SwiGLU layer (the swiglu tactics take it)" if gated else "not a SwiGLU layer"
    if gated:
        return swiglu.swiglu_supports(step, inputs)
    return _gemm_supports(step, inputs, _TRITON_ACTIVATIONS if swiglu_form is False else None)


def _triton_tactic(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int, level: int,
                   gated: bool) -> Tactic:
    name = f"cuda.rms_norm_gemm.{'swiglu.' if gated else ''}triton.{block_m}x{block_n}x{block_k}"

    def supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
        common = _supports(step, inputs, gated)
        if common is not True:
            return common
        rows = _gemm_rows(inputs)
        if block_m > max(16, 1 << max(rows - 1, 0).bit_length()):
            return f"{block_m}-row tiles for {rows} rows: mostly padding"
        return True

    def prepare(step: StepSpec, constants: list[Any], device: torch.device):
        kernels = _kernels()
        config = kernels.GemmConfig(block_m, block_n, block_k, num_warps=num_warps, num_stages=num_stages)
        epsilon = _epsilon(step)
        if gated:
            def launch(ctx, x, w, b=None, residual=None, **_attributes):
                return kernels.swiglu_gemm(x, w, b, residual, config=config, rms_epsilon=epsilon)  # [..., H]
            return launch
        epilogue = {"activation": _attr(step, "activation", ""), "alpha": float(_attr(step, "alpha", 0.0)),
                    "beta": float(_attr(step, "beta", 0.0)),
                    "residual_after_activation": bool(_attr(step, "residual_after_activation", 1)),
                    "out_dtype": torch.float32 if _attr(step, "output_float32", 0) else None}

        def launch(ctx, x, w, b=None, residual=None, **_attributes):
            return kernels.gemm(x, w, b, residual, config=config, rms_epsilon=epsilon, **epilogue)  # [..., N]

        return launch

    return Tactic(
        name=name, op_type="RMSNormGemm", domain="kiln", device="cuda", dtypes=_HALF, supports=supports,
        prepare=prepare, level=level, available=triton_available, float32_output=not gated,
        description=f"Triton {'gate|up ' if gated else ''}GEMM, {block_m}x{block_n}x{block_k} tiles: each row's "
                    "Σ x² from the loaded x tiles, the row scaled by its RMS norm before the epilogue",
    )


for _config, _level in (((128, 128, 64, 8, 3), 2), ((64, 128, 32, 4, 4), 2), ((16, 64, 64, 2, 4), 2)):
    register(_triton_tactic(*_config, level=_level, gated=False))
for _config, _level in (((128, 64, 64, 8, 3), 2), ((64, 64, 64, 4, 3), 2), ((16, 64, 64, 2, 4), 2)):
    register(_triton_tactic(*_config, level=_level, gated=True))


def _supports_norm_then_cublas(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if _attr(step, "output_float32", 0):
        if _attr(step, "activation", "") == "SwiGLU":
            return "a SwiGLU layer writing the fp32 output: its gating kernel stores the inputs' dtype"
        if not mm_stores_float32():
            return "this torch has no aten::mm.dtype: cuBLAS cannot store the fp32 output directly"
    return _supports(step, inputs, None)


def _prepare_norm_then_cublas(step: StepSpec, constants: list[Any], device: torch.device):
    kernels = _kernels()
    epsilon = _epsilon(step)
    plain = dataclasses.replace(step, op_type="FusedGemm", attributes={
        k: v for k, v in step.attributes.items() if k != "epsilon"})
    gemm = swiglu.prepare_cublas_elementwise(plain, constants, device) \
        if _attr(step, "activation", "") == "SwiGLU" else _prepare_gemm_addmm(plain, constants, device)

    def launch(ctx, x, w, b=None, residual=None, **_attributes):
        normed = kernels.rms_norm(x, None, epsilon, axis=-1)  # [..., K], fp32 statistics
        return gemm(ctx, normed, w, b, residual)

    return launch


register(Tactic(
    name="cuda.rms_norm_gemm.norm_then_cublas", op_type="RMSNormGemm", domain="kiln", device="cuda", dtypes=_FLOAT,
    supports=_supports_norm_then_cublas, prepare=_prepare_norm_then_cublas, available=triton_available,
    float32_output=True,
    description="Triton RMSNorm kernel, then cuBLAS (addmm + epilogue, or the gate|up GEMM + one gating kernel)",
))
