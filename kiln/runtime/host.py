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
NEVER_ON_HOST = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial"}
SHAPE_OPS = {"Shape", "Size"}  # read only their input's shape: host steps wherever the input lives

# Inputs an op reads on the host (shapes, axes, counts, scalars: kiln/ops reads them with ints() or
# scalar()), by op and input index. A device layer is given every other host tensor on the device
# (uploaded once per shape plan): torch would otherwise copy it inside the kernel call, a transfer
# that waits for the host and makes CUDA-graph capture impossible (GatherND with host indices).
_REDUCE_OPS = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
               "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")
HOST_INPUTS: dict[str, frozenset[int]] = {op: frozenset(inputs) for op, inputs in {
    "Reshape": {1}, "Split": {1}, "Slice": {1, 2, 3, 4}, "Squeeze": {1}, "Unsqueeze": {1}, "Expand": {1},
    "Tile": {1, 2, 3}, "Pad": {1, 2, 3}, "CenterCropPad": {1}, "ConstantOfShape": {0}, "Range": {0, 1, 2},
    "Dropout": {1, 2}, "TopK": {1}, "OneHot": {1}, "Trilu": {1}, "MaxUnpool": {2}, "Col2Im": {1, 2},
    "AffineGrid": {1}, "NonMaxSuppression": {2, 3, 4}, "Resize": {1, 2, 3}, "Upsample": {1}, "Clip": {1, 2},
    "If": {0}, "Loop": {0, 1}, "SplitToSequence": {1}, "SequenceAt": {1}, "SequenceInsert": {2},
    "SequenceErase": {1}, "DFT": {1, 2}, "STFT": {1, 3}, "CumSum": {1},
    **{op: {1} for op in _REDUCE_OPS},
}.items()}


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
