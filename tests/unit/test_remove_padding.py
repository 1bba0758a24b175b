"""Padding-free encoders (kiln/passes/remove_padding.py, kiln/ops/tokens.py): the token ops against numpy and
a per-sequence SDPA, the rewrite's structure, padding-free engines against onnxruntime on the unmodified ONNX at
their real tokens (zeros at padding) for every mask kind, the refusals, the flag through save/load and the CLI."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln import zoo
from kiln.builder import autotune
from kiln.cli import main
from kiln.frontend import onnx as onnx_frontend
from kiln.ops.registry import OpContext
from kiln.ops.tokens import key_lengths, pack_tokens, packed_attention, token_index, unpack_tokens
from kiln.passes import PassOptions, optimize
from kiln.passes.remove_padding import PaddingRefused, key_padding_mask
from kiln.plan.spec import StepSpec
from kiln.runtime.buckets import PACKING_RULES, packed_rows, packing_rule, token_bucket
from kiln.tactics import registry
from kiln.tactics.cuda import packed_attention as cuda_packed
from kiln.tactics.tactic import InputMeta

# fp32 against onnxruntime: the packed GEMMs and attention sum in another order over other row counts
RTOL, ATOL = 1e-5, 2e-5
CTX = OpContext("tokens", "TokenIndex", "kiln")


def _mask(rng: np.random.Generator, batch: int, seq: int, kind: str) -> np.ndarray:
    """right / left: real lengths in [1, S] at the start / end of each row; holes: random positions; ones:
    no padding. With batch > 2, row 1 is all padding (except `ones`)."""
    mask = np.zeros((batch, seq), np.int64)
    for row in range(batch):
        n = rng.integers(1, seq + 1)
        if kind == "left":
            mask[row, seq - n:] = 1
        elif kind == "holes":
            mask[row] = rng.random(seq) < 0.6
        else:
            mask[row, :n] = 1
    if kind == "ones":
        mask[:] = 1
    elif batch > 2:
        mask[1] = 0
    return mask


@pytest.mark.parametrize("kind", ["right", "left", "holes", "ones"])
def test_token_index_packs_the_real_tokens_in_row_major_order(kind):
    rng = np.random.default_rng(0)
    mask = _mask(rng, 4, 9, kind)
    m = torch.from_numpy(mask)
    real = np.flatnonzero(mask)
    index, scatter, cu_seqlens = token_index(CTX, m)
    np.testing.assert_array_equal(index.numpy(), real)
    np.testing.assert_array_equal(scatter.numpy(), real)
    np.testing.assert_array_equal(cu_seqlens.numpy(), np.concatenate([[0], np.cumsum(mask.sum(1))]))
    assert cu_seqlens.dtype == torch.int32
    # a token bucket of T' >= T rows: the same first T, dummies gathered from 0 and scattered to the dropped B·S
    bucket = torch.empty(len(real) + 7, dtype=torch.uint8)
    index, scatter, _ = token_index(CTX, m, bucket)
    np.testing.assert_array_equal(index[:len(real)].numpy(), real)
    assert (index[len(real):] == 0).all() and (scatter[len(real):] == mask.size).all()
    x = torch.randn(4, 9, 5)
    packed = pack_tokens(CTX, x, index)  # [T', 5]
    assert packed.shape == (len(real) + 7, 5)
    torch.testing.assert_close(unpack_tokens(CTX, packed, scatter, m), x * m[..., None], rtol=0, atol=0)
    # B·S rows: the identity packing, views in place; B + 2 cu_seqlens entries say its rows hold padding
    index, scatter, cu_seqlens = token_index(CTX, m, torch.empty(mask.size, dtype=torch.uint8))
    assert torch.equal(index, torch.arange(mask.size)) and cu_seqlens.tolist() == [0, 9, 18, 27, 36, 36]
    packed = pack_tokens(CTX, x, index)
    assert packed.data_ptr() == x.data_ptr()
    torch.testing.assert_close(unpack_tokens(CTX, packed, scatter, m), x * m[..., None], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["right", "left", "holes", "ones"])
def test_key_lengths_are_a_prefix_rows_length_else_minus_one(kind):
    """A row whose real tokens are its first n positions has length n (all padding: 0), any other row -1: checked
    row by row in numpy (the position after the last real token is the count)."""
    rng = np.random.default_rng(1)
    mask = _mask(rng, 6, 11, kind)
    expected = []
    for row in mask != 0:
        end = row.nonzero()[0].max() + 1 if row.any() else 0
        expected.append(int(row.sum()) if row.sum() == end else -1)
    got = key_lengths(CTX, torch.from_numpy(mask))
    assert got.dtype == torch.int32 and got.tolist() == expected
    assert (kind in ("right", "ones")) == (min(expected) >= 0)


def test_packed_attention_is_per_sequence_attention_over_real_tokens():
    rng = np.random.default_rng(1)
    batch, seq, heads, dim = 4, 11, 3, 8
    mask = _mask(rng, batch, seq, "holes")
    m = torch.from_numpy(mask)
    index, scatter, cu_seqlens = token_index(CTX, m)
    q, k, v = (torch.randn(len(index), heads, dim) for _ in range(3))  # packed [T, H, D]
    attrs = {"scale": 0.3, "q_perm": [0, 2, 1, 3], "k_perm": [0, 2, 1, 3], "v_perm": [0, 2, 1, 3],
             "out_perm": [0, 2, 1, 3]}
    got = packed_attention(CTX, q, k, v, m, index, scatter, cu_seqlens, **attrs)  # [T, H, D]
    for row in range(batch):  # the oracle: plain SDPA, no mask, over the row's own tokens
        rows = slice(int(cu_seqlens[row]), int(cu_seqlens[row + 1]))
        one = [t[rows].transpose(0, 1)[None] for t in (q, k, v)]  # [1, H, n, D]
        want = F.scaled_dot_product_attention(*one, scale=0.3)[0].transpose(0, 1) if rows.stop > rows.start \
            else q[rows]
        torch.testing.assert_close(got[rows], want, rtol=1e-5, atol=1e-6)


def _per_sequence_flash(q, k, v, cu_seqlens, longest, scale):
    """A CPU stand-in of varlen flash attention (torch SDPA per sequence) for the tactic's layout handling."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1])
    for b in range(len(cu_seqlens) - 1):
        rows = slice(int(cu_seqlens[b]), int(cu_seqlens[b + 1]))
        assert rows.stop - rows.start <= longest
        one = [t[rows].transpose(0, 1)[None] for t in (q, k, v)]
        out[rows] = F.scaled_dot_product_attention(*one, scale=scale)[0].transpose(0, 1)
    return out


