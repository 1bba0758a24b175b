"""MatMul, Gemm, and the ops built around them: Attention (opset 23+), RotaryEmbedding,
LinearAttention, CausalConvWithState and ai.onnx.preview::FlexAttention.

Floating math runs in the input dtype for matmuls (the BLAS accumulates in fp32) and in
fp32 for the softmax/statistics of 16-bit inputs. Integer matmuls run in int64 on the CPU
(torch has no integer GEMM on CUDA, nor for the unsigned types) and wrap back.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kiln.ops._util import torch_dtype
from kiln.ops.reduction import accumulation_dtype
from kiln.ops.registry import register

_UNSIGNED_WIDE = (torch.uint16, torch.uint32, torch.uint64)


def _integer_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for integer tensors, with the wrap-around of the storage type."""
    out_dtype = torch.promote_types(a.dtype, b.dtype)

    def wide(t: torch.Tensor) -> torch.Tensor:
        t = t.cpu()
        if t.dtype == torch.uint64:
            return t.view(torch.int64)  # same bits; products wrap identically mod 2**64
        return t.to(torch.int64)

    out = torch.matmul(wide(a), wide(b))
    out = out.view(torch.uint64) if out_dtype == torch.uint64 else out.to(out_dtype)
    return out.to(a.device)


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.is_floating_point() or a.is_complex():
        return torch.matmul(a, b)
    if a.device.type == "cpu" and a.dtype not in _UNSIGNED_WIDE and a.dtype == b.dtype:
        return torch.matmul(a, b)
    return _integer_matmul(a, b)


@register("MatMul")
def matmul(ctx, a, b):
    return _matmul(a, b)


@register("Gemm")
def gemm(ctx, a, b, c=None, *, alpha=1.0, beta=1.0, transA=0, transB=0, broadcast=0):
    """Y = alpha · A' · B' + beta · C, A' = Aᵀ if transA, B' = Bᵀ if transB; C broadcasts to [M, N]."""
    if transA:
        a = a.transpose(0, 1)
    if transB:
        b = b.transpose(0, 1)
    if a.is_floating_point():
        if c is not None and beta != 0:
            return torch.addmm(c.to(a.dtype), a, b, beta=beta, alpha=alpha)
        y = torch.matmul(a, b)
        return y if alpha == 1.0 else y * alpha
    y = _matmul(a, b)
    if alpha != 1.0:
        y = (y.to(torch.float64) * alpha).to(y.dtype)
    if c is not None and beta != 0:
        y = y + (c if beta == 1.0 else (c.to(torch.float64) * beta).to(c.dtype))
    return y.to(a.dtype)


# --- Attention --------------------------------------------------------------------------


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, S, H·D] -> [B, H, S, D]."""
    b, s, hidden = x.shape
    return x.reshape(b, s, num_heads, hidden // num_heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] -> [B, S, H·D]."""
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b, s, h * d)


def _attention_bias(
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    q_len: int,
    kv_len: int,
    offset: int | torch.Tensor,  # scalar, or [B] per batch (external cache)
    left_window_size: int,
    right_window_size: int,
    nonpad_kv_seqlen: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """The additive bias (0 = attend, −inf = masked) broadcastable to [B, H, q, kv], or None.

    Causal and sliding-window masks are bottom-right aligned: query i sits at absolute
    position i + offset. `offset` is the past length (internal cache) or
    nonpad_kv_seqlen − q_len per batch (external cache).
    """
    bias = None
    if attn_mask is not None:
        pad = kv_len - attn_mask.shape[-1]
        if pad > 0:  # a mask shorter than the keys masks the rest
            attn_mask = F.pad(attn_mask, (0, pad), value=False if attn_mask.dtype == torch.bool else -math.inf)
        if attn_mask.dtype == torch.bool:
            zero = torch.zeros((), dtype=dtype, device=device)
            bias = torch.where(attn_mask, zero, torch.full((), -math.inf, dtype=dtype, device=device))
        else:
            bias = attn_mask.to(dtype)
    i = torch.arange(q_len, device=device).reshape(q_len, 1)
    j = torch.arange(kv_len, device=device).reshape(1, kv_len)
    if isinstance(offset, torch.Tensor):
        position = i + offset.to(device=device, dtype=torch.int64).reshape(-1, 1, 1, 1)  # [B, 1, q, 1]
    else:
        position = i + offset  # [q, 1]
    allowed = None
    if is_causal:
        allowed = j <= position
    if left_window_size >= 0:
        inside = position - j <= left_window_size
        allowed = inside if allowed is None else allowed & inside
    if right_window_size >= 0:
        inside = j - position <= right_window_size
        allowed = inside if allowed is None else allowed & inside
    if nonpad_kv_seqlen is not None:
        valid = j < nonpad_kv_seqlen.to(device=device, dtype=torch.int64).reshape(-1, 1, 1, 1)  # [B, 1, 1, kv]
        allowed = valid if allowed is None else allowed & valid
    if allowed is not None:
        structural = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, -math.inf)
        bias = structural if bias is None else bias + structural
    return bias


