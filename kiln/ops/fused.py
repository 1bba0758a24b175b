"""kiln-domain fused ops that the optimizer emits (domain "kiln").

Each op stands for a subgraph of ONNX ops (kiln/passes/fusion/ says which); the docstring
gives the maths. The epilogue of FusedConv/FusedGemm is shared:

    y = layer(x) + bias
    y = act(y) + residual        (residual_after_activation = 1, e.g. MobileNetV2, BERT)
    y = act(y + residual)        (residual_after_activation = 0, e.g. ResNet)

FusedConv may apply a second activation to that sum, final_activation (final_alpha, final_beta):
    y = final_act(act(y) + residual)   (a TCN block: relu(relu(conv2(h)) + x))

In-place epilogue ops reuse the layer's output buffer: no intermediate touches memory twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ir import dtypes

from kiln.ops.nn import _conv_params, _pad_spatial, convolution
from kiln.ops.registry import register


def _activate_(y: torch.Tensor, activation: str, alpha: float, beta: float) -> torch.Tensor:
    """act(y), in place where torch has an in-place form."""
    if activation == "":
        return y
    if activation == "Relu":
        return y.relu_()
    if activation == "Clip":  # alpha = min, beta = max
        return y.clamp_(alpha, beta)
    if activation == "Sigmoid":
        return y.sigmoid_()
    if activation == "SiLU":  # x * sigmoid(x)
        return F.silu(y, inplace=True)
    if activation == "Tanh":
        return y.tanh_()
    if activation == "Gelu":
        return F.gelu(y)
    if activation == "GeluTanh":
        return F.gelu(y, approximate="tanh")
    if activation == "LeakyRelu":
        return F.leaky_relu_(y, alpha)
    if activation == "HardSigmoid":  # max(0, min(1, alpha*x + beta))
        return y.mul_(alpha).add_(beta).clamp_(0.0, 1.0)
    if activation == "HardSwish":
        return F.hardswish(y, inplace=True)
    raise ValueError(f"unknown fused activation {activation!r}")


def _epilogue(y, residual, activation, alpha, beta, residual_after_activation):
    if residual is not None and not residual_after_activation:
        y = y.add_(residual) if y.shape == residual.shape else y + residual
    y = _activate_(y, activation, alpha, beta)
    if residual is not None and residual_after_activation:
        y = y.add_(residual) if y.shape == residual.shape else y + residual
    return y


@register("FusedConv", domain="kiln")
def fused_conv(ctx, x, w, b=None, residual=None, *, auto_pad="NOTSET", dilations=None, group=1,
               kernel_shape=None, pads=None, strides=None, activation="", alpha=0.0, beta=0.0,
               residual_after_activation=0, final_activation="", final_alpha=0.0, final_beta=0.0):
    """Conv(x, W, b) followed by the shared epilogue (activation and/or residual Add), then final_activation."""
    n = x.dim() - 2
    kernel = list(kernel_shape) if kernel_shape else list(w.shape[2:])
    strides, dilations, pads = _conv_params(x, kernel, auto_pad, dilations, pads, strides)
    if pads[:n] == pads[n:]:  # symmetric: let the convolution pad, no copy of x
        y = convolution(x, w, b, stride=strides, padding=pads[:n], dilation=dilations, groups=group)
    else:
        y = convolution(_pad_spatial(x, pads[:n], pads[n:]), w, b, stride=strides, dilation=dilations, groups=group)
    y = _epilogue(y, residual, activation, alpha, beta, residual_after_activation)
    return _activate_(y, final_activation, final_alpha, final_beta)


@register("FusedGemm", domain="kiln")
def fused_gemm(ctx, x, w, b=None, residual=None, *, activation="", alpha=0.0, beta=0.0,
               residual_after_activation=1, output_float32=0):
    """x @ Wᵀ + b (W stored [N, K], pre-transposed at build, as torch.nn.functional.linear wants).

    activation "SwiGLU" (gate and up GEMMs of a gated MLP, W = [W_gate; W_up]) halves the last dim:
    y = silu(h[..., :H]) * h[..., H:], h = x @ Wᵀ + b, H = half of h's last dim; a residual, if any,
    is added to y. output_float32 (a half-precision engine's layer writing its fp32 output, set by
    kiln/builder/precision.py): the product and epilogue of the half inputs in fp32, stored fp32, where the
    boundary would have cast the half result (a GEMM accumulates in fp32: its sums, not rounded to half).
    """
    if output_float32:
        x, w = x.float(), w.float()
        b, residual = (None if t is None else t.float() for t in (b, residual))
    y = F.linear(x, w, b)  # x: [..., K], w: [N, K] -> y: [..., N]
    if activation == "SwiGLU":
        gate, up = y.chunk(2, dim=-1)  # [..., N/2] each, views of y
        y = F.silu(gate).mul_(up)  # a new [..., N/2] tensor: not in place
        return _epilogue(y, residual, "", alpha, beta, 1)  # the residual, if any, after the gating
    return _epilogue(y, residual, activation, alpha, beta, residual_after_activation)


@register("SqueezeExcite", domain="kiln")
def squeeze_excite(ctx, x, w1, b1=None, w2=None, b2=None, *, activation="", alpha=0.0, beta=0.0, gate="Sigmoid",
                   gate_alpha=0.0, gate_beta=0.0):
    """Squeeze-and-excitation: y = x · gate(W2 act(W1 mean(x) + b1) + b2), the mean over x's spatial dims,
    one gate value per (image, channel). w1 [R, C], w2 [C, R]; act and gate are epilogue activations
    (gate: Sigmoid or HardSigmoid, its alpha/beta those of ONNX HardSigmoid)."""
    s = x.mean(dim=tuple(range(2, x.dim())), dtype=torch.float32)  # [N, C], fp32 statistics
    h = _activate_(F.linear(s, w1.float(), None if b1 is None else b1.float()), activation, alpha, beta)  # [N, R]
    g = _activate_(F.linear(h, w2.float(), None if b2 is None else b2.float()), gate, gate_alpha, gate_beta)  # [N, C]
    return x * g.to(x.dtype).reshape(*g.shape, *([1] * (x.dim() - 2)))


@register("Gelu", domain="kiln")
def gelu(ctx, x, *, approximate="none"):
    """none: x·Φ(x) = x·½(1 + erf(x/√2));  tanh: ½x(1 + tanh(√(2/π)(x + 0.044715x³)))."""
    return F.gelu(x, approximate=approximate)


@register("LayerNorm", domain="kiln")
def layer_norm(ctx, x, scale=None, bias=None, residual=None, *, axis=-1, epsilon=1e-5):
    """(s - mean) / sqrt(var + ε) · scale + bias over the dims from `axis` on (fp32 statistics),
    s = x + residual (skip-LayerNorm; residual may broadcast). With two outputs, s is the second."""
    s = x if residual is None else x + residual
    axis = axis + s.dim() if axis < 0 else axis
    shape = list(s.shape[axis:])
    if s.dtype in (torch.float16, torch.bfloat16):
        y = F.layer_norm(s.float(), shape, None, None, epsilon).to(s.dtype)
        y = y * scale if scale is not None else y
        y = y + bias if bias is not None else y
    else:
        if scale is not None and list(scale.shape) != shape:
            scale = scale.expand(shape)
        if bias is not None and list(bias.shape) != shape:
            bias = bias.expand(shape)
        y = F.layer_norm(s, shape, scale, bias, epsilon)
    return (y, s) if ctx.num_outputs == 2 else y


@register("RMSNorm", domain="kiln")
def rms_norm(ctx, x, scale=None, *, axis=-1, epsilon=1e-6):
    """x / sqrt(mean(x², axis..) + ε) · scale, statistics in fp32."""
    axis = axis + x.dim() if axis < 0 else axis
    dims = list(range(axis, x.dim()))
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + epsilon)).to(x.dtype)
    return y * scale if scale is not None else y


@register("Softmax", domain="kiln")
def softmax(ctx, x, *, axis=-1):
    """exp(x - max) / sum(exp(x - max)) along one axis."""
    return torch.softmax(x, dim=axis)


@register("Attention", domain="kiln")
def attention(ctx, q, k=None, v=None, mask=None, key_lengths=None, *, scale=1.0, q_perm=None, k_perm=None,
              v_perm=None, out_perm=None, gqa=0, nan_to_zero=0, is_causal=0, q_num_heads=0, kv_num_heads=0, qkv_split=None,
              out_merge_heads=0, q_quant=None, k_quant=None, v_quant=None, score_quant=None, prob_quant=None,
              out_quant=None, float8_quant=0, fp8_scale=None):
    """softmax(q·kᵀ·scale + mask)·v with q/k/v permuted to [B, H, S, D] first (views, no copies).

    `gqa` = 1: k and v have fewer heads than q (grouped-query attention), each shared by
    H_q / H_kv query heads. `nan_to_zero`: rows whose every key is masked give 0, not NaN.
    `is_causal`: query i sees keys 0..i (the top-left aligned lower triangle), no mask tensor.
    `key_lengths` (int32 [B], kiln/ops/tokens.py `key_lengths`): where key_lengths[b] >= 0 batch b attends to its
    first key_lengths[b] keys and its mask is ignored; where it is negative, the mask applies (not with is_causal).
    Layout (absorbed Reshapes/Split, all views): `qkv_split` = [Wq, Wk, Wv]: q holds q, k and v
    side by side on its last axis; `q_num_heads` / `kv_num_heads`: a 3-D input [B, S, H·D] is
    first unflattened to [B, S, H, D]; `out_merge_heads`: the output's last two axes are merged.

    Quantized attention (an explicitly quantized graph's Q/DQ absorbed, kiln/passes/fusion/attention.py), each
    optional: `q_quant`/`k_quant`/`v_quant` = [scale, zero_point]: that input is 8-bit, read as (x - z)·s;
    `score_quant`/`prob_quant` = [scale, zero_point, qmin, qmax]: the scores q·kᵀ·scale (before the mask) and
    the probabilities (after the NaN guard) go through DQ(Q(·)), (clamp(round(x / s) + z, qmin, qmax) - z)·s,
    round half to even as ONNX QuantizeLinear; `out_quant` = [scale, zero_point, qmin, qmax]: the output is
    Q(out), 8-bit (uint8 when qmin = 0, else int8). `float8_quant` = 1: every one of them is E4M3FN instead
    (onnxruntime's FP8 QDQ model): the inputs are float8_e4m3fn read as x·s, and Q(x) is x / s clamped to ±448
    and rounded to E4M3 (round half to even), as ONNX QuantizeLinear with saturate = 1; the output is float8_e4m3fn.

    `fp8_scale` (an FP8 engine's attention, kiln/quant/attention.py) changes nothing here: it allows a tactic to
    compute with q, k and v on the E4M3 grid at that scale (and the probabilities in E4M3), checked against this
    op on the rounded inputs (kiln/builder/autotune.py) and timed against the exact tactics.
    """
    if qkv_split:
        q, k, v = torch.split(q, list(qkv_split), dim=-1)  # [B, S, Wq], [B, S, Wk], [B, S, Wv]
    if q_num_heads and q.dim() == 3:
        q = q.unflatten(-1, (q_num_heads, -1))  # [B, S, H, D]
    if kv_num_heads and k.dim() == 3:
        k = k.unflatten(-1, (kv_num_heads, -1))
    if kv_num_heads and v.dim() == 3:
        v = v.unflatten(-1, (kv_num_heads, -1))
    q = q.permute(q_perm) if q_perm else q  # q: [B, H, S, D]
    k = k.permute(k_perm) if k_perm else k  # k: [B, Hkv, T, D]
    v = v.permute(v_perm) if v_perm else v  # v: [B, Hkv, T, D]
    q, k, v = (_dequantized(x, p) for x, p in ((q, q_quant), (k, k_quant), (v, v_quant)))
    if mask is not None and mask.dtype != q.dtype and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    if key_lengths is not None:
        mask = _key_length_mask(mask, key_lengths, k.shape[-2], bool(is_causal), q.dtype)
    if gqa and k.shape[-3] != q.shape[-3]:
        repeat = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(repeat, dim=-3)
        v = v.repeat_interleave(repeat, dim=-3)
    if score_quant or prob_quant:
        out = _fake_quantized_attention(q, k, v, mask, scale, bool(is_causal) and mask is None, nan_to_zero,
                                        score_quant, prob_quant, bool(float8_quant))
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                             is_causal=bool(is_causal) and mask is None)  # [B, H, S, D]
    if nan_to_zero:
        out = torch.nan_to_num_(out, nan=0.0) if not out.requires_grad else torch.nan_to_num(out, nan=0.0)
    out = out.permute(out_perm) if out_perm else out
    out = out.flatten(-2) if out_merge_heads else out
    if out_quant and float8_quant:
        out = _quantized(out, out_quant, float8=True)  # float8_e4m3fn
    elif out_quant:
        out = _quantized(out, out_quant).to(torch.uint8 if out_quant[2] >= 0 else torch.int8)
    return out


def _key_length_mask(mask: torch.Tensor | None, key_lengths: torch.Tensor, keys: int, is_causal: bool,
                     dtype: torch.dtype) -> torch.Tensor:
    """The mask `attention` applies with key lengths: batch b's keys past key_lengths[b] hidden where that is >= 0,
    the given mask (or none: every key) where it is negative. Bool where the mask is (or there is none), else
    additive in `dtype`; broadcastable to [B, H, S, T]."""
    if is_causal:
        raise ValueError("attention: key_lengths with is_causal: a causal mask is not a prefix of the keys")
    lengths = key_lengths.reshape(-1, 1, 1, 1)  # [B, 1, 1, 1]
    kept = torch.arange(keys, device=key_lengths.device) < lengths  # [B, 1, 1, T]
    if mask is None or mask.dtype == torch.bool:
        given = torch.ones((), dtype=torch.bool, device=kept.device) if mask is None else mask
        return torch.where(lengths >= 0, kept, given)
    hidden = torch.full((), float("-inf"), dtype=dtype, device=kept.device)
    return torch.where(lengths >= 0, torch.where(kept, torch.zeros((), dtype=dtype, device=kept.device), hidden),
                       mask)


def _dequantized(x: torch.Tensor, quant: list[float] | None) -> torch.Tensor:
    """(x - z)·s for an 8-bit input with quant = [s, z]; x itself otherwise."""
    if not quant:
        return x
    return (x.float() - quant[1]) * quant[0]


def _quantized(x: torch.Tensor, quant: list[float], float8: bool = False) -> torch.Tensor:
    """Q(x) = clamp(round(x / s) + z, qmin, qmax), integer-valued floats, for quant = [s, z, qmin, qmax] (round half
    to even, as ONNX QuantizeLinear); float8: x / s clamped to [qmin, qmax] (±448: saturate = 1; NaN stays NaN) and
    rounded to E4M3 (half to even), a float8_e4m3fn tensor."""
    s, z, low, high = quant
    if float8:
        return torch.clamp(x.float() / s, low, high).to(torch.float8_e4m3fn)
    return torch.clamp(torch.round(x / s) + z, low, high)


def _fake_quant(x: torch.Tensor, quant: list[float] | None, float8: bool = False) -> torch.Tensor:
    """DQ(Q(x)) = (Q(x) - z)·s for quant = [s, z, qmin, qmax]; x itself without one."""
    if not quant:
        return x
    if float8:  # z = 0
        return _quantized(x, quant, float8=True).to(x.dtype) * quant[0]
    return (_quantized(x, quant) - quant[1]) * quant[0]


def _fake_quantized_attention(q, k, v, mask, scale, causal, nan_to_zero, score_quant, prob_quant, float8=False):
    """softmax(DQ(Q(q·kᵀ·scale)) + mask), NaN guard, DQ(Q(·)), times v: an explicitly quantized graph's attention
    with its score and probability quantization (q, k, v: [B, H, S|T, D], float; float8: Q rounds to E4M3)."""
    scores = _fake_quant(torch.matmul(q, k.transpose(-1, -2)) * scale, score_quant, float8)  # [B, H, S, T]
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    p = torch.softmax(scores, dim=-1)
    if nan_to_zero:
        p = torch.nan_to_num(p, nan=0.0)
    return torch.matmul(_fake_quant(p, prob_quant, float8), v)  # [B, H, S, Dv]


@register("Rotary", domain="kiln")
def rotary(ctx, x, cos, sin, *, num_heads=0, interleaved=0, rotate_heads=0):
    """Rotary position embedding, rotate-half form: x·cos + rotate_half(x)·sin, cos/sin broadcast to x.

    rotate_half(x) = concat(-x[..., D/2:], x[..., :D/2]); `interleaved` = 1 rotates pairs
    (x0, x1), (x2, x3), ... instead (GPT-J). `num_heads`: a 3-D x [B, S, H·D] is first viewed
    as [B, S, H, D]. cos/sin are full width [..., D] (both halves given), so any rotary table works.
    `rotate_heads` = R > 0 (with num_heads and a 3-D x): only heads [0, R) rotate, the others pass
    through, and y keeps x's shape [B, S, H·D]: a packed q|k|v (kiln/passes/fusion/rotary.py
    fuse_packed_rotary) whose v heads are not rotated.
    """
    if rotate_heads and num_heads and x.dim() == 3:
        heads = x.unflatten(-1, (num_heads, -1))  # [B, S, H, D]
        rotated = rotary(ctx, heads[:, :, :rotate_heads], cos, sin, interleaved=interleaved)  # [B, S, R, D]
        return torch.cat((rotated, heads[:, :, rotate_heads:]), dim=2).flatten(-2)  # [B, S, H·D]
    if num_heads and x.dim() == 3:
        x = x.unflatten(-1, (num_heads, -1))  # [B, S, H, D]
    if interleaved:
        pairs = x.unflatten(-1, (-1, 2))  # [..., D/2, 2]
        rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    else:
        first, second = x.chunk(2, dim=-1)
        rotated = torch.cat((-second, first), dim=-1)
    return torch.addcmul(x * cos, rotated, sin)


_ELEMENTWISE = {
    "Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div, "Pow": torch.pow,
    "Max": torch.maximum, "Min": torch.minimum,
    "Neg": torch.neg, "Abs": torch.abs, "Exp": torch.exp, "Log": torch.log, "Sqrt": torch.sqrt,
    "Reciprocal": torch.reciprocal, "Relu": torch.relu, "Sigmoid": torch.sigmoid, "Tanh": torch.tanh,
    "Erf": torch.erf, "Sin": torch.sin, "Cos": torch.cos, "Floor": torch.floor, "Ceil": torch.ceil,
    "Gelu": F.gelu, "GeluTanh": lambda x: F.gelu(x, approximate="tanh"),
    # an E4M3 tensor and its per-tensor scale (kiln/passes/fusion/elementwise_dequantize.py): DequantizeLinear
    # (int8/uint8 with its zero point, CPU builds: (q - z)·s)
    "Dequantize": lambda q, scale, zero=None: _dequantize(q, scale, zero),
    # ... and the chain's result to E4M3 (the program's last line): QuantizeLinear, saturating at ±448, nearest-even
    # (int8/uint8 with its zero point: saturate(round_half_even(v / s) + z))
    "Quantize": lambda v, scale, zero=None: _quantize(v, scale, zero),
}


def _dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    if zero is None:  # E4M3, zero point 0
        return q.to(torch.float32) * scale.to(torch.float32)
    return (q.to(torch.float32) - zero.to(torch.float32)) * scale.to(torch.float32)


def _quantize(v: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    if zero is None:  # E4M3: saturate at ±448, round to nearest even on E4M3's grid
        return (v.to(torch.float32) / scale.to(torch.float32)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    info = torch.iinfo(zero.dtype)
    r = torch.round(v.to(torch.float32) / scale.to(torch.float32)) + zero.to(torch.float32)  # round half to even
    return r.clamp(info.min, info.max).to(zero.dtype)


def dequantized_inputs(code) -> set[int]:
    """The inputs an Elementwise program reads as a Dequantize line's quantized operand (may be E4M3)."""
    return {int(line.split()[1][1:]) for line in code if line.split()[0] == "Dequantize" and line.split()[1][0] == "i"}


def quantization_scales(code) -> set[int]:
    """The inputs read as a Dequantize / Quantize line's scale: float32 in every precision (kiln/builder/precision.py)."""
    return {int(line.split()[2][1:]) for line in code
            if line.split()[0] in ("Dequantize", "Quantize") and line.split()[2][0] == "i"}


@register("Elementwise", domain="kiln")
def elementwise(ctx, *inputs, code=None, output_dtype=0):
    """A chain of elementwise ops as a small program: each line `Op a b` reads inputs `i<k>`
    or earlier results `t<k>`, and the last line's result is the output.

    On CPU each line is one torch call (the gain is fewer steps); on GPU the same program is
    what a generated Triton kernel evaluates in one pass. output_dtype (ONNX id; a program with
    Dequantize lines, whose float32 scales do not give the storage type): the result's dtype.
    """
    temps: list[torch.Tensor] = []
    for line in code:
        op, *args = line.split()
        values = [inputs[int(a[1:])] if a[0] == "i" else temps[int(a[1:])] for a in args]
        temps.append(_ELEMENTWISE[op](*values))
    return temps[-1].to(dtypes.from_onnx(output_dtype).torch) if output_dtype else temps[-1]


@register("EmbeddingConcat", domain="kiln")
def embedding_concat(ctx, ids, *parts, fields=()):
    """Concat(part_k if fields[k] < 0 else part_k[ids[:, fields[k]]], axis=1): a recommender's per-field
    embedding lookups and their concatenation as one step (kiln/passes/fusion/embedding_concat.py).
    ids [N, F] integer; a looked-up part is a table [V, D] (negative ids count from its end), the others
    [N, C] tensors concatenated as they are."""
    looked_up = [(part, field) for part, field in zip(parts, fields) if field >= 0]
    if any(field >= ids.shape[1] for _, field in looked_up):
        raise IndexError(f"{ctx.name}: fields {list(fields)} index ids of {ids.shape[1]} columns")
    ids = ids.to(torch.int64)  # [N, F]

    def rows(field: int, vocab: int) -> torch.Tensor:  # negatives count from the table's end (no host copy:
        column = ids[:, field]  # a CUDA graph captures this layer)
        return torch.where(column < 0, column + vocab, column)

    pieces = [part if field < 0 else part.index_select(0, rows(field, part.shape[0])) for part, field in zip(parts, fields)]
    return torch.cat(pieces, dim=1)  # [N, Σ widths]
