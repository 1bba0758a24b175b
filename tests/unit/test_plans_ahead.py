"""A loaded decoder of several native segments computes its profile's shape plans on the background thread
(issue 10, views_ahead.plans_ahead_at, first_calls.plan_shapes): gpt2_tiny's shape function builds its causal mask
from both batch and sequence, ~14 ops at each new batch x sequence (~0.4-0.8 ms of a later first call's ~1 ms
outside the loop). After the job, first calls at fresh shapes find their plans and run no shape function, and
match onnxruntime; the plans made ahead are the values a call computes."""

from __future__ import annotations

import threading
import zlib

import numpy as np
import pytest
import torch

import kiln
from kiln import zoo
from kiln.kernels.cpu import onednn_ahead
from kiln.runtime import first_calls, views_ahead
from kiln.tactics import registry

PROFILE = "1x1,2x8,4x16"  # 64 input shapes: every one planned ahead (PLANS_AHEAD 128)
ORT_TOL = 1e-4  # fp32 logits of two layers summed in other orders than onnxruntime's
NEW_SHAPES = [(3, 5), (1, 13), (4, 16), (2, 3), (1, 1), (3, 11)]


@pytest.fixture(scope="module")
def exported():
    return zoo.export("gpt2_tiny", batch=2, seq=8, dynamic=True)


@pytest.fixture(scope="module")
def saved(exported, tmp_path_factory):
    path = tmp_path_factory.mktemp("plans_ahead") / "gpt2_tiny.kiln"
    # gpt2_tiny is one native segment (each attention takes its head merge); with its attentions left to torch it is
    # three, the program of several segments whose plans this file is about
    tactics = [name for name in registry.all_tactics("cpu") if name != "cpu.attention.native"]
    kiln.build(str(exported.path), device="cpu", profiles=[{"input_ids": PROFILE}], tactics=tactics).save(path)
    assert onednn_ahead.AHEAD.wait(timeout=120), "the background thread did not finish"
    return path


@pytest.fixture(scope="module")
def session(exported):
    import onnxruntime as ort
    return ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])


def _loaded(saved):
    context = kiln.load(str(saved)).create_execution_context()
    assert onednn_ahead.AHEAD.wait(timeout=120), "the background thread did not finish"
    return context


def _count_shape_function(program, monkeypatch) -> list[int]:
    calls = [0]
    fn = program.shape_function.fn

    def counted(env):
        calls[0] += 1
        return fn(env)
    monkeypatch.setattr(program.shape_function, "fn", counted)
    return calls


def _ids(shape: tuple[int, int]) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(repr(("plans ahead", shape)).encode())).integers(0, 1000, shape)


def _check(context, session, shapes) -> None:
    for shape in shapes:
        ids = _ids(shape)
        got = context.run({"input_ids": ids})
        names = [o.name for o in session.get_outputs()]
        assert set(got) == set(names)
        for name, want in zip(names, session.run(None, {"input_ids": ids})):
            g = got[name].numpy() if isinstance(got[name], torch.Tensor) else np.asarray(got[name])
            np.testing.assert_allclose(g, want, rtol=ORT_TOL, atol=ORT_TOL, err_msg=f"{name} at {shape}")


def test_first_calls_after_load_find_their_plans_and_match_onnxruntime(saved, session, monkeypatch):
    context = _loaded(saved)
    program = context.program
    assert len(program.segments) > 1 and program.plans_ahead  # several segments: the segments job's program
    planned = {sig[0][0] for sig in program.shape_plans}
    assert {(b, s) for b in range(1, 5) for s in range(1, 17)} <= planned
    calls = _count_shape_function(program, monkeypatch)
    _check(context, session, NEW_SHAPES)
    assert calls[0] == 0, "a first call computed its shape values: no plan made ahead"


