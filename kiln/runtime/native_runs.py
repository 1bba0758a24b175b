"""Which steps of a program run as native segments (kiln/runtime/native.py): every run of two or more consecutive
steps whose tactics offer a NativeStep and whose sizes and memory orders chain, with the steps met between members
that do not depend on the run hoisted before it; each run replaced by one Segment step. A run of one step is a
segment only where it is the program's whole work (a model of one Gemm, one Conv, one Relu): the program is then one
call of the compiled loop, numpy in and out (kiln/runtime/direct_run.py), ~3x faster a call than the layer's launch
through Program.run's torch path (bench/results/tiny-models-zen4-2026-12-07b.md).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kiln.runtime.native import Segment
from kiln.runtime.native_arena import SharedArena
from kiln.runtime.native_members import _expects, reads_of, writes_of
from kiln.runtime.step import BoundStep
from kiln.tactics.tactic import NativeStep, native_strides, row_major_strides


def _same_order(size: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether strides a and b lay a value of this size out in the same memory order (dims of size 1 address
    nothing: [N, C, 1, 1] is the same NHWC and row-major)."""
    return all(x == y for d, x, y in zip(size, a, b) if d != 1)


def _layout_strides(size: tuple[int, ...], layout: str) -> tuple[int, ...]:
    return native_strides(size) if layout == "nhwc" else row_major_strides(size)


def _joins(step: BoundStep, produced: dict[int, tuple[int, ...]], strides: dict[int, tuple[int, ...]] | None = None,
           native: NativeStep | None = None) -> bool:
    """Every value step reads from the run (`produced`: slot -> size) is of the size it was built for (a value from
    outside the run is checked per call) and, where `strides` (slot -> the strides it is written in) is given, in the
    memory order the step reads it in: a 4-D value kiln's own kernels write row-major (a recurrent layer's Y) is not
    what oneDNN's layers read as NHWC."""
    native = native or step.fn.native
    for slot, role in reads_of(step, native):
        if slot not in produced:
            continue
        size, dtype, layout = _expects(native, role)
        if tuple(produced[slot]) != size:
            return False
        if strides is not None and not _same_order(size, strides[slot], _layout_strides(size, layout)):
            return False
    return True


def _reading_rows(step: BoundStep, native: NativeStep, produced: dict[int, tuple[int, ...]],
                  strides: dict[int, tuple[int, ...]]) -> tuple[BoundStep, NativeStep]:
    """step with the form of its layer that reads its 4-D src row-major (NativeStep.reading_rows), where the run
    wrote that src row-major and the layer offers the form; else step as it is."""
    x = step.inputs[0]
    if native.reads is not None or native.rows_input or native.reading_rows is None or x not in produced \
            or _same_order(produced[x], strides[x], native_strides(produced[x])):
        return step, native
    try:
        rows = native.reading_rows()
    except ValueError:  # no such form at this size: the run closes before the layer, as for any layout mismatch
        return step, native
    fn = step.fn

    def launch(ctx, *args, **attributes):  # the layer's own launch: outside a segment its layout does not matter
        return fn(ctx, *args, **attributes)

    launch.__dict__.update(fn.__dict__)
    launch.native = rows
    return replace(step, fn=launch), rows


def _may_alias(step: BoundStep, native: NativeStep, i: int, steps: list[BoundStep], members: list[int],
               pending: list[int], produced: dict[int, tuple[int, ...]], strides: dict[int, tuple[int, ...]],
               last_read: dict[int, int], outputs: set[int]) -> bool:
    """Whether step i may join the open run as an alias of its src: right after the member that wrote it, the src
    a value of the run that dies here and is no output of the program, in the size and order the step reads."""
    x = step.inputs[0]
    return bool(members and not pending and members[-1] == i - 1 and steps[i - 1].outputs[0] == x
                and last_read.get(x) == i and x not in outputs and _joins(step, produced, strides, native))


def _aliasing(step: BoundStep, native: NativeStep, i: int, steps: list[BoundStep], members: list[int],
              pending: list[int], produced: dict[int, tuple[int, ...]], strides: dict[int, tuple[int, ...]],
              last_read: dict[int, int], outputs: set[int]) -> tuple[BoundStep, NativeStep]:
    """step with its alias form (NativeStep.aliasing: a relayout that moves no byte) where it may join the run so;
    else step as it is (its copy)."""
    if native.alias or native.aliasing is None:
        return step, native
    try:
        alias = native.aliasing()
    except ValueError:
        return step, native
    if not _may_alias(step, alias, i, steps, members, pending, produced, strides, last_read, outputs):
        return step, native
    fn = step.fn

    def launch(ctx, *args, **attributes):  # outside a segment the layer copies as before
        return fn(ctx, *args, **attributes)

    launch.__dict__.update(fn.__dict__)
    launch.native = alias
    return replace(step, fn=launch), alias


def _hoistable(pending: list[BoundStep], produced: dict[int, Any], read: set[int]) -> bool:
    """Steps that are not native, met between members of a run, may run before it: none reads a value
    the run writes, and none frees a value the run reads (its last use would move before theirs)."""
    for step in pending:
        if any(s in produced for s in step.inputs if s >= 0) or any(s in read for s in step.free):
            return False
    return True


