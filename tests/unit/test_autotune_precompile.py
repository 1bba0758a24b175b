"""The tactic search's hand-off to the parallel compile of a CUDA build's kernels (kiln/builder/precompile.py),
wired as a CUDA build wires it, run on the CPU with a stand-in for CandidateKernels: each distinct layer's candidates
are handed over (prepared as the search prepares them) before the search starts, the search waits for a layer's
kernels right before it tunes that layer, the pool is closed at the end, and the header says what was compiled.
The compile itself (sm_90, worker processes, disk-cache hits) is tests/kernels/test_precompile.py's."""

from __future__ import annotations

from types import SimpleNamespace

from kiln.builder import autotune
from kiln.builder.build import build
from kiln.builder.config import BuildConfig
from tests.unit.test_tactics import conv_model


class _Recorder:
    """What autotune calls on CandidateKernels, in order."""

    pool = SimpleNamespace(workers=3, seconds=1.5)
    kernels = 7

    def __init__(self, events: list):
        self.events = events

    def record(self, i, tactics, prepare, ctx, inputs, attributes):
        for tactic in tactics:
            prepare(tactic)  # each as the search will prepare it
        self.events.append(("record", i, len(tactics)))

    def wait(self, i):
        self.events.append(("wait", i))

    def close(self):
        self.events.append(("close",))


def test_layers_are_handed_over_first_and_waited_for_as_they_are_tuned(tmp_path, monkeypatch):
    events: list = []
    monkeypatch.setattr(autotune.CandidateKernels, "start", classmethod(lambda cls, device, workers: _Recorder(events)))
    engine = build(conv_model(tmp_path), BuildConfig(device="cpu", shapes={"x": [2, 8, 12, 12]}),
                   progress=lambda message: events.append(("say", message)))

    recorded = [e[1] for e in events if e[0] == "record"]
    tuned = [e for e in events if e[0] == "say" and e[1].startswith("tactics: ") and "/" in e[1].split()[1]]
    assert len(recorded) == 2 and all(e[2] > 0 for e in events if e[0] == "record")  # the 3x3 and the 1x1 layer
    first_wait = next(k for k, e in enumerate(events) if e[0] == "wait")
    assert all(k < first_wait for k, e in enumerate(events) if e[0] == "record")  # handed over before the search
    for say in tuned:  # each layer tuned right after its wait
        before = events[events.index(say) - 1]
        assert before[0] == "wait", (before, say)
    assert sorted(e[1] for e in events if e[0] == "wait") == sorted(recorded)
    assert events.index(("close",)) > events.index(tuned[-1])
    assert engine.plan.header["tactics"]["compile"] == {"workers": 3, "kernels": 7, "seconds_summed": 1.5}
