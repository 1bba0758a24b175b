"""The choice between a native segment's parallel and serial forms (kiln/runtime/form_choice.py), on made-up
run times: which form runs first, that the faster runs, how often the other is probed, how fast a change of
load is followed, and that one slow run changes nothing. Times in ms-like units; no clock, no torch."""

from __future__ import annotations

import pytest

from kiln.runtime.form_choice import PARALLEL, SERIAL, FormChooser

QUIET = {PARALLEL: 10.0, SERIAL: 14.0}  # EfficientNet-B0, 2 threads, free cores (ms)
BUSY = {PARALLEL: 64.0, SERIAL: 31.0}  # the same on cores other work holds


def _drive(chooser: FormChooser, times, runs: int) -> list[str]:
    """`runs` runs, each taking times[form] (a dict, or a function of (run index, form))."""
    chosen = []
    for i in range(runs):
        form = chooser.choose()
        chooser.record(form, times(i, form) if callable(times) else times[form])
        chosen.append(form)
    return chosen


def test_each_form_is_measured_first_its_warm_up_not_counted():
    chooser = FormChooser(warmup=1)
    assert _drive(chooser, QUIET, 4) == [PARALLEL, PARALLEL, SERIAL, SERIAL]
    assert chooser.estimate(PARALLEL) == 10.0 and chooser.estimate(SERIAL) == 14.0
    assert chooser.runs == {PARALLEL: 2, SERIAL: 2}


def test_a_slow_first_run_is_not_counted():
    chooser = FormChooser(warmup=1)
    _drive(chooser, lambda i, form: 500.0 if i == 0 else QUIET[form], 4)  # page faults on the first run
    assert chooser.estimate(PARALLEL) == 10.0


@pytest.mark.parametrize("times, best", [(QUIET, PARALLEL), (BUSY, SERIAL)])
def test_the_faster_form_runs_and_the_other_once_every_explore_every(times, best):
    chooser = FormChooser(explore_every=16)
    chosen = _drive(chooser, times, 4 + 160)[4:]
    other = [i for i, form in enumerate(chosen) if form != best]
    assert len(other) == 10  # one probe in each 16 runs
    assert all(b - a == 16 for a, b in zip(other, other[1:]))


def test_a_busy_machine_is_followed_within_a_few_runs():
    chooser = FormChooser(explore_every=16)
    _drive(chooser, QUIET, 40)
    assert chooser.best() == PARALLEL
    chosen = _drive(chooser, BUSY, 40)
    # the incumbent's median turns after two slow runs; then serial's quiet estimate (14) is the lower
    assert chosen[:2] == [PARALLEL, PARALLEL] and chosen[2] == SERIAL
    assert chosen[2:].count(PARALLEL) <= 3  # from then on only probes


def test_freed_cores_are_followed_within_a_probe_interval():
    chooser = FormChooser(explore_every=16)
    _drive(chooser, BUSY, 40)
    assert chooser.best() == SERIAL
    chosen = _drive(chooser, QUIET, 60)
    first = chosen.index(PARALLEL)  # the next probe
    assert first < 16
    # the probe beat serial's estimate (10 < 14): probed again at once, two of three quiet times decide
    assert chosen[first + 1] == PARALLEL and chooser.estimate(PARALLEL) == 10.0
    assert chosen[first + 2:].count(SERIAL) <= 3  # from then on only probes


def test_one_slow_run_moves_nothing():
    chooser = FormChooser(explore_every=16)
    _drive(chooser, QUIET, 20)
    chosen = _drive(chooser, lambda i, form: 90.0 if i == 3 else QUIET[form], 12)  # a preemption
    assert chosen.count(SERIAL) <= 1 and chooser.best() == PARALLEL  # at most the interval's probe
    assert chooser.estimate(PARALLEL) == 10.0


def test_a_probe_slower_than_the_incumbent_waits_a_full_interval():
    chooser = FormChooser(explore_every=8)
    chosen = _drive(chooser, QUIET, 4 + 24)[4:]
    probes = [i for i, form in enumerate(chosen) if form == SERIAL]
    assert probes == [7, 15, 23]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="two forms"):
        FormChooser(forms=(PARALLEL,))
    with pytest.raises(ValueError, match="explore_every"):
        FormChooser(explore_every=1)
    with pytest.raises(ValueError, match="unknown form 'gpu'"):
        FormChooser().record("gpu", 1.0)
