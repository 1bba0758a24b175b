"""CUDA tactics for a gated MLP's gate|up GEMM: kiln::FusedGemm with activation SwiGLU.

    cuda.gemm.swiglu.cublas_elementwise   cuBLAS GEMM into [..., 2H], then silu(gate)·up (+ residual) as one
                                          Triton elementwise kernel over its two halves (views, no Split):
                                          2 kernels, where the op's default runs 3 (linear, silu, mul)
    cuda.gemm.swiglu.triton.<BMxBNxBK>    one Triton GEMM accumulating the gate and the up tile side by side,
                                          the gating in its epilogue: the [..., 2H] output never exists

The decoder LMs' MLPs (Llama, Qwen2, Mistral through fuse_swiglu; Phi-3's merged gate|up through
fuse_split_swiglu) ran the op's default on CUDA (the library GEMM tactics refuse SwiGLU). The tuner times
both forms on the real shape: cuBLAS's main loop against the Triton kernel's saved round trip.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch

from kiln.plan.spec import StepSpec
from kiln.tactics.cuda.library import padded_tile, triton_available
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic
from kiln.tactics.tactic import attribute as _attr
from kiln.tactics.tactic import tensor_input as _input

_HALF = (torch.float16, torch.bfloat16)
_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
# silu(gate) · up, then + residual: kiln::Elementwise programs (kiln/kernels/cuda/triton/elementwise.py)
_GATE = ["Sigmoid i0", "Mul i0 t0", "Mul i1 t1"]
_GATE_RESIDUAL = [*_GATE, "Add t2 i2"]


def _kernels():
    return importlib.import_module("kiln.kernels.cuda.triton")


def swiglu_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if _attr(step, "activation", "") != "SwiGLU":
        return "not a SwiGLU layer (the library GEMM tactics take the others)"
    x, w, b, residual = inputs[0], _input(inputs, 1), _input(inputs, 2), _input(inputs, 3)
    if not x.shape:
        return "x is a scalar"
    if w is None or len(w.shape) != 2 or w.shape[1] != x.shape[-1]:
        return f"w is not an [2H, K={x.shape[-1]}] matrix"
    if w.shape[0] % 2:
        return f"w has {w.shape[0]} rows: SwiGLU needs the gate and up halves of equal height"
    if w.dtype != x.dtype or (b is not None and b.dtype != x.dtype) or (residual is not None and residual.dtype != x.dtype):
        return "x, w, bias and residual do not share one dtype"
    if b is not None and math.prod(b.shape) != w.shape[0]:
        return f"bias of shape {list(b.shape)} is not one value per GEMM column ({w.shape[0]})"
    if residual is not None:
        out = (*x.shape[:-1], w.shape[0] // 2)
        try:
            fits = tuple(torch.broadcast_shapes(residual.shape, out)) == out
        except RuntimeError:
            fits = False
        if not fits:
            return f"residual of shape {list(residual.shape)} does not broadcast to the output {list(out)}"
    return True


def prepare_cublas_elementwise(step: StepSpec, constants: list[Any], device: torch.device):
    kernels = _kernels()
    gate_only = kernels.compile_elementwise(_GATE, 2)
    gate_residual = kernels.compile_elementwise(_GATE_RESIDUAL, 3)

    def launch(ctx, x, w, b=None, residual=None, **_attributes):
        x2 = x.reshape(-1, x.shape[-1])  # x2: [M, K]
        y2 = torch.mm(x2, w.t()) if b is None else torch.addmm(b.reshape(-1), x2, w.t())  # [M, 2H]
        gate, up = y2.view(*x.shape[:-1], w.shape[0]).chunk(2, dim=-1)  # [..., H] each, strided views
        return gate_only(gate, up) if residual is None else gate_residual(gate, up, residual)  # [..., H]

    return launch


register(Tactic(
    name="cuda.gemm.swiglu.cublas_elementwise", op_type="FusedGemm", domain="kiln", device="cuda", dtypes=_FLOAT,
    supports=swiglu_supports, prepare=prepare_cublas_elementwise, available=triton_available,
    description="cuBLAS gate|up GEMM, then silu(gate)·up (+ residual) as one Triton kernel over its halves",
))


def _triton_swiglu_tactic(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int, level: int):
    name = f"cuda.gemm.swiglu.triton.{block_m}x{block_n}x{block_k}"

    def supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
        common = swiglu_supports(step, inputs)
        if common is not True:
            return common
        rows = math.prod(inputs[0].shape[:-1])
        if padded_tile(block_m, rows):
            return f"{block_m}-row tiles for {rows} rows: mostly padding"
        return True

    def prepare(step: StepSpec, constants: list[Any], device: torch.device):
        kernels = _kernels()
        config = kernels.GemmConfig(block_m, block_n, block_k, num_warps=num_warps, num_stages=num_stages)

        def launch(ctx, x, w, b=None, residual=None, **_attributes):
            return kernels.swiglu_gemm(x, w, b, residual, config=config)  # [..., H]

        return launch

    return Tactic(
        name=name, op_type="FusedGemm", domain="kiln", device="cuda", dtypes=_HALF, supports=supports,
        prepare=prepare, level=level, available=triton_available,
        description=f"Triton gate|up GEMM, {block_m}x{block_n}x{block_k} tiles, {num_warps} warps, {num_stages} "
                    "stages: two fp32 accumulators, silu(gate)·up (+ residual) stored once",
    )


# Two accumulators per program: the tiles are half as wide as the plain GEMM's for the same registers.
for _config, _level in (((128, 64, 64, 8, 3), 2), ((64, 64, 64, 4, 3), 2), ((16, 64, 64, 2, 4), 2),
                        ((128, 128, 64, 8, 3), 3)):
    register(_triton_swiglu_tactic(*_config, level=_level))
