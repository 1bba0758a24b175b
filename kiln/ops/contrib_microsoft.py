"""com.microsoft ops: what onnxruntime's transformer optimizer and onnxscript's ort_fusions emit.

Semantics follow onnxruntime's docs/ContribOperators.md and its CPU kernels (the tests check
every op against onnxruntime on random inputs). The families:

- normalisation: SkipLayerNormalization, SkipSimplifiedLayerNormalization,
  EmbedLayerNormalization, and SimplifiedLayerNormalization (in ai.onnx, where onnxruntime
  puts it) — statistics in fp32;
- activations: Gelu, BiasGelu, FastGelu, QuickGelu, BiasAdd;
- matmuls: FusedMatMul, MatMulNBits (blocked 2/4/8-bit weights, dequantised on the fly);
- attention: Attention (packed QKV projection), MultiHeadAttention, GroupQueryAttention,
  RotaryEmbedding (position_ids before the caches, unlike ai.onnx's).

Masks are additive: onnxruntime adds `mask_filter_value` (-10000 by default) to masked
scores rather than -inf, so a fully masked row gives a uniform average, as it does there.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kiln.ops import indexing
from kiln.ops.matmul import merge_heads, split_heads
from kiln.ops.reduction import accumulation_dtype
from kiln.ops.registry import register

MS = "com.microsoft"


# --- Normalisation ----------------------------------------------------------------------


def _layer_norm(x: torch.Tensor, gamma, beta, epsilon: float, *, simplified: bool):
    """(y, mean, inv_std) over the last dim; statistics in fp32 (fp64 stays fp64)."""
    xf = x.to(accumulation_dtype(x.dtype))
    if simplified:  # RMS: no centring
        mean = None
        centred = xf
    else:
        mean = xf.mean(dim=-1, keepdim=True)
        centred = xf - mean
    inv_std = torch.rsqrt((centred * centred).mean(dim=-1, keepdim=True) + epsilon)
    y = centred * inv_std * gamma.to(xf.dtype)
    if beta is not None:
        y = y + beta.to(xf.dtype)
    return y.to(x.dtype), mean, inv_std


def _skip_norm_outputs(ctx, summed, y, mean, inv_std):
    """Outputs (output, mean, inv_std_var, input_skip_bias_sum), as many as the node has."""
    outputs = (y, mean, inv_std, summed)
    return outputs[0] if ctx.num_outputs <= 1 else outputs[: ctx.num_outputs]


@register("SkipLayerNormalization", domain=MS)
def skip_layer_normalization(ctx, x, skip, gamma, beta=None, bias=None, *, epsilon=1e-12):
    """s = x + skip + bias;  y = LayerNorm(s)·γ + β over the hidden (last) dim."""
    summed = x + skip  # skip: [B, S, H], [1, S, H] or [S, H]
    if bias is not None:
        summed = summed + bias
    y, mean, inv_std = _layer_norm(summed, gamma, beta, epsilon, simplified=False)
    return _skip_norm_outputs(ctx, summed, y, mean, inv_std)


@register("SkipSimplifiedLayerNormalization", domain=MS)
def skip_simplified_layer_normalization(ctx, x, skip, gamma, bias=None, *, epsilon=1e-12):
    """s = x + skip + bias;  y = s / √(mean(s²) + ε) · γ (RMSNorm with a residual)."""
    summed = x + skip
    if bias is not None:
        summed = summed + bias
    y, mean, inv_std = _layer_norm(summed, gamma, None, epsilon, simplified=True)
    return _skip_norm_outputs(ctx, summed, y, mean, inv_std)


def simplified_layer_normalization(ctx, x, scale, *, axis=-1, epsilon=1e-5, stash_type=1):
    """y = x / √(mean(x², dims [axis, rank)) + ε) · scale;  second output: the 1/√ term."""
    axis = axis + x.dim() if axis < 0 else axis
    dims = list(range(axis, x.dim()))
    xf = x.to(accumulation_dtype(x.dtype))
    inv_std = torch.rsqrt((xf * xf).mean(dim=dims, keepdim=True) + epsilon)
    y = (xf * inv_std * scale.to(xf.dtype)).to(x.dtype)
    return y if ctx.num_outputs <= 1 else (y, inv_std)[: ctx.num_outputs]


# onnxruntime registers it in the ai.onnx domain, as it does its LayerNormalization for
# opsets before 17 (kiln's ai.onnx LayerNormalization covers every opset).
register("SimplifiedLayerNormalization")(simplified_layer_normalization)


@register("EmbedLayerNormalization", domain=MS)
def embed_layer_normalization(ctx, input_ids, segment_ids, word_embedding, position_embedding,
                              segment_embedding=None, gamma=None, beta=None, mask=None, position_ids=None, *,
                              epsilon=1e-12, mask_index_type=1):
    """e = word[ids] + position[pos] + segment[seg];  y = LayerNorm(e)·γ + β.

    Outputs: y [B, S, H], mask_index [B] int32 (the count of 1s in each mask row: the key
    length the old Attention mask format expects) and the sum e before normalisation.
    """
    batch, seq = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(seq, device=input_ids.device).expand(batch, seq)
    else:
        position_ids = position_ids.to(torch.int64).expand(batch, seq)
    summed = word_embedding[input_ids.to(torch.int64)] + position_embedding[position_ids]
    if segment_embedding is not None and segment_ids is not None:
        summed = summed + segment_embedding[segment_ids.to(torch.int64)]
    y, _, _ = _layer_norm(summed, gamma, beta, epsilon, simplified=False)
    if mask is not None and mask_index_type == 1:
        mask_index = (mask != 0).sum(dim=1).to(torch.int32)
    else:
        mask_index = torch.zeros(batch, dtype=torch.int32, device=input_ids.device)
    outputs = (y, mask_index, summed)
    return outputs[0] if ctx.num_outputs <= 1 else outputs[: ctx.num_outputs]


# --- Activations ------------------------------------------------------------------------


@register("Gelu", domain=MS)
def gelu(ctx, x):
    """x·Φ(x) = ½x(1 + erf(x/√2))."""
    return F.gelu(x)


@register("BiasGelu", domain=MS)
def bias_gelu(ctx, x, bias):
    """Gelu(x + bias), erf form."""
    return F.gelu(x + bias)


@register("FastGelu", domain=MS)
def fast_gelu(ctx, x, bias=None):
    """½y(1 + tanh(√(2/π)(y + 0.044715y³))), y = x + bias."""
    return F.gelu(x if bias is None else x + bias, approximate="tanh")


@register("QuickGelu", domain=MS)
def quick_gelu(ctx, x, *, alpha=1.702):
    """x·σ(αx)."""
    return x * torch.sigmoid(alpha * x)


@register("BiasAdd", domain=MS)
def bias_add(ctx, x, bias, skip):
    """x + bias + skip (x, skip: [N, S, C]; bias: [C])."""
    return x + bias + skip


register("Trilu", domain=MS)(indexing.trilu)


# --- Matmuls ----------------------------------------------------------------------------


def _transpose_batch(x: torch.Tensor) -> torch.Tensor:
    """[d0, d1, ..., dn-2, dn-1] -> [d1, ..., dn-2, d0, dn-1]: the first dim joins the matrix rows."""
    if x.dim() <= 2:
        return x
    return x.permute(*range(1, x.dim() - 1), 0, x.dim() - 1)


@register("FusedMatMul", domain=MS)
def fused_matmul(ctx, a, b, *, alpha=1.0, transA=0, transB=0, transBatchA=0, transBatchB=0):
    """alpha · op(A) @ op(B), op = optional batch-transpose then optional swap of the last two dims."""
    if transBatchA:
        a = _transpose_batch(a)
    if transBatchB:
        b = _transpose_batch(b)
    if transA:
        a = a.transpose(-1, -2) if a.dim() >= 2 else a
    if transB:
        b = b.transpose(-1, -2) if b.dim() >= 2 else b
    y = torch.matmul(a, b)
    return y if alpha == 1.0 else y * alpha


def _unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., n] -> uint8 [..., n·8/bits], the low bits of each byte first."""
    per_byte = 8 // bits
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)  # [per_byte]
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)


