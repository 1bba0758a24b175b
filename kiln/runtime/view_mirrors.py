"""A transformer's layers after its first, as a native segment's view at new sizes sees them (kiln/runtime/
native_views.py _PlanRewrite): a member that reads, by the template's wiring, what a layer one period before it read
(_Mirror) takes that layer's answers without its rule or loop step; consecutive mirrors are copied at once
(_MirrorRun). native_views.py imports this module, which does not import it back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.tactics.tactic import SizedPrimitive


MIRROR_PERIODS = 64  # the longest layer _mirrors looks for (members): its search is this many passes over a segment


@dataclass(frozen=True, slots=True)
class _Mirror:
    """A member that reads, by the template's wiring, what the member `of` (a layer before it of the same rule)
    reads: each input made by a member that mirrors the one making `of`'s, or the same slot, or a size `checks`
    compares per view. Its rule's answer is then `of`'s (rules of one key give equal answers at equal sizes): a view
    copies `of`'s output sizes and oneDNN primitive, and writes its plan from `of`'s values."""

    of: int
    checks: tuple[tuple[int, int], ...]  # (its input's slot, `of`'s): sizes a view compares
    outputs: tuple[tuple[int, int], ...]  # (its output's slot, `of`'s)


@dataclass(frozen=True, slots=True)
class _MirrorRun:
    """Consecutive mirrors of a view's schedule, the first's checks before them (a transformer's layers after its
    first: BERT-base's 76 mirrors are 2 runs), copied by a view at once: what a view's loop does for each (its output
    sizes and oneDNN answer those of the member it mirrors), in the same order, as two dict updates."""

    members: tuple[tuple[int, int, _Mirror], ...]  # the schedule's entries
    checks: tuple[tuple[int, int], ...]  # the first member's
    slots: tuple[int, ...]  # each output slot, in order ...
    sames: tuple[int, ...]  # ... and the one whose size it takes
    layers: tuple[int, ...]  # each oneDNN member, in order ...
    answers_of: tuple[int, ...]  # ... and the member whose answer it takes

    def copy(self, sizes: dict[int, tuple], bound: dict[int, SizedPrimitive]) -> None:
        """The run's sizes and oneDNN answers copied (ValueError where the first's checked sizes differ: the view
        refuses, and the layers are bound one by one). Each update goes in order, so a mirror of a mirror in the
        run takes what the run copied before it."""
        for a, b in self.checks:
            if sizes[a] != sizes[b]:
                raise ValueError("a layer's sizes differ from those of the one it mirrors")
        sizes.update(zip(self.slots, map(sizes.__getitem__, self.sames)))
        if bound:  # a layer whose rows ran on kiln's GEMM (its plan rule's answer) is not in it: nor its mirrors
            bound.update((k, bound[of]) for k, of in zip(self.layers, self.answers_of) if of in bound)


def _mirror_runs(schedule: list[tuple[int, int, _Mirror | None]], members: list[tuple]
                 ) -> list[tuple[int, int, _Mirror | None] | _MirrorRun]:
    """`schedule` with each run of consecutive mirrors, split before every mirror with checks, as a _MirrorRun."""
    steps: list = []
    run: list[tuple[int, int, _Mirror]] = []
    for entry in [*schedule, (None, 0, None)]:
        mirror = entry[2]
        if run and (mirror is None or mirror.checks):
            outputs = [pair for _, _, m in run for pair in m.outputs]
            layers = [(k, m.of) for k, _, m in run if members[k][9] is not None]
            steps.append(_MirrorRun(tuple(run), run[0][2].checks, tuple(s for s, _ in outputs),
                                    tuple(s for _, s in outputs), tuple(k for k, _ in layers),
                                    tuple(of for _, of in layers)))
            run = []
        if mirror is None:
            if entry[0] is not None:
                steps.append(entry)
        else:
            run.append(entry)
    return steps


def _mirrors(members: list[tuple], counts: list[int], sizes: dict[int, tuple]
             ) -> tuple[list[tuple[int, int, _Mirror | None]], np.ndarray, int]:
    """(every member's (index, how many values its rule gives, its _Mirror or None), where each value in member order
    is among those of the members a view evaluates, how many those give). The period of the mirrors is the one that
    makes the most (a transformer's layer: of BERT-base's 91 members a view evaluates 15, 76 copy); a
    member mirrors one whose template sizes equal its own, so a view that finds them unequal is bound otherwise."""
    made: dict[int, tuple[int, int]] = {}  # slot -> (member, output j), of slots one member writes
    for k, member in enumerate(members):
        for j, slot in member[5]:
            made[slot] = (k, j) if slot not in made else (-1, -1)
    best: dict[int, _Mirror] = {}
    for period in range(1, min(len(members) // 2, MIRROR_PERIODS) + 1):
        found: dict[int, _Mirror] = {}
        for k in range(period, len(members)):
            mirror = _mirror(members[k], members[k - period], k - period, period, made, found, sizes)
            if mirror is not None:
                found[k] = mirror
        if len(found) > len(best):
            best = found
    schedule, remap, evaluated, start = [], [], 0, {}
    for k, count in enumerate(counts):
        mirror = best.get(k)
        if mirror is None:
            start[k] = evaluated
            evaluated += count
        else:
            start[k] = start[mirror.of]
        remap += range(start[k], start[k] + count)
        schedule.append((k, count, mirror))
    return schedule, np.array(remap, np.intp), evaluated


def _arena_checks(arena: list[tuple[int, int, int]], schedule: list[tuple[int, int, _Mirror | None]]
                  ) -> list[tuple[int, int, int]]:
    """The arena's (slot, itemsize, capacity) checks a view makes: a mirror's output is as large as its mirrored
    member's (else the view stops at the mirror's checks), so each slot is checked as the first slot it copies,
    once per itemsize at the least capacity of those (BERT-base: 90 checks -> 15)."""
    copied = {slot: same for _, _, mirror in schedule if mirror is not None for slot, same in mirror.outputs}
    least: dict[tuple[int, int], int] = {}
    for slot, itemsize, capacity in arena:
        while slot in copied:
            slot = copied[slot]
        least[slot, itemsize] = min(capacity, least.get((slot, itemsize), capacity))
    return [(slot, itemsize, capacity) for (slot, itemsize), capacity in least.items()]


def _mirror(member: tuple, earlier: tuple, of: int, period: int, made: dict[int, tuple[int, int]],
            found: dict[int, _Mirror], sizes: dict[int, tuple]) -> _Mirror | None:
    """`member`'s _Mirror of `earlier` (member `of`), or None: another rule or wiring, a member without a rule, or an
    input of another template size."""
    rule, _at, reads, x, residual, outputs, _placed, follows, _read, bind = member
    rule_e, _, reads_e, x_e, residual_e, outputs_e, _, follows_e, _, bind_e = earlier
    key = rule.key if rule is not None else bind.rule.key if bind is not None else None
    key_e = rule_e.key if rule_e is not None else bind_e.rule.key if bind_e is not None else None
    if key is None or key != key_e or (rule is None) != (rule_e is None) or follows != follows_e \
            or (reads is None) != (reads_e is None) or (residual is None) != (residual_e is None) \
            or [j for j, _ in outputs] != [j for j, _ in outputs_e]:
        return None
    slots = [slot for _, slot in reads] if reads is not None else [x]
    slots_e = [slot for _, slot in reads_e] if reads_e is not None else [x_e]
    if len(slots) != len(slots_e):
        return None
    checks = []
    for a, b in zip(slots + [residual], slots_e + [residual_e]):
        if a == b:
            continue
        maker, maker_e = made.get(a), made.get(b)
        if maker is not None and maker[0] >= 0 and maker_e == (maker[0] - period, maker[1]) \
                and maker[0] in found and found[maker[0]].of == maker_e[0]:
            continue  # made by a member that mirrors the one making b: equal sizes
        if sizes.get(a) is None or sizes.get(a) != sizes.get(b):
            return None
        checks.append((a, b))
    return _Mirror(of, tuple(checks), tuple((slot, slot_e) for (_, slot), (_, slot_e) in zip(outputs, outputs_e)))
