"""Elementwise math, comparisons, logic and bitwise ops with numpy-style broadcasting.

Everything runs on torch kernels. Two kinds of value take a numpy path instead: the wide
unsigned integers (uint16/32/64), for which torch CPU has almost no kernels (no add, no
compare), and strings (object arrays). Those are rare in real models, so the round-trip is
accepted there and nowhere else.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kiln.ops._util import from_numpy, scalar, to_numpy
from kiln.ops.registry import register

_WIDE_UINTS = frozenset(
    d for d in (getattr(torch, n, None) for n in ("uint16", "uint32", "uint64")) if d is not None
)


def _needs_numpy(*values: Any) -> bool:
    """True when some value is a numpy array or a dtype torch has few kernels for."""
    for v in values:
        if isinstance(v, np.ndarray):
            return True
        if isinstance(v, torch.Tensor) and v.dtype in _WIDE_UINTS:
            return True
    return False


def _via_numpy(fn: Callable[..., Any], *values: Any) -> Any:
    """Run `fn` on numpy copies of `values`; the result goes back where the first tensor lives."""
    like = next((v for v in values if isinstance(v, torch.Tensor)), None)
    with np.errstate(all="ignore"):
        out = np.asarray(fn(*[to_numpy(v) if v is not None else None for v in values]))
    if out.dtype.kind in ("U", "S"):
        out = out.astype(object)
    return from_numpy(out, like)


def _elementwise(torch_fn: Callable[..., Any], numpy_fn: Callable[..., Any]) -> Callable[..., Any]:
    """One kernel for tensors torch handles, numpy for the rest."""

    def run(*values: Any) -> Any:
        if _needs_numpy(*values):
            return _via_numpy(numpy_fn, *values)
        return torch_fn(*values)

    return run


# --- arithmetic ---------------------------------------------------------------------------

_add = _elementwise(torch.add, np.add)
_sub = _elementwise(torch.sub, np.subtract)
_mul = _elementwise(torch.mul, np.multiply)


@register("Add")
def add(ctx, a, b):
    return _add(a, b)


@register("Sub")
def sub(ctx, a, b):
    return _sub(a, b)


@register("Mul")
def mul(ctx, a, b):
    return _mul(a, b)


def _numpy_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.dtype.kind in "iu":
        return np.trunc(np.true_divide(a, b)).astype(a.dtype) if a.dtype.kind == "i" else a // b
    return np.divide(a, b).astype(a.dtype)


@register("Div")
def div(ctx, a, b):
    """Integer division truncates toward zero (C semantics), as onnxruntime and the reference do."""
    if _needs_numpy(a, b):
        return _via_numpy(_numpy_div, a, b)
    if a.is_floating_point() or a.is_complex():
        return a / b
    return torch.div(a, b, rounding_mode="trunc")


@register("Pow")
def pow_(ctx, a, b):
    """The result has the base's type; the exponent may be of another numeric type."""
    if _needs_numpy(a):
        return _via_numpy(lambda x, y: np.power(x, y).astype(x.dtype), a, b)
    if _needs_numpy(b):
        b = b.to(torch.float64 if a.is_floating_point() else torch.int64)
    if not a.is_floating_point() and b.is_floating_point():
        # integer base, float exponent: compute in double like numpy, then truncate
        return torch.pow(a.to(torch.float64), b.to(torch.float64)).to(a.dtype)
    out = torch.pow(a, b)
    return out if out.dtype == a.dtype else out.to(a.dtype)


@register("Mod")
def mod(ctx, a, b, *, fmod=0):
    """fmod=0: the remainder takes the divisor's sign (Python %); fmod=1: the dividend's (C fmod)."""
    if _needs_numpy(a, b):
        return _via_numpy(np.fmod if fmod else np.mod, a, b)
    return torch.fmod(a, b) if fmod else torch.remainder(a, b)


def _variadic(ctx, values: tuple, combine: Callable[[Any, Any], Any]) -> Any:
    if not values:
        raise ValueError(f"{ctx.op_type} needs at least one input")
    return functools.reduce(combine, values)


_maximum = _elementwise(torch.maximum, np.maximum)
_minimum = _elementwise(torch.minimum, np.minimum)


@register("Max")
def max_(ctx, *values):
    return _variadic(ctx, values, _maximum)


@register("Min")
def min_(ctx, *values):
    return _variadic(ctx, values, _minimum)


@register("Sum")
def sum_(ctx, *values):
    return _variadic(ctx, values, _add)


@register("Mean")
def mean(ctx, *values):
    total = _variadic(ctx, values, _add)
    if _needs_numpy(total):
        return _via_numpy(lambda t: (t / len(values)).astype(t.dtype), total)
    return total / len(values)


