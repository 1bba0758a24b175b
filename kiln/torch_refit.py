"""CompiledModule.refit's pieces (kiln/torch_backend.py): a module's state_dict checked against the
compiled module's, a kiln stage's ONNX model with new initializers (its engine then derives its weights
through kiln/builder/refit.py), a PyTorch stage's tensor replaced by a copy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from kiln.builder.refit import RefitError, RefitReport
from kiln.frontend.torch import Stage
from kiln.ir import dtypes


@dataclass
class ModuleRefit:
    """What CompiledModule.refit changed: per stage its engine's RefitReport (kiln) or the module keys it
    took (PyTorch), and the keys given that no stage reads (BatchNorm's num_batches_tracked in eval)."""

    stages: dict[str, RefitReport | list[str]]
    unused: list[str]

    def __str__(self) -> str:
        lines = [f"refit {len(self.stages)} stage(s)"]
        for name, done in self.stages.items():
            if isinstance(done, RefitReport):
                lines.append(f"  {name} (kiln): {len(done.changed)} engine weight(s) changed, "
                             f"{done.unchanged} unchanged")
            else:
                lines.append(f"  {name} (PyTorch): {len(done)} weight(s) replaced")
        if self.unused:
            more = " ..." if len(self.unused) > 10 else ""
            lines.append(f"  read by no stage: {', '.join(self.unused[:10])}{more}")
        return "\n".join(lines)


def with_initializers(model_bytes: bytes, weights: dict[str, torch.Tensor], stage: str) -> bytes:
    """The stage's ONNX model with the named initializers replaced (dtypes and shapes already checked)."""
    model = onnx.load_from_string(model_bytes)
    held = {init.name: init for init in model.graph.initializer}
    absent = sorted(name for name in weights if name not in held)
    if absent:
        raise RefitError(f"stage {stage}: its ONNX model has no initializer {absent[:10]}: the exporter did not keep "
                         "these weights as they are, so they cannot be replaced")
    for name, value in weights.items():
        array = dtypes.torch_to_numpy(value.detach().cpu().contiguous())
        held[name].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(array), name))
    return model.SerializeToString()


def replace_tensor(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """module.<name> becomes a copy of `value` on its device: the tensor it held (the compiled module's own
    parameter) is not written to."""
    old = getattr(module, name)
    new = value.detach().to(old.device).clone()
    if name in module._parameters:
        module._parameters[name] = torch.nn.Parameter(new, requires_grad=False)
    else:
        module._buffers[name] = new


def weight_specs(module: Any, stages: list[Stage]) -> dict[str, tuple[str, list[int]]]:
    """The module's state_dict as (dtype, shape) per key: what a refit must match."""
    specs: dict[str, tuple[str, list[int]]] = {}
    if isinstance(module, torch.nn.Module):
        specs.update({k: (str(v.dtype), list(v.shape)) for k, v in module.state_dict().items()})
    for stage in stages:
        for name, key in stage.weights.items():
            value = getattr(stage.module, name)
            specs[key] = (str(value.dtype), list(value.shape))
    return specs


def check_state_dict(specs: dict[str, tuple[str, list[int]]], state: dict[str, Any], strict: bool) -> None:
    """Every key, shape and dtype of `state` against the module's (`specs`); with `strict` every key of the
    module given; all problems in one RefitError."""
    if not specs:
        raise RefitError("this compiled module does not record its module's weights (compiled by an older kiln): "
                         "compile it again with refittable=True")
    problems = []
    unknown = sorted(k for k in state if k not in specs)
    if unknown:
        shown = ", ".join(list(specs)[:12]) + (" ..." if len(specs) > 12 else "")
        problems.append(f"unexpected key(s) {unknown[:10]}{' ...' if len(unknown) > 10 else ''}: the compiled "
                        f"module's state_dict has no such entry (its keys: {shown})")
    missing = sorted(k for k in specs if k not in state) if strict else []
    if missing:
        problems.append(f"missing key(s) {missing[:10]}{' ...' if len(missing) > 10 else ''} (strict: every key "
                        "of the module's state_dict)")
    for key, value in state.items():
        if key not in specs:
            continue
        dtype, shape = specs[key]
        if not isinstance(value, torch.Tensor):
            problems.append(f"{key!r}: a {type(value).__name__}, not a tensor")
        elif str(value.dtype) != dtype or list(value.shape) != shape:
            problems.append(f"{key!r}: the module holds {dtype} {shape}, given {value.dtype} {list(value.shape)}")
    if problems:
        raise RefitError("weights that do not fit the compiled module:\n  " + "\n  ".join(problems))
