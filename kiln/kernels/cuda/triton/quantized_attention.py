"""An explicitly quantized attention (kiln::Attention with q/k/v_quant, score_quant, prob_quant, out_quant: the
Q/DQ of onnxruntime's QDQ BERT, int8 or E4M3, kiln/passes/fusion/attention.py) without materialising q·kᵀ.

The op (kiln/ops/fused.py) is, per row of scores, with x̂ = (x8 - z)·s the dequantized inputs:

    s_j = FQ_score(q̂·k̂_j·scale) + mask_j        FQ(x) = DQ(Q(x)): int8 (round half even, clamp) or E4M3 (saturating)
    p_j = exp(s_j - max s) / Σ exp(s - max s)    [NaN -> 0 for a row whose every key is masked: nan_to_zero]
    o   = Σ_j FQ_prob(p_j)·v̂_j                  [-> Q_out(o)]

FQ_prob needs each p_j normalised, i.e. the row's max and sum before any p·v: flash attention's online softmax
cannot round p before knowing l (a rescaled p rounds differently: E4M3 and integer grids are not scale-invariant).
Two kernels, none of the [B, H, S, T] traffic of the unfused graph (BERT-base 64 x 384: 113 M scores a layer,
453 MB a float32 pass):

- one pass (`_one_pass_kernel`, T up to ONE_PASS_MAX_CHUNKS key blocks): a program holds all its rows' scores in
  registers, a tuple of [BM, BN] tiles, so q·kᵀ, the score rounding and exp run once per score, as in a flash
  kernel; then l, and p = e·(1/l) rounded times v. A [.., 1, T] padding mask is one key vector per block, and E4M3
  rounding is a magic add (_e4m3_grid, ~7 instructions). Issue 12: the two-pass kernel took 0.53-0.61 ms a
  BERT-base layer on the H100, 4x the fp16 flash tile's 0.14: its q·kᵀ, score rounding (~17 instructions a value,
  round_to_e4m3) and [BM, BN] mask loads twice, two exps a score.
- two passes (`_quantized_attention_kernel`, any T): pass 1 keeps the running max m and sum l of the rounded
  scores; pass 2 recomputes the same scores, p = exp(s - m) / l, rounds p and accumulates p·v.

The products stay fp16 tensor-core dots, not E4M3 ones: Hopper's E4M3 wgmma sums with ~13 mantissa bits
(kiln/kernels/cuda/triton/attention.py), enough to send a score near a rounding midpoint of the score grid the
other way on about a percent of BERT-like scores (1.7e-4 of Σ|q_i·k_i| measured on the H200, ~8x |q·k|, against
a grid step of 2^-4 of it), each moving its row's output by many steps.

Exact products: the integer q8 - z, k8 - z (|x| <= 255) and E4M3 values are exact in fp16, so each tl.dot of them
sums exact products in fp32; the scales multiply the sums after. The probabilities' rounded values (integers
of [qmin - z, qmax - z], or E4M3 grid values in units of the probability scale) are exact in fp16 too. What may
differ from the op is fp32 summation order (the scores, the row sum), which sends a near-tie of a rounding the other
way now and then: the builder checks the tactic against the op, with a quantized attention's two output steps
(kiln/builder/accuracy.py QUANTIZED_ATTENTION_STEPS). So may exp2 and 1/l (the op: exp, then a division), and the
row sum l: a probability at an E4M3 midpoint then rounds one step the other way, for every key sharing its rounded
score at once. That moves an output by a few of its units, which near zero is dozens of E4M3 steps (issue 12: 116
on the H100; the same arithmetic in torch on the CPU, 121): QUANTIZED_ATTENTION_FLOAT8_SLACK. Not a conversion: no
value here is rounded by `.to(float8)`, only stored after round_to_e4m3 put it on the grid (exact).

Roundings are fp32 arithmetic (qmath: round_half_even, round_to_e4m3; here _e4m3_grid), correct in the interpreter
and on the GPU alike; x / s is x·(1/s) here (the op divides: a tie may go the other way, as in kiln's other quantized
kernels), and the one-pass kernel folds scale / s_score and (1/l) / s_prob into one multiplier each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.kernels.cuda.triton import qmath

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): e^x = 2^(x·log2 e)
MAX_HEAD_DIM = 128
INT8_DTYPES = (torch.int8, torch.uint8)
FP8_DTYPE = torch.float8_e4m3fn


@dataclass(frozen=True)
class Quantization:
    """One tensor's per-tensor quantization: x = (x8 - zero)·scale; [qmin, qmax] the 8-bit range (E4M3: ±448)."""
    scale: float
    zero: float = 0.0
    qmin: float = -448.0
    qmax: float = 448.0

    @classmethod
    def of(cls, values: list[float] | None) -> Quantization | None:
        """From an attribute of kiln::Attention: [s, z] (an input) or [s, z, qmin, qmax]."""
        if not values:
            return None
        return cls(*[float(v) for v in values]) if len(values) == 4 else cls(float(values[0]), float(values[1]))