# --- unary math ---------------------------------------------------------------------------


def _unary(op_type: str, torch_fn: Callable[..., Any], numpy_fn: Callable[..., Any]) -> None:
    run = _elementwise(torch_fn, numpy_fn)

    def kernel(ctx, x):
        return run(x)

    kernel.__name__ = kernel.__qualname__ = op_type.lower()
    register(op_type)(kernel)


_unary("Neg", torch.neg, np.negative)
_unary("Abs", torch.abs, np.abs)
_unary("Sign", torch.sign, np.sign)
_unary("Sqrt", torch.sqrt, np.sqrt)
_unary("Exp", torch.exp, np.exp)
_unary("Log", torch.log, np.log)
_unary("Reciprocal", torch.reciprocal, np.reciprocal)
_unary("Sin", torch.sin, np.sin)
_unary("Cos", torch.cos, np.cos)
_unary("Tan", torch.tan, np.tan)
_unary("Asin", torch.asin, np.arcsin)
_unary("Acos", torch.acos, np.arccos)
_unary("Atan", torch.atan, np.arctan)
_unary("Sinh", torch.sinh, np.sinh)
_unary("Cosh", torch.cosh, np.cosh)
_unary("Asinh", torch.asinh, np.arcsinh)
_unary("Acosh", torch.acosh, np.arccosh)
_unary("Atanh", torch.atanh, np.arctanh)
_unary("Ceil", torch.ceil, np.ceil)
_unary("Floor", torch.floor, np.floor)
_unary("Round", torch.round, np.round)  # both round half to even, as ONNX asks
_unary("Erf", torch.erf, np.vectorize(math.erf))
_unary("IsNaN", torch.isnan, np.isnan)


@register("IsInf")
def isinf(ctx, x, *, detect_negative=1, detect_positive=1):
    if detect_negative and detect_positive:
        return torch.isinf(x)
    if detect_positive:
        return torch.isposinf(x)
    if detect_negative:
        return torch.isneginf(x)
    return torch.zeros_like(x, dtype=torch.bool)


# --- comparisons and logic ----------------------------------------------------------------

_unary("Not", torch.logical_not, np.logical_not)

for _op_type, _torch_fn, _numpy_fn in [
    ("Equal", torch.eq, np.equal),
    ("Less", torch.lt, np.less),
    ("LessOrEqual", torch.le, np.less_equal),
    ("Greater", torch.gt, np.greater),
    ("GreaterOrEqual", torch.ge, np.greater_equal),
    ("And", torch.logical_and, np.logical_and),
    ("Or", torch.logical_or, np.logical_or),
    ("Xor", torch.logical_xor, np.logical_xor),
    ("BitwiseAnd", torch.bitwise_and, np.bitwise_and),
    ("BitwiseOr", torch.bitwise_or, np.bitwise_or),
    ("BitwiseXor", torch.bitwise_xor, np.bitwise_xor),
]:

    def _binary_kernel(ctx, a, b, _run=_elementwise(_torch_fn, _numpy_fn)):
        return _run(a, b)

    _binary_kernel.__name__ = _binary_kernel.__qualname__ = _op_type.lower()
    register(_op_type)(_binary_kernel)

_unary("BitwiseNot", torch.bitwise_not, np.invert)


@register("BitShift")
def bitshift(ctx, x, y, *, direction):
    direction = direction.decode() if isinstance(direction, bytes) else direction
    if direction not in ("LEFT", "RIGHT"):
        raise ValueError(f"BitShift direction must be LEFT or RIGHT, got {direction!r}")
    left = direction == "LEFT"
    if _needs_numpy(x, y):
        return _via_numpy(np.left_shift if left else np.right_shift, x, y)
    return torch.bitwise_left_shift(x, y) if left else torch.bitwise_right_shift(x, y)


@register("Where")
def where(ctx, condition, x, y):
    if _needs_numpy(x, y):
        return _via_numpy(np.where, condition, x, y)
    return torch.where(condition, x, y)


# --- Clip ---------------------------------------------------------------------------------

_FLT_MAX = 3.4028234663852886e38


@register("Clip")
def clip(ctx, x, low=None, high=None, *, min=-_FLT_MAX, max=_FLT_MAX):  # noqa: A002
    """Opset < 11 bounds come as attributes `min`/`max`; from 11 as optional scalar inputs."""
    if ctx.opset < 11:
        low, high = min, max
    else:
        low = None if low is None else scalar(low)
        high = None if high is None else scalar(high)
    if low is None and high is None:
        return x
    if _needs_numpy(x):
        return _via_numpy(lambda v: np.clip(v, low, high).astype(v.dtype), x)
    return torch.clamp(x, low, high)  # min > max gives max everywhere, as numpy.clip does
