"""onnx_ir tensors -> the values kiln's ops and engines hold (torch tensors; numpy object arrays
for strings). Used at build time (folding, lowering); the runtime never imports onnx_ir."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.ir import dtypes


def tensor_to_runtime(tensor: ir.TensorProtocol, copy: bool = True) -> Any:
    """The tensor's values as the runtime holds them (torch where it can). copy=False: a writable array is
    shared, not copied (the caller owns the tensor and never writes to it again)."""
    array = tensor.numpy()
    if array.dtype == object or array.dtype.kind in "SU":
        return np.array([s.decode("utf-8", "surrogateescape") if isinstance(s, bytes) else s
                         for s in array.ravel()], dtype=object).reshape(array.shape)
    dt = dtypes.from_onnx(int(tensor.dtype))
    if array.dtype != dt.numpy:
        array = array.view(dt.numpy) if array.dtype.itemsize == dt.numpy.itemsize else array.astype(dt.numpy)
    return dtypes.numpy_to_torch(np.array(array, copy=True) if copy else array)