@triton.jit
def _fake_quant(x, inverse, zero, QMIN: tl.constexpr, QMAX: tl.constexpr, FLOAT8: tl.constexpr):
    """Q(x) - z in units of the scale (x·inverse rounded): an integer of [QMIN - z, QMAX - z], or an E4M3 value."""
    v = x * inverse
    if FLOAT8:
        return qmath.round_to_e4m3(v)
    return tl.minimum(tl.maximum(qmath.round_half_even(v) + zero, QMIN), QMAX) - zero


@triton.jit
def _scores(q, k_base, mask_base, offs_m, offs_n, row_ok, T, stride_kt, stride_kd, stride_ms, stride_mt, k_zero,
            qk_scale, score_inverse, score_zero, score_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
            HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, HAS_SCORE_Q: tl.constexpr, SCORE_MIN: tl.constexpr,
            SCORE_MAX: tl.constexpr, FLOAT8: tl.constexpr):
    """The rounded, masked scores of one key block, in natural-log units: [BM, BN] fp32 (-inf where hidden)."""
    offs_d = tl.arange(0, BLOCK_D)
    key_ok = offs_n < T
    k_ok = (offs_d[:, None] < HEAD_DIM) & key_ok[None, :]
    k = tl.load(k_base + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kt, mask=k_ok)  # kᵀ: [BD, BN]
    k = tl.where(k_ok, k.to(tl.float32) - k_zero, 0.0).to(tl.float16)  # exact: |k8 - z| <= 255, or E4M3
    s = tl.dot(q, k) * qk_scale  # s: [BM, BN] = q̂·k̂ᵀ·scale
    if HAS_SCORE_Q:
        s = _fake_quant(s, score_inverse, score_zero, SCORE_MIN, SCORE_MAX, FLOAT8) * score_scale
    if HAS_MASK:
        m_ptrs = mask_base + offs_m[:, None] * stride_ms + offs_n[None, :] * stride_mt
        bias = tl.load(m_ptrs, mask=row_ok[:, None] & key_ok[None, :], other=0)
        if MASK_BOOL:
            s = tl.where(bias != 0, s, float("-inf"))
        else:
            s = s + bias.to(tl.float32)
    return tl.where(key_ok[None, :], s, float("-inf"))


