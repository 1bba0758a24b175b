"""The choice between a native segment's parallel and serial forms (kiln/kernels/cpu/form_choice.py), on made-up
run times: which form runs first, that the faster runs, how often the other is probed, how fast a change of
load is followed, and that one slow run changes nothing. Times in ms-like units; no clock, no torch."""

from __future__ import annotations

import math
import random

import pytest

from kiln.kernels.cpu.form_choice import PARALLEL, SERIAL, FormChooser

QUIET = {PARALLEL: 10.0, SERIAL: 14.0}  # EfficientNet-B0, 2 threads, free cores (ms)
BUSY = {PARALLEL: 64.0, SERIAL: 31.0}  # the same on cores other work holds
START = [PARALLEL, PARALLEL, SERIAL, SERIAL, PARALLEL, SERIAL, PARALLEL, SERIAL]  # warm-up + window (3) runs each


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
    assert _drive(chooser, QUIET, len(START)) == START
    assert chooser.estimate(PARALLEL) == 10.0 and chooser.estimate(SERIAL) == 14.0
    assert chooser.runs == {PARALLEL: 4, SERIAL: 4}


def test_one_disturbed_run_does_not_decide_the_start():
    # bench/zoo.py on a 2-vCPU EPYC: kiln's first counted parallel run came right after an onnxruntime run whose
    # workers still spun on the other core. Decided on that one run, serial ran for the bench's 45 runs.
    chooser = FormChooser(warmup=1)
    chosen = _drive(chooser, lambda i, form: 25.0 if i == 1 else QUIET[form], len(START) + 20)
    assert chosen[:len(START)] == START and chooser.best() == PARALLEL
    assert chosen[len(START):].count(SERIAL) <= 1  # the interval's probe at most
    before = FormChooser(warmup=1, start_runs=1)  # decided on one run each, as before 2026-12-06
    chosen = _drive(before, lambda i, form: 25.0 if i == 1 else QUIET[form], len(START) + 20)
    assert before.best() == SERIAL and chosen[4:].count(PARALLEL) == 0


def test_a_slow_first_run_is_not_counted():
    chooser = FormChooser(warmup=1)
    _drive(chooser, lambda i, form: 500.0 if i == 0 else QUIET[form], 4)  # page faults on the first run
    assert chooser.estimate(PARALLEL) == 10.0


# QUIET: serial 1.4x parallel, probes every 16 runs cost 2.5%; BUSY: parallel 2.06x serial, probes every 16 would
# cost 6.6%, so every ceil(1.06 / 0.03) = 36
@pytest.mark.parametrize("times, best, interval", [(QUIET, PARALLEL, 16), (BUSY, SERIAL, 36)])
def test_the_faster_form_runs_and_the_other_once_an_interval(times, best, interval):
    chooser = FormChooser(explore_every=16, probe_cost=0.03)
    chosen = _drive(chooser, times, len(START) + 10 * interval)[len(START):]
    other = [i for i, form in enumerate(chosen) if form != best]
    assert chooser.interval() == interval
    assert len(other) == 10 and all(b - a == interval for a, b in zip(other, other[1:]))


def test_the_interval_is_capped():
    chooser = FormChooser(explore_every=16, probe_cost=0.03, longest_interval=100)
    _drive(chooser, {PARALLEL: 1.0, SERIAL: 50.0}, 10)
    assert chooser.interval() == 100


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
    chosen = _drive(chooser, QUIET, 100)
    # serial now at 14 against parallel's busy 64: the interval is at its longest (64) until the next probe
    first = chosen.index(PARALLEL)
    assert first < 64
    # the probe beat serial's estimate (10 < 14): probed again at once, two of three quiet times decide
    assert chosen[first + 1] == PARALLEL and chooser.estimate(PARALLEL) == 10.0
    rest = chosen[first + 2:]
    assert rest.count(SERIAL) <= len(rest) // 16  # from then on only probes, one an interval


