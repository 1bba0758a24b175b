"""GPTQ's layout (quant_method "gptq": AutoGPTQ, GPTQModel, optimum), 4 or 8 bits, groups of input features
(n = 32 / bits values a word):

    qweight [in/n, out]       int32: word r of column o holds inputs n·r .. n·r+n-1 in its nibbles (bytes) 0..n-1
    qzeros  [groups, out/n]   int32: zero points, outputs n·j .. n·j+n-1 in word j, sequentially
    scales  [groups, out]     fp16
    g_idx   [in]              int32: the group of each input row (i // group_size without act-order)
    w[o, k] = (q[k, o] - zero[g, o]) · s[g, o],  g = k // group_size

The classic checkpoint_format "gptq" stores zero - 1 (AutoGPTQ's packer; its kernels add the 1 back, so a
stored 15 reads as 16), "gptq_v2" (GPTQModel) stores the zero itself. group_size -1: one group (per channel).
desc_act (act-order) checkpoints have a g_idx that is not sorted: refused (kiln's kernels want contiguous
groups; permuting the input of every fused part differently is not supported).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.llm.config import LLMError
from kiln.llm.prequantized.base import CheckpointFormat, unpack_int32
from kiln.llm.prequantized.tensor import QuantizedTensor


@dataclass
class GPTQ(CheckpointFormat):
    group_size: int  # -1: one group over the whole input
    zero_offset: int  # added to the stored zero: 1 for checkpoint_format "gptq", 0 for "gptq_v2"
    bits: int = 4
    name = "gptq"
    components = ("qweight", "qzeros", "scales")

    @classmethod
    def from_config(cls, config: dict, source: str) -> GPTQ:
        bits = config.get("bits")
        if bits not in (4, 8):
            raise LLMError(f"{source}: GPTQ with {bits} bits is not supported (4 or 8 bits)")
        if config.get("desc_act"):
            raise LLMError(f"{source}: GPTQ with desc_act (act-order: input rows reordered into groups by g_idx) is "
                           "not supported; use a checkpoint quantized with desc_act false")
        checkpoint_format = str(config.get("checkpoint_format", "gptq")).lower()
        if config.get("is_marlin_format") or checkpoint_format not in ("gptq", "gptq_v2"):
            raise LLMError(f"{source}: GPTQ checkpoint_format {checkpoint_format!r} is not supported "
                           "(\"gptq\" or \"gptq_v2\")")
        group = config.get("group_size", 128)
        if not isinstance(group, int) or (group <= 0 and group != -1):
            raise LLMError(f"{source}: GPTQ group_size {group!r}: expected a positive group or -1")
        return cls(group, 1 if checkpoint_format == "gptq" else 0, bits)

    def drops(self, component: str, tensor: torch.Tensor, layer: str) -> bool:
        if component != "g_idx":
            return False
        group = self.group_size if self.group_size > 0 else tensor.shape[0]
        if not torch.equal(tensor.long(), torch.arange(tensor.shape[0]) // group):
            raise LLMError(f"{layer}.g_idx is not i // group_size ({group}): the checkpoint reorders input rows "
                           "(act-order), which kiln does not support")
        return True

    def unpack(self, group: dict[str, torch.Tensor], layer: str) -> QuantizedTensor:
        qweight, qzeros, scales = group["qweight"], group["qzeros"], group["scales"]
        per_word = 32 // self.bits
        in_features, out_features = qweight.shape[0] * per_word, qweight.shape[1]
        size = self.group_size if self.group_size > 0 else in_features
        groups = in_features // size
        if (in_features % size or list(qzeros.shape) != [groups, out_features // per_word]
                or list(scales.shape) != [groups, out_features] or qweight.dtype != torch.int32):
            raise LLMError(f"{layer}: GPTQ tensors qweight {list(qweight.shape)} {qweight.dtype}, qzeros "
                           f"{list(qzeros.shape)}, scales {list(scales.shape)} do not fit groups of {size} "
                           f"at {self.bits} bits (expected qweight [in/{per_word}, out] int32, qzeros "
                           f"[groups, out/{per_word}], scales [groups, out])")
        values = unpack_int32(qweight, self.bits, dim=0).t()  # [out, in]
        zero = (unpack_int32(qzeros, self.bits, dim=1) + self.zero_offset).t().float().contiguous()  # [out, groups]
        scale = scales.t().float().contiguous()
        if self.bits == 8:
            return QuantizedTensor("int8-group", values.to(torch.uint8).contiguous(), scale, zero, size,
                                   f"{layer} (gptq)")
        return QuantizedTensor.int4(values, scale, zero, size, f"{layer} (gptq)")
