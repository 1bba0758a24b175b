"""Capture streams (kiln/runtime/capture_streams.py): every live GraphRunner warms up and captures its CUDA graphs on a
stream no other live runner has, so no two runners' graphs share torch's cuBLAS workspace (cached per cuBLAS handle
and stream: issue 14's wrong answers under kiln serve, two instances captured on one thread and torch's one default
capture stream, replayed at once). Without a GPU: torch's stream pool (round robin) and its graph capture are stood
in for, recording which stream each capture ran on. The GPU half: tests/gpu/test_concurrent_contexts.py."""

from __future__ import annotations

import contextlib
import gc
import logging

import pytest
import torch

from kiln.runtime import cuda_graphs
from kiln.runtime.capture_streams import CaptureStreams
from kiln.runtime.cuda_graphs import GraphRunner


class _Stream:
    def __init__(self, handle: int, priority: int):
        self.cuda_stream, self.priority = handle, priority

    def wait_stream(self, other) -> None:
        pass

    def __repr__(self) -> str:
        return f"<stream {self.cuda_stream}>"


class _Pool:
    """torch.cuda.Stream() as it behaves: `size` streams per priority handed out round robin, one counter per
    priority whoever draws (instances, side streams and capture streams all advance it)."""

    def __init__(self, size: int):
        self.size, self.drawn = size, {}

    def draw(self, device=None, priority: int = 0) -> _Stream:
        k = self.drawn.get(priority, 0)
        self.drawn[priority] = k + 1
        return _Stream(1000 * -priority + k % self.size, priority)


def test_two_holders_never_get_the_same_stream_though_the_pool_hands_it_out_again():
    pool = _Pool(4)
    streams = CaptureStreams(pool.draw, pool_size=4, priorities=(0,))
    a = streams.take("cuda:0")
    for _ in range(3):  # instance and side streams drawn meanwhile: the round robin is back at a's
        pool.draw()
    assert pool.draw().cuda_stream == a.cuda_stream  # what a plain torch.cuda.Stream() would give the next runner
    for _ in range(3):
        pool.draw()
    b = streams.take("cuda:0")
    assert b.cuda_stream != a.cuda_stream
    c, d = streams.take("cuda:0"), streams.take("cuda:0")
    assert len({s.cuda_stream for s in (a, b, c, d)}) == 4 and streams.holders() == 4
    streams.give_back("cuda:0", b.cuda_stream)  # b's runner is gone: its stream is the one free
    assert streams.take("cuda:0").cuda_stream == b.cuda_stream


def test_devices_are_kept_apart_and_a_full_pool_moves_to_the_next_priority_then_shares(caplog):
    pool = _Pool(2)
    streams = CaptureStreams(pool.draw, pool_size=2, priorities=(0, -1))
    first = [streams.take("cuda:0") for _ in range(4)]
    assert [s.priority for s in first] == [0, 0, -1, -1] and len({s.cuda_stream for s in first}) == 4
    assert streams.take("cuda:1").cuda_stream in {s.cuda_stream for s in first}  # another device's stream: its own
    with caplog.at_level(logging.WARNING, logger="kiln.runtime"):
        shared = streams.take("cuda:0")
    assert shared.cuda_stream in {s.cuda_stream for s in first}
    assert "hold every stream of torch's pools" in caplog.text and "must not run at the same time" in caplog.text
    streams.give_back("cuda:0", shared.cuda_stream)
    assert streams.holders() == 5  # the shared stream still has its first holder


def test_a_stream_comes_back_when_its_owner_is_garbage():
    pool = _Pool(8)
    streams = CaptureStreams(pool.draw, pool_size=8, priorities=(0,))

    class Owner:
        pass

    owner = Owner()
    streams.take_for(owner, "cuda:0")
    assert streams.holders() == 1
    del owner
    gc.collect()
    assert streams.holders() == 0


class _Program:
    """A program stand-in: doubles its input, recording the stream each run ran on."""

    def __init__(self, current: list):
        self.current, self.ran_on = current, []

    def run(self, inputs, plan=None):
        self.ran_on.append(self.current[-1])
        return [inputs[0] * 2]


class _Graph:
    def replay(self) -> None:
        pass


@pytest.fixture
def captures(monkeypatch):
    """torch's CUDA calls around a capture stood in for: which stream each capture ran on, in order."""
    pool = _Pool(4)  # small, as the process's other streams make torch's 32 in a server
    registry = CaptureStreams(pool.draw, pool_size=4, priorities=(0,))
    monkeypatch.setattr(cuda_graphs, "CAPTURE_STREAMS", registry, raising=False)  # raising: the old module had none
    ambient = _Stream(-1, 0)
    current = [ambient]
    captured = []

    @contextlib.contextmanager
    def stream(s):
        current.append(s)
        try:
            yield
        finally:
            current.pop()

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None):  # torch.cuda.graph: stream None is its one default capture stream
        captured.append(stream)
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "Stream", pool.draw)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *args: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    monkeypatch.setattr(cuda_graphs, "_replay_ms", lambda g: 0.1)
    return captured, current, pool


def test_each_runner_warms_up_and_captures_on_a_stream_of_its_own(captures):
    """Two contexts' runners on one thread (kiln serve warms every instance of a model up on its loading thread): their
    graphs are captured on two streams, never torch's shared default, each runner always on its own; the eager run
    before a capture (where cuBLAS's workspace for the stream is allocated) runs there too."""
    captured, current, pool = captures
    programs = [_Program(current), _Program(current)]
    runners = [GraphRunner(p) for p in programs]
    x = torch.randn(2, 3)
    for runner in runners:
        out = runner.run([x])  # first sight: eager, then captured
        torch.testing.assert_close(out[0], 2 * x)
        for _ in range(5):  # side streams and instance streams drawn between the captures
            pool.draw()
    runners[0].run([torch.randn(4, 3)])  # a second signature of the first runner
    assert None not in captured, "a graph captured on torch.cuda.graph's one default stream, shared by every runner"
    first, second, again = captured
    assert first.cuda_stream != second.cuda_stream, "two runners' graphs on one stream share cuBLAS's workspace"
    assert again is first
    for program, stream in zip(programs, (first, second)):
        assert program.ran_on[1] is stream  # the host-sync check's eager run: on the capture stream
        assert all(s.cuda_stream != -1 for s in program.ran_on[1:3])
    assert all(r.stats.captures >= 1 for r in runners)


def test_kiln_capture_streams_0_captures_on_torchs_one_default_stream(captures, monkeypatch):
    """The A/B switch: the old behaviour, every runner's graphs on torch.cuda.graph's default capture stream."""
    captured, current, _ = captures
    monkeypatch.setenv("KILN_CAPTURE_STREAMS", "0")
    for _ in range(2):
        GraphRunner(_Program(current)).run([torch.randn(2, 3)])
    assert captured == [None, None]
