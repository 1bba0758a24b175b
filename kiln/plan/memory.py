"""Activation memory plan: liveness intervals -> offsets in one arena (greedy best fit).

Sizes come from the shapes known at build (symbolic dims take the profile's value, or 1).
The runtime frees every activation after its last use, which is what this plan assumes; the
report compares the planned arena (peak of live bytes, with reuse) to the naive sum.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.plan.spec import ProgramSpec

ALIGN = 64


@dataclass
class Interval:
    name: str
    size: int
    start: int  # step that produces it
    end: int  # last step that reads it (or the end, for outputs)
    offset: int = -1


def place(intervals: list[Interval]) -> list[Interval]:
    """Offsets for `intervals` (in place; returned): the largest first, each at the lowest offset
    that overlaps no interval live in any of the same steps (both ends inclusive: a step's output
    never shares memory with its inputs)."""
    placed: list[Interval] = []
    for iv in sorted(intervals, key=lambda x: (-x.size, x.start)):
        busy = sorted((p.offset, p.offset + p.size) for p in placed if p.start <= iv.end and iv.start <= p.end)
        offset = 0
        for lo, hi in busy:
            if offset + iv.size <= lo:
                break
            offset = max(offset, hi)
        iv.offset = offset
        placed.append(iv)
    return placed


def plan_arena(program: ProgramSpec, sizes: dict[str, int | None]) -> dict:
    """Returns {"peak_bytes", "naive_bytes", "unknown": [...], "offsets": {name: (offset, size)}}."""
    produced: dict[str, int] = {}
    last: dict[str, int] = {}
    n = len(program.steps)
    for i, step in enumerate(program.steps):
        for name in step.outputs:
            if name:
                produced[name] = i
        for name in [*step.inputs, *step.captures]:
            if name:
                last[name] = i
    for name in program.outputs:
        last[name] = n
    intervals, unknown = [], []
    for name, start in produced.items():
        size = sizes.get(name)
        if size is None:
            unknown.append(name)
            continue
        size = (size + ALIGN - 1) // ALIGN * ALIGN
        intervals.append(Interval(name, size, start, last.get(name, start)))
    placed = place(intervals)
    peak = max((p.offset + p.size for p in placed), default=0)
    return {
        "peak_bytes": peak,
        "naive_bytes": sum(p.size for p in placed),
        "unknown": unknown,
        "offsets": {p.name: [p.offset, p.size] for p in placed},
    }
