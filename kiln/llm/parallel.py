"""Tensor parallelism's one piece of shared state: which rank of how many this process is, and the
collectives the model's parallel layers call (no-ops for one rank). The group is passed to the model
explicitly, never read from a module global.

Megatron's split: column-parallel layers (q/k/v, gate/up, the LM head over the vocabulary) keep a
slice of output features and need no communication; row-parallel layers (o_proj, down_proj) keep a
slice of input features and sum their partial outputs (all-reduce); the embedding keeps a slice of the
vocabulary, zeroes rows it does not own and all-reduces. NCCL on GPUs, gloo on the CPU (tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kiln.llm.config import LLMError


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object | None = None  # a torch.distributed process group (None: the default one)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dim (logits over a vocabulary split by rank)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def shard(self, total: int, what: str) -> tuple[int, int]:
        """(start, size) of this rank's equal slice of `total` features."""
        if total % self.size:
            raise LLMError(f"{what}: {total} is not divisible by the tensor-parallel size {self.size}")
        size = total // self.size
        return self.rank * size, size


SINGLE = TensorParallel()
