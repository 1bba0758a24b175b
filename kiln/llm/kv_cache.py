"""The paged KV cache's memory: one tensor per layer pair, sized from a byte budget the user sets.

Layout per layer: k and v each [num_blocks, block_size, num_kv_heads, head_dim] (vLLM's flash layout:
a block's tokens are contiguous, a token's heads are contiguous), all layers in one allocation
[num_layers, 2, num_blocks, block_size, Hkv, D] so the budget is one number and one allocation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.llm.config import LLMError


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int  # this rank's
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def blocks_for_budget(self, budget_bytes: int) -> int:
        blocks = budget_bytes // self.bytes_per_block
        if blocks < 2:
            raise LLMError(f"a KV-cache budget of {budget_bytes} bytes holds {blocks} block(s) of "
                           f"{self.bytes_per_block} bytes ({self.block_size} tokens x {self.num_layers} layers); "
                           "kiln needs at least 2: raise kv_cache_memory")
        return blocks


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed (padded slots and fresh blocks hold finite values: 0 x garbage would be NaN)."""
    shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    try:
        cache = torch.zeros(shape, dtype=spec.dtype, device=device)
    except torch.OutOfMemoryError:
        raise LLMError(f"cannot allocate the KV cache ({num_blocks} blocks, "
                       f"{num_blocks * spec.bytes_per_block / 2**30:.2f} GiB) on {device}: lower kv_cache_memory") from None
    return [(cache[i, 0], cache[i, 1]) for i in range(spec.num_layers)]
