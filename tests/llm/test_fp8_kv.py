"""FP8 (E4M3, unit scale) KV cache: kv_cache_dtype="fp8". The Triton decode and prefill kernels read an FP8 cache
as the torch reference attention does on the same stored values (widened), the fused RoPE + cache write stores
what the torch write stores (rounded to the model dtype, saturated at +-448, then E4M3), and an engine with an
FP8 cache holds twice the tokens for the same budget and generates close to the full-precision one. Under
TRITON_INTERPRET=1 on the CPU; on the GPU with TRITON_INTERPRET=0."""

import os

import pytest
import torch

pytest.importorskip("triton")

from kiln.llm import LLM, LLMError, SamplingParams  # noqa: E402
from kiln.llm.attention import AttentionMetadata, paged_attention, write_kv  # noqa: E402
from kiln.llm.config import RopeConfig  # noqa: E402
from kiln.llm.kernels.fused import rope_kv_write  # noqa: E402
from kiln.llm.kernels.paged_decode import paged_decode_attention  # noqa: E402
from kiln.llm.kernels.paged_prefill import paged_prefill_attention  # noqa: E402
from kiln.llm.models.layers import Rotary  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.kernels.conftest import (_fix_interpreter_bf16_dot, _fix_interpreter_fp8_cast,
                                        _fix_interpreter_scalar_index)

    _fix_interpreter_bf16_dot()
    _fix_interpreter_scalar_index()
    _fix_interpreter_fp8_cast()  # the interpreter's float -> E4M3 rounding drops the exponent carry

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def caches(num_blocks, page, kv_heads, head_dim, g):
    k = (torch.randn((num_blocks, page, kv_heads, head_dim), generator=g) * 2).to(FP8)
    v = (torch.randn((num_blocks, page, kv_heads, head_dim), generator=g) * 2).to(FP8)
    return k, v


def tables_for(seq_lens, page, num_blocks, g):
    max_blocks = max(-(-n // page) for n in seq_lens)
    order = torch.randperm(num_blocks - 1, generator=g) + 1
    tables = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        used = -(-n // page)
        tables[b, :used] = order[b * max_blocks:b * max_blocks + used]
    return tables


@pytest.mark.parametrize("dtype,tol,f16_dot", [(torch.float32, 2e-5, False), (torch.bfloat16, 2e-2, False),
                                               (torch.bfloat16, 2e-2, True)])
def test_decode_kernel_reads_an_fp8_cache(dtype, tol, f16_dot):
    g = torch.Generator().manual_seed(1)
    seq_lens, heads, kv_heads, head_dim, page = [9, 70, 33], 8, 2, 32, 8
    k, v = caches(40, page, kv_heads, head_dim, g)
    tables = tables_for(seq_lens, page, 40, g)
    q = torch.randn((len(seq_lens), heads, head_dim), generator=g).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=torch.empty(0), query_start=list(range(3)), query_lens=[1] * 3,
                             seq_lens=seq_lens, block_tables=tables, seq_lens_tensor=lens)
    expected = paged_attention(q.float(), k, v, meta, head_dim ** -0.5)  # the torch path widens the cache itself
    got = paged_decode_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), tables.to(DEVICE), lens.to(DEVICE),
                                 head_dim ** -0.5, split_tokens=16, block_n=16, fp8_f16_dot=f16_dot)
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu().float(), expected, atol=tol, rtol=tol)


