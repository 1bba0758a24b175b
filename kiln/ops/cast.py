"""Type conversions: Cast, CastLike, BitCast.

torch converts between the types it holds (rounding to nearest even, as ONNX asks). Three
corners need more:
- float8 with saturate=1 (the default) clamps to the type's finite range first, so inf and
  out-of-range values become +-max; with saturate=0, ml_dtypes converts (overflow gives NaN
  or inf as the format has), since torch's float8_e4m3fn conversion saturates on its own.
- float8e8m0 (a power-of-two scale) is built from the float32 exponent bits, with the
  round_mode the op names ("up" by default).
- int4/uint4/int2/uint2/float4e2m1 and strings live in numpy arrays, converted with ml_dtypes
  and numpy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kiln.ir import dtypes
from kiln.ir.dtypes import DType
from kiln.ops._util import from_numpy, to_numpy
from kiln.ops.registry import register

_FLOAT8 = frozenset({"float8e4m3fn", "float8e4m3fnuz", "float8e5m2", "float8e5m2fnuz"})


def dtype_of(value: Any) -> DType:
    if isinstance(value, torch.Tensor):
        return dtypes.from_torch(value.dtype)
    return dtypes.from_numpy(np.asarray(value).dtype)


def _target(to: Any) -> DType:
    """`to` is an ONNX type id; Cast-1 spelled it as a type name ("FLOAT")."""
    if isinstance(to, bytes):
        to = to.decode()
    if isinstance(to, str):
        return dtypes.BY_NAME[to.lower()]
    return dtypes.from_onnx(int(to))


def _text(mode: Any) -> str:
    return mode.decode() if isinstance(mode, bytes) else mode


def _to_float8e8m0(x: torch.Tensor, saturate: bool, round_mode: str) -> torch.Tensor:
    """float -> e8m0 (an 8-bit biased exponent, no sign, no mantissa), as onnx.numpy_helper does.

    Inf and NaN map to 0xFF (NaN); other values keep their float32 exponent, rounded by
    `round_mode` ("up": any mantissa bit bumps the exponent; "nearest": round half to even
    on the exponent's scale; "down": truncate). saturate stops rounding up past 2^127.
    """
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    special = exponent == 0xFF
    if round_mode == "up":
        round_up = ((bits & 0x7FFFFF) != 0) & ~special
    elif round_mode == "nearest":
        guard = (bits & 0x400000) != 0
        rest = (bits & 0x3FFFFF) != 0
        round_up = guard & (rest | (exponent > 0)) & ~special
    elif round_mode == "down":
        round_up = torch.zeros_like(special)
    else:
        raise ValueError(f"round_mode must be 'up', 'nearest' or 'down', got {round_mode!r}")
    if saturate:
        round_up = round_up & (exponent != 0xFE)
    exponent = torch.where(special, 0xFF, (exponent + round_up.to(exponent.dtype)) & 0xFF)
    out = exponent.to(torch.uint8)
    e8m0 = dtypes.BY_NAME["float8e8m0"].torch
    if e8m0 is None:  # a torch without float8_e8m0fnu: the value stays a numpy array
        return out.cpu().numpy().view(dtypes.BY_NAME["float8e8m0"].numpy)
    return out.view(e8m0)


def _to_string(array: np.ndarray) -> np.ndarray:
    """Numbers as text the way onnxruntime writes them: floats as "%.8g" ("0.1", "100", "1e+20"),
    the spec's reserved literals "INF"/"-INF"/"NaN", bools as "1"/"0"."""
    if array.dtype.kind == "O":
        return array
    if array.dtype == np.bool_:
        array = array.astype(np.uint8)
    if array.dtype.kind in "iu":
        return array.astype(np.str_).astype(object)
    values = array.astype(np.float64).reshape(-1)
    special = {np.inf: "INF", -np.inf: "-INF"}
    text = ["NaN" if v != v else special.get(v) or "%.8g" % v for v in values.tolist()]
    return np.array(text, dtype=object).reshape(array.shape)


def _from_string(array: np.ndarray, target: DType) -> np.ndarray:
    """Numbers in plain or scientific notation, "INF"/"+INF"/"-INF"/"NaN" in any case."""
    text = np.char.strip(array.astype(np.str_))
    if target.name == "bool":
        lower = np.char.lower(text)
        words = (lower == "true") | (lower == "false")
        numbers = np.where(words, "0", text).astype(np.float64)
        return np.where(words, lower == "true", numbers != 0)
    return text.astype(np.float64).astype(target.numpy)  # to integers: "100.5" -> 100, as the spec allows


def cast_to(x: Any, target: DType, saturate: bool = True, round_mode: str = "up") -> Any:
    """Convert one runtime value to `target` with ONNX Cast semantics."""
    source = dtype_of(x)
    if source == target:
        return x
    if target.name == "string":
        return _to_string(to_numpy(x))
    if source.name == "string":
        return from_numpy(_from_string(np.asarray(x), target))
    if target.name == "float8e8m0":
        if isinstance(x, np.ndarray):
            x = torch.from_numpy(x.astype(np.float32))
        return _to_float8e8m0(x, saturate, round_mode)
    if target.torch is None or isinstance(x, np.ndarray) or (target.name in _FLOAT8 and not saturate):
        # numpy-only types on either side, or float8 overflow to NaN/inf: ml_dtypes converts
        like = x if isinstance(x, torch.Tensor) else None
        array = to_numpy(x)
        with np.errstate(all="ignore"):
            out = array.astype(target.numpy)
        return from_numpy(out, like) if target.torch is not None else out
    if target.name in _FLOAT8:
        if not x.is_floating_point():
            x = x.to(torch.float32)
        limit = torch.finfo(target.torch).max
        x = torch.clamp(x, -limit, limit)  # NaN stays NaN; inf becomes +-max
    return x.to(target.torch)


@register("Cast")
def cast(ctx, x, *, to, saturate=1, round_mode="up"):
    return cast_to(x, _target(to), bool(saturate), _text(round_mode))


@register("CastLike")
def cast_like(ctx, x, target_type, *, saturate=1, round_mode="up"):
    return cast_to(x, dtype_of(target_type), bool(saturate), _text(round_mode))


@register("BitCast")
def bitcast(ctx, x, *, to):
    """Reinterpret the bytes of each element as another type of the same width."""
    source, target = dtype_of(x), _target(to)
    if "string" in (source.name, target.name):
        raise ValueError(f"BitCast cannot convert {source.name} to {target.name}: strings have no fixed width")
    if source.numpy.itemsize != target.numpy.itemsize or source.numpy.itemsize == 0:
        raise ValueError(
            f"BitCast needs types of one width, got {source.name} ({source.numpy.itemsize * 8} bits) "
            f"and {target.name} ({target.numpy.itemsize * 8} bits)"
        )
    if isinstance(x, torch.Tensor) and target.torch is not None:
        return x.contiguous().view(target.torch)
    like = x if isinstance(x, torch.Tensor) else None
    out = np.ascontiguousarray(to_numpy(x)).view(target.numpy)
    return from_numpy(out, like) if target.torch is not None else out
