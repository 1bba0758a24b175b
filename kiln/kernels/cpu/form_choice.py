"""Which of two bound forms of a native segment runs next, chosen by their recent measured times.

A segment's small layers are bound twice (kiln/kernels/cpu/onednn_primitives.py): on OpenMP's thread count
("parallel") and in the calling thread ("serial"). Which is faster depends on the machine at the moment:
on free cores the parallel form wins (EfficientNet-B0 at 2 threads: 10 vs 14 ms), on cores other work
holds it loses 2x (every parallel region's join waits out a descheduled thread's slice: 64 vs 31 ms;
bench/results/efficientnet-cpu-2026-12-02.md). A load average decided it once per process and lagged the
moment; this follows it run by run (each segment, and each small layer's per-call path outside segments, which
is also what the tuner times):

- each form's estimate is the median of its last WINDOW run times (one slow run, a preemption, moves nothing);
- neither is preferred before each has WINDOW counted runs, the two taken in turn: one disturbed run must not
  decide. With one run each, bench/zoo.py's MobileNetV2 and EfficientNet-B0 on a quiet 2-vCPU EPYC ran their
  serial forms (7.7 and 13.5 ms against the parallel forms' ~4.3 and ~10, 1.48x and 1.55x onnxruntime; the demo,
  which times kiln before onnxruntime has run, 0.98x): the first counted parallel run came right after an
  onnxruntime run whose workers were still spinning on the other core, and with parallel's estimate ~2x serial's
  the next probe was up to LONGEST_INTERVAL runs away, after the bench's 45 (bench/results/dw-zen4-2026-12-06.md);
- the form with the lower estimate runs; every EXPLORE_EVERY runs the other one runs once, so its estimate
  follows the machine too; a probe faster than the incumbent's estimate is probed again at once (two of three
  decide), so a change of load is followed within a probe interval plus two runs;
- where the other form is much slower, it is probed less often: the interval grows so that probes cost at most
  PROBE_COST of the run time (B0 on busy cores, parallel 212 ms against serial 88: a probe every 48 runs, not
  every 16, which cost 9%), up to LONGEST_INTERVAL runs (so freed cores are noticed within 64 runs);
- the first WARMUP runs of each form are not counted (first-touch pages, cold caches and code).

Pure bookkeeping over (form, seconds): no torch, no clock of its own (the caller times the run), so its logic
is tested with made-up times (tests/unit/test_form_choice.py). It runs at every call of a segment with two forms: each
form's estimate is kept as its window changes, not sorted again at each decision (choose + record ~2.5 -> ~1 µs a
call, bench/results/call-overhead-zen4-2026-12-07.md).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

PARALLEL, SERIAL = "parallel", "serial"
WINDOW = 3  # run times per form the estimate is the median of
EXPLORE_EVERY = 16  # runs between probes of the form not chosen: ~1/16 of runs pay the worse form
WARMUP = 1  # first runs of each form not counted
PROBE_COST = 0.03  # the share of run time probes of a slower form may cost
# runs between probes at most, however slow the other form: its estimate is as old as the last probe, and when
# the load drops the incumbent speeds up first (the ratio grows: serial 31 -> 14 ms against parallel's busy 64)
LONGEST_INTERVAL = 64


@dataclass
class FormChooser:
    """choose() -> the form to run; record(form, seconds) after it ran. Not thread-safe: the segment's lock (or a
    layer's, on its per-call path) serializes its runs."""

    forms: tuple[str, ...] = (PARALLEL, SERIAL)
    explore_every: int = EXPLORE_EVERY
    window: int = WINDOW
    warmup: int = WARMUP
    probe_cost: float = PROBE_COST
    longest_interval: int = LONGEST_INTERVAL
    start_runs: int | None = None  # counted runs of each form before either is preferred (None: window; 1: one each)
    runs: dict[str, int] = field(default_factory=dict)  # form -> runs made (warm-up included): what a bench reports
    _times: dict[str, deque] = field(default_factory=dict)
    _estimates: dict[str, float | None] = field(default_factory=dict)  # estimate(form), kept as its times change
    _started: bool = False  # every form has start_runs counted runs (then always: the windows only fill)
    _since_probe: int = 0
    _challenger: str | None = None  # a form whose last probe beat the incumbent: probed again at once
    _best: str = PARALLEL
    _interval: int = EXPLORE_EVERY
    _next: str = PARALLEL

    def __post_init__(self):
        self.start_runs = self.window if self.start_runs is None else self.start_runs
        if len(self.forms) != 2 or self.explore_every < 2 or self.window < 1 or self.warmup < 0 \
                or self.probe_cost <= 0 or self.longest_interval < self.explore_every \
                or not 1 <= self.start_runs <= self.window:
            raise ValueError(f"FormChooser: two forms, explore_every >= 2, window >= 1, warmup >= 0, probe_cost > 0, "
                             f"longest_interval >= explore_every, 1 <= start_runs <= window; got {self.forms}, "
                             f"{self.explore_every}, {self.window}, {self.warmup}, {self.probe_cost}, "
                             f"{self.longest_interval}, {self.start_runs}")
        self.runs = {f: 0 for f in self.forms}
        self._times = {f: deque(maxlen=self.window) for f in self.forms}
        self._estimates = {f: None for f in self.forms}
        self._best = self._next = self.forms[0]
        self._interval = self.explore_every

    def choose(self) -> str:
        """The form to run now (decided when the last run was recorded: a per-call layer of 10 µs can afford it)."""
        return self._next

    def record(self, form: str, seconds: float) -> None:
        """`form` ran in `seconds`."""
        times = self._times.get(form)
        if times is None:
            raise ValueError(f"FormChooser: unknown form {form!r}, not one of {self.forms}")
        runs = self.runs[form] = self.runs[form] + 1
        if runs > self.warmup:
            measured = self._started or not self._starting()
            if measured and form != self._best:  # a probe: again at once when it beat the incumbent's estimate
                self._challenger = form if seconds < self._estimates[self._best] else None
                self._since_probe = 0
            elif measured:  # the interval counts from when both forms have an estimate
                self._since_probe += 1
            times.append(seconds)
            ordered = sorted(times)
            self._estimates[form] = ordered[len(ordered) // 2]
        self._decide()

    def estimate(self, form: str) -> float | None:
        """Median of the form's last counted run times (seconds); None before its first."""
        return self._estimates[form]

    def best(self) -> str:
        """The form with the lower estimate (the first form on a tie or before both are measured)."""
        return self._best

    def interval(self) -> int:
        """Runs between probes of the form not chosen: EXPLORE_EVERY, longer where its estimate is so much
        slower that probing it that often would cost more than probe_cost of the run time."""
        return self._interval

    def _starting(self) -> bool:
        """Whether some form has fewer than `start_runs` counted runs: no form is preferred yet."""
        return any(len(times) < self.start_runs for times in self._times.values())

    def _decide(self) -> None:
        if not self._started:
            for form in self.forms:  # each form's warm-up and first counted run, one form after the other
                if not self._times[form]:
                    self._next = form
                    return
            if self._starting():  # then in turn until each has `start_runs` (the form with fewer first)
                self._next = min(self.forms, key=lambda f: len(self._times[f]))
                return
            self._started = True
        a, b = self.forms
        ea, eb = self._estimates[a], self._estimates[b]
        best, other, fast, slow = (b, a, eb, ea) if eb < ea else (a, b, ea, eb)
        self._best = best
        # probes every interval runs cost (slow - fast) / interval of the time: at most probe_cost of fast
        wanted = math.ceil((slow / fast - 1) / self.probe_cost) if fast > 0 else self.explore_every
        self._interval = max(self.explore_every, min(wanted, self.longest_interval))
        if self._challenger is not None and self._challenger != best:
            self._next = self._challenger
        elif self._since_probe + 1 >= self._interval:
            self._next = other
        else:
            self._next = best
