"""The execution arguments of a native segment's view's oneDNN members (kiln/runtime/native_views.py _PlanRewrite):
each such member runs its layer shape's primitive at the view's rows (NativeStep.primitive_at) on arguments a view
writes into one array (dnnl_exec_arg_t's), each role a memory object of the primitive's descriptor at the member's
arena address, its weight and bias its own. What does not change from view to view (where each argument goes, the
ids, the weights' memory objects) is laid out once per wiring (ArgumentsTable); a view makes its memory objects and
takes its primitives' handles (ViewHandles, kept across views), and writes them by numpy stores.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.kernels.cpu import onednn
from kiln.runtime.step import BoundStep
from kiln.tactics.tactic import NativeStep, PrimitiveRule, SizedPrimitive


@dataclass(frozen=True, slots=True)
class ArgumentsRewrite:
    """A oneDNN member whose execution arguments a view writes (NativeStep.primitive_at): its rule, the arena
    address of each role it binds, and its own arguments after them (the rule's `fixed`: ids, memory objects)."""

    rule: PrimitiveRule
    addresses: dict[str, int]
    fixed_ids: tuple[int, ...]
    fixed_memories: tuple[int, ...]


def arguments_layout(m: BoundStep, native: NativeStep, bound: Any, arg: Any, address: dict[int, int]
                     ) -> ArgumentsRewrite | None:
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
        if got is None or got.primitive != bound.made_from or got.roles != bound.roles \
                or given[len(got.roles):] != list(native.primitive_at.fixed):
            return None
    fixed = native.primitive_at.fixed
    return ArgumentsRewrite(native.primitive_at, addresses, tuple(argument for argument, _ in fixed),
                            tuple(memory for _, memory in fixed))


@dataclass
class HeldArguments:
    """What a view's rewritten oneDNN calls point at: their execution arguments, the memory objects those name, what
    their primitives need alive (RoleArguments.keep) and the handles they run."""

    array: np.ndarray
    memories: list[Any]
    kept: list[Any]
    handles: list[Any]  # the primitive handles the calls run, its template's views' (ViewHandles)
    made_from: list[int]  # each call's shared primitive, in member order


class ViewArguments:
    """The execution arguments of a template's views' oneDNN members (those _PlanRewrite binds by their primitive
    rules): a table per wiring (ArgumentsTable) and the views' primitive handles (ViewHandles), kept across views."""

    def __init__(self) -> None:
        self._tables: dict[tuple, ArgumentsTable] = {}  # by the members a view binds and their answers' sharing
        self._handles = ViewHandles()

    def at(self, bound: dict[int, SizedPrimitive], binds: dict[int, ArgumentsRewrite], owned: list[Any]
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(primitives, nargs, args addresses) of the oneDNN members in `bound` (member -> its primitive at a view's
        sizes), in its order: every member's execution arguments in one array, each role a memory object of its
        descriptor there at its arena address (one per descriptor and address); `owned` gets what they point at
        (HeldArguments). Where the array goes is the members' ArgumentsTable (made at the first view of their
        wiring): a view makes only its primitives' handles and memory objects, and writes them by numpy stores."""
        index: dict[int, int] = {}  # a shared answer (mirrors share their layer's) -> its place among `shared`
        groups = tuple([index.setdefault(id(sized), len(index)) for sized in bound.values()])
        shared = list({id(sized): sized for sized in bound.values()}.values())
        roles = tuple(tuple((role, argument) for role, argument, _md in sized.arguments.roles) for sized in shared)
        key = (tuple(bound), groups, roles)
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = ArgumentsTable.of([binds[k] for k in bound], groups, roles)
        handles: dict[int, Any] = {}  # a shared primitive -> the views' handle of it (ViewHandles)
        for sized in shared:
            primitive = sized.arguments.primitive
            if primitive not in handles:
                handles[primitive] = self._handles.of(sized.arguments)
        held: dict[tuple[int, int], Any] = {}
        memories = []  # each place's memory object
        for group, j, address in table.places:
            md = shared[group].arguments.roles[j][2]
            memory = held.get((md, address))
            if memory is None:
                memory = held[md, address] = onednn.shared_memory(md, address)
            memories.append(memory.value.value)
        array = table.array.copy()  # dnnl_exec_arg_t's, in one array the collector does not track
        array["memory"][table.role_positions] = np.array(memories, np.uintp)[table.role_places]
        made_from = np.array([sized.arguments.primitive for sized in shared], np.uintp)[table.groups]
        primitives = np.array([handles[sized.arguments.primitive].value.value for sized in shared],
                              np.uintp)[table.groups]
        owned.append(HeldArguments(array, list(held.values()), [sized.arguments.keep for sized in shared],
                                   list(handles.values()), made_from.tolist()))
        return primitives, table.counts, table.offsets + np.uintp(array.ctypes.data)


VIEW_HANDLES = 256  # primitive handles a template's views share, least recently used out (as many as VIEWS)


class ViewHandles:
    """A handle of each shared primitive (onednn.own_primitive) that a template's views run, kept across views: a new
    shape at a row count seen before (1 x 2s after 2 x s; the primitive is the rows') makes none (3 for BERT-base,
    ~10 µs each). The views share them because they run under their template's lock, one at a time: no other lock's
    runs share a handle's scratchpad. Views are bound under their segment's resize lock."""

    def __init__(self) -> None:
        self._handles: OrderedDict[int, tuple[Any, Any]] = OrderedDict()  # primitive -> (what keeps it, handle)

    def of(self, arguments: onednn.RoleArguments) -> Any:
        """The views' handle of `arguments`' primitive (kept with what keeps the primitive alive: while it is here,
        no other primitive has its address)."""
        found = self._handles.get(arguments.primitive)
        if found is not None:
            self._handles.move_to_end(arguments.primitive)
            return found[1]
        handle = onednn.own_primitive(arguments.primitive)
        self._handles[arguments.primitive] = (arguments.keep, handle)
        if len(self._handles) > VIEW_HANDLES:
            self._handles.popitem(last=False)
        return handle


@dataclass(frozen=True)
class ArgumentsTable:
    """Where a view's oneDNN members' execution arguments go in its one array, for members of one wiring: which
    members share an answer (`groups`: a layer and its mirrors), the roles of each answer, each member's weight
    and bias. Each entry of the array is a fixed argument (its id and memory object, written once here) or a role
    of a member: the memory object of its answer's descriptor at the member's arena address, one per `places`
    entry (answer, role, address), which a view makes and stores."""

    array: np.ndarray  # _EXEC_ARG: ids, and the fixed arguments' memory objects
    places: tuple[tuple[int, int, int], ...]  # (answer, its role j, address): a memory object each, per view
    role_positions: np.ndarray  # the array's entries of roles ...
    role_places: np.ndarray  # ... and the place of each
    groups: np.ndarray  # each member's answer
    counts: np.ndarray  # each member's arguments (int32) ...
    offsets: np.ndarray  # ... and the byte offset of its first (uintp)

    @classmethod
    def of(cls, binds: list[ArgumentsRewrite], groups: tuple[int, ...], roles: tuple[tuple[tuple[str, int], ...], ...]
           ) -> ArgumentsTable:
        """The table of members `binds` (their ArgumentsRewrite), member i answered by answer groups[i], whose roles
        are roles[groups[i]] ((role, execution argument) each)."""
        ids: list[int] = []
        fixed: list[int] = []  # the memory object of each entry, 0 for a role's
        places: dict[tuple[int, int, int], int] = {}
        role_positions, role_places, counts, firsts = [], [], [], []
        for bind, group in zip(binds, groups):
            firsts.append(len(ids))
            counts.append(len(roles[group]) + len(bind.fixed_ids))
            for j, (role, argument) in enumerate(roles[group]):
                role_positions.append(len(ids))
                role_places.append(places.setdefault((group, j, bind.addresses[role]), len(places)))
                ids.append(argument)
                fixed.append(0)
            ids += bind.fixed_ids
            fixed += bind.fixed_memories
        array = np.empty(len(ids), _EXEC_ARG)
        array["arg"], array["memory"] = ids, fixed
        return cls(array, tuple(places), np.array(role_positions, np.intp), np.array(role_places, np.intp),
                   np.array(groups, np.intp), np.array(counts, np.int32),
                   np.array(firsts, np.uintp) * np.uintp(_EXEC_ARG.itemsize))


_EXEC_ARG = np.dtype([("arg", np.int32), ("memory", np.uintp)], align=True)  # dnnl_exec_arg_t, as C lays it out