def dequantize_nbits(b, scales, zero_points, g_idx, *, K, N, bits, block_size, dtype) -> torch.Tensor:
    """MatMulNBits weights -> W [N, K] in `dtype`: W[n, k] = (q[n, k] - zp[n, block(k)]) · scale[n, block(k)]."""
    blocks = (K + block_size - 1) // block_size
    q = _unpack_bits(b.reshape(N, -1), bits)[:, : blocks * block_size].to(dtype)  # [N, blocks·block_size]
    scales = scales.reshape(N, blocks).to(dtype)
    if zero_points is None:
        zp = torch.full((), float(1 << (bits - 1)), dtype=dtype, device=b.device)
    elif zero_points.dtype == torch.uint8:
        zp = _unpack_bits(zero_points.reshape(N, -1), bits)[:, :blocks].to(dtype)  # [N, blocks]
    else:  # float zero points (HQQ): same shape as scales
        zp = zero_points.reshape(N, blocks).to(dtype)
    if g_idx is not None and g_idx.numel() == K:  # act-order: column k belongs to block g_idx[k]
        group = g_idx.to(torch.int64)
        scale_k = scales[:, group]
        zp_k = zp[:, group] if zp.dim() == 2 else zp
        return (q[:, :K] - zp_k) * scale_k
    q = q.reshape(N, blocks, block_size)
    zp = zp.unsqueeze(-1) if zp.dim() == 2 else zp
    w = (q - zp) * scales.unsqueeze(-1)  # [N, blocks, block_size]
    return w.reshape(N, blocks * block_size)[:, :K]


