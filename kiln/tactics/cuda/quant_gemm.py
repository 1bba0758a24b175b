"""CUDA tactics for kiln::QGemm (kiln/ops/quantized.py): INT8 and FP8 GEMMs with the requantizing epilogue.

    cuda.qgemm.triton.<BMxBNxBK>   Triton GEMM on int8 (int32 accumulator) or float8e4m3fn (fp32), the whole
                                   epilogue (zero point, bias, per-channel scale, Relu/Clip, requantization
                                   or float out) on the tile in registers: one read of x, one write of y
    cuda.qgemm.triton_persistent.* the same FP8 GEMM with one program per SM walking the tiles, TMA loads and
                                   stores, the epilogue on half tiles: an FFN up's Gelu -> fp8 in the GEMM (8-bit
                                   outputs: a float one is cuBLASLt's, scaled_mm_direct)
    cuda.qgemm.int_mm              cuBLASLt int8 GEMM (torch._int_mm, int32 out), then one Triton pass
    cuda.qgemm.scaled_mm           cuBLASLt FP8 GEMM (torch._scaled_mm, unit scales, fp32 out), then one Triton pass
    cuda.qgemm.scaled_mm_direct    cuBLASLt FP8 GEMM with the scales (per tensor, or row-wise for bf16) and the
                                   bias in cuBLASLt, writing the float output itself; Relu/Clip in place
    cuda.qgemm.scaled_mm_half      cuBLASLt FP8 GEMM writing fp16 (bf16), then one Triton pass: bias, any
                                   activation (an FFN's Gelu) and the 8-bit output
    <FP8 tactic>.fast_accum        the same with Hopper's fast FP8 accumulation (cuBLASLt's use_fast_accum,
                                   Triton's sm_90 default): the tensor cores sum the whole K in their ~14-bit
                                   adds, no fp32 promotion per step (Triton: the 128-row tiles)
    cuda.qgemm.dequantized         the float layer: x dequantized to fp16 in one pass, cuBLAS fp16 GEMM on
                                   the dequantized weight, then one Triton pass (bias in fp32, requantization)

A QGemm with its product quantized (inputs 9-11: onnxruntime's FP8 QDQ linear y = Q(act(DQ(Q(x·W)) + b)·m), the
chain after the product in the epilogue): the Triton tactics, scaled_mm, scaled_mm_half (the chain in their
Triton pass; a float output too) and dequantized take it, judged by quant_product_check (the unfused pair's
tolerance); scaled_mm_direct cannot (cuBLASLt adds its bias before the one rounding it has).

Measured on the H200 (issue 12): cuBLASLt INT8 is slower than FP16 at ResNet-50/BERT GEMM shapes and FP8
1.4-1.6x faster, so no tactic here is assumed to win: the autotuner times them all against the op's
reference (and each other) on the layer's real shape, and judges each within one quantization step.

Nothing in a launch reads a device value on the host (scales, zero points and bias are read at
prepare): every tactic runs inside a captured CUDA graph.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from kiln.plan.spec import StepSpec
from kiln.tactics.cuda.library import padded_tile
from kiln.tactics.cuda.quant_common import (
    FP8,
    GEMM_ACTIVATIONS,
    INT8_INPUTS,
    QUANTIZED,
    QuantizedLayer,
    check_layer,
    check_product,
    kernels,
    name_of,
    output_dtype,
    triton_available,
)
from kiln.tactics.cuda.quant_product_check import product_layer_checker
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic, tensor_input

_INT_MM_MIN_ROWS = 17  # torch._int_mm on CUDA wants more than 16 rows: fewer are padded to this many


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    common = check_layer(step, inputs, 2, GEMM_ACTIVATIONS)
    if common is not True:
        return common
    x, w = inputs[0], inputs[3]
    if not x.shape or x.shape[-1] != w.shape[1]:
        return f"x {list(x.shape)} does not match the weight [N, K] {list(w.shape)}"
    if w.shape[1] == 0:
        return "K = 0"
    return check_product(step, inputs)


def _product(inputs: list[InputMeta]) -> bool:
    """Whether the layer's product is quantized (inputs 9-11: the chain after it in the epilogue)."""
    return tensor_input(inputs, 9) is not None


