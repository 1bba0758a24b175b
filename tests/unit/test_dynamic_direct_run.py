"""A dynamic one-segment program without shape values (roberta_tiny exported with symbolic batch x sequence: its
segment reads the inputs and the program's constants, nothing computed per shape) runs numpy calls as one call of its
compiled loop (kiln/runtime/direct_run.py DirectRuns, kiln/runtime/cpu_paths.py): bit for bit the general path's
outputs (the same engine, KILN_DIRECT_RUN=0) and onnxruntime's at fresh random shapes inside the profile, at first
and repeat calls, in several contexts; wrong dtypes, ranks and shapes outside the profile raise what they raised."""

from __future__ import annotations

import threading

import numpy as np
import onnxruntime as ort
import pytest

import kiln
from kiln import zoo
from kiln.builder import autotune
from kiln.errors import BindingError
from kiln.kernels.cpu import onednn, onednn_ahead
from kiln.runtime.native import Segment
from kiln.zoo.models import make_inputs

PROFILE = {"input_ids": "1x1,2x16,8x64"}
# fp32 GEMMs of another blocking and accumulation order, hidden size 64, O(1) LayerNorm outputs (as
# test_uniform_gather.py's check of the same model)
ORT_TOL = 1e-5

pytestmark = pytest.mark.skipif(not onednn.available(), reason="oneDNN is not built")


@pytest.fixture(scope="module")
def dynamic_roberta():
    """(engine, onnxruntime session) of roberta_tiny exported with symbolic batch x sequence, one native segment."""
    with pytest.MonkeyPatch.context() as patch:
        # the native tactics win: the one-segment program is the subject, not the tuner's timing (a tuned torch layer
        # would cut the segment: test_uniform_gather.py)
        patch.setattr(autotune, "NATIVE_CREDIT_MS", 1e3)
        exported = zoo.export("roberta_tiny", batch=2, seq=16, dynamic=True)
        engine = kiln.build(str(exported.path), profiles=[PROFILE])
    assert onednn_ahead.AHEAD.wait(timeout=120), "the build's background jobs did not finish"
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    return engine, session


def _general(engine, monkeypatch):
    """A context of the same engine on the general path (Program.run, the segment's torch call), each call at its own
    size (no padded first call: a padded run agrees with an unpadded one to fp32 rounding, not bit for bit)."""
    monkeypatch.setenv("KILN_DIRECT_RUN", "0")
    context = engine.create_execution_context(pad_first_calls=False)
    monkeypatch.delenv("KILN_DIRECT_RUN")
    assert context._direct is None
    return context


def _shapes(rng, count: int) -> list[tuple[int, int]]:
    """Fresh batch x sequence sizes inside the profile (1x1 .. 8x64), and its corners."""
    drawn = {(int(rng.integers(1, 9)), int(rng.integers(1, 65))) for _ in range(count)}
    return sorted(drawn | {(1, 1), (8, 64), (2, 16)})


def _feeds(rng, batch: int, seq: int) -> dict[str, np.ndarray]:
    return make_inputs(zoo.get("roberta_tiny"), batch=batch, seq=seq, seed=int(rng.integers(1 << 30)))


def test_the_dynamic_roberta_is_one_segment_without_shape_values_and_has_direct_runs(dynamic_roberta):
    engine, _ = dynamic_roberta
    program = engine.program
    assert program.shape_plans is None and len(program.run_steps) == 1 and isinstance(program.run_steps[0].fn, Segment)
    assert engine.direct_runs is not None and engine.direct_runs.segment is program.run_steps[0].fn
    context = engine.create_execution_context()
    assert context._direct is not None