@register("MatMulNBits", domain=MS)
def matmul_nbits(ctx, a, b, scales, zero_points=None, g_idx=None, bias=None, *, K, N, bits=4, block_size,
                 accuracy_level=0):
    """Y = A @ Wᵀ (+ bias) with W [N, K] stored as `bits`-bit codes in blocks of `block_size` along K.

    B: uint8 [N, blocks, block_size·bits/8]; scales: [N·blocks]; zero_points: packed uint8
    [N, ⌈blocks·bits/8⌉] or float like scales; default zero point 2^(bits-1).
    """
    if bits not in (2, 4, 8):
        raise ValueError(f"MatMulNBits node {ctx.name!r}: bits={bits} is not supported (2, 4 or 8)")
    compute = accumulation_dtype(a.dtype) if a.device.type == "cpu" else a.dtype
    w = dequantize_nbits(b, scales, zero_points, g_idx, K=K, N=N, bits=bits, block_size=block_size, dtype=compute)
    y = F.linear(a.to(compute), w, None if bias is None else bias.to(compute))  # [..., K] -> [..., N]
    return y.to(a.dtype)


# --- Attention --------------------------------------------------------------------------


def _attend(q, k, v, bias, scale: float, *, softcap: float = 0.0, sink: torch.Tensor | None = None,
            want_qk: bool = False):
    """softmax(q·kᵀ·scale [softcapped] + bias [+ sink column])·v in fp32 for 16-bit inputs.

    q: [B, N, S, H]; k, v: [B, Nkv, T, H] (Nkv divides N); bias: additive, broadcastable to
    [B, N, S, T]; sink: [N] logits of an extra key with a zero value (smooth softmax / head sink).
    Returns (y [B, N, S, Hv], scores or None).
    """
    heads = q.shape[1]
    if k.shape[1] != heads:  # grouped-query: KV head h serves query heads h·g ... h·g+g-1
        group = heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    compute = accumulation_dtype(q.dtype)
    q, k, v = q.to(compute), k.to(compute), v.to(compute)
    if bias is not None:
        bias = bias.to(compute)
    if not want_qk and softcap <= 0 and sink is None:
        if bias is not None:
            bias = bias.expand(q.shape[0], heads, q.shape[2], k.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale), None
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, N, S, T]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias
    qk = scores
    if sink is not None:
        sink_column = sink.to(compute).reshape(1, heads, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v), qk


