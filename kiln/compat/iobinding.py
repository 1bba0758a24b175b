"""OrtValue and IOBinding: onnxruntime's way to keep inputs and outputs on a device between runs.

An OrtValue here holds a torch tensor (on the CPU or a CUDA device), so a CUDA engine reads bound
device inputs and hands device outputs back without a copy through the host, which is what
`run_with_iobinding` is for. Raw buffer pointers (`bind_input(..., buffer_ptr=...)`) are refused
with the reason: kiln cannot know the memory's owner or lifetime; bind an OrtValue instead.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kiln.errors import KilnError
from kiln.ir import dtypes


def _torch_device(device_type: str, device_id: int) -> torch.device:
    kind = device_type.lower()
    if kind == "cpu":
        return torch.device("cpu")
    if kind in ("cuda", "gpu"):
        return torch.device("cuda", device_id)
    raise KilnError(f"device type {device_type!r}: kiln binds values on 'cpu' or 'cuda'")


class OrtValue:
    """onnxruntime.OrtValue over a torch tensor."""

    def __init__(self, tensor: torch.Tensor | np.ndarray):
        self._value = tensor

    @classmethod
    def ortvalue_from_numpy(cls, array: np.ndarray, device_type: str = "cpu", device_id: int = 0) -> OrtValue:
        device = _torch_device(device_type, device_id)
        converted = dtypes.numpy_to_torch(np.asarray(array))
        if isinstance(converted, np.ndarray):  # strings and types torch cannot hold stay numpy, on the host
            if device.type != "cpu":
                raise KilnError(f"an array of {array.dtype} cannot live on {device}")
            return cls(converted)
        return cls(converted.to(device))

    @classmethod
    def ortvalue_from_shape_and_type(cls, shape: list[int], element_type: Any, device_type: str = "cpu",
                                     device_id: int = 0) -> OrtValue:
        dt = dtypes.from_numpy(np.dtype(element_type))
        return cls(torch.empty(list(shape), dtype=dt.torch, device=_torch_device(device_type, device_id)))

    def numpy(self) -> np.ndarray:
        if isinstance(self._value, np.ndarray):
            return self._value
        return dtypes.torch_to_numpy(self._value.detach().cpu())

    def shape(self) -> list[int]:
        return list(self._value.shape)

    def data_type(self) -> str:
        return f"tensor({self._dtype().name})"

    def element_type(self) -> np.dtype:
        return self._dtype().numpy

    def device_name(self) -> str:
        return "cpu" if isinstance(self._value, np.ndarray) or self._value.device.type == "cpu" else "cuda"

    def is_tensor(self) -> bool:
        return True

    def has_value(self) -> bool:
        return True

    def data_ptr(self) -> int:
        return self._value.ctypes.data if isinstance(self._value, np.ndarray) else self._value.data_ptr()

    def as_tensor(self) -> torch.Tensor | np.ndarray:
        """kiln's addition: the tensor itself (no copy)."""
        return self._value

    def _dtype(self) -> dtypes.DType:
        if isinstance(self._value, np.ndarray):
            return dtypes.from_numpy(self._value.dtype)
        return dtypes.from_torch(self._value.dtype)


class IOBinding:
    """onnxruntime.IOBinding for a kiln.InferenceSession (session.io_binding())."""

    def __init__(self, session: Any):
        self._session = session
        self.inputs: dict[str, OrtValue] = {}
        self.outputs: dict[str, OrtValue | torch.device | None] = {}  # a value to fill, or where to put it
        self.results: dict[str, OrtValue] = {}

    def bind_cpu_input(self, name: str, array: np.ndarray) -> None:
        self.inputs[name] = OrtValue.ortvalue_from_numpy(array)

    def bind_input(self, name: str, device_type: str, device_id: int, element_type: Any, shape: list[int],
                   buffer_ptr: int) -> None:
        raise KilnError(f"bind_input({name!r}, ..., buffer_ptr=...): kiln does not bind raw device pointers (it "
                        "cannot know who owns the memory); bind an OrtValue with bind_ortvalue_input, or a numpy "
                        "array with bind_cpu_input")

    def bind_ortvalue_input(self, name: str, value: OrtValue) -> None:
        self.inputs[name] = value

    def bind_output(self, name: str, device_type: str = "cpu", device_id: int = 0, element_type: Any = None,
                    shape: list[int] | None = None, buffer_ptr: int | None = None) -> None:
        if buffer_ptr is not None:
            raise KilnError(f"bind_output({name!r}, ..., buffer_ptr=...): kiln does not write to raw pointers; "
                            "bind an OrtValue with bind_ortvalue_output, or bind the device only")
        self.outputs[name] = _torch_device(device_type, device_id)

    def bind_ortvalue_output(self, name: str, value: OrtValue) -> None:
        self.outputs[name] = value

    def get_outputs(self) -> list[OrtValue]:
        return [self.results[name] for name in self.outputs if name in self.results]

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        return [value.numpy() for value in self.get_outputs()]

    def clear_binding_inputs(self) -> None:
        self.inputs.clear()

    def clear_binding_outputs(self) -> None:
        self.outputs.clear()
        self.results.clear()

    def synchronize_inputs(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def synchronize_outputs(self) -> None:
        self.synchronize_inputs()

    def store(self, results: dict[str, Any]) -> None:
        """The session's run results into the bound outputs (all outputs when none were bound)."""
        if not self.outputs:
            self.outputs = {name: None for name in results}
        self.results = {}
        for name, where in self.outputs.items():
            value = results[name]
            if isinstance(where, OrtValue):
                target = where.as_tensor()
                if list(target.shape) != list(value.shape):
                    raise KilnError(f"output {name!r} is {list(value.shape)}, but the bound OrtValue is "
                                    f"{list(target.shape)}")
                if isinstance(target, np.ndarray):
                    target[...] = value if isinstance(value, np.ndarray) else dtypes.torch_to_numpy(value.cpu())
                else:
                    target.copy_(value if isinstance(value, torch.Tensor) else torch.from_numpy(value))
                self.results[name] = where
            elif isinstance(value, torch.Tensor):
                self.results[name] = OrtValue(value if where is None else value.to(where))
            else:
                self.results[name] = OrtValue(value)
