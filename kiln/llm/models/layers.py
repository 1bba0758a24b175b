"""The pieces decoder models are made of: tensor-parallel linear layers and embedding, RMSNorm, RoPE.

Linear layers keep their full-size weights' slice for this rank and load from the checkpoint's full
tensors (`load`), so the same model code runs on one device or split over several. Their full-precision
weight is allocated when a full-precision tensor is loaded into it (`materialize_weight`): a pre-quantized
checkpoint's layers never hold one (an int4 70B model does not first take a bf16 70B model's memory).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kiln.llm.config import LLMError, RopeConfig
from kiln.llm.parallel import TensorParallel
from kiln.llm.prequantized.tensor import QuantizedTensor

# the fused Triton kernels (kiln/llm/kernels/fused.py) on CUDA; KILN_LLM_FUSED=0: the torch code everywhere
FUSED = os.environ.get("KILN_LLM_FUSED", "1") != "0"


@dataclass
class FP8Rows:
    """Activations already quantized per token for an FP8 GEMM (torch._scaled_mm) by the kernel that made them
    (the norm before a projection, SwiGLU before down): E4M3 values [T, K], fp32 scales [T, 1], and the dtype the
    rows had before (the GEMM's output dtype)."""

    values: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def takes_fp8_rows(linear: ColumnLinear | RowLinear, rows: int) -> bool:
    """Whether `linear` multiplies `rows` activation rows by torch._scaled_mm with per-token scales, so the kernel
    making its input may hand it FP8Rows (quantized in the same pass) instead of bf16 rows it would quantize."""
    fp8 = getattr(linear.quantized, "use_scaled_mm", False)  # an FP8Weight on a GPU with FP8 tensor cores
    return FUSED and fp8 and (linear.decode_gemv is None or linear.decode_gemv.config_for(rows) is None)


class ColumnLinear(nn.Module):
    """y = x·Wᵀ + b, W's output features split by rank. `parts` lists the logical outputs fused into
    one GEMM (q, k, v; gate, up): each is split by rank on its own, so a rank holds its slice of each."""

    def __init__(self, in_features: int, parts: list[int], bias: bool, tp: TensorParallel, what: str):
        super().__init__()
        self.tp = tp
        self.parts, self.in_features = parts, in_features
        self.slices = [tp.shard(p, f"{what} output part {i}") for i, p in enumerate(parts)]
        self.offsets = [sum(size for _, size in self.slices[:i]) for i in range(len(parts))]
        local = sum(size for _, size in self.slices)
        self.device = torch.get_default_device()
        # allocated by materialize_weight when a full-precision tensor arrives
        self.weight = nn.Parameter(torch.empty(local, in_features, device="meta"), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(local), requires_grad=False) if bias else None
        self.quantized: nn.Module | None = None  # set by kiln/llm/quantization.py (the weight is then None)
        self.checkpoint_parts: dict[int, QuantizedTensor] = {}  # pre-quantized parts, until they are attached
        self.decode_gemv = None  # kernels/gemv.py's DecodeGemv where kiln/llm/decode_gemv.py chose it for decode rows

    def load(self, kind: str, tensor: torch.Tensor | QuantizedTensor, part: int = 0) -> None:
        """Load this rank's slice of the checkpoint's full `kind` ("weight" or "bias") of one fused part."""
        start, size = self.slices[part]
        if isinstance(tensor, QuantizedTensor):  # kept quantized: quantization.attach_checkpoint_weights
            if list(tensor.shape) != [self.parts[part], self.in_features]:
                raise LLMError(f"part {part}: expected {[self.parts[part], self.in_features]}, "
                               f"got {list(tensor.shape)}")
            self.checkpoint_parts[part] = tensor.rows(start, size).to(self.device)
            return
        if kind == "weight":
            materialize_weight(self)
        offset = self.offsets[part]
        target = getattr(self, kind).data[offset:offset + size]
        source = tensor[start:start + size]
        if source.shape != target.shape:
            raise LLMError(f"part {part}: expected {list(target.shape)} (of {self.slices[part]}), got "
                             f"{list(tensor.shape)}")
        target.copy_(source)

    def forward(self, x: torch.Tensor | FP8Rows) -> torch.Tensor:
        if self.decode_gemv is not None and not isinstance(x, FP8Rows):
            y = self.decode_gemv(x, self.bias)  # None: these rows run the layer's own path
            if y is not None:
                return y
        if self.quantized is None:
            return F.linear(x, self.weight, self.bias)
        y = self.quantized(x)
        return y if self.bias is None else y + self.bias


class RowLinear(nn.Module):
    """y = x·Wᵀ + b, W's input features split by rank: partial sums all-reduced, bias added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel, what: str):
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.start, local = tp.shard(in_features, f"{what} input")
        self.device = torch.get_default_device()
        # allocated by materialize_weight when a full-precision tensor arrives
        self.weight = nn.Parameter(torch.empty(out_features, local, device="meta"), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.quantized: nn.Module | None = None
        self.checkpoint_parts: dict[int, QuantizedTensor] = {}
        self.decode_gemv = None  # as ColumnLinear's

    def load(self, kind: str, tensor: torch.Tensor | QuantizedTensor) -> None:
        full = [self.weight.shape[0]] + ([self.in_features] if kind == "weight" else [])
        if list(tensor.shape) != full:
            raise LLMError(f"expected {full}, got {list(tensor.shape)}")
        if isinstance(tensor, QuantizedTensor):  # kept quantized: quantization.attach_checkpoint_weights
            self.checkpoint_parts[0] = tensor.columns(self.start, self.weight.shape[1]).to(self.device)
            return
        if kind == "weight":
            materialize_weight(self)
            tensor = tensor[:, self.start:self.start + self.weight.shape[1]]
        getattr(self, kind).data.copy_(tensor)

    def forward(self, x: torch.Tensor | FP8Rows) -> torch.Tensor:
        y = self.decode_gemv(x) if self.decode_gemv is not None and not isinstance(x, FP8Rows) else None
        if y is None:
            y = F.linear(x, self.weight) if self.quantized is None else self.quantized(x)
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


def materialize_weight(linear: ColumnLinear | RowLinear) -> None:
    """Allocate the layer's full-precision weight (built on the meta device) on its device."""
    if linear.weight is not None and linear.weight.is_meta:
        linear.weight = nn.Parameter(torch.empty(linear.weight.shape, dtype=linear.weight.dtype, device=linear.device),
                                     requires_grad=False)


class VocabEmbedding(nn.Module):
    """Token embedding with the vocabulary split by rank (rows past the vocabulary are zero padding)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows = math.ceil(vocab_size / tp.size)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.zeros(self.rows, hidden_size), requires_grad=False)
        self.decode_gemv = None  # as ColumnLinear's, for the logits of the LM head

    def load(self, kind: str, tensor: torch.Tensor) -> None:
        if tensor.shape[0] != self.vocab_size or tensor.shape[1:] != self.weight.shape[1:]:
            raise LLMError(f"expected [{self.vocab_size}, {self.weight.shape[1]}], got {list(tensor.shape)}")
        part = tensor[self.start:self.start + self.rows]
        self.weight.data[:part.shape[0]].copy_(part)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(token_ids, self.weight)
        local = token_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """hidden·Eᵀ over this rank's rows, gathered over ranks: [R, H] -> [R, vocab] (fp32)."""
        local = self.decode_gemv(hidden) if self.decode_gemv is not None and weight is None else None
        if local is None:
            local = F.linear(hidden, self.weight if weight is None else weight)
        local = local.float()
        return self.tp.all_gather_last(local)[..., :self.vocab_size]


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · w, accumulated in fp32 whatever the storage dtype (as transformers)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)

    def forward(self, x: torch.Tensor, fp8: bool = False) -> torch.Tensor | FP8Rows:
        """fp8: the reader is an FP8 GEMM (takes_fp8_rows): the rows come quantized, in the same pass on CUDA."""
        if FUSED and x.is_cuda and x.dim() == 2:
            from kiln.llm.kernels.fused import rms_norm, rms_norm_fp8  # here: a CPU run never imports triton
            if fp8:
                _, values, scale = rms_norm_fp8(x, None, self.weight, self.eps)
                return FP8Rows(values, scale, x.dtype)
            return rms_norm(x, self.weight, self.eps)
        if fp8:
            raise LLMError("RMSNorm: FP8 rows are made by the fused CUDA kernel only (takes_fp8_rows says when)")
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor,
                    fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor | FP8Rows]:
        """(x + delta, norm(x + delta)): the residual add and the next norm, one kernel on CUDA (fp8: as forward's)."""
        if FUSED and x.is_cuda and x.dim() == 2:
            from kiln.llm.kernels.fused import add_rms_norm, rms_norm_fp8
            if fp8:
                total, values, scale = rms_norm_fp8(x, delta, self.weight, self.eps)
                return total, FP8Rows(values, scale, x.dtype)
            return add_rms_norm(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self.forward(x, fp8)


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """RoPE's inverse frequencies [head_dim/2] and the cos/sin scale, as transformers computes them
    (modeling_rope_utils: default, linear, llama3, yarn)."""
    dim = head_dim
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.kind == "default":
        return inv_freq, 1.0
    if rope.kind == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.kind == "llama3":
        old = rope.original_max_position or max_position
        low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)  # long waves: / factor
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled  # in between: interpolate
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn: extrapolate short wavelengths, interpolate long ones, ramp between; scale cos/sin
    factor, original = rope.factor, rope.original_max_position or max_position

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        attention_factor = (mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
                            if rope.mscale and rope.mscale_all_dim else mscale(factor))

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class Rotary(nn.Module):
    """Rotary position embedding (the half-split layout of transformers' rotate_half), with a cos/sin
    table for every position up to max_position computed once in fp32."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position: int, model_max_position: int):
        super().__init__()
        inv_freq, scale = rope_inverse_frequencies(rope, head_dim, model_max_position)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [P, D/2]
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        out = []
        for x in xs:  # [T, H, D]
            x1, x2 = x.float().chunk(2, dim=-1)
            out.append(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype))
        return out
