"""A padding-free engine carries the plain program too (kiln/builder/padding_free.py): where a run does not pack
its tokens it is the plain engine (same steps and tactics, the attention mask read as a key mask, outputs equal to
the bit at real tokens, zeros at padding), where it packs it still matches onnxruntime; one set of weights in the
file and in memory; save/load, refit and inspect keep both programs."""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
import pytest
import torch

import kiln
from kiln import zoo
from kiln.builder.padding_free import tuning_mask, tuning_tokens
from kiln.cli import main
from kiln.runtime import buckets as buckets_module
from kiln.runtime.buckets import PACK_MIN_SAVING, packed_rows

CUDA = buckets_module.PACKING_RULES["cuda"]

PROFILE = [{"input_ids": "1x1,2x16,16x128"}]  # up to 2048 positions: "auto" packs a run there that saves 45%
# fp32 against onnxruntime: the packed GEMMs and attention sum in another order over other row counts
RTOL, ATOL = 1e-5, 2e-5
# the ops that compute an exported BERT's [B, 1, S, S] attention mask
MASK_OPS = {"Shape", "Squeeze", "Unsqueeze", "Concat", "Reshape", "Expand", "Range", "Cast", "Equal", "Less",
            "LessOrEqual", "GreaterOrEqual", "Greater", "And", "Or", "Not", "Where", "Slice", "Gather", "Mul", "Sub",
            "Add", "Max", "GatherND", "ConstantOfShape"}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(model path, plain engine, padding-free engine, onnxruntime): both built with one timing cache, so the
    plain program's layers are given the plain build's tactics (a timing on this shared CPU would not repeat)."""
    exported = zoo.export("bert_tiny", dynamic=True)
    cache = str(tmp_path_factory.mktemp("timing") / "cache.json")
    plain = kiln.build(str(exported.path), profiles=PROFILE, timing_cache=cache)
    log: list[str] = []
    free = kiln.build(str(exported.path), profiles=PROFILE, timing_cache=cache, remove_padding=True,
                      progress=log.append)
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    return exported.path, plain, free, session, log


def _feeds(rng: np.random.Generator, batch: int, seq: int, kind: str, fill: float = 1.0) -> dict[str, np.ndarray]:
    """right / left padding with each row's real length in [1, fill·S]; ones: no padding."""
    mask = np.zeros((batch, seq), np.int64)
    for row in range(batch):
        n = int(rng.integers(1, max(2, int(fill * seq)) + 1)) if kind != "ones" else seq
        if kind == "left":
            mask[row, seq - n:] = 1
        else:
            mask[row, :n] = 1
    return {"input_ids": rng.integers(0, 1024, (batch, seq), dtype=np.int64), "attention_mask": mask}


def _refuse(monkeypatch, program) -> None:
    """Make a program fail if it runs (for this test): which of the two a run takes is then seen."""
    def run(*_args, **_kwargs):
        raise AssertionError("this program must not run here")
    monkeypatch.setattr(program, "run", run)


