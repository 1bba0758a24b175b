"""kiln.InferenceSession.run_async against onnxruntime's own run_async on the same model: the call returns
at once, the callback gets (outputs, user_data, err) on another thread, outputs as run() gives them and
err "" on success, [] and the message on failure; missing inputs raise at the call, as onnxruntime's do."""

from __future__ import annotations

import threading
import time

import numpy as np
import onnxruntime as ort
import pytest

import kiln.compat as kort
from tests.frontdoor.test_inference_session import _mlp_model


class _Calls:
    """Collects callbacks: each (outputs, user_data, err, thread name), and waits for n of them."""

    def __init__(self):
        self.results: list[tuple] = []
        self.done = threading.Condition()

    def __call__(self, outputs, user_data, err):
        with self.done:
            self.results.append((outputs, user_data, err, threading.current_thread().name))
            self.done.notify_all()

    def wait(self, n: int) -> list[tuple]:
        with self.done:
            assert self.done.wait_for(lambda: len(self.results) >= n, timeout=120), f"{len(self.results)} of {n}"
            return list(self.results)


def _sessions():
    model = _mlp_model()
    return kort.InferenceSession(model, providers=["CPUExecutionProvider"]), \
        ort.InferenceSession(model, providers=["CPUExecutionProvider"])


def test_runs_in_flight_at_once_match_onnxruntime():
    session, reference = _sessions()
    rng = np.random.default_rng(0)
    feeds = [{"input": rng.standard_normal((batch, 16)).astype(np.float32)} for batch in (1, 3, 5, 2, 7, 4)]
    calls = _Calls()
    for k, feed in enumerate(feeds):
        names = [None, ["hidden"], [], ["logits", "hidden"]][k % 4]
        assert session.run_async(names, feed, calls, k) is None  # returns at once, as onnxruntime's does
    results = calls.wait(len(feeds))
    assert sorted(r[1] for r in results) == list(range(len(feeds)))  # each run's user_data came back
    for outputs, k, err, thread in results:
        names = [None, ["hidden"], [], ["logits", "hidden"]][k % 4]
        want = reference.run(names, feeds[k])
        assert err == "" and thread != threading.current_thread().name
        assert len(outputs) == len(want)
        for got, expected in zip(outputs, want):
            assert isinstance(got, np.ndarray) and got.dtype == expected.dtype
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def _errors(session, feed, names):
    calls = _Calls()
    session.run_async(names, feed, calls, "data")
    outputs, user_data, err, _ = calls.wait(1)[0]
    assert outputs == [] and user_data == "data"
    return err


@pytest.mark.parametrize("case", ["output name", "element type", "rank", "dimension"])
def test_failures_reach_the_callback_as_onnxruntimes_do(case):
    session, reference = _sessions()
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    feed, names = {
        "output name": ({"input": x}, ["nope"]),
        "element type": ({"input": x.astype(np.float64)}, None),
        "rank": ({"input": x[0]}, None),
        "dimension": ({"input": np.zeros((3, 5), np.float32)}, None),
    }[case]
    got, want = _errors(session, feed, names), _errors(reference, feed, names)
    assert got and want
    if case == "output name":  # onnxruntime's async wording has a space its sync one lacks
        assert "Invalid output name" in got and "nope" in got and "nope" in want
    else:
        assert got.splitlines()[0].strip() == want.splitlines()[0].strip()


def test_missing_inputs_raise_at_the_call():
    session, reference = _sessions()
    x = np.zeros((2, 16), np.float32)
    for s in (session, reference):
        with pytest.raises(ValueError, match=r"Required inputs \(\['input'\]\) are missing from input feed "
                                             r"\(\['inputz'\]\)"):
            s.run_async(None, {"inputz": x}, lambda *a: None, None)
        with pytest.raises(TypeError):
            s.run_async(None, {"input": x}, lambda *a: None)  # user_data is required, as onnxruntime's is


def test_a_failing_callback_is_reported_and_the_session_serves_on(monkeypatch):
    session, _ = _sessions()
    reported = []
    monkeypatch.setattr(threading, "excepthook", lambda args: reported.append(args.exc_type))
    x = {"input": np.ones((2, 16), np.float32)}

    def broken(outputs, user_data, err):
        raise RuntimeError("the application's bug")

    session.run_async(None, x, broken, None)
    calls = _Calls()
    session.run_async(["logits"], x, calls, None)
    outputs, _, err, _ = calls.wait(1)[0]
    assert err == "" and outputs[0].shape == (2, 8)
    deadline = time.monotonic() + 60  # the two runs may finish in either order
    while not reported and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reported == [RuntimeError]