def test_the_varlen_tactic_lays_packed_qkv_out_as_the_reference_does(monkeypatch):
    # the CUDA tactic's own code (split q|k|v, heads, merge) on the CPU, flash replaced by per-sequence SDPA;
    # tests/gpu/test_remove_padding.py runs the real kernel
    monkeypatch.setattr(cuda_packed, "flash_varlen", _per_sequence_flash)
    rng = np.random.default_rng(2)
    m = torch.from_numpy(_mask(rng, 3, 10, "right"))
    index, scatter, cu_seqlens = token_index(CTX, m)
    heads, dim = 2, 8
    attrs = {"scale": 0.35, "q_perm": [0, 2, 1, 3], "k_perm": [0, 2, 1, 3], "v_perm": [0, 2, 1, 3],
             "out_perm": [0, 2, 1, 3], "q_num_heads": heads, "kv_num_heads": heads, "qkv_split": [16, 16, 16],
             "out_merge_heads": 1}
    qkv = torch.randn(len(index), 3 * heads * dim)
    step = StepSpec("PackedAttention", "a", ["qkv", "", "", "m", "i", "s", "c"], ["o"], attrs, domain="kiln")
    registry.load_device("cuda")
    tactic = registry.get("cuda.packed_attention.flash_varlen")
    metas = [InputMeta.of(x, False) for x in (qkv.half(), None, None, m, index, scatter, cu_seqlens)]
    assert tactic.supports(step, metas) is True
    bad = StepSpec("PackedAttention", "a", step.inputs, ["o"], {**attrs, "q_perm": [0, 3, 1, 2]}, domain="kiln")
    assert "q_perm" in tactic.supports(bad, metas)
    launch = tactic.prepare(step, [None] * 7, torch.device("cpu"))
    got = launch(CTX, qkv, None, None, m, index, scatter, cu_seqlens, **attrs)
    want = packed_attention(CTX, qkv, None, None, m, index, scatter, cu_seqlens, **attrs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def bert():
    exported = zoo.export("bert_tiny", dynamic=True)
    with pytest.MonkeyPatch.context() as patch:  # the native tactics win: the segment, not a loaded machine's timing
        patch.setattr(autotune, "NATIVE_CREDIT_MS", 1e3)
        engine = kiln.build(str(exported.path), remove_padding=True, profiles=[{"input_ids": "1x1,2x16,4x48"}])
    return exported, engine, ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def bert_padded(bert):
    """The padded form (each attention on q/k/v scattered back) built for the CPU: the graph optimized so, then
    built as it is (opt_level 0 runs no pass again, every layer its torch form; the header still says what the
    rewrite did)."""
    exported, _, _ = bert
    graph = _optimized(str(exported.path), remove_padding=True, cpu_rules=True, padded_attention=True)
    return kiln.build(graph, opt_level=0, profiles=[{"input_ids": "1x1,2x16,4x48"}])


def _ops(engine) -> list[str]:
    return [s.op_type for s in engine.plan.program.steps]


def test_the_rewrite_packs_every_layer_after_the_embeddings(bert, bert_padded):
    _, engine, _ = bert
    removal = engine.plan.header["remove_padding"]
    assert removal == {"mask": "attention_mask", "bucket_input": "kiln_token_bucket", "layers": 14, "attentions": 2,
                       "attention": "packed", "packed": ["layer_norm"], "unpacked": ["layer_norm_4"],
                       "plain_program": 24, "tuned_at": {"mask": [2, 16], "tokens": 16}}  # tests/unit/test_padding_free_programs.py
    # (the plain program: 48 steps with the model's [B, 1, S, S] mask subgraph, 29 with the key mask, key_padding_mask,
    # 26 since drop_broadcast_expand: the token-type ids' Expand and its shape arithmetic gone, 24 since
    # fill_uniform_gather: the token types' GatherElements of a zero buffer and their lookup folded to one row)
    # PackedAttention over the packed tokens (on the CPU kiln's varlen C kernel), the [B, 1, S, S] mask's subgraph gone
    ops = _ops(engine)
    assert ops.count("PackedAttention") == 2 and "Attention" not in ops and "Where" not in ops
    assert ops.count("TokenIndex") == ops.count("PackTokens") == ops.count("UnpackTokens") == 1
    assert [b.name for b in engine.inputs] == ["input_ids", "attention_mask"]  # the bucket is no binding
    assert engine.plan.program.inputs[-1] == "kiln_token_bucket"
    # the padded form: each attention on q|k|v scattered back, its output gathered again
    assert bert_padded.plan.header["remove_padding"]["attention"] == "padded"
    ops = _ops(bert_padded)
    assert ops.count("Attention") == 2 and "PackedAttention" not in ops
    assert ops.count("TokenIndex") == 1 and ops.count("PackTokens") == 1 + 2 and ops.count("UnpackTokens") == 1 + 2


def test_the_cpu_runs_the_padding_free_encoder_as_one_native_segment(bert):
    # the token ops and the packed attention are kiln's C kernels: from the embeddings to the unpacked output one
    # segment, as the plain engine's encoder (before them: four segments and a dozen torch steps between)
    _, engine, _ = bert
    tactics = {s.op_type: s.tactic for s in engine.plan.program.steps if s.domain == "kiln"}
    assert tactics["TokenIndex"] == "cpu.tokenindex.native" and tactics["PackTokens"] == "cpu.packtokens.native"
    assert tactics["UnpackTokens"] == "cpu.unpacktokens.native"
    assert tactics["PackedAttention"] == "cpu.packed_attention.native"
    segments = engine.program.segments
    assert len(segments) == 1
    members = {m.ctx.name for m in segments[0].members}
    assert {s.name for s in engine.plan.program.steps if s.domain == "kiln"} <= members


@pytest.mark.parametrize("packing", ["always", "never"])  # "auto" runs these small shapes as "never" does
@pytest.mark.parametrize("form", ["padded", "packed"])
@pytest.mark.parametrize("buckets", [False, True], ids=["exact", "token-buckets"])
def test_real_tokens_match_onnxruntime_and_padding_is_zero(bert, bert_padded, form, buckets, packing):
    _, engine, session = bert
    engine = engine if form == "packed" else bert_padded
    # buckets: padded shapes, T' >= T packed rows; packing "never": every position a row (the identity packing)
    context = engine.create_execution_context(buckets=buckets, packing=packing)
    rng = np.random.default_rng(3)
    # (4, 37) twice: one input shape, two token counts (what a shape's cached plans and bindings must not keep)
    for batch, seq, kind in [(3, 16, "right"), (4, 37, "left"), (4, 37, "holes"), (4, 48, "holes"), (2, 9, "ones"),
                             (1, 13, "right"), (1, 5, "ones")]:
        mask = _mask(rng, batch, seq, kind)
        feeds = {"input_ids": rng.integers(0, 1024, (batch, seq), dtype=np.int64), "attention_mask": mask}
        want = session.run(None, feeds)[0]
        got = context.run(feeds)["layer_norm_4"]
        keep = mask != 0
        np.testing.assert_allclose(got[keep], want[keep], rtol=RTOL, atol=ATOL, err_msg=f"{batch}x{seq} {kind}")
        assert not got[~keep].any(), f"{batch}x{seq} {kind}: outputs at padding positions must be zero"
        # a numpy mask's tokens are counted on the host, a tensor's by torch (CUDA: the run's one sync): the same run
        tensors = context.run({name: torch.from_numpy(value) for name, value in feeds.items()})["layer_norm_4"]
        np.testing.assert_array_equal(tensors.numpy(), got)


def test_packing_is_chosen_where_it_pays(bert):
    def rows(real: int, batch: int, seq: int, packing: str = "auto", bucketed: bool = True) -> int:
        mask = torch.zeros(batch, seq, dtype=torch.int64)
        mask.view(-1)[:real] = 1
        return packed_rows(mask, None, bucketed, packing, rule=PACKING_RULES["cuda"])  # the H200's numbers

    assert rows(600, 8, 128) == 1024  # 1K positions, bucket 640 saves 37% (under 45%): every position
    assert rows(500, 8, 128) == 512 and rows(500, 8, 128, bucketed=False) == 500
    assert rows(12450, 32, 512) == 13312  # 16K positions saving 19%: packed
    assert rows(15500, 32, 512) == 16384  # ... saving 5% (after the bucket): every position
    assert rows(15500, 32, 512, "always") == 16384 and rows(15000, 32, 512, "always") == 15360  # buckets
    assert rows(10, 4, 64) == 256 and rows(10, 4, 64, "always") == 16  # too few positions for "auto"
    assert rows(10, 4, 64, "never") == 256
    with pytest.raises(ValueError, match="packing='sometimes'"):
        bert[1].create_execution_context(packing="sometimes")


def test_the_cpu_packs_any_saving_into_eighth_step_buckets():
    # the CPU's rule (a CPU mask's): packed wherever its token bucket saves a row, whether or not the context
    # buckets shapes; the rows always a bucket of eighth steps, so a stream of masks binds few segment views
    def rows(real: int, batch: int, seq: int, packing: str = "auto") -> int:
        mask = torch.zeros(batch, seq, dtype=torch.int64)
        mask.view(-1)[:real] = 1
        return packed_rows(mask, None, False, packing)

    assert packing_rule(torch.device("cpu")) is PACKING_RULES["cpu"]
    assert rows(60, 1, 64) == 60 and rows(61, 1, 64) == 64  # 64 of 64: the identity packing
    assert rows(10, 4, 64) == 16 and rows(17, 4, 64) == 18 and rows(600, 8, 128) == 640  # from 16 rows up
    assert rows(600, 8, 128, "never") == 1024 and rows(1000, 8, 128, "always") == 1024
    for tokens in range(1, 4096, 7):
        bucket = rows(tokens, 8, 512)
        assert tokens <= bucket <= max(16, 1.125 * tokens)


def test_token_buckets_waste_at_most_an_eighth_where_rows_cost_most():
    assert [token_bucket(t, 16384) for t in (0, 17, 129, 200, 300, 810, 1030, 12450, 16000)] == \
        [16, 32, 192, 256, 320, 896, 1152, 13312, 16384]
    assert token_bucket(119, 128) == 128 and token_bucket(5, 8) == 8  # never past B·S
    for tokens in range(1, 20000, 37):
        bucket = token_bucket(tokens, 1 << 15)
        assert tokens <= bucket <= max(16, 2 * tokens) and (tokens < 1024 or bucket <= 1.125 * tokens)


def test_a_saved_engine_keeps_the_flag(bert, tmp_path):
    exported, engine, session = bert
    engine.save(tmp_path / "bert.kiln")
    loaded = kiln.load(tmp_path / "bert.kiln")
    assert loaded.plan.header["build_config"]["remove_padding"] is True
    assert loaded.plan.header["remove_padding"] == engine.plan.header["remove_padding"]
    rng = np.random.default_rng(4)
    mask = _mask(rng, 3, 20, "right")
    feeds = {"input_ids": rng.integers(0, 1024, (3, 20), dtype=np.int64), "attention_mask": mask}
    np.testing.assert_array_equal(loaded.run(feeds)["layer_norm_4"], engine.run(feeds)["layer_norm_4"])
    assert not loaded.run(feeds)["layer_norm_4"][mask == 0].any()


def _optimized(model: onnx.ModelProto | str, **options):
    return optimize(onnx_frontend.load(model), PassOptions(**options))


def test_on_cuda_the_region_starts_at_the_embedding_lookups(bert):
    # CUDA's rules (no cpu_rules): the ids are packed, not the embedded rows, and the position embeddings ([1, S, D],
    # one row per position) packed for each token's position; so a run padded to the profile's largest shape for its
    # CUDA graph embeds and normalizes only its token bucket's rows. The CPU's rules start at the first LayerNorm.
    exported, _, session = bert
    graph = _optimized(str(exported.path), remove_padding=True)
    removal = graph.meta["kiln.remove_padding"]
    # (the token-type rows: one constant [1, 1, D] row since fill_uniform_gather, nothing to pack)
    assert removal["packed"] == ["input_ids", "embedding_2"] and removal["layers"] == 17
    packs = {n.inputs[0].name: n for n in graph.graph if n.op_type == "PackTokens"}
    assert packs["embedding_2"].attributes["broadcast"].value == 1 and "broadcast" not in packs["input_ids"].attributes
    lookups = [n for n in graph.graph if n.op_type == "Gather" and n.inputs[1].name.endswith("_packed")]
    assert len(lookups) == 1  # the word embeddings on the packed ids
    cpu = _optimized(str(exported.path), remove_padding=True, cpu_rules=True)
    assert cpu.meta["kiln.remove_padding"]["packed"] == ["layer_norm"]
    # numerically: that graph as an engine (each layer its torch form) against onnxruntime, packed (token buckets,
    # their dummy rows included), every position a row, and the plain rule's choice; a fully padded row included
    engine = kiln.build(graph, opt_level=0, profiles=[{"input_ids": "1x1,2x16,4x48"}])
    rng = np.random.default_rng(6)
    for batch, seq, kind in [(4, 37, "right"), (1, 48, "left"), (3, 5, "holes")]:
        mask = _mask(rng, batch, seq, kind)
        feeds = {"input_ids": rng.integers(0, 1024, (batch, seq)), "attention_mask": mask}
        want = session.run(None, feeds)[0]
        keep = mask != 0
        for packing in ("auto", "always", "never"):
            got = engine.create_execution_context(packing=packing).run(feeds)["layer_norm_4"]
            np.testing.assert_allclose(got[keep], want[keep], rtol=RTOL, atol=ATOL, err_msg=f"{batch}x{seq} {packing}")
            assert not got[~keep].any()


def test_a_broadcast_pack_reads_each_tokens_position():
    x = torch.randn(1, 6, 3)  # [1, S, D]: one row per position
    index = torch.tensor([0, 4, 7, 11, 0])  # flat b·S + s of a [2, 6] mask, a dummy row last
    torch.testing.assert_close(pack_tokens(CTX, x, index, broadcast=1), x[0, [0, 4, 1, 5, 0]], rtol=0, atol=0)
    step = StepSpec(op_type="PackTokens", name="p", inputs=["x", "index"], outputs=["y"], domain="kiln",
                    attributes={"broadcast": 1})
    native = registry.get("cpu.packtokens.native")  # gathers B·S rows of x: it refuses (where kiln's C is built)
    if native.available():
        assert "for every row of the batch" in str(native.check(step, [InputMeta.of(x, False),
                                                                      InputMeta.of(index, False)]))


def test_key_padding_mask_reads_the_padding_mask_as_one_row_per_batch(bert):
    exported, _, session = bert
    graph = _optimized(str(exported.path))
    old = next(n.inputs[3].producer() for n in graph.graph if n.op_type == "Attention")  # [B, 1, S, S]
    nodes = len(list(graph.graph))
    assert key_padding_mask(graph) == 2
    masks = {n.inputs[3] for n in graph.graph if n.op_type == "Attention"}
    assert len(masks) == 1
    key_mask = masks.pop()
    assert [d if isinstance(d, int) else d.value for d in key_mask.shape] == ["batch", 1, 1, "seq"]
    assert [n.op_type for n in graph.graph if n.name.startswith("key_mask")] == ["Equal", "Where", "Unsqueeze"]
    # the model's mask subgraph gone: since attention_key_mask it is Where(Unsqueeze(Cast(attention_mask)), 0, -inf),
    # as many nodes as the key mask's
    assert old not in list(graph.graph) and len(list(graph.graph)) <= nodes
    # numerically: the engine of the rewritten graph (every layer its torch form) against onnxruntime, a fully padded
    # row included (the key mask hides its every key: it still matches at real tokens, and holds no NaN)
    engine = kiln.build(graph, opt_level=0, profiles=[{"input_ids": "1x1,2x16,4x48"}])
    rng = np.random.default_rng(5)
    mask = _mask(rng, 4, 37, "right")  # row 1: all padding
    feeds = {"input_ids": rng.integers(0, 1024, (4, 37)), "attention_mask": mask}
    got, want = engine.run(feeds)["layer_norm_4"], session.run(None, feeds)[0]
    keep = mask != 0
    np.testing.assert_allclose(got[keep], want[keep], rtol=1e-5, atol=2e-5)
    assert not np.isnan(got).any()
    # a model without a padding mask: nothing to read, the graph unchanged
    gpt2 = _optimized(str(zoo.export("gpt2_tiny", dynamic=True).path))
    nodes = len(list(gpt2.graph))
    assert key_padding_mask(gpt2) == 0 and len(list(gpt2.graph)) == nodes


@pytest.mark.parametrize("kind", ["right", "left", "holes"])
def test_key_lengths_beside_the_key_mask_keep_the_real_tokens(bert, kind):
    """On CUDA (key_lengths=True) the attentions read the mask's lengths as well; the rewritten graph still matches
    onnxruntime at real tokens for right padding (lengths used), left padding and holes (-1: the key mask applies),
    a fully padded row included."""
    exported, _, session = bert
    graph = _optimized(str(exported.path))
    assert key_padding_mask(graph, key_lengths=True) == 2
    lengths = [n for n in graph.graph if n.op_type == "KeyLengths"]
    assert len(lengths) == 1 and lengths[0].inputs[0].name == "attention_mask"
    attentions = [n for n in graph.graph if n.op_type == "Attention"]
    assert all(len(n.inputs) == 5 and n.inputs[4] is lengths[0].outputs[0] for n in attentions)
    engine = kiln.build(graph, opt_level=0, profiles=[{"input_ids": "1x1,2x16,4x48"}])
    rng = np.random.default_rng(6)
    mask = _mask(rng, 4, 37, kind)  # row 1: all padding
    feeds = {"input_ids": rng.integers(0, 1024, (4, 37)), "attention_mask": mask}
    got, want = engine.run(feeds)["layer_norm_4"], session.run(None, feeds)[0]
    keep = mask != 0
    np.testing.assert_allclose(got[keep], want[keep], rtol=RTOL, atol=ATOL)
    assert not np.isnan(got).any()


def test_a_model_without_a_padding_mask_is_refused():
    with pytest.raises(PaddingRefused, match="no padding mask input.*input_ids"):
        _optimized(str(zoo.export("gpt2_tiny", dynamic=True).path), remove_padding=True)


def test_a_layer_mixing_tokens_after_the_attention_is_refused(bert):
    exported, _, _ = bert
    model = onnx.load(str(exported.path))
    hidden = model.graph.output[0].name
    axes = onnx.helper.make_tensor("pool_axes", onnx.TensorProto.INT64, [1], [1])
    model.graph.initializer.append(axes)
    model.graph.node.append(onnx.helper.make_node("ReduceMean", [hidden, "pool_axes"], ["pooled"], name="mean_pool"))
    model.graph.output.append(onnx.helper.make_tensor_value_info("pooled", onnx.TensorProto.FLOAT, None))
    with pytest.raises(PaddingRefused, match="'mean_pool' \\(ReduceMean\\).*not per-token"):
        _optimized(model, remove_padding=True)


def test_an_attention_bias_is_not_a_padding_mask():
    # T5's relative position bias is added to the mask: not a padding mask, refused
    with pytest.raises(PaddingRefused, match="a bias, not a padding mask"):
        _optimized(str(zoo.export("t5_encoder_tiny", dynamic=True).path), remove_padding=True)


def test_without_fusions_there_is_no_attention_to_pack_around(bert):
    exported, _, _ = bert
    with pytest.raises(PaddingRefused, match="no fused attention reads the padding mask"):
        _optimized(str(exported.path), opt_level=1, remove_padding=True)


def test_the_cli_builds_padding_free_and_inspect_says_so(bert, tmp_path, capsys):
    exported, _, _ = bert
    out = tmp_path / "bert.kiln"
    assert main(["build", str(exported.path), "-o", str(out), "--remove-padding",
                 "--profile", "input_ids:1x1,2x8,2x16"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "remove padding on: 14 layer(s) (2 attention(s)) run on the real tokens of 'attention_mask'" in text
    assert "the engine holds both programs on one set of weights" in text
    assert main(["build", str(zoo.export("gpt2_tiny", dynamic=True).path), "-o", str(tmp_path / "g.kiln"),
                 "--remove-padding"]) == 1
    assert "no padding mask input" in capsys.readouterr().err


def test_a_padding_free_engine_refits(bert, tmp_path):
    # the refit derives weights through the same passes as the build, the rewrite included
    exported, _, _ = bert
    model = onnx.load(str(exported.path))
    rng = np.random.default_rng(5)
    for tensor in model.graph.initializer:
        array = onnx.numpy_helper.to_array(tensor)
        if array.dtype == np.float32 and array.ndim == 2:  # the weight matrices (each its own)
            tensor.CopyFrom(onnx.numpy_helper.from_array(array * rng.uniform(0.8, 1.2, array.shape).astype(np.float32),
                                                         tensor.name))
    onnx.save(model, str(tmp_path / "new.onnx"))
    engine = kiln.build(str(exported.path), remove_padding=True, profiles=[{"input_ids": "1x1,2x16,4x48"}])
    engine.refit(str(tmp_path / "new.onnx"))
    session = ort.InferenceSession(str(tmp_path / "new.onnx"), providers=["CPUExecutionProvider"])
    mask = _mask(rng, 3, 21, "left")
    feeds = {"input_ids": rng.integers(0, 1024, (3, 21), dtype=np.int64), "attention_mask": mask}
    keep = mask != 0
    want = session.run(None, feeds)[0][keep]
    np.testing.assert_allclose(engine.run(feeds)["layer_norm_4"][keep], want, rtol=RTOL, atol=ATOL)  # plain program
    packed = engine.create_execution_context(packing="always").run(feeds)["layer_norm_4"]  # ... and the packed one
    np.testing.assert_allclose(packed[keep], want, rtol=RTOL, atol=ATOL)
