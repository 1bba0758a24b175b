"""One linear layer's weight as a checkpoint quantized it, unpacked into kiln's terms (quantization.py's
Int4Weight, Int8Weight, FP8Weight hold exactly these values), so that no value is re-rounded at load:

    int4  values uint8 [out, in/2], two 4-bit q in 0..15 a byte (input 2i in the low nibble of byte i,
          Int4Weight's packing), w = (q - zero) · scale, one scale and zero per group of input features
    int8  values int8,           w = values · scale, one scale per output channel
    int8-group  values uint8,    w = (values - zero) · scale, one scale and zero per group (8-bit GPTQ, ...)
    fp8   values float8_e4m3fn,  w = values · scale, one scale per output channel (a per-tensor scale repeated)

scale and zero are [out, groups] fp32 (groups = 1: per output channel; group_size is then the input width).
A tensor-parallel rank takes rows (column-parallel) or columns (row-parallel) of it; columns must fall on
group boundaries. Layers move theirs to their device as they load it, so a checkpoint is never held
whole on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.llm.config import LLMError


@dataclass
class QuantizedTensor:
    method: str  # int4 | int8 | int8-group | fp8
    values: torch.Tensor  # [out, in] (int4: [out, in/2], two a byte)
    scale: torch.Tensor  # [out, groups] fp32
    zero: torch.Tensor | None  # [out, groups] fp32 (int4, int8-group), None otherwise
    group_size: int  # input features per group (the input width for one group)
    source: str = ""  # the checkpoint format and layer it came from, for error messages

    @classmethod
    def int4(cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
             source: str) -> QuantizedTensor:
        """q: [out, in] integers in 0..15 -> packed two a byte."""
        if q.shape[1] % 2:
            raise LLMError(f"{source}: {q.shape[1]} input features: int4 needs an even number (two a byte)")
        q = q.to(torch.uint8)
        packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()  # row-major whatever q's strides (the kernels' layout)
        return cls("int4", packed, scale, zero, group_size, source)

    @property
    def shape(self) -> torch.Size:
        out, columns = self.values.shape
        return torch.Size((out, columns * 2 if self.method == "int4" else columns))

    def to(self, device: torch.device) -> QuantizedTensor:
        zero = None if self.zero is None else self.zero.to(device)
        return QuantizedTensor(self.method, self.values.to(device), self.scale.to(device), zero, self.group_size,
                               self.source)

    def rows(self, start: int, size: int) -> QuantizedTensor:
        """Output features [start, start + size) (a column-parallel rank's slice of one fused part)."""
        zero = None if self.zero is None else self.zero[start:start + size]
        return QuantizedTensor(self.method, self.values[start:start + size], self.scale[start:start + size], zero,
                               self.group_size, self.source)

    def columns(self, start: int, size: int) -> QuantizedTensor:
        """Input features [start, start + size) (a row-parallel rank's slice)."""
        per_byte = 2 if self.method == "int4" else 1
        if start % per_byte or size % per_byte:
            raise LLMError(f"{self.source}: a tensor-parallel rank's input features [{start}, {start + size}) split "
                           "a byte of two int4 values")
        stored = slice(start // per_byte, (start + size) // per_byte)
        if self.scale.shape[1] == 1:  # one scale per output channel: any slice keeps it
            return QuantizedTensor(self.method, self.values[:, stored], self.scale, self.zero, size, self.source)
        if start % self.group_size or size % self.group_size:
            raise LLMError(f"{self.source}: a tensor-parallel rank's input features [{start}, {start + size}) do not "
                           f"fall on the checkpoint's groups of {self.group_size}; use a tensor_parallel size that "
                           f"divides the input width into whole groups")
        groups = slice(start // self.group_size, (start + size) // self.group_size)
        zero = None if self.zero is None else self.zero[:, groups]
        return QuantizedTensor(self.method, self.values[:, stored], self.scale[:, groups], zero, self.group_size,
                               self.source)

    def dequantize(self) -> torch.Tensor:
        """[out, in] fp32: exact (a 4- or 8-bit integer or an e4m3 value times an fp16/bf16/fp32 scale)."""
        if self.method == "int4":
            q = torch.stack((self.values & 0xF, self.values >> 4), dim=-1).view(self.shape).float()
        else:
            q = self.values.float()
        q = q.view(q.shape[0], -1, self.group_size)
        if self.zero is not None:
            q = q - self.zero[..., None]
        return (q * self.scale[..., None]).view(self.shape)
