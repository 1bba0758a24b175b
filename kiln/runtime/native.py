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
every run of two or more such steps whose shapes chain (kiln/runtime/program.py) into one
step: its inputs are the values the run reads from outside, its outputs the values read after
it. Those are bound per call (an entry's address; an exit gets a fresh tensor), so nothing a
caller holds is ever overwritten by a later run. A residual whose value dies at a convolution
and lives in the arena is accumulated in place (the primitive's sum post-op); a Reshape that
moves no byte is an alias of its input's memory.

Inputs of another size than the one the segment was planned for (a profile's other shapes) run as a
view over a template segment (_Resized): the template's arena and memory plan, each layer at that
size from its NativeStep (`at`) — kiln's own kernels only replan, oneDNN primitives bind anew to the
template's addresses. A size the template's arena cannot hold grows the template to the largest sizes
seen along each entry axis, so a stream of shapes binds a few templates, not one segment per shape.
A view's plans of kiln's own kernels are its template's with the fields that follow the sizes written
over (_PlanRewrite: no per-member Python objects). Views are kept (VIEWS per segment, least recently used
out); a segment that reorders NCHW images at its head binds a segment of its own per size (RESIZED); a
size a layer cannot bind runs through the layers' own launch functions, as without segments.
"""

from __future__ import annotations

import ctypes
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from kiln.kernels.cpu import hugepages, native_loop, onednn
from kiln.kernels.cpu.form_choice import PARALLEL, SERIAL, FormChooser
from kiln.plan.memory import Interval, place
from kiln.runtime.step import BoundStep, call_step
from kiln.tactics.tactic import NativeStep, PrimitiveRule, SizedPrimitive, native_strides, row_major_strides

_CL = torch.channels_last
RESIZED = 8  # segments bound for other input sizes than the tuned one, per segment (profile shapes)
VIEWS = 256  # sizes kept as views over a template's memory (_Resized: plans only), per segment


_NUMPY = {torch.float32: np.dtype(np.float32), torch.int64: np.dtype(np.int64), torch.int32: np.dtype(np.int32),
          torch.uint8: np.dtype(np.uint8), torch.bool: np.dtype(np.bool_)}


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
    return size, torch.float32, "nhwc" if len(size) == 4 and not (role == "src" and native.rows_input) else "rows"


def _same_order(size: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether strides a and b lay a value of this size out in the same memory order (dims of size 1 address
    nothing: [N, C, 1, 1] is the same NHWC and row-major)."""
    return all(x == y for d, x, y in zip(size, a, b) if d != 1)


def _layout_strides(size: tuple[int, ...], layout: str) -> tuple[int, ...]:
    return native_strides(size) if layout == "nhwc" else row_major_strides(size)


class Segment:
    """Consecutive layers of a program run as bound primitives; called as one step."""

    def __init__(self, members: list[BoundStep], read_after: set[int], constants: dict[int, Any] | None = None,
                 natives: list[NativeStep] | None = None):
        """`natives`: the members' NativeSteps at other input sizes than their tuned ones (see resized)."""
        self.members = members
        self.read_after = read_after
        self.constants = constants or {}  # slot -> weight: what the layers' own launches read besides activations
        self.resized: OrderedDict[tuple, Segment | None] = OrderedDict()  # entry sizes -> that size's segment
        self.view_evictions = 0  # sizes let go from `resized` so far (what holds on to them notices: direct_run.py)
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
        self.buffers = [hugepages.empty(peak // 4)] if peak else []
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
        with onednn.shared_memories():  # one memory object per arena place and size (a view's too: _bind_sizes)
            bound = [None if native.alias else _bind_member(m, native, accumulate[k], address)
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
        self._lock = threading.Lock()
        self._stage: dict[int, torch.Tensor] = {}
        # NCHW images (4-D entries as users hand them) are laid out NHWC by a reorder at the head
        # of the loop, into a buffer of the segment's: no allocation, both threads.
        self._staged = []  # (entry index, Bound of its reorder, its buffer)
        for k, size in enumerate(self.entry_sizes):
            if self.entry_layouts[k] == "nhwc":
                buffer = hugepages.empty(math.prod(size)).as_strided(size, native_strides(size))
                reorder = onednn.Reorder(size, onednn.TAG_ABCD, onednn.TAG_ACDB, serial=torch.get_num_threads() > 1)
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
        staged_names = [f"reorder of input {k}" for k, _, _ in self._staged] + self._names
        # the forms a run may take (kiln/kernels/cpu/form_choice.py): small layers on OpenMP's count, and, where
        # some have one (onednn_primitives.thread_forms), on one thread
        forms = {PARALLEL: self._calls}
        serial = serial_calls(self.bound, member_calls)
        if serial is not None:
            forms[SERIAL] = serial
        self.chooser = FormChooser() if serial is not None else None
        self._variants = {}  # (staged, form) -> (bindings, calls, names)
        for form, calls in forms.items():
            self._variants[False, form] = (plain, calls, self._names)
            if self._staged:  # only a segment reading NCHW images has the reordering variant
                self._variants[True, form] = (staged, reorders[form] + calls, staged_names)
        # the loop in C when it could be built (kiln/kernels/cpu/native_loop.py): one call per run
        loop = native_loop.load()
        self._set_handle = lib.lib.dnnl_memory_set_data_handle
        self._c = None
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
        # Other sizes as views over this segment's memory (_Resized)
        self._views = self._c is not None and not self._staged
        # the segment whose memory other sizes' views use, once grown past this one (None: this one; never
        # `self`, which made every segment a reference cycle: a dead engine's arena, packed weights and
        # oneDNN primitives then waited for the garbage collector)
        self._grown: Segment | None = None
        self._rewrite: _PlanRewrite | None = None  # made at the first view over this segment

    def _c_loop(self, loop, bindings: list, calls: list) -> tuple:
        nbind = len(bindings)
        addresses = (ctypes.c_void_p * max(nbind, 1))()
        for i, (_, src) in enumerate(bindings):
            if isinstance(src, int):  # fixed: a staged entry's buffer
                addresses[i] = src
        functions, objects, nargs, args = native_loop.call_arrays(calls)
        return (loop.kiln_run_segment, functions, ctypes.cast(self._set_handle, ctypes.c_void_p), nbind,
                (ctypes.c_void_p * max(nbind, 1))(*[m for m, _ in bindings]), addresses,
                [(i, src) for i, (_, src) in enumerate(bindings) if not isinstance(src, int)],
                len(calls), objects, nargs, args, ctypes.c_int(-1))

    def _run(self, entry_addresses: list[int], exit_addresses: list[int], staged: bool) -> None:
        """Point the run's inputs and outputs, run every layer in the form the chooser picks, timed for it
        (the caller holds the lock)."""
        sources = {"entry": entry_addresses, "exit": exit_addresses}
        chooser = self.chooser
        if chooser is None:
            self._run_form(sources, staged, PARALLEL)
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
            with onednn.shared_memories():  # the layers' memory objects at one arena place and size: one each
                segment = self._rewritten(key) if self._views else None
                if segment is None:
                    at = self._natives_at(key)
                    segment = self._view(key, at) if self._views else None
                if segment is None:
                    segment = Segment(self.members, self.read_after, self.constants, at.natives)
                    if segment.entries != self.entries or segment.exits != self.exits:
                        raise ValueError("the segment's entries or exits changed")
        except Exception:  # noqa: BLE001  a size the layers cannot bind: they run one by one, as before
            segment = None
        self.resized[key] = segment
        while len(self.resized) > (VIEWS if self._views else RESIZED):
            self.resized.popitem(last=False)
            self.view_evictions += 1
        return segment

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
                candidate = Segment(self.members, self.read_after, self.constants, at.natives)
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

    def __call__(self, ctx, *values):
        key = _entry_key(values, self.entry_dtypes)  # the entries' sizes, in one pass (a repeated call's whole check)
        if key is not None:
            if key == self._planned_key:
                return self._run_bound(values)
            with self._resize_lock:  # contexts of one engine share its segments
                other = self._bind_sizes(key)
            if other is not None:
                return other._run_bound(values)
        out = self.fallback(list(values))
        return tuple(out) if len(out) != 1 else out[0]

    def _run_bound(self, values: tuple) -> Any:
        """One run on entries of the planned sizes and dtypes: fresh exit tensors."""
        exits = [torch.empty_strided(size, strides, dtype=dtype) for size, strides, dtype in self.exit_shapes]
        # NCHW images go through the reorders at the head of the loop; other entries in another
        # layout are copied into a buffer of the segment's (no fresh pages per run)
        staged = bool(self._staged) and all(not self._laid_out(k, values[k]) and values[k].is_contiguous()
                                            for k, _, _ in self._staged)
        with self._lock:
            entries = [v if (staged and self.entry_layouts[k] == "nhwc") or self._laid_out(k, v)
                       else self._staging(k, v) for k, v in enumerate(values)]
            self._run([v.data_ptr() for v in entries], [v.data_ptr() for v in exits], staged)
        return tuple(exits) if len(exits) != 1 else exits[0]

    def run_at(self, entry_addresses: list[int], exit_addresses: list[int]) -> None:
        """One run on entries and exits at these addresses, laid out as planned (not a staged segment's NCHW
        images): kiln/runtime/direct_run.py's."""
        with self._lock:
            self._run(entry_addresses, exit_addresses, False)

    def run_numpy(self, arrays: list[np.ndarray]) -> list[np.ndarray] | None:
        """The whole program as this one segment, on C-contiguous float32 numpy arrays of the
        planned sizes (NCHW images: the staged loop); numpy outputs. None: not such inputs."""
        for a, size, dtype in zip(arrays, self.entry_sizes, self.entry_dtypes):
            if a.dtype != _NUMPY.get(dtype) or a.shape != size or not a.flags.c_contiguous:
                return None
        exits = []
        for size, strides, dtype in self.exit_shapes:
            if len(size) == 4 and strides != row_major_strides(size):
                n, c, h, w = size
                exits.append(np.empty((n, h, w, c), np.float32).transpose(0, 3, 1, 2))  # NHWC memory, NCHW shape
            else:
                exits.append(np.empty(size, _NUMPY[dtype]))
        with self._lock:
            self._run([a.ctypes.data for a in arrays], [e.ctypes.data for e in exits], bool(self._staged))
        return exits


@dataclass
class _AtSizes:
    """The members of a segment at other entry sizes: their NativeSteps, and slot -> (size, strides, dtype)
    of each value they write (_forms)."""

    natives: list[NativeStep]
    forms: dict[int, tuple]


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


def _c_loop_over(c: tuple, calls: list, template_calls: list) -> tuple:
    """A segment's compiled-loop arrays (`c`: Segment._c_loop's, for `template_calls`) with other calls on the
    same memory objects: its bindings kept, an addresses array of its own (written per run, under the template's
    lock). Calls of the template's functions without arguments (replanned kernels: only the plan is new) share
    the template's functions, nargs and args arrays (the loop only reads them); calls that differ (members bound
    anew) are written into copies of them."""
    run, functions, set_handle, nbind, memories, _addresses, moving, _count, _objects, nargs, args, _ = c
    if len(calls) != len(template_calls):
        functions, objects, nargs, args = native_loop.call_arrays(calls)
    else:
        objects = (ctypes.c_void_p * max(len(calls), 1))(*[o for _, o, _, _ in calls])
        differ = [i for i, ((f, _, n, a), t) in enumerate(zip(calls, template_calls))
                  if f != t[0] or n != t[2] or a != t[3]]
        if differ:  # members bound anew (a oneDNN primitive's arguments): the template's arrays copied, those set
            functions, nargs, args = (type(array).from_buffer_copy(array) for array in (functions, nargs, args))
            execute = native_loop.execute_function()
            for i in differ:
                f, _, nargs[i], args[i] = calls[i]
                functions[i] = f or execute
    return (run, functions, set_handle, nbind, memories, (ctypes.c_void_p * max(nbind, 1))(), moving, len(calls),
            objects, nargs, args, ctypes.c_int(-1))


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


def _entry_key(values: tuple, dtypes: list[torch.dtype]) -> tuple | None:
    """The sizes of a segment's entries, as its views are keyed; None when one is not a tensor of its entry's dtype."""
    key = []
    for v, dtype in zip(values, dtypes):
        if not isinstance(v, torch.Tensor) or v.dtype != dtype:
            return None
        key.append(tuple(v.shape))
    return tuple(key)


def _form(native: NativeStep) -> tuple:
    """What of a member's NativeStep shapes a segment's structure, whatever its sizes."""
    return (native.alias, native.accumulate, native.residual_input, None if native.reads is None else sorted(native.reads),
            len(native.more_outputs), native.channels_last, native.rows_input)


def _bind_member(m: BoundStep, native: NativeStep, accumulate: bool, address: dict[int, int]
                 ) -> tuple[Any, list[tuple[int, Any]]]:
    """A member's call bound to the planned addresses of what it reads and writes (0: an entry or
    exit, pointed at per run): (Bound, [(slot, role)])."""
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
    b = prim.bind(address.get(x, 0), address.get(out, 0), address.get(residual, 0) if residual is not None else None)
    return b, [(x, "src"), (out, "dst")] + ([(residual, "residual")] if residual is not None else [])


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


def _hoistable(pending: list[BoundStep], produced: dict[int, Any], read: set[int]) -> bool:
    """Steps that are not native, met between members of a run, may run before it: none reads a value
    the run writes, and none frees a value the run reads (its last use would move before theirs)."""
    for step in pending:
        if any(s in produced for s in step.inputs if s >= 0) or any(s in read for s in step.free):
            return False
    return True


def segments(steps: list[BoundStep], output_slots: list[int], constants: dict[int, Any] | None = None,
             not_members: set[int] | None = None) -> tuple[list[BoundStep], list[Segment]]:
    """steps with each run of >= 2 native steps replaced by one Segment step. Steps that are not native
    but met between a run's members (an exported attention mask's preparation, shape arithmetic) run
    before the segment when they do not depend on it. `not_members`: indices of steps never made
    members (shape-only steps, which the program computes once per input-shape signature)."""
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
        if native.alias:  # only right after a member of the run, over a value of it that dies here
            x = step.inputs[0]
            if (members and not pending and members[-1] == i - 1 and steps[i - 1].outputs[0] == x
                    and last_read.get(x) == i and x not in outputs and _joins(step, produced, strides, native)):
                members.append(i)
                steps[i] = step
                produced[step.outputs[0]] = tuple(native.output_size)  # an alias writes one value
                # (an alias's 4-D output is one whose order row-major and NHWC is the same)
                strides[step.outputs[0]] = row_major_strides(tuple(native.output_size))
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
    start = {run[0]: (run, before) for run, before in runs if len(run) >= 2}
    if not start:
        return steps, []
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
        try:
            read_by = {s for m in members_ for s in m.inputs}
            segment = Segment(members_, read_after, {s: v for s, v in (constants or {}).items() if s in read_by})
        except Exception:  # noqa: BLE001  a run that cannot be planned runs layer by layer, as before
            result.append(step)
            continue
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


def serial_calls(bound: list[Any], member_calls: list[list]) -> list | None:
    """The calls of bound members (`member_calls`: each one's calls()) with each small layer in its serial form
    (a Bound's serial_calls), the others as they are; None when no member has a serial form."""
    calls, any_serial = [], False
    for b, made in zip(bound, member_calls):
        serial = b.serial_calls() if hasattr(b, "serial_calls") else None
        any_serial |= serial is not None
        calls += serial if serial is not None else made
    return calls if any_serial else None


def _replanned(bound: Any, primitive: Any) -> Any | None:
    """`bound` (a template's call of kiln's own kernel) replanned for `primitive`, or None when the member is
    another kind of call at these sizes (a oneDNN layer: its tuned row count on oneDNN, the others on
    kiln's GEMM, kiln/tactics/cpu/onednn.py): then it is bound anew."""
    try:
        return bound.replan(primitive)
    except ValueError:
        return None


class _PlanRewrite:
    """A segment's views at other input sizes with the plans of kiln's own kernels written by arithmetic.

    A member whose NativeStep has `plan_at` (kiln's GEMM, LayerNorm, attention, broadcasts and gathers by rules of
    their own, kiln's other kernels by their kernel's integer fields) runs at new sizes a copy of its template call's
    plan with the fields that follow the sizes (row counts, batch, sequence, strides) written over: one buffer holds
    all of a view's such plans, written by two numpy stores, and no NativeStep, plan or Replanned object is made per
    member; rules of one key (a layer shape) are worked out once a view. Binding BERT-base's 91 members member by
    member cost 2-3 ms of Python and kept ~640 objects a new shape (bench/results/first-calls-2026-12-03b.md);
    rewritten, ~0.9-1.6 ms and 117 (bench/results/first-call-2026-12-03c.md). A oneDNN inner product runs its layer
    shape's primitive at the new rows on its own weight (NativeStep.primitive_at, worked out once per layer shape a
    view): all of a view's such members' execution arguments are one array, each role a memory object at its arena
    place (one per descriptor and place), no Bound, NativeStep or InnerProduct per member (BERT-base's 24: ~0.35 ->
    ~0.05 ms hot, bench/results/bind-base-cpu-2026-12-05.md). The other members (kernels whose plans hold floats,
    squeeze-excite, a oneDNN layer at rows another kernel takes) are bound as _Resized.bound_at binds them.

    Exact: a rule's fields are computed by the functions the kernels' own constructors use, a member's other fields
    do not follow the sizes (its weights, epsilon, memory objects), and a member whose rule does not give back its
    template plan's bytes at the template's sizes is bound the other way (tests/unit/test_native_binding.py compares
    every rewritten plan with the replanned one, byte for byte, at fresh shapes)."""

    def __init__(self, template: Segment):
        """The rewrite of `template`'s plans. It does not hold the template (the template holds it: a reference back
        would be a cycle); view() is given it."""
        call_of = {k: i for i, k in enumerate(template._bound_members)}
        image = bytearray()
        # per member: (its rule or None, at, reads, x: as Segment._resizers, the residual's slot or None,
        # [(output j, slot)] of the values it writes, its plan's function and offset in a view's buffer or None,
        # what its rule's result follows besides the sizes (its key, the step inputs it reads), the slots it reads,
        # a oneDNN layer whose arguments a view writes (_ArgumentsRewrite) or None)
        self._members: list[tuple] = []
        words: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])  # int64 word, value; int32 ...
        values = 0  # values a view's rules give, in member order
        sizes = dict(zip(template.entries, template.entry_sizes))
        for k, (m, native, (at, reads, x)) in enumerate(zip(template.members, template._natives, template._resizers)):
            arg = {i: sizes[slot] for i, slot in reads} if reads is not None else sizes[x]
            outputs = [(0, m.outputs[0])] + [(j, m.outputs[j]) for j in range(1, 1 + len(native.more_outputs))
                                             if j < len(m.outputs) and m.outputs[j] >= 0]
            for slot, _role, size, _strides, _dtype in writes_of(m, native):
                sizes[slot] = size
            residual = m.inputs[native.residual_input] if native.residual_input is not None else None
            call = call_of.get(k)
            layout = _plan_layout(native, template.bound[call], arg) if call is not None else None
            if layout is None:
                bind = None if call is None or template._accumulate[k] else \
                    _arguments_layout(m, native, template.bound[call], arg, template._address)
                self._members.append((None, at, reads, x, residual, outputs, None, None, (), bind))
                continue
            function, plan_bytes, fields = layout
            for offset, width in fields:
                words[0 if width == 8 else 2].append((len(image) + offset) // width)
                words[1 if width == 8 else 3].append(values)
                values += 1
            read = tuple(slot for _, slot in reads) if reads is not None else (x,)
            follows = (native.plan_at.key, tuple(i for i, _ in reads) if reads is not None else None)
            placed = (function, len(image))
            self._members.append((native.plan_at, at, reads, x, residual, outputs, placed, follows, read, None))
            image += plan_bytes + bytes(-len(plan_bytes) % 16)
        self._image = np.frombuffer(bytes(image), np.int64)  # 16-byte multiples
        self._values = values
        self._words = [np.array(w, np.intp) for w in words]
        forms = _forms(template.members, template._natives)
        self._arena = [(s, forms[s][2].itemsize, template._capacity[g]) for s, g in template._arena_slots]
        # each exit's dtype and strides rule (a NativeStep's output_strides: NHWC for a 4-D output of oneDNN's
        # layers or a channels-last kernel, row-major otherwise and for outputs past the first)
        nhwc = {m.outputs[0]: native.reads is None or native.channels_last
                for m, native in zip(template.members, template._natives)}
        self._exits = [(s, forms[s][2], nhwc.get(s, False)) for s in template.exits]

    def view(self, template: Segment, key: tuple) -> _Resized | None:
        """`template`'s view (the segment this rewrite was made for) at entry sizes `key`, or None: a rule or a
        layer refuses them, the template's arena cannot hold them (Segment._view then grows it), or an entry's rank
        differs from the template's."""
        if any(len(k) != len(t) for k, t in zip(key, template.entry_sizes)):
            return None
        sizes = dict(zip(template.entries, key))
        values: list[int] = []  # what the rules write, in member order
        natives: dict[int, NativeStep] = {}  # the members without a rule, at the new sizes
        bound: dict[int, SizedPrimitive] = {}  # the oneDNN members whose arguments are rewritten (no NativeStep made)
        worked: dict[tuple, tuple[tuple, list[int]]] = {}  # a rule's key and sizes -> (output sizes, values)
        primitives: dict[tuple, SizedPrimitive | None] = {}  # a primitive rule's key and size -> its answer
        try:
            for k, (rule, at, reads, x, residual, outputs, _placed, follows, read, bind) in enumerate(self._members):
                if rule is None:
                    sized = None
                    if bind is not None:
                        at_size = (bind.rule.key, sizes[x])
                        sized = primitives[at_size] if at_size in primitives else \
                            primitives.setdefault(at_size, bind.rule(sizes[x]))
                    if sized is not None:  # the layer's form is its template's (an inner product, as bound there)
                        bound[k] = sized
                        written = (sized.output_size,)
                    else:
                        native = natives[k] = at({i: sizes[slot] for i, slot in reads} if reads is not None
                                                 else sizes[x])
                        if _form(native) != template._structure[k]:
                            return None
                        written = (tuple(native.output_size), *(tuple(size) for size, _ in native.more_outputs))
                else:
                    found = worked.get(at_sizes := (follows, tuple(map(sizes.__getitem__, read))))
                    if found is None:  # the first layer of its shape at these sizes
                        sized = rule({i: sizes[slot] for i, slot in reads} if reads is not None else sizes[x])
                        flat: list[int] = []
                        for value in sized.fields.values():
                            if type(value) is tuple:
                                flat.extend(value)
                            else:
                                flat.append(value)
                        found = worked[at_sizes] = (sized.output_sizes, flat)
                    written = found[0]
                    values += found[1]
                if residual is not None and sizes[residual] != written[0]:
                    return None  # as _natives_at: the layers run one by one
                for j, slot in outputs:
                    sizes[slot] = written[j]
        except ValueError:
            return None
        if len(values) != self._values:
            return None
        for s, itemsize, capacity in self._arena:
            if math.prod(sizes[s]) * itemsize > capacity:
                return None
        buffer = self._image.copy()  # every rewritten plan, in one array the collector does not track
        if values:
            flat = np.array(values, np.int64)
            where64, value64, where32, value32 = self._words
            buffer[where64] = flat[value64]
            buffer.view(np.int32)[where32] = flat[value32]
        base = buffer.ctypes.data
        owners, member_calls, owned, anew = [], [], [buffer], set()
        arguments = self._arguments_at(bound, owned) if bound else {}
        for b, k in zip(template.bound, template._bound_members):
            placed = self._members[k][6]
            if placed is not None:  # the copy points at the template call's memory objects
                owners.append(b)
                member_calls.append([(placed[0], base + placed[1], 0, 0)])
                continue
            if k in bound:  # its own arguments: memory objects of the arena's places, none a run points elsewhere
                primitive, nargs, args = arguments[k]
                owners.append(None)
                member_calls.append([(None, primitive, nargs, args)])
                continue
            owner, bound_anew = _rebound(template, b, k, natives[k])
            if bound_anew:
                anew.add(len(owners))
            owners.append(owner)
            owned.append(owner)
            member_calls.append(owner.calls())
        exit_shapes = [(sizes[s], native_strides(sizes[s]) if nhwc else row_major_strides(sizes[s]), dtype)
                       for s, dtype, nhwc in self._exits]
        return _Resized(template, owners, member_calls, anew, exit_shapes,
                        ([tuple(size) for size in key], template.entry_dtypes, template.entry_layouts), owned)

    def _arguments_at(self, bound: dict[int, SizedPrimitive], owned: list[Any]) -> dict[int, tuple[int, int, int]]:
        """member -> (primitive, nargs, args address) of each oneDNN member in `bound` (member -> its primitive at a
        view's sizes): every member's execution arguments in one array, each role a memory object of its descriptor
        there at its arena address (one per descriptor and address); `owned` gets what they point at
        (_HeldArguments)."""
        ids: list[int] = []  # execution arguments, member after member ...
        memories: list[int] = []  # ... and their memory objects
        held: dict[tuple[int, int], Any] = {}
        kept: list[Any] = []
        starts: dict[int, tuple[int, int, int]] = {}  # member -> (primitive, its first argument, nargs)
        for k, sized in bound.items():
            arguments, bind = sized.arguments, self._members[k][9]
            addresses = bind.addresses
            starts[k] = (arguments.primitive, len(ids), len(arguments.roles) + len(bind.fixed_ids))
            for role, argument, md in arguments.roles:
                memory = held.get((md, addresses[role]))
                if memory is None:
                    memory = held[md, addresses[role]] = onednn.shared_memory(md, addresses[role])
                ids.append(argument)
                memories.append(memory.value.value)
            ids += bind.fixed_ids
            memories += bind.fixed_memories
            kept.append(arguments.keep)
        array = np.empty(len(ids), _EXEC_ARG)  # dnnl_exec_arg_t's, in one array the collector does not track
        array["arg"], array["memory"] = ids, memories
        owned.append(_HeldArguments(array, list(held.values()), kept))
        base = array.ctypes.data
        return {k: (primitive, nargs, base + first * _EXEC_ARG.itemsize) for k, (primitive, first, nargs) in
                starts.items()}


_EXEC_ARG = np.dtype([("arg", np.int32), ("memory", np.uintp)], align=True)  # dnnl_exec_arg_t, as C lays it out


@dataclass
class _HeldArguments:
    """What a view's rewritten oneDNN calls point at: their execution arguments, the memory objects those name, and
    what their primitives need alive (RoleArguments.keep)."""

    array: np.ndarray
    memories: list[Any]
    kept: list[Any]


@dataclass(frozen=True, slots=True)
class _ArgumentsRewrite:
    """A oneDNN member whose execution arguments a view writes (NativeStep.primitive_at): its rule, the arena
    address of each role it binds, and its own arguments after them (the rule's `fixed`: ids, memory objects)."""

    rule: PrimitiveRule
    addresses: dict[str, int]
    fixed_ids: tuple[int, ...]
    fixed_memories: tuple[int, ...]


def _arguments_layout(m: BoundStep, native: NativeStep, bound: Any, arg: Any, address: dict[int, int]
                      ) -> _ArgumentsRewrite | None:
    """How a view writes a oneDNN member's arguments, or None: no primitive rule, a role an entry or exit (a run
    points it elsewhere), a template call in a serial form (a view would lose it), or a template call of oneDNN
    (`bound`) that the rule does not give back at its own sizes (`arg`), arguments and all."""
    if native.primitive_at is None or getattr(bound, "serial_primitive", None) is not None:
        return None
    slots = {"src": m.inputs[0], "dst": m.outputs[0]}
    if native.residual_input is not None:
        slots["residual"] = m.inputs[native.residual_input]
    addresses = {role: address.get(slot, 0) for role, slot in slots.items()}
    if not all(addresses.values()):
        return None
    if type(bound) is onednn.Bound:  # else the template runs this layer on another kernel at its sizes
        sized = native.primitive_at(arg)
        got = None if sized is None else sized.arguments
        given = [(a.arg, a.memory) for a in bound.args]
        if got is None or got.primitive != bound.primitive_handle or got.roles != bound.roles \
                or given[len(got.roles):] != list(native.primitive_at.fixed):
            return None
    fixed = native.primitive_at.fixed
    return _ArgumentsRewrite(native.primitive_at, addresses, tuple(argument for argument, _ in fixed),
                             tuple(memory for _, memory in fixed))


def _plan_layout(native: NativeStep, bound: Any, arg: Any) -> tuple[int, bytes, list[tuple[int, int]]] | None:
    """(function, plan bytes, [(byte offset, width)] of each value its rule writes, in order) of a member whose plan
    a view rewrites, or None: no rule, not one plan of kiln's own, a field that is not an integer, or a rule that
    does not give back the template call's plan at its own sizes (`arg`)."""
    if native.plan_at is None or not hasattr(bound, "plan") or hasattr(bound, "serial_calls") \
            or len(bound.calls()) != 1:
        return None
    plan = bound.plan
    original = ctypes.string_at(ctypes.addressof(plan), ctypes.sizeof(plan))
    try:
        sized = native.plan_at(arg)
    except ValueError:
        return None
    kinds = dict(type(plan)._fields_)
    fields: list[tuple[int, int]] = []
    rewritten = bytearray(original)
    for name, value in sized.fields.items():
        kind = kinds.get(name)
        if kind is None:
            return None
        held = native_loop.integer_field(kind)  # an array of arrays: a broadcast's strides
        items = value if isinstance(value, tuple) else (value,)
        if held is None or len(items) != held[0]:
            return None
        width, start = held[1], getattr(type(plan), name).offset
        for j, item in enumerate(items):
            offset = start + j * width
            fields.append((offset, width))
            rewritten[offset:offset + width] = int(item).to_bytes(width, "little", signed=True)
    if bytes(rewritten) != original:
        return None
    return bound.calls()[0][0], original, fields


def _rebound(template: Segment, bound: Any, k: int, native: NativeStep) -> tuple[Any, bool]:
    """Member k's call at `native`'s sizes over the template's memory: its template call (`bound`) replanned, else
    bound anew with memory objects of its own (a oneDNN primitive, made for its row count); True when anew."""
    replanned = _replanned(bound, native.primitive(template._accumulate[k])) if hasattr(bound, "replan") else None
    if replanned is not None:
        return replanned, False
    return _bind_member(template.members[k], native, template._accumulate[k], template._address)[0], True


class _Resized:
    """A segment at other input sizes over its template's memory: the template's arena, each member
    at these sizes bound to the template's planned addresses. kiln's own kernels replan on the
    template's memory objects (only their plan changes: tens of microseconds a layer, or none where
    _PlanRewrite writes the plans of a view at once); a oneDNN primitive binds anew at these sizes.
    Building one skips the memory plan, the arena's pages and the structure's analysis that a Segment
    of its own does (milliseconds for a transformer block). The template's lock serializes runs: they
    share its arena and memory objects."""

    def __init__(self, template: Segment, owners: list[Any], member_calls: list[list], anew: set[int],
                 exit_shapes: list[tuple], entry_forms: tuple[list, list, list], owned: list[Any]):
        """`owners`: the memory objects of each bound member's calls (a Bound, a Replanned, or the template's own
        call, whose plan a rewritten copy runs); `member_calls`: their calls; `anew`: the owners (indices) with memory
        objects of their own, which a run binds where they are entries or exits; `owned`: what the calls point at
        that the view keeps alive."""
        self.template = template
        self.entries, self.exits = template.entries, template.exits
        self._bound, self._owned = owners, owned  # each bound member's memory objects; what the view keeps alive
        calls = [c for made in member_calls for c in made]
        self.exit_shapes = exit_shapes
        self.entry_sizes, self.entry_dtypes, self.entry_layouts = entry_forms
        forms = {PARALLEL: calls}
        serial = serial_calls(owners, member_calls)
        if serial is not None:
            forms[SERIAL] = serial
        self.chooser = FormChooser() if serial is not None else None  # this size's own times
        counts = [len(made) for made in member_calls]
        self._names = template._names if counts == template._call_counts else \
            [template.members[k].ctx.name for n, k in zip(counts, template._bound_members) for _ in range(n)]
        if not anew & template._per_call_bound and len(calls) == len(template._calls):
            # what a run points at its entries and exits are the template's memory objects (members bound anew,
            # with memory objects of their own, read and write only the arena): its bindings hold, and only the
            # calls' arrays are new (the common case: a transformer's interior GEMMs on oneDNN)
            self._c = {form: _c_loop_over(template._c[False, PARALLEL], c, template._calls) for form, c in forms.items()}
            return
        bindings = []
        for k, s in enumerate(self.entries):
            bindings += [(owners[i].memory(role), ("entry", k)) for i, role in template.per_call[s]]
        for j, g in enumerate(template.exit_groups):
            bindings += [(owners[i].memory(role), ("exit", j)) for i, role in template.per_call.get(g, ())]
        loop = native_loop.load()
        self._c = {form: template._c_loop(loop, bindings, c) for form, c in forms.items()}

    @classmethod
    def bound_at(cls, template: Segment, natives: list[NativeStep], forms: dict[int, tuple] | None = None
                 ) -> _Resized:
        """The view of every member at `natives`' sizes, each replanned or bound anew. `forms`:
        _forms(template.members, natives), when the caller has them."""
        owners = []
        anew = set()  # members bound anew have memory objects of their own: a run binds those it points at
        for b, k in zip(template.bound, template._bound_members):
            owner, bound_anew = _rebound(template, b, k, natives[k])
            if bound_anew:
                anew.add(len(owners))
            owners.append(owner)
        forms = forms if forms is not None else _forms(template.members, natives)
        return cls(template, owners, [b.calls() for b in owners], anew, [forms[s] for s in template.exits],
                   _entry_forms(template.entries, template._entry_readers, natives), owners)

    def _run_bound(self, values: tuple) -> Any:
        exits = [torch.empty_strided(size, strides, dtype=dtype) for size, strides, dtype in self.exit_shapes]
        entries = []
        for v, layout in zip(values, self.entry_layouts):
            laid_out = v.is_contiguous(memory_format=_CL) if layout == "nhwc" else v.is_contiguous()
            entries.append(v if laid_out else (v.contiguous(memory_format=_CL) if layout == "nhwc" else v.contiguous()))
        self.run_at([v.data_ptr() for v in entries], [v.data_ptr() for v in exits])
        return tuple(exits) if len(exits) != 1 else exits[0]

    def run_at(self, entry_addresses: list[int], exit_addresses: list[int]) -> None:
        """One run on entries and exits at these addresses, each laid out as this view's entry_layouts and
        exit_shapes say (the template's lock held: views share its arena and memory objects)."""
        template = self.template
        sources = {"entry": entry_addresses, "exit": exit_addresses}
        with template._lock:
            chooser = self.chooser
            form = chooser.choose() if chooser is not None else PARALLEL
            start = time.perf_counter()
            if form == SERIAL:  # as Segment._run_form: no parallel region in the serial form
                with onednn.one_openmp_thread():
                    _run_loop(self._c[form], template._stream, sources, self._names)
            else:
                _run_loop(self._c[form], template._stream, sources, self._names)
            if chooser is not None:
                chooser.record(form, time.perf_counter() - start)
