"""Checkpoints another tool already quantized, loaded as they are: config.json's `quantization_config`
names the format (read and checked here, before any weight is read), and `convert_weights` turns each
quantized linear layer's stored tensors into one QuantizedTensor named `<layer>.weight`, so the models'
loaders route it (q/k/v and gate/up parts, tensor-parallel slices) like a full-precision weight;
quantization.attach_checkpoint_weights then swaps in the module that multiplies it.

    awq                 AutoAWQ GEMM, 4 bits                 awq.py
    gptq                AutoGPTQ / GPTQModel, 4 or 8 bits    gptq.py
    compressed-tensors  pack-quantized int4/int8, int8, FP8  compressed_tensors.py
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kiln.llm.config import LLMError
from kiln.llm.prequantized.awq import AWQ
from kiln.llm.prequantized.base import CheckpointFormat
from kiln.llm.prequantized.compressed_tensors import CompressedTensors
from kiln.llm.prequantized.gptq import GPTQ
from kiln.llm.prequantized.tensor import QuantizedTensor

FORMATS = {"awq": AWQ, "gptq": GPTQ, "compressed-tensors": CompressedTensors}

__all__ = ["AWQ", "GPTQ", "CompressedTensors", "CheckpointFormat", "QuantizedTensor", "read_format", "convert_weights",
           "FORMATS"]


def read_format(quantization_config: dict | None, source: str) -> CheckpointFormat | None:
    """The checkpoint's quantization format from config.json's quantization_config (None: not quantized);
    refuses, by name, what kiln cannot load as it is."""
    if not quantization_config:
        return None
    method = str(quantization_config.get("quant_method", "")).lower()
    if method not in FORMATS:
        raise LLMError(f"{source}: quantization_config quant_method {method!r} is not supported; kiln loads "
                       f"{', '.join(FORMATS)} checkpoints (or quantizes full-precision ones itself with "
                       "quantization=\"int8\" | \"int4\" | \"fp8\")")
    return FORMATS[method].from_config(quantization_config, source)


def convert_weights(weights: Iterable[tuple[str, torch.Tensor]], fmt: CheckpointFormat
                    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The checkpoint's (name, tensor) with each quantized layer's tensors replaced by one
    (`<layer>.weight`, QuantizedTensor), yielded once the layer's last tensor has been read."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        layer, _, component = name.rpartition(".")
        if fmt.drops(component, tensor, layer):
            continue
        if not fmt.holds(component, tensor):
            yield name, tensor
            continue
        group = pending.setdefault(layer, {})
        group[component] = tensor
        if fmt.complete(group):
            del pending[layer]
            yield f"{layer}.weight", fmt.unpack(group, layer)
    if pending:
        layer, group = next(iter(pending.items()))
        missing = [c for c in fmt.components if c not in group]
        raise LLMError(f"{len(pending)} {fmt.name} layer(s) lack some of their tensors, e.g. {layer}: has "
                       f"{', '.join(sorted(group))}, lacks {', '.join(missing)}")
