"""Generators: Constant, ConstantOfShape, Range, EyeLike, Dropout and the random ops.

Random ops draw from torch's generator (seeded when the node has a `seed`); their values
cannot match another runtime's, only their shape, dtype and distribution.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from kiln.ops._util import ints, scalar, torch_dtype
from kiln.ops.registry import register


def _device(x: Any) -> torch.device:
    return x.device if isinstance(x, torch.Tensor) else torch.device("cpu")


@register("Constant")
def constant(ctx, *, value=None, value_float=None, value_floats=None, value_int=None, value_ints=None,
             value_string=None, value_strings=None, sparse_value=None):
    if value is not None:
        return value
    if sparse_value is not None:
        return sparse_value
    if value_float is not None:
        return torch.tensor(value_float, dtype=torch.float32)
    if value_floats is not None:
        return torch.tensor(list(value_floats), dtype=torch.float32)
    if value_int is not None:
        return torch.tensor(value_int, dtype=torch.int64)
    if value_ints is not None:
        return torch.tensor(list(value_ints), dtype=torch.int64)
    if value_string is not None:
        return np.array(_text(value_string), dtype=object)
    if value_strings is not None:
        return np.array([_text(s) for s in value_strings], dtype=object)
    raise ValueError(f"Constant {ctx.name!r} has no value attribute")


def _text(s: str | bytes) -> str:
    return s.decode() if isinstance(s, bytes) else s


@register("ConstantOfShape")
def constant_of_shape(ctx, shape, *, value=None):
    dims = ints(shape)
    if value is None:
        return torch.zeros(dims, dtype=torch.float32, device=_device(shape))
    if isinstance(value, torch.Tensor):
        return value.reshape(-1)[:1].to(_device(shape)).expand(dims).clone() if dims else value.reshape(())
    return np.full(dims, np.asarray(value).reshape(-1)[0], dtype=np.asarray(value).dtype)


@register("Range")
def range_(ctx, start, limit, delta):
    s, lim, d = scalar(start), scalar(limit), scalar(delta)
    if isinstance(s, int) and isinstance(lim, int) and isinstance(d, int):
        if start.dtype == torch.int64:  # exact in int64: one call (an exported encoder's arange, per new shape)
            return arange_int64(s, lim, d, start.device)
        n = max(-((s - lim) // d), 0)  # exact ceil((limit - start) / delta) for integers
    else:
        n = max(math.ceil((lim - s) / d), 0)
    # start + i * delta in the input type, as ONNX defines it (not a float accumulation).
    steps = torch.arange(n, device=start.device, dtype=torch.int64).to(start.dtype)
    return start.reshape(()) + steps * delta.reshape(())


def arange_int64(start: int, limit: int, delta: int, device: Any = None) -> torch.Tensor:
    """ONNX Range on int64 scalars given as Python ints (kiln/runtime/shape_function.py keeps dims as ints)."""
    n = max(-((start - limit) // delta), 0)  # exact ceil((limit - start) / delta) for integers
    return torch.arange(start, start + n * delta, delta, dtype=torch.int64, device=device)


@register("EyeLike")
def eye_like(ctx, x, *, dtype=None, k=0):
    out_dtype = torch_dtype(dtype) if dtype is not None else x.dtype
    rows, cols = x.shape
    r = torch.arange(rows, device=x.device).unsqueeze(1)
    c = torch.arange(cols, device=x.device)
    return (c - r == k).to(out_dtype)


def _generator(seed: float | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    return gen


@register("Dropout")
def dropout(ctx, data, ratio_input=None, training_mode=None, *, seed=None, ratio=0.5, is_test=0,
            consumed_inputs=None):
    # Dropout-7..10 had `ratio` as an attribute and no training mode (inference is identity);
    # from 12 ratio and training_mode are inputs.
    p = scalar(ratio_input) if ratio_input is not None else ratio
    training = bool(scalar(training_mode)) if training_mode is not None else False
    if not training or p == 0:
        if ctx.num_outputs < 2:
            return data
        return data, torch.ones(data.shape, dtype=torch.bool, device=data.device)
    gen = _generator(seed, data.device)
    mask = torch.rand(data.shape, generator=gen, device=data.device) >= p
    out = torch.where(mask, data / (1.0 - p), torch.zeros((), dtype=data.dtype, device=data.device))
    return (out, mask) if ctx.num_outputs > 1 else out


@register("RandomNormal")
def random_normal(ctx, *, shape, dtype=1, mean=0.0, scale=1.0, seed=None):
    out = torch.empty(list(shape), dtype=torch_dtype(dtype))
    return out.normal_(mean, scale, generator=_generator(seed, out.device))


@register("RandomUniform")
def random_uniform(ctx, *, shape, dtype=1, high=1.0, low=0.0, seed=None):
    out = torch.empty(list(shape), dtype=torch_dtype(dtype))
    return out.uniform_(low, high, generator=_generator(seed, out.device))


@register("RandomNormalLike")
def random_normal_like(ctx, x, *, dtype=None, mean=0.0, scale=1.0, seed=None):
    out_dtype = torch_dtype(dtype) if dtype is not None else x.dtype
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    return out.normal_(mean, scale, generator=_generator(seed, x.device))


@register("RandomUniformLike")
def random_uniform_like(ctx, x, *, dtype=None, high=1.0, low=0.0, seed=None):
    out_dtype = torch_dtype(dtype) if dtype is not None else x.dtype
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    return out.uniform_(low, high, generator=_generator(seed, x.device))


@register("Bernoulli")
def bernoulli(ctx, x, *, dtype=None, seed=None):
    out_dtype = torch_dtype(dtype) if dtype is not None else x.dtype
    draw = torch.bernoulli(x.to(torch.float64) if not x.is_floating_point() else x,
                           generator=_generator(seed, x.device))
    return draw.to(out_dtype)


@register("Multinomial")
def multinomial(ctx, x, *, dtype=6, sample_size=1, seed=None):
    # x: [batch, classes] unnormalised log-probabilities.
    probs = torch.softmax(x.to(torch.float64), dim=-1)
    draw = torch.multinomial(probs, sample_size, replacement=True, generator=_generator(seed, x.device))
    return draw.to(torch_dtype(dtype))