@register("Attention", min_opset=23)
def attention(ctx, q, k, v, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None, *,
              scale=None, is_causal=0, q_num_heads=None, kv_num_heads=None, softmax_precision=None,
              softcap=0.0, qk_matmul_output_mode=0, left_window_size=-1, right_window_size=-1):
    """softmax(Q·Kᵀ·scale [softcapped] + bias) · V with GQA, KV cache and masks.

    Outputs: Y, present_key/present_value (the past concatenated with K/V, [B, H, S, D])
    and, when asked for, qk_matmul_output at the stage qk_matmul_output_mode names
    (0 raw scores, 1 after softcap, 2 after the bias, 3 after softmax). A query row whose
    every key is masked gives zeros, not NaN.
    """
    three_d = q.dim() == 3
    if three_d:  # [B, S, H·D] -> [B, H, S, D]
        q = split_heads(q, q_num_heads)
        k = split_heads(k, kv_num_heads)
        v = split_heads(v, kv_num_heads)
    if past_key is not None:
        k = torch.cat([past_key, k], dim=2)
        v = torch.cat([past_value, v], dim=2)
    present_key, present_value = k, v
    batch, heads, q_len, head_size = q.shape
    kv_len = k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(head_size)

    compute = accumulation_dtype(q.dtype)
    if softmax_precision is not None and torch_dtype(softmax_precision) == torch.float64:
        compute = torch.float64
    if past_key is not None:
        offset: int | torch.Tensor = past_key.shape[2]
    elif nonpad_kv_seqlen is not None:
        offset = nonpad_kv_seqlen.to(torch.int64) - q_len
    else:
        offset = 0
    bias = _attention_bias(attn_mask, bool(is_causal), q_len, kv_len, offset, left_window_size,
                           right_window_size, nonpad_kv_seqlen, compute, q.device)
    if k.shape[1] != heads:  # grouped-query attention: KV head h serves query heads h·g ... h·g+g−1
        group = heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    # A fully masked row (bias all −inf) attends nothing and gives 0.
    fully_masked = None
    if bias is not None:
        fully_masked = torch.isneginf(bias.amax(dim=-1, keepdim=True)) if kv_len else None

    want_qk = ctx.num_outputs >= 4
    if not want_qk and softcap <= 0:
        y = F.scaled_dot_product_attention(  # q, k, v: [B, H, S, D]
            q.to(compute), k.to(compute), v.to(compute),
            attn_mask=None if bias is None else bias.expand(batch, heads, q_len, kv_len),
            scale=scale,
        )
        qk_output = None
    else:
        sqrt_scale = math.sqrt(scale)
        scores = torch.matmul(q.to(compute) * sqrt_scale, (k.to(compute) * sqrt_scale).transpose(-1, -2))
        qk_output = scores
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
            if qk_matmul_output_mode == 1:
                qk_output = scores
        if bias is not None:
            scores = scores + bias
        if qk_matmul_output_mode == 2:
            qk_output = scores
        probs = torch.softmax(scores, dim=-1)
        if fully_masked is not None:
            probs = torch.where(fully_masked, torch.zeros((), dtype=compute, device=q.device), probs)
        if qk_matmul_output_mode == 3:
            qk_output = probs
        y = torch.matmul(probs, v.to(compute))
    if fully_masked is not None:
        y = torch.where(fully_masked, torch.zeros((), dtype=y.dtype, device=y.device), y)
    y = y.to(q.dtype)
    if three_d:
        y = merge_heads(y)
    outputs = (y, present_key, present_value, None if qk_output is None else qk_output.to(q.dtype))
    return outputs[: max(ctx.num_outputs, 1)]


