"""The Triton paged prefill kernel against the torch reference under TRITON_INTERPRET=1 at small
shapes: requests with and without cached prefixes, chunks, single rows, GQA, sliding windows, bf16."""

import os

import pytest
import torch

pytest.importorskip("triton")

from kiln.llm.attention import AttentionMetadata, paged_attention, prefill_tiles  # noqa: E402
from kiln.llm.kernels.paged_prefill import paged_prefill_attention  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter fixes tests/kernels applies (bf16 tl.dot)
    from tests.kernels.conftest import _fix_interpreter_bf16_dot, _fix_interpreter_scalar_index

    _fix_interpreter_bf16_dot()
    _fix_interpreter_scalar_index()

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu"


def run(heads, kv_heads, head_dim, page, requests, window=None, dtype=torch.float32, block_m=16, block_n=16):
    """requests: (cached tokens, new tokens) each. Compares the kernel's rows with the reference's."""
    g = torch.Generator().manual_seed(len(requests) + heads)
    seq_lens = [c + n for c, n in requests]
    query_lens = [n for _, n in requests]
    max_blocks = max(-(-s // page) for s in seq_lens)
    num_blocks = len(requests) * max_blocks + 2
    k_cache = torch.randn((num_blocks, page, kv_heads, head_dim), generator=g).to(dtype)
    v_cache = torch.randn((num_blocks, page, kv_heads, head_dim), generator=g).to(dtype)
    order = torch.randperm(num_blocks - 1, generator=g) + 1
    tables = torch.zeros((len(requests), max_blocks), dtype=torch.int32)
    for b, s in enumerate(seq_lens):
        used = -(-s // page)
        tables[b, :used] = order[b * max_blocks:b * max_blocks + used]
    q = torch.randn((sum(query_lens), heads, head_dim), generator=g).to(dtype)
    starts = [sum(query_lens[:b]) for b in range(len(requests))]
    meta = AttentionMetadata(slot_mapping=torch.empty(0), query_start=starts, query_lens=query_lens, seq_lens=seq_lens,
                             block_tables=tables, seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32))
    expected = paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, head_dim ** -0.5, window)
    to = dict(device=DEVICE)
    tiles = torch.tensor([(b, r) for b in range(len(requests)) for r in range(0, query_lens[b], block_m)],
                         dtype=torch.int32).reshape(-1, 2)
    got = paged_prefill_attention(q.to(**to), k_cache.to(**to), v_cache.to(**to), tables.to(**to),
                                  torch.tensor(starts, dtype=torch.int32, **to),
                                  torch.tensor(query_lens, dtype=torch.int32, **to), meta.seq_lens_tensor.to(**to),
                                  tiles.to(**to), head_dim ** -0.5, window, block_m=block_m, block_n=block_n)
    return got.float().cpu(), expected


@pytest.mark.parametrize("heads,kv_heads,head_dim,page", [(4, 4, 16, 4), (8, 2, 32, 8), (6, 2, 16, 16), (4, 1, 64, 4)])
def test_kernel_matches_the_reference(heads, kv_heads, head_dim, page):
    # whole prompts, prompts after a prefix hit, a chunk in the middle, single rows
    requests = [(0, 21), (12, 5), (40, 17), (7, 1), (0, 1), (33, 40)]
    got, expected = run(heads, kv_heads, head_dim, page, requests)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)  # fp32; summation order only


@pytest.mark.parametrize("window", [1, 5, 12])
def test_sliding_window(window):
    got, expected = run(4, 2, 16, 4, [(0, 30), (25, 9), (3, 2)], window=window)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_half_precision_storage():
    got, expected = run(4, 2, 32, 8, [(0, 20), (16, 7)], dtype=torch.bfloat16)
    # p is rounded to bf16 before p·v (as flash attention does): bf16's 8-bit mantissa
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


def test_tiles_cover_every_prefill_row_once():
    tiles = prefill_tiles([1, 1, 70, 3, 32], first_request=2, device=torch.device("cpu"))
    assert tiles.tolist() == [[2, 0], [2, 32], [2, 64], [3, 0], [4, 0]]
