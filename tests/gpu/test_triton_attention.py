"""kiln's Triton flash attention on CUDA (`pytest tests/gpu/test_triton_attention.py -q`): correctness of every
default-build tactic at the benchmark's layer shapes against the op in fp32 (SDPA math), replayed in a CUDA
graph, and the kernel's edge cases (tails, masks, fully masked rows, GQA, odd head dims) at real sizes against
an fp32 reference. Timings: bench/attention.py. Skipped without CUDA.

Run it on its own, not in one pytest session with tests/kernels: that directory's conftest sets
TRITON_INTERPRET=1, which would run the kernel in the (CPU) interpreter.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "0",
                       reason="TRITON_INTERPRET is set (tests/kernels ran in this session): run tests/gpu alone"),
]
attention_kernels = pytest.importorskip("kiln.kernels.cuda.triton.attention", exc_type=ImportError)

from kiln.ops.fused import attention  # noqa: E402
from kiln.ops.tokens import key_lengths  # noqa: E402
from kiln.plan.spec import StepSpec  # noqa: E402
from kiln.tactics import registry  # noqa: E402
from kiln.builder.accuracy import TOLERANCE, mismatch  # noqa: E402
from kiln.tactics.tactic import InputMeta  # noqa: E402
from tests.gpu.common import capture, graph_replay  # noqa: E402

DEVICE = torch.device("cuda")
HEADS_LAST = [0, 2, 1, 3]
DEFAULT_BUILD = [t.name for t in registry.candidates("Attention", "kiln", "cuda", opt_level=2)
                 if t.name.startswith("cuda.attention.triton.")]


def randn(*shape, dtype=torch.float16):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def step(n_inputs: int, **attributes) -> StepSpec:
    return StepSpec(op_type="Attention", name="attention_0", inputs=[f"in{i}" for i in range(n_inputs)],
                    outputs=["out"], attributes=attributes, domain="kiln", opset=21)


def reference(s: StepSpec, args: list) -> torch.Tensor:
    """The op in fp32 with SDPA's math backend: the maths, not another fast kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]), torch.inference_mode():
        return attention(None, *[a.float() if a is not None and a.is_floating_point() else a for a in args],
                         **s.attributes)


def make_layer(name: str) -> tuple[StepSpec, list]:
    """The layer as kiln's optimizer hands it over: BERT/ViT/GPT-2 read q/k/v as column slices of the QKV
    GEMM output [B, S, 3·H·D]; Llama reads [B, S, H·D] q/k/v; all write [B, S, H·D]."""
    packed = dict(q_num_heads=12, kv_num_heads=12, q_perm=HEADS_LAST, k_perm=HEADS_LAST, v_perm=HEADS_LAST,
                  out_perm=HEADS_LAST, out_merge_heads=1, qkv_split=[768] * 3)
    if name == "bert_b64_s384_mask":
        lengths = torch.randint(192, 385, (64, 1, 1, 1), device=DEVICE)
        padding = torch.where(torch.arange(384, device=DEVICE).view(1, 1, 1, 384) < lengths, 0.0, -10000.0)
        return step(4, scale=0.125, **packed), [randn(64, 384, 2304), None, None, padding.half()]
    if name == "bert_b32_s512_key_lengths":  # the padding-free plain program on CUDA: key mask + KeyLengths
        padding = padding_mask(32, 512)
        key_mask = torch.where(padding == 0, torch.finfo(torch.float32).min, 0.0).half()[:, None, None, :]
        return step(5, scale=0.125, **packed), [randn(32, 512, 2304), None, None, key_mask, key_lengths(None, padding)]
    if name == "vit_b64_s197":
        return step(3, scale=0.125, **packed), [randn(64, 197, 2304), None, None]
    if name == "gpt2_b8_s512_causal":
        return step(3, scale=0.125, is_causal=1, **packed), [randn(8, 512, 2304), None, None]
    if name == "bert_b1_s128":
        return step(3, scale=0.125, **packed), [randn(1, 128, 2304), None, None]
    assert name == "llama_gqa_b4_s1024_causal_bf16"
    return (step(3, scale=128 ** -0.5, is_causal=1, gqa=1, q_num_heads=32, kv_num_heads=8, q_perm=HEADS_LAST,
                 k_perm=HEADS_LAST, v_perm=HEADS_LAST, out_perm=HEADS_LAST, out_merge_heads=1),
            [randn(4, 1024, n * 128, dtype=torch.bfloat16) for n in (32, 8, 8)])


def padding_mask(batch: int, seq: int) -> torch.Tensor:
    """[B, S] int64: right padding from random lengths in [1, S], and rows of length 1, S, 0 (all padding) and one with
    holes (its key length -1: the mask applies)."""
    lengths = torch.randint(1, seq + 1, (batch, 1), device=DEVICE)
    lengths[:3, 0] = torch.tensor([1, seq, 0])
    padding = (torch.arange(seq, device=DEVICE) < lengths).long()
    padding[3] = (torch.rand(seq, device=DEVICE) < 0.5).long()
    padding[3, 0] = padding[3, -1] = 1  # real tokens at both ends: not a prefix
    return padding


@pytest.mark.parametrize("layer", ["bert_b32_s512_key_lengths", "bert_b64_s384_mask", "vit_b64_s197",
                                   "gpt2_b8_s512_causal", "bert_b1_s128",
                                   "llama_gqa_b4_s1024_causal_bf16"])