def test_the_plain_program_is_the_plain_build(engines):
    _, plain, free, _, log = engines
    assert free.plan.plain is not None and plain.plan.plain is None
    steps = {s.name: s.to_json() for s in free.plan.plain.steps}
    built = {s.name: s.to_json() for s in plain.plan.program.steps}
    # the plain build's steps, tactics and their configurations included, but for the attention mask: the attentions
    # read a [B, 1, 1, S] key mask made from the input (remove_padding.key_padding_mask), the model's [B, 1, S, S]
    # subgraph is gone; then one masked fill per output
    attentions = [name for name, step in built.items() if step["op_type"] == "Attention"]
    assert len(attentions) == 2
    for name in attentions:
        assert steps[name]["inputs"][3] == "key_mask" != built[name]["inputs"][3]
        assert {**steps[name], "inputs": None, "tactic_config": None} == \
            {**built[name], "inputs": None, "tactic_config": None}  # the same tactic, on the key mask's size:
        assert dict(steps[name]["tactic_config"]["input_sizes"])[3] == [2, 1, 1, 16]  # [B, 1, 1, S] at opt 2x16
    kept = [name for name in built if name in steps and name not in attentions]
    assert [steps[name] for name in kept] == [built[name] for name in kept]
    assert {built[name]["op_type"] for name in built if name not in steps} <= MASK_OPS  # only the mask's subgraph
    assert {"FusedGemm", "LayerNorm", "Gather"} <= {built[name]["op_type"] for name in kept}
    added = [step for name, step in steps.items() if name not in built]
    assert [step["op_type"] for step in added] == ["Equal", "Where", "Unsqueeze", "ZeroPadding"]
    assert added[-1]["inputs"] == ["layer_norm_4", "attention_mask"] and list(steps)[-1] == added[-1]["name"]
    assert free.plan.plain.inputs == plain.plan.program.inputs
    plain_tuned = free.plan.header["plain_tactics"]["layers"].keys()
    assert plain_tuned - {"key_mask"} == plain.plan.header["tactics"]["layers"].keys() & steps.keys()
    # the packed program was tuned on packed rows: 2-D GEMM inputs of the token count the build log names
    tuned = free.plan.header["remove_padding"]["tuned_at"]
    assert tuned == {"mask": [2, 16], "tokens": tuning_tokens(32)}
    assert any(f"at {tuned['tokens']} packed token rows" in line for line in log)
    sizes = {tuple(s.tactic_config["input_size"]) for s in free.plan.program.steps
             if s.op_type == "FusedGemm" and "input_size" in s.tactic_config}
    assert sizes and all(size[0] == tuned["tokens"] and len(size) == 2 for size in sizes), sizes


@pytest.mark.parametrize("buckets", [False, True], ids=["exact", "buckets"])
def test_where_it_does_not_pack_it_is_the_plain_engine(engines, buckets, monkeypatch):
    """Unpadded exact runs are the plain engine's to the bit; padded ones (and runs in a bucket) to float32's
    tolerance: the free engine's plain program reads a key mask, with which CPU attention stops at the last visible
    key (attention.c), where the plain engine's [B, 1, S, S] mask runs every key; the shorter sums round apart
    (1.2e-7 to 3.6e-7 seen)."""
    _, plain, free, _, _ = engines
    # the CUDA rule on the CPU: it leaves these runs unpacked (the CPU's own packs whenever a bucket saves a row)
    monkeypatch.setitem(buckets_module.PACKING_RULES, "cpu", buckets_module.PACKING_RULES["cuda"])
    reference = plain.create_execution_context(buckets=buckets, pad_first_calls=False)
    context = free.create_execution_context(buckets=buckets)
    _refuse(monkeypatch, free.program)  # every run below is one "auto" does not pack: the plain program's
    rng = np.random.default_rng(11)
    for batch, seq, kind in [(1, 13, "right"), (3, 16, "left"), (4, 48, "right"), (2, 9, "ones"), (16, 128, "ones"),
                             (16, 120, "right")]:
        feeds = _feeds(rng, batch, seq, kind, fill=1.0 if kind == "ones" else 0.9)
        mask = feeds["attention_mask"]
        if (batch, seq) == (16, 120):  # 1920 positions (2048 in buckets) with few padded: packing would save too little
            mask[:, :int(0.7 * seq)] = 1
        want = reference.run(feeds)["layer_norm_4"]
        got = context.run(feeds)["layer_norm_4"]
        keep = mask != 0
        np.testing.assert_allclose(got[keep], want[keep], rtol=1e-5, atol=1e-5, err_msg=f"{batch}x{seq} {kind}")
        assert not got[~keep].any(), f"{batch}x{seq} {kind}: outputs at padding positions must be zero"
        if kind == "ones" and not buckets:
            np.testing.assert_array_equal(got, want)


