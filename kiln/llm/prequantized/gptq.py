"""GPTQ's layout (quant_method "gptq": AutoGPTQ, GPTQModel, optimum), 4 bits, groups of input features:

    qweight [in/8, out]       int32: word r of column o holds inputs 8r .. 8r+7 in nibbles 0..7 (sequential)
    qzeros  [groups, out/8]   int32: zero points, outputs 8j .. 8j+7 in nibbles 0..7 of word j
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
    name = "gptq"
    components = ("qweight", "qzeros", "scales")

    @classmethod
    def from_config(cls, config: dict, source: str) -> GPTQ:
        bits = config.get("bits")
        if bits != 4:
            raise LLMError(f"{source}: GPTQ with {bits} bits is not supported (4 bits)")
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
        return cls(group, 1 if checkpoint_format == "gptq" else 0)

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
        in_features, out_features = qweight.shape[0] * 8, qweight.shape[1]
        size = self.group_size if self.group_size > 0 else in_features
        groups = in_features // size
        if (in_features % size or list(qzeros.shape) != [groups, out_features // 8]
                or list(scales.shape) != [groups, out_features] or qweight.dtype != torch.int32):
            raise LLMError(f"{layer}: GPTQ tensors qweight {list(qweight.shape)} {qweight.dtype}, qzeros "
                           f"{list(qzeros.shape)}, scales {list(scales.shape)} do not fit groups of {size} "
                           f"(expected qweight [in/8, out] int32, qzeros [groups, out/8], scales [groups, out])")
        values = unpack_int32(qweight, 4, dim=0).t()  # [out, in]
        zero = (unpack_int32(qzeros, 4, dim=1) + self.zero_offset).t().float().contiguous()  # [out, groups]
        return QuantizedTensor.int4(values, scales.t().float().contiguous(), zero, size, f"{layer} (gptq)")