def _causal_bias(q_len: int, kv_len: int, offset, fill: float, device, *, window: int = -1) -> torch.Tensor:
    """Additive [.., q, kv] mask: query i (absolute position i + offset) sees keys j <= i + offset.

    offset: an int, or a [B] tensor (then the result is [B, 1, q, kv]); window > 0 also hides
    keys more than window - 1 positions back.
    """
    i = torch.arange(q_len, device=device).reshape(q_len, 1)
    j = torch.arange(kv_len, device=device).reshape(1, kv_len)
    position = i + (offset.to(device).reshape(-1, 1, 1, 1) if isinstance(offset, torch.Tensor) else offset)
    hidden = j > position
    if window > 0:
        hidden = hidden | (j <= position - window)
    return torch.zeros(hidden.shape, device=device).masked_fill(hidden, fill)


def _key_mask_bias(mask: torch.Tensor, batch: int, q_len: int, kv_len: int, past: int, fill: float):
    """Attention's mask_index (every documented layout) -> additive bias [B, 1, S|1, T]."""
    device = mask.device
    j = torch.arange(kv_len, device=device)
    if mask.dim() == 1:
        if mask.shape[0] == batch:  # right padding: key lengths
            hidden = j.reshape(1, -1) >= mask.to(torch.int64).reshape(-1, 1)
        elif mask.shape[0] == 2 * batch:  # end positions, then start positions
            end, start = mask[:batch].to(torch.int64), mask[batch:].to(torch.int64)
            hidden = (j.reshape(1, -1) >= end.reshape(-1, 1)) | (j.reshape(1, -1) < start.reshape(-1, 1))
        else:
            raise ValueError(f"mask_index of shape {list(mask.shape)}: expected [{batch}] or [{2 * batch}]")
        hidden = hidden[:, None, None, :]
    elif mask.dim() == 2:  # [B, T] of 1 (keep) / 0 (mask)
        hidden = (mask == 0)[:, None, None, :]
    elif mask.dim() == 3:  # [B, S, T]
        hidden = (mask == 0)[:, None, :, :]
    elif mask.dim() == 4:  # [B, 1, max, max]: the causal-style block for these positions
        hidden = (mask[:, :, past : past + q_len, :kv_len] == 0)
    else:
        raise ValueError(f"mask_index of rank {mask.dim()} is not a documented layout")
    return torch.zeros(hidden.shape, device=device).masked_fill(hidden, fill)


def _add(a, b):
    return b if a is None else a + b


def _mask_bias(key_mask, attention_bias, unidirectional: int, batch: int, q_len: int, kv_len: int, past: int,
               fill: float, device) -> torch.Tensor | None:
    """Attention's and MultiHeadAttention's additive bias: key mask + causal mask + attention_bias."""
    bias = None
    if key_mask is not None:
        bias = _key_mask_bias(key_mask, batch, q_len, kv_len, past, fill)
    if unidirectional:
        bias = _add(bias, _causal_bias(q_len, kv_len, past, fill, device))
    if attention_bias is not None:
        bias = _add(bias, attention_bias)
    return bias


