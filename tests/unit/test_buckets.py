"""Shape buckets (kiln/runtime/buckets.py): which dims pad, to which sizes, and padding never
changes a result (padded runs against unpadded ones and against onnxruntime, fresh shapes each run).
CUDA pads by default; here the CPU context is asked to, which runs the same padding and cropping."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import kiln
from kiln import zoo
from kiln.plan.spec import Binding
from kiln.runtime.buckets import plan_buckets

# Padded and unpadded runs differ only in the GEMMs' and attention's summation order over other
# shapes (fp32): well inside 1e-5 of the scale of BERT's LayerNorm'd outputs.
RTOL, ATOL = 1e-5, 2e-5


@pytest.fixture(scope="module")
def bert():
    exported = zoo.export("bert_tiny", dynamic=True)
    return exported, kiln.build(str(exported.path), profiles=[{"input_ids": "1x1,2x16,4x48"}])


def _feeds(rng, batch, seq):
    mask = np.ones((batch, seq), np.int64)
    for row in range(batch):
        mask[row, rng.integers(1, seq + 1):] = 0
    return {"input_ids": rng.integers(0, 1024, (batch, seq), dtype=np.int64), "attention_mask": mask}


def test_bert_pads_batch_and_the_masked_sequence(bert):
    _, engine = bert
    buckets = plan_buckets(engine.inputs, engine.outputs)
    assert buckets.symbols == {"batch": 1, "seq": 8}
    assert buckets.sizes("seq", 1, 48) == [8, 16, 32, 48]
    assert buckets.sizes("batch", 1, 4) == [1, 2, 4]
    assert buckets.sizes("seq", 1, 512) == [8, 16, 32, 64, 128, 192, 256, 384, 512]  # 1.5x steps from 128
    assert buckets.sizes("batch", 1, 32) == [1, 2, 4, 8, 16, 24, 32]
    assert buckets.sizes("batch", 3, 20) == [4, 8, 16, 20]
    assert buckets.bucket("seq", 33, 1, 48) == 48 and buckets.bucket("seq", 9, 1, 48) == 16
    assert buckets.crops == [[(0, "batch"), (1, "seq")]]


def test_padding_never_changes_a_result(bert):
    exported, engine = bert
    padded = engine.create_execution_context(buckets=True)
    plain = engine.create_execution_context(buckets=False)
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng()
    shapes = {(3, 9), (1, 1), (4, 48)} | {(int(rng.integers(1, 5)), int(rng.integers(1, 49))) for _ in range(4)}
    for batch, seq in sorted(shapes):
        feeds = _feeds(rng, batch, seq)
        got = next(iter(padded.run(feeds).values()))
        assert got.shape == (batch, seq, 64)  # cropped back
        np.testing.assert_allclose(got, next(iter(plain.run(feeds).values())), rtol=RTOL, atol=ATOL,
                                   err_msg=f"padded vs unpadded, batch {batch} x seq {seq}")
        np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=1e-4, atol=1e-4)


def test_a_decoder_without_a_mask_pads_only_batch_unless_told():
    exported = zoo.export("gpt2_tiny", dynamic=True)
    engine = kiln.build(str(exported.path), profiles=[{"input_ids": "1x1,2x16,3x40"}])
    assert plan_buckets(engine.inputs, engine.outputs).symbols == {"batch": 1}
    causal = kiln.build(str(exported.path), profiles=[{"input_ids": "1x1,2x16,3x40"}], pad_dims=["seq"])
    buckets = plan_buckets(causal.inputs, causal.outputs, ["seq"])
    assert buckets.symbols == {"batch": 1, "seq": 8}
    padded = causal.create_execution_context(buckets=True)
    rng = np.random.default_rng()
    for batch, seq in ((1, 5), (3, 17), (2, int(rng.integers(1, 41)))):
        ids = rng.integers(0, 1024, (batch, seq), dtype=np.int64)
        # causal attention: tokens padded at the end are never seen by the real ones
        np.testing.assert_allclose(next(iter(padded.run({"input_ids": ids}).values())),
                                   next(iter(engine.run({"input_ids": ids}).values())), rtol=RTOL, atol=1e-4)


def test_no_bucket_where_an_output_could_not_be_cropped():
    inputs = [Binding("x", "float", ["batch", 8])]
    assert plan_buckets(inputs, [Binding("y", "float", ["batch", 8])]).symbols == {"batch": 1}
    assert plan_buckets(inputs, [Binding("y", "float", [None, 8])]) is None  # unnamed dynamic dim
    assert plan_buckets(inputs, [Binding("y", "float", ["batch + 1", 8])]) is None  # an expression
    assert plan_buckets(inputs, [Binding("y", "float", None)]) is None  # rank unknown
    assert plan_buckets([Binding("x", "float", [4, 8])], [Binding("y", "float", [4, 8])]) is None  # fixed


def test_a_symbol_off_axis_0_without_a_mask_does_not_pad():
    inputs = [Binding("x", "float", ["batch", "n", 3])]
    assert plan_buckets(inputs, [Binding("y", "float", ["batch", "n", 3])]).symbols == {"batch": 1}


def test_warm_up_runs_every_bucket_once(bert):
    _, engine = bert
    context = engine.create_execution_context(buckets=True)
    assert context.warm_up() == 3 * 4  # batch 1, 2, 4 x seq 8, 16, 32, 48
    assert len(engine.program.shape_plans) >= 12
    plain = engine.create_execution_context(buckets=False)
    assert plain.warm_up() == 1  # no buckets: the opt shape
