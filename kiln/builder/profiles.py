"""Optimization profiles at build: the user's, checked against the model's inputs, or kiln's defaults.

A profile gives each input a smallest, an optimal and a largest shape (TensorRT's min/opt/max).
The user names the inputs whose ranges they know; an input they leave out takes its symbolic
dims from inputs that share the symbol (`attention_mask: [batch, seq]` follows `input_ids`).
Without any profile, kiln picks one for a model with symbolic dims and says why:

    a dim at axis 0             batch:    1 .. 64, tuned at 1
    an image's H or W           32 .. 1024, tuned at 224 ([N, C, H, W], C fixed at 1, 3 or 4)
    another symbolic dim        sequence: 1 (0 for a float tensor: a KV cache's past) .. the rows of
                                the model's position-embedding table (a constant gathered by
                                positions), else 512; tuned at min(128, max)

`--shapes` (BuildConfig.shapes) keeps its meaning, the shapes tactics are tuned at: it becomes the
default profile's opt (its range widened to hold it).
"""

from __future__ import annotations

import re
from typing import Any

import onnx_ir as ir

from kiln.errors import KilnError
from kiln.plan.spec import Binding, Profile, ShapeRange

DEFAULT_BATCH = (1, 1, 64)
DEFAULT_SEQUENCE_MAX = 512
DEFAULT_IMAGE = (32, 224, 1024)

ProfileSpec = dict[str, Any]  # input name -> (min, opt, max) as lists of ints or "1x1,8x128,32x512"


class ProfileError(KilnError):
    """An optimization profile does not fit the model's inputs."""


def _dims(text: str, where: str) -> list[int]:
    try:
        dims = [int(d) for d in text.lower().split("x")] if text else []
    except ValueError:
        raise ProfileError(f"{where}: {text!r} is not dimensions separated by 'x' (e.g. 8x128)") from None
    if any(d < 0 for d in dims):
        raise ProfileError(f"{where}: dimensions must not be negative")
    return dims


def _range(value: Any, where: str) -> ShapeRange:
    if isinstance(value, ShapeRange):
        return value
    if isinstance(value, str):
        parts = value.split(",")
        if len(parts) != 3:
            raise ProfileError(f"{where}: expected MIN,OPT,MAX (three shapes), given {value!r}")
        return ShapeRange(*[_dims(p.strip(), where) for p in parts])
    if isinstance(value, dict):
        return ShapeRange(*[[int(d) for d in value[k]] for k in ("min", "opt", "max")])
    parts = list(value)
    if len(parts) != 3:
        raise ProfileError(f"{where}: expected (min, opt, max), given {len(parts)} shapes")
    return ShapeRange(*[[int(d) for d in p] for p in parts])


def _check_range(binding: Binding, r: ShapeRange, where: str) -> None:
    if binding.shape is not None and not len(r.min) == len(r.opt) == len(r.max) == len(binding.shape):
        raise ProfileError(f"{where}: input {binding.name!r} has rank {len(binding.shape)} "
                           f"({binding.describe()}); the profile gives ranks {len(r.min)}, {len(r.opt)}, {len(r.max)}")
    for axis in range(len(r.min)):
        lo, mid, hi = r.min[axis], r.opt[axis], r.max[axis]
        if not lo <= mid <= hi:
            raise ProfileError(f"{where}: input {binding.name!r} axis {axis}: min {lo}, opt {mid}, max {hi} "
                               "must satisfy min <= opt <= max")
        fixed = binding.shape[axis] if binding.shape is not None else None
        if isinstance(fixed, int) and not lo == mid == hi == fixed:
            raise ProfileError(f"{where}: input {binding.name!r} axis {axis} is fixed at {fixed} in the model; "
                               f"the profile gives {lo}..{hi}")


def _symbol_ranges(bindings: dict[str, Binding], ranges: dict[str, ShapeRange], where: str) -> dict[str, tuple]:
    """symbol -> (min, opt, max) from the ranges given; two inputs sharing a symbol must agree."""
    symbols: dict[str, tuple[tuple[int, int, int], str]] = {}
    for name, r in ranges.items():
        shape = bindings[name].shape or []
        for axis, dim in enumerate(shape):
            if not isinstance(dim, str):
                continue
            value = (r.min[axis], r.opt[axis], r.max[axis])
            seen = symbols.setdefault(dim, (value, name))
            if seen[0] != value:
                raise ProfileError(f"{where}: dimension {dim!r} is {seen[0][0]}..{seen[0][2]} (opt {seen[0][1]}) for "
                                   f"input {seen[1]!r} but {value[0]}..{value[2]} (opt {value[1]}) for {name!r}")
    return {k: v for k, (v, _) in symbols.items()}


def _complete(bindings: dict[str, Binding], ranges: dict[str, ShapeRange], symbols: dict[str, tuple],
              where: str) -> dict[str, ShapeRange]:
    """Every tensor input with a dynamic dim gets a range: given, or from the symbols it shares."""
    done = dict(ranges)
    for name, b in bindings.items():
        if name in done or b.kind != "tensor" or b.shape is None or all(isinstance(d, int) for d in b.shape):
            continue
        lo, mid, hi = [], [], []
        for axis, dim in enumerate(b.shape):
            if isinstance(dim, int):
                values = (dim, dim, dim)
            elif isinstance(dim, str) and dim in symbols:
                values = symbols[dim]
            else:
                raise ProfileError(f"{where}: input {name!r} {b.describe()} axis {axis} ({dim or 'unnamed'}) is not "
                                   f"covered: give {name}'s range too")
            lo.append(values[0]), mid.append(values[1]), hi.append(values[2])
        done[name] = ShapeRange(lo, mid, hi)
    return {name: done[name] for name in bindings if name in done}  # in the bindings' order


