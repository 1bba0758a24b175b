"""What a CPU engine makes before a new shape's first call meets it (issue 10, kiln/kernels/cpu/onednn_ahead.py):
the inner products of the profile's row counts on a background thread, on the engine's thread count, found made
by the binding thread (which then creates none), results against onnxruntime; the queue's order, dedup and budget;
and the memory objects a segment's layers share (onednn.shared_memories)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import kiln
from kiln.kernels.cpu import onednn, onednn_ahead, onednn_primitives
from kiln.plan.spec import Profile, ShapeRange
from kiln.runtime import first_calls, native_views

from test_onednn_rows import ORT_TOL, K, _two_layers, one_thread  # noqa: E402, F401  (tests/unit is on the path;
# one_thread: its fixture)

pytestmark = pytest.mark.skipif(not onednn.available(), reason="libdnnl.so.3 cannot be loaded")

TUNED, MOST = 16, 40  # the profile's opt and max rows: made ahead up to 16 x (40 / 16) = 40


@pytest.fixture(params=[False, True], ids=["no residual", "residual"])
def built(request, one_thread, native_tactics_win, monkeypatch, tmp_path):
    """The two oneDNN layers (the second with a residual or not) built at 16 rows, saved, loaded again in a native
    segment: (engine, onnxruntime session). The native tactic wins: this is about its row counts."""
    # a queue of its own: in a long test process (a CI worker) the process's queue may have spent its budget, or
    # taken these very jobs for an earlier test whose primitives the cache has let go since (CI saw both)
    ahead = onednn_ahead.Ahead()
    monkeypatch.setattr(onednn_ahead, "AHEAD", ahead)
    model = _two_layers(request.param)
    engine = kiln.build(model.SerializeToString(), profiles=[{"x": f"1x{K},{TUNED}x{K},{MOST}x{K}"}],
                        tactics=["cpu.gemm.onednn_direct"])
    engine.save(tmp_path / "two_layers.kiln")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    yield (kiln.load(tmp_path / "two_layers.kiln"),
           ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]))
    ahead.stop()


def test_a_new_row_count_finds_its_inner_products_made_and_matches_onnxruntime(built, monkeypatch):
    engine, session = built
    assert onednn_ahead.AHEAD.wait(timeout=120), "the background thread did not finish"
    created = []
    make = onednn_primitives._inner_product
    monkeypatch.setattr(onednn_primitives, "_inner_product", lambda *a: created.append(a[0]) or make(*a))
    rng = np.random.default_rng()
    fresh = sorted({int(r) for r in rng.integers(3, MOST, size=6)} - {TUNED})
    for rows in fresh + fresh[:2]:  # and two row counts again: bound once, reused
        x = rng.standard_normal((rows, K)).astype(np.float32)
        np.testing.assert_allclose(engine.run({"x": x})["y"], session.run(None, {"x": x})[0], rtol=ORT_TOL,
                                   atol=ORT_TOL, err_msg=f"{rows} rows")
    assert created == [], f"inner products created while binding at {created} rows"  # none made ahead: fails


def test_nothing_is_made_ahead_when_turned_off(built, monkeypatch):
    engine, _session = built
    monkeypatch.setenv("KILN_ONEDNN_AHEAD", "0")
    assert first_calls.primitives_ahead(engine.program, engine.profiles) == 0


def test_the_layers_offer_their_row_counts_up_to_the_profiles_reach(built):
    """One thread: the layer without a residual runs 1-2 rows on the runtime-M matmul (its first runs are jobs),
    3-40 on inner products; the one with a residual (no runtime-M path) every row count on inner products."""
    engine, _session = built
    gemms = [m.fn for seg in engine.program.segments for m in seg.members if m.ctx.op_type == "FusedGemm"]
    assert len(gemms) == 2
    for fn in gemms:
        jobs = fn.ahead(MOST / TUNED)
        rows = {job.key[-1] for job in jobs if job.key[0] == "inner product"}
        warmed = {job.key[-1] for job in jobs if job.key[0] == "runtime matmul"}
        residual = fn.native.residual_input is not None
        assert warmed == (set() if residual else {1, 2})
        assert rows == set(range(1 if residual else 3, MOST + 1)) - {TUNED}


def _recording(log: list, key: tuple, order: int) -> onednn_ahead.Job:
    return onednn_ahead.Job(key, order, lambda: log.append(key) or True)


def test_jobs_run_smallest_first_once_each_within_the_budget():
    ahead, log = onednn_ahead.Ahead(budget=4), []
    assert ahead.schedule([_recording(log, ("a", r), r) for r in (9, 3, 5)], threads=1) == 3
    assert ahead.schedule([_recording(log, ("a", 3), 3), _recording(log, ("b", 1), 1),
                           _recording(log, ("b", 2), 2)], threads=1) == 1  # ("a", 3) again; then the budget
    assert ahead.wait(timeout=30)
    assert sorted(log[:3], key=lambda k: k[1]) == log[:3] == [("a", 3), ("a", 5), ("a", 9)]
    assert log[3:] == [("b", 1)] and ahead.made == 4


def test_jobs_run_on_the_thread_count_they_were_scheduled_at(monkeypatch):
    """oneDNN fixes a kernel's thread count at creation: the background thread creates at the engine's count."""
    openmp = onednn._openmp_threads(onednn.load().lib)
    if openmp is None:
        pytest.skip("this libdnnl has no OpenMP")
    seen = {}
    job = onednn_ahead.Job(("threads",), 0, lambda: seen.update(count=openmp[0](), thread=threading.current_thread()))
    ahead = onednn_ahead.Ahead()
    ahead.schedule([job], threads=1)
    deadline = time.monotonic() + 30  # made by the thread (not waited for: a waiter would make it itself)
    while not seen and time.monotonic() < deadline:
        time.sleep(0.001)
    assert seen["count"] == 1 and seen["thread"] is not threading.main_thread()
    # and where a waiter makes it (the thread held before its first job): at the count scheduled, not the waiter's
    held = threading.Event()
    monkeypatch.setattr(onednn_ahead, "_lowest_priority", lambda: held.wait(30))
    before = openmp[0]()
    openmp[1](2)
    try:
        seen.clear()
        ahead = onednn_ahead.Ahead()
        ahead.schedule([job], threads=1)
        assert ahead.wait(timeout=30)
        assert seen["count"] == 1 and seen["thread"] is threading.current_thread() and openmp[0]() == 2
    finally:
        openmp[1](before)
        held.set()


def test_a_segments_layers_share_memory_objects_at_one_place_and_size(built):
    engine, session = built
    segment = engine.program.segments[0]
    first, second = segment.bound  # fc1 writes the arena place fc2 reads, at one size: one memory object
    assert first.memory("dst") == second.memory("src")
    assert first.memory("src") not in (second.memory("src"), second.memory("dst"))  # the entry: its own
    rows = int(np.random.default_rng().integers(3, MOST)) | 1
    view = segment._bind_sizes(((rows, K),))
    if hasattr(view._owned[0], "memory"):  # bound member by member: its layers share theirs as the template's do
        assert view._owned[0].memory("dst").value == view._owned[1].memory("src").value
    else:  # the template's call arrays rewritten at these rows (native_views._CallImage): its memory objects
        assert not hasattr(view, "_bound") and (segment._grown or segment).bound[0].memory("dst").value == \
            (segment._grown or segment).bound[1].memory("src").value
    x = np.random.default_rng().standard_normal((rows, K)).astype(np.float32)
    np.testing.assert_allclose(engine.run({"x": x})["y"], session.run(None, {"x": x})[0], rtol=ORT_TOL, atol=ORT_TOL)


def test_stop_drops_what_is_queued_and_waits_for_the_job_in_hand():
    ahead, started, release, log = onednn_ahead.Ahead(), threading.Event(), threading.Event(), []

    def slow() -> bool:
        started.set()
        release.wait(10)
        log.append("first")
        return True

    ahead.schedule([onednn_ahead.Job(("slow",), 0, slow)] + [_recording(log, ("b", r), r) for r in range(1, 5)], 1)
    assert started.wait(10)

    # the job in hand ends only once stop() has dropped the queue (before: a timer let it go after 0.2 s, and a main
    # thread descheduled that long on a loaded machine left the thread the next job to run)
    def release_once_stopping() -> None:
        deadline = time.monotonic() + 30
        while not ahead._stopped and time.monotonic() < deadline:
            time.sleep(0.001)
        release.set()

    threading.Thread(target=release_once_stopping, daemon=True).start()
    ahead.stop()
    assert log == ["first"] and ahead.wait(0)


class _SlowToFree:
    """What a job's closure may hold the last reference to (a layer and its tensors): freeing it takes a while, with
    the GIL released (as torch's C++ releases it), and says when it is done."""

    def __init__(self, freed: list):
        self.freed = freed

    def __del__(self):
        time.sleep(0.3)
        self.freed.append(threading.current_thread().name)


def _holding(held: _SlowToFree, ran: list) -> onednn_ahead.Job:
    def make(held=held) -> bool:
        ran.append(threading.current_thread())
        return True
    return onednn_ahead.Job(("holding",), 0, make)


def test_wait_returns_once_the_jobs_made_are_dropped():
    """The thread drops each job before it says it is idle: what a job held is freed by the time wait() returns
    (before: the thread's frame held the last job until the thread ended, after wait() and stop() had returned). The
    job is made by the thread or, where the waiter took it first, by the waiter: freed where it was made, either way
    before wait() returns."""
    ahead, freed, ran = onednn_ahead.Ahead(), [], []
    ahead.schedule([_holding(_SlowToFree(freed), ran)], threads=1)
    assert ahead.wait(30)
    assert len(ran) == 1 and freed == [ran[0].name]


def test_a_waiter_makes_the_queued_jobs_that_a_starved_thread_would(monkeypatch):
    """The thread runs at nice 19: on a machine whose cores are taken it gets next to no time (the suite's 120 s waits
    ran out at load 22). Here it is held before its first job, as if it got none; wait() makes the queued jobs on
    the caller's thread, in order, and returns; the thread, let go, finds nothing left and ends."""
    held, log = threading.Event(), []
    monkeypatch.setattr(onednn_ahead, "_lowest_priority", lambda: held.wait(30))
    ahead = onednn_ahead.Ahead()
    jobs = [onednn_ahead.Job(("made", r), r, lambda r=r: log.append((r, threading.current_thread().name)) or True)
            for r in (3, 1, 2)]
    assert ahead.schedule(jobs, threads=1) == 3
    assert ahead.wait(30)
    assert log == [(r, threading.current_thread().name) for r in (1, 2, 3)] and ahead.made == 3
    held.set()
    ahead._last.join(30)
    assert not ahead._last.is_alive() and ahead._thread is None and ahead.wait(0) and len(log) == 3
    assert ahead.schedule([onednn_ahead.Job(("made", 4), 4, lambda: log.append((4, "")) or True)], threads=1) == 1
    assert ahead.wait(30) and len(log) == 4  # a thread again for what comes later


def test_stop_joins_the_thread_and_schedules_nothing_after():
    """stop() (atexit) returns once the thread has ended, so none of it runs while the interpreter finalizes."""
    ahead, freed, ran = onednn_ahead.Ahead(), [], []
    ahead.schedule([_holding(_SlowToFree(freed), ran)], threads=1)
    deadline = time.monotonic() + 30
    while not ran and time.monotonic() < deadline:
        time.sleep(0.001)
    ahead.stop()
    assert ran and not ran[0].is_alive() and freed == ["kiln-onednn-ahead"]
    assert ahead.schedule([_recording([], ("after",), 0)], threads=1) == 0 and ahead._thread is None


EXIT_WHILE_A_JOB_FREES_TORCH = """
import threading, time
import torch
from kiln.kernels.cpu import onednn_ahead

class Layer:  # its last reference is the job's: freed on the background thread, inside torch (the GIL released)
    def __del__(self):
        a = torch.ones(256, 256)
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            torch.mm(a, a)

made = threading.Event()
def make(layer=Layer()):
    made.set()
    return True
onednn_ahead.AHEAD.schedule([onednn_ahead.Job(("exit",), 0, make)], 1)
del make
made.wait(30)
print("done", flush=True)
"""


def test_a_process_that_exits_while_a_job_is_freed_exits_cleanly():
    """Issue 14: a process that exited while the background thread was inside torch (freeing its last job) aborted
    after its work was done: "terminate called without an active exception", exit code -6 (every time here, before
    the thread was joined at exit; CI saw it in kiln serve's engine process and in a script that builds an engine)."""
    kiln_root = str(Path(onednn_ahead.__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": kiln_root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(EXIT_WHILE_A_JOB_FREES_TORCH)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout == "done\n" and done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "terminate called" not in done.stderr


def test_a_loaded_engine_makes_its_segments_plan_rewrite_ahead(built, monkeypatch):
    """A saved engine of a dynamic profile makes each segment's plan rewrite (native_views._PlanRewrite) on the
    background thread at load, so its first call at a new shape does not (before: that call made it, ~2-6 ms of
    Python on the tiny and base BERTs); the call's outputs still match onnxruntime. An engine of one shape (min =
    max) makes none."""
    engine, session = built
    assert onednn_ahead.AHEAD.wait(timeout=120), "the background thread did not finish"
    segments = [s for s in engine.program.segments if s._views]
    assert segments and all(s._rewrite is not None for s in segments)  # made at load: fails before
    made = []
    real = native_views._PlanRewrite.__init__
    monkeypatch.setattr(native_views._PlanRewrite, "__init__", lambda self, t: made.append(t) or real(self, t))
    rng = np.random.default_rng(zlib.crc32(b"plan rewrite ahead"))
    rows = int(rng.integers(3, MOST)) | 1
    x = rng.standard_normal((rows, K)).astype(np.float32)
    np.testing.assert_allclose(engine.run({"x": x})["y"], session.run(None, {"x": x})[0], rtol=ORT_TOL, atol=ORT_TOL)
    assert made == [] and any(key[0][0] == rows for s in segments for key in s.resized)
    assert all(not s.rewrite_ahead() for s in segments)  # once
    rewrites = lambda profiles: [j for j in first_calls.ahead_jobs(engine.program, profiles)  # noqa: E731
                                 if j.key[0] == "plan rewrite"]
    assert len(rewrites(engine.profiles)) == len(segments)
    one_shape = [Profile({name: ShapeRange(r.opt, r.opt, r.opt) for name, r in p.inputs.items()})
                 for p in engine.profiles]
    assert rewrites(one_shape) == []  # an engine of one shape has no other sizes to view


def test_a_job_that_raises_leaves_the_queue_working():
    """Work made ahead is an optimisation: a job that raises (a segment whose rewrite cannot be made ahead, as CI once
    saw) is counted and logged, and the jobs queued after it are still made."""
    done = []

    def fails():
        raise TypeError("not made ahead")

    ahead = onednn_ahead.Ahead()
    ahead.schedule([onednn_ahead.Job(("raises",), 0, fails), onednn_ahead.Job(("after",), 1, lambda: done.append(1))],
                   threads=1)
    assert ahead.wait(timeout=30)
    assert ahead.failed == 1 and done == [1]


def test_an_engines_plan_jobs_are_queued_past_the_budget():
    """The budget bounds the primitives made ahead (their JIT code's memory), not an engine's own plan work (its plan
    rewrite, its views grown and traced: uncounted jobs), which a process's later engines still get."""
    done = []
    ahead = onednn_ahead.Ahead(budget=1)
    jobs = [onednn_ahead.Job(("primitive", r), r, lambda r=r: done.append(r)) for r in (1, 2)]
    jobs.append(onednn_ahead.Job(("plan",), 5, lambda: done.append("plan"), counted=False))
    assert ahead.schedule(jobs, threads=1) == 2 and ahead.wait(timeout=30)
    assert done == [1, "plan"] and ahead.budget == 0
    assert ahead.schedule([onednn_ahead.Job(("plan", 2), 0, lambda: done.append("again"), counted=False)], 1) == 1
    assert ahead.wait(timeout=30) and done[-1] == "again"  # with the budget spent: fails when they count
