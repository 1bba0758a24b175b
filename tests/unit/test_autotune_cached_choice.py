"""A timing-cache hit whose winner fails the check on this layer's inputs (kiln/builder/autotune.py, step 3):
the layer takes the next fastest cached candidate that passes, not its default.

Issue 12, ResNet-50 FP8 at batch 256 on the H200 (opt level 3): node_Conv_896 timed every candidate and took an FP8
fast-accumulation tile, which passed its check on that layer's data; node_Conv_905, the same shape, hit the cache,
its data failed the same tile ("float8 results differ by up to 40 steps of their grid"), and it ran its default
(1.05 ms; the next candidate took 0.033 ms). Here a tactic that saturates at ±SATURATION stands for it: within the
tolerance on small products, far off on large ones. The timings are injected (`measure` replaced): they decide.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln.builder import autotune
from kiln.builder.layer_records import Recorded
from kiln.builder.timing_cache import TimingCache
from kiln.plan.spec import StepSpec
from kiln.tactics.tactic import DEFAULT, Tactic

CPU = torch.device("cpu")
SATURATION = 3.0
SATURATING, EXACT, EXACT_SLOWER = (f"cpu.test_cached_choice.{n}" for n in ("saturating", "exact", "exact_slower"))
TIMES_MS = {DEFAULT: 1.0, SATURATING: 0.03, EXACT: 0.05, EXACT_SLOWER: 0.07}


def _mul(ctx, x, w):
    return x * w


def _tactic(name: str, fn) -> Tactic:
    return Tactic(name=name, op_type="Mul", domain="", device="cpu", dtypes=(torch.float32,),
                  supports=lambda step, inputs: True, prepare=lambda step, constants, device: fn)


TACTICS = [_tactic(SATURATING, lambda ctx, x, w, **_: (x * w).clamp(-SATURATION, SATURATION)),
           _tactic(EXACT, lambda ctx, x, w, **_: x * w),
           _tactic(EXACT_SLOWER, lambda ctx, x, w, **_: x * w)]


@pytest.fixture
def injected_times(monkeypatch):
    """Every candidate timed at TIMES_MS, whatever calls `measure` (the search, its re-timing passes)."""
    timed: list[list[str]] = []

    def measure(fns, device, runs, **clocked):
        timed.append(sorted(fns))
        return {name: TIMES_MS[name] for name in fns}

    monkeypatch.setattr(autotune, "measure", measure)
    return timed


def _layer(name: str) -> StepSpec:
    return StepSpec(op_type="Mul", name=name, inputs=["x", "w"], outputs=["y"], attributes={}, domain="", opset=14)


def _tune(name: str, scale: float, cache: TimingCache, tactics: list[Tactic] = TACTICS, seed: int = 0):
    """Tune one Mul layer on fresh inputs of |x·w| up to ~scale·4 (the shape, and so the cache key, of every call)."""
    generator = torch.Generator().manual_seed(seed)
    x, w = torch.randn(256, generator=generator) * scale, torch.randn(256, generator=generator)
    found, _ = autotune._tune_layer(_layer(name), Recorded([x, w], _mul(None, x, w)), _mul, None, {}, [None, None],
                                    tactics, CPU, cache, {}, runs=3)
    return found


def test_an_identical_layer_whose_data_fails_the_cached_winner_takes_the_next_fastest(injected_times):
    cache = TimingCache(None)
    first = _tune("conv_896", scale=0.2, cache=cache)  # |x·w| < 3: the saturating tactic is exact here
    assert first.tactic == SATURATING and not first.cached
    assert injected_times  # a miss: timed

    timed_before = len(injected_times)
    second = _tune("conv_905", scale=10.0, cache=cache, seed=1)  # products up to ~40: saturating is far off
    assert second.cached and len(injected_times) == timed_before  # a hit: nothing timed again
    assert second.candidates[SATURATING].startswith("rejected: "), second.candidates
    assert second.tactic == EXACT and second.time_ms == TIMES_MS[EXACT]
    assert second.runner_up == EXACT_SLOWER  # a rejected candidate is nobody's runner-up
    assert autotune.fallback_reason(second) is None


def test_a_hit_whose_every_candidate_fails_runs_the_default_and_says_why(injected_times):
    cache = TimingCache(None)
    saturating_only = TACTICS[:1]
    assert _tune("conv_896", scale=0.2, cache=cache, tactics=saturating_only).tactic == SATURATING
    found = _tune("conv_905", scale=10.0, cache=cache, tactics=saturating_only, seed=1)
    assert found.cached and found.tactic == DEFAULT and found.time_ms == TIMES_MS[DEFAULT]
    reason = autotune.fallback_reason(found)
    assert reason is not None and "every candidate (1) was rejected" in reason


def test_a_hit_whose_winner_passes_checks_only_the_winner(injected_times):
    cache = TimingCache(None)
    _tune("conv_896", scale=0.2, cache=cache)
    prepared: list[str] = []
    counting = [dataclasses.replace(t, prepare=lambda step, c, d, t=t: prepared.append(t.name) or t.prepare(step, c, d))
                for t in TACTICS]
    found = _tune("conv_905", scale=0.2, cache=cache, tactics=counting, seed=1)
    assert found.cached and found.tactic == SATURATING and prepared == [SATURATING]