def test_default_build_tactics_at_benchmark_layers(layer):
    torch.manual_seed(0)
    s, args = make_layer(layer)
    expected = reference(s, args)
    tolerance = {torch.float32: TOLERANCE[args[0].dtype]}  # the autotuner's bound for the storage dtype
    metas = [InputMeta.of(a, False) for a in args]
    ran = []
    for name in DEFAULT_BUILD:
        tactic = registry.get(name)
        if tactic.check(s, metas) is not True:
            continue
        launch = tactic.prepare(dataclasses.replace(s, tactic=name), [None] * len(args), DEVICE)
        with torch.inference_mode():
            eager = launch(None, *args, **s.attributes)
            replayed = graph_replay(lambda launch=launch: launch(None, *args, **s.attributes))
        problem = mismatch(eager.float(), expected, tolerance)
        assert problem is None, f"{name}: {problem}"
        assert torch.equal(eager, replayed), f"{name}: the CUDA-graph replay differs from the eager launch"
        assert eager.shape == expected.shape and eager.is_contiguous()
        ran.append(name)
    assert ran, f"no default-build Triton tactic supports {layer}"


CONFIG = attention_kernels.AttentionConfig(64, 64, num_warps=4, num_stages=3)


def fp32_reference(q, k, v, mask=None, *, scale, is_causal=False):
    group = q.shape[1] // k.shape[1]
    q, k, v = q.float(), k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=DEVICE).tril(), float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


def check(out, expected, dtype=torch.float16):
    rtol, atol = TOLERANCE[dtype]
    scale = expected.abs().max().item()
    error = (out.float() - expected).abs().max().item()
    assert error <= atol + rtol * scale, f"max error {error:.3g} > {atol} + {rtol} x {scale:.3g}"


def test_tails_bool_mask_and_fully_masked_rows():
    """ViT's 197 queries with a per-query bool mask [B, H, S, T] hiding every key of some rows."""
    q, k, v = randn(16, 12, 197, 64), randn(16, 12, 197, 64), randn(16, 12, 197, 64)
    allowed = torch.rand(16, 12, 197, 197, device=DEVICE) < 0.5
    allowed[3, 4, 100] = False
    allowed[7, :, 196] = False
    out = attention_kernels.flash_attention(q, k, v, allowed, scale=0.125, nan_to_zero=True, config=CONFIG)
    check(out, fp32_reference(q, k, v, allowed, scale=0.125))
    assert not out.isnan().any() and torch.equal(out[3, 4, 100], torch.zeros_like(out[3, 4, 100]))


@pytest.mark.parametrize("head_dim", [32, 80, 96, 128])
def test_head_dims(head_dim):
    q, k, v = randn(8, 8, 300, head_dim), randn(8, 8, 300, head_dim), randn(8, 8, 300, head_dim)
    check(attention_kernels.flash_attention(q, k, v, scale=head_dim ** -0.5, config=CONFIG),
          fp32_reference(q, k, v, scale=head_dim ** -0.5))


def test_causal_with_more_keys_than_queries_and_an_fp32_broadcast_mask():
    q, k, v = randn(4, 8, 100, 64), randn(4, 8, 300, 64), randn(4, 8, 300, 64)
    check(attention_kernels.flash_attention(q, k, v, scale=0.125, is_causal=True, config=CONFIG),
          fp32_reference(q, k, v, scale=0.125, is_causal=True))
    mask = torch.randn(1, 1, 100, 300, device=DEVICE) * 3
    mask[..., 250:] = -1e9  # -inf once rounded to fp16, as the op rounds it
    check(attention_kernels.flash_attention(q, k, v, mask, scale=0.125, config=CONFIG),
          fp32_reference(q, k, v, mask.half(), scale=0.125))


def test_many_batches_and_heads_use_every_grid_axis():
    """B = 1024, H = 16: 16384 (batch, head) pairs, on grid axes 1 and 2 (each limited to 65535)."""
    q, k, v = randn(1024, 16, 40, 64), randn(1024, 4, 40, 64), randn(1024, 4, 40, 64)
    check(attention_kernels.flash_attention(q, k, v, scale=0.125, config=CONFIG),
          fp32_reference(q, k, v, scale=0.125))


def masks_of(padding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(key lengths, the key mask with NaN on every row that has a length (a kernel reading it would show it), the
    key mask [B, 1, 1, S]: 0 at real keys, -inf at padding)."""
    lengths = key_lengths(None, padding)
    key_mask = torch.where(padding == 0, float("-inf"), 0.0).half()[:, None, None, :]
    return lengths, torch.where(lengths[:, None, None, None] >= 0, float("nan"), key_mask), key_mask


@pytest.mark.parametrize("config", attention_kernels.ATTENTION_CONFIGS, ids=lambda c: c.name)
def test_key_lengths_at_every_tile_and_replayed_with_other_lengths(config):
    """BERT-base 32x512 with key lengths (1, S, 0, -1 and random): each tile config against the fp32 reference on the
    key mask; then one CUDA graph captured with these lengths replays other ones (and another mask) written into the
    same tensors: nothing of them is read on the host."""
    torch.manual_seed(1)
    q, k, v = randn(32, 12, 512, 64), randn(32, 12, 512, 64), randn(32, 12, 512, 64)
    padding = padding_mask(32, 512)
    lengths, given, key_mask = masks_of(padding)
    assert lengths[:4].tolist() == [1, 512, 0, -1]

    def run():
        return attention_kernels.flash_attention(q, k, v, given, lengths, scale=0.125, config=config)

    with torch.inference_mode():
        check(run(), fp32_reference(q, k, v, key_mask, scale=0.125))
        graph, out = capture(run)
        other_lengths, other_given, other_key_mask = masks_of(padding.flip(0))
        lengths.copy_(other_lengths)
        given.copy_(other_given)
        graph.replay()
        torch.cuda.synchronize()
    check(out, fp32_reference(q, k, v, other_key_mask, scale=0.125))

