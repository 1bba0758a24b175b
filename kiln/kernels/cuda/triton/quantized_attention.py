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
- the lean one pass (`_one_pass_lean_kernel`, session 21: the one-pass kernel took 0.475 ms, 2.1x the fp16 tile's
  0.222): the same roundings of the same values in fewer instructions (sm_90 SASS at 384 keys, E4M3: 2016 a thread
  for 32x128.w8r128 against 2688, 1680 with k/v fp16) and waits: the next key/value block's load issued before this
  one's dot, the row max and sum reduced once, E4M3 rounded by the saturating conversion; optionally (HOLD) the
  scores held as 8-bit codes, four to a register, for the 64/128-row wgmma tiles whose fp32 scores would spill, and
  (KV_HALF) k/v converted to fp16 once a call instead of once a row block.
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
value here is rounded by `.to(float8)`, only stored after round_to_e4m3 put it on the grid (exact), but in the
lean kernel (its hardware_e4m3: cvt.rn.satfinite is the op's nearest-even, saturating rounding).

Roundings are fp32 arithmetic (qmath: round_half_even, round_to_e4m3; here _e4m3_grid), correct in the interpreter
and on the GPU alike, except the lean kernel's E4M3 ones on the GPU (E4M3_SATFINITE: the conversion itself); x / s
is x·(1/s) here (the op divides: a tie may go the other way, as in kiln's other quantized kernels), and the one-pass
kernels fold scale / s_score and (1/l) / s_prob into one multiplier each.
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
def _program_rows(q_ptr, k_ptr, v_ptr, mask_ptr, stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh,
                  stride_vb, stride_vh, stride_mb, stride_mh, S, kv_group, q_zero, HEAD_DIM: tl.constexpr,
                  FLOAT8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Every kernel's opening: this program's BLOCK_M query rows of one (batch, head) (grid: row blocks, heads,
    batches), q as exact fp16 (q8 - z, |.| <= 255, or the E4M3 values: E4M3's zero point is 0; 0 past S and
    HEAD_DIM) and the bases of k and v (the head's kv head: GQA) and of the mask. Returns (q, offs_m, row_ok, batch,
    head, k_base, v_base, mask_base)."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    kv_head = (head // kv_group).to(tl.int64)
    head = head.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # offs_m: [BM]
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < S
    q_ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q_ptrs = q_ptr + batch * stride_qb + head * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=q_ok)  # q: [BM, BD]; masked lanes undefined (no `other` converts to E4M3 everywhere)
    if FLOAT8:
        q = tl.where(q_ok, q.to(tl.float16), 0.0)
    else:
        q = tl.where(q_ok, qmath.to_float(q) - q_zero, 0.0).to(tl.float16)  # padding: 0 whatever z is
    return (q, offs_m, row_ok, batch, head, k_ptr + batch * stride_kb + kv_head * stride_kh,
            v_ptr + batch * stride_vb + kv_head * stride_vh, mask_ptr + batch * stride_mb + head * stride_mh)


@triton.jit
def _store_rows(acc, out_ptr, batch, head, offs_m, row_ok, stride_ob, stride_oh, stride_os, stride_od, pv_scale,
                out_inverse, out_zero, HEAD_DIM_V: tl.constexpr, OUT: tl.constexpr, OUT_MIN: tl.constexpr,
                OUT_MAX: tl.constexpr, NAN_TO_ZERO: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Every kernel's close: the rows' Σ p·v (in units of the p and v scales) scaled, NaN -> 0 with nan_to_zero,
    quantized with OUT (qmath.OUT_FLOAT / OUT_INT / OUT_FP8) and stored."""
    offs_dv = tl.arange(0, BLOCK_DV)
    out = acc * pv_scale  # the scales of p (1 without prob_quant) and of v
    if NAN_TO_ZERO:
        out = tl.where(out != out, 0.0, out)
    if OUT != 0:
        out = qmath.quantize_value(out * out_inverse, out_zero, OUT, OUT_MIN, OUT_MAX)
    o_ptrs = out_ptr + batch * stride_ob + head * stride_oh + offs_m[:, None] * stride_os + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))


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
    q, offs_m, row_ok, batch, head, k_base, v_base, mask_base = _program_rows(
        q_ptr, k_ptr, v_ptr, mask_ptr, stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_vb,
        stride_vh, stride_mb, stride_mh, S, kv_group, q_zero, HEAD_DIM, FLOAT8, BLOCK_M, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

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
    _store_rows(acc, out_ptr, batch, head, offs_m, row_ok, stride_ob, stride_oh, stride_os, stride_od, pv_scale,
                out_inverse, out_zero, HEAD_DIM_V, OUT, OUT_MIN, OUT_MAX, NAN_TO_ZERO, BLOCK_DV)


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
    g, _code = _score_units(x, score_zero, SCORE_MIN, SCORE_MAX, HAS_SCORE_Q, FLOAT8, E4M3_ARITHMETIC)
    return _masked(g * score_scale if HAS_SCORE_Q else g, mask_base, offs_m, row_ok, start_n, T, stride_ms, stride_mt,
                   HAS_MASK, MASK_BOOL, MASK_ROWS, FULL_BLOCKS, BLOCK_N)


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
    q, offs_m, row_ok, batch, head, k_base, v_base, mask_base = _program_rows(
        q_ptr, k_ptr, v_ptr, mask_ptr, stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_vb,
        stride_vh, stride_mb, stride_mh, S, kv_group, q_zero, HEAD_DIM, FLOAT8, BLOCK_M, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

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
        if HAS_PROB_Q:  # exact products: both on 8-bit grids
            acc = tl.dot(_prob_units(p, prob_zero, PROB_MIN, PROB_MAX, FLOAT8, E4M3_ARITHMETIC), v, acc)
        else:
            acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
    _store_rows(acc, out_ptr, batch, head, offs_m, row_ok, stride_ob, stride_oh, stride_os, stride_od, pv_scale,
                out_inverse, out_zero, HEAD_DIM_V, OUT, OUT_MIN, OUT_MAX, NAN_TO_ZERO, BLOCK_DV)


# ---- the lean one pass: the same sums, fewer instructions, registers and waits --------------------------------------

@triton.jit
def _key_tile(k_base, start_n, T, stride_kt, stride_kd, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_N: tl.constexpr, FULL_BLOCKS: tl.constexpr):
    """kᵀ of keys [start_n, start_n + BLOCK_N) as stored: [BD, BN], lanes past T or HEAD_DIM undefined (_exact_half
    zeroes them). A load alone, so that the next block's can be issued before this one's dot."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    ptrs = k_base + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kt
    if FULL_BLOCKS:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(offs_d[:, None] < HEAD_DIM) & (offs_n < T)[None, :])


@triton.jit
def _value_tile(v_base, start_n, T, stride_vt, stride_vd, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_DV: tl.constexpr, FULL_BLOCKS: tl.constexpr):
    """v of keys [start_n, start_n + BLOCK_N) as stored: [BN, BDV], lanes past T or HEAD_DIM_V undefined."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_dv = tl.arange(0, BLOCK_DV)
    ptrs = v_base + offs_n[:, None] * stride_vt + offs_dv[None, :] * stride_vd
    if FULL_BLOCKS:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(offs_n < T)[:, None] & (offs_dv[None, :] < HEAD_DIM_V))


@triton.jit
def _exact_half(x, ok, zero, FLOAT8: tl.constexpr, KV_HALF: tl.constexpr, FULL_BLOCKS: tl.constexpr):
    """A k or v tile as the exact fp16 the dots take: x8 - z (|.| <= 255), the E4M3 values, or (KV_HALF) the tile
    as the pre-pass wrote it (x8 - z in fp16 already); 0 where not ok (padding: 0·garbage need not be 0)."""
    if KV_HALF:
        h = x
    elif FLOAT8:
        h = x.to(tl.float16)
    else:
        h = (qmath.to_float(x) - zero).to(tl.float16)
    if not FULL_BLOCKS:
        h = tl.where(ok, h, 0.0)
    return h


# the lean kernel's E4M3 rounding (HARDWARE_E4M3): _e4m3_grid, a clamp and a conversion, the conversion alone
E4M3_ARITHMETIC, E4M3_CONVERT, E4M3_SATFINITE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _saturated(v):
    """v clamped to ±448, NaN kept: E4M3's saturating range, before a conversion rounds it (cvt.rn.satfinite
    saturates by itself: E4M3_SATFINITE, the GPU's; the interpreter's conversion, torch's, gives NaN past 464)."""
    v = tl.minimum(v, 448.0, propagate_nan=tl.PropagateNan.ALL)
    return tl.maximum(v, -448.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _score_units(x, score_zero, SCORE_MIN: tl.constexpr, SCORE_MAX: tl.constexpr, HAS_SCORE_Q: tl.constexpr,
                 FLOAT8: tl.constexpr, HARDWARE_E4M3: tl.constexpr):
    """(g, code): g the score rounded, in units of its scale (Q(x) - z: an integer, or an E4M3 value; x itself
    without score_quant), code its byte as an int32 in [0, 255] (the E4M3 bits, or Q(x)'s low byte), for _held.
    HARDWARE_E4M3 (E4M3_CONVERT or E4M3_SATFINITE): the conversion rounds (nearest-even: the op's x / s ->
    float8_e4m3fn), one cvt a pair of values where _e4m3_grid takes ~7 instructions a value; the compiler drops
    whichever of g and code goes unused."""
    if not HAS_SCORE_Q:
        return x, x.to(tl.int32, bitcast=True)
    if FLOAT8:
        if HARDWARE_E4M3:
            f8 = (x if HARDWARE_E4M3 == E4M3_SATFINITE else _saturated(x)).to(tl.float8e4nv)
            g = f8.to(tl.float32)
        else:
            g = _e4m3_grid(x, True)
            f8 = g.to(tl.float8e4nv)  # exact: g is on the grid
        return g, f8.to(tl.uint8, bitcast=True).to(tl.int32)
    g = _integer_grid(x, score_zero, SCORE_MIN, SCORE_MAX)
    return g, (g + score_zero).to(tl.int32) & 0xFF  # Q(x): an integer of [SCORE_MIN, SCORE_MAX], a byte's range


@triton.jit
def _held(word, SHIFT: tl.constexpr, score_zero, SCORE_MIN: tl.constexpr, FLOAT8: tl.constexpr):
    """The rounded score (units, as _score_units' g) whose byte sits at bit SHIFT of `word`: exact."""
    if FLOAT8:
        return ((word >> SHIFT) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if SCORE_MIN < 0:
        return ((word << (24 - SHIFT)) >> 24).to(tl.float32) - score_zero  # int8: the byte sign-extended
    return ((word >> SHIFT) & 0xFF).to(tl.float32) - score_zero


@triton.jit
def _masked(s, mask_base, offs_m, row_ok, start_n, T, stride_ms, stride_mt, HAS_MASK: tl.constexpr,
            MASK_BOOL: tl.constexpr, MASK_ROWS: tl.constexpr, FULL_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys [start_n, start_n + BLOCK_N)'s scores s with the mask applied: -inf past T."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    key_ok = offs_n < T
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
def _prob_units(p, prob_zero, PROB_MIN: tl.constexpr, PROB_MAX: tl.constexpr, FLOAT8: tl.constexpr,
                HARDWARE_E4M3: tl.constexpr):
    """p (in units of its scale, >= 0 or NaN) rounded as the op's prob_quant, as the fp16 the p·v dot takes."""
    if FLOAT8:
        if HARDWARE_E4M3 == E4M3_SATFINITE:
            return p.to(tl.float8e4nv).to(tl.float16)
        if HARDWARE_E4M3:
            return tl.minimum(p, 448.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float8e4nv).to(tl.float16)
        return _e4m3_grid(p, False).to(tl.float16)
    return _integer_grid(p, prob_zero, PROB_MIN, PROB_MAX).to(tl.float16)


@triton.jit
def _one_pass_lean_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr,
                          stride_qb, stride_qh, stride_qs, stride_qd,
                          stride_kb, stride_kh, stride_kt, stride_kd,
                          stride_vb, stride_vh, stride_vt, stride_vd,
                          stride_mb, stride_mh, stride_ms, stride_mt,
                          stride_ob, stride_oh, stride_os, stride_od,
                          S, T, kv_group, q_zero, k_zero, v_zero, score_multiplier, score_zero, score_scale,
                          prob_inverse, prob_zero, pv_scale, out_inverse, out_zero, opaque_zero,
                          HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, HAS_MASK: tl.constexpr,
                          MASK_BOOL: tl.constexpr, MASK_ROWS: tl.constexpr, HAS_SCORE_Q: tl.constexpr,
                          SCORE_MIN: tl.constexpr, SCORE_MAX: tl.constexpr, HAS_PROB_Q: tl.constexpr,
                          PROB_MIN: tl.constexpr, PROB_MAX: tl.constexpr, OUT: tl.constexpr, OUT_MIN: tl.constexpr,
                          OUT_MAX: tl.constexpr, NAN_TO_ZERO: tl.constexpr, FLOAT8: tl.constexpr,
                          HARDWARE_E4M3: tl.constexpr, HOLD: tl.constexpr, KV_HALF: tl.constexpr,
                          CHUNKS: tl.constexpr, FULL_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """_one_pass_kernel's arithmetic (the same roundings of the same fp32 values), issue 12's second round:
    - the next key block's (and value block's) load is issued before this block's dot, the tiles being unrolled
      (num_stages pipelines loops only): the 16-32-row kernel waited on each block's load;
    - the row max and sum are elementwise over [BM, BN] tiles, reduced across the row once (each tl.max / tl.sum of
      a tile whose warps split the keys is a shuffle tree and a barrier through shared memory);
    - HARDWARE_E4M3: E4M3 roundings are conversions (_score_units): E4M3_SATFINITE on the GPU (sm_90's
      cvt.rn.satfinite.e4m3x2.f32 saturates at ±448 and keeps NaN), E4M3_CONVERT (a clamp first) in the interpreter;
    - HOLD: each score is held as its 8-bit code, four to an int32 (_score_units, _held), and its exponential
      computed again for p: a 64- or 128-row tile (Hopper's wgmma, a warp owning whole rows: no cross-warp
      reductions) then holds 384-512 scores a row in 48-64 registers, where fp32 scores (exps) would take 192;
    - KV_HALF: k and v are fp16 (x8 - z) written by a pre-pass once a call, not converted by every row block.
    Every p·v product stays an exact fp16 one and every rounding the op's; the sums' order differs as before."""
    q, offs_m, row_ok, batch, head, k_base, v_base, mask_base = _program_rows(
        q_ptr, k_ptr, v_ptr, mask_ptr, stride_qb, stride_qh, stride_qs, stride_qd, stride_kb, stride_kh, stride_vb,
        stride_vh, stride_mb, stride_mh, S, kv_group, q_zero, HEAD_DIM, FLOAT8, BLOCK_M, BLOCK_D)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    held = ()  # HOLD: int32 [BM, BN] words, the codes of key blocks 4w .. 4w + 3
    scores = ()  # else: fp32 [BM, BN] tiles
    m_tile = tl.full([BLOCK_M, BLOCK_N], float("-inf"), dtype=tl.float32)
    k_next = _key_tile(k_base, 0, T, stride_kt, stride_kd, HEAD_DIM, BLOCK_D, BLOCK_N, FULL_BLOCKS)
    for c in tl.static_range(CHUNKS):
        k_stored = k_next
        if c + 1 < CHUNKS:
            k_next = _key_tile(k_base, (c + 1) * BLOCK_N, T, stride_kt, stride_kd, HEAD_DIM, BLOCK_D, BLOCK_N,
                               FULL_BLOCKS)
        offs_n = c * BLOCK_N + tl.arange(0, BLOCK_N)
        k = _exact_half(k_stored, (offs_d[:, None] < HEAD_DIM) & (offs_n < T)[None, :], k_zero, FLOAT8, KV_HALF,
                        FULL_BLOCKS)
        x = tl.dot(q, k) * score_multiplier  # exact products summed in fp32, then q̂·k̂ᵀ·scale / s_score
        g, code = _score_units(x, score_zero, SCORE_MIN, SCORE_MAX, HAS_SCORE_Q, FLOAT8, HARDWARE_E4M3)
        s = _masked(g * score_scale if HAS_SCORE_Q else g, mask_base, offs_m, row_ok, c * BLOCK_N, T, stride_ms,
                    stride_mt, HAS_MASK, MASK_BOOL, MASK_ROWS, FULL_BLOCKS, BLOCK_N)
        m_tile = tl.maximum(m_tile, s)
        if HOLD:
            if c % 4 == 0:
                word = code
            else:
                word = word | (code << (8 * (c % 4)))
            if c % 4 == 3 or c == CHUNKS - 1:
                held = held + (word ^ opaque_zero,)  # else the compiler sees each byte's code through the shifts
        else:
            scores = scores + (s,)
    m_i = tl.max(m_tile, 1)
    m_log2 = tl.where(m_i == float("-inf"), 0.0, m_i) * LOG2E  # every key hidden: no -inf - -inf
    v_next = _value_tile(v_base, 0, T, stride_vt, stride_vd, HEAD_DIM_V, BLOCK_N, BLOCK_DV, FULL_BLOCKS)
    exps = ()
    l_tile = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for c in tl.static_range(CHUNKS):
        if HOLD:
            s = _masked(_held(held[c // 4], 8 * (c % 4), score_zero, SCORE_MIN, FLOAT8) * score_scale,
                        mask_base + opaque_zero, offs_m, row_ok, c * BLOCK_N, T, stride_ms, stride_mt, HAS_MASK, MASK_BOOL, MASK_ROWS,
                        FULL_BLOCKS, BLOCK_N)
        else:
            s = scores[c]
        e = tl.math.exp2(s * LOG2E - m_log2[:, None])  # e^(s - max s): [BM, BN]
        l_tile += e
        if not HOLD:
            exps = exps + (e,)
    l_i = tl.sum(l_tile, 1)
    # l = 0: every key hidden, the op's softmax is NaN there (0 with nan_to_zero); a NaN l (a NaN score) stays NaN,
    # and so does every p of its row (the grids' clamps propagate NaN) up to the output's NaN test
    inverse_l = tl.where(l_i == 0.0, 0.0 if NAN_TO_ZERO else float("nan"), 1.0 / l_i)
    if HAS_PROB_Q:
        inverse_l = inverse_l * prob_inverse  # p / s_prob in one multiply
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for c in tl.static_range(CHUNKS):
        v_stored = v_next
        if c + 1 < CHUNKS:
            v_next = _value_tile(v_base, (c + 1) * BLOCK_N, T, stride_vt, stride_vd, HEAD_DIM_V, BLOCK_N, BLOCK_DV,
                                 FULL_BLOCKS)
        if HOLD:  # the same instructions on the same values as above: the same e (the word + 0 keeps the compiler
            # from reusing the first computation's, which would hold every e in registers: 255 and spills)
            s = _masked(_held(held[c // 4] + opaque_zero, 8 * (c % 4), score_zero, SCORE_MIN, FLOAT8) * score_scale,
                        mask_base - opaque_zero,
                        offs_m, row_ok, c * BLOCK_N, T, stride_ms, stride_mt, HAS_MASK, MASK_BOOL, MASK_ROWS,
                        FULL_BLOCKS, BLOCK_N)
            e = tl.math.exp2(s * LOG2E - m_log2[:, None])
        else:
            e = exps[c]
        p = e * inverse_l[:, None]  # p: [BM, BN], in units of the probability scale
        offs_n = c * BLOCK_N + tl.arange(0, BLOCK_N)
        v = _exact_half(v_stored, (offs_n < T)[:, None] & (offs_dv[None, :] < HEAD_DIM_V), v_zero, FLOAT8, KV_HALF,
                        FULL_BLOCKS)
        if HAS_PROB_Q:
            acc = tl.dot(_prob_units(p, prob_zero, PROB_MIN, PROB_MAX, FLOAT8, HARDWARE_E4M3), v, acc)  # exact
        else:
            acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
    _store_rows(acc, out_ptr, batch, head, offs_m, row_ok, stride_ob, stride_oh, stride_os, stride_od, pv_scale,
                out_inverse, out_zero, HEAD_DIM_V, OUT, OUT_MIN, OUT_MAX, NAN_TO_ZERO, BLOCK_DV)


ONE_PASS_MAX_CHUNKS = 8  # key blocks a one-pass program holds at most (its tactics hold 3-8: registers, spills)


def _block_dim(d: int) -> int:
    return max(16, triton.next_power_of_2(d))  # tl.dot wants every tile dim >= 16


def quantized_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
                        scale: float, q_quant: Quantization, k_quant: Quantization, v_quant: Quantization,
                        score_quant: Quantization | None, prob_quant: Quantization | None,
                        out_quant: Quantization | None, float8: bool, nan_to_zero: bool, out: torch.Tensor,
                        block_m: int = 64, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                        one_pass: bool = False, max_registers: int = 0, lean: bool = False, hold: bool = False,
                        kv_half: bool = False, hardware_e4m3: bool | None = None) -> torch.Tensor:
    """kiln::Attention's quantized form into `out` ([B, H, S, Dv] view; int8/uint8/float8_e4m3fn with out_quant,
    else float). q: [B, H, S, D], k: [B, Hkv, T, D], v: [B, Hkv, T, Dv], 8-bit (float8_e4m3fn with float8), any
    strides; mask: bool (True = attend) or additive float, broadcastable to [B, H, S, T]. one_pass: the kernel that
    holds a row block's scores (T <= ONE_PASS_MAX_CHUNKS·block_n; its tactics' tiles hold fewer without spilling),
    else the two-pass one; max_registers (one pass): ptxas's cap a thread (maxnreg), to fit more programs an SM.
    lean (one pass): _one_pass_lean_kernel, with `hold` (scores held as bytes; only with score_quant, else fp32),
    `kv_half` (k and v converted to fp16 once, by torch, before the kernel) and `hardware_e4m3` (E4M3 rounding by
    conversion: the default on CUDA tensors; the interpreter's conversion is right only with tests/kernels/conftest's
    fix, and after a clamp, which the GPU's saturating conversion needs not)."""
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
    if one_pass and lean and kv_half:  # x8 - z, exact in fp16: once, not once a row block
        k, v = (t.to(torch.float16) if float8 or not quant.zero else t.to(torch.float16).sub_(quant.zero)
                for t, quant in ((k, k_quant), (v, v_quant)))
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
        if lean:
            return _one_pass_lean(q, k, v, mask, mask_strides, out, grid, s_len, t_len, heads // kv_heads, q_quant,
                                  k_quant, v_quant, multiplier, score_quant, prob_quant, out_quant, kind, float8,
                                  nan_to_zero, block_m, block_n, num_warps, max_registers, hold, kv_half,
                                  q.is_cuda if hardware_e4m3 is None else hardware_e4m3)
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


def _one_pass_lean(q, k, v, mask, mask_strides, out, grid, s_len, t_len, kv_group, q_quant, k_quant, v_quant,
                   multiplier, score_quant, prob_quant, out_quant, kind, float8, nan_to_zero, block_m, block_n,
                   num_warps, max_registers, hold, kv_half, hardware_e4m3) -> torch.Tensor:
    """quantized_attention's launch of _one_pass_lean_kernel (its arguments, as _one_pass_kernel's)."""
    score = score_quant or Quantization(1.0)
    prob = prob_quant or Quantization(1.0)
    output = out_quant or Quantization(1.0)
    d, dv = q.shape[3], v.shape[3]
    _one_pass_lean_kernel[grid](
        q, k, v, mask if mask is not None else q, out, *q.stride(), *k.stride(), *v.stride(), *mask_strides,
        *out.stride(), s_len, t_len, kv_group, q_quant.zero, 0.0 if kv_half else k_quant.zero,
        0.0 if kv_half else v_quant.zero, multiplier, score.zero, score.scale, 1.0 / prob.scale, prob.zero,
        prob.scale * v_quant.scale, 1.0 / output.scale, output.zero, 0, HEAD_DIM=d, HEAD_DIM_V=dv,
        HAS_MASK=mask is not None, MASK_BOOL=mask is not None and mask.dtype == torch.uint8,
        MASK_ROWS=mask_strides[2] != 0, HAS_SCORE_Q=score_quant is not None, SCORE_MIN=score.qmin,
        SCORE_MAX=score.qmax, HAS_PROB_Q=prob_quant is not None, PROB_MIN=prob.qmin, PROB_MAX=prob.qmax, OUT=kind,
        OUT_MIN=output.qmin, OUT_MAX=output.qmax, NAN_TO_ZERO=bool(nan_to_zero), FLOAT8=bool(float8),
        HARDWARE_E4M3=(E4M3_ARITHMETIC if not (hardware_e4m3 and float8) else E4M3_SATFINITE if q.is_cuda
                       else E4M3_CONVERT).value,
        HOLD=bool(hold and score_quant is not None),
        KV_HALF=bool(kv_half), CHUNKS=triton.cdiv(t_len, block_n),
        FULL_BLOCKS=t_len % block_n == 0 and d == _block_dim(d) and dv == _block_dim(dv), BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=_block_dim(d), BLOCK_DV=_block_dim(dv), num_warps=num_warps, num_stages=1,
        **({"maxnreg": max_registers} if max_registers else {}))
    return out
