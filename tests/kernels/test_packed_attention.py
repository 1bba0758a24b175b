"""PackedAttention's CUDA tactic at the identity packing (every position a row, kiln/ops/tokens.py): kiln's Triton
flash kernel with the padding mask, on CPU tensors under Triton's interpreter, against the op's reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from kiln.ops.registry import OpContext  # noqa: E402
from kiln.ops.tokens import packed_attention, token_index  # noqa: E402
from kiln.plan.spec import StepSpec  # noqa: E402
from kiln.tactics import registry  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes

# fp16 against the fp32 reference: the kernel rounds the softmax probabilities to fp16 before p·v (about two
# ulps of the output scale, |v| ~ 1..4), tests/kernels/test_attention.py's reasoning
ATOL = 4e-3


def test_the_identity_packing_runs_the_masked_flash_kernel():
    rng = np.random.default_rng(0)
    batch, seq, heads, dim = 3, 24, 2, 16
    mask = torch.from_numpy((rng.random((batch, seq)) < 0.7).astype(np.int64))
    mask[1] = 0  # a row of padding only: its rows are 0, not NaN
    ctx = OpContext("attention", "PackedAttention", "kiln", num_inputs=7)
    index, scatter, cu_seqlens = token_index(ctx, mask, torch.empty(batch * seq, dtype=torch.uint8))
    assert torch.equal(index, torch.arange(batch * seq))  # B·S rows: the identity packing
    attrs = {"scale": dim ** -0.5, "q_perm": [0, 2, 1, 3], "k_perm": [0, 2, 1, 3], "v_perm": [0, 2, 1, 3],
             "out_perm": [0, 2, 1, 3], "q_num_heads": heads, "kv_num_heads": heads, "qkv_split": [heads * dim] * 3,
             "out_merge_heads": 1}
    qkv = torch.randn(batch * seq, 3 * heads * dim).half()  # [B·S, 3·H·D]
    step = StepSpec("PackedAttention", "attention", ["qkv", "", "", "m", "i", "s", "c"], ["o"], attrs, domain="kiln")
    registry.load_device("cuda")
    launch = registry.get("cuda.packed_attention.flash_varlen").prepare(step, [None] * 7, torch.device("cpu"))
    got = launch(ctx, qkv, None, None, mask, index, scatter, cu_seqlens, **attrs)  # [B·S, H·D]
    want = packed_attention(ctx, qkv.float(), None, None, mask, index, scatter, cu_seqlens, **attrs)
    assert got.shape == want.shape == (batch * seq, heads * dim)
    real = mask.reshape(-1) != 0  # padding queries' rows are dropped by the final unpack: only real ones count
    torch.testing.assert_close(got[real].float(), want[real], atol=ATOL, rtol=0)
    assert torch.isfinite(got).all()
