"""Weight quantization of the decoder's linear layers, gpt-fast's way: rewrite the weights, then swap
the module. After loading, every q/k/v, o, gate/up and down projection keeps its weight quantized and
multiplies through a small module (`layer.quantized`); embeddings, norms and the LM head stay as loaded.

    fp8   E4M3 with one scale per output channel (s = max|w| / 448). On a GPU with FP8 tensor cores
          (compute capability >= 8.9) activations are quantized per token on the fly and the GEMM is
          torch._scaled_mm; elsewhere the weight is dequantized to the activation dtype.
    int8  weight-only, symmetric per output channel (s = max|w| / 127): y = (x · qᵀ) · s.
    int4  weight-only, asymmetric per group of `group_size` input features (scale and zero point per
          group), two values packed per byte: w ≈ (q - z) · s.

On the CPU the weight is dequantized, then multiplied (the reference); on CUDA int8 and int4 go through
the Triton weight-only GEMM (kernels/quant_gemm.py), which dequantizes tiles in registers. Checkpoints
already quantized (compressed-tensors, AutoAWQ) are not read yet.
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
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX  # [out]
        self.register_buffer("q", (w / scale[:, None]).to(torch.float8_e4m3fn))  # [out, in]
        self.register_buffer("scale", scale)
        self.use_scaled_mm = (weight.is_cuda and torch.cuda.get_device_capability(weight.device) >= (8, 9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("q", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from kiln.llm.kernels.quant_gemm import int8_gemm  # here: a CPU run never imports triton
            return int8_gemm(x, self.q, self.scale)
        return F.linear(x, self.q.to(x.dtype)) * self.scale.to(x.dtype)


class Int4Weight(nn.Module):
    def __init__(self, weight: torch.Tensor, group_size: int = 128):
        super().__init__()
        out_features, in_features = weight.shape
        group_size = min(group_size, in_features)
        if in_features % group_size or in_features % 2:
            raise LLMError(f"int4: input features {in_features} are not a multiple of the group size {group_size}")
        self.group_size = group_size
        w = weight.float().view(out_features, in_features // group_size, group_size)
        low, high = w.amin(dim=-1), w.amax(dim=-1)  # [out, groups]
        scale = ((high - low) / 15.0).clamp(min=1e-12)
        zero = torch.round(-low / scale).clamp(0, 15)
        q = (torch.round(w / scale[..., None]) + zero[..., None]).clamp(0, 15).to(torch.uint8).view(out_features, -1)
        self.register_buffer("packed", q[:, 0::2] | (q[:, 1::2] << 4))  # [out, in/2]: even index in the low nibble
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        low, high = self.packed & 0xF, self.packed >> 4
        q = torch.stack((low, high), dim=-1).view(self.packed.shape[0], -1, self.group_size).float()
        return ((q - self.zero[..., None]) * self.scale[..., None]).view(self.packed.shape[0], -1).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from kiln.llm.kernels.quant_gemm import int4_gemm  # here: a CPU run never imports triton
            return int4_gemm(x, self.packed, self.scale, self.zero, self.group_size)
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
                module.quantized = FP8Weight(weight)
            elif method == "int8":
                module.quantized = Int8Weight(weight)
            else:
                module.quantized = Int4Weight(weight, group_size)
            module.weight = None  # the full-precision copy is gone
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