def user_profiles(specs: list[ProfileSpec], inputs: list[Binding]) -> list[Profile]:
    """The profiles the user gave, checked against the inputs and completed through shared symbols."""
    bindings = {b.name: b for b in inputs}
    profiles = []
    for k, spec in enumerate(specs):
        where = f"profile {k}"
        unknown = sorted(set(spec) - set(bindings))
        if unknown:
            raise ProfileError(f"{where}: no input named {unknown}; the model's inputs are {list(bindings)}")
        ranges = {name: _range(value, f"{where}, input {name!r}") for name, value in spec.items()}
        for name, r in ranges.items():
            _check_range(bindings[name], r, where)
        symbols = _symbol_ranges(bindings, ranges, where)
        profiles.append(Profile(_complete(bindings, ranges, symbols, where), source="user"))
    return profiles


def _position_rows(graph: ir.Graph) -> tuple[int, str] | None:
    """(rows, name) of the smallest constant table the model gathers by positions: a Gather whose
    data is a 2-D initializer named like a position embedding (the exporters keep the module path)."""
    found = None
    for node in graph:
        if node.op_type != "Gather" or not node.inputs or node.inputs[0] is None:
            continue
        table = node.inputs[0]
        if table.const_value is None or table.shape is None or len(table.shape) != 2:
            continue
        if not re.search(r"pos(ition)?(_|\.)?(emb|embed|embedding)|wpe", table.name or "", re.IGNORECASE):
            continue
        rows = int(table.shape[0])
        if found is None or rows < found[0]:
            found = (rows, table.name)
    return found


def _image(b: Binding) -> bool:
    """[N, C, H, W] with C fixed at 1, 3 or 4 and H, W both dynamic."""
    shape = b.shape or []
    return len(shape) == 4 and shape[1] in (1, 3, 4) and not isinstance(shape[2], int) and not isinstance(shape[3], int)


def default_profile(inputs: list[Binding], graph: ir.Graph, shapes: dict[str, list[int]]) -> Profile | None:
    """kiln's profile for a model with dynamic dims (None when every input is fixed)."""
    dynamic = [b for b in inputs if b.kind == "tensor" and b.shape is not None
               and not all(isinstance(d, int) for d in b.shape)]
    if not dynamic:
        return None
    positions = _position_rows(graph)
    seq_max = positions[0] if positions else DEFAULT_SEQUENCE_MAX
    seq = (1, min(128, seq_max), seq_max)
    notes: dict[str, str] = {}
    symbols: dict[str, tuple[int, int, int]] = {}
    ranges: dict[str, ShapeRange] = {}
    for b in dynamic:
        lo, mid, hi = [], [], []
        for axis, dim in enumerate(b.shape):
            if isinstance(dim, int):
                values = (dim, dim, dim)
            elif isinstance(dim, str) and dim in symbols:
                values = symbols[dim]
            else:
                label = dim if isinstance(dim, str) else f"{b.name} axis {axis}"
                floats = b.dtype in ("float", "float16", "bfloat16")
                if axis == 0:
                    values, why = DEFAULT_BATCH, "batch"
                elif floats and _image(b):
                    values, why = DEFAULT_IMAGE, "image size"
                else:
                    # a float tensor's length (a KV cache's past) may be 0; token ids have at least one
                    values = (0 if floats else 1, *seq[1:])
                    why = (f"sequence, up to the {seq_max} rows of the position table {positions[1]!r}"
                           if positions else f"sequence, up to {seq_max} (no position table found)")
                notes[label] = f"{label} {values[0]}..{values[2]} (opt {values[1]}): {why}"
                if isinstance(dim, str):
                    symbols[dim] = values
            lo.append(values[0]), mid.append(values[1]), hi.append(values[2])
        ranges[b.name] = ShapeRange(lo, mid, hi)
    for name, given in shapes.items():  # --shapes: the tuning shape, inside the range
        r = ranges.get(name)
        if r is None or len(given) != len(r.opt):
            continue
        r.opt = list(given)
        r.min = [min(a, g) for a, g in zip(r.min, given)]
        r.max = [max(a, g) for a, g in zip(r.max, given)]
    return Profile(ranges, source="default: " + "; ".join(notes.values()))


def resolve(specs: list[ProfileSpec], inputs: list[Binding], graph: ir.Graph,
            shapes: dict[str, list[int]]) -> list[Profile]:
    """The engine's profiles: the user's when given, else kiln's default (none for fixed shapes)."""
    if specs:
        return user_profiles(specs, inputs)
    default = default_profile(inputs, graph, shapes)
    return [default] if default is not None else []


def shapes_at(profile: Profile, point: str) -> dict[str, list[int]]:
    """Every input's shape at one point of a profile: "min", "opt" or "max"."""
    return {name: list(getattr(r, point)) for name, r in profile.inputs.items()}
