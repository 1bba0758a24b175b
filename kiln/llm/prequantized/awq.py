"""AutoAWQ's GEMM layout (quant_method "awq", version "gemm"), 4 bits, asymmetric, groups of input features:

    qweight [in, out/8]      int32: word j of row k holds outputs 8j .. 8j+7, output 8j + ORDER[i] in nibble i
    qzeros  [in/group, out/8] int32: the zero points, packed the same way
    scales  [in/group, out]  fp16
    w[o, k] = (q[k, o] - z[k // group, o]) · s[k // group, o]

ORDER = (0, 2, 4, 6, 1, 3, 5, 7) is AutoAWQ's interleave (WQLinear_GEMM.from_linear), chosen for its CUDA
kernel's dequantization; unpacking reads nibble UNDO[k] for output 8j + k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.llm.config import LLMError
from kiln.llm.prequantized.base import CheckpointFormat, unpack_int32
from kiln.llm.prequantized.tensor import QuantizedTensor

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds output ORDER[i] of its word
UNDO = tuple(ORDER.index(k) for k in range(8))  # output k of a word is in nibble UNDO[k] = (0, 4, 1, 5, 2, 6, 3, 7)


def _unpack_outputs(packed: torch.Tensor) -> torch.Tensor:
    """[R, out/8] int32 in AWQ's interleaved order -> [R, out] uint8."""
    nibbles = unpack_int32(packed, 4, dim=1).view(packed.shape[0], -1, 8)
    return nibbles[..., list(UNDO)].reshape(packed.shape[0], -1).to(torch.uint8)


@dataclass
class AWQ(CheckpointFormat):
    group_size: int
    name = "awq"
    components = ("qweight", "qzeros", "scales")

    @classmethod
    def from_config(cls, config: dict, source: str) -> AWQ:
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise LLMError(f"{source}: AWQ version {version!r} is not supported: kiln reads AutoAWQ's GEMM layout "
                           "(version \"gemm\"); re-export the checkpoint with version=\"gemm\"")
        bits = config.get("bits", config.get("w_bit"))
        if bits != 4:
            raise LLMError(f"{source}: AWQ with {bits} bits is not supported (4 bits)")
        if not config.get("zero_point", True):
            raise LLMError(f"{source}: AWQ without zero points (zero_point false) is not supported")
        group = config.get("group_size", config.get("q_group_size", 128))
        if not isinstance(group, int) or group <= 0:
            raise LLMError(f"{source}: AWQ group_size {group!r}: expected a positive group of input features")
        return cls(group)

    def unpack(self, group: dict[str, torch.Tensor], layer: str) -> QuantizedTensor:
        qweight, qzeros, scales = group["qweight"], group["qzeros"], group["scales"]
        in_features, out_features = qweight.shape[0], qweight.shape[1] * 8
        groups = in_features // self.group_size
        if (in_features % self.group_size or list(qzeros.shape) != [groups, out_features // 8]
                or list(scales.shape) != [groups, out_features] or qweight.dtype != torch.int32):
            raise LLMError(f"{layer}: AWQ tensors qweight {list(qweight.shape)} {qweight.dtype}, qzeros "
                           f"{list(qzeros.shape)}, scales {list(scales.shape)} do not fit groups of {self.group_size} "
                           f"(expected qweight [in, out/8] int32, qzeros [in/group, out/8], scales [in/group, out])")
        values = _unpack_outputs(qweight).t()  # [out, in]
        zero = _unpack_outputs(qzeros).t().float().contiguous()  # [out, groups]
        return QuantizedTensor.int4(values, scales.t().float().contiguous(), zero, self.group_size, f"{layer} (awq)")
