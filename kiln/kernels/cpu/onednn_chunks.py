"""A oneDNN layer that computes each image alone, at another batch, as runs of the primitive made for its tuned one.

A oneDNN convolution (pooling, reorder) primitive is made for one input size: a new batch used to mean a new
primitive, created and JIT-compiled (~0.5-1 ms a convolution), so an image segment bound at a new batch cost
~8-10 ms of primitives before its first run (bench/results/first-call-2026-12-06.md). The batch is the outermost
dim of NHWC memory and these layers compute each image alone: N images are N / b runs of the primitive made for b,
each on memory b images further on. kiln_batch_chunks (segment_loop.c) makes those runs in one call of a native
segment: it reads each role's base address from its memory object (a segment points its entries and exits there
per run), points the object one chunk further before each run and back after; a remainder of N mod b images runs on
the layer's one-image primitive (made once per layer, on first need). A view of a segment at a new batch then binds
memory objects and a plan, never a primitive.

Exact: each image is computed alone either way, by the kernel oneDNN picks for b images instead of N; a
convolution sums over one output pixel's channels and window whatever the batch, so results agree with the primitive
made for N to float32 rounding (tests/unit/test_image_batches.py: with torch and with that primitive, on fresh data).

Speed: per layer, interleaved, 1 thread, Zen 4 (bench/batch_chunks_layers.py,
bench/results/image-batches-2026-12-06.md): runs of the tuned primitive 0.98-1.04x the time of the primitive made for
the whole batch (ResNet-50's layer kinds at 3-112 px; one 1.14x, a 512->512 3x3 at 3 px in runs of one image); each
run adds oneDNN's fixed cost of an execution (a few µs), which shows only on tiny layers.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import threading
from collections.abc import Iterator
from typing import Any

from kiln.kernels.cpu import native_loop, onednn

ROLES = 4  # CHUNK_ROLES in segment_loop.c


class _ChunkPlan(ctypes.Structure):  # chunk_plan in segment_loop.c
    _fields_ = [("execute", ctypes.c_void_p), ("set_handle", ctypes.c_void_p), ("get_handle", ctypes.c_void_p),
                ("primitive", ctypes.c_void_p), ("nargs", ctypes.c_int), ("args", ctypes.c_void_p),
                ("count", ctypes.c_long),
                ("primitive1", ctypes.c_void_p), ("nargs1", ctypes.c_int), ("args1", ctypes.c_void_p),
                ("count1", ctypes.c_long),
                ("nroles", ctypes.c_int), ("memories", ctypes.c_void_p * ROLES), ("memories1", ctypes.c_void_p * ROLES),
                ("strides", ctypes.c_long * ROLES), ("strides1", ctypes.c_long * ROLES)]


def available() -> bool:
    return onednn.available() and native_loop.load() is not None


_EXACT = threading.local()


@contextlib.contextmanager
def exact_batches() -> Iterator[None]:
    """Inside, on this thread, a layer at another batch binds a primitive made for that batch, not chunks of its
    tuned one: kiln/runtime/native_batches.py's exact bind of a batch met often, made on a background thread (a
    tiny image layer's runs repeat oneDNN's fixed cost of an execution per run; a primitive for the whole batch
    pays it once)."""
    outer = getattr(_EXACT, "on", False)
    _EXACT.on = True
    try:
        yield
    finally:
        _EXACT.on = outer


def exact() -> bool:
    """Whether this thread is inside exact_batches()."""
    return getattr(_EXACT, "on", False)


class BatchChunks:
    """A layer at `batch` images as runs of `whole` (its primitive object made for b images: a Conv2d, Pool2d) and,
    where b does not divide the batch, of `one` (the same layer made for 1 image). Offers bind() as they do."""

    def __init__(self, whole: Any, one: Any | None, batch: int):
        b = whole.input_size[0]
        self.count, self.count1 = divmod(batch, b)
        if self.count1 and one is None:
            raise ValueError(f"{batch} images in runs of {b} leave {self.count1}: the one-image primitive is needed")
        if one is not None and (one.input_size[0] != 1 or one.input_size[1:] != whole.input_size[1:]):
            raise ValueError(f"the one-image primitive is for {list(one.input_size)}, "
                             f"not 1 of {list(whole.input_size)}")
        self.whole, self.one = whole, one if self.count1 else None
        self.input_size = (batch, *whole.input_size[1:])
        self.output_size = (batch, *whole.output_size[1:])
        self.residual = getattr(whole, "residual", False)
        self.residual_in_place = getattr(whole, "residual_in_place", False)
        # bytes of one image, per role (float32 NHWC: what these layers read and write)
        self._image_bytes = {"src": math.prod(whole.input_size[1:]) * 4, "dst": math.prod(whole.output_size[1:]) * 4,
                             "residual": math.prod(whole.output_size[1:]) * 4}

    def bind(self, src: int, dst: int, residual: int | None = None) -> ChunksBound:
        """The runs bound at these addresses (0: an entry or exit, pointed at per run), as the primitive's own bind."""
        whole = self.whole.bind(src, dst, residual)
        one = self.one.bind(0, 0, 0 if residual is not None else None) if self.one is not None else None
        return ChunksBound(self, whole, one)