def test_where_it_packs_it_matches_onnxruntime(engines, monkeypatch):
    _, _, free, session, _ = engines
    context = free.create_execution_context()
    _refuse(monkeypatch, free.plain_program)  # these runs save more than half of 1200+ positions: "auto" packs them
    rng = np.random.default_rng(12)
    for batch, seq, kind in [(16, 128, "right"), (12, 100, "left"), (11, 128, "right")]:
        feeds = _feeds(rng, batch, seq, kind, fill=0.5)
        mask = feeds["attention_mask"]
        assert packed_rows(torch.from_numpy(mask), None, False) < mask.size  # it does pack
        got = context.run(feeds)["layer_norm_4"]
        want = session.run(None, feeds)[0]
        keep = mask != 0
        np.testing.assert_allclose(got[keep], want[keep], rtol=RTOL, atol=ATOL, err_msg=f"{batch}x{seq} {kind}")
        assert not got[~keep].any()


def test_one_set_of_weights_in_the_file_and_in_memory(engines, tmp_path):
    _, plain, free, _, _ = engines
    plain.save(tmp_path / "plain.kiln")
    free.save(tmp_path / "free.kiln")
    # the plain program's JSON is the one addition: the weights are stored once
    assert os.path.getsize(tmp_path / "free.kiln") < 1.1 * os.path.getsize(tmp_path / "plain.kiln")
    assert free.plan.header["weights_bytes"] <= 1.01 * plain.plan.header["weights_bytes"]
    # ... and in memory: a weight both programs read is one tensor object in both (Program numbers the constants
    # first, in the spec's order)
    plain_slots = {name: s for s, name in enumerate(free.plan.plain.constants)}
    packed_slots = {free.plan.program.constants[name]: s for s, name in enumerate(free.plan.program.constants)}
    shared = total = 0  # bytes: the plain program alone reads the small constants of its attention mask's subgraph
    for name, key in free.plan.plain.constants.items():
        weight = free.plain_program.template[plain_slots[name]]
        size = weight.nbytes if isinstance(weight, torch.Tensor) else 0
        total += size
        if key in packed_slots:
            assert weight is free.program.template[packed_slots[key]], name
            shared += size
    assert shared >= 0.95 * total, (shared, total)


def test_save_and_load_keep_both_programs(engines, tmp_path):
    _, _, free, _, _ = engines
    free.save(tmp_path / "free.kiln")
    loaded = kiln.load(tmp_path / "free.kiln")
    assert loaded.plan.plain is not None
    assert loaded.plan.plain.to_json() == free.plan.plain.to_json()
    rng = np.random.default_rng(13)
    for batch, seq, fill in [(3, 20, 0.9), (16, 128, 0.5)]:  # the plain program, then the packed one
        feeds = _feeds(rng, batch, seq, "right", fill)
        np.testing.assert_array_equal(loaded.run(feeds)["layer_norm_4"], free.run(feeds)["layer_norm_4"])


def test_inspect_says_the_engine_holds_both(engines, tmp_path, capsys):
    _, _, free, _, _ = engines
    free.save(tmp_path / "free.kiln")
    assert main(["inspect", str(tmp_path / "free.kiln")]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "the engine holds both programs on one set of weights" in text
    assert f"tuned at {free.plan.header['remove_padding']['tuned_at']['tokens']} packed rows" in text
    assert "plain program tactics" in text and "layer(s) tuned" in text


def test_the_packed_program_is_tuned_on_a_run_that_saves_just_enough():
    # the build tunes at CUDA's rule (the CPU's packs whenever a bucket saves a row)
    for positions, want in ((32, 16), (1024, 512), (4096, 2816), (16384, 14336), (20480, 18432)):
        tokens = tuning_tokens(positions)
        assert tokens == want, positions
        mask = torch.zeros(positions, dtype=torch.int64)
        mask[:tokens] = 1
        if positions >= PACK_MIN_SAVING[-1][0]:  # a run of that many tokens packs, to exactly that token bucket
            assert packed_rows(mask.reshape(1, -1), None, bucketed=True, rule=CUDA) == tokens
            mask[:tokens + 1] = 1  # ... and the next bucket up saves too little to pack
            assert packed_rows(mask.reshape(1, -1), None, bucketed=True, rule=CUDA) == positions
    mask = tuning_mask(3, 10, 17, torch.int64)
    assert int(mask.sum()) == 17 and mask.sum(1).tolist() == [6, 6, 5] and mask[:, 0].all()
