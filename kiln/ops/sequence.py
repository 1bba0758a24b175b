"""Sequences (Python lists of tensors) and optionals (a value, or None when empty)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kiln.ops._util import ints, norm_axis, scalar
from kiln.ops.registry import register


def _position(position: Any, length: int, *, insert: bool = False) -> int:
    """A sequence position input, negative counting from the back, checked against length."""
    index = int(scalar(position))
    limit = length + 1 if insert else length
    if not -length <= index < limit:
        raise IndexError(f"sequence position {index} is out of range for a sequence of {length}")
    return index + length if index < 0 else index


@register("SequenceConstruct")
def sequence_construct(ctx, *inputs):
    return list(inputs)


@register("SequenceEmpty")
def sequence_empty(ctx, *, dtype=1):
    return []


@register("SequenceLength")
def sequence_length(ctx, sequence):
    return torch.tensor(len(sequence), dtype=torch.int64)


@register("SequenceAt")
def sequence_at(ctx, sequence, position):
    return sequence[_position(position, len(sequence))]


@register("SequenceInsert")
def sequence_insert(ctx, sequence, tensor, position=None):
    out = list(sequence)
    if position is None:
        out.append(tensor)
    else:
        out.insert(_position(position, len(out), insert=True), tensor)
    return out


@register("SequenceErase")
def sequence_erase(ctx, sequence, position=None):
    out = list(sequence)
    del out[-1 if position is None else _position(position, len(out))]
    return out


@register("SplitToSequence")
def split_to_sequence(ctx, input, split=None, *, axis=0, keepdims=1):
    axis = norm_axis(axis, input.dim())
    if split is None:
        parts = torch.split(input, 1, dim=axis)
        return [p.squeeze(axis) for p in parts] if not keepdims else list(parts)
    sizes = ints(split)
    if split.dim() == 0:  # one chunk size; the last chunk may be smaller
        return list(torch.split(input, sizes[0], dim=axis))
    return list(torch.split(input, sizes, dim=axis))


@register("ConcatFromSequence")
def concat_from_sequence(ctx, sequence, *, axis, new_axis=0):
    if new_axis:
        return torch.stack(list(sequence), dim=norm_axis(axis, sequence[0].dim() + 1))
    if isinstance(sequence[0], np.ndarray):
        return np.concatenate(sequence, axis=axis)
    return torch.cat(list(sequence), dim=norm_axis(axis, sequence[0].dim()))


@register("SequenceMap")
def sequence_map(ctx, *inputs, body):
    """Run body once per position; tensors (not sequences) among the inputs are shared."""
    own, outer = inputs[: ctx.num_inputs], ctx.outer(inputs[ctx.num_inputs :])
    length = len(own[0])
    results: list[list[Any]] = [[] for _ in range(ctx.num_outputs)]
    for i in range(length):
        args = [v[i] if isinstance(v, list) else v for v in own]
        for k, out in enumerate(body.run(args, outer=outer)):
            results[k].append(out)
    return tuple(results)


@register("Optional")
def optional(ctx, input=None, *, type=None):
    return input


@register("OptionalHasElement")
def optional_has_element(ctx, optional=None):
    return torch.tensor(optional is not None)


@register("OptionalGetElement")
def optional_get_element(ctx, optional):
    if optional is None:
        raise ValueError("OptionalGetElement on an empty optional")
    return optional

