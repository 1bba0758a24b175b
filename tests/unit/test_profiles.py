"""Optimization profiles: the user's and kiln's defaults, checked at build, enforced at run, and every
shape inside a profile right against onnxruntime (fresh random shapes each run)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import kiln
from kiln import zoo
from kiln.builder.profiles import ProfileError
from kiln.cli import main
from kiln.errors import BindingError

RTOL, ATOL = 1e-4, 1e-4  # fp32: kernels sum in another order than onnxruntime's


@pytest.fixture(scope="module")
def bert():
    """BERT (2 layers) exported with symbolic batch and seq, attention_mask an input."""
    return zoo.export("bert_tiny", dynamic=True)


@pytest.fixture(scope="module")
def bert_engine(bert):
    return kiln.build(str(bert.path), profiles=[{"input_ids": "1x1,2x16,4x48"}])


def _ort(path):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _text_inputs(rng, batch: int, seq: int, vocab: int = 1024) -> dict[str, np.ndarray]:
    ids = rng.integers(0, vocab, (batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), np.int64)
    for row in range(batch):
        mask[row, rng.integers(1, seq + 1):] = 0  # each row keeps at least one token
    return {"input_ids": ids, "attention_mask": mask}


def test_a_user_profile_is_completed_through_shared_symbols(bert_engine):
    [profile] = bert_engine.plan.profiles
    assert profile.source == "user"
    assert set(profile.inputs) == {"input_ids", "attention_mask"}  # the mask follows input_ids' batch and seq
    for name in profile.inputs:
        r = profile.inputs[name]
        assert (r.min, r.opt, r.max) == ([1, 1], [2, 16], [4, 48])


def test_every_shape_inside_the_profile_matches_onnxruntime(bert, bert_engine):
    rng = np.random.default_rng()
    session = _ort(bert.path)
    shapes = {(1, 1), (4, 48), (2, 16)} | {(int(rng.integers(1, 5)), int(rng.integers(1, 49))) for _ in range(5)}
    for batch, seq in sorted(shapes):
        feeds = _text_inputs(rng, batch, seq)
        got = bert_engine.run(feeds)
        [want] = session.run(None, feeds)
        np.testing.assert_allclose(next(iter(got.values())), want, rtol=RTOL, atol=ATOL,
                                   err_msg=f"batch {batch} x seq {seq}")


def test_a_shape_outside_every_profile_names_input_shape_and_ranges(bert_engine):
    rng = np.random.default_rng()
    with pytest.raises(BindingError) as err:
        bert_engine.run(_text_inputs(rng, 1, 49))
    message = str(err.value)
    assert "outside every optimization profile" in message
    assert "input 'input_ids' shape [1, 49] is not inside [1..4, 1..48]" in message
    with pytest.raises(BindingError, match=r"\[5, 8\] is not inside \[1\.\.4, 1\.\.48\]"):
        bert_engine.run(_text_inputs(rng, 5, 8))


def test_a_rejected_signature_is_rejected_every_time(bert_engine):
    """A CPU context remembers the numpy signatures it checked and runs them unchecked after: a signature that
    failed its check must never be remembered (here twice in a row, the same error each time)."""
    rng = np.random.default_rng()
    context = bert_engine.create_execution_context()
    feeds = _text_inputs(rng, 2, 16)
    mismatched = {"input_ids": feeds["input_ids"], "attention_mask": np.ones((2, 17), np.int64)}
    wrong_dtype = {"input_ids": feeds["input_ids"].astype(np.int32), "attention_mask": feeds["attention_mask"]}
    for _ in range(2):
        with pytest.raises(BindingError, match=r"input 'attention_mask': dimension .* is 17, but input 'input_ids'"):
            context.run(mismatched)
        with pytest.raises(BindingError, match=r"input 'input_ids': expected dtype int64, given int32"):
            context.run(wrong_dtype)
    context.run(feeds)  # the good signature, then the bad ones again, now past a remembered signature
    with pytest.raises(BindingError, match="is 17"):
        context.run(mismatched)


def test_tactics_are_checked_at_both_ends_of_the_profile(bert_engine):
    checks = bert_engine.plan.header["tactics"].get("profiles")
    if checks is None:  # no layer has a tactic other than its default on this machine
        assert not any(s.tactic for s in bert_engine.plan.program.steps)
        return
    points = " ".join(checks["checked_at"])
    assert "profile 0 min input_ids[1, 1]" in points and "profile 0 max input_ids[4, 48]" in points


def test_several_profiles_the_first_that_fits_runs(bert):
    engine = kiln.build(str(bert.path), profiles=[
        {"input_ids": [[1, 1], [1, 8], [1, 16]]},
        {"input_ids": [[2, 8], [4, 32], [4, 64]], "attention_mask": [[2, 8], [4, 32], [4, 64]]},
    ])
    rng = np.random.default_rng()
    session = _ort(bert.path)
    context = engine.create_execution_context()
    for (batch, seq), profile in (((1, 12), 0), ((3, 40), 1), ((1, 1), 0)):
        feeds = _text_inputs(rng, batch, seq)
        got = context.run(feeds)
        assert context.profile == profile
        np.testing.assert_allclose(next(iter(got.values())), session.run(None, feeds)[0], rtol=RTOL, atol=ATOL)
    with pytest.raises(BindingError, match="profile 1 .*input 'input_ids' shape \\[1, 40\\]"):
        context.run(_text_inputs(rng, 1, 40))  # batch 1 is profile 0's, seq 40 only profile 1's


def test_default_profile_from_the_position_table(bert):
    engine = kiln.build(str(bert.path))
    [profile] = engine.plan.profiles
    assert profile.inputs["input_ids"].max == [64, 128]  # bert_tiny's position table has 128 rows
    assert profile.inputs["input_ids"].opt == [1, 128]
    assert "position table 'model.embeddings.position_embeddings.weight'" in profile.source
    assert "batch 1..64" in profile.source


def test_default_profile_takes_the_tuning_shapes(bert):
    engine = kiln.build(str(bert.path), shapes={"input_ids": [2, 200], "attention_mask": [2, 200]})
    r = engine.plan.profiles[0].inputs["input_ids"]
    assert r.opt == [2, 200] and r.max == [64, 200]  # the range widens to hold the tuning shape


def test_a_fixed_shape_model_has_no_profile():
    engine = kiln.build(str(zoo.export("bert_tiny").path))
    assert engine.plan.profiles == []


@pytest.mark.parametrize("profiles, message", [
    ([{"tokens": "1x1,2x2,4x4"}], r"no input named \['tokens'\]; the model's inputs are \['input_ids', "),
    ([{"input_ids": "1,2,4"}], r"input 'input_ids' has rank 2 \(int64\[batch, seq\]\); the profile gives ranks 1"),
    ([{"input_ids": "1x8,2x4,4x16"}], r"axis 1: min 8, opt 4, max 16 must satisfy min <= opt <= max"),
    ([{"input_ids": "1x1,2x16"}], r"expected MIN,OPT,MAX \(three shapes\)"),
    ([{"input_ids": "1x1,2x16,4x32", "attention_mask": "1x1,2x16,4x64"}],
     r"dimension 'seq' is 1\.\.32 \(opt 16\) for input 'input_ids' but 1\.\.64 \(opt 16\) for 'attention_mask'"),
    ([{"input_ids": "1x1,2xa,4x32"}], r"'2xa' is not dimensions separated by 'x'"),
])
def test_a_profile_that_does_not_fit_the_model_is_refused_clearly(bert, profiles, message):
    with pytest.raises(ProfileError, match=message):
        kiln.build(str(bert.path), profiles=profiles)


def test_a_fixed_dim_must_stay_fixed():
    exported = zoo.export("resnet_tiny", dynamic=True)  # pixel_values: [batch, 3, 64, 64]
    with pytest.raises(ProfileError, match=r"axis 1 is fixed at 3 in the model; the profile gives 1\.\.3"):
        kiln.build(str(exported.path), profiles=[{"pixel_values": "1x1x64x64,1x3x64x64,2x3x64x64"}])


def test_resnet_with_dynamic_batch_matches_onnxruntime_at_every_batch():
    exported = zoo.export("resnet_tiny", dynamic=True)
    engine = kiln.build(str(exported.path), profiles=[{"pixel_values": "1x3x64x64,2x3x64x64,6x3x64x64"}])
    session = _ort(exported.path)
    rng = np.random.default_rng()
    for batch in sorted({1, 6, int(rng.integers(1, 7)), int(rng.integers(1, 7))}):
        x = rng.standard_normal((batch, 3, 64, 64), dtype=np.float32)
        np.testing.assert_allclose(engine.run({"pixel_values": x})["logits"] if "logits" in engine.output_names
                                   else next(iter(engine.run({"pixel_values": x}).values())),
                                   session.run(None, {"pixel_values": x})[0], rtol=1e-3, atol=1e-3,
                                   err_msg=f"batch {batch}")  # 1e-3: a conv stack's fp32 sums


def test_gpt2_with_dynamic_sequence_matches_onnxruntime():
    exported = zoo.export("gpt2_tiny", dynamic=True)
    engine = kiln.build(str(exported.path), profiles=[{"input_ids": "1x1,2x32,3x96"}])
    session = _ort(exported.path)
    rng = np.random.default_rng()
    for batch, seq in sorted({(1, 1), (3, 96), (int(rng.integers(1, 4)), int(rng.integers(1, 97)))}):
        ids = rng.integers(0, 1024, (batch, seq), dtype=np.int64)
        np.testing.assert_allclose(next(iter(engine.run({"input_ids": ids}).values())),
                                   session.run(None, {"input_ids": ids})[0], rtol=RTOL, atol=ATOL,
                                   err_msg=f"batch {batch} x seq {seq}")


def test_cli_build_with_profiles_and_inspect_shows_them(bert, tmp_path, capsys):
    out = tmp_path / "bert.kiln"
    assert main(["build", str(bert.path), "-o", str(out), "--profile", "input_ids:1x1,2x8,2x16",
                 "--profile", "input_ids:3x1,4x8,4x32;attention_mask:3x1,4x8,4x32"]) == 0
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "optimization profile 0: input_ids [1..2, 1..16], attention_mask [1..2, 1..16]" in text
    assert "optimization profile 1: input_ids [3..4, 1..32], attention_mask [3..4, 1..32]" in text
    assert main(["build", str(bert.path), "-o", str(out), "--profile", "input_ids:1x1"]) == 1
    assert "expected MIN,OPT,MAX" in capsys.readouterr().err
