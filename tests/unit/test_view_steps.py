"""A signature's view layers recorded at its second run and run as one torch view each after (view_steps.py): from
the ops' outputs (program.LEAN_VIEWS off) or from what the view layers' lean launches kept (on, view_launches.py)."""

from __future__ import annotations

import threading
import zlib

import numpy as np
import onnxruntime as ort
import pytest
import torch

import kiln
from kiln.errors import ExecutionError
from kiln.ops import tensor as tensor_ops
from kiln.runtime import program as program_module, view_steps
from kiln.runtime.view_steps import SignatureViews, _Reshaped, _Strided
from tests.unit.llama_engine import llama_segments  # noqa: F401  (the fixture: its attentions unfused)

# fp32 logits of two decoder layers against onnxruntime's: summation orders differ (kiln's GEMMs, attention)
RTOL = ATOL = 1e-4


def _context(path, monkeypatch, lean: bool):
    monkeypatch.setenv("KILN_PAD_FIRST_CALLS", "0")  # every shape runs at its own sizes
    monkeypatch.setattr(program_module, "LEAN_VIEWS", lean)  # on: recorded from the lean launches' kept views
    context = kiln.load(str(path)).create_execution_context()
    context.warm_up()
    return context


def _feeds(context, rng, shape):
    feeds = {"input_ids": rng.integers(0, 100, shape, dtype=np.int64), "attention_mask": np.ones(shape, np.int64)}
    return {n: feeds[n] for n in context.engine.input_names}


def _mismatched(program) -> list:
    """The kept step lists' view layers whose recorded input is not of their signature's batch x sequence (each of
    llama_tiny's view layers reads an activation [batch, sequence, ...] or [batch, heads, sequence, ...])."""
    views = program.signature_views
    wrong = []
    for signature, steps in views._lists.items():
        b, s = signature[0][0]
        for i in views._positions:
            made = steps[i].fn
            size = tuple(made.in_size)
            if type(made) not in (_Strided, _Reshaped) or size[0] not in (b, b * 4) or s not in size:
                wrong.append((signature[0][0], steps[i].ctx.name, size))
    return wrong


def _calls_of(monkeypatch, owner, name) -> list:
    """The calls of owner.name on this thread from now on (not a background job's)."""
    calls, real, caller = [], getattr(owner, name), threading.get_ident()

    def counted(*a, **k):
        if threading.get_ident() == caller:
            calls.append(name)
        return real(*a, **k)
    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.mark.parametrize("lean", [False, True])
def test_llama_repeated_shapes_take_their_recorded_views_and_match_onnxruntime(llama_segments, monkeypatch, lean):
    """Shapes met again, other shapes between them (the same batch at another sequence, the same sequence at another
    batch, a batch or a sequence of 1): each call equals onnxruntime (fp32), and a shape's later calls equal its first
    call bit for bit (the same torch views and copies the ops make). From a shape's third call on, no view layer runs
    its op: every one of llama_tiny's 34 is one as_strided or reshape."""
    exported, path = llama_segments
    context = _context(path, monkeypatch, lean)
    program = context.engine.program
    assert program.signature_views is not None and len(program.signature_views._positions) == 34
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(zlib.crc32(b"llama view steps"))
    shapes = [(2, 8), (2, 9), (3, 8), (1, 16), (4, 1), (3, 13), (4, 16)]
    firsts = {}
    ops = _calls_of(monkeypatch, tensor_ops, "reshape_to")
    for turn in range(3):
        for shape in shapes + shapes[::-1]:
            feeds = _feeds(context, rng, shape)
            feeds["input_ids"] = firsts.setdefault(shape, (feeds["input_ids"], None))[0]
            ops.clear()
            got = next(iter(context.run(feeds).values()))
            np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=RTOL, atol=ATOL)
            if firsts[shape][1] is None:
                firsts[shape] = (feeds["input_ids"], got)
            else:
                np.testing.assert_array_equal(got, firsts[shape][1])
                if turn == 2:
                    assert not ops, (shape, ops)  # (a Reshape's op reshapes by reshape_to)
    assert not _mismatched(program)


