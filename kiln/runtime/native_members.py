"""A native segment's members (kiln/runtime/native.py): what each reads and writes and in which size, dtype and
layout, its call bound to the memory plan's addresses, its calls' serial form, and one run of the compiled loop
that makes the calls. Below the Segment, its views (native_views.py) and the runs that form it (native_runs.py),
which all read members through these.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import torch

from kiln.kernels.cpu import onednn
from kiln.runtime.step import BoundStep
from kiln.tactics.tactic import NativeStep, row_major_strides


def reads_of(m: BoundStep, native: NativeStep) -> list[tuple[int, Any]]:
    """(slot, role) of each value a member reads: its src (step input 0) and residual, or for kiln's
    own kernels every step input it names, the role being the input's index."""
    if native.reads is not None:
        return [(m.inputs[i], i) for i in native.reads if i < len(m.inputs) and m.inputs[i] >= 0]
    found = [(m.inputs[0], "src")]
    if native.residual_input is not None:
        found.append((m.inputs[native.residual_input], "residual"))
    return found


def writes_of(m: BoundStep, native: NativeStep) -> list[tuple[int, str, tuple[int, ...], tuple[int, ...], torch.dtype]]:
    """(slot, role, size, strides, dtype) of each value a member writes: its output, and for kiln's own
    kernels of several outputs (NativeStep.more_outputs) each further one that is read (role "dst<j>")."""
    found = [(m.outputs[0], "dst", tuple(native.output_size), native.output_strides, native.output_dtype)]
    for j, (size, dtype) in enumerate(native.more_outputs, 1):
        if j < len(m.outputs) and m.outputs[j] >= 0:
            found.append((m.outputs[j], f"dst{j}", tuple(size), row_major_strides(tuple(size)), dtype))
    return found


def _expects(native: NativeStep, role: Any) -> tuple[tuple[int, ...], torch.dtype, str]:
    """(size, dtype, layout) a member reads its input `role` in."""
    if native.reads is not None:
        size, dtype = native.reads[role]
        return tuple(size), dtype, "nhwc" if native.channels_last and len(size) == 4 else "rows"
    size = tuple(native.input_size if role == "src" else native.output_size)
    dtype = native.input_dtype if role == "src" else native.residual_dtype
    return size, dtype, "nhwc" if len(size) == 4 and not (role == "src" and native.rows_input) else "rows"


def _forms(members: list[BoundStep], natives: list[NativeStep]) -> dict[int, tuple]:
    """slot -> (size, strides, dtype) of each value the members write."""
    return {slot: (size, strides, dtype) for m, native in zip(members, natives)
            for slot, _role, size, strides, dtype in writes_of(m, native)}


def _entry_forms(entries: list[int], readers: list[list[tuple[int, Any]]], natives: list[NativeStep]
                 ) -> tuple[list, list, list]:
    """Each entry's size, dtype and layout ("nhwc": a 4-D activation of oneDNN's layers; "rows": row-major,
    what kiln's own kernels read), as its readers [(member, role)] expect it."""
    sizes, dtypes, layouts = [], [], []
    for s, read_by in zip(entries, readers):
        expected = {_expects(natives[k], role) for k, role in read_by}
        if len(expected) != 1:
            raise ValueError(f"the layers of a segment read value {s} in different forms: {sorted(map(str, expected))}")
        size, dtype, layout = expected.pop()
        sizes.append(size)
        dtypes.append(dtype)
        layouts.append(layout)
    return sizes, dtypes, layouts


def _run_loop(c: tuple, stream: Any, sources: dict[str, list[int]], names: list[str]) -> None:
    """One run of a segment's compiled loop (`c`: Segment._c_loop's arrays): its moving bindings pointed at
    this run's entries and exits (`sources`), every call made; a failing call raised by its layer's name.
    The caller holds the lock of the segment whose memory objects the loop binds."""
    run, functions, set_handle, nbind, memories, addresses, moving, count, objects, nargs, args, failed = c
    for i, (kind, k) in moving:
        addresses[i] = sources[kind][k]
    status = run(functions, set_handle, stream, nbind, memories, addresses, count, objects, nargs, args,
                 ctypes.byref(failed))
    if status:
        where = names[failed.value] if failed.value >= 0 else "binding an input or output"
        onednn._check(status, f"layer {where!r} of a native segment")


