"""A size rule's answers at new sizes as closed forms of those sizes, traced from the rule itself.

A native segment's view at new input sizes asks each layer shape's rule (NativeStep.plan_at, a PlanRule) for its
plan fields; at a new (batch, sequence) every rule is new, and a rule is tens of microseconds of Python (attention's
~70). A TracedRule runs the rule once more with its sizes as symbols (_Dim): a symbol carries the arithmetic done on
it (products, sums: a stride, a row count) as an expression of the input dims, and records each comparison the rule
makes with it and each value it reads as an integer (`int()`, an index, a hash) as a guard (the expression and what
it gave). The rule's answer, its symbols written as their expressions, compiles to one function of the dims; the
guards key it. At other sizes, the guards evaluated on them give the same outcomes only where the rule, run there,
would take the same path (it is deterministic in the sizes: every use of a size's value is a guard), so it would
compute the same expressions: the compiled answer is the rule's. A new batch at a known sequence length follows the
same path (the sizes are only multiplied); a row count a rule compares with thresholds (kiln's GEMM) keys it by
those outcomes.

Kept honest: a trace whose compiled answer differs from the rule's own at the traced sizes (a rule that branches
on its sizes' type), or a rule that does with a symbol what a symbol does not support, is not kept: that rule is
then always run (the answer is the rule's either way).
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import chain
from typing import Any

from kiln.tactics.tactic import PlanRule, SizedPlan

TRACES = 16  # paths kept per rule (each adds its guards to one compiled function): past these, the rule runs


class _Untraceable(Exception):
    """The rule used a symbol in a way it cannot follow, or answered something it cannot compile."""


class _Trace:
    """One traced run's guards: (expression source, its outcome) in the order the rule observed them."""

    __slots__ = ("guards", "seen")

    def __init__(self):
        self.guards: list[tuple[str, Any]] = []
        self.seen: dict[str, Any] = {}

    def observe(self, source: str, outcome: Any) -> Any:
        if source not in self.seen:
            self.seen[source] = outcome
            self.guards.append((source, outcome))
        return outcome


def _source(x: Any) -> str | None:
    """An operand's expression source: a symbol's, an int's literal, None for anything else."""
    if type(x) is _Dim:
        return x.source
    if type(x) is int:
        return repr(x)
    return None


_IDENTITY = {("*", 1), ("+", 0), ("-", 0), ("//", 1)}  # x op n == x (n on the right; * and + on either side)


def _arithmetic(symbol: str, function: Callable[[int, int], int], reflected: bool = False):
    def method(self: _Dim, other: Any) -> Any:
        source = _source(other)
        value = other.value if type(other) is _Dim else other
        if source is None:  # a float, a bool...: the value is read
            self.trace.observe(self.source, self.value)
            return function(value, self.value) if reflected else function(self.value, value)
        if type(other) is int and (symbol, other) in _IDENTITY and (not reflected or symbol in "*+"):
            return self  # `1*d[0]` (a product's start) is d[0]: shorter closed forms, less code a view runs
        if reflected:
            return _Dim(f"({source}{symbol}{self.source})", function(value, self.value), self.trace)
        return _Dim(f"({self.source}{symbol}{source})", function(self.value, value), self.trace)
    return method


def _comparison(symbol: str, function: Callable[[int, int], bool]):
    def method(self: _Dim, other: Any) -> Any:
        source = _source(other)
        value = other.value if type(other) is _Dim else other
        if source is None:
            self.trace.observe(self.source, self.value)
            return function(self.value, value)
        return self.trace.observe(f"({self.source}{symbol}{source})", function(self.value, value))
    return method


def _read(function: Callable[[int], Any]):
    def method(self: _Dim, *args: Any) -> Any:
        self.trace.observe(self.source, self.value)  # the value itself is read: a guard on it
        return function(self.value, *args)
    return method


class _Dim:
    """A size as a traced rule sees it: its value, and its expression in the input dims (`d[j]`, the j-th dim of
    the rule's sizes flattened). Arithmetic with ints gives symbols; a comparison or a read of the value is a
    guard. Not an int subclass: C code could read an int's value without a guard."""

    __slots__ = ("source", "value", "trace")

    def __init__(self, source: str, value: int, trace: _Trace):
        self.source, self.value, self.trace = source, value, trace

    __add__, __radd__ = _arithmetic("+", operator.add), _arithmetic("+", operator.add, True)
    __sub__, __rsub__ = _arithmetic("-", operator.sub), _arithmetic("-", operator.sub, True)
    __mul__, __rmul__ = _arithmetic("*", operator.mul), _arithmetic("*", operator.mul, True)
    __floordiv__, __rfloordiv__ = _arithmetic("//", operator.floordiv), _arithmetic("//", operator.floordiv, True)
    __mod__, __rmod__ = _arithmetic("%", operator.mod), _arithmetic("%", operator.mod, True)
    __eq__, __ne__ = _comparison("==", operator.eq), _comparison("!=", operator.ne)
    __lt__, __le__ = _comparison("<", operator.lt), _comparison("<=", operator.le)
    __gt__, __ge__ = _comparison(">", operator.gt), _comparison(">=", operator.ge)

    def __neg__(self) -> _Dim:
        return _Dim(f"(-{self.source})", -self.value, self.trace)

    def __bool__(self) -> bool:
        return self.trace.observe(f"({self.source}!=0)", self.value != 0)

    __index__ = __int__ = __hash__ = _read(int)
    __float__ = _read(float)
    __abs__ = _read(abs)
    __truediv__ = _read(operator.truediv)
    __repr__ = __str__ = _read(repr)
    __format__ = _read(format)


