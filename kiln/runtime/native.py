"""Native segments: runs of consecutive CPU layers executed as bound oneDNN primitives.

Inside a network, a layer's Python path costs far more than it does in a hot loop: each
convolution streams megabytes through the caches and evicts the interpreter's and torch's
dispatch code and data, so the next step's few microseconds of Python become tens
(measured on MobileNetV2, 2 threads: 6.0 ms a run, of which 4.0 ms inside oneDNN). onnxruntime's
C++ executor pays little of this. A segment removes it: each layer's primitive is bound once, at
load, to where the segment's memory plan puts its output (one arena on huge pages, offsets by
liveness, greedy best fit as kiln/plan/memory.py plans the engine's), and a run is one call
into a compiled loop (kiln/kernels/cpu/native_loop.py) that binds the run's inputs and outputs
and executes every layer. NCHW images are laid out NHWC by a reorder at the head of that loop.

A tactic offers a step to a segment by setting `launch.native` (NativeStep). Program groups
every run of two or more such steps whose shapes chain (kiln/runtime/program.py, by native_runs.py) into one
step (a run of one where that step is the program's whole work: a model of one layer then runs as one call of the
loop, numpy in and out, kiln/runtime/direct_run.py): its inputs are the values the run reads from outside, its
outputs the values read after it. Those are bound per call (an entry's address; an exit gets a fresh tensor), so
nothing a caller holds is ever overwritten by a later run. A residual whose value dies at a convolution
and lives in the arena is accumulated in place (the primitive's sum post-op); a Reshape that
moves no byte is an alias of its input's memory.

Inputs of another size than the one the segment was planned for (a profile's other shapes) run as a
view over a template segment (_Resized): the template's arena and memory plan, each layer at that
size from its NativeStep (`at`) — kiln's own kernels only replan, oneDNN primitives bind anew to the
template's addresses. A size the template's arena cannot hold grows the template to the largest sizes
seen along each entry axis, so a stream of shapes binds a few templates, not one segment per shape.
A view's plans of kiln's own kernels are its template's with the fields that follow the sizes written
over (_PlanRewrite: no per-member Python objects). Views are kept (VIEWS per segment, least recently used
out); a segment without the compiled loop binds a segment of its own per size (RESIZED); a size a layer cannot
bind runs through the layers' own launch functions, as without segments. An image segment's oneDNN layers at a new
batch run their tuned primitives in chunks of its batch (kiln/kernels/cpu/onednn_chunks.py): its views bind no
primitive. Another batch of an image segment's images runs as runs of the segment itself (native_batches.py); a
batch met often is bound exactly on a background thread and swapped in where a trial measures it faster.

The parts: this module's Segment plans its arena, binds its members and runs them, and picks how a size runs;
native_members.py says what each member reads and writes and binds its call; native_views.py makes the views at
other sizes (_Resized, _PlanRewrite); native_runs.py finds the runs of a program that become segments.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kiln.kernels.cpu import hugepages, native_loop, onednn
from kiln.kernels.cpu.form_choice import PARALLEL, SERIAL, FormChooser
from kiln.plan.memory import Interval, place
from kiln.runtime.native_arena import SharedArena
from kiln.runtime.native_batches import (PLANS, BatchPlan, another_batch, batch_plan, binds_enabled, call_batch, forget,
                                        planned_batch)
from kiln.runtime.native_members import (TINY_WORK, _bind_member, _entry_forms, _form, _forms, _run_loop, estimated_work,
                                         reads_of, serial_calls, writes_of)
from kiln.runtime.native_views import _PlanRewrite, _Resized, exit_tensors
from kiln.runtime.step import BoundStep, call_step
from kiln.tactics.tactic import NativeStep, native_strides, row_major_strides

_CL = torch.channels_last
RESIZED = 8  # segments bound for other input sizes than the tuned one, per segment (profile shapes)
VIEWS = 256  # sizes kept as views over a template's memory (_Resized: plans only), per segment
GROW_AHEAD_BYTES = 256 << 20  # the largest arena a view template grows to at load (Segment.grow_ahead): pages touched


class Segment:
    """Consecutive layers of a program run as bound primitives; called as one step."""

    SHARE_VIEWS = True  # twins (on_arena) take their origin's grown template, traced rules and walk (_adopt)
    SHARE_ARENA = True  # a grown view template over its program's arena (_grow_arena), not memory of its own
    # a twin's adopted grown template touched whole at its adoption (session 26), not only where its origin's runs
    # reached (adopt_views). Kept on: off, a context holds ~13-27 MiB on BERT-base instead of ~39 (bench/ctx_memory.py
    # --whole is on), but its first call at a shape whose pages nobody touched faults them in the loop (3x250 after
    # small shapes: +93 ms over its repeat on this KVM's huge pages, +11 ms on), a spike the first calls must not pay
    TOUCH_ADOPTED_WHOLE = True

    def __init__(self, members: list[BoundStep], read_after: set[int], constants: dict[int, Any] | None = None,
                 natives: list[NativeStep] | None = None, arena: SharedArena | None = None):
        """`natives`: the members' NativeSteps at other input sizes than their tuned ones (see resized). `arena`:
        the memory (and lock) this segment shares with the program's other segments (native_arena.py)."""
        self.members = members
        self.read_after = read_after
        self.constants = constants or {}  # slot -> weight: what the layers' own launches read besides activations
        self.resized: OrderedDict[tuple, Segment | None] = OrderedDict()  # entry sizes -> that size's segment
        self.view_evictions = 0  # sizes let go from `resized` so far (what holds on to them notices: direct_run.py)
        self.unbound: str | None = None  # why the latest sizes that could not be bound ran layer by layer
        self._resize_lock = threading.Lock()
        natives = natives if natives is not None else [m.fn.native for m in members]
        produced: dict[int, int] = {}  # slot -> member that writes it
        forms: dict[int, tuple] = {}  # slot -> (size, strides, dtype) it is written in
        for k, (m, native) in enumerate(zip(members, natives)):
            for slot, _role, size, strides, dtype in writes_of(m, native):
                produced[slot] = k
                forms[slot] = (size, strides, dtype)
        consumers: dict[int, list[tuple[int, Any]]] = {}  # slot -> [(member, role)]
        for k, (m, native) in enumerate(zip(members, natives)):
            for slot, role in reads_of(m, native):
                consumers.setdefault(slot, []).append((k, role))

        self.entries = [s for s in consumers if s not in produced]  # read here, written before the segment
        self.exits = [s for s in produced if s in read_after]  # written here, read after it
        exits = set(self.exits)
        last_read = {s: max(k for k, _ in uses) for s, uses in consumers.items()}

        # Values that share memory: an alias's output is its input's memory; an accumulated result
        # is written over its residual. root[s]: the first value of s's group.
        root: dict[int, int] = {}
        accumulate: list[bool] = []
        for k, (m, native) in enumerate(zip(members, natives)):
            x, out = m.inputs[0], m.outputs[0]
            residual = m.inputs[native.residual_input] if native.residual_input is not None else None
            if native.reads is not None:  # kiln's own kernels: no alias, no accumulation
                accumulate.append(False)
                continue
            if native.alias:
                if x not in produced or last_read[x] != k or x in exits:
                    raise ValueError(f"alias {m.ctx.name}: its input is not a value of the segment that dies here")
                root[out] = root.get(x, x)
                accumulate.append(False)
                continue
            over = (native.accumulate and residual in produced and last_read[residual] == k and residual != x
                    and residual not in exits and out not in exits)
            accumulate.append(over)
            if over:
                root[out] = root.get(residual, residual)
        group = {s: root.get(s, s) for s in produced}
        exit_group = {group[s] for s in exits}  # groups read after the segment: bound per call

        # The memory plan: the other groups get offsets in one arena by liveness (greedy best fit,
        # kiln/plan/memory.py), on huge pages.
        spans: dict[int, Interval] = {}
        for s, k in produced.items():
            g = group[s]
            if g in exit_group:
                continue
            size = math.prod(forms[s][0]) * forms[s][2].itemsize
            end = last_read.get(s, k)
            iv = spans.get(g)
            if iv is None:
                spans[g] = Interval(str(g), (size + 63) // 64 * 64, k, end)
            else:
                iv.size, iv.start, iv.end = max(iv.size, (size + 63) // 64 * 64), min(iv.start, k), max(iv.end, end)
        self._capacity = {g: iv.size for g, iv in spans.items()}  # what a view over this segment may use
        self._layout = (produced, group, exit_group, last_read)
        placed = place(list(spans.values()))
        peak = max((iv.offset + iv.size for iv in placed), default=0)
        self.arena = arena  # another context's program binds these layers anew on its sibling (on_arena)
        shared = arena.take(peak) if arena is not None and peak else None
        self.buffers = [shared if shared is not None else hugepages.empty(peak // 4)] if peak else []
        # where members take their scratch: the arena whose lock this segment's runs hold (below), else their own
        self._scratch_arena = arena if shared is not None else None
        base = self.buffers[0].data_ptr() if peak else 0
        address: dict[int, int] = {s: base + spans[group[s]].offset for s in produced if group[s] in spans}

        # Bind every layer to its buffers; entries and exit groups are pointed at per call.
        # entry slot or exit group -> [(index of the Bound in self.bound, role)]
        self.per_call: dict[int, list[tuple[int, Any]]] = {}
        self._address, self._accumulate = address, accumulate
        self.bound = []  # owns the memory objects the calls' argument arrays point at
        self._bound_members: list[int] = []  # the member of each bound call
        self._calls = []
        self._names = []  # the layer each call belongs to
        self._call_counts = []  # calls of each bound member: a view whose members make as many shares _names
        member_calls = []
        if self._scratch_arena is not None and any(native.scratch_bytes for native in natives):
            self._scratch_arena.scratch(max(native.scratch_bytes for native in natives))  # its members' at once
        with onednn.shared_memories():  # one memory object per arena place and size (a view's too: _bind_sizes)
            bound = [None if native.alias else _bind_member(m, native, accumulate[k], address, self._scratch_arena)
                     for k, (m, native) in enumerate(zip(members, natives))]
        for k, (m, native) in enumerate(zip(members, natives)):
            if native.alias:
                continue
            b, roles = bound[k]
            for s, role in roles:
                if s in produced and group[s] in exit_group:
                    self.per_call.setdefault(group[s], []).append((len(self.bound), role))
                elif s not in produced:
                    self.per_call.setdefault(s, []).append((len(self.bound), role))
            self.bound.append(b)
            self._bound_members.append(k)
            calls = b.calls()
            self._calls += calls
            self._names += [m.ctx.name] * len(calls)
            self._call_counts.append(len(calls))
            member_calls.append(calls)
        self.exit_groups = [group[s] for s in self.exits]
        self._per_call_bound = {i for uses in self.per_call.values() for i, _ in uses}  # bound calls a run points
        self.exit_shapes = [forms[s] for s in self.exits]
        self._entry_readers = [consumers[s] for s in self.entries]
        self.entry_sizes, self.entry_dtypes, self.entry_layouts = _entry_forms(self.entries, self._entry_readers,
                                                                               natives)
        self._planned_key = tuple(tuple(size) for size in self.entry_sizes)  # _entry_key of the planned sizes
        lib = onednn.load()
        self._execute, self._stream = lib.lib.dnnl_primitive_execute, lib.stream
        self._check = onednn._check
        self._lock = arena.lock if shared is not None else threading.Lock()  # the arena's users run one at a time
        self._stage: dict[int, torch.Tensor] = {}
        # NCHW images (4-D entries as users hand them) are laid out NHWC by a reorder at the head
        # of the loop, into a buffer of the segment's: no allocation, both threads.
        self._staged = []  # (entry index, Bound of its reorder, its buffer)
        for k, size in enumerate(self.entry_sizes):
            if self.entry_layouts[k] == "nhwc":
                dtype = self.entry_dtypes[k]  # an int8 engine's uint8 activations as well as float32 images
                buffer = hugepages.empty(math.prod(size), dtype).as_strided(size, native_strides(size))
                reorder = onednn.Reorder(size, onednn.TAG_ABCD, onednn.TAG_ACDB, serial=torch.get_num_threads() > 1,
                                         dtype=dtype)
                self._staged.append((k, reorder.bind(0, buffer.data_ptr()), buffer))
        # What a run points at its inputs and outputs: (memory object, source), the source an
        # ("entry", k), an ("exit", j) or a fixed address (a staged entry's buffer).
        staged_entries = {k: (bound, buffer) for k, bound, buffer in self._staged}
        plain: list[tuple[int, Any]] = []
        staged: list[tuple[int, Any]] = []
        for k, s in enumerate(self.entries):
            for i, role in self.per_call[s]:
                memory = self.bound[i].memory(role)
                plain.append((memory, ("entry", k)))
                staged.append((memory, staged_entries[k][1].data_ptr()) if k in staged_entries
                              else (memory, ("entry", k)))
        for k, (bound, _buffer) in staged_entries.items():
            staged.append((bound.memory("src"), ("entry", k)))
        for j, g in enumerate(self.exit_groups):
            for i, role in self.per_call.get(g, ()):
                plain.append((self.bound[i].memory(role), ("exit", j)))
                staged.append((self.bound[i].memory(role), ("exit", j)))
        reorders = {PARALLEL: [c for _, b, _ in self._staged for c in b.calls()],  # the serial form's on one thread
                    SERIAL: [c for _, b, _ in self._staged for c in (b.serial_calls() or b.calls())]}
        # a staged entry's reorder is timed under a name of its own (Segment.timed), one per segment: the layers
        # reading that entry are what make it (the autotuner charges it to them in context: builder/in_context.py)
        self.entry_reorders: dict[str, list[str]] = {
            f"reorder of input {k} for {members[self._entry_readers[k][0][0]].ctx.name}":
                [members[j].ctx.name for j, _ in self._entry_readers[k]] for k, _, _ in self._staged}
        staged_names = list(self.entry_reorders) + self._names
        # the forms a run may take (kiln/kernels/cpu/form_choice.py): small layers on OpenMP's count, and, where
        # some have one (onednn_primitives.thread_forms), on one thread
        forms = {PARALLEL: self._calls}
        serial = serial_calls(self.bound, member_calls)
        if serial is not None:
            forms[SERIAL] = serial
        # a segment whose whole work is too small for a second thread (estimated_work) runs its serial form, no
        # chooser: both forms stay compiled (views at other sizes start from the parallel one: native_views.py)
        self.work = estimated_work(members, natives, self.constants)
        self.only_form = SERIAL if serial is not None and self.work < TINY_WORK else PARALLEL
        self.chooser = FormChooser() if serial is not None and self.only_form == PARALLEL else None
        self._variants = {}  # (staged, form) -> (bindings, calls, names)
        for form, calls in forms.items():
            self._variants[False, form] = (plain, calls, self._names)
            if self._staged:  # only a segment reading NCHW images has the reordering variant
                self._variants[True, form] = (staged, reorders[form] + calls, staged_names)
        # the loop in C when it could be built (kiln/kernels/cpu/native_loop.py): one call per run
        loop = native_loop.load()
        self._set_handle = lib.lib.dnnl_memory_set_data_handle
        self._c = None
        self._bare: dict[bool, BareLoop] = {}  # bare_loop's, by staged
        if loop is not None and self._calls:
            self._c = {k: self._c_loop(loop, bindings, calls) for k, (bindings, calls, _) in
                       self._variants.items()}
        self.accumulated = sum(accumulate)
        self.aliased = sum(n.alias for n in natives)
        self._natives = natives
        self._structure = [_form(n) for n in natives]  # what fits() compares another size's members with
        # what _natives_at and fits() walk per new input size, looked up once here: each member's `at` with the
        # slots it reads ((step input, slot) pairs, or its input 0's slot), and (slot, group) of every value that
        # lives in the arena
        self._resizers = [(m.fn.native.at, [(i, m.inputs[i]) for i in m.fn.native.reads]
                           if m.fn.native.reads is not None else None, m.inputs[0]) for m in members]
        self._arena_slots = [(s, group[s]) for s in produced if group[s] not in exit_group]
        # Other sizes as views over this segment's memory (_Resized). A segment that reorders NCHW images at its head
        # has them too: a view reads its entries laid out NHWC (_Resized._run_bound lays them out), and its oneDNN
        # image layers run their tuned primitives over the new batch in chunks (kiln/kernels/cpu/onednn_chunks.py)
        self._views = self._c is not None
        # the segment whose memory other sizes' views use, once grown past this one (None: this one; never
        # `self`, which made every segment a reference cycle: a dead engine's arena, packed weights and
        # oneDNN primitives then waited for the garbage collector)
        self._grown: Segment | None = None
        self._rewrite: _PlanRewrite | None = None  # made at the first view over this segment
        # the segment this one is another context's twin of (on_arena), weakly; None: none
        self._origin: weakref.ref[Segment] | None = None
        # Another batch of the planned images as runs of this segment (native_batches.py): the planned batch, the
        # batches' plans, whether the members compute each image alone (None: not yet asked) and the one-image
        # reorders of the images left past the runs
        self._planned_batch = planned_batch(self.entry_sizes, self.entry_layouts, natives) if self._c is not None \
            else None
        self._batch_plans: OrderedDict[tuple, BatchPlan] = OrderedDict()  # least recently used first
        self._left_reorders: dict[int, tuple] = {}
        self._per_image: bool | None = None
        self._bound_batches: dict[tuple, BatchPlan] = {}  # batches bound exactly, kept (native_batches.call_batch)
        # whether a run at the planned sizes has reached this segment's arena (its twins' jobs touch their own
        # pages there only then: adopt_views)
        self.ran_planned = False

    def on_arena(self, arena: SharedArena | None, adopt: bool = True) -> Segment:
        """These layers bound anew over `arena` (another execution context's: SharedArena.sibling): the same memory
        plan, at the same offsets from the arena's start, with bound calls, staging buffers and views of their own;
        the layers' launches and packed weights are shared. Views are bound under this segment's resize lock: a
        layer's primitives at other sizes (NativeStep.at, cached in its launch) are made one at a time, as within
        one program. What the origin's views have made that follows the sizes only (its grown template's sizes,
        traced rules and walk) the twin takes now (`adopt`; else a background job does, views_ahead.twins_job, or its
        first new size) and at its later new sizes (_adopt), not made again."""
        twin = Segment(self.members, self.read_after, self.constants, self._natives, arena=arena)
        twin._resize_lock = self._resize_lock
        if self.SHARE_VIEWS:
            twin._origin = weakref.ref(self)  # weakly: a refit's old program is not kept alive by its twins
            if adopt:
                with self._resize_lock:
                    twin._adopt()
        return twin

    def adopt_views(self, limit: int) -> int:
        """A twin's (on_arena) views readied from its origin's, for a background job at the twin's creation
        (views_ahead.twins_job): what _adopt takes (the grown template, its plan rewrite on the origin's traces), then
        this segment's own view at each of the origin's `limit` most recently used sizes (oldest first, as the
        origin's LRU holds them), so that a second context's first call at a shape the first has run finds its view
        bound, as a repeat does (before: its first call assembled it, ~0.15-0.3 ms). Takes the resize lock per view,
        so a call waits for one view's binding at most. The pages those runs reach are touched here, and only those
        (_extents; the planned plan's where the origin ran its planned sizes); with TOUCH_ADOPTED_WHOLE off the adopted
        grown template is not touched whole, so a context holds the memory of the shapes run, not the profile's largest
        plan (BERT-base: ~13 MiB a context that runs small shapes, ~27 with the planned 8 x 128, where each held ~39). Returns how many
        views it bound, plus one where it adopted."""
        origin = self._origin() if self._origin is not None else None
        if origin is None or not self._views:
            return 0
        with self._resize_lock:
            made = int(self._adopt())
            keys = [key for key, view in origin.resized.items() if view is not None][-limit:] if limit > 0 else []
        planned = origin.ran_planned
        del origin
        if planned and not self.ran_planned:  # its runs at the planned sizes reach its whole plan, as its origin's
            self._touch(self, [(0, self.planned_bytes)])
        for key in keys:
            with self._resize_lock:
                if key in self.resized:
                    continue
                view = self._bind_sizes(key)
            made += view is not None
            if isinstance(view, _Resized):
                self._touch(view.template, self._extents(view.template, key))
            del view
            time.sleep(0)  # the GIL to a calling thread, if one waits
        return made

    def _extents(self, template: Segment, key: tuple) -> list[tuple[int, int]]:
        """[(start, stop)] in bytes from the start of `template`'s arena plan of every value a run of its view at entry
        sizes `key` writes there: the pages that run reaches (each value at its planned place, as large as it is at
        `key`), merged. By the plan rewrite's rules where they size every member (no lock: _PlanRewrite.arena_bytes_at),
        else by the members' NativeSteps at `key` (made one at a time, under the resize lock); empty where neither."""
        rewrite = template._rewrite
        found = rewrite.arena_bytes_at(template, key) if rewrite is not None else None
        if found is None:
            try:
                with self._resize_lock:
                    forms = template._natives_at(key).forms
            except ValueError:
                return []
            found = {s: math.prod(forms[s][0]) * forms[s][2].itemsize for s, _g in template._arena_slots if s in forms}
        base = template.buffers[0].data_ptr() if template.buffers else 0
        spans = sorted((template._address[s] - base, template._address[s] - base + nbytes)
                       for s, nbytes in found.items())
        merged: list[list[int]] = []
        for start, stop in spans:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], stop)
            elif stop > start:
                merged.append([start, stop])
        return [(start, stop) for start, stop in merged]

    @staticmethod
    def _touch(template: Segment, extents: list[tuple[int, int]]) -> None:
        """The pages of `template`'s arena plan within `extents` (bytes from its start) faulted in now, zeroed under the
        lock its runs take (a run of the lane's other segments, over the same arena, may be using it meanwhile; the
        values there die with each run): a lane's first call there then finds them, where a huge page's first
        touch inside the loop may wait on the kernel's compaction (+35-75 ms on BERT-base,
        bench/results/first-shape-2026-12-06.md)."""
        if not template.buffers:
            return
        buffer = template.buffers[0]
        with template._lock:
            for start, stop in extents:
                buffer[start // 4:-(-stop // 4)].zero_()

    def _adopt(self) -> bool:
        """What this segment (another context's twin: on_arena) may take from its origin's views instead of making it
        again at its first calls (issue 10/14: a second context's first call at a shape the first had run cost ~5 ms on
        bert_tiny where its repeat costs 0.1): the origin's grown template (the load's view job grew it to the profile's
        largest), as a template of its own at the same sizes over memory of its own (no page touched here: only where
        this lane's runs reach, or adopt_views touches at its origin's sizes; touched whole, every lane held the
        profile's largest plan, BERT-base's 36 MiB, however small its shapes), and each template's plan rewrite made
        sharing its origin's traced rules and traced walk (_PlanRewrite's `like`: what is the engine's, read-only once
        made, and the same for templates of one plan). Views themselves stay this segment's: they point at its memory.
        The caller holds the resize lock (shared with the origin: what the origin grows or rewrites meanwhile is set
        under it). True where it took something."""
        origin = self._origin() if self._origin is not None else None
        if origin is None:
            return False
        adopted = False
        if self._grown is None and origin._grown is not None:
            # over this context's arena where it holds it (SharedArena.sibling: one memory and lock for the views and
            # the planned segments), else memory of its own
            self._grown, adopted = origin._grown.on_arena(self._grow_arena()), True
            if self.TOUCH_ADOPTED_WHOLE:
                self._touch(self._grown, [(0, self._grown.planned_bytes)])
        template = self._grown or self
        like = template._origin() if template._origin is not None else None
        if template._rewrite is None and like is not None and like._rewrite is not None:
            template._rewrite, adopted = _PlanRewrite(template, like=like._rewrite), True
        return adopted

    def _c_loop(self, loop, bindings: list, calls: list) -> tuple:
        nbind = len(bindings)
        addresses = (ctypes.c_void_p * max(nbind, 1))()
        for i, (_, src) in enumerate(bindings):
            if isinstance(src, int):  # fixed: a staged entry's buffer
                addresses[i] = src
        functions, objects, nargs, args = native_loop.call_arrays(calls)
        return (loop.kiln_run_segment_bare, functions, ctypes.cast(self._set_handle, ctypes.c_void_p), nbind,
                (ctypes.c_void_p * max(nbind, 1))(*[m for m, _ in bindings]), addresses,
                [(i, src) for i, (_, src) in enumerate(bindings) if not isinstance(src, int)],
                len(calls), objects, nargs, args, ctypes.c_int(-1))

    def _run(self, entry_addresses: list[int], exit_addresses: list[int], staged: bool) -> None:
        """Point the run's inputs and outputs, run every layer in the form the chooser picks, timed for it
        (the caller holds the lock)."""
        sources = {"entry": entry_addresses, "exit": exit_addresses}
        self.ran_planned = True
        chooser = self.chooser
        if chooser is None:
            self._run_form(sources, staged, self.only_form)
            return
        form = chooser.choose()
        start = time.perf_counter()
        self._run_form(sources, staged, form)
        chooser.record(form, time.perf_counter() - start)

    def _run_form(self, sources: dict[str, list[int]], staged: bool, form: str) -> None:
        if form == SERIAL:  # OpenMP's count at 1 meanwhile: no layer of the serial form forks (one_openmp_thread)
            with onednn.one_openmp_thread():
                self._run_form_as_is(sources, staged, form)
        else:
            self._run_form_as_is(sources, staged, form)

    def _run_form_as_is(self, sources: dict[str, list[int]], staged: bool, form: str) -> None:
        bindings, calls, names = self._variants[staged, form]
        if self._c is not None:
            _run_loop(self._c[staged, form], self._stream, sources, names)
            return
        for memory, src in bindings:
            self._set_handle(memory, src if isinstance(src, int) else sources[src[0]][src[1]])
        for k, (fn, obj, nargs, args) in enumerate(calls):
            if fn is not None:  # only the compiled library's kernels have their own function
                raise RuntimeError(f"layer {names[k]!r} needs kiln's compiled native code, which is not loaded")
            status = self._execute(obj, self._stream, nargs, args)
            if status:
                self._check(status, f"layer {names[k]!r} of a native segment")

    @contextlib.contextmanager
    def timed(self, clock: int = time.CLOCK_MONOTONIC) -> Iterator[dict[str, list[float]]]:
        """Within: each run of this segment at its planned size adds, per layer, its ms in that run (its calls'
        times summed, by `clock`: the wall's, or time.CLOCK_THREAD_CPUTIME_ID, the calling thread's CPU time) to
        the dict's list. What a layer costs as the network runs it, after the layer before
        it evicted its weights and activations, not as a loop of its own calls finds it (kiln/runtime/profiler.py:
        profile_segments). Needs the compiled loop."""
        if self._c is None:
            raise RuntimeError(f"a segment's per-layer times need kiln's compiled loop: {native_loop.reason()}")
        found: dict[str, list[float]] = {}
        timed_run = native_loop.load().kiln_run_segment_timed
        plain = dict(self._c)

        def clocked(c: tuple, names: list[str]) -> tuple:
            elapsed = (ctypes.c_longlong * max(len(names), 1))()

            def run(*args) -> int:
                status = timed_run(*args, elapsed, clock)
                per_layer: dict[str, float] = {}
                for name, ns in zip(names, elapsed):
                    per_layer[name] = per_layer.get(name, 0.0) + ns / 1e6
                for name, ms in per_layer.items():
                    found.setdefault(name, []).append(ms)
                return status
            return (run, *c[1:])

        with self._lock:
            self._c = {key: clocked(c, self._variants[key][2]) for key, c in plain.items()}
            self._bare = {}  # (bare_loop's made again on the timed loop, and on the plain one after)
        try:
            yield found
        finally:
            with self._lock:
                self._c = plain
                self._bare = {}

    def _staging(self, k: int, v: torch.Tensor) -> torch.Tensor:
        """Entry k copied into its own buffer in the segment's layout (made on first use)."""
        buffer = self._stage.get(k)
        if buffer is None:
            size = tuple(v.shape)
            strides = native_strides(size) if self.entry_layouts[k] == "nhwc" else row_major_strides(size)
            buffer = self._stage[k] = torch.empty_strided(size, strides, dtype=v.dtype)
        return buffer.copy_(v)

    def _laid_out(self, k: int, v: torch.Tensor) -> bool:
        return v.is_contiguous(memory_format=_CL) if self.entry_layouts[k] == "nhwc" else v.is_contiguous()

    @property
    def planned_bytes(self) -> int:
        return sum(b.numel() * 4 for b in self.buffers)

    def fallback(self, values: list[Any]) -> list[Any]:
        """The layers' own launch functions, for inputs of other sizes than planned."""
        env = {**self.constants, **dict(zip(self.entries, values))}
        for m in self.members:
            out = call_step(m.fn, m.ctx, [env.get(s) if s >= 0 else None for s in m.inputs], m.attributes)
            env.update(zip(m.outputs, out) if len(m.outputs) > 1 else [(m.outputs[0], out)])
        return [env[s] for s in self.exits]

    def _natives_at(self, key: tuple) -> _AtSizes:
        """Every member's NativeStep for entries of sizes `key` (ValueError: a layer cannot bind them)."""
        sizes = dict(zip(self.entries, key))
        natives = []
        forms: dict[int, tuple] = {}
        for m, (at, reads, x) in zip(self.members, self._resizers):
            if at is None:
                raise ValueError(f"layer {m.ctx.name!r} offers no primitive for other sizes")
            native = at({i: sizes[slot] for i, slot in reads}) if reads is not None else at(sizes[x])
            if native.residual_input is not None and sizes[m.inputs[native.residual_input]] != native.output_size:
                raise ValueError(f"layer {m.ctx.name!r}: the residual is not the output's size")
            if native.more_outputs:
                for slot, _role, size, strides, dtype in writes_of(m, native):
                    sizes[slot] = size
                    forms[slot] = (size, strides, dtype)
            else:  # writes_of's one entry, without its list
                size = tuple(native.output_size)
                sizes[m.outputs[0]] = size
                forms[m.outputs[0]] = (size, native.output_strides, native.output_dtype)
            natives.append(native)
        return _AtSizes(natives, forms)

    def _bind_sizes(self, key: tuple) -> Segment | _Resized | None:
        """The segment bound for entries of sizes `key` (built on first sight, VIEWS or RESIZED kept, least recently
        used out), or None when a layer cannot be bound at them: then the layers run one by one. The caller holds
        the resize lock."""
        if key in self.resized:
            self.resized.move_to_end(key)
            return self.resized[key]
        try:
            if self._origin is not None and self._views:
                self._adopt()  # what the origin grew or rewrote since this twin was made
            template = self._grown or self
            rewrite = template._rewrite if self._views else None
            segment = rewrite.traced_view(template, key) if rewrite is not None else None  # no oneDNN scope
            if segment is None:
                with onednn.shared_memories():  # the layers' memory objects at one arena place and size: one each
                    segment = self._bound_at(key)
        except Exception as error:  # noqa: BLE001  a size the layers cannot bind: they run one by one, as before
            segment = None
            self.unbound = f"{key}: {type(error).__name__}: {error}"  # the latest, for tests and the profiler
        self.resized[key] = segment
        while len(self.resized) > (VIEWS if self._views else RESIZED):
            self.resized.popitem(last=False)
            self.view_evictions += 1
        return segment

    def _bound_at(self, key: tuple) -> Segment | _Resized:
        """_bind_sizes's view at `key` where no traced path answers: rewritten, a view bound member by member, or a
        Segment of its own."""
        segment = self._rewritten(key) if self._views else None
        if segment is None:
            at = self._natives_at(key)
            segment = self._view(key, at) if self._views else None
        if segment is None:
            segment = Segment(self.members, self.read_after, self.constants, at.natives)
            if segment.entries != self.entries or segment.exits != self.exits:
                raise ValueError("the segment's entries or exits changed")
        return segment

    def rewrite_ahead(self) -> bool:
        """Make the plan rewrite of this segment's views now (a background job at load: first_calls.primitives_ahead)
        rather than at the first call at a new size, which otherwise waits for it (BERT-base: ~5-6 ms of Python, the
        most of a saved engine's first new shape). True where it made it (False: made already, or no views)."""
        if not self._views or self._grown is not None or self._rewrite is not None:
            return False
        with self._resize_lock:
            if self._grown is not None or self._rewrite is not None:
                return False
            self._rewrite = _PlanRewrite(self)
        return True

    def trace_ahead(self, key: tuple) -> bool:
        """Trace the view's walk at entry sizes `key` (its rules' paths and the walk's: _PlanRewrite.learn_at) before
        any call there: a background job at load (first_calls.primitives_ahead), so that a first call at sizes of a
        class traced here is one call of the traced walk (BERT-base's first new shape: ~4-5 ms of traces otherwise,
        bench/results/first-shape-2026-12-06.md). Binds nothing and takes no lock of the segment's: only the
        plan rewrite's traced rules and walk change, under their locks. True where a path of the walk was added."""
        template = self._grown or self
        rewrite = template._rewrite if self._views else None
        if rewrite is None or any(len(k) != len(t) for k, t in zip(key, template.entry_sizes)):
            return False
        return rewrite.learn_at(template, key)

    def view_ahead(self, key: tuple) -> int:
        """This segment's view at entry sizes `key` made now (a background job at load: views_ahead.views_ahead_at,
        at the shapes whose plans it made), where its traced walk answers them (one call; nothing is walked, bound or
        traced here) and the segment keeps fewer than VIEWS // 2 views (the calls' own views keep the other half
        before one made here goes): a first call there finds it as a repeat does, where making it cost llama_tiny
        ~45 µs a segment of a first call's ~0.65 ms outside the loop (bench/results/first-shape-2026-12-06.md).
        The bytes of the view's plans and calls (what it holds), 0 where none was made."""
        if not self._views or key == self._planned_key:
            return 0
        with self._resize_lock:
            if key in self.resized or len(self.resized) >= VIEWS // 2:
                return 0
            if self._origin is not None:
                self._adopt()
            template = self._grown or self
            rewrite = template._rewrite
            try:
                view = rewrite.traced_view(template, key) if rewrite is not None else None
            except Exception:  # noqa: BLE001  sizes a rule refuses: a call there finds out (and runs one by one)
                view = None
            if view is None:
                return 0
            self.resized[key] = view
            self.resized.move_to_end(key, last=False)  # the first to go: a call's own views are newer
            return sum(getattr(b, "nbytes", 0) for b in view._owned)

    def grow_ahead(self, key: tuple) -> bool:
        """Grow the views' template to entry sizes `key` now (the profile's largest: a background job at load,
        first_calls.primitives_ahead), with its plan rewrite, as the first call past the template's arena would
        (_view: a Segment of its own at the larger sizes, ~7 ms on BERT-base, then its plan rewrite and its traces
        at the next new shape, ~10 ms: bench/results/first-shape-2026-12-06.md). The grown arena is the one a
        stream reaching the profile's largest shape would grow to, its pages touched here (BERT-base at 8 x 256:
        38 MiB, beside the build's 18.5; past GROW_AHEAD_BYTES it is left to a call that needs it). True where it
        grew; ValueError where a layer cannot bind `key`."""
        if not self._views or self._grown is not None:
            return False
        at = self._natives_at(key)
        if self.fits(at.natives, at.forms):
            return False
        candidate = type(self)(self.members, self.read_after, self.constants, at.natives, arena=self._grow_arena())
        if candidate.entries != self.entries or candidate.exits != self.exits or not candidate._views \
                or not candidate.fits(at.natives, at.forms) \
                or sum(b.numel() * b.element_size() for b in candidate.buffers) > GROW_AHEAD_BYTES:
            return False  # (its arena's pages never touched: they held no memory)
        candidate.rewrite_ahead()
        with candidate._lock:  # (the program's arena, where it is over it: a run may be using it meanwhile)
            for buffer in candidate.buffers:  # its pages faulted in here: a huge page's first touch may wait on the
                buffer.zero_()  # kernel's compaction (a first call on the untouched arena: +35-75 ms inside the loop)
        with self._resize_lock:  # as _view sets it (its caller holds the lock)
            if self._grown is not None:
                return False
            self._grown = candidate
        return True

    def _grow_arena(self) -> SharedArena | None:
        """Where a grown view template plans its values: the program's arena (SHARE_ARENA), as its segments do, where
        it holds the template (its address space is the bound of any run of the planned sizes: BERT-base's 441 MiB
        holds its 36 MiB template at 8 x 256), else (None, or an arena too small: Segment falls back) memory of its
        own. Views and the segments at their planned sizes then share their pages and lock instead of holding both
        (BERT-base: ~36 MiB resident where they held 54 once both had run, bench/results/first-shape-2026-12-06.md).
        They run one at a time anyway: one context calls its program's segments one after another."""
        return self.arena if self.SHARE_ARENA else None

    def _rewritten(self, key: tuple) -> _Resized | None:
        """These sizes as a view whose plans of kiln's own kernels are the template's rewritten (_PlanRewrite),
        or None where the template's arena cannot hold them or a layer's rule refuses them."""
        template = self._grown or self
        if template._rewrite is None:
            template._rewrite = _PlanRewrite(template)
        return template._rewrite.view(template, key)

    def _view(self, key: tuple, wanted: _AtSizes) -> _Resized | None:
        """These sizes as a view over the template's memory: no binding, only the members' plans at
        them. A template too small for them grows to the largest sizes seen along each entry axis
        (so a stream of shapes binds a few templates, not one segment per shape)."""
        template = self._grown or self
        if template.fits(wanted.natives, wanted.forms):
            return _Resized.bound_at(template, wanted.natives, wanted.forms)
        grown = tuple(tuple(max(a, b) for a, b in zip(t, k)) if len(t) == len(k) else k
                      for t, k in zip(template.entry_sizes, key))
        for sizes in dict.fromkeys((grown, key)):
            try:
                at = wanted if sizes == key else self._natives_at(sizes)
                candidate = Segment(self.members, self.read_after, self.constants, at.natives,
                                    arena=self._grow_arena())
            except Exception:  # noqa: BLE001  the merged sizes may not bind: then these alone
                continue
            if candidate.entries != self.entries or candidate.exits != self.exits or not candidate._views \
                    or not candidate.fits(wanted.natives, wanted.forms):
                continue
            self._grown = candidate
            return _Resized.bound_at(candidate, wanted.natives, wanted.forms)
        return None

    def fits(self, natives: list[NativeStep], forms: dict[int, tuple] | None = None) -> bool:
        """Whether the members at `natives`' sizes fit this segment's arena (each value no larger than
        its place) with the same structure (aliases, accumulations, what each reads): the memory
        plan's offsets hold for them, liveness being the same. `forms`: _forms(members, natives), when
        the caller has them."""
        if [_form(n) for n in natives] != self._structure:
            return False
        forms = forms if forms is not None else _forms(self.members, natives)
        capacity = self._capacity
        for s, g in self._arena_slots:
            size, _strides, dtype = forms[s]
            if math.prod(size) * dtype.itemsize > capacity.get(g, -1):
                return False
        return True

    writes_into = True  # Program.run may give __call__ tensors to write its exits into

    def __call__(self, ctx, *values, into: list | None = None):
        """One run; `into`: a tensor (or None) per exit that the run writes that exit into where it has the exit's
        size, strides and dtype (exit_tensors; execute()'s bound outputs), on the planned sizes or a view; a batch in
        runs and the layers one by one make their own."""
        key = _entry_key(values, self.entry_dtypes)  # the entries' sizes, in one pass (a repeated call's whole check)
        if key is not None:
            if key == self._planned_key:
                return self._run_bound(values, into)
            plan = self._batch_runs(key)
            if plan is not None:  # another batch: runs of this segment or its view, or that batch bound exactly
                return call_batch(self, key, values, plan)  # once met often (native_batches.py)
            return self.run_resized(key, values, into)
        out = self.fallback(list(values))
        return tuple(out) if len(out) != 1 else out[0]

    def run_resized(self, key: tuple, values: tuple, into: list | None = None) -> Any:
        """One run on entries of sizes `key` (not the planned ones) on this segment's view at them (_bind_sizes),
        or layer by layer where it has none."""
        with self._resize_lock:  # contexts of one engine share its segments
            other = self._bind_sizes(key)
        if other is not None:
            return other._run_bound(values, into)
        out = self.fallback(list(values))
        return tuple(out) if len(out) != 1 else out[0]

    def _batch_runs(self, key: tuple) -> BatchPlan | None:
        """The plan of entries of sizes `key` (native_batches.py): another batch of its images as runs of this
        segment, or of a segment with views (_views) on its view, until met often enough to bind exactly; None
        where neither (its members mix a batch's images in runs, not another batch, binds off). The plans are
        kept least recently used out: a batch called all along keeps its plan (and its exact bind) however many
        other batches come and go."""
        plans = self._batch_plans
        plan = plans.get(key)
        if plan is not None:
            try:
                plans.move_to_end(key)
            except KeyError:  # let go by another thread meanwhile: this call still runs on it
                pass
            return plan
        if self._planned_batch is None and not (self._views and another_batch(self._planned_key, key)
                                                and binds_enabled()):
            return None
        with self._resize_lock:
            plan = plans.get(key) or batch_plan(self, key)
            if plan is not None and key not in plans:
                plans[key] = plan
                while len(plans) > PLANS:
                    forget(self, *plans.popitem(last=False))
        return plan

    def _run_bound(self, values: tuple, into: list | None = None) -> Any:
        """One run on entries of the planned sizes and dtypes: fresh exit tensors (or `into`'s, exit_tensors)."""
        exits = exit_tensors(self.exit_shapes, into)
        # NCHW images go through the reorders at the head of the loop; other entries in another
        # layout are copied into a buffer of the segment's (no fresh pages per run)
        staged = bool(self._staged) and all(not self._laid_out(k, values[k]) and values[k].is_contiguous()
                                            for k, _, _ in self._staged)
        with self._lock:
            entries = [v if (staged and self.entry_layouts[k] == "nhwc") or self._laid_out(k, v)
                       else self._staging(k, v) for k, v in enumerate(values)]
            self._run([v.data_ptr() for v in entries], [v.data_ptr() for v in exits], staged)
        return tuple(exits) if len(exits) != 1 else exits[0]

    def tiny(self, scale: float = 1.0) -> bool:
        """Whether a run of this segment, its estimated work times `scale` (work at larger sizes), is too small for a
        second thread (TINY_WORK) and enters no OpenMP parallel region: it runs its serial form alone (only_form), or
        only kiln's own kernels (their loops take the calling thread alone at such sizes), no oneDNN primitive."""
        return self.work * scale < TINY_WORK and (self.only_form == SERIAL or (
            not self._staged and all(fn is not None for fn, _obj, _nargs, _args in self._calls)))

    def run_at(self, entry_addresses: list[int], exit_addresses: list[int], staged: bool = False) -> None:
        """One run on entries and exits at these addresses, laid out as planned (`staged`: NCHW images where the
        segment lays them out at its loop's head): kiln/runtime/direct_run.py's."""
        with self._lock:
            self._run(entry_addresses, exit_addresses, staged)

    def bare_loop(self, staged: bool) -> BareLoop | None:
        """The compiled loop of a segment of one form (no form chooser) as one ctypes call on arguments made once:
        a caller holding the lock writes the moving bindings' addresses into `addresses` and calls `run(*args)`
        (kiln/runtime/direct_run.py StaticRun: a tiny model's call, where run_at's layers, its sources dict and
        _run_loop's unpacking were ~0.8 µs of a ~6 µs call). None with a chooser or without the compiled loop. timed()
        swaps the loop's function while it times and empties `_bare`: a run takes `_bare`'s, else asks here."""
        if self.chooser is not None or self._c is None:
            return None
        c = self._c[staged, self.only_form]
        found = self._bare.get(staged)
        if found is None or found.c is not c:
            run, functions, set_handle, nbind, memories, addresses, moving, count, objects, nargs, args, failed = c
            found = self._bare[staged] = BareLoop(c, run, (functions, set_handle, self._stream, nbind, memories,
                                                          addresses, count, objects, nargs, args, ctypes.byref(failed)),
                                                  addresses, tuple(moving), failed,
                                                  self._variants[staged, self.only_form][2], self.only_form == SERIAL)
        return found


@dataclass(frozen=True)
class BareLoop:
    """Segment.bare_loop's call: `run(*args)` runs every layer on the addresses in `addresses` (its bindings';
    `moving`: [(binding, ("entry" | "exit", position))] those a run points), `failed` the failing layer's index in
    `names` after a nonzero status (raise_failed)."""

    c: tuple  # the segment's compiled loop it was made from (Segment._c_loop)
    run: Any
    args: tuple
    addresses: Any  # ctypes array of the bindings' addresses
    moving: tuple[tuple[int, tuple[str, int]], ...]
    failed: Any  # ctypes.c_int
    names: list[str]
    serial: bool = False  # the serial form: run with OpenMP's count at 1 (onednn.one_openmp_thread), as _run_form

    def raise_failed(self, status: int) -> None:
        where = self.names[self.failed.value] if self.failed.value >= 0 else "binding an input or output"
        onednn._check(status, f"layer {where!r} of a native segment")


@dataclass
class _AtSizes:
    """The members of a segment at other entry sizes: their NativeSteps, and slot -> (size, strides, dtype)
    of each value they write (_forms)."""

    natives: list[NativeStep]
    forms: dict[int, tuple]


def _entry_key(values: tuple, dtypes: list[torch.dtype]) -> tuple | None:
    """The sizes of a segment's entries, as its views are keyed; None when one is not a tensor of its entry's dtype."""
    key = []
    for v, dtype in zip(values, dtypes):
        if not isinstance(v, torch.Tensor) or v.dtype != dtype:
            return None
        key.append(tuple(v.shape))
    return tuple(key)
