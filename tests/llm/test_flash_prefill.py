"""prefill_attention="flash": a step's whole prompts through torch's flash attention (varlen, causal, GQA) with
their K/V read back from the cache, against the torch reference over the same cache (bf16 and FP8 caches, decode
rows first as the runner orders them). The kernel is CUDA-only: on the CPU the dispatch and the option's check
run, the numerical test on the GPU (TRITON_INTERPRET=0)."""

import os

import pytest
import torch

from kiln.llm import LLM, attention
from kiln.llm.attention import AttentionMetadata, paged_attention, write_kv
from kiln.llm.config import EngineConfig, LLMError

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu"


def meta_for(cached: list[int], new: list[int], tables: torch.Tensor, page: int, device: str) -> AttentionMetadata:
    """Requests with `cached` tokens already in their blocks and `new` rows this step (decodes first)."""
    starts = [sum(new[:b]) for b in range(len(new))]
    seq_lens = [c + n for c, n in zip(cached, new)]
    slots = [int(tables[b, p // page]) * page + p % page for b in range(len(new)) for p in range(cached[b], seq_lens[b])]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), query_start=starts, query_lens=list(new),
        seq_lens=seq_lens, block_tables=tables.to(device),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        num_decodes=sum(1 for n in new if n == 1), backend="triton", max_seq_len=512, prefill_kernel="flash",
        query_start_tensor=torch.tensor(starts, dtype=torch.int32, device=device),
        query_lens_tensor=torch.tensor(new, dtype=torch.int32, device=device),
        prefill_tiles=attention.prefill_tiles(list(new), sum(1 for n in new if n == 1), torch.device(device)))


def test_only_steps_of_whole_prompts_take_flash():
    tables = torch.arange(1, 13, dtype=torch.int32).view(3, 4)
    whole = meta_for([40, 0, 0], [1, 30, 7], tables, 16, "cpu")  # a decode, then two whole prompts
    assert attention._whole_prompts(whole, None)
    assert not attention._whole_prompts(whole, 8)  # a sliding window: the paged kernel
    hit = meta_for([40, 0, 16], [1, 30, 7], tables, 16, "cpu")  # the last prompt after a prefix-cache hit
    assert not attention._whole_prompts(hit, None)


def test_the_option_is_checked():
    with pytest.raises(LLMError, match="prefill_attention 'fast'"):
        EngineConfig(prefill_attention="fast").check()
    EngineConfig(prefill_attention="flash").check()


def varlen_causal(q, k, v, bounds_q, bounds_k, longest_q, longest_k, dropout, causal, debug, scale):
    """A stand-in for aten._flash_attention_forward on the CPU (fp32 SDPA per sequence, GQA by repetition): what
    the flash call is asked to compute, so the gather, the bounds and the rows written are checked here."""
    assert causal and dropout == 0.0 and bounds_q.dtype == torch.int32 and torch.equal(bounds_q, bounds_k)
    assert longest_q == longest_k == int((bounds_q[1:] - bounds_q[:-1]).max())
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for start, end in zip(bounds_q[:-1].tolist(), bounds_q[1:].tolist()):
        qs, ks, vs = (x[start:end].transpose(0, 1).float() for x in (q, k, v))  # [H, S, D]
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1).to(q.dtype)
    return out, None, None, None, None


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_flash_prefill_reads_the_prompts_back_from_the_cache(kv_dtype, monkeypatch):
    """On the CPU, with flash replaced by varlen_causal: the prompts' K/V gathered from their slots (an FP8 cache's
    bytes, widened), the bounds made once a step, only the prefill rows written."""
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", varlen_causal)
    g = torch.Generator().manual_seed(6)
    heads, kv_heads, dim, page = 4, 2, 16, 4
    cached, new = [9, 0, 0], [1, 11, 6]  # a decode, two whole prompts
    tables = (torch.randperm(30, generator=g)[:15] + 1).to(torch.int32).view(3, 5)
    k_cache = (torch.randn((31, page, kv_heads, dim), generator=g) * 2).to(kv_dtype)
    v_cache = (torch.randn((31, page, kv_heads, dim), generator=g) * 2).to(kv_dtype)
    meta = meta_for(cached, new, tables, page, "cpu")
    q = torch.randn((sum(new), heads, dim), generator=g)
    out = torch.full_like(q, 7.0)
    attention.flash_prefill_attention(q, k_cache, v_cache, meta, dim ** -0.5, out)
    bounds = meta.prefill_bounds
    assert bounds.tolist() == [0, 11, 17]
    attention.flash_prefill_attention(q, k_cache, v_cache, meta, dim ** -0.5, out)  # the next layer's call
    assert meta.prefill_bounds is bounds
    assert (out[0] == 7.0).all()  # the decode row is the decode kernel's
    meta.backend = "torch"
    expected = paged_attention(q, k_cache, v_cache, meta, dim ** -0.5)
    torch.testing.assert_close(out[1:], expected[1:], atol=2e-5, rtol=1e-5)  # fp32: summation order only


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="flash attention runs on CUDA only")
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_flash_prefill_matches_the_reference(kv_dtype):
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, page = 32, 8, 128, 16
    # two decodes, a one-token prompt (a decode row to the runner: it sorts it among them), prompts of 128 and 37
    cached, new = [70, 9, 0, 0, 0], [1, 1, 1, 128, 37]
    num_blocks = 5 * 8 + 1
    k_cache = torch.zeros((num_blocks, page, kv_heads, dim), dtype=kv_dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    tables = (torch.randperm(num_blocks - 1, generator=g)[:40] + 1).to(torch.int32).view(5, 8)
    past = meta_for([0] * 5, cached, tables, page, DEVICE)  # the decodes' earlier keys
    total = sum(cached)
    write_kv(torch.randn((total, kv_heads, dim), generator=g).to(torch.bfloat16).to(DEVICE),
             torch.randn((total, kv_heads, dim), generator=g).to(torch.bfloat16).to(DEVICE), k_cache, v_cache,
             past.slot_mapping)
    meta = meta_for(cached, new, tables, page, DEVICE)
    rows = sum(new)
    write_kv(torch.randn((rows, kv_heads, dim), generator=g).to(torch.bfloat16).to(DEVICE),
             torch.randn((rows, kv_heads, dim), generator=g).to(torch.bfloat16).to(DEVICE), k_cache, v_cache,
             meta.slot_mapping)
    q = torch.randn((rows, heads, dim), generator=g).to(torch.bfloat16).to(DEVICE)
    got = paged_attention(q, k_cache, v_cache, meta, dim ** -0.5)
    meta.backend = "torch"
    expected = paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, dim ** -0.5)
    # bf16 q, K/V (E4M3 values are exact in bf16) and p before p·v: ~2^-8 relative on values of ~1
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)
    meta.backend, meta.prefill_kernel = "triton", "triton"
    paged = paged_attention(q, k_cache, v_cache, meta, dim ** -0.5)  # the paged kernel: the same to bf16 rounding
    torch.testing.assert_close(got.float(), paged.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(got[:3], paged[:3])  # the decode rows took the decode kernel in both


def prefill_logits(llm, prompt: list[int], kernel: str) -> torch.Tensor:
    """fp32 logits of every row of one whole-prompt prefill step, its attention through `kernel`."""
    from kiln.llm.request import Request
    from kiln.llm.scheduler import ScheduledRequest

    runner = llm.engine.runner
    runner.prefill_attention = kernel
    inputs = runner.prepare([ScheduledRequest(Request("r", prompt), prompt, 0, [1, 2, 3, 4])])
    assert inputs.meta.prefill_kernel == kernel
    inputs.logit_rows = torch.arange(len(prompt), device=inputs.token_ids.device)
    return runner.forward(inputs).float().cpu()


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="flash attention runs on CUDA only")
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_an_engine_with_flash_prefill(hf_models, kv):
    """A bf16 engine's prefill logits with flash and with the paged kernel: their difference, and (bf16 cache) each
    one's error against transformers in fp32, of the size transformers' own bf16 run makes (the oracle of
    tests/llm/test_gpu.py). Two kernels over the same cache differ by bf16 rounding only, so this holds on an FP8
    cache too (where both differ from the fp32 model by the cache's E4M3 rounding). The first H200 run compared the
    first generated token's log-probability at abs 3e-2 and failed at 3.2e-2 (bf16 cache): bf16 logits of a few
    units round at ~1e-2, so that bound was tighter than bf16 itself."""
    folder, hf = hf_models("llama")
    prompt = list(range(5, 60))
    with torch.no_grad():
        reference = hf.float()(torch.tensor([prompt])).logits[0]
        hf_bf16 = hf.to("cuda", torch.bfloat16)(torch.tensor([prompt], device="cuda")).logits[0].float().cpu()
        hf.to("cpu", torch.float32)
    bf16_error = (hf_bf16 - reference).abs().max()
    llm = LLM(folder, dtype="bfloat16", device="cuda", kv_cache_memory="64MiB", block_size=16, kv_cache_dtype=kv,
              cuda_graphs=False)
    paged = prefill_logits(llm, prompt, "triton")
    flash = prefill_logits(llm, prompt, "flash")
    assert (flash - paged).abs().max() <= 2 * bf16_error + 1e-2
    if kv == "auto":
        assert (flash - reference).abs().max() <= 2 * bf16_error + 1e-2
        assert (paged - reference).abs().max() <= 2 * bf16_error + 1e-2
