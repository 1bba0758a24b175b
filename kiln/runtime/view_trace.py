"""A native segment's view at new sizes as one generated function of the entry dims (kiln/runtime/native_views.py).

_PlanRewrite.view walks a template's members at new entry sizes: per layer shape a traced rule's closed forms
(kiln/tactics/traced_rules.py), the mirrors' copies, the residual, mirror and arena checks, and gathers the plan
fields it writes. A first call pays that walk right after a run has cooled the caches: ~0.3 ms for BERT-base's 91
members (15 evaluated, 2 runs of mirrors), ~60 µs of it hot. Where every member the walk evaluates has a rule,
what it finds (the plan fields, the exits' sizes) is a function of the entry dims alone, so the walk itself can be
traced: run once on symbols, each rule's path and each check a guard, its answer expressions of the dims
(traced_rules.ClosedForms). A view at sizes on a traced path is then one call of that function, the plans written
from its values as before.

Exact: the symbols' walk is the view's walk with its int-only parts left out (members without a rule, oneDNN
arguments: such a walk is never traced; a oneDNN layer whose rows on kiln's GEMM have a plan rule is traced at those
rows only, its rule's guards keeping the others off the path), each rule answering from the same traced path the view's call would
take; a path whose compiled answer at the traced sizes is not the walk's own is not kept (tests/unit/
test_native_binding.py compares views bound both ways, byte for byte).
"""

from __future__ import annotations

import functools
import math
from itertools import chain
from typing import Any

from kiln.tactics.traced_rules import ClosedForms, Untraceable


class ViewTrace:
    """A _PlanRewrite's walks at new sizes as closed forms of the entry dims: (the values its rules write, in member
    order; each exit's sizes; each exit's strides), or None off every traced path. The strides follow the sizes
    (_PlanRewrite.exit_strides on symbols): a view's exits cost no Python of their own."""

    def __init__(self, entries: list[int], ranks: tuple[int, ...]):
        """`entries`: the template's entry slots, `ranks` their ranks (a view's key has them: _PlanRewrite.view
        checks). It does not hold its _PlanRewrite (which holds it: a reference back would be a cycle): learn() is
        given it."""
        self._entries, self._ranks = list(entries), ranks
        self._forms = ClosedForms()
        self.ahead = False  # whether the load's view job traced it (_PlanRewrite._ahead: a call's misses defer theirs)

    @property
    def ranks(self) -> tuple[int, ...]:
        return self._ranks

    @property
    def paths(self) -> int:
        return self._forms.paths

    @property
    def traceable(self) -> bool:
        """False once a trace failed or disagreed (ClosedForms.learn then adds no path)."""
        return self._forms.traceable

    def __call__(self, key: tuple) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]
                                            ] | None:
        try:
            return self._forms(tuple(chain.from_iterable(key)))
        except ArithmeticError:  # a closed form's division by zero: the view's walk raises it as the rule would
            return None

    def learn(self, rewrite: Any, key: tuple, values: list[int], exits: list[tuple[int, ...]]) -> bool:
        """Trace `rewrite`'s walk (the _PlanRewrite's schedule, members, arena checks and exits) at `key`, where its
        view found `values` (in member order) and exit sizes `exits`."""
        exits = tuple(tuple(size) for size in exits)
        return self._forms.learn(tuple(chain.from_iterable(key)), functools.partial(self._walk, rewrite),
                                 (tuple(values), exits, rewrite.exit_strides(exits)))

    def _walk(self, rewrite: Any, dims: tuple) -> tuple[tuple, tuple, tuple] | None:
        """`rewrite`'s view's walk on `dims` (symbols) where every member it evaluates has a rule: the values, the
        exits' sizes and strides, or None where a check refuses (the view would) or a rule has no traced path there."""
        it = iter(dims)
        key = [tuple(next(it) for _ in range(rank)) for rank in self._ranks]
        sizes = dict(zip(self._entries, key))
        values: list[Any] = []
        worked: dict[tuple, tuple[tuple, list[Any]]] = {}  # as the view's, by the sizes' expressions
        for step in rewrite._steps:
            if type(step) is not tuple:  # a run of mirrors: its checks (guards) and copies
                if any(rewrite._members[k][0] is None for k in step.layers):
                    raise Untraceable("a oneDNN member's mirrors")  # (a layer with a plan rule: its rows traced)
                step.copy(sizes, {})
                continue
            k, count, _mirror = step
            rule, _at, _reads, _x, residual, outputs, _placed, follows, read, _bind = rewrite._members[k]
            if rule is None:
                raise Untraceable("a member without a rule")  # its NativeStep or oneDNN arguments: int-only
            read_sizes = tuple(map(sizes.__getitem__, read))
            at_sizes = (follows, tuple(tuple(getattr(d, "source", d) for d in size) for size in read_sizes))
            found = worked.get(at_sizes)
            if found is None:
                sized = rule.traced(follows[1], read_sizes)
                if sized is None:
                    return None
                found = worked[at_sizes] = (sized.output_sizes, sized.flat_values())
            if len(found[1]) != count:
                return None
            written = found[0]
            values += found[1]
            if residual is not None and sizes[residual] != written[0]:
                return None
            for j, slot in outputs:
                sizes[slot] = written[j]
        if len(values) != rewrite._values:
            return None
        for s, itemsize, capacity in rewrite._arena:
            if math.prod(sizes[s]) * itemsize > capacity:
                return None
        exits = tuple(tuple(sizes[s]) for s, _dtype, _nhwc in rewrite._exits)
        return tuple(values), exits, rewrite.exit_strides(exits)
