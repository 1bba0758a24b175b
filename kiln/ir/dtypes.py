"""Element types: one table mapping ONNX type ids to numpy and torch.

This module is imported by the lean runtime, so it must not import `onnx`: the ONNX
`TensorProto.DataType` numbers are written out here.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import torch


@dataclass(frozen=True)
class DType:
    onnx_id: int
    name: str  # ONNX spelling, lower case: "float", "float16", "int64", ...
    numpy: np.dtype | None
    torch: torch.dtype | None  # None: torch cannot hold it; values stay numpy arrays
    safetensors: str | None  # safetensors' dtype code, None: stored another way

    @property
    def is_float(self) -> bool:
        return self.name in FLOAT_NAMES


def _t(name: str) -> torch.dtype | None:
    return getattr(torch, name, None)


_TABLE = [
    DType(1, "float", np.dtype(np.float32), torch.float32, "F32"),
    DType(2, "uint8", np.dtype(np.uint8), torch.uint8, "U8"),
    DType(3, "int8", np.dtype(np.int8), torch.int8, "I8"),
    DType(4, "uint16", np.dtype(np.uint16), _t("uint16"), "U16"),
    DType(5, "int16", np.dtype(np.int16), torch.int16, "I16"),
    DType(6, "int32", np.dtype(np.int32), torch.int32, "I32"),
    DType(7, "int64", np.dtype(np.int64), torch.int64, "I64"),
    DType(8, "string", np.dtype(object), None, None),
    DType(9, "bool", np.dtype(np.bool_), torch.bool, "BOOL"),
    DType(10, "float16", np.dtype(np.float16), torch.float16, "F16"),
    DType(11, "double", np.dtype(np.float64), torch.float64, "F64"),
    DType(12, "uint32", np.dtype(np.uint32), _t("uint32"), "U32"),
    DType(13, "uint64", np.dtype(np.uint64), _t("uint64"), "U64"),
    DType(14, "complex64", np.dtype(np.complex64), torch.complex64, None),
    DType(15, "complex128", np.dtype(np.complex128), torch.complex128, None),
    DType(16, "bfloat16", np.dtype(ml_dtypes.bfloat16), torch.bfloat16, "BF16"),
    DType(17, "float8e4m3fn", np.dtype(ml_dtypes.float8_e4m3fn), _t("float8_e4m3fn"), "F8_E4M3"),
    DType(18, "float8e4m3fnuz", np.dtype(ml_dtypes.float8_e4m3fnuz), _t("float8_e4m3fnuz"), None),
    DType(19, "float8e5m2", np.dtype(ml_dtypes.float8_e5m2), _t("float8_e5m2"), "F8_E5M2"),
    DType(20, "float8e5m2fnuz", np.dtype(ml_dtypes.float8_e5m2fnuz), _t("float8_e5m2fnuz"), None),
    DType(21, "uint4", np.dtype(ml_dtypes.uint4), None, None),
    DType(22, "int4", np.dtype(ml_dtypes.int4), None, None),
    DType(23, "float4e2m1", np.dtype(ml_dtypes.float4_e2m1fn), None, None),
    DType(24, "float8e8m0", np.dtype(ml_dtypes.float8_e8m0fnu), _t("float8_e8m0fnu"), None),
    DType(25, "uint2", np.dtype(ml_dtypes.uint2), None, None),
    DType(26, "int2", np.dtype(ml_dtypes.int2), None, None),
]

FLOAT_NAMES = {
    "float", "float16", "double", "bfloat16", "float8e4m3fn", "float8e4m3fnuz",
    "float8e5m2", "float8e5m2fnuz", "float4e2m1", "float8e8m0",
}

BY_ID: dict[int, DType] = {d.onnx_id: d for d in _TABLE}
BY_NAME: dict[str, DType] = {d.name: d for d in _TABLE}
BY_NUMPY: dict[np.dtype, DType] = {d.numpy: d for d in _TABLE if d.numpy is not None}
BY_TORCH: dict[torch.dtype, DType] = {d.torch: d for d in _TABLE if d.torch is not None}


def from_onnx(onnx_id: int) -> DType:
    try:
        return BY_ID[onnx_id]
    except KeyError:
        raise ValueError(f"ONNX element type {onnx_id} is not known to kiln") from None


def from_numpy(dtype: np.dtype) -> DType:
    dtype = np.dtype(dtype)
    if dtype.kind in ("U", "S", "O"):
        return BY_NAME["string"]
    try:
        return BY_NUMPY[dtype]
    except KeyError:
        raise ValueError(f"numpy dtype {dtype} has no ONNX counterpart") from None


def from_torch(dtype: torch.dtype) -> DType:
    try:
        return BY_TORCH[dtype]
    except KeyError:
        raise ValueError(f"torch dtype {dtype} has no ONNX counterpart") from None


# torch dtypes numpy holds as they are, with no conjugate or negative bit: tensor.numpy() in one call
NUMPY_REAL = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
              torch.uint8, torch.bool}


def numpy_to_torch(array: np.ndarray) -> torch.Tensor | np.ndarray:
    """Zero-copy where torch can hold the type; numpy kept for strings and sub-byte types."""
    dt = from_numpy(array.dtype)
    if dt.torch is None:
        return array
    if array.dtype.kind in "biufc" and array.dtype.type.__module__ == "numpy":
        if not array.flags.writeable:
            array = array.copy()
        if array.ndim and array.flags.c_contiguous:
            return torch.from_numpy(array)  # the common case in one call: engines run it on every input
        return torch.from_numpy(np.ascontiguousarray(array)).reshape(array.shape)  # keeps 0-d
    # ml_dtypes (bfloat16, float8...): reinterpret the bytes.
    raw = np.ascontiguousarray(array).view(np.uint8 if array.itemsize == 1 else np.uint16)
    if not raw.flags.writeable:
        raw = raw.copy()
    return torch.from_numpy(raw).view(dt.torch).reshape(array.shape)


def torch_to_numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype in NUMPY_REAL and not tensor.requires_grad and tensor.is_cpu:
        return tensor.numpy()  # no conjugate or negative bit on real types: one call (every engine output; is_cpu, not
        # device.type: no device object made, ~0.26 µs a call less)
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    dt = from_torch(tensor.dtype)
    if dt.numpy.type.__module__ == "numpy":
        return tensor.resolve_conj().resolve_neg().numpy()
    carrier = torch.uint8 if tensor.element_size() == 1 else torch.int16
    return tensor.contiguous().view(carrier).numpy().view(dt.numpy)
