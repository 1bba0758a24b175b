"""kiln::QGemm on kiln's own AVX2 int8 GEMM (kiln/kernels/cpu/i8gemm.c).

    cpu.qgemm.kiln_i8   uint8/int8 rows x [..., K] times the int8 weight packed once at load: vpmaddubsw pair sums,
                        int32 accumulation (exact: the weight's adjacent pairs checked at prepare), the zero point,
                        bias, scale, activation (Relu/Clip; GELU by gemm.c's vector forms) and the requantization
                        on the sums; threads over 32-channel panels;
                        runnable inside native segments (rows of rank 2 or 3)

A candidate beside cpu.qgemm.onednn (oneDNN's int8 matmul) and cpu.qgemm.dequantized (the float layer): the tuner
times all three per layer and keeps the fastest. Written for AVX2 CPUs without VNNI, where oneDNN's int8 matmul ran
MiniLM's GEMMs 1.09-1.5x slower than onnxruntime's MLAS (bench/results/int8-gemm-avx2-2026-12-07.md measures this
one). It refuses a weight whose adjacent pairs could saturate vpmaddubsw (|w1| + |w2| > 128; 7-bit weights,
reduce_range, never do), a non-zero weight zero point, a product chain (the FP8 epilogue: CUDA's), and activations
other than none, Relu, Clip, Gelu and GeluTanh.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

from kiln.kernels.cpu import i8gemm
from kiln.plan.spec import StepSpec
from kiln.tactics.cpu.quantized import _activation, _built, _configure, _constants_refusal, _y
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, NativeStep, PlanRule, SizedPlan, Tactic, resizable, same_primitive
from kiln.tactics.tactic import attribute as _attr
from kiln.tactics.tactic import tensor_input as _input


def scales_refusal(step: StepSpec, inputs: list[InputMeta]) -> str | None:
    """Why i8gemm's epilogue cannot take a QGemm's or QConv's scales (a per-tensor input scale; an output quantized per
    tensor to uint8/int8 by the engine's constants, or float32), or None."""
    if len(inputs[1].shape) > 0 and inputs[1].shape != (1,):
        return "a per-channel input scale"
    y_scale = _input(inputs, 6)
    if y_scale is not None:
        y_zero = _input(inputs, 7)
        if not y_scale.constant or y_zero is None or not y_zero.constant or y_zero.dtype not in i8gemm.SOURCES \
                or y_scale.shape not in ((), (1,)):
            return "the output is not quantized per tensor to uint8/int8 by constants of the engine"
    elif int(_attr(step, "output_dtype", 1)) != 1:
        return "a float output other than float32"
    return None


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    if (refusal := _constants_refusal(inputs)) is not None:
        return refusal
    if _input(inputs, 9) is not None:
        return "a QGemm with its product quantized (the FP8 chain in its epilogue): CUDA's kernels only"
    x, w = inputs[0], inputs[3]
    if x.dtype not in i8gemm.SOURCES:
        return f"source {str(x.dtype).removeprefix('torch.')}: uint8/int8 rows only"
    if w.dtype != torch.int8 or len(w.shape) != 2:
        return "the weight is not an int8 [N, K] matrix"
    if len(x.shape) < 2 or x.shape[-1] != w.shape[1]:
        return f"input {list(x.shape)} does not match the weight [N, K] {list(w.shape)}"
    if (refusal := scales_refusal(step, inputs)) is not None:
        return refusal
    if _attr(step, "activation", "") not in i8gemm.ACTIVATIONS:
        return f"activation {_attr(step, 'activation', '')!r}: i8gemm applies none, Relu, Clip, Gelu, GeluTanh"
    if not i8gemm.available():
        return f"kiln's i8gemm kernel: {i8gemm.reason()}"
    if not i8gemm.vector_products():
        return "kiln's i8gemm kernel was compiled without AVX2 (its plain C form is for tests)"
    return True


def _prepare(step: StepSpec, constants: list[Any], device: torch.device):
    x_scale, x_zero, w, w_scale, w_zero = constants[1:6]
    if bool((w_zero != 0).any()):
        raise ValueError("the weight's zero point is not 0")
    if (refusal := i8gemm.weight_refusal(w)) is not None:
        raise ValueError(refusal)
    bias = constants[8] if len(constants) > 8 else None
    y = _y(constants)
    activation, alpha, beta = _activation(step)
    n, k = int(w.shape[0]), int(w.shape[1])
    tuned = math.prod(step.tactic_config["input_size"][:-1])
    x_dtype = x_zero.dtype

    first = i8gemm.I8Gemm(w, w_scale, bias, tuned, x_dtype, float(x_scale.reshape(-1)[0]),
                          int(x_zero.reshape(-1)[0]), y, activation, alpha, beta)
    layers = {tuned: first}
    lock = threading.Lock()

    def build(rows: int) -> i8gemm.I8Gemm:
        return first.at_rows(rows)  # the packed weight shared: a new row count costs a plan

    def rows_of(size: tuple[int, ...]) -> int:
        if len(size) not in (2, 3) or size[-1] != k:
            raise ValueError(f"i8gemm over [..., {k}] rows of rank 2 or 3, given {list(size)}")
        return math.prod(size[:-1])

    def sized(size: tuple[int, ...]) -> SizedPlan:  # a segment's view at other sizes: the plan's row fields
        return SizedPlan(((*size[:-1], n),), first.row_fields(rows_of(size)))

    plan_rule = PlanRule(sized, ("kiln_i8", k, n, first.wanted_threads))

    def launch(ctx, x, *_inputs, **_attributes):
        lead = x.shape[:-1]
        rows = math.prod(lead)
        with lock:
            layer = _built(layers, rows, build, tuned)
        return layer(x.reshape(rows, k).contiguous()).reshape(*lead, n)  # [..., N]

    @resizable

    def native_at(size: tuple[int, ...]) -> NativeStep:  # rows [B, S, K] bound as [B*S, K]
        rows = rows_of(size)
        with lock:
            layer = _built(layers, rows, build, tuned)
        return NativeStep(tuple(size), (*size[:-1], n), same_primitive(layer), output_dtype=layer.out_dtype,
                          input_dtype=x_dtype, plan_at=plan_rule)

    launch.native = native_at(tuple(step.tactic_config["input_size"]))
    return launch


register(Tactic(
    name="cpu.qgemm.kiln_i8", op_type="QGemm", domain="kiln", device="cpu", dtypes=i8gemm.SOURCES,
    supports=_supports, configure=_configure, prepare=_prepare, available=i8gemm.available, native=True,
    description="kiln's AVX2 int8 GEMM: vpmaddubsw pair sums in int32, weight packed at load, requantize fused",
))
