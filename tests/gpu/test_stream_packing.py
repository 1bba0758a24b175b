"""A padding-free engine under a stream of shapes on CUDA (kiln/runtime/buckets.py graph_rows): after
create_execution_context(warm_up=True) a random stream of batch x sequence with padding masks captures no graph, holds
at most 64 and evicts none, and matches torch fp32 at its real tokens (zeros at padding)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kiln
from kiln import zoo
from kiln.runtime.buckets import PACKING_RULES, graph_signatures

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FP16_ATOL = 2e-2  # fp16 storage, fp32 accumulation: BERT's LayerNorm'd hidden states (|x| <= ~5)


def test_a_warmed_up_stream_captures_nothing_and_matches_torch():
    exported = zoo.export("bert_tiny", dynamic=True)
    engine = kiln.build(str(exported.path), device="cuda", precision="fp16", remove_padding=True,
                        profiles=[{"input_ids": "1x1,8x64,64x128"}])  # bert_tiny: 128 positions
    context = engine.create_execution_context(warm_up=True)
    stats = context.runner.stats
    buckets = context.buckets
    most = graph_signatures(buckets.sizes("batch", 1, 64), buckets.sizes("seq", 1, 128), 64 * 128,
                            PACKING_RULES["cuda"])  # 22 buckets below 2048 positions, 16 token buckets, 1 identity
    assert stats.captures == most <= 64 and stats.evictions == 0, (stats, stats.eager_reasons)
    captured = stats.captures
    module = zoo.torch_model("bert_tiny").cuda().float().eval()
    rng = np.random.default_rng(3)
    for k in range(60):
        batch, seq = int(rng.integers(1, 65)), int(rng.integers(1, 129))
        mask = np.zeros((batch, seq), np.int64)
        for row in range(batch):
            mask[row, :rng.integers(max(1, seq // 4), seq + 1)] = 1
        feeds = {"input_ids": torch.from_numpy(rng.integers(0, 1024, (batch, seq))).cuda(),
                 "attention_mask": torch.from_numpy(mask).cuda()}
        got = next(iter(context.run(feeds).values())).float()
        assert got.shape[:2] == (batch, seq)
        if k % 6 == 0:
            with torch.inference_mode():
                want = module(**feeds).float()
            keep = feeds["attention_mask"] != 0
            torch.testing.assert_close(got[keep], want[keep], atol=FP16_ATOL, rtol=0, msg=f"{batch}x{seq}")
            assert not got[~keep].any(), f"{batch}x{seq}: zeros at padding"
    assert stats.captures == captured and stats.eager_runs == captured, (stats, stats.eager_reasons)
    assert stats.graphs <= 64 and stats.evictions == 0