@register("Attention", domain=MS)
def attention(ctx, x, weights, bias=None, mask_index=None, past=None, attention_bias=None,
              past_sequence_length=None, *, num_heads, qkv_hidden_sizes=None, unidirectional=0,
              mask_filter_value=-10000.0, scale=0.0, do_rotary=0, rotary_embedding_dim=0,
              past_present_share_buffer=0):
    """Multi-head self-attention with the QKV projection inside: [q|k|v] = x·W + bias.

    x: [B, S, D_in]; weights: [D_in, Dq + Dk + Dv]; past/present: [2, B, N, P(+S), H].
    """
    if do_rotary:
        raise ValueError(f"Attention node {ctx.name!r}: do_rotary=1 is not supported; use RotaryEmbedding nodes")
    if past_present_share_buffer:
        raise ValueError(f"Attention node {ctx.name!r}: past_present_share_buffer=1 is not supported")
    qkv = torch.matmul(x, weights)
    if bias is not None:
        qkv = qkv + bias
    sizes = list(qkv_hidden_sizes) if qkv_hidden_sizes else [qkv.shape[-1] // 3] * 3
    q, k, v = (split_heads(t, num_heads) for t in torch.split(qkv, sizes, dim=-1))  # [B, N, S, H]
    past_len = 0
    if past is not None and past.numel():
        past_len = past.shape[3]
        k = torch.cat([past[0], k], dim=2)
        v = torch.cat([past[1], v], dim=2)
    batch, _, seq, head_size = q.shape
    total = k.shape[2]
    bias_total = _mask_bias(mask_index, attention_bias, unidirectional, batch, seq, total, past_len,
                            mask_filter_value, q.device)
    y, _ = _attend(q, k, v, bias_total, scale or 1.0 / math.sqrt(head_size))
    y = merge_heads(y.to(x.dtype))
    if ctx.num_outputs <= 1:
        return y
    return y, torch.stack([k, v])


@register("MultiHeadAttention", domain=MS)
def multi_head_attention(ctx, query, key=None, value=None, bias=None, key_padding_mask=None, attention_bias=None,
                         past_key=None, past_value=None, past_sequence_length=None, cache_indirection=None, *,
                         num_heads, mask_filter_value=-10000.0, scale=0.0, unidirectional=0):
    """Attention on projected Q/K/V (+ optional packed bias), with KV cache and masks.

    query: [B, S, D] or packed QKV [B, S, N, 3, H]; key/value: [B, L, D], already-split
    [B, N, L, H] (cross-attention cache, no bias or past), or key packed KV [B, L, N, 2, H].
    Outputs: output [B, S, Dv], present_key/value [B, N, P+L, H], qk scores.
    """
    if cache_indirection is not None:
        raise ValueError(f"MultiHeadAttention node {ctx.name!r}: cache_indirection (beam search) is not supported")
    batch, seq = query.shape[:2]
    if query.dim() == 5:  # packed QKV
        q, k, v = query.unbind(dim=3)  # [B, S, N, H] each
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    else:
        if bias is not None:
            dq = query.shape[-1]
            bq, bk, bv = bias[:dq], bias[dq : 2 * dq], bias[2 * dq :]
            query = query + bq
        q = split_heads(query, num_heads)
        if key.dim() == 5:  # packed KV [B, L, N, 2, H]
            k, v = (t.transpose(1, 2) for t in key.unbind(dim=3))
        elif key.dim() == 4:  # [B, N, L, H]
            k, v = key, value
        else:
            if bias is not None:
                key, value = key + bk, value + bv
            k, v = split_heads(key, num_heads), split_heads(value, num_heads)
    past_len = 0
    if past_key is not None and past_key.numel() and key is not None and key.dim() == 3:
        past_len = past_key.shape[2]
        k = torch.cat([past_key, k], dim=2)
        v = torch.cat([past_value, v], dim=2)
    total = k.shape[2]
    bias_total = _mask_bias(key_padding_mask, attention_bias, unidirectional, batch, seq, total, past_len,
                            mask_filter_value, q.device)
    y, qk = _attend(q, k, v, bias_total, scale or 1.0 / math.sqrt(q.shape[-1]), want_qk=ctx.num_outputs >= 4)
    y = merge_heads(y.to(query.dtype))
    outputs = (y, k, v, None if qk is None else qk.to(query.dtype))
    return y if ctx.num_outputs <= 1 else outputs[: ctx.num_outputs]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: int) -> torch.Tensor:
    """Rotary embedding of x [B, N, S, H] with cos/sin [B, S, R/2]; features past R pass through."""
    rot = cos.shape[-1] * 2
    compute = accumulation_dtype(x.dtype)
    cos, sin = cos.to(compute).unsqueeze(1), sin.to(compute).unsqueeze(1)  # [B, 1, S, R/2]
    x_rot, x_pass = x[..., :rot].to(compute), x[..., rot:]
    x1, x2 = (x_rot[..., 0::2], x_rot[..., 1::2]) if interleaved else x_rot.chunk(2, dim=-1)
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    rotated = torch.stack([real, imag], dim=-1).flatten(-2) if interleaved else torch.cat([real, imag], dim=-1)
    return torch.cat([rotated.to(x.dtype), x_pass], dim=-1)


