"""Padding-free encoders on CUDA (kiln/passes/remove_padding.py): the varlen flash tactic of PackedAttention
against the op's reference, and a padding-free bert_tiny engine (fp16, CUDA graphs over token buckets) against
torch fp32 at its real tokens, with zeros at padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kiln
from kiln import zoo
from kiln.ops.registry import OpContext
from kiln.ops.tokens import packed_attention, token_index
from kiln.plan.spec import StepSpec
from kiln.tactics import registry
from kiln.tactics.tactic import InputMeta

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FP16_ATOL = 2e-2  # fp16 storage, fp32 accumulation: BERT's LayerNorm'd hidden states (|x| <= ~5)
ATTENTION_ATOL = 5e-3  # one fp16 attention: the softmax-weighted mean of fp16 values, two summation orders


def _mask(rng, batch: int, seq: int, kind: str) -> torch.Tensor:
    mask = np.zeros((batch, seq), np.int64)
    for row in range(batch):
        n = rng.integers(1, seq + 1)
        if kind == "left":
            mask[row, seq - n:] = 1
        else:
            mask[row, :n] = 1
    if batch > 2:
        mask[1] = 0  # a row of padding only
    return torch.from_numpy(mask).cuda()


@pytest.mark.parametrize("name", ["cuda.packed_attention.flash_varlen", "cuda.packed_attention.varlen_attn"])
@pytest.mark.parametrize("batch,seq,heads,head_dim,kind", [(3, 40, 4, 64, "right"), (4, 130, 2, 32, "left"),
                                                           (1, 17, 12, 64, "right")])
def test_varlen_tactics_match_the_reference(name, batch, seq, heads, head_dim, kind):
    rng = np.random.default_rng(batch * seq)
    mask = _mask(rng, batch, seq, kind)
    attrs = {"scale": head_dim ** -0.5, "q_perm": [0, 2, 1, 3], "k_perm": [0, 2, 1, 3], "v_perm": [0, 2, 1, 3],
             "out_perm": [0, 2, 1, 3], "q_num_heads": heads, "kv_num_heads": heads,
             "qkv_split": [heads * head_dim] * 3, "out_merge_heads": 1}
    ctx = OpContext("attention", "PackedAttention", "kiln", num_inputs=7)
    for bucket in (None, torch.empty(int(mask.count_nonzero()) + 5, dtype=torch.uint8, device="cuda")):
        index, scatter, cu_seqlens = token_index(ctx, mask, bucket)
        qkv = torch.randn(index.shape[0], 3 * heads * head_dim, device="cuda", dtype=torch.float16)  # [T', 3·H·D]
        step = StepSpec("PackedAttention", "attention", ["qkv", "", "", "m", "i", "s", "c"], ["o"], attrs,
                        domain="kiln")
        registry.load_device("cuda")
        tactic = registry.get(name)
        if not tactic.available():
            pytest.skip(f"{name} is not in torch {torch.__version__}")
        metas = [InputMeta.of(x, False) for x in (qkv, None, None, mask, index, scatter, cu_seqlens)]
        assert tactic.check(step, metas) is True
        launch = tactic.prepare(step, [None] * 7, torch.device("cuda"))
        got = launch(ctx, qkv, None, None, mask, index, scatter, cu_seqlens, **attrs)
        want = packed_attention(ctx, qkv.float(), None, None, mask, index, scatter, cu_seqlens, **attrs)
        real = int(mask.count_nonzero())  # rows past it are a bucket's dummies: never read
        torch.testing.assert_close(got[:real].float(), want[:real], atol=ATTENTION_ATOL, rtol=0)


@pytest.fixture(scope="module")
def bert_free():
    exported = zoo.export("bert_tiny", dynamic=True)
    return kiln.build(str(exported.path), device="cuda", precision="fp16", remove_padding=True,
                      profiles=[{"input_ids": "1x1,4x64,8x128"}])


@pytest.mark.parametrize("packing", ["always", "never", "auto"])  # packed rows; every position; the rule's choice
def test_a_padding_free_engine_matches_torch_at_real_tokens_and_replays_graphs(bert_free, packing):
    engine = bert_free
    assert engine.plan.header["remove_padding"]["attentions"] == 2
    module = zoo.torch_model("bert_tiny").cuda().float().eval()
    ctx = engine.create_execution_context(packing=packing)
    rng = np.random.default_rng(0)
    for batch, seq, kind in [(4, 64, "right"), (4, 64, "right"), (8, 100, "left"), (1, 128, "right"),
                             (4, 64, "right"), (3, 33, "left")]:
        mask = _mask(rng, batch, seq, kind)
        feeds = {"input_ids": torch.from_numpy(rng.integers(0, 1024, (batch, seq))).cuda(), "attention_mask": mask}
        for _ in range(3):  # eager, capture, replay
            got = next(iter(ctx.run(feeds).values())).float()
        with torch.inference_mode():
            want = module(**feeds).float()
        keep = mask != 0
        torch.testing.assert_close(got[keep], want[keep], atol=FP16_ATOL, rtol=0)
        assert not got[~keep].any(), "outputs at padding positions must be zero"
    stats = ctx.runner.stats
    assert stats.captures >= 1 and stats.replays >= 1, (stats, stats.eager_reasons)


@pytest.fixture(scope="module")
def bert_pair(tmp_path_factory):
    """(plain engine, padding-free engine) of one profile, built with one timing cache: the padding-free engine's
    plain program gets the plain build's tactics (kiln/builder/padding_free.py)."""
    exported = zoo.export("bert_tiny", dynamic=True)
    cache = str(tmp_path_factory.mktemp("timing") / "cache.json")
    options = dict(device="cuda", precision="fp16", profiles=[{"input_ids": "1x1,4x64,16x128"}], timing_cache=cache)
    return kiln.build(str(exported.path), **options), kiln.build(str(exported.path), remove_padding=True, **options)


