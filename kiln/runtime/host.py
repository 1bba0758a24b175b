"""Running a program on CUDA, the host's side: shape arithmetic on the host, once per shape.

Values computed only from constants and shapes (Shape, Gather on a shape, Concat of dims,
Range over a length...) are functions of the input *shapes*, not of the data. The runtime
computes them on the CPU, once per input-shape signature, and remembers them in a
`ShapePlan` — as TensorRT computes shape tensors on the host. What remains is device work
that never waits on the host, so the whole step list can be captured into one CUDA graph
per concrete input shape and replayed (`GraphRunner`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

HOST_MAX_NUMEL = 4096  # host results larger than this move to the device once and stay there


@dataclass
class ShapePlan:
    """What one input-shape signature taught the runtime (valid for that signature only)."""

    host_outputs: dict[int, list[Any]] = field(default_factory=dict)  # step -> its outputs
    uploads: dict[int, dict[int, Any]] = field(default_factory=dict)  # step -> arg -> device copy
    recording: bool = True


def on_device(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type == "cuda"
    if isinstance(value, list):
        return any(on_device(v) for v in value)
    return False


def upload(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor) and value.device != device:
        return value.to(device)
    if isinstance(value, list):
        return [upload(v, device) for v in value]
    return value


def place(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() > HOST_MAX_NUMEL:
        return value.to(device)
    return value


def outputs_of(result: Any, n: int) -> list[Any]:
    if n == 1:
        return [result[0] if isinstance(result, tuple) else result]
    return list(result)


@contextlib.contextmanager
def host_sync_is_an_error() -> Iterator[None]:
    """Inside, torch raises on any operation that would synchronize with the host: a run that
    passes may be captured into a CUDA graph (the runtime's capture, the autotuner's timing)."""
    with warnings.catch_warnings():  # "prototype feature": it is, and it is what we need
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
