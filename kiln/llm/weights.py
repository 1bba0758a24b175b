"""Reading a Hugging Face folder's weights: *.safetensors, one file or shards listed in
model.safetensors.index.json, memory-mapped (no pickle: .bin checkpoints are refused by name)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from kiln.llm.config import LLMError


def safetensors_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise LLMError(f"{index} lists shards that are not in the folder: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.glob("*.bin"))
        hint = (f" (it has {', '.join(pickles)}: pickled weights, which kiln does not load; convert them with "
                "transformers' save_pretrained(safe_serialization=True))") if pickles else ""
        raise LLMError(f"{folder} has no *.safetensors weights{hint}")
    return files


def iterate_weights(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every shard, as stored (dtype and layout unchanged, mmapped)."""
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