def _flatten(sizes: Any) -> tuple[tuple, tuple[int, ...]]:
    """(the sizes' structure: which inputs in which order, each size's rank; every dim in that order). The order is
    the caller's: a rule may answer in the order it iterates its sizes (a view writes fields in their order)."""
    if type(sizes) is dict:
        return tuple((k, len(v)) for k, v in sizes.items()), tuple(d for v in sizes.values() for d in v)
    return len(sizes), tuple(sizes)


def _symbolic(sizes: Any, trace: _Trace) -> Any:
    """The sizes with each dim a symbol `d[j]`, in _flatten's order."""
    counter = iter(range(1 << 30))
    symbols = lambda size: tuple(_Dim(f"d[{next(counter)}]", int(v), trace) for v in size)  # noqa: E731
    if type(sizes) is dict:
        return {k: symbols(v) for k, v in sizes.items()}
    return symbols(sizes)


def _written(value: Any) -> str:
    """Python source building `value` (an answer's part) from the dims `d`."""
    if type(value) is _Dim:
        return value.source
    if type(value) in (int, bool):
        return repr(value)
    if type(value) is tuple:
        return "(" + "".join(_written(v) + ", " for v in value) + ")"
    if type(value) is dict and all(type(k) is str for k in value):
        return "{" + ", ".join(f"{k!r}: {_written(v)}" for k, v in value.items()) + "}"
    raise _Untraceable(f"an answer holding a {type(value).__name__}")


def _condition(guards: list[tuple[str, Any]]) -> str:
    """Python source true where every guard gives its traced outcome."""
    tests = [(source if outcome else f"not {source}") if type(outcome) is bool else f"{source} == {outcome!r}"
             for source, outcome in guards]
    return " and ".join(tests) or "True"


_UNTRACED = threading.local()  # `on`: this thread's rules answer untraced (untraced())


@contextmanager
def untraced() -> Iterator[None]:
    """Within it, this thread's TracedRules run a rule off every traced path without tracing it (the path left to
    a later trace, another thread's: native_views._PlanRewrite.view defers a call's traces to the background)."""
    before = getattr(_UNTRACED, "on", False)
    _UNTRACED.on = True
    try:
        yield
    finally:
        _UNTRACED.on = before


class TracedRule:
    """A PlanRule (NativeStep.plan_at) answering from its traced closed forms where the sizes follow a traced path,
    else by running it (and tracing that path, up to TRACES, where the rule is `traceable`).

    Per structure of its sizes (which inputs, their ranks), the paths compile to one function of the dims: each
    path's guards as one condition, then its answer; the first path whose guards hold answers (any would: a path
    whose every guard holds is the one the rule takes)."""

    def __init__(self, rule: PlanRule):
        self.rule, self.key = rule, rule.key
        self._paths_of: dict[tuple, list[str]] = {}  # per structure (_flatten's): each path's source
        self._answers: dict[tuple, Callable] = {}  # ... compiled: dims -> SizedPlan, or None off every path
        self._paths = 0
        self._traceable = rule.traceable  # else the rule is always run
        self._lock = threading.Lock()

    def __call__(self, sizes: Any) -> SizedPlan:
        structure, dims = _flatten(sizes)
        answers = self._answers.get(structure)
        if answers is not None and (found := answers(dims)) is not None:
            return found
        answer = self.rule(sizes)
        if self._traceable and self._paths < TRACES and not getattr(_UNTRACED, "on", False):
            self._trace(sizes, structure, dims, answer)
        return answer

    def at(self, names: tuple | None, read: tuple[tuple[int, ...], ...]) -> SizedPlan:
        """`self({names[j]: read[j]})` (names None: `self(read[0])`, a layer of one input), what a segment's view asks
        per layer shape: the structure and dims taken from the tuples by C iteration, the dict built only where no
        traced path answers (_flatten's per-dim generator and the dict were ~1/3 of a rule's ~14 µs, BERT-base). A
        structure with a name twice (a dict would keep one) is none _flatten makes, so never answered here."""
        if names is None:
            size = read[0]
            structure, dims = len(size), tuple(size)
        else:
            structure, dims = tuple(zip(names, map(len, read))), tuple(chain.from_iterable(read))
        answers = self._answers.get(structure)
        if answers is not None and (found := answers(dims)) is not None:
            return found
        return self(dict(zip(names, read)) if names is not None else read[0])

    def traced(self, names: tuple | None, read: tuple[tuple, ...]) -> SizedPlan | None:
        """at()'s answer from a traced path only, None where none is traced for these sizes: the rule is never run.
        The dims may be symbols (ClosedForms): a path's guards then become the caller's guards, its closed forms
        expressions of the caller's dims."""
        if names is None:
            structure, dims = len(read[0]), tuple(read[0])
        else:
            structure, dims = tuple(zip(names, map(len, read))), tuple(chain.from_iterable(read))
        answers = self._answers.get(structure)
        return None if answers is None else answers(dims)

    def _trace(self, sizes: Any, structure: tuple, dims: tuple[int, ...], answer: SizedPlan) -> None:
        trace = _Trace()
        try:
            traced = self.rule(_symbolic(sizes, trace))
            if type(traced) is not SizedPlan:
                raise _Untraceable(f"an answer of type {type(traced).__name__}")
            path = (f"    if {_condition(trace.guards)}:\n"
                    f"        return SizedPlan({_written(traced.output_sizes)}, {_written(traced.fields)})\n")
        except (_Untraceable, TypeError, AttributeError, ValueError):  # what a symbol does not support: run the rule
            self._traceable = False
            return
        with self._lock:
            paths = self._paths_of.get(structure, []) + [path]
            namespace = {"SizedPlan": SizedPlan}
            exec("def answers(d):\n" + "".join(paths) + "    return None\n", namespace)  # noqa: S102
            answers = namespace.pop("answers")  # not left in its own globals: a reference cycle
            found = answers(dims)
            if found != answer or list(found.fields) != list(answer.fields):  # another path for symbols than ints
                self._traceable = False
                return
            self._paths_of[structure], self._answers[structure] = paths, answers
            self._paths += 1