def test_where_it_does_not_pack_it_is_the_plain_engine(bert_pair, monkeypatch):
    # the plain engine's layers, but its attentions read a [B, 1, 1, S] key mask (remove_padding.key_padding_mask)
    # and the program is tuned at the profile's max too (kiln/builder/build.py): other kernels may win, so the
    # outputs match the plain engine's within fp16's error, not to the bit
    plain, free = bert_pair
    gemms = [s.name for s in plain.plan.program.steps if s.op_type == "FusedGemm"]
    assert gemms and gemms == [s.name for s in free.plan.plain.steps if s.op_type == "FusedGemm"]
    masks = [{s.inputs[3] for s in e.steps if s.op_type == "Attention"} for e in (free.plan.plain, plain.plan.program)]
    assert len(masks[0]) == 1 and masks[0].isdisjoint(masks[1])
    # the plain build now folds its own mask to a [B, 1, 1, S] key mask too (Cast, Where, Reshape; was a [B, 1, S, S]
    # subgraph when this test was written): the padding-free program's mask is as short (Equal, Where, Unsqueeze) and
    # adds only ZeroPadding and KeyLengths (H200, session 33: 25 steps against 23)
    assert len(free.plan.plain.steps) <= len(plain.plan.program.steps) + 2
    assert not {s.op_type for s in free.plan.plain.steps} & {"Expand", "Tile"}  # no [B, 1, S, S] mask is made
    # on CUDA they read the mask's key lengths too (kiln::KeyLengths): right padding takes the kernel's length path,
    # left padding (a key length of -1) the mask path, both below
    lengths = [s.outputs[0] for s in free.plan.plain.steps if s.op_type == "KeyLengths"]
    assert len(lengths) == 1
    assert all(s.inputs[4] == lengths[0] for s in free.plan.plain.steps if s.op_type == "Attention")
    reference, context = plain.create_execution_context(), free.create_execution_context()

    def refuse(*_args, **_kwargs):
        raise AssertionError("a run that does not pack ran the packed program")

    monkeypatch.setattr(free.program, "run", refuse)
    rng = np.random.default_rng(1)
    # under 2048 positions "auto" runs plain; 16 x 128 with a few padded positions packs to every position: plain
    for batch, seq, kind in [(4, 64, "right"), (1, 128, "left"), (3, 33, "right"), (16, 128, "full")]:
        mask = _mask(rng, batch, seq, kind) if kind != "full" else torch.ones(batch, seq, dtype=torch.int64).cuda()
        if kind == "full":
            mask[0, 100:] = 0
        feeds = {"input_ids": torch.from_numpy(rng.integers(0, 1024, (batch, seq))).cuda(), "attention_mask": mask}
        for _ in range(3):  # eager, capture, replay: each context its own graphs
            want = next(iter(reference.run(feeds).values())).clone()
            got = next(iter(context.run(feeds).values())).clone()
        keep = mask != 0
        torch.testing.assert_close(got[keep].float(), want[keep].float(), atol=FP16_ATOL, rtol=0,
                                   msg=f"{batch}x{seq} {kind}")
        assert not got[~keep].any()
    assert context.runner.stats.replays >= 1, context.runner.stats.eager_reasons


def test_where_it_packs_the_packed_program_runs(bert_pair, monkeypatch):
    _, free = bert_pair
    module = zoo.torch_model("bert_tiny").cuda().float().eval()

    def refuse(*_args, **_kwargs):
        raise AssertionError("a run that packs ran the plain program")

    monkeypatch.setattr(free.plain_program, "run", refuse)
    context = free.create_execution_context()
    rng = np.random.default_rng(2)
    mask = torch.zeros(16, 128, dtype=torch.int64)
    for row in range(16):
        mask[row, :rng.integers(1, 40)] = 1  # ~85% padding of 2048 positions: packed
    mask = mask.cuda()
    feeds = {"input_ids": torch.from_numpy(rng.integers(0, 1024, (16, 128))).cuda(), "attention_mask": mask}
    for _ in range(3):
        got = next(iter(context.run(feeds).values())).float()
    with torch.inference_mode():
        want = module(**feeds).float()
    keep = mask != 0
    torch.testing.assert_close(got[keep], want[keep], atol=FP16_ATOL, rtol=0)
    assert not got[~keep].any()
