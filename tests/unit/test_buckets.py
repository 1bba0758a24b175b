"""Shape buckets (kiln/runtime/buckets.py): which dims pad, to which sizes, and padding never
changes a result (padded runs against unpadded ones and against onnxruntime, fresh shapes each run).
CUDA pads by default; here the CPU context is asked to, which runs the same padding and cropping."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

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
    assert buckets.symbols == {"batch": 1, "seq": 16}
    assert buckets.batch == "batch"  # axis 0 of every input and output carrying it: runs may split
    assert buckets.sizes("seq", 1, 48) == [16, 32, 48]
    assert buckets.sizes("batch", 1, 4) == [1, 2, 4]
    # a 1.5x step from 128, quarter steps from 256: at most 1.25x padding where the work is large
    assert buckets.sizes("seq", 1, 512) == [16, 32, 64, 128, 192, 256, 320, 384, 448, 512]
    assert buckets.sizes("seq", 1, 1024) == [16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024]
    assert buckets.sizes("batch", 1, 32) == [1, 2, 4, 8, 16, 32]  # in between: split into chunks
    assert buckets.sizes("batch", 3, 20) == [4, 8, 16, 20]
    assert buckets.bucket("seq", 33, 1, 48) == 48 and buckets.bucket("seq", 9, 1, 48) == 16
    assert buckets.crops == [[(0, "batch"), (1, "seq")]]


def _buckets_with_costs(costs: dict[int, float]):
    buckets = plan_buckets([Binding("x", "float", ["batch", "seq"]), Binding("attention_mask", "int64", ["batch", "seq"])],
                           [Binding("y", "float", ["batch", "seq", 4])])
    for size, ms in costs.items():
        buckets.learn({"batch": (size, size), "seq": (100, 128)}, ms)
    return buckets


def test_a_batch_splits_where_the_measured_replays_say_it_costs_less():
    # time growing with the rows (a GPU-bound size): 25 rows as 16 + 8 + 1 beats 32 padded
    grows = _buckets_with_costs({1: 1.0, 2: 1.1, 4: 1.3, 8: 2.0, 16: 4.0, 32: 8.0})
    assert grows.split({"batch": (25, 32), "seq": (100, 128)}) == [(16, 16), (8, 8), (1, 1)]
    assert grows.split({"batch": (32, 32), "seq": (100, 128)}) is None  # no padding to save
    assert grows.split({"batch": (17, 32), "seq": (100, 128)}) == [(16, 16), (1, 1)]
    assert grows.split({"batch": (25, 32), "seq": (100, 64)}) is None  # no replay measured at seq 64
    # flat time (launch-bound sizes): padding is free, one run
    flat = _buckets_with_costs({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0, 32: 1.0})
    assert flat.split({"batch": (25, 32), "seq": (100, 128)}) is None
    # at most MAX_CHUNKS replays: 31 rows would be 16 + 8 + 4 + 2 + 1 (five), so the cover is four chunks
    chunks = grows.split({"batch": (31, 32), "seq": (100, 128)})
    assert chunks is None or (len(chunks) <= 4 and sum(r for r, _ in chunks) == 31)
    # the padded bucket's own time unknown: never split on a guess
    assert _buckets_with_costs({1: 1.0, 16: 4.0}).split({"batch": (17, 32), "seq": (100, 128)}) is None


def test_no_split_where_an_output_does_not_carry_the_batch():
    inputs = [Binding("x", "float", ["batch", 8])]
    assert plan_buckets(inputs, [Binding("y", "float", ["batch", 8]), Binding("n", "float", [1])]).batch is None


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float16, torch.float32])
def test_pad_puts_the_input_in_the_leading_corner_and_zeros_elsewhere(dtype):
    # one padded symbol on axis 0, one on axis 1, a fixed dim between them on the third input; fresh values
    buckets = plan_buckets([Binding("input_ids", "int64", ["batch", "seq"]), Binding("attention_mask", "int64",
                                                                                   ["batch", "seq"]),
                            Binding("x", "float", ["batch", "seq", 3])], [Binding("y", "float", ["batch", "seq"])])
    rng = np.random.default_rng()
    batch, seq = int(rng.integers(1, 5)), int(rng.integers(1, 40))
    targets = {"batch": (batch, 4), "seq": (seq, 48)}
    inputs = [torch.from_numpy(rng.integers(-5, 6, shape)).to(dtype) for shape in ((batch, seq),) * 2 + ((batch, seq, 3),)]
    for x, got in zip(inputs, buckets.pad(inputs, targets)):
        want = torch.zeros((4, 48, *x.shape[2:]), dtype=dtype)  # the definition: zeros, the input at [:b, :s]
        want[:batch, :seq] = x
        assert got.dtype == dtype and torch.equal(got, want)
    same = buckets.pad(inputs, {"batch": (batch, batch), "seq": (seq, seq)})
    assert all(a is b for a, b in zip(same, inputs))  # at its bucket already: the input itself, no copy


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
    assert buckets.symbols == {"batch": 1, "seq": 16}
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
    assert context.warm_up() == 3 * 3  # batch 1, 2, 4 x seq 16, 32, 48
    assert len(engine.program.shape_plans) >= 9
    plain = engine.create_execution_context(buckets=False, pad_first_calls=False)
    assert plain.warm_up() == 1  # no buckets: the opt shape (with padded first calls the buckets: test_first_calls.py)


def test_a_split_batch_gives_the_unpadded_result(bert):
    """The chunked path (as CUDA runs it once replays are timed) on the CPU: the costs are set by hand
    so that every batch of 3 runs as 2 + 1 and every batch of 4 off its bucket does too."""
    exported, engine = bert
    split = engine.create_execution_context(buckets=True)
    for seq_bucket in (16, 32, 48):
        for size, ms in {1: 1.0, 2: 1.5, 4: 3.0}.items():
            split.buckets.learn({"batch": (size, size), "seq": (seq_bucket, seq_bucket)}, ms)
    plain = engine.create_execution_context(buckets=False)
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng()
    for seq in (int(rng.integers(1, 17)), int(rng.integers(17, 49))):
        feeds = _feeds(rng, 3, seq)
        assert split.buckets.split(split.buckets.targets(
            [feeds["input_ids"], feeds["attention_mask"]], engine.profiles[0], engine.input_names)) == [(2, 2), (1, 1)]
        got = next(iter(split.run(feeds).values()))
        assert got.shape == (3, seq, 64)
        np.testing.assert_allclose(got, next(iter(plain.run(feeds).values())), rtol=RTOL, atol=ATOL,
                                   err_msg=f"split vs unpadded, batch 3 x seq {seq}")
        np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=1e-4, atol=1e-4)


def test_a_bucket_captured_by_a_run_has_its_replay_time_learned(bert):
    """What a CUDA context does on the CPU: a stand-in for the graph runner that 'captures' each new
    padded shape once (timing it as the runner does) — the context learns that time for the bucket, once."""
    import types

    _, engine = bert
    context = engine.create_execution_context(buckets=True)
    program = engine.program
    seen: dict[tuple, float] = {}

    def run(args):
        key = tuple(tuple(a.shape) for a in args)
        if key not in seen:
            seen[key] = 0.5 + len(seen)  # "measured at its capture"
            runner.stats.captures += 1
        return program.run(args)

    runner = types.SimpleNamespace(stats=types.SimpleNamespace(captures=0, split_runs=0), run=run,
                                   replay_ms=lambda args: seen.get(tuple(tuple(a.shape) for a in args)))
    context.runner = runner
    rng = np.random.default_rng()
    for batch, seq in ((3, 20), (4, 30), (1, 5), (3, 25)):  # the last: the first's bucket again
        context.run(_feeds(rng, batch, seq))
    assert context.buckets.costs == {(("seq", 32),): {4: 0.5}, (("seq", 16),): {1: 1.5}}
    assert runner.stats.captures == 2


def _bert_buckets(steps: str):
    buckets = plan_buckets([Binding("input_ids", "int64", ["batch", "seq"]),
                            Binding("attention_mask", "int64", ["batch", "seq"])],
                           [Binding("y", "float", ["batch", "seq", 4])])
    buckets.batch_steps = steps
    return buckets


def test_half_batch_buckets_add_a_1_5x_step_from_8_and_cost_these_graphs():
    pow2, half = _bert_buckets("pow2"), _bert_buckets("half")
    assert half.sizes("batch", 1, 64) == [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]
    assert half.sizes("batch", 1, 8) == [1, 2, 4, 8] and half.sizes("batch", 1, 10) == [1, 2, 4, 8, 10]
    assert half.sizes("batch", 5, 20) == [8, 12, 16, 20] and half.sizes("batch", 1, 12) == [1, 2, 4, 8, 12]
    assert [half.bucket("batch", n, 1, 64) for n in (9, 12, 13, 17, 25, 33, 49)] == [12, 12, 16, 24, 32, 48, 64]
    assert half.sizes("seq", 1, 512) == pow2.sizes("seq", 1, 512)  # the sequence's ladder is its own
    # the graphs a warm-up captures (one per batch x sequence bucket): BERT 1..32 x 1..512, 1..64 x 128
    # (bench/serve.py's profile: the sequence fixed) and 1..64 x 1..128
    for steps, wide, served, short in ((pow2, 60, 7, 28), (half, 80, 10, 40)):
        assert len(steps.sizes("batch", 1, 32)) * len(steps.sizes("seq", 1, 512)) == wide
        assert len(steps.sizes("batch", 1, 64)) * len(steps.sizes("seq", 128, 128)) == served
        assert len(steps.sizes("batch", 1, 64)) * len(steps.sizes("seq", 1, 128)) == short


def test_half_buckets_split_by_the_measured_replays():
    # H100 BERT-base fp16 seq 128 replays (serve-graphs-2026-12-07.md), 12 and 24 between their neighbours
    half = _bert_buckets("half")
    for size, ms in {1: 0.43, 2: 0.46, 4: 0.52, 8: 0.66, 12: 0.80, 16: 0.94, 24: 1.29, 32: 1.63}.items():
        half.learn({"batch": (size, size), "seq": (128, 128)}, ms)
    assert half.split({"batch": (11, 12), "seq": (100, 128)}) is None  # padded to 12: 8 + 4 would cost 1.2 ms
    assert half.split({"batch": (20, 24), "seq": (100, 128)}) is None
    # time growing with the rows: 14 as 12 + 2 (two replays) where pow2 would take 8 + 4 + 2
    grows = _bert_buckets("half")
    for size in (1, 2, 4, 8, 12, 16):
        grows.learn({"batch": (size, size), "seq": (128, 128)}, float(size))
    assert grows.split({"batch": (14, 16), "seq": (100, 128)}) == [(12, 12), (2, 2)]


def test_batch_buckets_is_checked_and_read_from_the_environment(bert, monkeypatch):
    _, engine = bert
    with pytest.raises(ValueError, match=r"batch_buckets='thirds': expected one of \('pow2', 'half'\)"):
        engine.create_execution_context(buckets=True, batch_buckets="thirds")
    assert engine.create_execution_context(buckets=True).buckets.batch_steps == "pow2"
    monkeypatch.setenv("KILN_BATCH_BUCKETS", "half")
    assert engine.create_execution_context(buckets=True).buckets.batch_steps == "half"
    assert engine.create_execution_context(buckets=True, batch_buckets="pow2").buckets.batch_steps == "pow2"


@pytest.fixture(scope="module")
def bert_wide_batch():
    exported = zoo.export("bert_tiny", dynamic=True)
    return exported, kiln.build(str(exported.path), profiles=[{"input_ids": "1x1,8x16,16x32"}])


def test_half_buckets_pad_exactly_and_warm_up_runs_each(bert_wide_batch):
    """Batches padded to 12 (and 16) against unpadded runs and onnxruntime, fresh shapes and masks; the warm-up runs
    every bucket: 6 batch (1, 2, 4, 8, 12, 16) x 2 sequence (16, 32)."""
    exported, engine = bert_wide_batch
    half = engine.create_execution_context(buckets=True, batch_buckets="half")
    plain = engine.create_execution_context(buckets=False)
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng()
    shapes = {(9, 7), (12, 32), (13, 17)} | {(int(rng.integers(9, 17)), int(rng.integers(1, 33))) for _ in range(3)}
    for batch, seq in sorted(shapes):
        feeds = _feeds(rng, batch, seq)
        targets = half.buckets.targets([feeds["input_ids"], feeds["attention_mask"]], engine.profiles[0],
                                       engine.input_names)
        assert targets["batch"] == (batch, 12 if batch <= 12 else 16)
        got = next(iter(half.run(feeds).values()))
        assert got.shape == (batch, seq, 64)  # cropped back
        np.testing.assert_allclose(got, next(iter(plain.run(feeds).values())), rtol=RTOL, atol=ATOL,
                                   err_msg=f"padded (half) vs unpadded, batch {batch} x seq {seq}")
        np.testing.assert_allclose(got, session.run(None, feeds)[0], rtol=1e-4, atol=1e-4)
    assert half.warm_up() == 6 * 2
    assert engine.create_execution_context(buckets=True).warm_up() == 5 * 2


def test_half_buckets_only_where_the_graph_cache_holds_them(bert_wide_batch, caplog):
    """bucket_graphs counts what warm_up runs (a graph each on CUDA); half steps that would pass max_graphs stay
    powers of two, logged at info level: kiln serve's default is half (BERT 1..32 x 1..512: 80 shapes for 64 graphs)."""
    _, engine = bert_wide_batch
    half = engine.create_execution_context(buckets=True, batch_buckets="half", max_graphs=12)
    assert half.buckets.batch_steps == "half" and half.bucket_graphs() == 6 * 2 == half.warm_up()
    with caplog.at_level("INFO", logger="kiln.runtime.context"):
        kept = engine.create_execution_context(buckets=True, batch_buckets="half", max_graphs=11)
    assert kept.buckets.batch_steps == "pow2" and kept.bucket_graphs() == 5 * 2
    assert "12 bucketed shapes would pass the 11 graphs" in caplog.text