@pytest.mark.parametrize("pad", [True, False])
def test_first_and_repeat_calls_run_directly_bit_for_bit_as_the_general_path_and_match_onnxruntime(
        dynamic_roberta, counted, monkeypatch, pad):
    engine, session = dynamic_roberta
    general = _general(engine, monkeypatch)
    context = engine.create_execution_context(pad_first_calls=pad)
    rng = np.random.default_rng()
    for batch, seq in _shapes(rng, 6):
        feeds = _feeds(rng, batch, seq)
        want = session.run(None, feeds)
        before = len(counted)
        runs = [context.run(feeds) for _ in range(3)]  # the first call, the repeat that measures binding, a repeat
        assert len(counted) > before and counted[-1][0][0] >= batch and counted[-1][0][1] >= seq  # the last: direct
        own = counted[-1] == ((batch, seq), (batch, seq))  # else padded in a bound host (padding first calls)
        assert own or pad, f"{batch}x{seq} ran at {counted[-1]} without padding"
        old = general.run(feeds)
        for name, w in zip((o.name for o in session.get_outputs()), want):
            for k, got in enumerate(runs):
                assert isinstance(got[name], np.ndarray) and got[name].shape == w.shape
                np.testing.assert_allclose(got[name], w, rtol=ORT_TOL, atol=ORT_TOL,
                                           err_msg=f"{name} at {batch}x{seq}, call {k}")
            if own:  # at the shape's own size: the same view on the same inputs as the general path
                np.testing.assert_array_equal(runs[-1][name], old[name], err_msg=f"{name} at {batch}x{seq}")
            else:  # padded: the GEMMs' and attention's sums over other shapes, fp32 rounding (test_direct_run.py)
                np.testing.assert_allclose(runs[-1][name], old[name], rtol=1e-5, atol=2e-5,
                                           err_msg=f"{name} at {batch}x{seq}, padded")
        assert runs[-1][name] is not runs[-2][name]  # every call's outputs are its own


def test_repeats_at_a_bound_shape_run_directly_at_that_shape(dynamic_roberta, counted):
    engine, session = dynamic_roberta
    context = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng()
    batch, seq = int(rng.integers(1, 9)), int(rng.integers(1, 65))
    feeds = _feeds(rng, batch, seq)
    context.run(feeds)
    context.run(feeds)
    counted.clear()
    for _ in range(5):
        got = context.run(feeds)
    assert counted == [((batch, seq), (batch, seq))] * 5
    np.testing.assert_allclose(next(iter(got.values())), session.run(None, feeds)[0], rtol=ORT_TOL, atol=ORT_TOL)


def test_several_contexts_on_threads(dynamic_roberta, counted):
    engine, session = dynamic_roberta
    rng = np.random.default_rng()
    requests = [_feeds(rng, batch, seq) for batch, seq in _shapes(rng, 3)]
    want = [session.run(None, feeds)[0] for feeds in requests]
    errors = []

    def worker(seed):
        context = engine.create_execution_context()
        order = np.random.default_rng(seed).permutation(len(requests))
        for _ in range(4):
            for k in order:
                got = next(iter(context.run(requests[k]).values()))
                if got.shape != want[k].shape or np.abs(got - want[k]).max() > ORT_TOL:
                    errors.append((seed, k, got.shape, float(np.abs(got - want[k]).max())))

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    # each context binds a shape at its first call, measures binding at its second, then runs it directly
    assert len(counted) >= 3 * (4 - 2) * len(requests)


def _error(context, feeds) -> str:
    with pytest.raises(BindingError) as raised:
        context.run(feeds)
    return str(raised.value)


def test_wrong_inputs_raise_what_the_general_path_raises_before_and_after_warm_calls(dynamic_roberta, monkeypatch):
    engine, _ = dynamic_roberta
    general = _general(engine, monkeypatch)
    context = engine.create_execution_context()
    rng = np.random.default_rng()
    good = _feeds(rng, 2, int(rng.integers(1, 65)))
    wrong = {
        "outside the profile": _feeds(rng, 2, 65),
        "a batch past the profile": _feeds(rng, 9, 4),
        "float ids": {**good, "input_ids": good["input_ids"].astype(np.float32)},
        "a rank too few": {**good, "input_ids": good["input_ids"][0].copy()},
        "symbols disagreeing": {**good, "attention_mask": np.ones((2, good["input_ids"].shape[1] + 1), np.int64)},
        "a missing input": {"input_ids": good["input_ids"]},
    }
    before = {what: _error(context, feeds) for what, feeds in wrong.items()}
    for _ in range(3):  # warm: the good shape checked, bound and run directly
        context.run(good)
    for what, feeds in wrong.items():
        said = _error(context, feeds)
        assert said == before[what] == _error(general, feeds), what
    assert "outside every optimization profile" in before["outside the profile"]
