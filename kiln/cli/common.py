"""Helpers the verbs share: rich console and text, byte and shape formatting, --shapes parsing,
and the inputs of run and bench (an --inputs .npz, or random arrays of each binding's dtype and shape).

Lean: imports no ONNX, frontend or passes (tests/unit/test_lean_runtime.py).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import KilnError
from kiln.ir import dtypes
from kiln.plan.spec import Binding, EnginePlan


def console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # Pipes and captured output get a wide fixed width, so tables do not wrap names.
    width = None if stream.isatty() else 160
    return Console(stderr=stderr, width=width, highlight=False)


def text(value: Any):
    from rich.text import Text

    return Text(str(value))  # never parsed as markup: shapes like "[batch, 3]" stay literal


def fmt_bytes(n: int | float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def fmt_shape(shape: list | None) -> str:
    if shape is None:
        return "?"
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def parse_shapes(specs: list[str] | None) -> dict[str, list[int]]:
    """`--shapes x:1x3x224x224,mask:1x128` (repeatable) -> {"x": [1, 3, 224, 224], ...}."""
    shapes: dict[str, list[int]] = {}
    for spec in specs or []:
        for item in filter(None, (s.strip() for s in spec.split(","))):
            name, sep, dims = item.rpartition(":")
            if not sep or not name:
                raise KilnError(f"--shapes {item!r}: expected NAME:DIMxDIMx..., e.g. input:1x3x224x224")
            try:
                shapes[name] = [int(d) for d in dims.lower().split("x")] if dims else []
            except ValueError:
                raise KilnError(
                    f"--shapes {item!r}: dimensions must be integers separated by 'x', e.g. {name}:1x3x224x224"
                ) from None
            if any(d < 0 for d in shapes[name]):
                raise KilnError(f"--shapes {item!r}: dimensions must not be negative")
    return shapes


def parse_profile(spec: str) -> dict[str, str]:
    """`--profile "input_ids:1x1,8x128,32x512;attention_mask:1x1,8x128,32x512"` -> one profile, its
    ranges as given (the builder checks them against the model: kiln/builder/profiles.py)."""
    profile: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in re.split(r"[;\s]+", spec))):
        name, sep, ranges = item.rpartition(":")
        if not sep or not name:
            raise KilnError(f"--profile {item!r}: expected NAME:MIN,OPT,MAX, e.g. input_ids:1x1,8x128,32x512")
        profile[name] = ranges
    return profile


def _concrete_shape(binding: Binding, given: dict[str, list[int]], defaults: dict[str, list[int]],
                    symbols: dict[str, int]) -> list[int]:
    """A binding's shape with every symbolic dim resolved: --shapes, then the build's shapes, then 1."""
    if binding.name in given:
        return given[binding.name]
    if binding.shape is None:
        if binding.name in defaults:
            return defaults[binding.name]
        raise KilnError(
            f"input {binding.name!r} has unknown rank; give its shape with --shapes {binding.name}:DIMxDIM..."
        )
    built = defaults.get(binding.name)
    if built is not None and len(built) != len(binding.shape):
        built = None
    shape = []
    for axis, dim in enumerate(binding.shape):
        if isinstance(dim, int):
            shape.append(dim)
        elif isinstance(dim, str):
            shape.append(symbols.get(dim, 1))
        else:  # an unnamed dynamic dim
            shape.append(built[axis] if built else 1)
    return shape


def _symbols_from(bindings: list[Binding], shapes: dict[str, list[int]]) -> dict[str, int]:
    """Symbol values implied by explicit shapes: --shapes x:4x3 on x: [batch, 3] sets batch=4."""
    symbols: dict[str, int] = {}
    for b in bindings:
        given = shapes.get(b.name)
        if given is None or b.shape is None or len(given) != len(b.shape):
            continue
        for dim, n in zip(b.shape, given):
            if isinstance(dim, str):
                symbols.setdefault(dim, n)
    return symbols


def _random_array(binding: Binding, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    if binding.kind != "tensor":
        raise KilnError(
            f"input {binding.name!r} is a {binding.kind}; `kiln run` cannot make one up: pass --inputs"
        )
    name = binding.dtype or "float"
    dt = dtypes.BY_NAME[name]
    if name == "string":
        return np.array([f"kiln{i}" for i in range(int(np.prod(shape)))], dtype=object).reshape(shape)
    if name == "bool":
        return rng.random(shape) < 0.5
    if name.startswith("complex"):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt.numpy)
    if dt.is_float:
        return rng.standard_normal(shape).astype(np.float32).astype(dt.numpy)
    # Integers: small and non-negative, so they are valid indices, counts or token ids.
    return rng.integers(0, 4, size=shape).astype(dt.numpy)


def make_inputs(plan: EnginePlan, args: argparse.Namespace) -> dict[str, Any]:
    bindings = plan.inputs
    if getattr(args, "inputs", None):
        path = Path(args.inputs)
        if not path.is_file():
            raise KilnError(f"--inputs {path}: no such file")
        try:
            with np.load(path, allow_pickle=False) as npz:
                return {k: npz[k] for k in npz.files}
        except (OSError, ValueError) as e:
            raise KilnError(f"--inputs {path}: not a readable .npz file ({e})") from None
    given = parse_shapes(args.shapes)
    unknown = sorted(set(given) - {b.name for b in bindings})
    if unknown:
        raise KilnError(f"--shapes names {unknown}, but the engine's inputs are {[b.name for b in bindings]}")
    defaults = plan.header.get("build_config", {}).get("shapes", {}) or {}
    symbols = _symbols_from(bindings, defaults) | _symbols_from(bindings, given)  # --shapes wins
    rng = np.random.default_rng(args.seed)
    return {b.name: _random_array(b, _concrete_shape(b, given, defaults, symbols), rng) for b in bindings}
