"""torch.export of a module for kiln.compile (kiln/frontend/torch.py, step 1): the user's dynamic ranges
({arg: {axis: (min, opt, max)}}) checked and given to torch.export as dynamic dims, the program decomposed as the
ONNX exporter decomposes it, the exporters' own chatter silenced.

torch.onnx's registry and decomposition table are private to torch (torch.onnx._internal.exporter,
stable from torch 2.6 to 2.13); they are read in `_onnx_registry` and `_decompose` only.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.export import Dim
from torch.onnx._internal.exporter import (  # private to torch: see the docstring
    _decomp,
    _registration,
)

from kiln.errors import KilnError

Range = tuple[int, int, int]  # min, opt, max


# ---- capture ------------------------------------------------------------------------------------

def _is_range(spec: Any) -> bool:
    return isinstance(spec, dict) and bool(spec) and all(isinstance(k, int) for k in spec)


def _range(value: Any, where: str, example: int) -> Range:
    parts = [int(v) for v in value]
    if len(parts) == 2:
        parts = [parts[0], min(max(example, parts[0]), parts[1]), parts[1]]
    if len(parts) != 3 or not parts[0] <= parts[1] <= parts[2]:
        raise KilnError(f"dynamic {where}: give (min, max) or (min, opt, max) with min <= opt <= max, given {value!r}")
    return parts[0], parts[1], parts[2]


def _export_dynamic(dynamic: dict, signature: inspect.BoundArguments) -> tuple[dict, dict[int, dict[int, Range]]]:
    """kiln's `dynamic` ({arg: {axis: (min, opt, max)}}, nested like the argument) -> torch.export's
    dynamic_shapes (Dim.DYNAMIC per axis) and, per example tensor (by id), its axes' ranges."""
    unknown = sorted(set(dynamic) - set(signature.arguments))
    if unknown:
        raise KilnError(f"dynamic names {unknown}, but forward() takes {list(signature.arguments)}")
    ranges: dict[int, dict[int, Range]] = {}

    def walk(spec: Any, value: Any, where: str) -> Any:
        if spec is None:
            return None
        if isinstance(value, torch.Tensor):
            if not _is_range(spec):
                raise KilnError(f"dynamic {where}: a tensor's entry maps axes to ranges, e.g. {{0: (1, 8, 64)}}")
            checked = {}
            for axis, r in spec.items():
                if not -value.dim() <= axis < value.dim():
                    raise KilnError(f"dynamic {where}: axis {axis} of a {value.dim()}-d tensor")
                axis %= value.dim()
                checked[axis] = _range(r, f"{where} axis {axis}", value.shape[axis])
                if value.shape[axis] < 2:
                    raise KilnError(f"dynamic {where} axis {axis}: the example's size there is {value.shape[axis]}; "
                                    "torch.export fixes dims of size 0 and 1, give an example of size 2 or more")
            ranges[id(value)] = checked
            return {axis: Dim.DYNAMIC for axis in checked}
        if isinstance(value, dict):
            return {k: walk(spec.get(k) if isinstance(spec, dict) else None, v, f"{where}[{k!r}]")
                    for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            specs = list(spec) if isinstance(spec, (list, tuple)) else [None] * len(value)
            return type(value)(walk(s, v, f"{where}[{i}]") for i, (s, v) in enumerate(zip(specs, value)))
        return None

    shapes = {name: walk(dynamic.get(name), value, name) for name, value in signature.arguments.items()}
    return shapes, ranges


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """torch's export and ONNX exporter talk about themselves ("torchvision is not installed. Skipping
    torchvision::nms", pytree deprecations): nothing there is the user's to act on."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


@functools.lru_cache(maxsize=1)
def _onnx_registry():
    with _quiet_exporter():
        return _registration.ONNXRegistry.from_torchlib()


def _decompose(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Decompose as torch.onnx.export does: ops the exporter translates stay whole."""
    registered = set(_decomp.get_onnx_implemented_overloads(_onnx_registry()))
    return program.run_decompositions(_decomp.create_onnx_friendly_decomposition_table(registered))


def capture(module: torch.nn.Module, args: tuple, kwargs: dict, dynamic: dict | None
            ) -> tuple[torch.export.ExportedProgram, dict[int, dict[int, Range]]]:
    """torch.export of the module, decomposed for ONNX; and the dynamic ranges per example tensor id."""
    forward = module.forward if isinstance(module, torch.nn.Module) else module
    try:
        signature = inspect.signature(forward).bind(*args, **kwargs)
    except TypeError as e:
        raise KilnError(f"the example inputs do not fit forward(): {e}") from None
    shapes, ranges = _export_dynamic(dynamic or {}, signature)
    try:
        with _quiet_exporter():
            program = torch.export.export(module, args, kwargs, dynamic_shapes=shapes if dynamic else None,
                                          strict=False)
    except Exception as e:
        raise KilnError(f"torch.export could not capture the module ({type(e).__name__}): {str(e)[:2000]}") from e
    with _quiet_exporter():
        return _decompose(program), ranges