@triton.jit
def _quantized_attention_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr,
                                stride_qb, stride_qh, stride_qs, stride_qd,
                                stride_kb, stride_kh, stride_kt, stride_kd,
                                stride_vb, stride_vh, stride_vt, stride_vd,
                                stride_mb, stride_mh, stride_ms, stride_mt,
                                stride_ob, stride_oh, stride_os, stride_od,
                                S, T, kv_group, q_zero, k_zero, v_zero, qk_scale,
                                score_inverse, score_zero, score_scale, prob_inverse, prob_zero, pv_scale,
                                out_inverse, out_zero,
                                HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, HAS_MASK: tl.constexpr,
                                MASK_BOOL: tl.constexpr, HAS_SCORE_Q: tl.constexpr, SCORE_MIN: tl.constexpr,
                                SCORE_MAX: tl.constexpr, HAS_PROB_Q: tl.constexpr, PROB_MIN: tl.constexpr,
                                PROB_MAX: tl.constexpr, OUT: tl.constexpr, OUT_MIN: tl.constexpr,
                                OUT_MAX: tl.constexpr, NAN_TO_ZERO: tl.constexpr, FLOAT8: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                                BLOCK_DV: tl.constexpr):
    """OUT: qmath.OUT_FLOAT / OUT_INT / OUT_FP8 (out_inverse, out_zero: the output's quantization)."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    kv_head = (head // kv_group).to(tl.int64)
    head = head.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # offs_m: [BM]
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < S
    q_ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + batch * stride_qb + head * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd,
                mask=q_ok)  # q: [BM, BD]; masked lanes undefined (no `other` converts to E4M3 everywhere)
    q = tl.where(q_ok, q.to(tl.float32) - q_zero, 0.0).to(tl.float16)  # padding: 0 whatever z is
    k_base = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head * stride_vh
    mask_base = mask_ptr + batch * stride_mb + head * stride_mh

    # pass 1: the row's max and sum of exp over the rounded, masked scores (online)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start_n in range(0, T, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s = _scores(q, k_base, mask_base, offs_m, offs_n, row_ok, T, stride_kt, stride_kd, stride_ms, stride_mt,
                    k_zero, qk_scale, score_inverse, score_zero, score_scale, HEAD_DIM, BLOCK_D, HAS_MASK, MASK_BOOL,
                    HAS_SCORE_Q, SCORE_MIN, SCORE_MAX, FLOAT8)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # every key so far hidden: no -inf - -inf
        l_i = l_i * tl.math.exp2((m_i - m_safe) * LOG2E) + tl.sum(tl.math.exp2((s - m_safe[:, None]) * LOG2E), 1)
        m_i = m_new
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    # l = 0: every key hidden: the op's softmax gives NaN there (0 with nan_to_zero)
    inverse_l = tl.where(l_i == 0.0, float("nan"), 1.0 / l_i)

    # pass 2: the same scores, p = exp(s - m) / l rounded, times v
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for start_n in range(0, T, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        s = _scores(q, k_base, mask_base, offs_m, offs_n, row_ok, T, stride_kt, stride_kd, stride_ms, stride_mt,
                    k_zero, qk_scale, score_inverse, score_zero, score_scale, HEAD_DIM, BLOCK_D, HAS_MASK, MASK_BOOL,
                    HAS_SCORE_Q, SCORE_MIN, SCORE_MAX, FLOAT8)
        p = tl.math.exp2((s - m_safe[:, None]) * LOG2E) * inverse_l[:, None]  # p: [BM, BN]
        if NAN_TO_ZERO:
            p = tl.where(p != p, 0.0, p)
        if HAS_PROB_Q:
            p = _fake_quant(p, prob_inverse, prob_zero, PROB_MIN, PROB_MAX, FLOAT8)  # in units of prob_scale
        key_ok = offs_n < T
        v_ok = key_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
        v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_dv[None, :] * stride_vd, mask=v_ok)  # v: [BN, BDV]
        v = tl.where(v_ok, v.to(tl.float32) - v_zero, 0.0).to(tl.float16)
        if HAS_PROB_Q:
            acc = tl.dot(p.to(tl.float16), v, acc)  # exact products: both on 8-bit grids
        else:
            acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
    out = acc * pv_scale  # the scales of p (1 without prob_quant) and of v
    if NAN_TO_ZERO:
        out = tl.where(out != out, 0.0, out)
    if OUT != 0:
        out = qmath.quantize_value(out * out_inverse, out_zero, OUT, OUT_MIN, OUT_MAX)
    o_ptrs = out_ptr + batch * stride_ob + head * stride_oh + offs_m[:, None] * stride_os + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))


# ---- one pass: a row block's every score held in registers (up to ONE_PASS_MAX_CHUNKS key blocks) ----------------

@triton.jit
def _e4m3_grid(v, SIGNED: tl.constexpr):
    """v saturated at ±448 and rounded (nearest, ties to even) onto the float8e4m3fn grid, NaN kept: what the op's
    x / s -> float8_e4m3fn -> float32 gives, in 6-7 fp32/int instructions a value where qmath.round_to_e4m3 takes ~17
    (it also keeps -0.0, which only a stored output needs). Adding 1.5·2^(e+20), e = v's binade (-6 at least: the
    subnormals share binade -6's spacing), makes the fp32 sum's spacing 2^(e-3), E4M3's there, so the add rounds
    (nearest-even) and the subtraction is exact; v of either sign stays inside that binade. The clamps propagate NaN
    (min.NaN), which a probability of a row holding a NaN must stay. SIGNED False: v >= 0 (probabilities)."""
    v = tl.minimum(v, 448.0, propagate_nan=tl.PropagateNan.ALL)
    if SIGNED:
        v = tl.maximum(v, -448.0, propagate_nan=tl.PropagateNan.ALL)
    binade = tl.maximum(v.to(tl.int32, bitcast=True) & 0x7F800000, (127 - 6) << 23)  # 2^e's bits, e >= -6
    magic = (binade + ((20 << 23) | 0x400000)).to(tl.float32, bitcast=True)  # 1.5·2^(e+20)
    return (v + magic) - magic


@triton.jit
def _integer_grid(v, zero, QMIN: tl.constexpr, QMAX: tl.constexpr):
    """Q(v) - z for an int8/uint8 quantization: round half even, + z, clamped to [QMIN, QMAX] (NaN kept), - z."""
    v = qmath.round_half_even(v) + zero
    v = tl.minimum(tl.maximum(v, QMIN, propagate_nan=tl.PropagateNan.ALL), QMAX, propagate_nan=tl.PropagateNan.ALL)
    return v - zero


@triton.jit
def _chunk_scores(q, k_base, mask_base, offs_m, row_ok, start_n, T, stride_kt, stride_kd, stride_ms, stride_mt,
                  k_zero, score_multiplier, score_zero, score_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, MASK_ROWS: tl.constexpr,
                  HAS_SCORE_Q: tl.constexpr, SCORE_MIN: tl.constexpr, SCORE_MAX: tl.constexpr,
                  FLOAT8: tl.constexpr, FULL_BLOCKS: tl.constexpr):
    """Keys [start_n, start_n + BLOCK_N)'s rounded, masked scores: [BM, BN] fp32, natural-log units, -inf where
    hidden. score_multiplier = scale·s_q·s_k / s_score (with score_quant), the scores' scale (without).
    FULL_BLOCKS: every key block whole (T % BLOCK_N == 0) and no head-dim padding: no masked loads, no key tests."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    key_ok = offs_n < T
    k_ptrs = k_base + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kt  # kᵀ: [BD, BN]
    if FULL_BLOCKS:
        k = tl.load(k_ptrs)
        k = k.to(tl.float16) if FLOAT8 else (qmath.to_float(k) - k_zero).to(tl.float16)
    else:
        k_ok = (offs_d[:, None] < HEAD_DIM) & key_ok[None, :]
        k = tl.load(k_ptrs, mask=k_ok)  # masked lanes undefined (no `other` converts to E4M3 everywhere): zeroed
        if FLOAT8:
            k = tl.where(k_ok, k.to(tl.float16), 0.0)  # exact: E4M3 values are fp16 values
        else:
            k = tl.where(k_ok, qmath.to_float(k) - k_zero, 0.0).to(tl.float16)  # exact: |k8 - z| <= 255
    x = tl.dot(q, k) * score_multiplier  # exact products summed in fp32, then q̂·k̂ᵀ·scale / s_score
    if HAS_SCORE_Q:
        if FLOAT8:
            s = _e4m3_grid(x, True) * score_scale
        else:
            s = _integer_grid(x, score_zero, SCORE_MIN, SCORE_MAX) * score_scale
    else:
        s = x
    if HAS_MASK and MASK_ROWS:  # one mask value per (query, key)
        bias = tl.load(mask_base + offs_m[:, None] * stride_ms + offs_n[None, :] * stride_mt,
                       mask=row_ok[:, None] & key_ok[None, :], other=0)
        if MASK_BOOL:
            s = tl.where(bias != 0, s, float("-inf"))
        else:
            s = s + bias.to(tl.float32)
        s = tl.where(key_ok[None, :], s, float("-inf"))
    elif HAS_MASK and FULL_BLOCKS:  # a padding mask, [.., 1, T]: one key vector for every row
        bias = tl.load(mask_base + offs_n * stride_mt)
        if MASK_BOOL:
            s = tl.where((bias != 0)[None, :], s, float("-inf"))
        else:
            s = s + bias.to(tl.float32)[None, :]
    elif HAS_MASK:  # the same, the keys past T folded into the vector
        bias = tl.load(mask_base + offs_n * stride_mt, mask=key_ok, other=0)
        if MASK_BOOL:
            s = tl.where(((bias != 0) & key_ok)[None, :], s, float("-inf"))
        else:
            s = s + tl.where(key_ok, bias.to(tl.float32), float("-inf"))[None, :]
    elif not FULL_BLOCKS:
        s = tl.where(key_ok[None, :], s, float("-inf"))
    return s