def _handle(memory: Any) -> int:
    """A Bound's memory object (a ctypes handle or an int) as an int."""
    return memory.value if isinstance(memory, ctypes.c_void_p) else int(memory)


class ChunksBound:
    """BatchChunks bound: one call of kiln_batch_chunks on the whole primitive's Bound (its memory objects are the
    ones a segment points at its entries and exits: memory()), and a serial form where that Bound has one."""

    def __init__(self, chunks: BatchChunks, whole: onednn.Bound, one: onednn.Bound | None):
        self.what = f"{whole.what} in runs over {chunks.input_size[0]} images"
        self._whole, self._one = whole, one
        lib = onednn.load().lib
        roles = [role for role, _arg, _md in whole.roles]
        if len(roles) > ROLES:
            raise ValueError(f"{whole.what}: {len(roles)} roles, the runs move at most {ROLES}")
        memories = [_handle(whole.memory(role)) for role in roles]
        if len(set(memories)) != len(memories):  # one object moved twice a run would land two chunks on
            raise ValueError(f"{whole.what}: two roles share a memory object")
        b = chunks.whole.input_size[0]

        def plan(primitive: int, primitive1: int | None) -> _ChunkPlan:
            p = _ChunkPlan(execute=native_loop.execute_function(),
                           set_handle=ctypes.cast(lib.dnnl_memory_set_data_handle, ctypes.c_void_p).value,
                           get_handle=ctypes.cast(lib.dnnl_memory_get_data_handle, ctypes.c_void_p).value,
                           primitive=primitive, nargs=whole.nargs, args=ctypes.addressof(whole.args),
                           count=chunks.count, count1=chunks.count1, nroles=len(roles))
            if one is not None:
                p.primitive1, p.nargs1, p.args1 = primitive1, one.nargs, ctypes.addressof(one.args)
            for r, role in enumerate(roles):
                p.memories[r] = memories[r]
                p.memories1[r] = _handle(one.memory(role)) if one is not None else 0
                p.strides[r] = chunks._image_bytes[role] * b
                p.strides1[r] = chunks._image_bytes[role]
            return p

        self.plan = plan(whole.primitive, one.primitive if one is not None else None)
        self._serial = None
        # the serial form where it runs on the parallel one's arguments (one with a weight of its own: none here)
        if whole.serial_primitive is not None and not getattr(whole, "serial_args_own", False):
            serial_one = None if one is None else (one.primitive if one.serial_primitive is None
                                                   or getattr(one, "serial_args_own", False) else one.serial_primitive)
            self._serial = plan(whole.serial_primitive, serial_one)
        self._function = ctypes.cast(native_loop.load().kiln_batch_chunks, ctypes.c_void_p).value

    def calls(self) -> list[tuple[int | None, int, int, int]]:
        return [(self._function, ctypes.addressof(self.plan), 0, 0)]

    def serial_calls(self) -> list[tuple[int | None, int, int, int]] | None:
        return None if self._serial is None else [(self._function, ctypes.addressof(self._serial), 0, 0)]

    def memory(self, role: str) -> int:
        """The dnnl_memory_t a run points elsewhere for `role` (the chunks start from its address)."""
        return self._whole.memory(role)
