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
        if type(a) is not np.ndarray:
            return None
        flags = a.flags  # (a new flags object at each read of a.flags)
        if not flags.c_contiguous or not flags.writeable or a.dtype not in _NUMPY_OWN:
            return None  # bfloat16 and float8 arrays (ml_dtypes' types) take the general path's conversion
        key.append((a.dtype, a.shape))
    return tuple(key)


class NumpyCheck:
    """A new numpy signature's check (ExecutionContext._check: dtypes, ranks, fixed dims, symbols agreeing, the first
    optimization profile holding the shapes) made from the signature alone (_numpy_signature's (dtype, shape) per
    input), with the bindings' and profiles' facts found once: a CPU context checks each new signature once, right
    after a run has cooled the caches, where _check's dicts, per-input calls and messages' machinery cost ~40 µs for
    BERT-base's two inputs (bench/results/first-call-2026-12-06.md). It answers only where every check passes (the
    profile's index); anything else is None, and the caller runs _check, which raises the error it always did.

    The checks are one generated function of the signature (each test written out: the inputs unpacked once, no loop
    over the facts): a stream of new shapes pays this at every call, and a loop over tables of facts read ~12 µs of
    bert_tiny's first call on a stream's cold caches, ~4 µs hot (bench/results/new-shapes-zen4-2026-12-07d.md)."""

    def __init__(self, inputs: list[tuple], symbols: list[tuple], profiles: list[tuple]):
        """`inputs`: (accepted numpy dtypes or None, rank or None, ((axis, size), ...) fixed) per input; `symbols`:
        the (input, axis) places of each symbol read by more than one; `profiles`: per profile, (input, min, max)
        of each input it bounds."""
        self._check = _compiled_check(inputs, symbols, profiles)

    @classmethod
    def of(cls, bindings: list[Binding], profiles: list[Any]) -> NumpyCheck | None:
        """The check of inputs `bindings` (in order) and optimization `profiles` (kiln/plan/spec.py Profile), or None
        where _check does something else too (an input not a tensor, no profile: it keeps the last one)."""
        if not profiles or any(b.kind != "tensor" for b in bindings):
            return None
        inputs, seen = [], {}
        for i, b in enumerate(bindings):
            accepted = None if not b.dtype else frozenset(d for d in _NUMPY_OWN if dtypes.from_numpy(d).name == b.dtype)
            rank = None if b.shape is None else len(b.shape)
            fixed = () if b.shape is None else tuple((a, d) for a, d in enumerate(b.shape) if isinstance(d, int))
            inputs.append((accepted, rank, fixed))
            for a, d in enumerate(b.shape or ()):
                if isinstance(d, str):
                    seen.setdefault(d, []).append((i, a))
        symbols = [tuple(uses) for uses in seen.values() if len(uses) > 1]
        index = {b.name: i for i, b in enumerate(bindings)}
        bounds = [tuple((index[name], tuple(r.min), tuple(r.max)) for name, r in profile.inputs.items()
                        if name in index) for profile in profiles]
        return cls(inputs, symbols, bounds)

    def __call__(self, key: tuple) -> int | None:
        """The profile of numpy signature `key` where every check passes, else None."""
        return self._check(key)


def _compiled_check(inputs: list[tuple], symbols: list[tuple], profiles: list[tuple]) -> Any:
    """NumpyCheck's checks as one function of a signature: in order, the count of inputs, each input's dtype, rank
    and fixed dims, the symbols' agreement (ranks checked before any dim is read), then the first profile whose
    every bound holds (its index), else None."""
    lines = ["def check(key):", f"    if len(key) != {len(inputs)}:", "        return None"]
    if inputs:
        lines.append(f"    {''.join(f'(t{i}, s{i}), ' for i in range(len(inputs)))}= key")
    accepted_sets = {}
    for i, (accepted, rank, fixed) in enumerate(inputs):
        tests = []
        if accepted is not None:
            accepted_sets[f"accepted{i}"] = accepted
            tests.append(f"t{i} not in accepted{i}")
        if rank is not None:
            tests.append(f"len(s{i}) != {rank}")
            tests += [f"s{i}[{axis}] != {want}" for axis, want in fixed]
        lines += [f"    if {test}:\n        return None" for test in tests]
    for (i, a), *others in symbols:
        lines += [f"    if s{j}[{b}] != s{i}[{a}]:\n        return None" for j, b in others]
    for k, bounds in enumerate(profiles):
        terms = []
        for i, low, high in bounds:
            rank = inputs[i][1]
            if rank is not None and rank != len(low):
                terms = ["False"]
                break
            if rank is None:
                terms.append(f"len(s{i}) == {len(low)}")
            terms += [f"{lo} <= s{i}[{j}] <= {hi}" for j, (lo, hi) in enumerate(zip(low, high))]
        lines.append(f"    if {' and '.join(terms) or 'True'}:\n        return {k}")
    lines.append("    return None")
    namespace: dict[str, Any] = dict(accepted_sets)
    exec("\n".join(lines) + "\n", namespace)  # noqa: S102  (the source is written here from ints and names)
    return namespace["check"]
