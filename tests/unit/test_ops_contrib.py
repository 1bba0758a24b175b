"""com.microsoft ops (kiln/ops/contrib_microsoft.py) against onnxruntime, their reference.

Each case builds a one-node model, draws fresh random inputs (seeded per case) and compares
every output of `kiln.build(model).run(feeds)` with onnxruntime's CPU kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import pytest
from onnx import helper

import kiln
from tests.unit import oracle
from tests.unit.oracle import case_node, case_rng, check, const, feeds, one_node_model, run_oracle

MS = "com.microsoft"
# (rtol, atol) per dtype. fp32: attention and normalisations sum dozens of products in a
# different order than onnxruntime's MLAS kernels (a few ulp each); integers compare exactly.
TOLERANCE = {np.dtype(np.float32): (1e-4, 1e-5), np.dtype(np.float16): (2e-3, 2e-3)}


@dataclass
class Case(oracle.Case):
    domain: str = MS  # the contrib ops; a few cases set "" for onnxruntime's ai.onnx extensions


def f32(*shape, lo=-1.0, hi=1.0):
    return lambda rng: rng.uniform(lo, hi, shape).astype(np.float32)


def f16(*shape, lo=-1.0, hi=1.0):
    return lambda rng: rng.uniform(lo, hi, shape).astype(np.float16)


def ints(lo, hi, *shape, dtype=np.int32):
    return lambda rng: rng.integers(lo, hi, shape).astype(dtype)


def ms_model(op: str, given: dict[str, np.ndarray], **attrs) -> onnx.ModelProto:
    """A com.microsoft node reading the arrays in `given` (in order), with one output y."""
    return one_node_model(helper.make_node(op, list(given), ["y"], domain=MS, **attrs), given)


# --- MatMulNBits weights ---------------------------------------------------------------------


def nbits_inputs(m, k, n, bits, block, *, zero_points=False, bias=False, batch=()):
    """A, packed B, scales (and zero points, bias): codes drawn uniformly over the 2^bits levels."""
    blocks = (k + block - 1) // block

    def pack(codes: np.ndarray) -> np.ndarray:  # [..., c] -> uint8 [..., c·bits/8], low bits first
        per_byte = 8 // bits
        codes = codes.reshape(*codes.shape[:-1], -1, per_byte).astype(np.uint16)
        return sum(codes[..., i] << (i * bits) for i in range(per_byte)).astype(np.uint8)

    def make(rng):
        codes = rng.integers(0, 1 << bits, (n, blocks, block))
        packed = pack(codes)  # [N, blocks, block·bits/8]
        scales = rng.uniform(0.01, 0.1, n * blocks).astype(np.float32)
        zp = None
        if zero_points:
            zp_codes = rng.integers(0, 1 << bits, (n, blocks))
            per_byte = 8 // bits
            padded = np.zeros((n, -(-blocks // per_byte) * per_byte), dtype=np.int64)
            padded[:, :blocks] = zp_codes
            zp = pack(padded)
        return [rng.uniform(-1, 1, (*batch, m, k)).astype(np.float32), packed, scales, zp, None,
                rng.uniform(-1, 1, n).astype(np.float32) if bias else None]

    return make


# --- Attention inputs -----------------------------------------------------------------------


def rotary_caches(max_pos, half):
    inv = 1.0 / (10000 ** (np.arange(half) / half))
    angles = np.arange(max_pos)[:, None] * inv[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def gqa_prompt(batch, seq, heads, kv_heads, head, *, packed=False, lengths=None, rotary=False, past_buffer=0,
               dtype=np.float32):
    """A first (prompt) GQA step; lengths: valid tokens per batch (right padding)."""
    def make(rng):
        return [v.astype(dtype) if v is not None and v.dtype == np.float32 else v for v in make_f32(rng)]

    def make_f32(rng):
        lens = np.asarray(lengths if lengths is not None else [seq] * batch, dtype=np.int32)
        q = rng.uniform(-1, 1, (batch, seq, heads * head)).astype(np.float32)
        k = rng.uniform(-1, 1, (batch, seq, kv_heads * head)).astype(np.float32)
        v = rng.uniform(-1, 1, (batch, seq, kv_heads * head)).astype(np.float32)
        cos, sin = rotary_caches(32, head // 2) if rotary else (None, None)
        past = None
        if past_buffer:
            past = np.zeros((batch, kv_heads, past_buffer, head), np.float32)
        qkv = [np.concatenate([q, k, v], axis=-1), None, None] if packed else [q, k, v]
        return [*qkv, past, past, lens - 1, np.asarray([seq], np.int32), cos, sin]
    return make


def gqa_decode(batch, heads, kv_heads, head, past_lengths, buffer, *, rotary=False, seq=1):
    """A decoding step: batch b has past_lengths[b] cached tokens in a [B, Nkv, buffer, H] cache."""
    def make(rng):
        lens = np.asarray(past_lengths, dtype=np.int32) + seq
        q = rng.uniform(-1, 1, (batch, seq, heads * head)).astype(np.float32)
        k = rng.uniform(-1, 1, (batch, seq, kv_heads * head)).astype(np.float32)
        v = rng.uniform(-1, 1, (batch, seq, kv_heads * head)).astype(np.float32)
        past_k = rng.uniform(-1, 1, (batch, kv_heads, buffer, head)).astype(np.float32)
        past_v = rng.uniform(-1, 1, (batch, kv_heads, buffer, head)).astype(np.float32)
        cos, sin = rotary_caches(64, head // 2) if rotary else (None, None)
        return [q, k, v, past_k, past_v, lens - 1, np.asarray([int(lens.max())], np.int32), cos, sin]
    return make


B, S, H = 2, 5, 16  # batch, sequence, hidden
CASES = [
    # normalisation
    Case("skip_ln", "SkipLayerNormalization", feeds(f32(B, S, H), f32(B, S, H), f32(H), f32(H), f32(H)),
         {"epsilon": 1e-5}, outputs=4),
    Case("skip_ln_2d_skip_no_beta", "SkipLayerNormalization", feeds(f32(B, S, H), f32(S, H), f32(H)), outputs=1),
    Case("skip_simplified_ln", "SkipSimplifiedLayerNormalization", feeds(f32(B, S, H), f32(B, S, H), f32(H), f32(H)),
         {"epsilon": 1e-6}, outputs=["y", "", "inv_std", "sum"]),
    Case("simplified_ln", "SimplifiedLayerNormalization", feeds(f32(B, S, H), f32(H)), {"epsilon": 1e-6},
         outputs=2, domain=""),
    Case("simplified_ln_axis", "SimplifiedLayerNormalization", feeds(f32(B, S, H), f32(S, H)), {"axis": 1}, domain=""),
    # onnxruntime's contrib LayerNormalization: ai.onnx before opset 17 made it standard
    Case("layer_norm_opset13", "LayerNormalization", feeds(f32(B, S, H), f32(H), f32(H)), {"epsilon": 1e-5},
         outputs=3, domain="", opset=13),
    Case("embed_ln", "EmbedLayerNormalization",
         feeds(ints(0, 50, B, S), ints(0, 2, B, S), f32(50, H), f32(16, H), f32(2, H), f32(H), f32(H),
               ints(0, 2, B, S)), {"epsilon": 1e-12}, outputs=3),
    Case("embed_ln_no_segment", "EmbedLayerNormalization",
         feeds(ints(0, 50, B, S), None, f32(50, H), f32(16, H), None, f32(H), f32(H)), outputs=2),
    # activations
    Case("gelu", "Gelu", feeds(f32(B, S, H, lo=-4, hi=4))),
    Case("bias_gelu", "BiasGelu", feeds(f32(B, S, H, lo=-4, hi=4), f32(H))),
    Case("fast_gelu", "FastGelu", feeds(f32(B, S, H, lo=-4, hi=4), f32(H))),
    Case("fast_gelu_no_bias", "FastGelu", feeds(f32(B, S, H, lo=-4, hi=4))),
    Case("quick_gelu", "QuickGelu", feeds(f32(B, S, H, lo=-4, hi=4)), {"alpha": 1.5}),
    Case("trilu_lower", "Trilu", feeds(f32(3, 6, 6), const(1, np.int64)), {"upper": 0}),
    # matmuls
    Case("attention_mask_3d", "Attention", feeds(f32(B, S, H), f32(H, 3 * H), f32(3 * H), ints(0, 2, B, S, S)),
         {"num_heads": 4}),
    Case("attention_mask_start_end", "Attention", feeds(f32(B, S, H), f32(H, 3 * H), f32(3 * H), const(
        [4, 5, 1, 0], np.int32)), {"num_heads": 4}),
    # 16-bit: statistics and softmax in fp32, as onnxruntime does
    Case("skip_ln_fp16", "SkipLayerNormalization", feeds(f16(B, S, H), f16(B, S, H), f16(H), f16(H), f16(H)),
         outputs=["y", "", "", "sum"]),
    Case("skip_simplified_ln_fp16", "SkipSimplifiedLayerNormalization", feeds(f16(B, S, H), f16(B, S, H), f16(H))),
    Case("fast_gelu_fp16", "FastGelu", feeds(f16(B, S, H, lo=-4, hi=4), f16(H))),
    Case("mha_fp16", "MultiHeadAttention", feeds(f16(B, S, H), f16(B, 7, H), f16(B, 7, H)), {"num_heads": 4}),
    Case("gqa_fp16_rotary", "GroupQueryAttention", gqa_prompt(B, S, 4, 2, 16, rotary=True, dtype=np.float16),
         {"num_heads": 4, "kv_num_heads": 2, "do_rotary": 1}, outputs=3),
    Case("fused_matmul", "FusedMatMul", feeds(f32(2, 3, 4, 5), f32(2, 3, 5, 6)), {"alpha": 0.5}),
    Case("fused_matmul_trans", "FusedMatMul", feeds(f32(2, 5, 4), f32(2, 6, 5)),
         {"alpha": 2.0, "transA": 1, "transB": 1}),
    Case("fused_matmul_trans_batch", "FusedMatMul", feeds(f32(3, 2, 5), f32(2, 5, 6)), {"transBatchA": 1}),
    Case("fused_matmul_trans_batch_and_a", "FusedMatMul", feeds(f32(3, 2, 4), f32(2, 3, 6)),
         {"transBatchA": 1, "transA": 1}),
    Case("fused_matmul_trans_batch_b", "FusedMatMul", feeds(f32(2, 4, 5), f32(6, 2, 5)),
         {"transBatchB": 1, "transB": 1}),
    Case("matmul_4bits", "MatMulNBits", nbits_inputs(3, 64, 8, 4, 32),
         {"K": 64, "N": 8, "bits": 4, "block_size": 32}),
    Case("matmul_4bits_zp_bias_ragged_k", "MatMulNBits", nbits_inputs(3, 40, 8, 4, 16, zero_points=True, bias=True,
                                                                    batch=(2,)),
         {"K": 40, "N": 8, "bits": 4, "block_size": 16}),
    Case("matmul_8bits_zp", "MatMulNBits", nbits_inputs(4, 64, 6, 8, 32, zero_points=True),
         {"K": 64, "N": 6, "bits": 8, "block_size": 32}),
    # attention
    Case("attention", "Attention", feeds(f32(B, S, H), f32(H, 3 * H), f32(3 * H)), {"num_heads": 4}),
    Case("attention_mask_2d", "Attention", feeds(f32(B, S, H), f32(H, 3 * H), f32(3 * H), const(
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.int32)), {"num_heads": 4}),
    Case("attention_mask_lengths", "Attention", feeds(f32(B, S, H), f32(H, 3 * H), f32(3 * H), const(
        [3, 5], np.int32)), {"num_heads": 2}),
    Case("attention_causal_past", "Attention",
         feeds(f32(B, S, H), f32(H, 3 * H), f32(3 * H), None, f32(2, B, 4, 3, 4)),
         {"num_heads": 4, "unidirectional": 1}, outputs=2),
    Case("attention_qkv_sizes_bias", "Attention",
         feeds(f32(B, S, H), f32(H, 16 + 16 + 8), f32(40), None, None, f32(B, 2, S, S)),
         {"num_heads": 2, "qkv_hidden_sizes": [16, 16, 8], "scale": 0.3}),
    Case("mha", "MultiHeadAttention", feeds(f32(B, S, H), f32(B, 7, H), f32(B, 7, H)), {"num_heads": 4}),
    Case("mha_bias_mask", "MultiHeadAttention",
         feeds(f32(B, S, H), f32(B, 7, H), f32(B, 7, H), f32(3 * H), const([[1] * 5 + [0] * 2, [1] * 7], np.int32)),
         {"num_heads": 4}),
    Case("mha_attention_bias_past", "MultiHeadAttention",
         feeds(f32(B, S, H), f32(B, S, H), f32(B, S, H), None, None, f32(1, 4, S, S + 3), f32(B, 4, 3, 4),
               f32(B, 4, 3, 4)),
         {"num_heads": 4}, outputs=3),
    Case("mha_bnsh_kv", "MultiHeadAttention", feeds(f32(B, S, H), f32(B, 4, 6, 4), f32(B, 4, 6, 4)),
         {"num_heads": 4}),
    Case("mha_causal", "MultiHeadAttention", feeds(f32(B, S, H), f32(B, S, H), f32(B, S, H)),
         {"num_heads": 2, "unidirectional": 1, "scale": 0.2}),
    Case("rotary_bsd", "RotaryEmbedding", lambda rng: [rng.uniform(-1, 1, (B, S, H)).astype(np.float32),
                                                       rng.integers(0, 20, (B, S)).astype(np.int64),
                                                       *rotary_caches(32, 2)], {"num_heads": 4}),
    Case("rotary_bnsh_offset_interleaved", "RotaryEmbedding",
         lambda rng: [rng.uniform(-1, 1, (B, 2, S, 8)).astype(np.float32), np.asarray([3], np.int64),
                      *rotary_caches(32, 4)], {"interleaved": 1}),
    Case("rotary_partial", "RotaryEmbedding",
         lambda rng: [rng.uniform(-1, 1, (B, S, H)).astype(np.float32), rng.integers(0, 20, (B, S)).astype(np.int64),
                      *rotary_caches(32, 1)], {"num_heads": 2, "rotary_embedding_dim": 2}),
    Case("gqa_prompt", "GroupQueryAttention", gqa_prompt(B, S, 4, 2, 8), {"num_heads": 4, "kv_num_heads": 2},
         outputs=3),
    Case("gqa_prompt_packed_rotary", "GroupQueryAttention", gqa_prompt(B, S, 4, 2, 16, packed=True, rotary=True),
         {"num_heads": 4, "kv_num_heads": 2, "do_rotary": 1}, outputs=3),
    Case("gqa_prompt_padded", "GroupQueryAttention", gqa_prompt(B, S, 4, 1, 8, lengths=[3, 5]),
         {"num_heads": 4, "kv_num_heads": 1}, outputs=1),
    Case("gqa_decode", "GroupQueryAttention", gqa_decode(B, 4, 2, 8, [3, 6], 6),
         {"num_heads": 4, "kv_num_heads": 2}, outputs=3),
    Case("gqa_decode_rotary_interleaved", "GroupQueryAttention", gqa_decode(B, 4, 2, 16, [2, 4], 8, rotary=True),
         {"num_heads": 4, "kv_num_heads": 2, "do_rotary": 1, "rotary_interleaved": 1}, outputs=3),
    Case("gqa_window_softcap", "GroupQueryAttention", gqa_prompt(B, 6, 4, 2, 8),
         {"num_heads": 4, "kv_num_heads": 2, "local_window_size": 3, "softcap": 2.0, "scale": 0.4}),
    Case("gqa_smooth_softmax", "GroupQueryAttention", gqa_prompt(B, S, 4, 2, 8),
         {"num_heads": 4, "kv_num_heads": 2, "smooth_softmax": 1}),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_op_matches_onnxruntime(case: Case):
    node, values = case_node(case, case.feeds(case_rng(case.id)))
    check(one_node_model(node, values, opset=case.opset, opsets={MS: 1}), values, TOLERANCE, label=case.id)


def test_bias_add():
    """onnxruntime has BiasAdd on CUDA only: check x + bias + skip directly."""
    rng = np.random.default_rng(7)
    given = {"x": rng.standard_normal((B, S, H), np.float32), "bias": rng.standard_normal(H, np.float32),
             "skip": rng.standard_normal((B, S, H), np.float32)}
    got = kiln.build(ms_model("BiasAdd", given)).run(given)["y"]
    np.testing.assert_allclose(got, given["x"] + given["bias"] + given["skip"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["packed_kv", "packed_qkv"])
def test_mha_packed_layouts(layout):
    """onnxruntime's CPU kernel has no packed layouts: compare with its result on the same Q/K/V unpacked."""
    rng = np.random.default_rng(11)
    heads, head, kv_len = 4, 4, S if layout == "packed_qkv" else 6
    q, k, v = (rng.uniform(-1, 1, (B, n, heads, head)).astype(np.float32) for n in (S, kv_len, kv_len))
    if layout == "packed_kv":
        given = {"query": q.reshape(B, S, heads * head), "key": np.stack([k, v], axis=3)}  # [B, L, N, 2, H]
    else:
        given = {"query": np.stack([q, k, v], axis=3)}  # [B, S, N, 3, H]
    got = kiln.build(ms_model("MultiHeadAttention", given, num_heads=heads)).run(given)["y"]
    flat = {"q": q.reshape(B, S, -1), "k": k.reshape(B, kv_len, -1), "v": v.reshape(B, kv_len, -1)}
    want = run_oracle(ms_model("MultiHeadAttention", flat, num_heads=heads), flat)[0]
    np.testing.assert_allclose(got, want, *TOLERANCE[np.dtype(np.float32)])
