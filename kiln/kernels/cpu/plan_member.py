"""A C kernel over a ctypes plan as a native-segment member: the protocol depthwise.py, se.py and relayout.py share.

Why: each of kiln's one-call C kernels (int f(plan, handles, count, args), native_loop.KernelLibrary) reads its
operands through oneDNN memory objects of its own, so that a segment can point them at its planned buffers
(`rebind`) and call the function on the plan from its compiled loop (`calls`), or time a one-thread form beside
the parallel one (`serial_calls`, onednn_primitives.thread_forms). That protocol was written out three times;
here it is once. A kernel's module keeps only what is its own: the plan's fields (and scratch) per thread count.

`MemoriesMember` is the same protocol's other half for members whose calls are several (a C pass and oneDNN
primitives: w8a16.py's split and two convolutions, winograd.py's transforms around a GEMM, w16gemm.py's one pass):
the roles' memory objects, rebinding them and running the calls alone; `FieldsMember` is its one-call form on a
plan of the layer's fields (i8gemm.py, w16gemm.py).

`PlanKernel` is the layer side (one layer at one input size): `bind(src, dst)` gives a `PlanMember`, and
`run_into(x, y)` runs the layer on tensors through a member of its own (its per-call path, as onednn.py's
primitives have).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, ClassVar

import torch

from kiln.kernels.cpu import native_loop, onednn, onednn_primitives

PARALLEL_ELEMENTS = 1 << 14  # below this many elements one thread: a parallel region costs ~2-5 µs


def thread_counts(elements: int, macs: int = 0, min_elements: int = PARALLEL_ELEMENTS) -> tuple[int, bool]:
    """A plan kernel's thread count for its per-call form and whether a serial twin is planned beside it: OpenMP's
    count for a layer of at least `min_elements` elements that onednn_primitives.thread_forms does not keep to one
    thread, else 1; the twin where thread_forms gives a small layer both forms (the segment's chooser times them)."""
    forms = onednn_primitives.thread_forms(elements, macs)
    threads = torch.get_num_threads() if elements >= min_elements and forms[0] is None else 1
    return threads, threads > 1 and len(forms) > 1


class PlanMember:
    """A layer's call for one segment (or its own per-call path): the C function `FUNCTION` of the layer's library
    on a plan reading the "src" memory object and writing "dst", and a serial twin of the plan where the subclass
    made one (`_plans`). Subclasses build their plans in `__init__` after this one's, from `plan_base()`."""

    FUNCTION: ClassVar[str]  # the library's entry point

    def __init__(self, layer: PlanKernel, src: int, dst: int):
        self.what = layer.what
        self._layer = layer  # owns the weights and sizes the plans point at
        self._md = onednn.memory_desc([1], onednn.TAG_A)  # only the address of an operand matters
        self._memories = {"src": onednn._memory(self._md.value, src), "dst": onednn._memory(self._md.value, dst)}
        self._entry = getattr(layer.library, self.FUNCTION)
        self._function = ctypes.cast(self._entry, ctypes.c_void_p).value
        self._plan: ctypes.Structure | None = None
        self._serial_plan: ctypes.Structure | None = None

    def plan_base(self) -> dict[str, Any]:
        """The fields every plan starts with: oneDNN's get-handle function and the two memory objects."""
        get_handle = ctypes.cast(onednn.load().lib.dnnl_memory_get_data_handle, ctypes.c_void_p).value
        return dict(get_handle=get_handle, x=self._memories["src"].value, y=self._memories["dst"].value)

    def _plans(self, plan: ctypes.Structure, serial: ctypes.Structure | None = None) -> None:
        self._plan, self._serial_plan = plan, serial

    def calls(self) -> list[tuple[int | None, int, int, int]]:
        return [(self._function, ctypes.addressof(self._plan), 0, 0)]

    def serial_calls(self) -> list[tuple[int | None, int, int, int]] | None:
        """calls() of the serial form (one thread, the same scratch: the two forms never run at once), or None
        without one."""
        if self._serial_plan is None:
            return None
        return [(self._function, ctypes.addressof(self._serial_plan), 0, 0)]

    def memory(self, role: str) -> int:
        return self._memories[role].value

    def rebind(self, role: str, address: int) -> None:
        onednn.load().lib.dnnl_memory_set_data_handle(self._memories[role].value, address)

    def run(self) -> None:
        status = self._entry(ctypes.addressof(self._plan), None, 0, None)
        if status:
            onednn._check(status, self.what)


class MemoriesMember:
    """A member whose roles are oneDNN memory objects of its own (`_memories`: role -> handle, made by the subclass)
    and whose `calls()` (the subclass's) run through the compiled loop: rebinding a role and running it alone."""

    what: str
    _memories: dict[str, Any]

    def calls(self) -> list[tuple[int | None, int, int, int]]:
        raise NotImplementedError

    def memory(self, role: str) -> int:
        return self._memories[role].value

    def rebind(self, role: str, address: int) -> None:
        onednn.load().lib.dnnl_memory_set_data_handle(self._memories[role].value, address)

    def run(self) -> None:
        """The calls through the compiled loop (the caller holds the layer's lock)."""
        status, failed = native_loop.run_calls(self.calls())
        if status:
            onednn._check(status, f"{self.what} (call {failed})")


class FieldsMember(MemoriesMember):
    """A layer's one call of the C function `function` on a `plan_type` plan of the layer's `fields`, whose x and y are
    memory objects of descriptors `src_md` / `dst_md` of its own (i8gemm.py's and w16gemm.py's GEMMs): the segment
    points them at each call's tensors. `plan` is what a segment's view at other sizes copies and rewrites
    (native_member's row_fields)."""

    def __init__(self, layer: Any, src: int, dst: int, src_md: Any, dst_md: Any, plan_type: type[ctypes.Structure],
                 function: Any):
        self.what = layer.what
        self._mds = (src_md, dst_md)  # the memory objects' descriptors live as long as they do
        self._memories = {"src": onednn._memory(src_md.value, src), "dst": onednn._memory(dst_md.value, dst)}
        self._layer = layer  # owns what the plan points at (packed weight, offsets, scales)
        get_handle = ctypes.cast(onednn.load().lib.dnnl_memory_get_data_handle, ctypes.c_void_p).value
        self.plan = plan_type(get_handle=get_handle, x=self._memories["src"].value, y=self._memories["dst"].value,
                              **layer.fields)
        self._calls = [(ctypes.cast(function, ctypes.c_void_p).value, ctypes.addressof(self.plan), 0, 0)]

    def calls(self) -> list[tuple[int | None, int, int, int]]:
        return list(self._calls)


class PlanKernel:
    """One layer of a plan kernel at one input size: `MEMBER` binds it, `library` and `what` are the subclass's."""

    MEMBER: ClassVar[type[PlanMember]]
    NO_RESIDUAL: ClassVar[str] = "the kernel adds no residual"
    library: ctypes.CDLL
    what: str

    def _own_calls(self) -> None:
        """Call from __init__: the lock and lazily bound member of the per-call path."""
        self._lock = threading.Lock()
        self._alone: PlanMember | None = None

    def bind(self, src: int, dst: int, residual: int | None = None) -> PlanMember:
        """The layer's call reading src, writing dst (each in a segment's layout), on scratch of its own."""
        if residual is not None:
            raise ValueError(self.NO_RESIDUAL)
        return self.MEMBER(self, src, dst)

    def run_into(self, x_address: int, y_address: int) -> None:
        """The layer from x's memory into y's, on its own member (one caller at a time)."""
        with self._lock:
            if self._alone is None:
                self._alone = self.bind(0, 0)
            bound = self._alone
            bound.rebind("src", x_address)
            bound.rebind("dst", y_address)
            bound.run()


class ChannelsLastKernel(PlanKernel):
    """A PlanKernel of one NHWC float32 input and output (depthwise.py's, grouped.py's): `__call__` on tensors."""

    input_size: tuple[int, ...]
    output_size: tuple[int, ...]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, C, H, W] channels-last float32 of the built size -> a new channels-last y."""
        if tuple(x.shape) != self.input_size or x.dtype != torch.float32 or \
                not x.is_contiguous(memory_format=torch.channels_last):
            raise ValueError(f"{self.what}: given {x.dtype} {list(x.shape)} (channels-last float32 of the built size)")
        n, c, h, w = self.output_size
        y = torch.empty_strided(self.output_size, (c * h * w, 1, w * c, c), dtype=torch.float32)
        self.run_into(x.data_ptr(), y.data_ptr())
        return y