@triton.jit
def _one_pass_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr,
                     stride_qb, stride_qh, stride_qs, stride_qd,
                     stride_kb, stride_kh, stride_kt, stride_kd,
                     stride_vb, stride_vh, stride_vt, stride_vd,
                     stride_mb, stride_mh, stride_ms, stride_mt,
                     stride_ob, stride_oh, stride_os, stride_od,
                     S, T, kv_group, q_zero, k_zero, v_zero, score_multiplier, score_zero, score_scale,
                     prob_inverse, prob_zero, pv_scale, out_inverse, out_zero,
                     HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, HAS_MASK: tl.constexpr,
                     MASK_BOOL: tl.constexpr, MASK_ROWS: tl.constexpr, HAS_SCORE_Q: tl.constexpr,
                     SCORE_MIN: tl.constexpr, SCORE_MAX: tl.constexpr, HAS_PROB_Q: tl.constexpr,
                     PROB_MIN: tl.constexpr, PROB_MAX: tl.constexpr, OUT: tl.constexpr, OUT_MIN: tl.constexpr,
                     OUT_MAX: tl.constexpr, NAN_TO_ZERO: tl.constexpr, FLOAT8: tl.constexpr, CHUNKS: tl.constexpr,
                     FULL_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_DV: tl.constexpr):
    """All T <= CHUNKS·BLOCK_N scores of BLOCK_M rows at once (a tuple of [BM, BN] tiles): q·kᵀ, the score rounding
    and the exponentials once each, then p = e / l rounded times v. OUT: qmath.OUT_FLOAT / OUT_INT / OUT_FP8."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    kv_head = (head // kv_group).to(tl.int64)
    head = head.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # offs_m: [BM]
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < S
    q_ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q_ptrs = q_ptr + batch * stride_qb + head * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=q_ok)  # q: [BM, BD]; masked lanes undefined (no `other` converts to E4M3 everywhere)
    if FLOAT8:
        q = tl.where(q_ok, q.to(tl.float16), 0.0)
    else:
        q = tl.where(q_ok, qmath.to_float(q) - q_zero, 0.0).to(tl.float16)  # padding: 0 whatever z is
    k_base = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head * stride_vh
    mask_base = mask_ptr + batch * stride_mb + head * stride_mh

    scores = ()
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for c in tl.static_range(CHUNKS):
        s = _chunk_scores(q, k_base, mask_base, offs_m, row_ok, c * BLOCK_N, T, stride_kt, stride_kd, stride_ms,
                          stride_mt, k_zero, score_multiplier, score_zero, score_scale, HEAD_DIM, BLOCK_D, BLOCK_N,
                          HAS_MASK, MASK_BOOL, MASK_ROWS, HAS_SCORE_Q, SCORE_MIN, SCORE_MAX, FLOAT8, FULL_BLOCKS)
        scores = scores + (s,)
        m_i = tl.maximum(m_i, tl.max(s, 1))
    m_log2 = tl.where(m_i == float("-inf"), 0.0, m_i) * LOG2E  # every key hidden: no -inf - -inf
    exps = ()
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c in tl.static_range(CHUNKS):
        e = tl.math.exp2(scores[c] * LOG2E - m_log2[:, None])  # e^(s - max s): [BM, BN]
        exps = exps + (e,)
        l_i += tl.sum(e, 1)
    # l = 0: every key hidden, the op's softmax is NaN there (0 with nan_to_zero); a NaN l (a NaN score) stays NaN,
    # and so does every p of its row (the grids' clamps propagate NaN) up to the output's NaN test
    inverse_l = tl.where(l_i == 0.0, 0.0 if NAN_TO_ZERO else float("nan"), 1.0 / l_i)
    if HAS_PROB_Q:
        inverse_l = inverse_l * prob_inverse  # p / s_prob in one multiply
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for c in tl.static_range(CHUNKS):
        p = exps[c] * inverse_l[:, None]  # p: [BM, BN], in units of the probability scale
        offs_n = c * BLOCK_N + tl.arange(0, BLOCK_N)
        v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_dv[None, :] * stride_vd  # v: [BN, BDV]
        if FULL_BLOCKS:
            v = tl.load(v_ptrs)
            v = v.to(tl.float16) if FLOAT8 else (qmath.to_float(v) - v_zero).to(tl.float16)
        else:
            v_ok = (offs_n < T)[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
            v = tl.load(v_ptrs, mask=v_ok)  # padding: 0 (a hidden key's p is 0, but 0·garbage need not be)
            if FLOAT8:
                v = tl.where(v_ok, v.to(tl.float16), 0.0)
            else:
                v = tl.where(v_ok, qmath.to_float(v) - v_zero, 0.0).to(tl.float16)
        if HAS_PROB_Q:
            if FLOAT8:
                p = _e4m3_grid(p, False)
            else:
                p = _integer_grid(p, prob_zero, PROB_MIN, PROB_MAX)
            acc = tl.dot(p.to(tl.float16), v, acc)  # exact products: both on 8-bit grids
        else:
            acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
    out = acc * pv_scale  # the scales of p (1 without prob_quant) and of v
    if NAN_TO_ZERO:
        out = tl.where(out != out, 0.0, out)
    if OUT != 0:
        out = qmath.quantize_value(out * out_inverse, out_zero, OUT, OUT_MIN, OUT_MAX)
    o_ptrs = out_ptr + batch * stride_ob + head * stride_oh + offs_m[:, None] * stride_os + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))


ONE_PASS_MAX_CHUNKS = 8  # key blocks a one-pass program holds at most (its tactics hold 3-8: registers, spills)


def _block_dim(d: int) -> int:
    return max(16, triton.next_power_of_2(d))  # tl.dot wants every tile dim >= 16


def quantized_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
                        scale: float, q_quant: Quantization, k_quant: Quantization, v_quant: Quantization,
                        score_quant: Quantization | None, prob_quant: Quantization | None,
                        out_quant: Quantization | None, float8: bool, nan_to_zero: bool, out: torch.Tensor,
                        block_m: int = 64, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                        one_pass: bool = False, max_registers: int = 0) -> torch.Tensor:
    """kiln::Attention's quantized form into `out` ([B, H, S, Dv] view; int8/uint8/float8_e4m3fn with out_quant,
    else float). q: [B, H, S, D], k: [B, Hkv, T, D], v: [B, Hkv, T, Dv], 8-bit (float8_e4m3fn with float8), any
    strides; mask: bool (True = attend) or additive float, broadcastable to [B, H, S, T]. one_pass: the kernel that
    holds a row block's scores (T <= ONE_PASS_MAX_CHUNKS·block_n; its tactics' tiles hold fewer without spilling),
    else the two-pass one; max_registers (one pass): ptxas's cap a thread (maxnreg), to fit more programs an SM."""
    wanted = (FP8_DTYPE,) if float8 else INT8_DTYPES
    if any(t.dtype not in wanted for t in (q, k, v)):
        raise TypeError(f"quantized_attention: q, k, v must be {' or '.join(map(str, wanted))}, "
                        f"got {q.dtype}, {k.dtype}, {v.dtype}")
    batch, heads, s_len, d = q.shape
    kv_heads, t_len, dv = k.shape[1], k.shape[2], v.shape[3]
    if max(d, dv) > MAX_HEAD_DIM or heads % kv_heads:
        raise ValueError(f"quantized_attention: head dims {d}/{dv}, heads {heads}/{kv_heads}")
    if out.shape != (batch, heads, s_len, dv):
        raise ValueError(f"quantized_attention: out {tuple(out.shape)}, expected {(batch, heads, s_len, dv)}")
    if out.numel() == 0:
        return out
    k, v = k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)
    mask_strides = (0, 0, 0, 0)
    if mask is not None:
        mask = mask.expand(batch, heads, s_len, t_len)
        if mask.dtype == torch.bool:
            mask = mask.view(torch.uint8)
        mask_strides = mask.stride()
    kind = qmath.OUT_FLOAT if out_quant is None else qmath.OUT_FP8 if float8 else qmath.OUT_INT
    score = score_quant or Quantization(1.0)
    prob = prob_quant or Quantization(1.0)
    output = out_quant or Quantization(1.0)
    grid = (triton.cdiv(s_len, block_m), heads, batch)
    if one_pass:
        if triton.cdiv(t_len, block_n) > ONE_PASS_MAX_CHUNKS:
            raise ValueError(f"quantized_attention: {t_len} keys, more than the one-pass kernel holds in "
                             f"{ONE_PASS_MAX_CHUNKS} blocks of {block_n} (use the two-pass kernel)")
        multiplier = float(scale) * q_quant.scale * k_quant.scale / (score.scale if score_quant is not None else 1.0)
        _one_pass_kernel[grid](
            q, k, v, mask if mask is not None else q, out, *q.stride(), *k.stride(), *v.stride(), *mask_strides,
            *out.stride(), s_len, t_len, heads // kv_heads, q_quant.zero, k_quant.zero, v_quant.zero, multiplier,
            score.zero, score.scale, 1.0 / prob.scale, prob.zero, prob.scale * v_quant.scale, 1.0 / output.scale,
            output.zero, HEAD_DIM=d, HEAD_DIM_V=dv, HAS_MASK=mask is not None,
            MASK_BOOL=mask is not None and mask.dtype == torch.uint8, MASK_ROWS=mask_strides[2] != 0,
            HAS_SCORE_Q=score_quant is not None, SCORE_MIN=score.qmin, SCORE_MAX=score.qmax,
            HAS_PROB_Q=prob_quant is not None, PROB_MIN=prob.qmin, PROB_MAX=prob.qmax, OUT=kind, OUT_MIN=output.qmin,
            OUT_MAX=output.qmax, NAN_TO_ZERO=bool(nan_to_zero), FLOAT8=bool(float8),
            CHUNKS=triton.cdiv(t_len, block_n),
            FULL_BLOCKS=t_len % block_n == 0 and d == _block_dim(d) and dv == _block_dim(dv),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_block_dim(d),
            BLOCK_DV=_block_dim(dv), num_warps=num_warps, num_stages=1,
            **({"maxnreg": max_registers} if max_registers else {}))
        return out
    _quantized_attention_kernel[grid](
        q, k, v, mask if mask is not None else q, out, *q.stride(), *k.stride(), *v.stride(), *mask_strides,
        *out.stride(), s_len, t_len, heads // kv_heads, q_quant.zero, k_quant.zero, v_quant.zero,
        float(scale) * q_quant.scale * k_quant.scale, 1.0 / score.scale, score.zero, score.scale,
        1.0 / prob.scale, prob.zero, prob.scale * v_quant.scale, 1.0 / output.scale, output.zero,
        HEAD_DIM=d, HEAD_DIM_V=dv, HAS_MASK=mask is not None, MASK_BOOL=mask is not None and mask.dtype == torch.uint8,
        HAS_SCORE_Q=score_quant is not None, SCORE_MIN=score.qmin, SCORE_MAX=score.qmax,
        HAS_PROB_Q=prob_quant is not None, PROB_MIN=prob.qmin, PROB_MAX=prob.qmax, OUT=kind, OUT_MIN=output.qmin,
        OUT_MAX=output.qmax, NAN_TO_ZERO=bool(nan_to_zero), FLOAT8=bool(float8), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=_block_dim(d), BLOCK_DV=_block_dim(dv), num_warps=num_warps, num_stages=num_stages)
    return out
