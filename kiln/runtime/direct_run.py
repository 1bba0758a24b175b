"""A bound input shape of a one-segment CPU program run as one call of its compiled loop: numpy in, numpy out.

Once an input-shape signature's shape values are known (Program.shape_plans) an encoder's program is often a single
native segment (kiln/runtime/native.py): bert_tiny's 21 members, BERT-base's 91. Its general run still goes
through the context's checks, torch.from_numpy, FirstCalls' bookkeeping, Program.run's environment, the segment's
entry key and view look-up and torch outputs: ~30 µs of Python a call in a hot loop (bert_tiny at 1 x 7: 74 µs a
call, onnxruntime 97), more in situ after a run has streamed the caches full. A DirectRun is what those steps find
for one signature, found once: the view bound at its sizes, the addresses of its fixed entries (shape values,
constants) and the exits' numpy forms; a run writes the inputs' addresses, makes the exits with numpy and calls the
loop.

A program of dynamic shapes with no shape values at all (the dynamic RoBERTa, its positions computed inside the
segment; a single layer over a symbolic batch: Program.shape_plans None) is one native segment from the start: its
records are the view at the inputs' sizes alone, nothing held per shape but the view. Before, its numpy calls ran the
general path (~31 µs around a ~85 µs loop at 2 x 16, against ~10 once direct: bench/results/dynamic-call-zen4-2026-12-07b.md).

A program of fixed input shapes that is one native segment runs the same way from its first call (StaticRun: the
context's _run_static path, kiln/runtime/cpu_paths.py), its constant entries (an encoder's position ids) at fixed
addresses.

A new signature's first call makes its record without a run of the program (DirectRuns.bind: shape values by the
shape function, the view bound at their sizes), so it too is one call of the loop
(bench/results/first-call-2026-12-05.md).

Exact by construction: the same view runs on the same addresses as the general path (tests/unit/test_direct_run.py
compares outputs bit for bit, and with onnxruntime). A record holds its view weakly: the segment's LRU owns views,
and when it lets one go the view is freed there and then, its record with it. A record keeps its shape values and
constants alive: the records of the plans the program lets go go with them (its LRU bound then holds), a record
whose plan or view is no longer the one there goes (made again once the shape is bound again), and each run marks
its signature used in both, as the general path does.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kiln.kernels.cpu.onednn import one_openmp_thread
from kiln.runtime.native import Segment
from kiln.runtime.native_batches import ON_VIEW, PENDING, direct_view, still_bound
from kiln.runtime.program import Program
from kiln.tactics.tactic import native_strides, row_major_strides

DIRECT_RUNS = 512  # signatures whose records are kept (then the cache starts over): small objects each

NUMPY_TO_TORCH = {np.dtype(t): torch.from_numpy(np.empty(0, t)).dtype for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.float16, np.float32, np.float64)}


@dataclass(frozen=True)
class DirectRun:
    """One signature's run: `view` (the Segment or its _Resized at these sizes, held weakly) called on entry
    addresses, the inputs' written in at `moving` [(entry position, input index)], the others fixed in `addresses`."""

    view: weakref.ref  # to an object with run_at(entry_addresses, exit_addresses)
    addresses: tuple[int, ...]  # every entry's address, the inputs' as 0
    moving: tuple[tuple[int, int], ...]
    exits: tuple[tuple[tuple[int, ...], np.dtype], ...]
    outputs: tuple[int, ...]  # each program output's exit
    keep: tuple[Any, ...]  # what the fixed addresses point into
    view_key: tuple  # the segment's key of the view (its LRU)
    plan: list  # the program's shape plan it was made from (its LRU)
    bare: tuple | None = None  # the view is a Segment of one form: StaticRun.bare's bindings; None: run_at
    batch_bound: bool = False  # the view is the exact bind of its batch (native_batches.py), not a _Resized

    def run(self, arrays: list[np.ndarray]) -> list[np.ndarray] | None:
        """The outputs, or None when the view was let go since the record was found (another thread bound other
        sizes): then the caller's general path runs."""
        view = self.view()
        if view is None:
            return None
        exits = [np.empty(size, dtype) for size, dtype in self.exits]
        if self.bare is not None:
            _run_bare(view, False, self.bare, arrays, exits)
        else:
            addresses = list(self.addresses)
            for position, k in self.moving:
                addresses[position] = address_of(arrays[k])
            view.run_at(addresses, [address_of(e) for e in exits])
        if len(self.outputs) == 1:
            return [exits[self.outputs[0]]]
        return [exits[j] for j in self.outputs]


