"""A native segment at other input sizes, as a view over a template segment's memory (kiln/runtime/native.py picks
when): the template's arena and memory plan, each member at the new sizes bound to the template's planned
addresses. kiln's own kernels replan on the template's memory objects, or have their plans written by arithmetic
(_PlanRewrite); a oneDNN primitive binds anew. `template` is that Segment: native.py makes views and imports this
module, which does not import it back.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import sys
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kiln.kernels.cpu import native_loop, onednn, onednn_ahead
from kiln.kernels.cpu.form_choice import PARALLEL, SERIAL, FormChooser
from kiln.kernels.cpu.plan_member import PlanMember
from kiln.runtime.native_members import _bind_member, _entry_forms, _form, _forms, _run_loop, serial_calls, writes_of
from kiln.runtime.view_arguments import ViewArguments, arguments_layout
from kiln.runtime.view_pack import PackedPlans
from kiln.runtime.view_mirrors import _Mirror, _MirrorRun, _arena_checks, _mirror_runs, _mirrors
from kiln.runtime.view_trace import ViewTrace
from kiln.tactics.traced_rules import TRACES, TracedRule, untraced
from kiln.tactics.tactic import NativeStep, SizedPrimitive, native_strides, row_major_strides


PACKED = True  # a view's plans and calls written by one struct pack where it can (view_pack.py; False: numpy's stores)
PENDING_TRACES = 8  # keys a segment's view leaves to the background thread's traces at once (_learn_later)
_LATER = itertools.count()  # the deferred traces' job keys (each its own: ids are reused)


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
    all of a view's such plans, written by one numpy store (_int32_stores), and no NativeStep, plan or Replanned
    object is made per member; rules of one key (a layer shape) are worked out once a view. Binding BERT-base's 91
    members member by member cost 2-3 ms of Python and kept ~640 objects a new shape
    (bench/results/first-calls-2026-12-03b.md);
    rewritten, ~0.9-1.6 ms and 117 (bench/results/first-call-2026-12-03c.md). A oneDNN inner product runs its layer
    shape's primitive at the new rows on its own weight (NativeStep.primitive_at, worked out once per layer shape a
    view): all of a view's such members' execution arguments are one array, each role a memory object at its arena
    place (one per descriptor and place), no Bound, NativeStep or InnerProduct per member (BERT-base's 24: ~0.35 ->
    ~0.05 ms hot, bench/results/bind-base-cpu-2026-12-05.md). Where every member is one of those two kinds, a view's
    loop arrays are the template's numpy images with those calls stored in (_CallImage: BERT-base's view ~0.27 ->
    ~0.22 ms hot, bench/results/bind-base-cpu-2026-12-05b.md). A member that reads, by the template's wiring, what
    a layer one period before it read (_Mirror: a transformer's layers after its first) takes that layer's answers
    without its rule or loop step (BERT-base's view 0.22 -> 0.18 ms hot, bench/results/bind4-2026-12-05c.md). Where
    every member the walk evaluates has a rule, the walk itself is traced into one generated function of the entry
    dims (view_trace.py): a view on a traced path is one call of it, then the plans' stores (BERT-base's view ~65 ->
    ~20 µs hot, ~0.31 -> ~0.17 ms in a first call, bench/results/first-call-2026-12-06.md); an alias (a Reshape
    that moves no byte: no call, no plan) whose NativeStep has a size rule is such a member with no values (bert_tiny's
    key mask [B, S] -> [B, 1, 1, S]). A oneDNN linear layer that runs its other row counts on kiln's GEMM (small
    layers: cpu.gemm.onednn_direct's OtherRows) has a plan rule for those rows and, where its template call is an
    inner product, a kiln GEMM plan of its own over its arena places (_other_kernel_layout): a view at those rows
    writes it as any plan, one at the rows oneDNN runs writes its arguments (bert_tiny's default build, 4 layers
    tuned on oneDNN: its walk is then traced). The other members (kernels whose plans hold floats, squeeze-excite, a oneDNN
    layer at rows another kernel takes) are bound as _Resized.bound_at binds them.

    Exact: a rule's fields are computed by the functions the kernels' own constructors use, a member's other fields
    do not follow the sizes (its weights, epsilon, memory objects), and a member whose rule does not give back its
    template plan's bytes at the template's sizes is bound the other way (tests/unit/test_native_binding.py compares
    every rewritten plan with the replanned one, byte for byte, at fresh shapes)."""

    def __init__(self, template: Any, like: _PlanRewrite | None = None):
        """The rewrite of `template`'s plans. It does not hold the template (the template holds it: a reference back
        would be a cycle); view() is given it. `like`: the rewrite of a template of the same members and plan over
        other memory (another execution context's twin, Segment.on_arena), whose traced rules and traced walk this
        one shares where its walk is the same (_same_walk): they follow the sizes only, never an address, and are
        read-only once made (a path is added whole, under its lock), so a second context's first calls find the
        paths the load's view job and the first context traced."""
        call_of = {k: i for i, k in enumerate(template._bound_members)}
        image = bytearray()
        self._kept: list[Any] = []  # what the plans of _other_kernel_layout's members point at (memory objects)
        # per member: (its rule or None, at, reads, x: as Segment._resizers, the residual's slot or None,
        # [(output j, slot)] of the values it writes, its plan's function and offset in a view's buffer or None,
        # what its rule's result follows besides the sizes (its key, the step inputs it reads), the slots it reads,
        # a oneDNN layer whose arguments a view writes (ArgumentsRewrite) or None)
        self._members: list[tuple] = []
        words: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])  # int64 word, value; int32 ...
        values = 0  # values the members' rules give, in member order
        counts: list[int] = []  # each member's
        traced: dict[tuple, TracedRule] = {}  # a rule per key (rules of one key give equal answers at equal sizes)

        def traced_rule(rule: Any) -> TracedRule:
            return traced.get(rule.key) or traced.setdefault(rule.key, TracedRule(rule))

        if like is not None:  # its rules' traces, where the rule is the same object (the twin's members are its own)
            for member in like._members:
                if member[0] is not None:
                    traced.setdefault(member[0].key, member[0])

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
            if layout is None and call is not None:  # a oneDNN layer's rows on kiln's GEMM: a plan of its own
                other = _other_kernel_layout(template, k, native, template.bound[call])
                if other is not None:
                    layout = other[0]
                    self._kept.append(other[1])
            if layout is None and call is None and _alias_rule_holds(native, arg):
                # an alias: its output size by its rule, no plan and no call (a walk of rules only is traced)
                self._members.append((traced_rule(native.plan_at), at, reads, x, residual, outputs, None,
                                      (native.plan_at.key, None), (x,), None))
                counts.append(0)
                continue
            if layout is None:
                bind = None if call is None or template._accumulate[k] else \
                    arguments_layout(m, native, template.bound[call], arg, template._address)
                self._members.append((None, at, reads, x, residual, outputs, None, None, (), bind))
                counts.append(0)
                continue
            function, plan_bytes, fields = layout
            for offset, width in fields:
                words[0 if width == 8 else 2].append((len(image) + offset) // width)
                words[1 if width == 8 else 3].append(values)
                values += 1
            read = tuple(slot for _, slot in reads) if reads is not None else (x,)
            follows = (native.plan_at.key, tuple(i for i, _ in reads) if reads is not None else None)
            placed = (function, len(image))
            # a oneDNN layer whose rows on kiln's GEMM the rule gives: its other rows bound by its primitive rule
            bind = None if native.primitive_at is None or template._accumulate[k] else \
                arguments_layout(m, native, template.bound[call], arg, template._address)
            self._members.append((traced_rule(native.plan_at), at, reads, x, residual, outputs, placed, follows, read,
                                  bind))
            counts.append(len(fields))
            image += plan_bytes + bytes(-len(plan_bytes) % 16)
        self._image = np.frombuffer(bytes(image), np.int64)  # 16-byte multiples
        # a view evaluates the members that mirror none (_mirrors) and writes every plan from their values
        self._schedule, remap, self._values = _mirrors(self._members, counts, sizes)
        self._steps = _mirror_runs(self._schedule, self._members)
        self._stores = _int32_stores(*(np.array(w, np.intp) for w in words), remap)
        forms = _forms(template.members, template._natives)
        arena = [(s, forms[s][2].itemsize, template._capacity[g]) for s, g in template._arena_slots]
        self._arena = _arena_checks(arena, self._schedule)
        self._itemsizes = {s: itemsize for s, itemsize, _capacity in arena}  # each arena slot's (arena_bytes_at)
        # each exit's dtype and strides rule (a NativeStep's output_strides: NHWC for a 4-D output of oneDNN's
        # layers or a channels-last kernel, row-major otherwise and for outputs past the first)
        nhwc = {m.outputs[0]: native.reads is None or native.channels_last
                for m, native in zip(template.members, template._natives)}
        self._exits = [(s, forms[s][2], nhwc.get(s, False)) for s in template.exits]
        self._calls = _CallImage.of(template, self._members)  # None: views assemble their calls member by member
        # where every call runs a rewritten plan (_assembled's views: BERT-base's 91), a view's plans and its loop's
        # objects array are one buffer: the template's plans, then a word per call (its plan's offset, the buffer's
        # address added per view)
        self._image_calls, self._plan_words = None, None
        if self._calls is not None and len(self._calls.plan_calls) == len(self._calls.objects):
            self._image_calls = np.concatenate([self._image, np.zeros(len(self._calls.objects), np.int64)])
            self._plan_words = self._calls.plan_offsets.astype(np.int64)
        # that buffer written by one struct pack (view_pack.py: a first call's ~8 numpy calls on cold caches)
        self._packed = None
        if self._image_calls is not None and PACKED:
            fields = [(8 * w, 8, int(remap[v])) for w, v in zip(words[0], words[1])] + \
                [(4 * w, 4, int(remap[v])) for w, v in zip(words[2], words[3])]
            self._packed = PackedPlans.of(bytes(image), fields, self._calls.plan_offsets.tolist())
        self._binds = {k: member[9] for k, member in enumerate(self._members) if member[9] is not None}
        # members with a plan and arguments (a oneDNN layer's rows on kiln's GEMM, its other rows on oneDNN)
        self._switches = {k for k, member in enumerate(self._members) if member[6] is not None and member[9]}
        self._arguments = ViewArguments()  # the oneDNN members' arguments, kept across views (tables, handles)
        # the walk of view() as closed forms of the entry dims, where every member it evaluates has a rule
        self._whole = ViewTrace(template.entries, tuple(len(size) for size in template.entry_sizes))
        self._pending: set[tuple] = set()  # keys whose traces wait on the background thread (_learn_later)
        if like is not None and self._same_walk(like):
            self._whole = like._whole  # (its `ahead` with it: a twin's misses defer as its origin's do)

    @property
    def _ahead(self) -> bool:
        """Whether the load's view job traced the walk (learn_at): a call's misses then defer their traces. Kept on
        the ViewTrace, which twins' rewrites share (a twin made before the job ran learns it there)."""
        return self._whole.ahead

    @_ahead.setter
    def _ahead(self, value: bool) -> None:
        self._whole.ahead = value

    def _same_walk(self, other: _PlanRewrite) -> bool:
        """Whether view()'s walk is the same function of the entry sizes for this rewrite and `other`: the same
        traced rules (objects), schedule of members and mirrors, values, exits and arena capacities (the traced
        walk's guards), and entry ranks. A twin's rewrite always is (its template is planned as its origin's)."""
        def walk_form(rewrite: _PlanRewrite) -> list[tuple]:
            return [(m[0], m[4], tuple(m[5]), m[7], m[8]) for m in rewrite._members]
        return self._values == other._values and self._arena == other._arena and self._exits == other._exits \
            and self._steps == other._steps and self._whole.ranks == other._whole.ranks \
            and walk_form(self) == walk_form(other)

    def view(self, template: Any, key: tuple) -> _Resized | None:
        """`template`'s view (the segment this rewrite was made for) at entry sizes `key`, or None: a rule or a
        layer refuses them, the template's arena cannot hold them (Segment._view then grows it), or an entry's rank
        differs from the template's."""
        if any(len(k) != len(t) for k, t in zip(key, template.entry_sizes)):
            return None
        traced = self.traced_view(template, key)
        if traced is not None:
            return traced
        defer = self._ahead and self._calls is not None and onednn_ahead.enabled()
        if defer:  # a class of sizes the load's traces missed: the rules run plainly, traced on the background
            with untraced():
                walked = self._walk(template, key)
        else:
            walked = self._walk(template, key)
        if walked is None:
            return None
        values, exits, natives, bound = walked
        if self._calls is not None and not natives and not bound:  # every member's plan rewritten
            if defer:
                self._learn_later(template, key)
            else:
                self._whole.learn(self, key, values, exits)  # the next views on this path: one call (TRACES at most)
            return self._assembled(template, key, values, exits)
        return self._bound_view(template, key, values, exits, natives, bound)

    def _learn_later(self, template: Any, key: tuple) -> None:
        """Queue learn_at(template, key) on the background thread (onednn_ahead.AHEAD): a call at sizes off every
        traced path of a walk traced at load (a class of sizes trace_shapes did not meet) walks with its rules run
        plainly (~0.6 ms on BERT-base) and leaves the rules' and the walk's traces (~4 ms of Python) to the thread,
        so the next sizes of that class are one call of the traced walk. At most PENDING_TRACES keys wait at once
        (a later miss of their class queues again); none once the walk has TRACES paths or cannot be traced. The
        job holds the template and this rewrite weakly."""
        forms = self._whole
        if len(self._pending) >= PENDING_TRACES or key in self._pending or not forms.traceable \
                or forms.paths >= TRACES:
            return
        self._pending.add(key)
        template_ref, rewrite_ref = weakref.ref(template), weakref.ref(self)

        def make() -> bool:
            template, rewrite = template_ref(), rewrite_ref()
            if template is None or rewrite is None:
                return False
            try:
                return rewrite.learn_at(template, key)
            finally:
                rewrite._pending.discard(key)
        onednn_ahead.AHEAD.schedule([onednn_ahead.Job(("view trace", next(_LATER)), 0, make, counted=False)], 1)

    def learn_at(self, template: Any, key: tuple) -> bool:
        """Trace view()'s walk at entry sizes `key` ahead of any call there, binding nothing: each rule's path at
        these sizes (TracedRule) and the walk's own (ViewTrace), so that a first call at sizes of the same class is
        one call of the traced walk. For the background thread at load (Segment.trace_ahead): it touches no state
        of the template or its views, only the traced rules and walk (each under its lock). It stops at a member
        without a rule (its NativeStep or oneDNN primitive would be made: left to a call). True where it added a
        path of the walk."""
        self._ahead = True
        if self._calls is None or tuple(map(len, key)) != self._whole.ranks or self._whole(key) is not None:
            return False
        walked = self._walk(template, key, rules_only=True)
        return walked is not None and self._whole.learn(self, key, walked[0], walked[1])

    def arena_bytes_at(self, template: Any, key: tuple) -> dict[int, int] | None:
        """Each of the template's arena slots' bytes at entry sizes `key` (what a view there writes at its planned
        place: Segment._extents, for the pages a new context's lane touches ahead), by learn_at's walk of the rules
        alone: nothing made or bound, no lock of the template's. None where a member has no rule's answer, a rule
        refuses `key` or the arena cannot hold it."""
        if tuple(map(len, key)) != self._whole.ranks:
            return None
        sizes: dict[int, tuple] = {}
        if self._walk(template, key, rules_only=True, into=sizes) is None:
            return None
        return {s: math.prod(sizes[s]) * itemsize for s, itemsize in self._itemsizes.items()}

    def _walk(self, template: Any, key: tuple, rules_only: bool = False, into: dict[int, tuple] | None = None
              ) -> tuple[list[int], list[tuple], dict[int, NativeStep], dict[int, SizedPrimitive]] | None:
        """view()'s walk at `key`: (the values the rules write, in member order; the exits' sizes; the members
        without a rule at these sizes, as NativeSteps; the oneDNN members whose arguments a view writes), or None
        where a rule or layer refuses them or the template's arena cannot hold them. `rules_only`: None at the
        first member without a rule's answer (nothing is made: learn_at). `into`: given every value's size (slot ->
        size) where the walk answers."""
        sizes = dict(zip(template.entries, key))
        values: list[int] = []  # what the rules write, in member order
        natives: dict[int, NativeStep] = {}  # the members without a rule, at the new sizes
        bound: dict[int, SizedPrimitive] = {}  # the oneDNN members whose arguments are rewritten (no NativeStep made)
        worked: dict[tuple, tuple[tuple, list[int]]] = {}  # a rule's key and sizes -> (output sizes, values)
        primitives: dict[tuple, SizedPrimitive | None] = {}  # a primitive rule's key and size -> its answer
        try:
            for k, count, mirror in self._scheduled(sizes, bound, natives):
                if mirror is not None:
                    for a, b in mirror.checks:
                        if sizes[a] != sizes[b]:
                            return None  # a layer's sizes differ from those of the one it mirrors: bound one by one
                    if mirror.of not in natives:  # else a oneDNN layer on another kernel: its own NativeStep
                        if mirror.of in bound:
                            bound[k] = bound[mirror.of]
                        for slot, same in mirror.outputs:
                            sizes[slot] = sizes[same]
                        continue
                rule, at, reads, x, residual, outputs, _placed, follows, read, bind = self._members[k]
                found = None
                if rule is not None:
                    found = worked.get(at_sizes := (follows, tuple(map(sizes.__getitem__, read))))
                    if found is None:  # the first layer of its shape at these sizes
                        try:
                            sized = rule.at(follows[1], at_sizes[1])  # rule({i: sizes[slot] ...}) or rule(sizes[x])
                        except ValueError:
                            if bind is None:
                                raise
                        else:
                            found = worked[at_sizes] = (sized.output_sizes, sized.flat_values())
                if found is None:
                    if rules_only:
                        return None
                    if rule is not None:  # rows its rule leaves to oneDNN: its plan unused, its values any
                        values += [0] * count
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
                    if len(found[1]) != count:
                        return None  # the template's plan has other fields
                    written = found[0]
                    values += found[1]
                if residual is not None and sizes[residual] != written[0]:
                    return None  # as _natives_at: the layers run one by one
                for j, slot in outputs:
                    sizes[slot] = written[j]
                if mirror is not None:  # a oneDNN layer's mirror on another kernel, as the layer it mirrors
                    for slot, same in mirror.outputs:
                        if sizes[slot] != sizes[same]:
                            return None
        except ValueError:
            return None
        if len(values) != self._values:
            return None
        for s, itemsize, capacity in self._arena:
            if math.prod(sizes[s]) * itemsize > capacity:
                return None
        if into is not None:
            into.update(sizes)
        return values, [sizes[s] for s, _dtype, _nhwc in self._exits], natives, bound

    def _bound_view(self, template: Any, key: tuple, values: list[int], exits: list[tuple],
                    natives: dict[int, NativeStep], bound: dict[int, SizedPrimitive]) -> _Resized:
        """view()'s view where its walk found members without a rule (`natives`) or oneDNN arguments (`bound`)."""
        buffer = self._plans(values)
        base = buffer.ctypes.data
        exit_shapes = self._exit_shapes(exits)
        entry_forms = ([tuple(size) for size in key], template.entry_dtypes, template.entry_layouts)
        owned = [buffer]
        if self._calls is not None and not natives and not bound.keys() & self._switches:
            # every member rewritten, each the kind of call the image has: the call arrays by numpy stores
            c = self._calls.at(base, self._arguments.at(bound, self._binds, owned) if bound else None)
            return _Resized(template, {PARALLEL: c}, template._names, exit_shapes, entry_forms, owned)
        owners, member_calls, anew = [], [], set()
        arguments = {}
        if bound:
            primitives, counts, addresses = self._arguments.at(bound, self._binds, owned)
            arguments = dict(zip(bound, zip(primitives.tolist(), counts.tolist(), addresses.tolist())))
        for b, k in zip(template.bound, template._bound_members):
            placed = self._members[k][6]
            if placed is not None and k not in bound and k not in natives:  # the copy: the call's memory objects
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
        return _Resized.from_members(template, owners, member_calls, anew, exit_shapes, entry_forms, owned)

    def traced_view(self, template: Any, key: tuple) -> _Resized | None:
        """`template`'s view at `key` from a traced path of view()'s walk (view_trace.py: its values and exits in one
        call), or None where no path holds (view() walks). No oneDNN member is bound on it: Segment._bind_sizes asks
        here before it opens the oneDNN memories' scope that a walk's bound members need."""
        if self._calls is None or tuple(map(len, key)) != self._whole.ranks:
            return None
        whole = self._whole(key)
        return self._assembled(template, key, *whole) if whole is not None else None

    def _plans(self, values: list[int]) -> np.ndarray:
        """A view's plans: the template's, each rule's values written over (one array the collector does not
        track)."""
        buffer = self._image.copy()
        if values:
            where, halves = self._stores
            buffer.view(np.int32)[where] = np.array(values, np.int64).view(np.int32)[halves]
        return buffer

    def exit_strides(self, exits: list[tuple] | tuple[tuple, ...]) -> tuple[tuple, ...]:
        """Each exit's strides at sizes `exits` (ints, or a traced walk's symbols: ViewTrace answers them)."""
        return tuple(native_strides(size) if nhwc else row_major_strides(size)
                     for size, (_s, _dtype, nhwc) in zip(exits, self._exits))

    def _exit_shapes(self, exits: list[tuple[int, ...]], strides: tuple[tuple[int, ...], ...] | None = None
                     ) -> list[tuple]:
        """(size, strides, dtype) of each exit at sizes `exits` (`strides`: a traced walk's, else worked out)."""
        strides = self.exit_strides(exits) if strides is None else strides
        return [(size, stride, dtype) for size, stride, (_s, dtype, _nhwc) in zip(exits, strides, self._exits)]

    def _assembled(self, template: Any, key: tuple, values: list[int] | tuple[int, ...], exits: list[tuple[int, ...]],
                   strides: tuple[tuple[int, ...], ...] | None = None) -> _Resized:
        """The view whose every member's plan is rewritten (no oneDNN arguments, no member bound otherwise): its
        plans from `values` (in member order), the call image's arrays pointed at them. Where every call runs a
        rewritten plan, the plans and the calls' objects array are one buffer (_image_calls), its address asked of
        __array_interface__ and the objects array a ctypes view of it by address: numpy's `.ctypes`, a second
        array and ctypes' from_buffer cost ~30 µs of a first call's ~150 for the view, right after a run has cooled
        the caches (bench/results/first-call-2026-12-06.md). Where it can, that buffer is a ctypes array written by
        one struct pack (view_pack.py: the numpy array, its image copy, stores and addresses were ~8 numpy calls,
        each slow on cold caches: ~10% of llama_tiny's views, bench/results/first-shape-2026-12-06.md, s27 h-views6).
        The view owns the buffer (its last `owned`). `strides`: the exits' (a traced walk's answer), else worked out."""
        image = self._image_calls
        if image is None:
            buffer = self._plans(values)
            c = self._calls.at(buffer.ctypes.data, None)
        else:
            plans = len(self._image)
            packed = self._packed  # one struct pack (view_pack.py), else numpy's stores where it refuses the values
            if packed is not None:
                buffer = packed.buffer_type()
                base = ctypes.addressof(buffer)
                if not packed.into(buffer, base, values):
                    words = np.frombuffer(buffer, np.int64)
                    words[:] = image
                    self._stored(words, base, values)
            else:
                buffer = image.copy()
                base = buffer.__array_interface__["data"][0]
                self._stored(buffer, base, values)
            c = self._calls.over(base + plans * 8)
        entry_forms = ([*map(tuple, key)], template.entry_dtypes, template.entry_layouts)
        return _Resized(template, {PARALLEL: c}, template._names, self._exit_shapes(exits, strides), entry_forms,
                        [buffer])

    def _stored(self, buffer: np.ndarray, base: int, values: list[int] | tuple[int, ...]) -> None:
        """_assembled's buffer (`buffer`, at address `base`, the template's plans and calls) by numpy: each rule's
        values stored over (_int32_stores), each call's plan address."""
        if values:
            where, halves = self._stores
            buffer.view(np.int32)[where] = np.array(values, np.int64).view(np.int32)[halves]
        np.add(self._plan_words, base, out=buffer[len(self._image):])

    def _scheduled(self, sizes: dict[int, tuple], bound: dict[int, SizedPrimitive], natives: dict[int, NativeStep]
                   ) -> Iterator[tuple[int, int, _Mirror | None]]:
        """The schedule's members a view evaluates one by one, in order: a run of mirrors is copied at once
        (_MirrorRun.copy) while no member is bound on another kernel (`natives` empty: every layer a mirror copies
        has its rule's or primitive's answer), else its members are given one by one."""
        for step in self._steps:
            if type(step) is not _MirrorRun:
                yield step
            elif natives:
                yield from step.members
            else:
                step.copy(sizes, bound)

@dataclass(frozen=True)
class _CallImage:
    """A template's compiled-loop arrays (Segment._c_loop's) as numpy images, for its views whose every member is
    rewritten (a plan of kiln's own kernel, or a oneDNN member's arguments): a view's objects, nargs and args arrays
    are copies with those calls written by numpy stores; the rest (functions, bindings: none of these members is an
    entry's or exit's) is the template's, which the loop only reads."""

    loop: tuple  # the template's Segment._c_loop arrays, with its functions, nargs and args as a view's runs them:
    # a member whose rows on kiln's GEMM a view writes a plan for, where the template runs oneDNN, kiln_gemm's
    objects: np.ndarray  # uintp, every call's
    nargs: np.ndarray  # int32
    args: np.ndarray  # uintp
    plan_calls: np.ndarray  # the calls running a rewritten plan ...
    plan_offsets: np.ndarray  # ... and where in a view's plan buffer it is (uintp)
    argument_calls: np.ndarray  # the oneDNN members' calls, in member order
    addresses: ctypes.Array  # every view's run addresses (nbind words) and failed call: one of each for all the views,
    failed: ctypes.c_int  # each run writes them under the template's lock (_run_loop) before the loop reads them
    objects_type: type  # a view's objects array over a buffer: its ctypes array type, asked once (a first call's
    # view pays each `c_void_p * n` cold)

    @classmethod
    def of(cls, template: Any, members: list[tuple]) -> _CallImage | None:
        """The image, or None where a member is neither kind, makes another count of calls than one, or the
        template's call of a oneDNN member is not oneDNN's execute (then views assemble their calls member by
        member; also where the template runs no loop in C: no native loop library, or its Python loop forced)."""
        if template._c is None:
            return None
        loop = template._c[False, PARALLEL]
        functions, objects, nargs, args = loop[1], loop[8], loop[9], loop[10]
        if set(template._call_counts) != {1} or len(functions) != len(template.bound):
            return None
        plan_calls, plan_offsets, argument_calls, other = [], [], [], []
        execute = native_loop.execute_function()
        for i, k in enumerate(template._bound_members):
            placed, bind = members[k][6], members[k][9]
            if placed is not None and (functions[i] == placed[0] or (bind is not None and functions[i] == execute)):
                plan_calls.append(i)
                plan_offsets.append(placed[1])
                if functions[i] != placed[0]:  # the template runs it on oneDNN (_other_kernel_layout)
                    other.append((i, placed[0]))
            elif placed is None and bind is not None and functions[i] == execute:
                argument_calls.append(i)
            else:
                return None
        if other:  # the template's arrays, those calls kiln_gemm's (no arguments)
            functions, nargs, args = (type(array).from_buffer_copy(array) for array in (functions, nargs, args))
            for i, function in other:
                functions[i], nargs[i], args[i] = function, 0, None
            loop = (*loop[:1], functions, *loop[2:9], nargs, args, *loop[11:])
        return cls(loop, np.frombuffer(objects, np.uintp).copy(), np.frombuffer(nargs, np.int32).copy(),
                   np.frombuffer(args, np.uintp).copy(), np.array(plan_calls, np.intp),
                   np.array(plan_offsets, np.uintp), np.array(argument_calls, np.intp),
                   (ctypes.c_void_p * max(loop[3], 1))(), ctypes.c_int(-1), type(loop[8]))

    def over(self, objects: int) -> tuple:
        """The loop's arrays of a view whose every call runs a rewritten plan, its objects array (each call's plan
        address) at address `objects`, kept alive by the view (_PlanRewrite._assembled): the template's nargs and args
        arrays (no oneDNN member)."""
        run, functions, set_handle, nbind, memories, _addresses, moving, count, _objects, nargs, args, _ = self.loop
        return (run, functions, set_handle, nbind, memories, self.addresses, moving, count,
                self.objects_type.from_address(objects), nargs, args, self.failed)

    def at(self, base: int, arguments: tuple[np.ndarray, np.ndarray, np.ndarray] | None) -> tuple:
        """The loop's arrays of a view whose plans are at `base` and whose oneDNN members' (primitives, nargs, args)
        are `arguments` (ViewArguments.at's, every such member's)."""
        run, functions, set_handle, nbind, memories, _addresses, moving, count, _objects, _nargs, _args, _ = self.loop
        if len(self.plan_calls) == len(self.objects):  # every call a rewritten plan, in order (BERT-base's 91)
            objects = self.plan_offsets + np.uintp(base)
        else:
            objects = self.objects.copy()
            objects[self.plan_calls] = self.plan_offsets + np.uintp(base)
        if arguments is None:  # no oneDNN member: the template's nargs and args arrays (the loop only reads them)
            nargs, args = _nargs, _args
        else:
            nargs, args = self.nargs.copy(), self.args.copy()
            objects[self.argument_calls], nargs[self.argument_calls], args[self.argument_calls] = arguments
            nargs, args = type(_nargs).from_buffer(nargs), type(_args).from_buffer(args)
        return (run, functions, set_handle, nbind, memories, self.addresses, moving, count,
                type(_objects).from_buffer(objects), nargs, args,
                self.failed)  # ctypes arrays over the numpy copies (which they keep alive)


def exit_tensors(exit_shapes: list[tuple], into: list | None = None) -> list[torch.Tensor]:
    """A run's exit tensors, (size, strides, dtype) each: fresh, or where `into` (one per exit, or None) holds a tensor
    of exactly that size, strides and dtype, that tensor (execute()'s bound outputs, Program.run's `into`: the run
    writes the caller's pages, no copy after)."""
    if into is None:
        return [torch.empty_strided(size, strides, dtype=dtype) for size, strides, dtype in exit_shapes]
    return [t if t is not None and t.dtype == dtype and t.shape == size and t.stride() == tuple(strides)
            else torch.empty_strided(size, strides, dtype=dtype)
            for t, (size, strides, dtype) in zip(into, exit_shapes)]


def _int32_stores(where64: np.ndarray, value64: np.ndarray, where32: np.ndarray, value32: np.ndarray,
                  remap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A view's plan stores as one: (int32 word of the plan buffer, int32 half of the values array) of every
    value's 64-bit field (both halves) and 32-bit field (its low half: what an int64 -> int32 cast keeps). One
    gather and one scatter instead of two of each: a first call runs them right after a run has cooled the caches,
    where each numpy call costs several times its warm time (bench/results/first-call-2026-12-06.md)."""
    low = 0 if sys.byteorder == "little" else 1
    value64, value32 = remap[value64], remap[value32]
    where = np.concatenate([2 * where64, 2 * where64 + 1, where32])
    halves = np.concatenate([2 * value64 + low, 2 * value64 + 1 - low, 2 * value32 + low])
    return where, halves


def _alias_rule_holds(native: NativeStep, arg: Any) -> bool:
    """Whether `native` is an alias (a Reshape that moves no byte: no call) whose size rule gives back its own output
    size at its template's sizes (`arg`)."""
    if not native.alias or native.plan_at is None or native.reads is not None:
        return False
    try:
        return native.plan_at(arg).output_sizes == (tuple(native.output_size),)
    except ValueError:
        return False


def _other_kernel_layout(template: Any, k: int, native: NativeStep, bound: Any
                         ) -> tuple[tuple[int, bytes, list[tuple[int, int]]], Any] | None:
    """(_plan_layout's answer, the call it was read from) for member k, a oneDNN layer (`bound`, its template call)
    that runs other row counts on kiln's GEMM (cpu.gemm.onednn_direct's OtherRows): the plan of its layer bound at
    a size its rule takes, over the member's arena places (memory objects of its own, at the template's
    addresses), or None: no such rule, a serial form or an accumulation (a view would lose them), a role an entry
    or exit (a run points those elsewhere), or no probed size the rule takes. A view at rows on kiln's GEMM then
    writes that plan as it does a kiln GEMM member's; at the rows oneDNN runs, its arguments (ArgumentsRewrite).
    bert_tiny's default build put 4 layers on oneDNN at its tuned 1024 rows: without this, every view bound them
    member by member and its walk was never traced."""
    if native.plan_at is None or native.primitive_at is None or native.reads is not None \
            or type(bound) is not onednn.Bound or getattr(bound, "serial_primitive", None) is not None \
            or template._accumulate[k]:
        return None
    m = template.members[k]
    slots = [m.inputs[0], m.outputs[0]] + ([m.inputs[native.residual_input]] if native.residual_input is not None
                                           else [])
    addresses = [template._address.get(slot, 0) for slot in slots]
    if not all(addresses):
        return None
    size = tuple(native.input_size)
    for probe in ((*[1] * (len(size) - 1), size[-1]), (2, *[1] * (len(size) - 2), size[-1])):
        try:
            native.plan_at(probe)
        except ValueError:
            continue
        at = native.at(probe)
        call = at.primitive(False).bind(*addresses)
        layout = _plan_layout(at, call, probe)
        return None if layout is None else (layout, call)
    return None


def _plan_layout(native: NativeStep, bound: Any, arg: Any) -> tuple[int, bytes, list[tuple[int, int]]] | None:
    """(function, plan bytes, [(byte offset, width)] of each value its rule writes, in order) of a member whose plan
    a view rewrites, or None: no rule, not one plan of kiln's own, a field that is not an integer, or a rule that
    does not give back the template call's plan at its own sizes (`arg`)."""
    # a PlanMember (plan_member.py: relayout.py's walks) keeps its plan as _plan; one with a serial form (a second
    # plan the serial loop runs) is not rewritten
    plan = getattr(bound, "plan", None) if not hasattr(bound, "serial_calls") else \
        getattr(bound, "_plan", None) if isinstance(bound, PlanMember) and bound.serial_calls() is None else None
    if native.plan_at is None or plan is None or len(bound.calls()) != 1:
        return None
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
        if held is None or len(items) != held[0] or None in items:  # None: a field the rule leaves unset
            return None
        width, start = held[1], getattr(type(plan), name).offset
        for j, item in enumerate(items):
            offset = start + j * width
            fields.append((offset, width))
            rewritten[offset:offset + width] = int(item).to_bytes(width, "little", signed=True)
    if bytes(rewritten) != original:
        return None
    return bound.calls()[0][0], original, fields


def _rebound(template: Any, bound: Any, k: int, native: NativeStep) -> tuple[Any, bool]:
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

    def __init__(self, template: Any, c: dict[str, tuple], names: list[str], exit_shapes: list[tuple],
                 entry_forms: tuple[list, list, list], owned: list[Any]):
        """`c`: the compiled loop's arrays of each form (PARALLEL, and SERIAL where a member has a serial form: then
        a FormChooser picks per run); `names`: the layer of each call; `owned`: what the calls point at that the view
        keeps alive."""
        self.template = template
        self.entries, self.exits = template.entries, template.exits
        self._c, self._names, self._owned = c, names, owned
        self.exit_shapes = exit_shapes
        self.entry_sizes, self.entry_dtypes, self.entry_layouts = entry_forms
        self.chooser = FormChooser() if SERIAL in c else None  # this size's own times

    @classmethod
    def from_members(cls, template: Any, owners: list[Any], member_calls: list[list], anew: set[int],
                     exit_shapes: list[tuple], entry_forms: tuple[list, list, list], owned: list[Any]) -> _Resized:
        """The view whose bound members' calls are `member_calls`: `owners`, the memory objects of each (a Bound, a
        Replanned, or the template's own call, whose plan a rewritten copy runs); `anew`: the owners (indices) with
        memory objects of their own, which a run binds where they are entries or exits."""
        calls = [c for made in member_calls for c in made]
        forms = {PARALLEL: calls}
        serial = serial_calls(owners, member_calls)
        if serial is not None:
            forms[SERIAL] = serial
        counts = [len(made) for made in member_calls]
        names = template._names if counts == template._call_counts else \
            [template.members[k].ctx.name for n, k in zip(counts, template._bound_members) for _ in range(n)]
        if not anew & template._per_call_bound and len(calls) == len(template._calls):
            # what a run points at its entries and exits are the template's memory objects (members bound anew,
            # with memory objects of their own, read and write only the arena): its bindings hold, and only the
            # calls' arrays are new (the common case: a transformer's interior GEMMs on oneDNN)
            c = {form: _c_loop_over(template._c[False, PARALLEL], made, template._calls) for form, made in forms.items()}
            return cls(template, c, names, exit_shapes, entry_forms, owned)
        bindings = []
        for k, s in enumerate(template.entries):
            bindings += [(owners[i].memory(role), ("entry", k)) for i, role in template.per_call[s]]
        for j, g in enumerate(template.exit_groups):
            bindings += [(owners[i].memory(role), ("exit", j)) for i, role in template.per_call.get(g, ())]
        loop = native_loop.load()
        c = {form: template._c_loop(loop, bindings, made) for form, made in forms.items()}
        return cls(template, c, names, exit_shapes, entry_forms, owned)

    @classmethod
    def bound_at(cls, template: Any, natives: list[NativeStep], forms: dict[int, tuple] | None = None
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
        return cls.from_members(template, owners, [b.calls() for b in owners], anew, [forms[s] for s in template.exits],
                                _entry_forms(template.entries, template._entry_readers, natives), owners)

    def _run_bound(self, values: tuple, into: list | None = None) -> Any:
        exits = exit_tensors(self.exit_shapes, into)
        entries = []
        for v, layout in zip(values, self.entry_layouts):
            laid_out = v.is_contiguous(memory_format=torch.channels_last) if layout == "nhwc" else v.is_contiguous()
            entries.append(v if laid_out else (v.contiguous(memory_format=torch.channels_last) if layout == "nhwc"
                                               else v.contiguous()))
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
