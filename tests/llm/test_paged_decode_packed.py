"""The packed decode kernel (kv_heads_per_program > 1: several K/V heads a program, their query rows in one tile,
each row masked to its own head's columns) against the torch reference (kiln/llm/attention.py) under
TRITON_INTERPRET=1 at small shapes, and on the GPU (TRITON_INTERPRET=0) at Llama-3-8B's heads on an FP8 cache:
GQA groups, splits, sliding windows, ragged lengths, scattered block tables, batch invariance; the FP8 launch's
environment variable (KILN_LLM_DECODE_FP8) and its errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from kiln.llm.kernels import paged_decode  # noqa: E402
from kiln.llm.kernels.paged_decode import paged_decode_attention, parse_launch  # noqa: E402
from tests.llm.test_paged_decode_kernel import DEVICE, case, reference  # noqa: E402  (its interpreter fixes too)

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("heads,kv_heads,head_dim,page,seq_lens,split,hpp", [
    (16, 4, 16, 4, [1, 7, 16, 33], 256, 4),  # GQA 4:1, 4 heads a program: 16 rows, no padding; one split
    (16, 4, 32, 8, [5, 40, 71], 16, 2),  # 2 heads a program (8 rows padded to 16), several 16-key splits
    (12, 4, 16, 16, [100, 3], 32, 4),  # GQA 3:1: 12 rows padded to 16, page 16
    (8, 8, 16, 4, [64, 65, 2], 16, 8),  # MHA, all 8 heads in one program
    (4, 2, 64, 4, [30, 9], 16, 2),  # GQA 2:1, head_dim 64
])
def test_packed_kernel_matches_the_torch_reference(heads, kv_heads, head_dim, page, seq_lens, split, hpp):
    q, k, v, tables, lens = case(len(seq_lens), heads, kv_heads, head_dim, page, seq_lens, seed=hpp)
    scale = head_dim ** -0.5
    got = paged_decode_attention(q, k, v, tables, lens, scale, split_tokens=split, block_n=16,
                                 kv_heads_per_program=hpp)
    # fp32 throughout; online softmax vs SDPA differ by summation order only
    torch.testing.assert_close(got, reference(q, k, v, tables, lens, scale), atol=2e-5, rtol=1e-5)


def test_packed_kernel_sliding_window_and_merge():
    q, k, v, tables, lens = case(3, 8, 4, 16, 4, [5, 30, 50])
    got = paged_decode_attention(q, k, v, tables, lens, 0.25, sliding_window=12, split_tokens=16, block_n=16,
                                 kv_heads_per_program=2)
    torch.testing.assert_close(got, reference(q, k, v, tables, lens, 0.25, window=12), atol=2e-5, rtol=1e-5)


def test_packed_kernel_request_does_not_depend_on_its_batch():
    """Request 1 (70 keys: 5 splits of 16, merged) alone, in the batch and in a grid for 4096 keys (16 splits):
    the same bits. On the H200 the wider grid failed (2026-12-04): the merge summed its splits in a register layout
    picked from the grid's split count; it now adds them one at a time in split order (merge_order_sm90 below)."""
    q, k, v, tables, lens = case(3, 16, 4, 16, 4, [9, 70, 33])
    launch = dict(split_tokens=16, block_n=16, kv_heads_per_program=4)
    both = paged_decode_attention(q, k, v, tables, lens, 0.25, **launch)
    alone = paged_decode_attention(q[1:2], k, v, tables[1:2], lens[1:2], 0.25, **launch)
    assert torch.equal(both[1:2], alone)
    wide = paged_decode_attention(q[1:2], k, v, tables[1:2], lens[1:2], 0.25, max_seq_len=4096, **launch)
    assert torch.equal(wide, alone)
    torch.testing.assert_close(both, reference(q, k, v, tables, lens, 0.25), atol=2e-5, rtol=1e-5)