@pytest.mark.parametrize("lean", [False, True])
def test_signature_views_follow_the_whole_signature(llama_segments, monkeypatch, lean):
    """A shape after another of the same batch (or sequence) takes its own recorded views: each kept list's layers
    recorded at its own batch x sequence, the outputs onnxruntime's. The check can fail: keyed by the batch alone (a
    wrong key), a shape after another of its batch takes the other's list, whose layers' guards run their ops on the
    other's shape values: the run fails or its outputs differ."""
    exported, path = llama_segments
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(zlib.crc32(b"llama view keys"))
    shapes = [(2, 8), (2, 9), (3, 9), (2, 8), (2, 5)]

    def run_all(context):
        for shape in shapes:
            feeds = _feeds(context, rng, shape)
            for _ in range(3):
                got = next(iter(context.run(feeds).values()))
                np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=RTOL, atol=ATOL)

    context = _context(path, monkeypatch, lean)
    run_all(context)
    assert not _mismatched(context.engine.program)
    assert len(context.engine.program.signature_views) == 4

    steps, keep = SignatureViews.steps, SignatureViews.keep
    monkeypatch.setattr(SignatureViews, "steps", lambda self, signature, lean: steps(self, signature[0][0][:1], lean))
    monkeypatch.setattr(SignatureViews, "keep", lambda self, signature, *a: keep(self, signature[0][0][:1], *a))
    with pytest.raises((ExecutionError, AssertionError)):
        run_all(_context(path, monkeypatch, lean))


@pytest.mark.parametrize("lean", [False, True])
def test_signature_views_are_bounded(llama_segments, monkeypatch, lean):
    """Past SIGNATURES, the least recently used signature's list goes; outputs stay onnxruntime's."""
    exported, path = llama_segments
    monkeypatch.setattr(view_steps, "SIGNATURES", 3)
    context = _context(path, monkeypatch, lean)
    views = context.engine.program.signature_views
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(zlib.crc32(b"llama view bound"))
    shapes = [(1, 3), (2, 4), (3, 5), (4, 6), (1, 7), (2, 7)]
    for k, shape in enumerate(shapes):
        feeds = _feeds(context, rng, shape)
        for _ in range(3):
            got = next(iter(context.run(feeds).values()))
        np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=RTOL, atol=ATOL)
        assert len(views) == min(k + 1, 3)
    assert [key[0][0] for key in views._lists] == shapes[-3:]


@pytest.mark.parametrize("op", ["transpose", "reshape copy"])
def test_a_recorded_view_runs_its_op_on_an_input_of_other_sizes_or_strides(op):
    """A layer's guard: an input whose sizes or strides are not the recorded ones (a data-dependent size upstream)
    takes the layer's own op, on the other inputs it was recorded with."""
    rng = np.random.default_rng(zlib.crc32(op.encode()))
    x = torch.from_numpy(rng.standard_normal((2, 3, 4, 5)).astype(np.float32))
    if op == "transpose":
        fn, rest, attributes = tensor_ops.transpose, (), {"perm": [0, 2, 1, 3]}
    else:
        fn, rest, attributes = tensor_ops.reshape, (torch.tensor([2, 60]),), {}
        x = x.transpose(1, 2)  # (its Reshape copies)
    recorder = view_steps._Recorder(fn, "Transpose" if op == "transpose" else "Reshape")
    y = recorder(None, x, *rest, **attributes)
    made = recorder.made
    assert type(made) is (_Strided if op == "transpose" else _Reshaped)
    torch.testing.assert_close(made(None, x), y, rtol=0, atol=0)
    others = [x.contiguous(), x[:1], torch.from_numpy(rng.standard_normal((2, 4, 3, 5)).astype(np.float32))]
    for other in others:
        if op != "transpose" and other.numel() != 120:
            continue
        torch.testing.assert_close(made(None, other), fn(None, other, *rest, **attributes), rtol=0, atol=0)
