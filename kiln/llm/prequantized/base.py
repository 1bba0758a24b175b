"""What every checkpoint format tells the loader: which of a layer's tensors make up its quantized weight,
when they are all there, and how to unpack them into a QuantizedTensor."""

from __future__ import annotations

import torch

from kiln.llm.prequantized.tensor import QuantizedTensor

SHIFTS_4BIT = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble i of an int32 sits at bits 4i .. 4i+3
SHIFTS_8BIT = torch.arange(0, 32, 8, dtype=torch.int32)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32/bits values each, value i of a word at bits [bits·i, bits·(i+1)), consecutive
    values along `dim` -> the values as int32, that dim 32/bits times longer."""
    shifts = SHIFTS_4BIT if bits == 4 else SHIFTS_8BIT
    mask = (1 << bits) - 1
    if dim == 1:  # [R, C/n] -> [R, C/n, n] -> [R, C]
        values = (packed.unsqueeze(-1) >> shifts) & mask
        return values.reshape(packed.shape[0], -1)
    values = (packed.unsqueeze(1) >> shifts[None, :, None]) & mask  # [R/n, n, C] -> [R, C]
    return values.reshape(-1, packed.shape[1])


class CheckpointFormat:
    name = ""
    components: tuple[str, ...] = ()  # tensor name suffixes that make one quantized linear weight

    def holds(self, component: str, tensor: torch.Tensor) -> bool:
        """Whether `layer.component` is part of a quantized weight (held until the layer's set is complete)."""
        return component in self.components

    def drops(self, component: str, tensor: torch.Tensor, layer: str) -> bool:
        """Tensors read and not loaded (after checking them): GPTQ's trivial g_idx, static activation scales."""
        return False

    def complete(self, group: dict[str, torch.Tensor]) -> bool:
        return all(c in group for c in self.components)

    def unpack(self, group: dict[str, torch.Tensor], layer: str) -> QuantizedTensor:
        raise NotImplementedError
