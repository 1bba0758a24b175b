"""The tactic search times a layer's candidates in a tournament (kiln/builder/autotune.py `tournament`): the best so
far against the next, the loser's prepared state let go at once. Held all together while timed, a layer's candidates
set ResNet-50's build peak (bench/results/mem8-2026-12-06.md). What must hold: no more than two candidates prepared
at a time (weakrefs to their launches, not a resident-memory threshold), and the same times choose the same tactic as
timing them all together did (the rule, _choose_over, applied to every candidate's times)."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch

from kiln.builder import autotune
from kiln.builder.layer_records import Recorded
from kiln.builder.timing_cache import TimingCache
from kiln.ops.fused import fused_conv
from kiln.plan.spec import StepSpec
from kiln.runtime.step import OpContext
from kiln.tactics import registry
from kiln.tactics.tactic import DEFAULT, Tactic

CPU = torch.device("cpu")


def _mul(ctx, x, w):
    return x * w


class _Launch:
    """A candidate's prepared state: weakref-able, so the test sees when it dies."""

    def __init__(self, offset: float):
        self.offset = offset

    def __call__(self, ctx, x, w, **_):
        return x * w + self.offset


class _Tracked:
    """Tactics whose launches are tracked: `alive_at_prepare` is how many earlier launches were alive each time one
    was prepared."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch
        self.refs: list[weakref.ref] = []
        self.alive_at_prepare: list[int] = []

    def tactic(self, name: str, offset: float = 0.0, native: bool = False) -> Tactic:
        def prepare(step, constants, device):
            # no collection forced: a loser kept alive by a reference cycle would stay until the next one, as in a build
            self.alive_at_prepare.append(sum(ref() is not None for ref in self.refs))
            launch = _Launch(offset)
            self.refs.append(weakref.ref(launch))
            return launch

        tactic = Tactic(name=f"cpu.test_tournament.{name}", op_type="Mul", domain="", device="cpu",
                        dtypes=(torch.float32,), supports=lambda step, inputs: True, prepare=prepare, native=native)
        # registered for this test only: the rule reads a tactic's `native` from the registry
        self.monkeypatch.setitem(registry._TACTICS, tactic.name, tactic)
        return tactic


def _step() -> StepSpec:
    return StepSpec(op_type="Mul", name="mul", inputs=["x", "w"], outputs=["y"], attributes={}, domain="", opset=14)


@pytest.fixture
def injected(monkeypatch):
    """`measure` replaced: every candidate timed at times[name] (a dict the test fills), each call recorded."""
    times: dict[str, float] = {}
    calls: list[list[str]] = []

    def measure(fns, device, runs, **clocked):
        calls.append(list(fns))
        for fn in fns.values():
            fn()  # as measure runs them: the launch must still be alive
        return {name: times[name] for name in fns}

    monkeypatch.setattr(autotune, "measure", measure)
    # the wall clock, whatever the machine's load (under load a match's close pair is timed again: contenders_again)
    monkeypatch.setattr(autotune, "cpu_clock", lambda threads: autotune.WALL)
    monkeypatch.setattr(autotune, "TOURNAMENT", True)
    return times, calls


def _tune(tactics: list[Tactic], others: dict | None = None):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(64, generator=g), torch.randn(64, generator=g)
    others = {label: Recorded([x[:n], w[:n]], _mul(None, x[:n], w[:n])) for label, n in (others or {}).items()}
    return autotune._tune_layer(_step(), Recorded([x, w], _mul(None, x, w)), _mul, None, {}, [None, None], tactics,
                                CPU, TimingCache(None), {}, runs=3, others=others)


def test_no_more_than_two_candidates_are_prepared_at_a_time_and_losers_die_at_once(injected, monkeypatch):
    times, calls = injected
    tracked = _Tracked(monkeypatch)
    names = ["a", "b", "c", "d", "e"]
    tactics = [tracked.tactic(n) for n in names]
    times.update({DEFAULT: 5.0, **{t.name: ms for t, ms in zip(tactics, [3.0, 4.0, 1.0, 2.0, 6.0])}})
    found, _ = _tune(tactics)
    assert found.tactic == tactics[2].name  # "c", the fastest
    # when each was prepared, at most the best so far was alive: "a" (best after beating the default) at b's and c's
    # prepare, then "c" (which beat "a": a let go) at d's and e's
    assert tracked.alive_at_prepare == [0, 1, 1, 1, 1]
    assert all(ref() is None for ref in tracked.refs)  # and none outlives the layer
    # every match is the best so far against the next, the default first
    assert calls == [[DEFAULT, tactics[0].name], [tactics[0].name, tactics[1].name],
                     [tactics[0].name, tactics[2].name], [tactics[2].name, tactics[3].name],
                     [tactics[2].name, tactics[4].name]]
    assert set(found.candidates) == set(times)  # every candidate's time in the header


def test_a_loser_is_dead_before_the_next_candidate_is_prepared(injected, monkeypatch):
    times, _ = injected
    tracked = _Tracked(monkeypatch)
    slow, fast, next_ = (tracked.tactic(n) for n in ("slow", "fast", "next"))
    times.update({DEFAULT: 9.0, slow.name: 8.0, fast.name: 1.0, next_.name: 2.0})
    _tune([slow, fast, next_])
    refs = dict(zip(("slow", "fast", "next"), tracked.refs))
    assert tracked.alive_at_prepare == [0, 1, 1]  # at next's prepare only "fast" was alive: "slow" had lost
    assert refs["slow"]() is None and refs["fast"]() is None and refs["next"]() is None


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (3, 2, 1, 0), (1, 0, 3, 2), (2, 3, 0, 1), (1, 2, 3, 0)])
def test_the_same_times_choose_the_same_tactic_in_any_order(injected, order, monkeypatch):
    """The tournament's choice is the rule's over every candidate's times, whatever the candidates' order: the native
    preference and credit, the layout preference and the default's tie-break included."""
    times, _ = injected
    tracked = _Tracked(monkeypatch)
    made = [tracked.tactic("plain"), tracked.tactic("native", native=True), tracked.tactic("tied"),
            tracked.tactic("slow")]
    # "native" is slower alone but wins by the native preference; "tied" ties the default (the default wins ties)
    times.update({DEFAULT: 1.0, made[0].name: 0.99, made[1].name: 1.05, made[2].name: 1.0, made[3].name: 3.0})
    found, _ = _tune([made[k] for k in order])
    assert found.tactic == autotune._choose(times) == made[1].name
    assert found.candidates == {k: round(v, 4) for k, v in times.items()}