class ClosedForms:
    """A computation over int dims answered from its traced closed forms, as TracedRule answers a rule: each path
    (its guards' outcomes) is traced once, by the caller running the computation on symbols (`learn`), and compiled
    into a function of the dims (TRACES at most, tried in order). A computation built of traced rules' answers
    (TracedRule.traced on symbols) and integer arithmetic, with a guard on each size it branches on, is then one call:
    a native segment's view at new sizes (kiln/runtime/view_trace.py). Its answer is a tuple of ints, symbols and
    tuples. A function per path: a new path compiles only its own source (BERT-base's walk: ~10 KB a path; one
    function of every path made the n-th path's trace recompile n of them)."""

    def __init__(self) -> None:
        self._paths: tuple[Callable, ...] = ()  # each path's dims -> the answer, or None where its guards do not hold
        self.traceable = True  # False once a trace failed or disagreed: then learn() does nothing
        self._lock = threading.Lock()

    @property
    def paths(self) -> int:
        return len(self._paths)

    def __call__(self, dims: tuple[int, ...]) -> Any:
        """The answer at `dims` from a traced path, or None (no path's guards hold: the caller computes it)."""
        for answer in self._paths:
            found = answer(dims)
            if found is not None:
                return found
        return None

    def learn(self, dims: tuple[int, ...], compute: Callable[[tuple], Any], expected: Any) -> bool:
        """Trace `compute` (the computation, on a tuple of dims) on symbols standing for `dims`, where it answered
        `expected`, and add its path. False where it is not added: TRACES paths already, `compute` answered None (it
        cannot follow this path: another may be traced), or it did with a symbol what a symbol does not support (or
        raised Untraceable: a part it can never follow), or the compiled path's answer at `dims` is not `expected`
        (in those two cases no path is added again)."""
        if not self.traceable or len(self._paths) >= TRACES:
            return False
        trace = _Trace()
        try:
            traced = compute(tuple(_Dim(f"d{j}", int(v), trace) for j, v in enumerate(dims)))
            if traced is None:
                return False
            # the dims unpacked once into locals: BERT's walk reads them ~150 times (a subscript each before)
            unpack = f"    {''.join(f'd{j}, ' for j in range(len(dims)))}= d\n" if dims else ""
            source = f"def answer(d):\n{unpack}    if {_condition(trace.guards)}:\n" \
                     f"        return {_written(traced)}\n    return None\n"
        except (_Untraceable, TypeError, AttributeError, ValueError, ArithmeticError):
            self.traceable = False
            return False
        namespace: dict[str, Any] = {}
        exec(source, namespace)  # noqa: S102
        answer = namespace.pop("answer")  # not left in its own globals: a reference cycle
        if answer(dims) != expected:
            self.traceable = False
            return False
        with self._lock:
            if len(self._paths) < TRACES:
                self._paths = (*self._paths, answer)  # replaced whole: a reader holds one tuple
        return True


class Untraceable(_Untraceable):
    """Raised by a ClosedForms computation at a part it cannot follow on symbols: no path is traced."""