@dataclass(frozen=True)
class StaticRun:
    """A program of fixed input shapes that is one native segment (it reads the inputs and the program's constants,
    writes the outputs), run on numpy arrays as one call of its compiled loop: the inputs' addresses written in at
    `moving`, the constants' fixed in `addresses`, numpy exits made per run (a caller's outputs are its own). No torch
    call and no entry check per run: the context's _run_static has checked the arrays against the bindings (dtype,
    shape, C order, writable), and StaticRun.of the bindings against the segment's planned entries, once. Before,
    such a program ran through torch.from_numpy, Program.run and the segment's torch call (roberta_tiny at 2 x 16:
    ~27 µs of a ~115 µs call, bench/results/call-overhead-zen4-2026-12-07.md); one whose entries were exactly its
    inputs ran Segment.run_numpy, which checked each array again."""

    segment: Segment
    staged: bool  # the segment lays NCHW images out NHWC at its loop's head (its staged variant)
    addresses: tuple[int, ...]  # every entry's address, the inputs' as 0
    moving: tuple[tuple[int, int], ...]  # (entry position, input index)
    exits: tuple[tuple[tuple[int, ...], np.dtype, bool], ...]  # (the memory's shape, dtype, NHWC memory of NCHW)
    outputs: tuple[int, ...]  # each program output's exit
    keep: tuple[Any, ...]  # what the fixed addresses point into
    # a segment of one form (Segment.bare_loop): the loop's bindings pointed straight at the run's inputs
    # [(binding, input index)], exits [(binding, exit index)] and constants [(binding, address)]; None: run_at
    bare: tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]] | None = None
    one_exit: bool = False  # one row-major exit, the program's one output: returned as made

    @classmethod
    def of(cls, program: Program, signature: list[tuple[np.dtype, tuple[int, ...]]]) -> StaticRun | None:
        """The program's StaticRun for inputs of `signature` [(numpy dtype, shape)] in binding order, or None where
        the program is not one native segment reading inputs of its planned sizes and dtypes (NCHW images where it
        lays them out) and contiguous constants, and writing every output row-major (or NHWC, an NCHW view)."""
        if len(program.run_steps) != 1 or len(program.segments) != 1 or program.run_steps[0].fn is not \
                program.segments[0]:
            return None
        segment = program.segments[0]
        if not all(s in segment.exits for s in program.output_slots):
            return None
        input_of = {slot: k for k, slot in enumerate(program.input_slots)}
        addresses, moving, keep = [], [], []
        for position, (slot, size, dtype, layout) in enumerate(zip(segment.entries, segment.entry_sizes,
                                                                   segment.entry_dtypes, segment.entry_layouts)):
            k = input_of.get(slot)
            if k is not None:  # an input, fed row-major: an NCHW image where the loop lays it out (staged)
                numpy_dtype, shape = signature[k]
                if NUMPY_TO_TORCH.get(np.dtype(numpy_dtype)) != dtype or tuple(shape) != tuple(size) \
                        or layout not in ("rows", "nhwc"):
                    return None
                moving.append((position, k))
                addresses.append(0)
                continue
            value = program.template[slot]
            if not isinstance(value, torch.Tensor) or value.dtype != dtype or value.device.type != "cpu" \
                    or tuple(value.shape) != tuple(size) or layout != "rows" or not value.is_contiguous():
                return None
            keep.append(value)
            addresses.append(value.data_ptr())
        exits = []
        for size, strides, dtype in segment.exit_shapes:
            numpy_dtype, size, strides = _NUMPY_OF.get(dtype), tuple(size), tuple(strides)
            if numpy_dtype is None:
                return None
            if strides == row_major_strides(size):
                exits.append((size, numpy_dtype, False))
            elif len(size) == 4 and strides == native_strides(size):
                n, c, h, w = size
                exits.append(((n, h, w, c), numpy_dtype, True))
            else:
                return None
        outputs = tuple(segment.exits.index(s) for s in program.output_slots)
        staged = bool(segment._staged)
        empty = any(0 in tuple(size) for size in segment.entry_sizes) or any(0 in size for size, _, _ in exits)
        return cls(segment, staged, tuple(addresses), tuple(moving), tuple(exits), outputs, tuple(keep),
                   None if empty else _bare_bindings(segment.bare_loop(staged), dict(moving), addresses),
                   len(exits) == 1 and outputs == (0,) and not exits[0][2])

    def run(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """The outputs of inputs `arrays` (in binding order, checked by the caller)."""
        made = [np.empty(size, dtype) for size, dtype, _ in self.exits]
        segment = self.segment
        if self.bare is not None:
            _run_bare(segment, self.staged, self.bare, arrays, made)
        else:
            addresses = list(self.addresses)
            for position, k in self.moving:
                addresses[position] = address_of(arrays[k])
            segment.run_at(addresses, [address_of(e) for e in made], self.staged)
        if self.one_exit:
            return made
        exits = [e.transpose(0, 3, 1, 2) if nhwc else e for e, (_, _, nhwc) in zip(made, self.exits)]
        return [exits[j] for j in self.outputs]


def _run_bare(segment: Segment, staged: bool, bare: tuple, arrays: list[np.ndarray], made: list[np.ndarray]) -> None:
    """One run of a one-form segment's loop (Segment.bare_loop) on `arrays` into `made`: the loop's bindings written
    here (`bare`: _bare_bindings'), one ctypes call. No array is empty (the caller's record checked): each address
    through ctypes' view of its buffer."""
    inputs, exits, constants = bare
    with segment._lock:
        loop = segment._bare.get(staged) or segment.bare_loop(staged)
        addresses = loop.addresses
        for binding, k in inputs:
            addresses[binding] = _addressof(_BYTE.from_buffer(arrays[k]))
        for binding, j in exits:
            addresses[binding] = _addressof(_BYTE.from_buffer(made[j]))
        for binding, address in constants:
            addresses[binding] = address
        segment.ran_planned = True
        if loop.serial:  # a tiny segment's serial form (Segment.only_form): no parallel region
            with one_openmp_thread():
                status = loop.run(*loop.args)
        else:
            status = loop.run(*loop.args)
    if status:
        loop.raise_failed(status)


def _bare_bindings(loop: Any, inputs: dict[int, int], addresses: list[int]) -> tuple | None:
    """StaticRun.bare: which of the loop's moving bindings (BareLoop.moving) take which input, exit or constant
    (`inputs`: entry position -> input index; `addresses`: every entry's, the constants' fixed); None without a
    bare loop (a segment with a form chooser, or no compiled loop)."""
    if loop is None:
        return None
    from_inputs, from_exits, from_constants = [], [], []
    for binding, (kind, position) in loop.moving:
        if kind == "exit":
            from_exits.append((binding, position))
        elif position in inputs:
            from_inputs.append((binding, inputs[position]))
        else:
            from_constants.append((binding, addresses[position]))
    return tuple(from_inputs), tuple(from_exits), tuple(from_constants)


def address_of(array: np.ndarray) -> int:
    """The address of a writable C-contiguous array's data, through ctypes' view of its buffer: ~0.35 µs here, where
    array.ctypes.data makes a helper object per call (~1 µs; bench/results/call-overhead-zen4-2026-12-07.md)."""
    return ctypes.addressof(_BYTE.from_buffer(array)) if array.nbytes else array.ctypes.data


class DirectRuns:
    """The DirectRun of each bound signature of a program that is one native segment once its shape values are
    known; shared by an engine's contexts."""

    def __init__(self, program: Program, segment: Segment):
        self.program = program
        self.segment = segment
        step = program.lean_steps[0]
        self._entry_slots = list(step.inputs)
        self._input_of = {slot: k for k, slot in enumerate(program.input_slots)}
        exits = list(step.outputs)
        self._outputs = tuple(exits.index(s) for s in program.output_slots)
        self._entries = self._entry_table()
        self._records: dict[tuple, DirectRun | None] = {}
        self._refused: set[tuple] = set()  # signatures bind() could not make a record of
        self._plan_evictions = program.plan_evictions
        self._lock = threading.Lock()
        self._self_ref = weakref.ref(self)  # what each record's view callback (_forget) holds

    @classmethod
    def of(cls, program: Program) -> DirectRuns | None:
        """The program's DirectRuns when, its shape values known, it is one native segment that reads its inputs
        and writes every output (else None)."""
        if len(program.lean_steps) != 1:  # (no shape values at all: one layer over a symbolic batch)
            return None
        step = program.lean_steps[0]
        segment = step.fn
        if not isinstance(segment, Segment) or segment._staged or not segment._views \
                or not all(s in step.outputs for s in program.output_slots):
            return None
        return cls(program, segment)

    def find(self, signature: tuple) -> DirectRun | None:
        """The signature's record (made here when the program has bound it), or None: not bound, or not runnable
        directly (another dtype or layout than the segment's, a size its layers run one by one)."""
        if self.program.plan_evictions != self._plan_evictions:
            self._forget_evicted()
        record = self._records.get(signature, _UNBOUND)  # one look-up: another thread may clear the records
        if record is _UNBOUND:
            record = self._make(signature)
            if record is _UNBOUND:
                return None  # not bound yet (or no longer): asked again once it is
            with self._lock:
                if len(self._records) >= DIRECT_RUNS:
                    self._records.clear()
                self._records[signature] = record
        if record is not None and not self._touch(signature, record):
            with self._lock:  # its plan or view went another way (a cleared cache): made again once bound again
                self._records.pop(signature, None)
            return None
        return record

    def bind(self, signature: tuple, arrays: list[np.ndarray]) -> DirectRun | None:
        """A new signature's record, made without a run of the program: its shape values computed
        (Program.plan_ahead) and its segment bound at their sizes (Segment._bind_sizes, as a run's call binds it),
        so that its first call runs as one call of the loop, as its repeats do. The general path's first call would
        compute the same shape values and bind the same view, then run it through Program.run's loop, the segment's
        entry key and torch outputs (~0.15-0.4 ms more on bert_tiny and BERT-base). None where the record cannot be
        made (the program computes some shape values only by running, or the view cannot run directly): the caller's
        general path runs, and finds the plan and the view (or their absence) there."""
        program = self.program
        if signature in self._refused:
            return None
        if program.plan_evictions != self._plan_evictions:
            self._forget_evicted()
        if program.shape_plans is not None and not program.plans_ahead:
            return None
        with program._plans_lock:
            known = program.shape_plans is None or signature in program.shape_plans
        if not known:
            if program.shape_function.shapes_only:
                # it reads only the inputs' sizes: the numpy arrays, no torch.from_numpy, no inference mode (the same
                # values, as ordinary tensors where the general path's are inference tensors: it reads both alike,
                # and views of its kept inference tensors are allowed outside the mode). Right after a run, the two
                # conversions and entering the mode cost ~30 and ~45 µs (bench/results/first-call-2026-12-06.md)
                if not program.plan_ahead(arrays, signature):
                    return None
            else:
                with torch.inference_mode():  # as the general path computes them
                    if not program.plan_ahead([torch.from_numpy(a) for a in arrays], signature):
                        return None
        record = self._make(signature, bind=True)
        if record is None:  # it cannot run directly: the general path's at every call, not asked again
            with self._lock:
                if len(self._refused) >= DIRECT_RUNS:
                    self._refused.clear()
                self._refused.add(signature)
        if record is _UNBOUND or record is None:
            return None
        with self._lock:
            if len(self._records) >= DIRECT_RUNS:
                self._records.clear()
            self._records[signature] = record
        # not marked used (_touch): its plan and view were made just now, each the most recent of its LRU. Where
        # another thread let the view go meanwhile, the record's run answers None (its weak reference) and the
        # caller's general path runs; a plan let go stays alive in the record (`plan`, `keep`)
        return record

    def _forget_evicted(self) -> None:
        """Let the records of the shape plans let go since the last look go too (a record holds its plan's tensors
        alive: BERT-base's ~7 MB at 8 x 256), or every record where the program does not say which went (more than
        it lists, or plan_evictions set by hand). Before, every record went at any eviction, and bind() declined
        until find() had cleared them: a stream of new shapes past SHAPE_PLANS ran each one's first call on the
        general path (torch conversions, Program.run: bert_tiny, every new shape after the 256th)."""
        program = self.program
        with self._lock:
            seen, now = self._plan_evictions, program.plan_evictions
            if now == seen:
                return
            evicted = list(program.evicted_plans)  # one C call: no other thread's append in between
            while evicted and evicted[-1][0] > now:  # let go after `now` was read: the next look's
                evicted.pop()
            evicted = evicted[len(evicted) - (now - seen):] if 0 < now - seen <= len(evicted) else None
            if evicted is not None and [count for count, _ in evicted] == list(range(seen + 1, now + 1)):
                for _, signature in evicted:
                    self._records.pop(signature, None)
            else:  # more let go than listed, or the count set by hand (lowered too)
                self._records.clear()
            self._plan_evictions = now

    def _touch(self, signature: tuple, record: DirectRun) -> bool:
        """Mark the signature used where the general path would: its shape plan and its view (least recent out).
        False when either is no longer there."""
        program, segment = self.program, self.segment
        if program.shape_plans is not None:
            with program._plans_lock:
                if program.shape_plans.get(signature) is not record.plan:
                    return False
                program.shape_plans.move_to_end(signature)
        view = record.view()
        if record.batch_bound:
            return view is not None and still_bound(segment, record.view_key, view)
        if view is not segment:
            with segment._resize_lock:
                if view is None or segment.resized.get(record.view_key) is not view:
                    return False
                segment.resized.move_to_end(record.view_key)
        return True

    def _entry_table(self) -> tuple | None:
        """What _make fills in per signature, found once: [(entry position, input index or None, plan index or None,
        dtype)] of the entries that move (the inputs; the shape values, at their place in every shape plan: the
        program's plan_slots, in order), and the fixed entries' addresses, sizes and tensors (the template's
        constants: the same for every signature). None where no signature can run directly (an entry not in rows,
        a constant of another dtype or device): a first call at a new shape ran this loop over BERT-base's 8
        entries, the constants' torch calls included (~66 µs with the exits and the record, after a run had cooled
        the caches: bench/results/first-call-2026-12-06.md)."""
        program, segment = self.program, self.segment
        in_plan = {slot: j for j, slot in enumerate(program.plan_slots)}
        moving, addresses, keep, key = [], [], [], []
        for position, (slot, dtype, layout) in enumerate(zip(self._entry_slots, segment.entry_dtypes,
                                                            segment.entry_layouts)):
            if layout != "rows":
                return None
            k, j = self._input_of.get(slot), in_plan.get(slot)
            if k is not None or j is not None:
                moving.append((position, k, j, dtype))
                addresses.append(0)
                key.append(())
                continue
            value = program.template[slot]
            if not isinstance(value, torch.Tensor) or value.dtype != dtype or value.device.type != "cpu":
                return None
            value = value.contiguous()
            keep.append(value)
            addresses.append(value.data_ptr())
            key.append(tuple(value.shape))
        return tuple(moving), tuple(addresses), tuple(keep), tuple(key)

    def _make(self, signature: tuple, bind: bool = False) -> DirectRun | None | object:
        """The signature's record; None where it cannot run directly; _UNBOUND where its shape plan or view is not
        (or no longer) there. `bind`: a view not there is bound (Segment._bind_sizes)."""
        program, segment = self.program, self.segment
        if program.shape_plans is None:  # a program without shape values: every signature's plan is empty
            plan = _NO_PLAN
        else:
            with program._plans_lock:
                plan = program.shape_plans.get(signature)
            if plan is None:
                return _UNBOUND
        if self._entries is None:
            return None
        table, fixed, constants, sizes = self._entries
        addresses, key, moving, keep = list(fixed), list(sizes), [], list(constants)
        for position, k, j, dtype in table:
            if k is not None:
                shape, given = signature[k]
                if given != dtype:
                    return None
                moving.append((position, k))
                key[position] = tuple(shape)
                continue
            value = plan[j][1]  # plan_slots[j]'s value
            if not isinstance(value, torch.Tensor) or value.dtype != dtype or not value.is_cpu:
                return None
            if not value.is_contiguous():  # (contiguous() is a dispatched op even where it returns the tensor)
                value = value.contiguous()
            keep.append(value)
            addresses[position] = value.data_ptr()
            key[position] = tuple(value.shape)
        key = tuple(key)
        batch = segment._batch_runs(key) if key != segment._planned_key else None
        found = direct_view(batch) if batch is not None else ON_VIEW
        if found is PENDING:
            return _UNBOUND  # its calls still count, bind or time a trial (native_batches.call_batch): asked later
        if key == segment._planned_key:
            view = segment
        elif found is None:
            return None  # another batch of its images: runs of the segment itself (Segment._run_batches), no view
        elif found is not ON_VIEW:
            view = found  # the batch's exact bind, kept
        else:
            with segment._resize_lock:
                view = segment.resized.get(key, _UNBOUND)
                if view is _UNBOUND and bind:
                    view = segment._bind_sizes(key)
        if view is None or view is _UNBOUND:
            return view  # None: a size its layers run one by one
        exits = []
        for size, strides, dtype in view.exit_shapes:
            numpy_dtype = _NUMPY_OF.get(dtype)
            if numpy_dtype is None or tuple(strides) != row_major_strides(tuple(size)):
                return None
            exits.append((tuple(size), numpy_dtype))
        held = weakref.ref(view, functools.partial(_forget, self._self_ref, signature))
        if not isinstance(view, Segment):  # a view over the template (_Resized): run_at
            return DirectRun(held, tuple(addresses), tuple(moving), tuple(exits), self._outputs, tuple(keep), key,
                             plan)
        empty = any(0 in size for size in key) or any(0 in size for size, _ in exits)
        bare = _bare_bindings(view.bare_loop(False), dict(moving), addresses) if not empty else None
        return DirectRun(held, tuple(addresses), tuple(moving), tuple(exits), self._outputs, tuple(keep), key, plan,
                         bare, view is not segment)


def _forget(runs: weakref.ref, signature: tuple, view: weakref.ref) -> None:
    """A record's view was freed (its segment's LRU let it go): the record goes too, and what it holds. No lock: this
    runs wherever the view's last reference went (under the segment's resize lock, or inside a collector pass), and
    one dict look-up and pop need none; a newer record popped by a race is made again on demand."""
    direct = runs()
    record = direct._records.get(signature) if direct is not None else None
    if record is not None and record.view is view:
        direct._records.pop(signature, None)


_NUMPY_OF = {t: d for d, t in NUMPY_TO_TORCH.items()}
_UNBOUND = object()  # DirectRuns._make: a shape plan or view not there
_NO_PLAN: list = []  # the shape plan of every signature of a program without shape values
_BYTE = ctypes.c_char  # address_of's view of an array's buffer
_addressof = ctypes.addressof


def torch_signature(arrays: list[np.ndarray]) -> tuple | None:
    """The program's signature (kiln/runtime/program.py input_signature) of numpy inputs, or None (a dtype torch's
    numpy bridge does not share)."""
    key = []
    for a in arrays:
        dtype = NUMPY_TO_TORCH.get(a.dtype)
        if dtype is None:
            return None
        key.append((a.shape, dtype))
    return tuple(key)


def program_signature(key: tuple) -> tuple | None:
    """torch_signature of numpy inputs from their (dtype, shape) each (bindings._numpy_signature's key), or None."""
    found = []
    for dtype, shape in key:
        torch_dtype = NUMPY_TO_TORCH.get(dtype)
        if torch_dtype is None:
            return None
        found.append((shape, torch_dtype))
    return tuple(found)
