"""Transformer encoders exported with symbolic batch and sequence run on the CPU as one native segment
(kiln/tactics/cpu/transformer.py, attention.py, broadcast.py; kiln/runtime/native.py) when their layers' native tactics
are chosen (made deterministic here: see native_first), mask preparation included,
and match onnxruntime at fresh random shapes inside their profile with real padding masks (left,
right, none, a row with no token). Tolerance: fp32 through 2 layers of 64-wide sums, 1e-4 absolute
on LayerNorm outputs of O(1); padded vs unpadded runs of kiln itself agree to 1e-5 on real tokens (the
same kernels, another row count: only the GEMM's blocking may reorder sums).

Contexts run with pad_first_calls=False: these tests are of binding at a new shape itself (a first call
run padded in a bound shape, timed against binding, is tests/unit/test_first_calls.py's)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import kiln
from kiln import zoo
from kiln.builder import autotune
from kiln.kernels.cpu import onednn
from kiln.kernels.cpu import transformer as kernels
from kiln.runtime import native
from kiln.runtime.native import Segment
from kiln.tactics.tactic import DEFAULT

pytestmark = pytest.mark.skipif(not (onednn.available() and kernels.available()),
                                reason="needs libdnnl and kiln's C kernels")

rng = np.random.default_rng()
PROFILE = "1x1,2x16,6x80"


def native_first(points: list[dict[str, float]]) -> str:
    """The tuner's choice made deterministic for the structure under test: a native tactic where one ran
    (timings on a shared 2-core machine decide nothing reliably), else the default."""
    from kiln.tactics import registry

    return next((k for k in points[0] if k != DEFAULT and registry.get(k).native), DEFAULT)


def build(name: str):
    exported = zoo.export(name, dynamic=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(autotune, "_choose_over", native_first)
        engine = kiln.build(str(exported.path), profiles=[{"input_ids": PROFILE}])
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    return engine, session


@pytest.fixture(scope="module")
def bert():
    return build("bert_tiny")


def padded_mask(b: int, s: int, kind: str) -> np.ndarray:
    mask = np.ones((b, s), np.int64)
    for row in range(b):
        real = int(rng.integers(1, s + 1))
        if kind == "right" or (kind == "mixed" and rng.random() < 0.5):
            mask[row, real:] = 0
        elif kind in ("left", "mixed"):
            mask[row, :s - real] = 0
    return mask


def feeds(b: int, s: int, mask: np.ndarray) -> dict[str, np.ndarray]:
    return {"input_ids": rng.integers(0, 1000, (b, s), dtype=np.int64), "attention_mask": mask}


def lean_steps(engine) -> list:
    return engine.program.lean_steps


def test_the_encoder_is_one_native_segment_mask_included(bert):
    engine, _ = bert
    program = engine.program
    (step,) = lean_steps(engine)  # a known shape: nothing but the segment runs
    assert isinstance(step.fn, Segment)
    ops = {m.ctx.op_type for m in step.fn.members}
    # the mask: Reshape(Where(Cast(attention_mask)), [0, 1, 1, -1]), the [B, 1, 1, S] key mask (attention_key_mask)
    assert {"Gather", "LayerNorm", "FusedGemm", "Attention", "Cast", "Where", "Reshape"} <= ops
    shape_only = {id(program.steps[i]) for i in program.shape_steps}
    outside = [s.ctx.op_type for s in program.run_steps if s is not step and id(s) not in shape_only]
    assert outside == [], f"layers outside the segment: {outside}"


@pytest.mark.parametrize("kind", ["right", "left", "mixed", "none"])
def test_random_shapes_with_padding_match_onnxruntime(bert, kind):
    engine, session = bert
    context = engine.create_execution_context(pad_first_calls=False)
    for _ in range(4):
        b, s = int(rng.integers(1, 7)), int(rng.integers(1, 81))
        mask = padded_mask(b, s, kind) if kind != "none" else np.ones((b, s), np.int64)
        if kind == "mixed" and b > 1:
            mask[-1] = 0  # a row that sees no token: the exported graph gives it a finite output
        x = feeds(b, s, mask)
        got = next(iter(context.run(x).values()))
        want = session.run(None, x)[0]
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4, err_msg=f"{b}x{s} {kind}")
    bound = [key for seg in engine.program.segments for key, other in seg.resized.items() if other is not None]
    assert bound, "no segment was bound at another shape"


def test_padding_never_changes_the_real_tokens(bert):
    engine, _ = bert
    b, s = 4, int(rng.integers(8, 60))
    mask = padded_mask(b, s, "right")
    x = feeds(b, s, mask)
    batch = next(iter(engine.run(x).values()))
    for row in range(b):
        real = int(mask[row].sum())
        alone = next(iter(engine.run({"input_ids": x["input_ids"][row:row + 1, :real],
                                      "attention_mask": np.ones((1, real), np.int64)}).values()))
        np.testing.assert_allclose(batch[row, :real], alone[0], atol=1e-5, rtol=1e-5, err_msg=f"row {row}")


def test_the_same_shape_again_takes_the_checked_path_and_stays_right(bert):
    engine, session = bert
    context = engine.create_execution_context(pad_first_calls=False)
    x = feeds(3, 17, padded_mask(3, 17, "mixed"))
    first = next(iter(context.run(x).values()))
    assert context._checked, "the checked signature was not remembered"
    x2 = {**x, "input_ids": rng.integers(0, 1000, (3, 17), dtype=np.int64)}
    np.testing.assert_allclose(next(iter(context.run(x2).values())), session.run(None, x2)[0], atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(next(iter(context.run(x).values())), first)
    with pytest.raises(kiln.errors.BindingError):  # a wrong dtype is still refused with the general checks
        context.run({**x, "attention_mask": x["attention_mask"].astype(np.int32)})


def test_other_shapes_are_views_over_one_growing_template(bert, monkeypatch):
    """A stream of shapes binds no segment per shape: each is a view (the members' plans at its sizes)
    over a template whose arena grows to the largest sizes seen; the views equal onnxruntime, and equal
    a segment bound on its own at that shape bit for bit (same kernels, same plans)."""
    engine, session = bert
    monkeypatch.setenv("KILN_DIRECT_RUN", "0")  # the general path, whose runs of a view (_run_bound) this counts:
    context = engine.create_execution_context(pad_first_calls=False)  # direct runs' are test_direct_run.py's
    (segment,) = context.program.segments  # the engine's, or a lane's when another context is alive (own arena)
    segment.resized.clear()
    segment._grown = None  # the segment is its own template again
    ran = []
    run_view = native._Resized._run_bound
    monkeypatch.setattr(native._Resized, "_run_bound", lambda view, values, into=None: ran.append((view, values))
                        or run_view(view, values, into))
    shapes = [(1, 5), (2, 9), (6, 80), (3, 33), (1, 80), (5, 2), (4, 61)]
    for b, s in shapes:
        x = feeds(b, s, padded_mask(b, s, "mixed"))
        got = next(iter(context.run(x).values()))
        np.testing.assert_allclose(got, session.run(None, x)[0], atol=1e-4, rtol=1e-4, err_msg=f"{b}x{s}")
    assert len(ran) == len(shapes), "a shape ran outside the views"
    for view, values in ran:
        key = tuple(tuple(v.shape) for v in values)
        alone = Segment(segment.members, segment.read_after, segment.constants, segment._natives_at(key).natives)
        for mine, theirs in zip(_as_tuple(run_view(view, values)), _as_tuple(alone._run_bound(values))):
            assert mine.equal(theirs), f"view at {key} differs from a segment of its own"
    templates = {id(view.template) for view, _ in ran}
    assert len(templates) <= 3, f"{len(templates)} templates bound for {len(shapes)} shapes"
    largest = segment._natives_at(tuple(tuple(v.shape) for v in ran[2][1]))  # the 6 x 80
    assert (segment._grown or segment).fits(largest.natives, largest.forms)


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def test_a_t5_encoder_with_rmsnorm_is_one_segment_and_matches_onnxruntime():
    """T5's RMSNorm (kiln::RMSNorm after the fusion) runs in kiln's C LayerNorm kernel without the mean
    (cpu.rmsnorm.native), so the encoder's layers are one segment; the relative-position bias is shape
    arithmetic, computed once per input shape. Random shapes with padding against onnxruntime."""
    engine, session = build("t5_encoder_tiny")
    (step,) = lean_steps(engine)
    assert isinstance(step.fn, Segment)
    assert "RMSNorm" in {m.ctx.op_type for m in step.fn.members}
    names = {i.name for i in session.get_inputs()}
    for _ in range(3):
        b, s = int(rng.integers(1, 7)), int(rng.integers(1, 81))
        x = {k: v for k, v in feeds(b, s, padded_mask(b, s, "right")).items() if k in names}
        got = next(iter(engine.run(x).values()))
        np.testing.assert_allclose(got, session.run(None, x)[0], atol=1e-4, rtol=1e-4, err_msg=f"t5 {b}x{s}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["distilbert_tiny", "albert_tiny"])
def test_other_encoders_are_one_segment_and_match_onnxruntime(name):
    engine, session = build(name)
    (step,) = lean_steps(engine)
    assert isinstance(step.fn, Segment)
    for _ in range(3):
        b, s = int(rng.integers(1, 7)), int(rng.integers(1, 81))
        x = feeds(b, s, padded_mask(b, s, "mixed"))
        got = next(iter(engine.run(x).values()))
        np.testing.assert_allclose(got, session.run(None, x)[0], atol=1e-4, rtol=1e-4, err_msg=f"{name} {b}x{s}")
