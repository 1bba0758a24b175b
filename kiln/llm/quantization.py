"""Weight quantization of the decoder's linear layers, gpt-fast's way: rewrite the weights, then swap
the module. After loading, every q/k/v, o, gate/up and down projection keeps its weight quantized and
multiplies through a small module (`layer.quantized`); embeddings, norms and the LM head stay as loaded.

    fp8   E4M3 with one scale per output channel (s = max|w| / 448). On a GPU with FP8 tensor cores
          (compute capability >= 8.9) activations are quantized per token on the fly and the GEMM is
          torch._scaled_mm; elsewhere the weight is dequantized to the activation dtype.
    int8  weight-only, symmetric per output channel (s = max|w| / 127): y = (x · qᵀ) · s.
    int4  weight-only, asymmetric per group of `group_size` input features (scale and zero point per
          group), two values packed per byte: w ≈ (q - z) · s.
    (Int8GroupWeight holds pre-quantized 8-bit checkpoints with per-group scales and zero points; kiln does
    not quantize to it.)

On the CPU the weight is dequantized, then multiplied (the reference); on CUDA int8 and int4 go through
the Triton weight-only GEMM (kernels/quant_gemm.py), which dequantizes tiles in registers. A decode step's
rows may instead run the weight-only decode GEMV (kernels/gemv.py) on fp8 and int8 weights, where timing at
engine start found it faster (kiln/llm/decode_gemv.py). Checkpoints
already quantized (AutoAWQ, GPTQ, compressed-tensors: kiln/llm/prequantized) load into the same modules with
their own values, scales and zero points (attach_checkpoint_weights), nothing re-rounded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.llm.config import LLMError
from kiln.llm.models import layers
from kiln.llm.models.layers import ColumnLinear, RowLinear

METHODS = ("fp8", "int8", "int4")
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class FP8Weight(nn.Module):
    """q: [out, in] float8_e4m3fn, scale: [out] fp32; w = q · scale."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)
        self.use_scaled_mm = q.is_cuda and torch.cuda.get_device_capability(q.device) >= (8, 9)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> FP8Weight:
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX  # [out]
        return cls((w / scale[:, None]).to(torch.float8_e4m3fn), scale)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor | layers.FP8Rows) -> torch.Tensor:
        if isinstance(x, layers.FP8Rows):  # quantized by the kernel that made them (layers.takes_fp8_rows)
            return torch._scaled_mm(x.values, self.q.t(), scale_a=x.scale, scale_b=self.scale[None, :],
                                    out_dtype=x.dtype)
        if self.use_scaled_mm:
            if layers.FUSED:
                from kiln.llm.kernels.fused import fp8_quantize_rows  # one kernel for the per-token scales
                x_q, x_scale = fp8_quantize_rows(x, FP8_MAX)
            else:
                x_scale = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # [T, 1] per token
                x_q = (x.float() / x_scale).to(torch.float8_e4m3fn)
            return torch._scaled_mm(x_q, self.q.t(), scale_a=x_scale, scale_b=self.scale[None, :], out_dtype=x.dtype)
        return F.linear(x, self.q.to(x.dtype)) * self.scale.to(x.dtype)