def _rows(inputs: list[InputMeta]) -> int:
    return math.prod(inputs[0].shape[:-1])  # x: [..., K] -> M rows


def _flat(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as a row-major [M, K] (no copy when it already is)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 and x2.stride(0) == x2.shape[1] else x2.contiguous()


# ---- Triton ------------------------------------------------------------------------------------------

def _triton_tactic(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int, level: int,
                   fast_accum: bool = False, persistent: bool = False) -> Tactic:
    kind = "triton_persistent" if persistent else "triton"
    name = f"cuda.qgemm.{kind}.{block_m}x{block_n}x{block_k}" + (".fast_accum" if fast_accum else "")

    def supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
        common = _supports(step, inputs)
        if common is not True:
            return common
        if fast_accum and inputs[0].dtype != FP8:
            return f"{name_of(inputs[0].dtype)} activations: int8 sums are exact, fast accumulation is FP8's"
        if persistent:
            out = output_dtype(step, inputs)
            if out not in QUANTIZED and not (_product(inputs) and out in (torch.float16, torch.bfloat16)):
                return out if isinstance(out, str) else \
                    "a float output: cuda.qgemm.scaled_mm_direct writes it from cuBLASLt's epilogue"
            refusal = kernels("qgemm").persistent_refusal(inputs[0].dtype, *inputs[3].shape[::-1], out)
            if refusal:
                return refusal
        rows, n = _rows(inputs), inputs[3].shape[0]
        if padded_tile(block_m, rows):
            return f"{block_m}-row tiles for {rows} rows: mostly padding"
        if padded_tile(block_n, n):
            return f"{block_n}-column tiles for {n} output columns: mostly padding"
        return True

    def prepare(step: StepSpec, constants: list[Any], device: torch.device):
        qgemm = kernels("qgemm")
        config = qgemm.QGemmConfig(block_m, block_n, block_k, num_warps=num_warps, num_stages=num_stages,
                                   fast_accum=fast_accum, persistent=persistent)
        layer = QuantizedLayer.of(step, constants, device)
        w = layer.w.contiguous()  # [N, K], K contiguous: wgmma's 8-bit B layout
        epilogue = layer.integer_epilogue()

        def launch(ctx, x, *_inputs, **_attributes):
            return qgemm.qgemm(x, w, epilogue, config)  # [..., N]

        return launch

    return Tactic(
        name=name, op_type="QGemm", domain="kiln", device="cuda", dtypes=QUANTIZED, supports=supports,
        prepare=prepare, level=level, available=triton_available, checker=product_layer_checker,
        description=f"Triton int8/fp8 GEMM, {block_m}x{block_n}x{block_k} tiles, {num_warps} warps, {num_stages} "
                    "stages, zero point / bias / scale / Relu / requantization on the tile before its one store"
                    + _FAST_ACCUM[fast_accum] + _PERSISTENT[persistent],
    )


# Fast accumulation is a candidate of its own, never assumed: the builder's check on the layer's real inputs
# (one step of an 8-bit output, fp16's tolerance of a float one) decides whether its error is acceptable there.
_FAST_ACCUM = {False: "", True: "; fast accumulation (the whole K in the tensor cores' ~14-bit adds)"}
_PERSISTENT = {False: "", True: "; FP8, one program per SM over the tiles, TMA loads and stores, the epilogue on "
                                "half tiles while the next tile's loads run (an FFN up's Gelu -> fp8 in the GEMM)"}

# (block_m, block_n, block_k, warps, stages) -> opt level: big-M tiles, a middle one, 16-row tiles for batch 1
for _config, _level in (((128, 128, 128, 8, 3), 2), ((64, 128, 128, 4, 4), 2), ((16, 64, 128, 2, 4), 2),
                        ((128, 256, 128, 8, 3), 3)):
    register(_triton_tactic(*_config, level=_level))
# FP8 with the tensor cores' accumulation: the large-M tiles (128x256 fits without the second accumulator)
for _config in ((128, 128, 128, 8, 3), (128, 256, 128, 8, 3)):
    register(_triton_tactic(*_config, level=2, fast_accum=True))
# FP8, persistent with TMA, fast accumulation: the large-M tiles, the 128-wide ones with a stage more (the shared
# memory allows it). BERT-base's FFN up on the H200 (bench/results/quant-gpu-2026-12-03c.md): 0.214 ms against
# cuBLASLt + the pass 0.2125, a tie the tuner decides; with fp32 accumulation 0.06 ms slower: not a candidate
for _config in ((128, 256, 128, 8, 3), (128, 128, 128, 8, 4)):
    register(_triton_tactic(*_config, level=2, fast_accum=True, persistent=True))


# ---- cuBLASLt INT8 (torch._int_mm) -------------------------------------------------------------------

def _int_mm_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    common = _supports(step, inputs)
    if common is not True:
        return common
    if inputs[0].dtype not in INT8_INPUTS:
        return f"{name_of(inputs[0].dtype)} activations: torch._int_mm multiplies int8"
    n, k = inputs[3].shape
    if k % 8 or n % 8:
        return f"K = {k}, N = {n}: torch._int_mm needs both multiples of 8"
    return True


def _prepare_int_mm(step: StepSpec, constants: list[Any], device: torch.device):
    requantize = kernels("qelementwise").requantize
    layer = QuantizedLayer.of(step, constants, device)
    w_t = layer.w.contiguous().t()  # [K, N] column-major: cuBLASLt's int8 "TN" layout, no copy
    epilogue = layer.integer_epilogue()
    unsigned = layer.x_dtype == torch.uint8

    def launch(ctx, x, *_inputs, **_attributes):
        lead = x.shape[:-1]
        x2 = _flat(x)  # [M, K]
        if unsigned:
            x2 = (x2 ^ 128).view(torch.int8)  # x − 128 as int8 (one pass); the zero point moved in the bias
        m = x2.shape[0]
        if m < _INT_MM_MIN_ROWS:
            x2 = F.pad(x2, (0, 0, 0, _INT_MM_MIN_ROWS - m))
        acc = torch._int_mm(x2, w_t)[:m]  # [M, N] int32, exact
        return requantize(acc, epilogue, -1).reshape(*lead, w_t.shape[1])

    return launch


register(Tactic(
    name="cuda.qgemm.int_mm", op_type="QGemm", domain="kiln", device="cuda", dtypes=INT8_INPUTS,
    supports=_int_mm_supports, prepare=_prepare_int_mm, available=triton_available,
    description="cuBLASLt int8 GEMM (torch._int_mm, int32 out), then zero point / bias / scale / Relu / "
                "requantization in one Triton pass",
))


# ---- cuBLASLt FP8 (torch._scaled_mm) -----------------------------------------------------------------

def _scaled_mm_available() -> bool:
    return hasattr(torch, "_scaled_mm")


def _scaled_mm_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    common = _supports(step, inputs)
    if common is not True:
        return common
    if inputs[0].dtype != FP8:
        return f"{name_of(inputs[0].dtype)} activations: torch._scaled_mm multiplies float8e4m3fn"
    n, k = inputs[3].shape
    if k % 16 or n % 16:
        return f"K = {k}, N = {n}: torch._scaled_mm needs both multiples of 16"
    return True


def _prepare_scaled_mm(step: StepSpec, constants: list[Any], device: torch.device):
    requantize = kernels("qelementwise").requantize
    layer = QuantizedLayer.of(step, constants, device)
    w_t = layer.w.contiguous().t()  # [K, N] column-major, as cuBLASLt's FP8 GEMM reads B
    one = torch.ones((), dtype=torch.float32, device=device)
    epilogue = layer.integer_epilogue()  # scales and bias applied to the fp32 sums, as the Triton kernel does

    def launch(ctx, x, *_inputs, **_attributes):
        lead = x.shape[:-1]
        acc = torch._scaled_mm(_flat(x), w_t, scale_a=one, scale_b=one, out_dtype=torch.float32)  # [M, N]
        return requantize(acc, epilogue, -1).reshape(*lead, w_t.shape[1])

    return launch


register(Tactic(
    name="cuda.qgemm.scaled_mm", op_type="QGemm", domain="kiln", device="cuda", dtypes=(FP8,),
    supports=_scaled_mm_supports, prepare=_prepare_scaled_mm, available=_scaled_mm_available,
    checker=product_layer_checker,
    description="cuBLASLt FP8 GEMM (torch._scaled_mm, fp32 out, full-precision accumulation), then bias / "
                "scale / Relu / requantization in one Triton pass",
))


def _direct_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    common = _scaled_mm_supports(step, inputs)
    if common is not True:
        return common
    if _product(inputs):
        return "the product is quantized before the bias: cuBLASLt's epilogue adds it before its one rounding"
    out = output_dtype(step, inputs)
    if out in QUANTIZED:
        return "a quantized output: cuBLASLt's epilogue has no Relu/Clip-then-round of kiln's contract"
    per_channel = math.prod(inputs[4].shape) > 1
    if per_channel and out != torch.bfloat16:
        return f"per-channel weight scales with a {name_of(out)} output: row-wise scaling writes bfloat16 only"
    return True


def _prepare_direct(step: StepSpec, constants: list[Any], device: torch.device, fast_accum: bool = False):
    layer = QuantizedLayer.of(step, constants, device)
    w_t = layer.w.contiguous().t()
    n = w_t.shape[1]
    per_channel = constants[4].numel() > 1  # as supports() judged it
    out = layer.out_dtype
    scale_b = (layer.channel_scale.reshape(1, n) if per_channel else layer.channel_scale[:1].reshape(()))
    one = torch.ones((), dtype=torch.float32, device=device)
    real_bias = None if layer.bias is None else (layer.bias.to(torch.float64) * layer.w_scale * layer.x_scale)
    bias_in_gemm = real_bias is not None and out != torch.float32  # cuBLASLt takes a half-precision bias
    bias = None if real_bias is None else real_bias.to(out)
    activation, alpha, beta = layer.activation, layer.alpha, layer.beta

    def launch(ctx, x, *_inputs, **_attributes):
        lead = x.shape[:-1]
        x2 = _flat(x)
        scale_a = torch.ones((x2.shape[0], 1), dtype=torch.float32, device=x2.device) if per_channel else one
        y = torch._scaled_mm(x2, w_t, scale_a=scale_a, scale_b=scale_b, bias=bias if bias_in_gemm else None,
                             out_dtype=out, use_fast_accum=fast_accum)  # [M, N]: x_scale·w_scale·Σ x·w (+ bias)
        if bias is not None and not bias_in_gemm:
            y.add_(bias)
        if activation == "Relu":
            y.relu_()
        elif activation == "Clip":
            y.clamp_(alpha, beta)
        elif activation in ("Gelu", "GeluTanh"):
            y = F.gelu(y, approximate="tanh" if activation == "GeluTanh" else "none")
        return y.reshape(*lead, n)

    return launch


for _fast, _note in _FAST_ACCUM.items():
    register(Tactic(
        name="cuda.qgemm.scaled_mm_direct" + (".fast_accum" if _fast else ""), op_type="QGemm", domain="kiln",
        device="cuda", dtypes=(FP8,), supports=_direct_supports, prepare=partial(_prepare_direct, fast_accum=_fast),
        available=_scaled_mm_available,
        description="cuBLASLt FP8 GEMM with x_scale·w_scale (per tensor, or row-wise for bf16) and the bias in "
                    "cuBLASLt, the float output written by it; Relu/Clip in place, Gelu in one torch pass" + _note,
    ))


# cuBLASLt writes x_scale·w_scale·Σ x·w in half precision (2 bytes per output where `scaled_mm` writes fp32's 4),
# then one Triton pass adds the bias in fp32, applies the activation and quantizes: an FFN up projection's
# Gelu -> fp8 output, which cuBLASLt's epilogue cannot write. fp16 (11 bits) where the weight scale is per tensor;
# per channel, cuBLASLt's row-wise scaling writes bfloat16 only (8 bits: near a tie of the 3-bit E4M3 grid the
# result may be one step off, which the builder's check allows). The half-precision product must not overflow:
# prepare refuses a layer whose largest output (y_scale·448) is not far inside fp16's range.
_HALF_LIMIT = 2.0**13


def _half_supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    common = _scaled_mm_supports(step, inputs)
    if common is not True:
        return common
    if output_dtype(step, inputs) not in QUANTIZED and not _product(inputs):
        return "a float output: cuda.qgemm.scaled_mm_direct writes it in one GEMM"
    return True  # the fp16 range is checked at prepare, where y_scale's value is read


def _prepare_half(step: StepSpec, constants: list[Any], device: torch.device, fast_accum: bool = False):
    requantize = kernels("qelementwise").requantize
    layer = QuantizedLayer.of(step, constants, device)
    w_t = layer.w.contiguous().t()  # [K, N] column-major
    n = w_t.shape[1]
    per_channel = constants[4].numel() > 1
    largest = (layer.product_scale if layer.quantized_product else layer.y_scale) * 448.0  # what is rounded
    if not per_channel and largest > _HALF_LIMIT:
        raise ValueError(f"{step.name}: outputs up to {largest:g} (the scale the product is quantized at x 448) "
                         "would overflow the fp16 product")
    half = torch.bfloat16 if per_channel else torch.float16
    scale_b = layer.channel_scale.reshape(1, n) if per_channel else layer.channel_scale[:1].reshape(())
    ones = torch.ones(n, dtype=torch.float32, device=device)
    real_bias = None if layer.bias is None else (layer.bias.to(torch.float64) * layer.w_scale * layer.x_scale)
    epilogue = layer.epilogue(ones, None if real_bias is None else real_bias.to(torch.float32))
    one = torch.ones((), dtype=torch.float32, device=device)

    def launch(ctx, x, *_inputs, **_attributes):
        lead = x.shape[:-1]
        x2 = _flat(x)
        scale_a = torch.ones((x2.shape[0], 1), dtype=torch.float32, device=x2.device) if per_channel else one
        product = torch._scaled_mm(x2, w_t, scale_a=scale_a, scale_b=scale_b, out_dtype=half,
                                   use_fast_accum=fast_accum)  # [M, N] real, no bias
        return requantize(product, epilogue, -1).reshape(*lead, n)

    return launch


for _fast, _note in _FAST_ACCUM.items():
    register(Tactic(
        name="cuda.qgemm.scaled_mm_half" + (".fast_accum" if _fast else ""), op_type="QGemm", domain="kiln",
        device="cuda", dtypes=(FP8,), supports=_half_supports, prepare=partial(_prepare_half, fast_accum=_fast),
        available=_scaled_mm_available, checker=product_layer_checker,
        description="cuBLASLt FP8 GEMM with x_scale·w_scale, fp16 (bf16 per channel) out, then bias (fp32) / "
                    "Relu / Clip / Gelu / quantization in one Triton pass: an 8-bit output after any activation"
                    + _note,
    ))


# ---- the float layer ---------------------------------------------------------------------------------

def _prepare_dequantized(step: StepSpec, constants: list[Any], device: torch.device):
    qelementwise = kernels("qelementwise")
    layer = QuantizedLayer.of(step, constants, device)
    w_real = layer.real_weight(torch.float16).contiguous()  # [N, K]
    epilogue = layer.real_epilogue()
    x_scale, x_zero = layer.x_scale, layer.x_zero

    def launch(ctx, x, *_inputs, **_attributes):
        xf = qelementwise.dequantize(x, x_scale, x_zero, torch.float16)  # [..., K] real values
        return qelementwise.requantize(F.linear(xf, w_real), epilogue, -1)

    return launch


register(Tactic(
    name="cuda.qgemm.dequantized", op_type="QGemm", domain="kiln", device="cuda", dtypes=QUANTIZED,
    supports=_supports, prepare=_prepare_dequantized, available=triton_available, checker=product_layer_checker,
    description="the float layer: x dequantized to fp16 (one pass), cuBLAS fp16 GEMM on the dequantized weight, "
                "then bias (fp32) / Relu / requantization in one Triton pass",
))