@register("FlexAttention", domain="ai.onnx.preview")
def flex_attention(ctx, q, k, v, *captured, scale=None, score_mod=None, prob_mod=None, softmax_precision=None):
    """softmax(score_mod(Q·Kᵀ·scale)) -> prob_mod -> · V; the mods are subgraphs on [B, H, L, S]."""
    heads, head_size = q.shape[1], q.shape[3]
    if scale is None:
        scale = 1.0 / math.sqrt(head_size)
    compute = torch_dtype(softmax_precision) if softmax_precision is not None else accumulation_dtype(q.dtype)
    if k.shape[1] != heads:
        group = heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    sqrt_scale = math.sqrt(scale)
    scores = torch.matmul((q * sqrt_scale).to(compute), (k * sqrt_scale).to(compute).transpose(-1, -2))
    outer = ctx.outer(captured)
    if score_mod is not None:
        scores = score_mod.run([scores], outer)[0].to(compute)
    probs = torch.softmax(scores, dim=-1)
    if prob_mod is not None:
        probs = prob_mod.run([probs], outer)[0].to(compute)
    return torch.matmul(probs, v.to(compute)).to(v.dtype)


# --- Rotary embedding -------------------------------------------------------------------


@register("RotaryEmbedding", min_opset=23)
def rotary_embedding(ctx, x, cos_cache, sin_cache, position_ids=None, *,
                     interleaved=0, rotary_embedding_dim=0, num_heads=0):
    """Rotate the first `rotary_embedding_dim` features of each head by the cached angles.

    x: [B, S, H·D] (needs num_heads) or [B, H, S, D]; caches: [max_pos, R/2] indexed by
    position_ids, or [B, S, R/2] when there are none. Pairs are (x[i], x[i + R/2]), or
    adjacent (x[2i], x[2i+1]) when interleaved.
    """
    original_shape = x.shape
    if x.dim() == 4:
        x = x.transpose(1, 2)  # [B, S, H, D]
    else:
        x = x.reshape(x.shape[0], x.shape[1], num_heads, -1)
    head_size = x.shape[-1]
    rot = rotary_embedding_dim or head_size
    if position_ids is not None:
        position_ids = position_ids.to(torch.int64)
        cos_cache, sin_cache = cos_cache[position_ids], sin_cache[position_ids]  # [B, S, R/2]
    compute = accumulation_dtype(x.dtype)
    cos = cos_cache.to(compute).unsqueeze(2)  # [B, S, 1, R/2]
    sin = sin_cache.to(compute).unsqueeze(2)
    x_rot, x_pass = x[..., :rot].to(compute), x[..., rot:]
    if interleaved:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
    else:
        x1, x2 = x_rot.chunk(2, dim=-1)
    real = cos * x1 - sin * x2
    imag = sin * x1 + cos * x2
    if interleaved:
        rotated = torch.stack([real, imag], dim=-1).reshape(x_rot.shape)
    else:
        rotated = torch.cat([real, imag], dim=-1)
    y = torch.cat([rotated.to(x.dtype), x_pass], dim=-1)
    if len(original_shape) == 4:
        return y.transpose(1, 2)
    return y.reshape(original_shape)


# --- Recurrent state ops (opset 27) -----------------------------------------------------


