"""kiln::Relayout and Slice in kiln's C (relayout.c): a permutation or a slice of elements as one strided copy,
a native-segment member.

Why: MobileViT's unfold and fold ([1, C, H, W] <-> [4, H*W/4, C], kiln/passes/fusion/relayout.py) ran as
Transposes on torch, each a step that split the native segment around it (15 steps a run). Inside a
segment a 4-D value is NHWC in memory, and there the unfold is rows of channels copied whole.

A Relayout is one layer at one input size: the walk of x's memory that writes y's memory in order is
found at build from an index table (kiln/ops/relayout.py strided_form) over both layouts, so the kernel
needs nothing but sizes and strides. `bind(src, dst)` gives a segment its call on memory objects of its
own, as oneDNN primitives do (kiln/kernels/cpu/onednn.py Bound), and `__call__` runs it on a tensor
(4-D: channels-last in and out, as in a segment).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kiln.kernels.cpu import native_loop, onednn, plan_member
from kiln.ops.relayout import TABLE_LIMIT, strided_form

SOURCE = Path(__file__).with_name("relayout.c").read_text()
MAX_DIMS = 8



class _Plan(ctypes.Structure):  # relayout_plan in relayout.c
    _fields_ = [("get_handle", ctypes.c_void_p), ("x", ctypes.c_void_p), ("y", ctypes.c_void_p),
                ("base", ctypes.c_long), ("rank", ctypes.c_long), ("size", ctypes.c_long * MAX_DIMS),
                ("stride", ctypes.c_long * MAX_DIMS)]


_LIBRARY = native_loop.KernelLibrary("relayout", SOURCE, ["kiln_relayout"],
                                    requires=(onednn.available, "libdnnl.so.3 cannot be loaded (the kernel's operands are oneDNN memory objects)"))
load, available, reason = _LIBRARY.load, _LIBRARY.available, _LIBRARY.reason  # the library, built on first use


def _strides(size: tuple[int, ...]) -> tuple[int, ...]:
    """A segment's memory strides of a value of this size: NHWC for 4-D, row-major otherwise."""
    if len(size) == 4:
        n, c, h, w = size
        return (c * h * w, 1, w * c, c)
    return _row_major(size)


def _row_major(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(size):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


def memory_walk(input_size: tuple[int, ...], move: Callable[[torch.Tensor], torch.Tensor], rows_input: bool = False
                ) -> tuple[int, list[tuple[int, int]], tuple[int, ...]]:
    """(base, [(size, stride)] outer to inner, output size): the walk of x's memory (segment layout; `rows_input`:
    row-major whatever its rank, as kiln's own kernels write a 4-D value) from element `base` that gives y's memory
    in order, y = move(x) (a view or copy of x's elements: a Relayout's reshape-permute-reshape, a Slice)."""
    numel = int(np.prod(input_size))
    if numel > TABLE_LIMIT:
        raise ValueError(f"{numel} elements: a walk of at most {TABLE_LIMIT}")
    x_strides = _row_major(input_size) if rows_input else _strides(input_size)
    offsets = torch.as_strided(torch.arange(numel, dtype=torch.int64), input_size, x_strides)
    moved = move(offsets)  # y's elements' offsets in x's memory
    output_size = tuple(moved.shape)
    laid = torch.empty_strided(output_size, _strides(output_size), dtype=torch.int64)
    laid.copy_(moved)  # y's memory order: walk its storage
    flat = laid.as_strided((laid.numel(),), (1,)).numpy()
    if flat.size == 0:
        raise ValueError(f"an empty output {list(output_size)}")
    base = int(flat.min())
    form = strided_form(flat - base)
    if form is None or int(flat[0]) != base:
        raise ValueError(f"no strided walk of {list(input_size)} gives its {list(output_size)}")
    if len(form) > MAX_DIMS:
        raise ValueError(f"a walk of {len(form)} dims: the kernel takes {MAX_DIMS}")
    return base, form, output_size


def relayout_move(dims: list[int], perm: list[int], output_size: tuple[int, ...]) -> Callable[[torch.Tensor], torch.Tensor]:
    """kiln::Relayout's map: x.reshape(dims).permute(perm).reshape(output_size)."""
    return lambda x: x.reshape(dims).permute(perm).reshape(output_size)


class Relayout(plan_member.PlanKernel):
    """y = move(x) on float32 values as a segment lays them out (4-D: NHWC), one strided walk of x's memory;
    move: kiln::Relayout's reshape-permute-reshape (relayout_move), or a Slice. `bind(src, dst)` reads and writes
    each in a segment's layout."""

    NO_RESIDUAL = "a relayout has no residual"

    def __init__(self, input_size: tuple[int, ...], move: Callable[[torch.Tensor], torch.Tensor],
                 what: str = "relayout", rows_input: bool = False):
        """`rows_input`: x's memory is row-major whatever its rank (a 4-D value kiln's own kernels wrote)."""
        library = load()
        if library is None:
            raise onednn.OneDNNError(f"kiln's relayout kernel is not built: {reason()}")
        self.input_size, self.rows_input = tuple(input_size), rows_input
        self.base, self.walk, self.output_size = memory_walk(self.input_size, move, rows_input)
        # y's memory is x's, byte for byte (a walk from the first element in one contiguous run): ConvNeXt's
        # permute of an NHWC image to [N, H·W, C] rows and back, which a segment then runs as an alias
        numel = int(np.prod(self.input_size))
        self.moves_nothing = self.base == 0 and [tuple(d) for d in self.walk] == [(numel, 1)]
        self.library = library
        self.what = f"{what} {list(self.input_size)} -> {list(self.output_size)}"
        self._own_calls()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x of the built size (4-D: channels-last, else contiguous) -> a new y in the same convention."""
        want = _row_major(self.input_size) if self.rows_input else _strides(self.input_size)
        if tuple(x.shape) != self.input_size or x.dtype != torch.float32:
            raise ValueError(f"{self.what}: given {x.dtype} {list(x.shape)}")
        laid_out = x.is_contiguous(memory_format=torch.channels_last) if x.dim() == 4 and not self.rows_input \
            else x.is_contiguous()
        if not laid_out:  # (torch's test ignores the strides of size-1 dims, which address nothing)
            x = torch.empty_strided(self.input_size, want, dtype=torch.float32).copy_(x)
        y = torch.empty_strided(self.output_size, _strides(self.output_size), dtype=torch.float32)
        self.run_into(x.data_ptr(), y.data_ptr())
        return y


class _Bound(plan_member.PlanMember):
    """A Relayout's call for one segment (or its own per-call path)."""

    FUNCTION = "kiln_relayout"

    def __init__(self, layer: Relayout, src: int, dst: int):
        super().__init__(layer, src, dst)
        sizes = [s for s, _ in layer.walk]
        strides = [t for _, t in layer.walk]
        self._plans(_Plan(**self.plan_base(), base=layer.base, rank=len(sizes),
                          size=(ctypes.c_long * MAX_DIMS)(*sizes), stride=(ctypes.c_long * MAX_DIMS)(*strides)))


Relayout.MEMBER = _Bound
