"""Small helpers shared by op implementations."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kiln.ir import dtypes


def ints(value: Any) -> list[int]:
    """A shape/axes/indices input (tensor, array or list) as a list of Python ints."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(-1).tolist()]
    return [int(v) for v in np.asarray(value).reshape(-1).tolist()]


def scalar(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.reshape(-1)[0].item()
    return np.asarray(value).reshape(-1)[0].item()


# ONNX ops whose inputs broadcast multidirectionally (numpy's rule; PRelu's slope broadcasts one way only: not here)
MULTIDIRECTIONAL = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean", "Equal", "Less",
                              "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor", "Where", "BitShift",
                              "BitwiseAnd", "BitwiseOr", "BitwiseXor"})


def broadcast_sizes(*sizes: tuple[int, ...]) -> tuple[int, ...]:
    """numpy's (ONNX's multidirectional) broadcast of `sizes`, a ValueError when they do not. In
    Python: torch.broadcast_shapes costs tens of microseconds a call (symbolic-shape checks); Expand runs
    this on every call of a transformer's mask preparation, kiln's CPU broadcast kernels whenever a native
    segment binds a new input size."""
    rank = max((len(s) for s in sizes), default=0)
    out = []
    for axis in range(rank):
        dim = 1
        for s in sizes:
            k = axis - rank + len(s)
            if k >= 0 and s[k] != 1:
                if dim != 1 and s[k] != dim:
                    raise ValueError(f"sizes {[list(z) for z in sizes]} do not broadcast "
                                     f"(axis {axis}: {dim} vs {s[k]})")
                dim = s[k]
        out.append(dim)
    return tuple(out)


def merge_walked_dims(shape: list[int], strides: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dims; merge neighbours d, d+1 that every operand walks as one (stride_d = stride_d+1·size_d+1):
    the fewest, longest loops over a broadcast elementwise op (the Triton and the C Elementwise kernels)."""
    keep = [d for d, size in enumerate(shape) if size != 1]
    shape = [shape[d] for d in keep]
    strides = [[s[d] for d in keep] for s in strides]
    d = len(shape) - 2
    while d >= 0:
        if all(s[d] == s[d + 1] * shape[d + 1] for s in strides):
            shape[d:d + 2] = [shape[d] * shape[d + 1]]
            for s in strides:
                s[d:d + 2] = [s[d + 1]]
        d -= 1
    return shape, strides


def norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def torch_dtype(onnx_id: int) -> torch.dtype | None:
    return dtypes.from_onnx(onnx_id).torch


def to_numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return dtypes.torch_to_numpy(value)
    return np.asarray(value)


def from_numpy(array: np.ndarray, like: torch.Tensor | None = None) -> Any:
    """numpy result -> runtime value (torch where it can hold the type), on `like`'s device."""
    out = dtypes.numpy_to_torch(np.ascontiguousarray(array).reshape(np.shape(array)))
    if like is not None and isinstance(out, torch.Tensor) and like.device.type != "cpu":
        out = out.to(like.device)
    return out
