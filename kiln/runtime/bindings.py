"""Bindings at the boundary: feeds converted to the runtime's tensors and handed back as the caller gave them
(numpy in -> numpy out; torch in -> torch out), checked against their bindings (BindingErrors naming the input or
output, expected vs given), and the signatures by which a context remembers a call it checked.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kiln.errors import BindingError
from kiln.ir import dtypes
from kiln.plan.spec import Binding


def _to_runtime(value: Any, binding: Binding, device: torch.device) -> Any:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [_to_runtime(v, binding, device) for v in value]
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    array = np.asarray(value)
    converted = dtypes.numpy_to_torch(array)
    if isinstance(converted, torch.Tensor) and device.type != "cpu":
        converted = converted.to(device, non_blocking=True)
    return converted


def _to_user(value: Any, as_torch: bool) -> Any:
    if isinstance(value, list):
        return [_to_user(v, as_torch) for v in value]
    if isinstance(value, torch.Tensor):
        return value if as_torch else dtypes.torch_to_numpy(value)
    return value


def _given_dtype(value: Any) -> str | None:
    if isinstance(value, torch.Tensor):
        return dtypes.from_torch(value.dtype).name
    if isinstance(value, np.ndarray):
        return dtypes.from_numpy(value.dtype).name
    return None


def _check_value(label: str, binding: Binding, value: Any, symbols: dict[str, tuple[int, str]] | None = None) -> None:
    """A tensor's dtype, rank and fixed dims against its binding, as BindingErrors naming `label`; with `symbols`
    (symbol -> (size, input name) seen so far), also that a symbolic dim agrees with the other inputs'."""
    given = _given_dtype(value)
    if binding.dtype and given != binding.dtype:
        raise BindingError(f"{label}: expected dtype {binding.dtype}, given {given} (shape {list(value.shape)})")
    if binding.shape is None:
        return
    shape = list(value.shape)
    if len(shape) != len(binding.shape):
        raise BindingError(f"{label}: expected rank {len(binding.shape)} shape {binding.describe()}, given shape {shape}")
    for axis, (want, got) in enumerate(zip(binding.shape, shape)):
        if isinstance(want, int) and want != got:
            raise BindingError(f"{label}: expected shape {binding.describe()}, given {shape} (axis {axis} must be {want})")
        if isinstance(want, str) and symbols is not None:
            seen = symbols.setdefault(want, (got, label))
            if seen[0] != got:
                raise BindingError(f"{label}: dimension {want!r} (axis {axis}) is {got}, but {seen[1]} gave it as "
                                   f"{seen[0]}")


_NUMPY_OWN = frozenset(np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                              np.uint32, np.uint64, np.float16, np.float32, np.float64))


def _tensor_signature(names: list[str], feeds: dict[str, Any]) -> tuple | None:
    """(dtype, shape, device index) of each input, in binding order, when every feed is a torch tensor and there
    is no other feed; else None."""
    if len(feeds) != len(names):
        return None
    key = []
    for name in names:
        t = feeds.get(name)
        if type(t) is not torch.Tensor:
            return None
        key.append((t.dtype, t.shape, t.get_device()))
    return tuple(key)


def _numpy_signature(names: list[str], feeds: dict[str, Any]) -> tuple | None:
    """(dtype, shape) of each input, in binding order, when every feed is a C-contiguous writable
    numpy array and there is no other feed; else None."""
    if len(feeds) != len(names):
        return None
    key = []
    for name in names:
        a = feeds.get(name)
        if type(a) is not np.ndarray or not a.flags.c_contiguous or not a.flags.writeable or a.dtype not in _NUMPY_OWN:
            return None  # bfloat16 and float8 arrays (ml_dtypes' types) take the general path's conversion
        key.append((a.dtype, a.shape))
    return tuple(key)
