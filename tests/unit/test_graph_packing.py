"""A padding-free context replaying CUDA graphs packs by graph_rows (kiln/runtime/buckets.py): a run of 2K+ bucketed
positions is padded to the profile's largest shape and packed to its token bucket, a smaller one runs the plain
program at its bucket (8x128 no longer pays for 32x512), so a stream of shapes replays at most one graph per token
bucket plus the small buckets'.
The rule is CUDA's; here it is forced on a CPU context (the same code path, no graphs) and checked against
onnxruntime (packed vs unpadded), by which program and rows each run takes, and by the signatures a stream meets
after warm_up (all of them warmed up: no capture in the stream; at most 64 for BERT-base's 32x512 profile)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

import kiln
from kiln import zoo
from kiln.runtime.buckets import PACKING_RULES, graph_rows, graph_signatures, graph_token_buckets, plan_buckets, \
    token_bucket
from kiln.runtime.cuda_graphs import MAX_GRAPHS

CUDA = PACKING_RULES["cuda"]
PROFILE = [{"input_ids": "1x1,2x16,32x128"}]  # up to 4096 positions: runs of 2048+ bucketed positions pack
RTOL, ATOL = 1e-5, 2e-5  # fp32 against onnxruntime: packed GEMMs and attention sum over other row counts


@pytest.fixture(scope="module")
def engine_and_session():
    exported = zoo.export("bert_tiny", dynamic=True)
    free = kiln.build(str(exported.path), profiles=PROFILE, remove_padding=True)
    return free, ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])


def _graph_context(engine):
    """A CPU context that packs as a CUDA-graph context does (its _graph_packing_rule needs CUDA graphs)."""
    context = engine.create_execution_context(buckets=True)
    context._graph_packing = CUDA
    context.buckets.batch = None
    return context


def _spy(monkeypatch, context) -> list[tuple]:
    """Each program run of `context`: (which program, input shapes, packed rows or None): what keys its graph."""
    seen: list[tuple] = []
    run = context._run_program

    def spy(args, rows=None):
        seen.append(("packed" if rows is not None else "plain", tuple(tuple(a.shape) for a in args), rows))
        return run(args, rows)
    monkeypatch.setattr(context, "_run_program", spy)
    return seen


def _feeds(rng, batch: int, seq: int, real: float) -> dict[str, np.ndarray]:
    mask = np.zeros((batch, seq), np.int64)
    for row in range(batch):
        mask[row, :max(1, int(rng.integers(int(real * seq) // 2, int(real * seq) + 1)))] = 1
    return {"input_ids": rng.integers(0, 1024, (batch, seq), dtype=np.int64), "attention_mask": mask}


def test_graph_rows_are_token_buckets_from_the_floor():
    assert [graph_rows(t, 16384, CUDA) for t in (1, 300, 1024, 1025, 3757, 4097, 12511, 15360, 15361, 16384)] == \
        [1024, 1024, 1024, 1280, 4096, 4608, 13312, 15360, 16384, 16384]
    assert graph_rows(5, 512, CUDA) == 512  # a profile smaller than the floor: every position
    for tokens in range(1, 16385, 97):  # never fewer rows than tokens; above the floor at most a quarter more up
        rows = graph_rows(tokens, 16384, CUDA)  # to 4K rows, an eighth more past them
        assert tokens <= rows <= max(1024, (1.25 if tokens <= 4096 else 1.125) * tokens)
        assert rows in graph_token_buckets(16384, CUDA) + [16384]


def test_bert_base_stream_profile_holds_at_most_64_graphs():
    # BERT-base's stream profile, 1x1..32x512: batch buckets 1..32, sequence buckets 16..512
    buckets = plan_buckets(*_bert_bindings())
    batches, sequences = buckets.sizes("batch", 1, 32), buckets.sizes("seq", 1, 512)
    assert batches == [1, 2, 4, 8, 16, 32] and sequences == [16, 32, 64, 128, 192, 256, 320, 384, 448, 512]
    buckets_below = sum(1 for b in batches for s in sequences if b * s < 2048)
    assert len(graph_token_buckets(16384, CUDA)) == 24 and buckets_below == 39
    assert graph_signatures(batches, sequences, 16384, CUDA) == 64 <= MAX_GRAPHS  # nothing evicted
    assert token_bucket(15361, 16384) == 16384  # the identity packing's bucket: the plain program at 32x512


def _bert_bindings():
    from kiln.plan.spec import Binding
    inputs = [Binding("input_ids", "int64", ["batch", "seq"]), Binding("attention_mask", "int64", ["batch", "seq"])]
    return inputs, [Binding("last_hidden_state", "float", ["batch", "seq", 768])]


def test_large_runs_pack_at_the_largest_shape_and_match_onnxruntime(engine_and_session, monkeypatch):
    free, session = engine_and_session
    context = _graph_context(free)
    seen = _spy(monkeypatch, context)
    rng = np.random.default_rng(21)
    # bucketed positions: 16x128 = 2048, 32x128 = 4096 (20 rows pad to 32), 16x64 = 1024 (9 rows pad to 16),
    # 8x128 = 1024 with every position real (it packed at 32x128 before: issue 10's 8x128 regression)
    for batch, seq, real, want in [(16, 128, 0.6, "packed"), (20, 100, 0.9, "packed"), (9, 50, 0.9, "plain"),
                                   (8, 128, 1.0, "plain"), (4, 100, 0.9, "plain"),
                                   (32, 128, 1.0, "plain at the largest"), (1, 7, 1.0, "plain")]:
        feeds = _feeds(rng, batch, seq, real)
        if real == 1.0:
            feeds["attention_mask"][:] = 1
        mask = feeds["attention_mask"]
        got = context.run(feeds)["layer_norm_4"]
        ref = session.run(None, feeds)[0]
        keep = mask != 0
        np.testing.assert_allclose(got[keep], ref[keep], rtol=RTOL, atol=ATOL, err_msg=f"{batch}x{seq}")
        assert got.shape == ref.shape and not got[~keep].any(), f"{batch}x{seq}: zeros at padding"
        program, shapes, rows = seen[-1]
        if want == "packed":
            assert program == "packed" and shapes[0] == (32, 128), shapes  # padded to the largest shape
            assert rows == graph_rows(int(keep.sum()), 4096, CUDA) and rows >= CUDA.rows_from
        elif want == "plain at the largest":
            assert program == "plain" and shapes[0] == (32, 128)
        else:  # at its own bucket, however many of its positions are real
            b, s = context.buckets.bucket("batch", batch, 1, 32), context.buckets.bucket("seq", seq, 1, 128)
            assert program == "plain" and shapes[0] == (b, s) and b * s < CUDA.graphs_from


def test_a_stream_after_warm_up_meets_only_warmed_up_signatures(engine_and_session, monkeypatch):
    free, session = engine_and_session
    context = _graph_context(free)
    seen = _spy(monkeypatch, context)
    runs = context.warm_up()
    warmed = set(seen)  # (program, input shapes, packed rows): a CUDA graph's signature
    assert runs == len(seen) == len(warmed)  # each warm-up run a new signature
    batches, sequences = context.buckets.sizes("batch", 1, 32), context.buckets.sizes("seq", 1, 128)
    assert len(warmed) == graph_signatures(batches, sequences, 4096, CUDA)
    seen.clear()
    rng = np.random.default_rng(22)
    for k in range(40):
        batch, seq = int(rng.integers(1, 33)), int(rng.integers(1, 129))
        feeds = _feeds(rng, batch, seq, float(rng.uniform(0.3, 1.0)))
        got = context.run(feeds)["layer_norm_4"]
        if k % 8 == 0:  # a few against onnxruntime (the whole test: the stream's signatures)
            keep = feeds["attention_mask"] != 0
            np.testing.assert_allclose(got[keep], session.run(None, feeds)[0][keep], rtol=RTOL, atol=ATOL)
    met = set(seen)
    assert met <= warmed, met - warmed
    assert {program for program, _, _ in met} == {"packed", "plain"}


def test_runs_of_known_tensor_shapes_decide_as_the_first_run_did(engine_and_session, monkeypatch):
    # torch tensors in: a context remembers what a signature's shapes decide (profile, buckets, positions); a
    # second run of the shapes takes the remembered decision, its own tokens counted: same program, rows, outputs
    free, session = engine_and_session
    context = _graph_context(free)
    seen = _spy(monkeypatch, context)
    rng = np.random.default_rng()
    for batch, seq in [(16, 128), (20, 100), (9, 50), (32, 128), (int(rng.integers(1, 33)), int(rng.integers(1, 129)))]:
        first = _feeds(rng, batch, seq, 0.9)
        second = _feeds(rng, batch, seq, 0.5)  # same shapes, other tokens: its own token bucket
        for feeds in (first, second):
            tensors = {n: torch.from_numpy(a) for n, a in feeds.items()}
            got = context.run(tensors)["layer_norm_4"].numpy()
            keep = feeds["attention_mask"] != 0
            np.testing.assert_allclose(got[keep], session.run(None, feeds)[0][keep], rtol=RTOL, atol=ATOL,
                                       err_msg=f"{batch}x{seq}")
            fresh = _graph_context(free)  # the decision a context that never met these shapes takes
            fresh_seen = _spy(monkeypatch, fresh)
            fresh.run(tensors)
            assert seen[-1] == fresh_seen[-1], f"{batch}x{seq}"
    wrong = {"input_ids": torch.zeros(16, 128, dtype=torch.int32), "attention_mask": torch.ones(16, 128, dtype=torch.int64)}
    with pytest.raises(kiln.BindingError, match="input_ids"):  # a known shape in another dtype: checked
        context.run(wrong)
    with pytest.raises(kiln.BindingError, match="outside every optimization profile"):
        context.run({"input_ids": torch.zeros(33, 8, dtype=torch.int64), "attention_mask": torch.ones(33, 8, dtype=torch.int64)})