def test_without_the_plans_first_calls_run_the_shape_function(saved, session, monkeypatch):
    monkeypatch.setattr(first_calls, "plan_shapes", lambda program, profiles: [])
    context = _loaded(saved)
    program = context.program
    calls = _count_shape_function(program, monkeypatch)
    _check(context, session, NEW_SHAPES[:3])
    assert calls[0] == 3


def test_plans_made_ahead_are_the_values_a_call_computes(saved):
    program = _loaded(saved).program
    for shape in [(1, 1), (3, 7), (4, 16)]:
        with program._plans_lock:
            ahead = dict(program.shape_plans[((shape, torch.int64),)])
        env = list(program.template)
        env[program.input_slots[0]] = torch.from_numpy(_ids(shape))
        with torch.inference_mode():
            program.shape_function(env)
        assert set(ahead) == set(program.plan_slots)
        for slot, value in ahead.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, env[slot]) and value.dtype == env[slot].dtype, (shape, slot)
            else:
                assert value == env[slot], (shape, slot)


def test_plan_shapes_are_the_smallest_of_the_profile_and_bounded(saved, monkeypatch):
    from kiln.plan.spec import Profile, ShapeRange

    program = _loaded(saved).program
    wide = Profile({"input_ids": ShapeRange((1, 1), (2, 64), (8, 1024))})
    shapes = first_calls.plan_shapes(program, [wide])
    assert len(shapes) == first_calls.PLANS_AHEAD
    sizes = [b * s for ((b, s),) in shapes]
    assert sizes == sorted(sizes) and shapes[0] == [(1, 1)]
    assert all(1 <= b <= 8 and 1 <= s <= 1024 for ((b, s),) in shapes)
    small = first_calls.plan_shapes(program, [Profile({"input_ids": ShapeRange((2, 3), (2, 4), (3, 5))})])
    assert sorted(shapes_ for ((shapes_),) in small) == [(b, s) for b in (2, 3) for s in (3, 4, 5)]
    monkeypatch.setattr(program, "plans_ahead", False)
    assert first_calls.plan_shapes(program, [wide]) == []
    assert first_calls.plan_shapes(program, [Profile({"other": ShapeRange((1,), (1,), (2,))})]) == []


def test_the_plans_stop_at_their_byte_budget(saved, monkeypatch):
    monkeypatch.setattr(views_ahead, "PLANS_AHEAD_BYTES", 1)  # the first plan passes it
    plans = _loaded(saved).program.shape_plans
    assert (((1, 1), torch.int64),) in plans and len(plans) <= 2  # the smallest made ahead (and a call's at most)


def test_without_the_plans_the_mask_is_cut_from_the_largest_shapes(saved, session, monkeypatch):
    """Past the plans made ahead (none here), a first call's shape function cuts the causal mask from its value at the
    profile's largest shape (kiln/runtime/shape_corners.py: made by the segments job at load) instead of running its
    steps; the outputs match onnxruntime. With CORNERS off the steps run (the cut is absent from the source)."""
    from kiln.runtime import shape_corners, shape_function

    monkeypatch.setattr(first_calls, "plan_shapes", lambda program, profiles: [])
    context = _loaded(saved)
    function = context.program.shape_function
    cuts = [v for k, v in function.fn.__globals__.items() if k.startswith("_corner")]
    assert len(cuts) == 1 and cuts[0].dims == (4, 16), function.source
    served, caller = [], threading.get_ident()
    real = shape_corners.CornerCut.__call__

    def counted(self, dims, extents):  # this thread's calls only (another engine's background job under xdist is not)
        found = real(self, dims, extents)
        if threading.get_ident() == caller:
            served.append(found)
        return found
    monkeypatch.setattr(shape_corners.CornerCut, "__call__", counted)
    calls = _count_shape_function(context.program, monkeypatch)
    _check(context, session, NEW_SHAPES[:3] + [(2, 15), (1, 2)])
    assert calls[0] == 5 and len(served) == 5 and all(v is not None for v in served)
    monkeypatch.setattr(shape_function, "CORNERS", False)
    assert "_corner" not in _loaded(saved).program.shape_function.source
