"""Reduced precision (fp16 / bf16): weights and activations stored in half precision.

Applied to the lowered program: float32 weights become half (except the few inputs that
carry coordinates rather than activations: Resize's roi and scales), Cast-to-float becomes
Cast-to-half, and the engine's float32 inputs/outputs keep their float32 bindings — the
runtime casts at the boundary, as TensorRT does. Reductions, softmax and normalisations
accumulate in fp32 inside torch's half kernels (and kiln's fused ones), whatever the storage.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.ops.fused import quantization_scales
from kiln.ops.quantized import QUANTIZED_LAYERS
from kiln.plan.spec import ProgramSpec

HALF = {"fp16": (torch.float16, "float16", 10), "bf16": (torch.bfloat16, "bfloat16", 16)}
FLOAT_ID = 1
# (op, input index) pairs that must stay float32: they are coordinates, not activations.
KEEP_FP32_INPUTS = {("Resize", 1), ("Resize", 2), ("Upsample", 1), ("GridSample", 1), ("RoiAlign", 1)}
# ... and the scales of explicit quantization (kiln/ops/quantized.py's and ONNX's Q/DQ): a Q/DQ graph is honoured
# exactly (DESIGN.md's strongly typed precision). Rounded to fp16 (11 bits) a scale moves every requantized value by
# up to ~5e-4 of itself (0.06 of a step at 127), flipping roundings that onnxruntime's float32 scales do not; every
# kernel reads them as host numbers once, at prepare, so they cost nothing in float32.
QUANTIZATION_SCALES = {("QuantizeLinear", 1), ("DequantizeLinear", 1), ("QConv", 1), ("QConv", 4), ("QConv", 6),
                       ("QConv", 10), ("QConv", 12), ("QGemm", 1), ("QGemm", 4), ("QGemm", 6), ("QAdd", 1),
                       ("QAdd", 4), ("QAdd", 6), ("LayerNormQuantize", 4),
                       ("LayerNormQuantize", 6), ("QGemm", 9)}


def lower_precision(program: ProgramSpec, weights: dict[str, Any], precision: str,
                    pinned: set[str] | None = None) -> dict[str, str]:
    """Convert in place; returns the boundary casts {binding name: internal dtype name}."""
    torch_dtype, name, onnx_id = HALF[precision]

    def is_pinned(step) -> bool:  # a pinned ONNX node keeps fp32 also when a fusion absorbed it
        return bool(pinned) and (step.name in pinned or bool(pinned.intersection(step.fused_from)))

    keep: set[str] = set()
    readers: dict[str, list[bool]] = {}
    for step in program.steps:
        scales = quantization_scales(step.attributes.get("code", ())) if step.op_type == "Elementwise" else set()
        for i, value in enumerate(step.inputs):
            if (step.op_type, i) in KEEP_FP32_INPUTS | QUANTIZATION_SCALES or i in scales:
                keep.add(value)
            readers.setdefault(value, []).append(is_pinned(step))
    # Weights only pinned layers read stay fp32: pinning should not start from rounded weights.
    keep |= {value for value, pins in readers.items() if all(pins)}
    key_of = dict(program.constants)
    keep_keys = {key_of.get(v, v) for v in keep}
    for key, w in list(weights.items()):
        if isinstance(w, torch.Tensor) and w.dtype == torch.float32 and key not in keep_keys:
            weights[key] = w.to(torch_dtype)
    for step in program.steps:
        if is_pinned(step):
            step.precision = "fp32"
            continue
        if step.op_type == "Cast" and step.attributes.get("to") == FLOAT_ID:
            step.attributes["to"] = onnx_id
        if step.op_type == "DequantizeLinear" and not step.attributes.get("output_dtype") and \
                step.output_dtypes[:1] == ["float"]:
            # its output type is its scale's, which stays float32 (QUANTIZATION_SCALES): the engine's storage type
            step.attributes["output_dtype"] = onnx_id
        if step.op_type == "Elementwise" and step.attributes.get("output_dtype") == FLOAT_ID:
            step.attributes["output_dtype"] = onnx_id  # its Dequantize lines' scales stay float32, as DQ's
        if step.domain == "kiln" and step.op_type in QUANTIZED_LAYERS and \
                step.attributes.get("output_dtype", FLOAT_ID) == FLOAT_ID:
            # a quantized layer's float output (no y_scale: a float reader) is written in the storage dtype: a
            # float32 one would meet half-precision weights in its readers (a LayerNorm's γ)
            step.attributes["output_dtype"] = onnx_id
        for attr in ("dtype",):
            if step.attributes.get(attr) == FLOAT_ID and step.op_type in (
                "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "EyeLike", "Multinomial"
            ):
                step.attributes[attr] = onnx_id
        step.output_dtypes = [name if d == "float" else d for d in step.output_dtypes]
    return {"float": name}


# Layers whose tactics can store their fp32 result from the fp32 accumulator (kiln::FusedGemm's output_float32).
FLOAT32_WRITERS = {("kiln", "FusedGemm")}


def write_float32_outputs(program: ProgramSpec, precision: str, pinned: set[str] | None = None) -> None:
    """A GEMM that produces one of the engine's float outputs, and that nothing else reads, stores it in fp32
    itself (output_float32): the boundary cast of the half result, a pass over the whole output (a decoder's
    logits: 371 us of Phi-3 small's 1.36 ms at 8 x 512 on the H200, an unvectorised copy), becomes a no-op.
    CUDA builds (the builder's call): there the GEMM tactics store fp32 from their accumulators; the CPU's do not."""
    half = HALF[precision][1]
    pinned = pinned or set()
    read = {value for step in program.steps for value in step.inputs}
    outputs = set(program.outputs)
    for step in program.steps:
        if (step.domain, step.op_type) not in FLOAT32_WRITERS or step.precision or step.name in pinned:
            continue
        out = step.outputs[0] if step.outputs else ""
        if out in outputs and out not in read and step.output_dtypes[:1] == [half]:  # a float output made half
            step.attributes["output_float32"] = 1
            step.output_dtypes[0] = "float"


def allow_fp8_attention(program: ProgramSpec, scales: dict[str, float]) -> int:
    """Each kiln::Attention that kiln's FP8 calibration measured (kiln/quant/attention.py, keyed by the name the
    fused step inherits) gets its E4M3 scale as `fp8_scale`: the E4M3 tactics may then run it, timed against the
    fp16 ones. Returns how many steps got one."""
    allowed = 0
    for step in program.steps:
        if step.domain == "kiln" and step.op_type == "Attention" and step.name in scales:
            step.attributes["fp8_scale"] = scales[step.name]
            allowed += 1
    return allowed