def test_one_slow_run_moves_nothing():
    chooser = FormChooser(explore_every=16)
    _drive(chooser, QUIET, 20)
    chosen = _drive(chooser, lambda i, form: 90.0 if i == 3 else QUIET[form], 12)  # a preemption
    assert chosen.count(SERIAL) <= 1 and chooser.best() == PARALLEL  # at most the interval's probe
    assert chooser.estimate(PARALLEL) == 10.0


def test_a_probe_slower_than_the_incumbent_waits_a_full_interval():
    chooser = FormChooser(explore_every=8, probe_cost=1.0)  # the interval never longer than explore_every
    chosen = _drive(chooser, QUIET, len(START) + 24)[len(START):]
    probes = [i for i, form in enumerate(chosen) if form == SERIAL]
    assert probes == [7, 15, 23]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="two forms"):
        FormChooser(forms=(PARALLEL,))
    with pytest.raises(ValueError, match="explore_every"):
        FormChooser(explore_every=1)
    with pytest.raises(ValueError, match="start_runs"):
        FormChooser(start_runs=4)  # more than the window holds
    with pytest.raises(ValueError, match="probe_cost"):
        FormChooser(probe_cost=0.0)
    with pytest.raises(ValueError, match="unknown form 'gpu'"):
        FormChooser().record("gpu", 1.0)


class _Sorted:
    """The chooser's rule restated plainly (its estimates sorted from the windows at every decision, as it was before
    it kept them, 2026-12-07): the oracle its kept estimates must follow call for call."""

    def __init__(self, **options):
        self.chooser = FormChooser(**options)  # for its settings only
        c = self.chooser
        self.times = {f: [] for f in c.forms}
        self.runs = {f: 0 for f in c.forms}
        self.best, self.next, self.since, self.challenger, self.interval = c.forms[0], c.forms[0], 0, None, \
            c.explore_every

    def median(self, form):
        window = sorted(self.times[form][-self.chooser.window:])
        return window[len(window) // 2] if window else None

    def starting(self):
        return any(len(self.times[f][-self.chooser.window:]) < self.chooser.start_runs for f in self.chooser.forms)

    def record(self, form, seconds):
        c = self.chooser
        self.runs[form] += 1
        if self.runs[form] > c.warmup:
            measured = not self.starting()
            if measured and form != self.best:
                self.challenger = form if seconds < self.median(self.best) else None
                self.since = 0
            elif measured:
                self.since += 1
            self.times[form].append(seconds)
        empty = [f for f in c.forms if not self.times[f]]
        if empty:
            self.next = empty[0]
            return
        if self.starting():
            self.next = min(c.forms, key=lambda f: len(self.times[f][-c.window:]))
            return
        a, b = c.forms
        ea, eb = self.median(a), self.median(b)
        best, other, fast, slow = (b, a, eb, ea) if eb < ea else (a, b, ea, eb)
        self.best = best
        wanted = math.ceil((slow / fast - 1) / c.probe_cost) if fast > 0 else c.explore_every
        self.interval = max(c.explore_every, min(wanted, c.longest_interval))
        if self.challenger is not None and self.challenger != best:
            self.next = self.challenger
        elif self.since + 1 >= self.interval:
            self.next = other
        else:
            self.next = best


@pytest.mark.parametrize("options", [{}, {"warmup": 0}, {"window": 5, "start_runs": 2}, {"explore_every": 4}])
def test_kept_estimates_choose_as_sorted_windows_do(options):
    """5,000 runs of drifting, noisy and spiking times: the same form chosen at every run, the same estimates."""
    rng = random.Random(7)
    chooser, oracle = FormChooser(**options), _Sorted(**options)
    for i in range(5000):
        form = chooser.choose()
        assert form == oracle.next, f"run {i}"
        load = 1.0 + (i // 700) % 3  # the machine gets busier and frees again
        base = {PARALLEL: 10.0 * load * load, SERIAL: 14.0 * load}[form]
        seconds = base * rng.uniform(0.9, 1.1) * (8.0 if rng.random() < 0.02 else 1.0)
        chooser.record(form, seconds)
        oracle.record(form, seconds)
        for f in chooser.forms:
            assert chooser.estimate(f) == oracle.median(f), f"run {i}, {f}"
        assert chooser.best() == oracle.best and chooser.interval() == oracle.interval