@register("LinearAttention", min_opset=27)
def linear_attention(ctx, query, key, value, past_state=None, decay=None, beta=None, *,
                     chunk_size=64, kv_num_heads, q_num_heads, scale=0.0, update_rule="gated_delta"):
    """Linear attention with a [B, H_kv, d_k, d_v] state, one token at a time, in fp32.

    Per step t: S ← S·exp(g_t) (gated), v_t ← β_t(v_t − Sᵀk_t) (delta), S ← S + k_t ⊗ v_t,
    o_t = scale · q_tᵀ S (each KV head's state read by its group of query heads).
    chunk_size is a tuning hint with no effect on the result.
    """
    if update_rule not in ("linear", "gated", "delta", "gated_delta"):
        raise ValueError(f"update_rule must be linear, gated, delta or gated_delta, got {update_rule!r}")
    gating = update_rule in ("gated", "gated_delta")
    delta = update_rule in ("delta", "gated_delta")
    if gating and decay is None:
        raise ValueError(f"update_rule {update_rule!r} needs the decay input")
    if delta and beta is None:
        raise ValueError(f"update_rule {update_rule!r} needs the beta input")
    b, t, _ = query.shape
    d_k = query.shape[-1] // q_num_heads
    d_v = value.shape[-1] // kv_num_heads
    group = q_num_heads // kv_num_heads
    f32 = torch.float32 if query.dtype != torch.float64 else torch.float64
    q4 = split_heads(query, q_num_heads).to(f32)  # [B, Hq, T, dk]
    k4 = split_heads(key, kv_num_heads).to(f32)  # [B, Hkv, T, dk]
    v4 = split_heads(value, kv_num_heads).to(f32)  # [B, Hkv, T, dv]
    if gating:
        if decay.shape[-1] == kv_num_heads:
            g4 = decay.reshape(b, t, kv_num_heads, 1).transpose(1, 2).to(f32)  # [B, Hkv, T, 1]
        else:
            g4 = split_heads(decay, kv_num_heads).to(f32)  # [B, Hkv, T, dk]
    if delta:
        beta4 = beta.reshape(b, t, beta.shape[-1], 1).transpose(1, 2).to(f32)  # [B, Hkv|1, T, 1]
    if past_state is not None:
        state_dtype = past_state.dtype
        state = past_state.to(f32)
    else:
        state_dtype = query.dtype
        state = torch.zeros(b, kv_num_heads, d_k, d_v, dtype=f32, device=query.device)
    scale_value = scale if scale else 1.0 / math.sqrt(d_k)
    outputs = []
    for i in range(t):
        k_t, v_t = k4[:, :, i], v4[:, :, i]  # [B, Hkv, dk], [B, Hkv, dv]
        if gating:
            state = state * torch.exp(g4[:, :, i]).unsqueeze(-1)
        if delta:
            retrieved = torch.einsum("bhdm,bhd->bhm", state, k_t)
            v_t = beta4[:, :, i] * (v_t - retrieved)
        state = state + k_t.unsqueeze(-1) * v_t.unsqueeze(-2)
        read = state.repeat_interleave(group, dim=1) if group > 1 else state
        outputs.append(scale_value * torch.einsum("bhd,bhdm->bhm", q4[:, :, i], read))
    out = torch.stack(outputs, dim=2) if outputs else torch.zeros(b, q_num_heads, 0, d_v, dtype=f32, device=query.device)
    return merge_heads(out).to(query.dtype), state.to(state_dtype)


@register("CausalConvWithState", min_opset=27)
def causal_conv_with_state(ctx, x, weight, bias=None, past_state=None, *, activation="none"):
    """Depthwise causal conv1d over [B, C, L] carrying the last k−1 inputs as state.

    The input is left-padded with past_state (zeros when absent); present_state is the
    last k−1 positions of that padded input. activation "silu"/"swish" applies x·σ(x).
    """
    if activation not in ("none", "silu", "swish"):
        raise ValueError(f"activation must be none, silu or swish, got {activation!r}")
    batch, channels, _ = x.shape
    width = weight.shape[2]
    if past_state is None:
        past_state = torch.zeros(batch, channels, width - 1, dtype=x.dtype, device=x.device)
    padded = torch.cat([past_state.to(x.dtype), x], dim=2)  # [B, C, L + k − 1]
    compute = accumulation_dtype(x.dtype)
    y = F.conv1d(padded.to(compute), weight.to(compute), None if bias is None else bias.to(compute),
                 groups=channels)
    if activation != "none":
        y = F.silu(y)
    present = padded.narrow(2, padded.shape[2] - (width - 1), width - 1)
    return y.to(x.dtype), present