def segments(steps: list[BoundStep], output_slots: list[int], constants: dict[int, Any] | None = None,
             not_members: set[int] | None = None, arena: SharedArena | None = None,
             reuse: list[Segment] | None = None, origins: list[Any] | None = None
             ) -> tuple[list[BoundStep], list[Segment]]:
    """steps with each run of >= 2 native steps (or the one run of a program whose whole work it is) replaced by one
    Segment step. Steps that are not native but met between a run's members (an exported attention mask's preparation,
    shape arithmetic) run before the segment when they do not depend on it. `not_members`: indices of steps never made
    members (shape-only steps, which the program computes once per input-shape signature). `arena`: another program's
    arena to plan into, one that never runs at the same time as this one (the build's in-context stage runs its two
    programs in turn: kiln/builder/in_context.py); its lock is shared. A segment whose plan it cannot hold gets memory
    of its own (Segment). `reuse`: that program's segments: a run of the same layers, at the same places, on the same
    launches or launches alike (`origins`, per step: Program's; default the launch's identity) is that segment
    (Segment.origin), not one bound anew (the in-context stage's rival program differs from the chosen one in one
    signature's layers: its other segments, their bound calls and their scratch, exist once)."""
    origin = list(origins) if origins is not None else [id(step.fn) for step in steps]
    steps = list(steps)  # a member may take its row-reading form (_reading_rows)
    last_read: dict[int, int] = {}
    for i, step in enumerate(steps):
        for s in step.inputs:
            if s >= 0:
                last_read[s] = i
    outputs = set(output_slots)
    excluded = not_members or set()
    runs: list[tuple[list[int], list[int]]] = []  # (members, steps run before the segment)
    members: list[int] = []
    hoisted: list[int] = []
    pending: list[int] = []
    produced: dict[int, tuple[int, ...]] = {}  # slot -> size, of the open run
    strides: dict[int, tuple[int, ...]] = {}  # slot -> the strides it is written in, of the open run
    read: set[int] = set()  # slots the open run's members read

    def close() -> None:
        nonlocal members, hoisted, pending, produced, strides, read
        if members:
            runs.append((members, hoisted))
        members, hoisted, pending, produced, strides, read = [], [], [], {}, {}, set()

    for i, step in enumerate(steps):
        native = getattr(step.fn, "native", None)
        ok = (isinstance(native, NativeStep) and step.outputs and step.outputs[0] >= 0 and i not in excluded
              and len(step.outputs) <= 1 + len(native.more_outputs))
        if not ok:
            if members:
                pending.append(i)
            continue
        if members:
            step, native = _reading_rows(step, native, produced, strides)
            step, native = _aliasing(step, native, i, steps, members, pending, produced, strides, last_read, outputs)
        if native.alias:  # only right after a member of the run, over a value of it that dies here
            if _may_alias(step, native, i, steps, members, pending, produced, strides, last_read, outputs):
                members.append(i)
                steps[i] = step
                produced[step.outputs[0]] = tuple(native.output_size)  # an alias writes one value
                # (a Reshape's 4-D output is one whose order row-major and NHWC is the same; a relayout's alias has
                # its output laid out as the segment lays 4-D values out, as its copy would write it)
                strides[step.outputs[0]] = native.output_strides
            else:
                close()
            continue
        joins = bool(members) and _joins(step, produced, strides, native) and \
            _hoistable([steps[k] for k in pending], produced, read)
        if not joins:
            close()
            step, native = steps[i], steps[i].fn.native  # a run's first member reads from outside it
        steps[i] = step
        hoisted += pending
        pending = []
        members.append(i)
        for slot, _role, size, written, _dtype in writes_of(step, native):
            produced[slot], strides[slot] = size, written
        read |= {slot for slot, _ in reads_of(step, native)}
    close()
    # a run of one member is a segment only where it is the program's whole work (every other step shape-only): the
    # program is then one call of its loop, numpy in and out (kiln/runtime/direct_run.py); inside a larger program a
    # segment of one layer would only add the segment's call to the layer's launch
    whole = len(runs) == 1 and len(runs[0][0]) + len(runs[0][1]) + len(excluded) >= len(steps)
    start = {run[0]: (run, before) for run, before in runs if len(run) >= 2 or whole}
    if not start:
        return steps, []
    # one arena for them all: the program runs its segments one at a time (kiln/runtime/native_arena.py)
    if arena is None:
        arena = SharedArena(SharedArena.bound([[(size, dtype) for k in run for _s, _r, size, _w, dtype
                                                in writes_of(steps[k], steps[k].fn.native)]
                                               for run, _ in start.values()]))
    reusable = {getattr(segment, "origin", None): segment for segment in reuse or []}
    result: list[BoundStep] = []
    made: list[Segment] = []
    moved: set[int] = set()
    for i, step in enumerate(steps):
        if i in moved:
            continue
        if i not in start:
            result.append(step)
            continue
        run, before = start[i]
        members_ = [steps[k] for k in run]
        end = run[-1]
        read_after = {s for s, last in last_read.items() if last > end} | outputs
        key = (tuple(run), tuple(origin[k] for k in run), tuple((tuple(m.inputs), tuple(m.outputs), tuple(m.free))
                                                                for m in members_), frozenset(read_after))
        segment = reusable.get(key)
        if segment is None:
            try:
                read_by = {s for m in members_ for s in m.inputs}
                segment = Segment(members_, read_after, {s: v for s, v in (constants or {}).items() if s in read_by},
                                  arena=arena)
            except Exception:  # noqa: BLE001  a run that cannot be planned runs layer by layer, as before
                result.append(step)
                continue
            segment.origin = key
        result.extend(steps[k] for k in before)  # they depend on nothing the segment writes
        moved.update(run)
        moved.update(before)
        first_ctx = members_[0].ctx
        ctx = replace(first_ctx, name=f"{first_ctx.name} .. {members_[-1].ctx.name} (native segment of {len(run)})",
                      num_inputs=len(segment.entries), num_outputs=len(segment.exits))
        free = sorted({s for m in members_ for s in m.free})
        result.append(BoundStep(segment, ctx, list(segment.entries), list(segment.exits), {}, free))
        made.append(segment)
    return (result, made) if made else (steps, [])