def test_the_decode_kernels_compile_to_one_order_for_any_batch_or_grid():
    """The real compiler (no GPU; tests/llm/merge_order_sm90.py): the split and packed kernels compile to the same
    TTGIR for a request alone, in a batch and in a wider grid (other pointer alignments and stride divisibilities),
    and the merge has no reduction that adds across splits. The merge before llm7b fails it (its tl.sum's layout
    followed the grid's split count)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.llm.merge_order_sm90"], env=env, capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert done.stdout.count("ok  ") == 8, done.stdout


@pytest.mark.parametrize("hpp", [1, 2, 4])
def test_packed_kernel_reads_an_fp8_cache_with_fp16_products(hpp):
    """bf16 q, FP8 cache, fp16 products (the engine's FP8 path): the values the torch path reads (widened)."""
    seq_lens = [1, 9, 70, 33, 257]
    q, k, v, tables, lens = case(len(seq_lens), 16, 4, 32, 8, seq_lens, dtype=torch.bfloat16, seed=5)
    k, v = (k.float() * 2).to(FP8), (v.float() * 2).to(FP8)
    got = paged_decode_attention(q, k, v, tables, lens, 32 ** -0.5, max_seq_len=512, split_tokens=64, block_n=16,
                                 kv_heads_per_program=hpp)
    assert got.dtype == torch.bfloat16
    # fp16 products, p rounded to fp16, out to bf16: ~2^-8 relative on values of ~1
    torch.testing.assert_close(got.float(), reference(q, k, v, tables, lens, 32 ** -0.5), atol=2e-2, rtol=2e-2)


def test_one_head_a_program_is_the_split_kernel():
    q, k, v, tables, lens = case(3, 8, 2, 16, 4, [9, 70, 33])
    default = paged_decode_attention(q, k, v, tables, lens, 0.25, split_tokens=16, block_n=16)
    assert torch.equal(paged_decode_attention(q, k, v, tables, lens, 0.25, split_tokens=16, block_n=16,
                                              kv_heads_per_program=1), default)


@pytest.mark.parametrize("hpp", [0, 3, 8])
def test_bad_heads_a_program_is_named(hpp):
    q, k, v, tables, lens = case(2, 8, 4, 16, 4, [9, 7])
    with pytest.raises(ValueError, match=f"kv_heads_per_program must be a power of two dividing the 4 K/V heads.*"
                                         f"got {hpp}"):
        paged_decode_attention(q, k, v, tables, lens, 0.25, kv_heads_per_program=hpp)


def test_parse_launch():
    assert parse_launch("h4 n32 w1 s5 sp64") == dict(kv_heads_per_program=4, block_n=32, num_warps=1, num_stages=5,
                                                     split_tokens=64)
    assert parse_launch("") == {}
    assert parse_launch("n32 hf1") == dict(block_n=32, heads_first=True)
    with pytest.raises(ValueError, match="KILN_LLM_DECODE_FP8='h4 x2': 'x2' is not one of"):
        parse_launch("h4 x2")


def test_the_fp8_launch_applies_to_an_fp8_cache_only(monkeypatch):
    """FP8_LAUNCH (KILN_LLM_DECODE_FP8) sets an FP8 cache's defaults: a bf16 cache keeps its own; an explicit
    argument wins."""
    seen = []
    real = paged_decode._decode_packed_kernel
    monkeypatch.setattr(paged_decode, "FP8_LAUNCH", dict(kv_heads_per_program=2, block_n=16, split_tokens=16))

    class Spy:
        def __getitem__(self, grid):
            seen.append(grid)
            return real[grid]

    monkeypatch.setattr(paged_decode, "_decode_packed_kernel", Spy())
    q, k, v, tables, lens = case(2, 8, 4, 16, 4, [9, 40], dtype=torch.bfloat16)
    paged_decode_attention(q, k, v, tables, lens, 0.25)  # bf16 cache: the split kernel
    assert seen == []
    k8, v8 = k.to(FP8), v.to(FP8)
    got = paged_decode_attention(q, k8, v8, tables, lens, 0.25, max_seq_len=64)
    assert seen == [(2, 2, 4)]  # 2 requests, 4 K/V heads / 2 a program, a 64-key grid in 16-key splits
    torch.testing.assert_close(got.float(), reference(q, k8, v8, tables, lens, 0.25), atol=2e-2, rtol=2e-2)
    paged_decode_attention(q, k8, v8, tables, lens, 0.25, kv_heads_per_program=1)
    assert len(seen) == 1


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="the GPU check (TRITON_INTERPRET=0 on CUDA)")
@pytest.mark.parametrize("launch", [dict(kv_heads_per_program=2), dict(kv_heads_per_program=4),
                                    dict(kv_heads_per_program=8), dict(kv_heads_per_program=4, num_warps=2),
                                    dict(kv_heads_per_program=4, split_tokens=64),
                                    dict(kv_heads_per_program=1, split_tokens=64)])
def test_packed_kernel_on_the_gpu_at_llama3_8b_heads(launch):
    """32 q / 8 K/V heads x 128, page 16, FP8 cache, bf16 q: rows of 1-700 keys (one split and several) against
    the reference; a request alone gets its bits in the batch, and merged rows theirs in a wider grid."""
    seq_lens = [1, 15, 64, 192, 193, 256, 257, 700]
    q, k, v, tables, lens = case(len(seq_lens), 32, 8, 128, 16, seq_lens, dtype=torch.bfloat16, seed=7)
    k, v = k.to(FP8), v.to(FP8)
    got = paged_decode_attention(q, k, v, tables, lens, 128 ** -0.5, max_seq_len=1024, **launch)
    torch.testing.assert_close(got.float(), reference(q, k, v, tables, lens, 128 ** -0.5), atol=3e-2, rtol=3e-2)
    alone = paged_decode_attention(q[3:4], k, v, tables[3:4], lens[3:4], 128 ** -0.5, max_seq_len=1024, **launch)
    assert torch.equal(got[3:4], alone)
    # rows merged from several splits (257 and 700 keys) in a grid for 4096 keys: the same bits as in 1024's
    wide = paged_decode_attention(q[6:8], k, v, tables[6:8], lens[6:8], 128 ** -0.5, max_seq_len=4096, **launch)
    assert torch.equal(got[6:8], wide)