def _form(native: NativeStep) -> tuple:
    """What of a member's NativeStep shapes a segment's structure, whatever its sizes."""
    return (native.alias, native.accumulate, native.residual_input, None if native.reads is None else sorted(native.reads),
            len(native.more_outputs), native.channels_last, native.rows_input)


def _bind_member(m: BoundStep, native: NativeStep, accumulate: bool, address: dict[int, int],
                 arena: Any = None) -> tuple[Any, list[tuple[int, Any]]]:
    """A member's call bound to the planned addresses of what it reads and writes (0: an entry or
    exit, pointed at per run): (Bound, [(slot, role)]). `arena`: the SharedArena whose lock the member's runs hold,
    where a primitive that takes scratch (`binds_on_arena`) takes it from (SharedArena.scratch); None: its own."""
    x, out = m.inputs[0], m.outputs[0]
    residual = m.inputs[native.residual_input] if native.residual_input is not None else None
    prim = native.primitive(accumulate)
    if native.reads is not None:
        reads = reads_of(m, native)
        more = [(slot, role) for slot, role, *_ in writes_of(m, native)[1:]]  # outputs past the first
        b = prim.bind_reads(address.get(out, 0), {role: address.get(slot, 0) for slot, role in reads + more})
        return b, [(out, "dst"), *more, *reads]
    if accumulate:
        return prim.bind(address.get(x, 0), address.get(out, 0)), [(x, "src"), (out, "dst")]
    on_arena = {"arena": arena} if arena is not None and getattr(prim, "binds_on_arena", False) else {}
    b = prim.bind(address.get(x, 0), address.get(out, 0), address.get(residual, 0) if residual is not None else None,
                  **on_arena)
    return b, [(x, "src"), (out, "dst")] + ([(residual, "residual")] if residual is not None else [])


def serial_calls(bound: list[Any], member_calls: list[list]) -> list | None:
    """The calls of bound members (`member_calls`: each one's calls()) with each small layer in its serial form
    (a Bound's serial_calls), the others as they are; None when no member has a serial form."""
    calls, any_serial = [], False
    for b, made in zip(bound, member_calls):
        serial = b.serial_calls() if hasattr(b, "serial_calls") else None
        any_serial |= serial is not None
        calls += serial if serial is not None else made
    return calls if any_serial else None


# A segment of less work than this (estimated_work: multiply-adds, or elements moved) runs its serial form only, no
# form chooser, and a context whose every call is such a segment skips the OpenMP governor (context.py): a parallel
# region costs ~2-5 µs (kernels/cpu/i8gemm.py's PARALLEL_MACS), more than a second thread could save on such work,
# and the chooser's timing (~1 µs) and the governor's begin/end (~0.6 µs) were 10-20% of a tiny model's 2-thread call
TINY_WORK = 1 << 18


def estimated_work(members: list[BoundStep], natives: list[NativeStep], constants: dict[int, Any]) -> int:
    """An upper estimate of a segment's multiply-adds (at least the elements each layer reads and writes), from sizes
    alone: a layer with weights (constants among its inputs: a Conv's, a Gemm's) its output's elements times its
    weights' elements per output channel; one reading two or more activations (a MatMul of two, an Add) its
    output's elements times the largest last dimension it reads; any other its activations' elements."""
    total = 0
    for m, native in zip(members, natives):
        out = math.prod(native.output_size)
        sizes = [tuple(native.input_size)]
        if native.reads is not None:
            sizes = [tuple(size) for size, _dtype in native.reads.values()]
        moved = out + sum(math.prod(size) for size in sizes)
        weights = sum(math.prod(getattr(constants[s], "shape", ())) for s in m.inputs if s in constants)
        channels = native.output_size[1] if len(native.output_size) == 4 else (native.output_size[-1] or 1)
        if weights:
            total += moved + out * max(1, weights // max(1, channels))
        elif native.reads is not None and len(sizes) > 1:
            total += moved + out * max(max((size[-1] for size in sizes if size), default=1), 1)
        else:
            total += moved
    return total
