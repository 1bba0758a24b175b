"""The Triton paged decode kernel against the torch reference (kiln/llm/attention.py) under
TRITON_INTERPRET=1 at small shapes (the root conftest sets it without CUDA): GQA groups, page sizes,
splits, sliding windows, ragged lengths, scattered block tables; batch invariance; the engine with
the triton backend generates what the torch backend does."""

import os

import pytest
import torch

triton = pytest.importorskip("triton")

from kiln.llm.attention import AttentionMetadata, paged_attention  # noqa: E402
from kiln.llm.kernels.paged_decode import paged_decode_attention  # noqa: E402

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu"
if os.environ.get("TRITON_INTERPRET") == "1":
    # the interpreter fixes tests/kernels applies (bf16 tl.dot on bit patterns, numpy scalar indices)
    from tests.kernels.conftest import _fix_interpreter_bf16_dot, _fix_interpreter_scalar_index

    _fix_interpreter_bf16_dot()
    _fix_interpreter_scalar_index()


def case(batch, heads, kv_heads, head_dim, page, seq_lens, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // page) for n in seq_lens)
    num_blocks = batch * max_blocks + 3
    k_cache = torch.randn((num_blocks, page, kv_heads, head_dim), generator=g).to(dtype).to(DEVICE)
    v_cache = torch.randn((num_blocks, page, kv_heads, head_dim), generator=g).to(dtype).to(DEVICE)
    order = torch.randperm(num_blocks - 1, generator=g) + 1  # scattered, never the null block
    tables = torch.zeros((batch, max_blocks), dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        used = -(-n // page)
        tables[b, :used] = order[b * max_blocks:b * max_blocks + used]
    q = torch.randn((batch, heads, head_dim), generator=g).to(dtype).to(DEVICE)
    return q, k_cache, v_cache, tables.to(DEVICE), torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)


def reference(q, k_cache, v_cache, tables, seq_lens, scale, window=None):
    batch = q.shape[0]
    meta = AttentionMetadata(slot_mapping=torch.empty(0), query_start=list(range(batch)), query_lens=[1] * batch,
                             seq_lens=seq_lens.tolist(), block_tables=tables, seq_lens_tensor=seq_lens)
    return paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale, window)


@pytest.mark.parametrize("heads,kv_heads,head_dim,page,seq_lens,split", [
    (4, 4, 16, 4, [1, 7, 16, 33], 256),  # MHA, lengths inside and across pages, one split
    (8, 2, 32, 8, [5, 40, 71], 16),  # GQA 4:1, several splits of 16 keys
    (6, 2, 16, 16, [100, 3], 32),  # GQA 3:1 (rows padded to 16), page 16
    (4, 1, 64, 4, [64, 65], 16),  # MQA
])
def test_kernel_matches_the_torch_reference(heads, kv_heads, head_dim, page, seq_lens, split):
    q, k, v, tables, lens = case(len(seq_lens), heads, kv_heads, head_dim, page, seq_lens)
    scale = head_dim ** -0.5
    got = paged_decode_attention(q, k, v, tables, lens, scale, split_tokens=split, block_n=16)
    # fp32 throughout; online softmax vs SDPA differ by summation order only
    torch.testing.assert_close(got, reference(q, k, v, tables, lens, scale), atol=2e-5, rtol=1e-5)


def test_sliding_window():
    q, k, v, tables, lens = case(3, 4, 2, 16, 4, [5, 30, 50])
    got = paged_decode_attention(q, k, v, tables, lens, 0.25, sliding_window=12, split_tokens=16, block_n=16)
    torch.testing.assert_close(got, reference(q, k, v, tables, lens, 0.25, window=12), atol=2e-5, rtol=1e-5)


def test_half_precision_storage():
    q, k, v, tables, lens = case(2, 4, 2, 32, 8, [20, 47], dtype=torch.bfloat16)
    got = paged_decode_attention(q, k, v, tables, lens, 32 ** -0.5, split_tokens=16, block_n=16)
    assert got.dtype == torch.bfloat16
    # p is rounded to bf16 before p·v (as flash attention does): bf16's 8 bits of mantissa
    torch.testing.assert_close(got.float(), reference(q, k, v, tables, lens, 32 ** -0.5), atol=2e-2, rtol=2e-2)


def test_a_request_does_not_depend_on_its_batch():
    q, k, v, tables, lens = case(3, 8, 2, 16, 4, [9, 70, 33])
    both = paged_decode_attention(q, k, v, tables, lens, 0.25, split_tokens=16, block_n=16)
    alone = paged_decode_attention(q[:1], k, v, tables[:1], lens[:1], 0.25, split_tokens=16, block_n=16)
    assert torch.equal(both[:1], alone)  # bit for bit: the split length does not depend on the batch
    wide = paged_decode_attention(q[:1], k, v, tables[:1], lens[:1], 0.25, max_seq_len=4096, split_tokens=16,
                                  block_n=16)
    assert torch.equal(wide, alone)  # nor on the grid (a CUDA graph is captured for max_model_len)
    # request 1: 70 keys, 5 splits merged (request 0 is one split, written by the split kernel: no merge)
    alone = paged_decode_attention(q[1:2], k, v, tables[1:2], lens[1:2], 0.25, split_tokens=16, block_n=16)
    assert torch.equal(both[1:2], alone)
    wide = paged_decode_attention(q[1:2], k, v, tables[1:2], lens[1:2], 0.25, max_seq_len=4096, split_tokens=16,
                                  block_n=16)
    assert torch.equal(wide, alone)


@pytest.mark.parametrize("max_splits", [1, 2, 3])
def test_long_requests_take_longer_splits_not_more(max_splits):
    """At most max_splits splits a request: 150 keys in 2 splits of 80 (16-key tiles), or 3 of 64, or one."""
    q, k, v, tables, lens = case(2, 4, 2, 16, 8, [150, 20])
    got = paged_decode_attention(q, k, v, tables, lens, 0.25, split_tokens=16, block_n=16, max_splits=max_splits)
    torch.testing.assert_close(got, reference(q, k, v, tables, lens, 0.25), atol=2e-5, rtol=1e-5)


def test_engine_with_the_triton_backend_generates_what_torch_does(hf_models):
    from kiln.llm import LLM, SamplingParams

    folder, _ = hf_models("llama")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = ["Hello world", "Paged attention reads keys and values from blocks"]
    expected = [o.outputs[0].token_ids for o in LLM(folder, kv_cache_memory="2MiB", block_size=4).generate(prompts,
                                                                                                       params)]
    llm = LLM(folder, kv_cache_memory="2MiB", block_size=4, attention_backend="triton", device=DEVICE)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected


def test_splits_past_a_request_are_neither_computed_nor_merged(monkeypatch):
    """The split kernel skips splits past a request's keys and the merge reads only the ones that hold keys:
    scratch buffers full of NaN (what an unwritten split would hold) change nothing, and the result is written
    into the `out` rows it is given."""
    q, k, v, tables, lens = case(3, 8, 2, 16, 4, [9, 70, 33])
    expected = reference(q, k, v, tables, lens, 0.25)
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    out = torch.full((5, 8, 16), 7.0, device=DEVICE)
    got = paged_decode_attention(q, k, v, tables, lens, 0.25, max_seq_len=256, split_tokens=16, block_n=16,
                                 out=out[1:4])
    monkeypatch.undo()
    assert got.data_ptr() == out[1:4].data_ptr()
    torch.testing.assert_close(out[1:4], expected, atol=2e-5, rtol=1e-5)
    assert (out[0] == 7).all() and (out[4] == 7).all()  # rows outside the slice untouched


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_the_default_splits_one_and_several_against_the_reference(kv_dtype):
    """The engine's launch (256-key splits of 64-key tiles, page 16, a grid for a longer max_seq_len than any row):
    rows of one split (written by the split kernel) and of several (merged) in one batch, bf16 and FP8 caches."""
    seq_lens = [1, 63, 64, 65, 256, 257, 700]
    q, k, v, tables, lens = case(len(seq_lens), 8, 2, 32, 16, seq_lens, dtype=torch.bfloat16, seed=3)
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    got = paged_decode_attention(q, k, v, tables, lens, 32 ** -0.5, max_seq_len=2048)
    # bf16 q, p rounded to bf16 before p·v: ~2^-8 relative
    torch.testing.assert_close(got.float(), reference(q, k, v, tables, lens, 32 ** -0.5), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("launch", [dict(heads_first=True), dict(num_stages=3), dict(num_stages=4, heads_first=True)])
def test_launch_settings_change_no_bit(launch):
    """The grid's order and the pipeline's stages are launch settings: the same bits (on the GPU a real check; the
    warps are not: 2 warps instead of 4 changed bits on the H200, llm4 run 1)."""
    q, k, v, tables, lens = case(3, 8, 2, 32, 8, [5, 40, 71])
    default = paged_decode_attention(q, k, v, tables, lens, 32 ** -0.5, split_tokens=16, block_n=16)
    assert torch.equal(paged_decode_attention(q, k, v, tables, lens, 32 ** -0.5, split_tokens=16, block_n=16,
                                              **launch), default)
    torch.testing.assert_close(default, reference(q, k, v, tables, lens, 32 ** -0.5), atol=2e-5, rtol=1e-5)