def prefill_over_fp8_cache(seed, requests, heads, kv_heads, head_dim, page, q_dtype, q_spread, **kernel_options):
    """One prefill batch over a random FP8 cache: (the Triton kernel's output, the torch reference's on the same
    stored values). requests: (cached, new) tokens each; q ~ N(0, q_spread²) in q_dtype, one 16-row tile a step."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in requests]
    query_lens = [n for _, n in requests]
    k, v = caches(30, page, kv_heads, head_dim, g)
    tables = tables_for(seq_lens, page, 30, g)
    q = (torch.randn((sum(query_lens), heads, head_dim), generator=g) * q_spread).to(q_dtype)  # [T, H, D]
    starts = [sum(query_lens[:b]) for b in range(len(requests))]
    meta = AttentionMetadata(slot_mapping=torch.empty(0), query_start=starts, query_lens=query_lens, seq_lens=seq_lens,
                             block_tables=tables, seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32))
    expected = paged_attention(q.float(), k, v, meta, head_dim ** -0.5)  # the torch path widens the cache itself
    tiles = torch.tensor([(b, r) for b in range(len(requests)) for r in range(0, query_lens[b], 16)],
                         dtype=torch.int32).reshape(-1, 2)
    to = dict(device=DEVICE)
    got = paged_prefill_attention(q.to(**to), k.to(**to), v.to(**to), tables.to(**to),
                                  torch.tensor(starts, dtype=torch.int32, **to),
                                  torch.tensor(query_lens, dtype=torch.int32, **to), meta.seq_lens_tensor.to(**to),
                                  tiles.to(**to), head_dim ** -0.5, None, block_m=16, block_n=16, **kernel_options)
    return got, expected


def test_prefill_kernel_reads_an_fp8_cache():
    got, expected = prefill_over_fp8_cache(2, [(0, 21), (12, 5), (7, 1)], heads=4, kv_heads=2, head_dim=16, page=4,
                                           q_dtype=torch.float32, q_spread=1.0)
    torch.testing.assert_close(got.cpu(), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("f16_dot", [False, True])
def test_prefill_kernel_reads_an_fp8_cache_with_bf16_queries(f16_dot):
    """The engine's case: bf16 q over an FP8 cache, the products in bf16 or (the default) in fp16."""
    # (cached, new) tokens: a whole prompt, a prefix hit, one row
    got, expected = prefill_over_fp8_cache(4, [(0, 37), (20, 9), (5, 1)], heads=8, kv_heads=2, head_dim=32, page=8,
                                           q_dtype=torch.bfloat16, q_spread=2.0, fp8_f16_dot=f16_dot)
    assert got.dtype == torch.bfloat16
    # bf16 output and p rounded to bf16 (fp16 with f16_dot) before p·v: ~2^-8 relative on values of a few units
    torch.testing.assert_close(got.cpu().float(), expected, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cache_write_stores_what_the_torch_write_stores(dtype):
    g = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, head_dim, blocks, page = 7, 4, 2, 32, 6, 4
    rotary = Rotary(RopeConfig(theta=10000.0), head_dim, 64, 64)
    qkv = (torch.randn((tokens, (heads + 2 * kv_heads) * head_dim), generator=g) * 3).to(dtype)
    qkv[0, heads * head_dim + 1] = 1000.0  # a key past E4M3's largest value (448): saturates, no NaN
    qkv[1, -1] = -900.0  # and a value
    positions = torch.randint(0, 64, (tokens,), generator=g)
    slots = torch.randperm(blocks * page, generator=g)[:tokens]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    _, k_ref = rotary(positions, q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim))
    k_cache_ref = torch.zeros((blocks, page, kv_heads, head_dim), dtype=FP8)
    v_cache_ref = torch.zeros((blocks, page, kv_heads, head_dim), dtype=FP8)
    write_kv(k_ref, v.reshape(tokens, kv_heads, head_dim), k_cache_ref, v_cache_ref, slots)
    k_cache, v_cache = k_cache_ref.clone().zero_().to(DEVICE), v_cache_ref.clone().zero_().to(DEVICE)
    rope_kv_write(qkv.to(DEVICE), positions.to(DEVICE), slots.to(DEVICE), rotary.cos.to(DEVICE), rotary.sin.to(DEVICE),
                  k_cache, v_cache, heads, kv_heads, head_dim)
    assert not torch.isnan(k_cache.float()).any() and not torch.isnan(v_cache.float()).any()
    assert k_cache_ref.float().abs().max() == 448.0 and v_cache_ref.float().abs().max() == 448.0
    assert torch.equal(v_cache.cpu().view(torch.uint8), v_cache_ref.view(torch.uint8))
    # k: the rotation's float rounding may differ in the last bit before E4M3 rounds it: at most one E4M3 step
    torch.testing.assert_close(k_cache.cpu().float(), k_cache_ref.float(), atol=1e-6, rtol=0.125)
    assert (k_cache.cpu().view(torch.uint8) != k_cache_ref.view(torch.uint8)).float().mean() < 0.05


def test_an_engine_with_an_fp8_cache(hf_models, monkeypatch):
    """The oracle: the full-precision engine whose K/V writes are rounded through E4M3 (saturated) first: the
    same attention over the same values, computed from an fp32 cache."""
    import kiln.llm.attention as attention

    folder, _ = hf_models("llama")
    options = dict(device="cpu", kv_cache_memory="256KiB", block_size=4)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    prompts = ["Hello world, hello", "Paged attention reads keys and values from blocks"]
    fp8 = LLM(folder, kv_cache_dtype="fp8", **options)
    got = fp8.generate(prompts, params)
    full = LLM(folder, **options)
    assert fp8.engine.num_kv_blocks == 4 * full.engine.num_kv_blocks  # fp32 model: 4 bytes -> 1 byte a value
    assert fp8.engine.kv_caches[0][0].dtype == FP8
    unrounded = full.generate(prompts, params)
    write = attention.write_kv

    def rounded(k, v, k_cache, v_cache, slots):
        def e4m3(x):
            return x.clamp(-448.0, 448.0).to(FP8).to(x.dtype)
        write(e4m3(k), e4m3(v), k_cache, v_cache, slots)

    monkeypatch.setattr(attention, "write_kv", rounded)
    for module in ("kiln.llm.models.llama", "kiln.llm.models.gpt2"):
        mod = __import__(module, fromlist=["write_kv"])
        if hasattr(mod, "write_kv"):
            monkeypatch.setattr(mod, "write_kv", rounded)
    expected = LLM(folder, **options).generate(prompts, params)  # a fresh engine: no prefix cached unrounded
    drift = 0.0
    for a, b, c in zip(expected, got, unrounded):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [x.logprob for x in b.outputs[0].logprobs] == pytest.approx([x.logprob for x in a.outputs[0].logprobs],
                                                                           abs=1e-4)
        drift = max(drift, max(abs(x.logprob - y.logprob) for x, y in zip(b.outputs[0].logprobs, c.outputs[0].logprobs)))
    assert drift > 1e-3  # the cache really is E4M3: full precision differs
    with pytest.raises(LLMError, match="kv_cache_dtype"):
        LLM(folder, kv_cache_dtype="int4", **options)