def test_the_default_keeps_a_tie_and_the_rule_holds_over_a_profile(injected, monkeypatch):
    times, _ = injected
    tracked = _Tracked(monkeypatch)
    a, b, c = (tracked.tactic(n) for n in "abc")
    times.update({DEFAULT: 1.0, a.name: 1.0, b.name: 1.0, c.name: 1.2})
    assert _tune([a, b, c])[0].tactic == DEFAULT

    # a profile's other points: the least summed ratio to each point's best (_choose_over), times per point
    per_point = {"opt": {DEFAULT: 4.0, a.name: 1.0, b.name: 1.1, c.name: 3.0},
                 "mid": {DEFAULT: 4.0, a.name: 3.0, b.name: 1.2, c.name: 1.0}}

    def measure(fns, device, runs, **clocked):
        n = next(iter(fns.values()))().numel()  # which point: its output's length
        return {name: per_point["opt" if n == 64 else "mid"][name] for name in fns}

    monkeypatch.setattr(autotune, "measure", measure)
    found, _ = _tune([a, b, c], others={"mid": 16})
    assert found.tactic == autotune._choose_over([per_point["opt"], per_point["mid"]]) == b.name
    assert found.at == {"mid": {k: round(v, 4) for k, v in per_point["mid"].items()}}


def test_a_real_conv_layers_candidates_are_let_go_one_by_one(monkeypatch):
    """The CPU conv tactics of a 3x3 layer, timed for real: each candidate's launch (its packed weight) dead by the
    time the one after next is prepared, none after the layer; the choice is the rule's over the times measured."""
    monkeypatch.setattr(autotune, "TOURNAMENT", True)
    g = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(1, 16, 12, 12, generator=g), torch.randn(32, 16, 3, 3, generator=g) * 0.2, \
        torch.randn(32, generator=g)
    attrs = dict(pads=[1] * 4, strides=[1, 1], group=1, activation="Relu", kernel_shape=[3, 3])
    ctx = OpContext(name="conv", op_type="FusedConv", domain="kiln")
    step = StepSpec("FusedConv", "conv", ["x", "w", "b"], ["y"], attrs, domain="kiln")
    refs: list[weakref.ref] = []
    alive: list[int] = []

    def tracked(t: Tactic) -> Tactic:
        def prepare(step, constants, device):
            alive.append(sum(ref() is not None for ref in refs))
            launch = t.prepare(step, constants, device)
            refs.append(weakref.ref(launch))
            return launch
        return dataclasses.replace(t, prepare=prepare)

    tactics = [tracked(t) for t in registry.candidates("FusedConv", "kiln", "cpu", opt_level=2)]
    cache = TimingCache(None)
    found, _ = autotune._tune_layer(step, Recorded([x, w, b], fused_conv(ctx, x, w, b, **attrs)), fused_conv, ctx,
                                    attrs, [None, w, b], tactics, CPU, cache, {}, runs=3)
    admitted = [name for name, v in found.candidates.items() if name != DEFAULT and isinstance(v, float)]
    assert len(admitted) >= 3, found.candidates  # enough candidates for a tournament
    assert max(alive) <= 1, alive
    assert all(ref() is None for ref in refs)
    (entry,) = cache.entries.values()
    assert found.tactic == autotune._choose(entry["times_ms"])


@pytest.mark.parametrize("order", [0, 1, 2])
def test_together_the_default_times_every_candidate_at_once_and_chooses_as_the_tournament(injected, order,
                                                                                         monkeypatch):
    """Without KILN_TUNE_TOURNAMENT the search prepares every candidate, times them in one measure call per point,
    and the same times choose the same tactic as the tournament's."""
    times, calls = injected
    tracked = _Tracked(monkeypatch)
    tactics = [tracked.tactic(n) for n in ("a", "b", "c")]
    times.update({DEFAULT: 1.0, tactics[0].name: 0.9, tactics[1].name: 0.5, tactics[2].name: 0.7})
    tactics = tactics[order:] + tactics[:order]
    monkeypatch.setattr(autotune, "TOURNAMENT", True)
    by_tournament, _ = _tune(tactics)
    calls.clear()
    monkeypatch.setattr(autotune, "TOURNAMENT", False)
    together, _ = _tune(tactics)
    assert together.tactic == by_tournament.tactic == tactics[(1 - order) % 3].name
    assert len(calls[0]) == 4  # the default and all three candidates in one call