class Int8Weight(nn.Module):
    """q: [out, in] int8, scale: [out] fp32; w = q · scale."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        return cls(torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from kiln.llm.kernels.quant_gemm import int8_gemm  # here: a CPU run never imports triton
            return int8_gemm(x, self.q, self.scale)
        return F.linear(x, self.q.to(x.dtype)) * self.scale.to(x.dtype)


class Int4Weight(nn.Module):
    """packed: [out, in/2] uint8 (input feature 2i in the low nibble of byte i, 2i+1 in the high one);
    scale, zero: [out, in/group_size] fp32; w = (q - zero) · scale."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int):
        super().__init__()
        self.group_size = group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)

    @classmethod
    def quantize(cls, weight: torch.Tensor, group_size: int = 128) -> Int4Weight:
        out_features, in_features = weight.shape
        group_size = min(group_size, in_features)
        if in_features % group_size or in_features % 2:
            raise LLMError(f"int4: input features {in_features} are not a multiple of the group size {group_size}")
        w = weight.float().view(out_features, in_features // group_size, group_size)
        low, high = w.amin(dim=-1), w.amax(dim=-1)  # [out, groups]
        scale = ((high - low) / 15.0).clamp(min=1e-12)
        zero = torch.round(-low / scale).clamp(0, 15)
        q = (torch.round(w / scale[..., None]) + zero[..., None]).clamp(0, 15).to(torch.uint8).view(out_features, -1)
        return cls(q[:, 0::2] | (q[:, 1::2] << 4), scale, zero, group_size)  # even input features in the low nibble

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        low, high = self.packed & 0xF, self.packed >> 4
        q = torch.stack((low, high), dim=-1).view(self.packed.shape[0], -1, self.group_size).float()
        return ((q - self.zero[..., None]) * self.scale[..., None]).view(self.packed.shape[0], -1).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from kiln.llm.kernels.quant_gemm import int4_gemm  # here: a CPU run never imports triton
            return int4_gemm(x, self.packed, self.scale, self.zero, self.group_size)
        return F.linear(x, self.dequantize(x.dtype))


class Int8GroupWeight(nn.Module):
    """8-bit weight-only with a scale and zero point per group, as pre-quantized 8-bit GPTQ and group-wise or
    asymmetric compressed-tensors checkpoints store it (kiln's own int8 is symmetric per channel):
    q: [out, in] uint8, scale, zero: [out, in/group_size] fp32; w = (q - zero) · scale."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int):
        super().__init__()
        self.group_size = group_size
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        q = self.q.float().view(self.q.shape[0], -1, self.group_size)
        return ((q - self.zero[..., None]) * self.scale[..., None]).view(self.q.shape).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from kiln.llm.kernels.quant_gemm import uint8_group_gemm  # here: a CPU run never imports triton
            return uint8_group_gemm(x, self.q, self.scale, self.zero, self.group_size)
        return F.linear(x, self.dequantize(x.dtype))


def quantize_model(model: nn.Module, method: str, group_size: int = 128) -> int:
    """Quantize every projection of `model` in place; returns how many layers were quantized."""
    if method not in METHODS:
        raise LLMError(f"quantization {method!r}: expected one of {', '.join(METHODS)}")
    count = 0
    for module in model.modules():
        if isinstance(module, (ColumnLinear, RowLinear)) and module.quantized is None:
            weight = module.weight.data
            if method == "fp8":
                module.quantized = FP8Weight.quantize(weight)
            elif method == "int8":
                module.quantized = Int8Weight.quantize(weight)
            else:
                module.quantized = Int4Weight.quantize(weight, group_size)
            module.weight = None  # the full-precision copy is gone
            count += 1
    return count


def attach_checkpoint_weights(model: nn.Module) -> int:
    """After loading a pre-quantized checkpoint (kiln/llm/prequantized): give every projection whose parts
    arrived quantized the module that multiplies them, its parts' values, scales and zero points stacked
    along the output features (each part keeps its own); returns how many layers."""
    count = 0
    for path, module in model.named_modules():
        if not isinstance(module, (ColumnLinear, RowLinear)) or not module.checkpoint_parts:
            continue
        parts = [module.checkpoint_parts.get(i) for i in range(len(getattr(module, "slices", [None])))]
        if any(p is None for p in parts):
            raise LLMError(f"{path}: some of its fused parts are quantized in the checkpoint and some are not "
                           f"({[p is not None for p in parts]}); kiln fuses them into one GEMM, so all or none")
        methods = {(p.method, p.group_size if p.zero is not None else 0) for p in parts}
        if len(methods) != 1:
            raise LLMError(f"{path}: its fused parts are quantized differently ({sorted(methods)}): "
                           "kiln fuses them into one GEMM with one method and group size")
        # each part already on the module's device; row-major, as the Triton GEMMs read them
        values = torch.cat([p.values for p in parts]).contiguous()
        scale = torch.cat([p.scale for p in parts]).contiguous()
        if parts[0].method == "int4":
            zero = torch.cat([p.zero for p in parts]).contiguous()
            module.quantized = Int4Weight(values, scale, zero, parts[0].group_size)
        elif parts[0].method == "int8-group":
            zero = torch.cat([p.zero for p in parts]).contiguous()
            module.quantized = Int8GroupWeight(values, scale, zero, parts[0].group_size)
        elif parts[0].method == "int8":
            module.quantized = Int8Weight(values, scale[:, 0].contiguous())
        else:
            module.quantized = FP8Weight(values, scale[:, 0].contiguous())
        module.weight = None
        module.checkpoint_parts = {}
        count += 1
    return count


def weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters and buffers that hold weights (the roofline's numerator)."""
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total