@register("RotaryEmbedding", domain=MS)
def rotary_embedding(ctx, x, position_ids, cos_cache, sin_cache, *, interleaved=0, is_packed_batching=0,
                     num_heads=0, rotary_embedding_dim=0, scale=1.0):
    """com.microsoft order: (input, position_ids, cos_cache, sin_cache).

    x: [B, S, N·H] or [B, N, S, H]; position_ids: [B, S], or one offset (positions offset + s);
    caches: [max_pos, R/2]. R = rotary_embedding_dim, or the head size.
    """
    if is_packed_batching:
        raise ValueError(f"RotaryEmbedding node {ctx.name!r}: is_packed_batching=1 is not supported")
    four_d = x.dim() == 4
    batch, seq = (x.shape[0], x.shape[2]) if four_d else x.shape[:2]
    if position_ids.numel() == 1:  # an offset into the cache
        position_ids = position_ids.reshape(1, 1).to(torch.int64) + torch.arange(seq, device=x.device)
    position_ids = position_ids.to(torch.int64).expand(batch, seq)
    if four_d:
        heads = x
    else:
        if not num_heads:
            num_heads = x.shape[-1] // (rotary_embedding_dim or cos_cache.shape[-1] * 2)
        heads = split_heads(x, num_heads)
    rot = rotary_embedding_dim or heads.shape[-1]
    cos, sin = cos_cache[position_ids][..., : rot // 2], sin_cache[position_ids][..., : rot // 2]
    y = _rotate(heads, cos, sin, interleaved)
    return y if four_d else merge_heads(y)


@register("GroupQueryAttention", domain=MS)
def group_query_attention(ctx, query, key=None, value=None, past_key=None, past_value=None, seqlens_k=None,
                          total_sequence_length=None, cos_cache=None, sin_cache=None, position_ids=None,
                          attention_bias=None, head_sink=None, *, num_heads, kv_num_heads, do_rotary=0,
                          local_window_size=-1, rotary_interleaved=0, scale=0.0, smooth_softmax=0, softcap=0.0,
                          qk_output=0):
    """Causal grouped-query attention over a KV cache with per-batch lengths.

    query: [B, S, N·H] or packed [B, S, (N + 2·Nkv)·H] (no key/value); past_key/value:
    [B, Nkv, P, H]; seqlens_k: [B] int32, each batch's total length − 1. The new tokens of
    batch b sit at positions [seqlens_k[b] + 1 − S, seqlens_k[b] + 1): the prompt (first run)
    is right-padded, later steps append after each batch's own past.
    """
    batch, seq, _ = query.shape
    if key is None:  # packed QKV
        head_size = query.shape[-1] // (num_heads + 2 * kv_num_heads)
        query, key, value = torch.split(query, [num_heads * head_size, kv_num_heads * head_size,
                                                kv_num_heads * head_size], dim=-1)
    q = split_heads(query, num_heads)  # [B, N, S, H]
    k, v = split_heads(key, kv_num_heads), split_heads(value, kv_num_heads)  # [B, Nkv, S, H]
    head_size = q.shape[-1]
    total = int(total_sequence_length.reshape(-1)[0])
    lengths = seqlens_k.to(torch.int64).reshape(batch) + 1  # valid length of each batch after this step
    past_buffer = past_key.shape[2] if past_key is not None else 0
    first_prompt = past_buffer == 0 or total == seq  # no past: positions start at 0 for every batch
    starts = torch.zeros_like(lengths) if first_prompt else lengths - seq  # [B] absolute position of token 0
    if do_rotary:
        if position_ids is None:
            position_ids = starts.reshape(-1, 1) + torch.arange(seq, device=q.device)  # [B, S]
        position_ids = position_ids.to(torch.int64)
        cos, sin = cos_cache[position_ids], sin_cache[position_ids]  # [B, S, R/2]
        q, k = _rotate(q, cos, sin, rotary_interleaved), _rotate(k, cos, sin, rotary_interleaved)
    present_len = max(past_buffer, total)
    if first_prompt:
        present_k, present_v = k, v
        if present_len > seq:
            pad = (0, 0, 0, present_len - seq)
            present_k, present_v = F.pad(k, pad), F.pad(v, pad)
    else:  # each batch's new tokens go after its own past; the cache past that is stale and reads 0
        p = torch.arange(present_len, device=q.device).reshape(1, present_len)
        relative = p - starts.reshape(-1, 1)  # [B, P]: position relative to the first new token
        source = relative.clamp(0, seq - 1)[:, None, :, None].expand(batch, kv_num_heads, present_len, head_size)
        is_past = (relative < 0)[:, None, :, None]
        is_new = ((relative >= 0) & (relative < seq))[:, None, :, None]

        def merge(past: torch.Tensor, new: torch.Tensor) -> torch.Tensor:  # -> [B, Nkv, P, H]
            past = F.pad(past, (0, 0, 0, present_len - past_buffer)) if present_len > past_buffer else past
            fresh = torch.where(is_new, new.gather(2, source), torch.zeros((), dtype=new.dtype, device=new.device))
            return torch.where(is_past, past[:, :, :present_len], fresh)

        present_k, present_v = merge(past_key, k), merge(past_value, v)
    # query i of batch b sits at starts[b] + i; it sees keys j <= that, and j < lengths[b]
    i = torch.arange(seq, device=q.device).reshape(1, 1, seq, 1)
    j = torch.arange(present_len, device=q.device).reshape(1, 1, 1, present_len)
    position = starts.reshape(-1, 1, 1, 1) + i  # [B, 1, S, 1]
    hidden = (j > position) | (j >= lengths.reshape(-1, 1, 1, 1))
    if local_window_size > 0:
        hidden = hidden | (j <= position - local_window_size)
    bias = torch.zeros(hidden.shape, device=q.device).masked_fill(hidden, -math.inf)
    if attention_bias is not None:
        bias = bias + attention_bias.to(bias.dtype)
    sink = head_sink if head_sink is not None else (
        torch.zeros(num_heads, device=q.device) if smooth_softmax else None)
    y, qk = _attend(q, present_k, present_v, bias, scale or 1.0 / math.sqrt(head_size), softcap=softcap, sink=sink,
                    want_qk=ctx.num_outputs >= 4)
    y = merge_heads(y.to(query.dtype))
    outputs = (y, present_k, present_v, None if qk is None else qk.to(query.dtype))
    return y if ctx.num_outputs <= 1 else outputs[: ctx.num_outputs]
