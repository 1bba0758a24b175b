"""Softmax over the last axis in kiln's C (softmax.c, compiled into the transformer kernels' library): a layer at
fixed sizes as a NativeKernel (kiln/kernels/cpu/transformer.py), a native-segment member through
kiln/tactics/cpu/softmax.py."""

from __future__ import annotations

import ctypes

from kiln.kernels.cpu.transformer import PARALLEL_ELEMENTS, NativeKernel, _rows


class _SoftmaxPlan(ctypes.Structure):  # softmax_plan
    _fields_ = [("get_handle", ctypes.c_void_p), ("x", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("rows", ctypes.c_long), ("n", ctypes.c_long), ("grain", ctypes.c_long)]


class Softmax(NativeKernel):
    """y = softmax(x) over the last axis of `size`, float32, rows in one pass each (max, shifted exps and their sum,
    times 1 / sum)."""

    PLAN, FUNCTION = _SoftmaxPlan, "kiln_softmax"

    def __init__(self, size: tuple[int, ...]):
        super().__init__(f"softmax {list(size)}")
        if not size or int(size[-1]) <= 0:
            raise ValueError(f"{self.what}: no rows to normalize")
        n = int(size[-1])
        self.output_size = tuple(size)
        self.roles = {0: ("x",), "dst": ("y",)}
        self.fields = dict(rows=_rows(size), n=n, grain=max(1, PARALLEL_ELEMENTS // n))

    @staticmethod
    def size_fields(size: tuple[int, ...]) -> dict[str, int]:
        """The plan fields that follow the input size (its width fixed by the layer's tuned size)."""
        return dict(rows=_rows(size))
