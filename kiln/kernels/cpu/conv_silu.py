"""A oneDNN convolution followed by kiln's SiLU in place (se.c's kiln_silu): y = silu(conv(x) + b).

Why: oneDNN applies SiLU as its swish post-op, and on an AMD EPYC (Zen 4) core that costs 0.55-1.1 ns an output
element with AVX2 and ~0.5 with AVX-512, against ~0.25 ns (AVX-512) and ~0.35-0.5 (AVX2) for se.c's loop over the
written output, memory included: 1x1 16->96 at 112x112 (1.2M outputs, AVX-512) took 0.41 ms without the post-op,
0.99-1.23 with it and 0.83 as the convolution and the loop's earlier scalar form (0.36 ns an element). EfficientNet-B0
has ~6M SiLU outputs a run (bench/results/zoo-cpu-2026-12-03b.md).
On small layers the two are near: which one a layer runs is the autotuner's pick between cpu.conv.onednn_direct and
cpu.conv.onednn_silu, timed on the machine.

ConvSiLU has the members a native segment binds (kiln/runtime/native.py): `bind` gives the convolution's Bound
with one more call, kiln_silu over the convolution's own destination memory object, so a segment that points
the output elsewhere moves both.
"""

from __future__ import annotations

import ctypes
import math
import threading

import torch

from kiln.kernels.cpu import onednn, onednn_primitives, se

PARALLEL_ELEMENTS = 1 << 15  # below this many outputs one thread: a parallel region costs a few µs


class _Plan(ctypes.Structure):  # silu_plan in se.c
    _fields_ = [("get_handle", ctypes.c_void_p), ("x", ctypes.c_void_p), ("n", ctypes.c_long),
                ("threads", ctypes.c_int)]


class ConvSiLU:
    """`conv` (a Conv2d built without an activation or residual) followed by SiLU over its output."""

    def __init__(self, conv: onednn_primitives.Conv2d):
        library = se.load()
        if library is None:
            raise onednn.OneDNNError(f"kiln's SiLU kernel is not built: {se.reason()}")
        if conv.residual:
            raise ValueError("ConvSiLU: the convolution has a residual; SiLU would follow the add")
        self.conv = conv
        self.input_size, self.output_size = conv.input_size, conv.output_size
        self.implementation = conv.implementation + " + kiln_silu"
        self._library = library
        self._lock = threading.Lock()
        self._alone: _Bound | None = None

    def bind(self, src: int, dst: int, residual: int | None = None) -> _Bound:
        if residual is not None:
            raise ValueError("ConvSiLU: no residual")
        return _Bound(self, self.conv.bind(src, dst))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, C, H, W] channels-last float32 of the built size -> silu(conv(x)), channels-last."""
        y = self.conv(x)
        with self._lock:
            if self._alone is None:
                self._alone = _Bound(self, None)
            self._alone.silu_over(y)
        return y


class _Bound:
    """The convolution's Bound (None on the per-call path) and kiln_silu over its destination."""

    def __init__(self, layer: ConvSiLU, conv: onednn.Bound | None):
        lib = onednn.load()
        self._layer, self._conv = layer, conv
        self.what = f"convolution {list(layer.input_size)} -> {list(layer.output_size)} + SiLU"
        if conv is not None:
            self._dst = conv.memory("dst")
        else:  # the per-call path's own memory object, pointed at each output
            self._md = onednn.memory_desc([1], onednn.TAG_A)
            self._own = onednn._memory(self._md.value, None)
            self._dst = self._own.value
        n = math.prod(layer.output_size)
        get_handle = ctypes.cast(lib.lib.dnnl_memory_get_data_handle, ctypes.c_void_p).value
        parallel = n >= PARALLEL_ELEMENTS and layer.conv.threads is None
        self._plan = _Plan(get_handle=get_handle, x=self._dst, n=n, threads=torch.get_num_threads() if parallel else 1)
        self._serial_plan = _Plan(get_handle=get_handle, x=self._dst, n=n, threads=1)
        self._function = ctypes.cast(layer._library.kiln_silu, ctypes.c_void_p).value

    def calls(self) -> list[tuple[int | None, int, int, int]]:
        return self._conv.calls() + [(self._function, ctypes.addressof(self._plan), 0, 0)]

    def serial_calls(self) -> list[tuple[int | None, int, int, int]] | None:
        """calls() of the serial form, or None where the convolution has none."""
        serial = self._conv.serial_calls()
        if serial is None:
            return None
        return serial + [(self._function, ctypes.addressof(self._serial_plan), 0, 0)]

    def memory(self, role: str) -> int:
        return self._conv.memory(role)

    def rebind(self, role: str, address: int) -> None:
        self._conv.rebind(role, address)

    def silu_over(self, y: torch.Tensor) -> None:
        onednn.load().lib.dnnl_memory_set_data_handle(self._dst, y.data_ptr())
        plan = self._plan if self._layer.conv.threads is None else self._serial_plan
        status = self._layer._library.kiln_silu(ctypes.addressof(plan), None, 0, None)
        if status:
            onednn._check(status, self.what)
