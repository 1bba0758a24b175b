"""Loading a checkpoint's tensors into a model: each model maps a checkpoint name to
(module path, parameter kind, fused part); this puts the tensor there, checking its shape, and at
the end names every checkpoint tensor it could not place and every parameter left unloaded."""

from __future__ import annotations

import torch
from torch import nn

from kiln.llm.config import LLMError
from kiln.llm.models.layers import ColumnLinear, RowLinear, VocabEmbedding
from kiln.llm.prequantized.tensor import QuantizedTensor


class WeightLoader:
    def __init__(self, model: nn.Module, source: str = "checkpoint"):
        self.model = model
        self.source = source
        self.expected = _expected_keys(model)
        self.loaded: set[str] = set()
        self.unplaced: list[str] = []

    def load(self, name: str, path: str, kind: str, tensor: torch.Tensor, part: int = 0) -> None:
        """Put checkpoint tensor `name` into the `kind` ("weight"/"bias") of the module at `path`."""
        key = f"{path}.{kind}#{part}"
        if key not in self.expected:
            self.unplaced.append(name)
            return
        module = self.model.get_submodule(path)
        if isinstance(tensor, QuantizedTensor) and not isinstance(module, (ColumnLinear, RowLinear)):
            raise LLMError(f"{self.source}: {name} is quantized ({tensor.method}), but kiln keeps {path} "
                           "(an embedding, LM head or norm) in full precision; a checkpoint that leaves it "
                           "unquantized (compressed-tensors' ignore, AWQ's modules_to_not_convert) loads")
        try:
            if isinstance(module, ColumnLinear):
                module.load(kind, tensor, part)
            elif isinstance(module, (RowLinear, VocabEmbedding)):
                module.load(kind, tensor)
            else:
                target = getattr(module, kind)
                if target.shape != tensor.shape:
                    raise LLMError(f"expected shape {list(target.shape)}, got {list(tensor.shape)}")
                target.data.copy_(tensor)
        except (LLMError, RuntimeError) as e:
            raise LLMError(f"{self.source}: tensor {name} does not fit {path}.{kind}: {e}") from None
        self.loaded.add(key)

    def skip(self, name: str) -> None:
        """A tensor the model does not need (a tied head stored anyway, a precomputed RoPE table)."""

    def unexpected(self, name: str) -> None:
        self.unplaced.append(name)

    def finish(self) -> None:
        missing = sorted(self.expected - self.loaded)
        problems = []
        if self.unplaced:
            problems.append(f"{len(self.unplaced)} tensor(s) kiln does not know where to put: "
                            + ", ".join(self.unplaced[:8]) + (" ..." if len(self.unplaced) > 8 else ""))
        if missing:
            problems.append(f"{len(missing)} parameter(s) not in the checkpoint: "
                            + ", ".join(k.replace("#0", "") for k in missing[:8]) + (" ..." if len(missing) > 8 else ""))
        if problems:
            raise LLMError(f"{self.source} does not match the model built from config.json: " + "; ".join(problems))


def _expected_keys(model: nn.Module) -> set[str]:
    keys = set()
    for path, module in model.named_modules():
        params = [name for name, p in module.named_parameters(recurse=False) if p is not None]
        parts = len(module.slices) if isinstance(module, ColumnLinear) else 1
        keys |= {f"{path}.{name}#{i}" for name in params for i in range(parts)}
    return keys
