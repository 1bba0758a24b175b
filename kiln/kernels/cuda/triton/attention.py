"""Forward flash attention (kiln::Attention): out = softmax(q·kᵀ·scale + mask)·v, never materialising q·kᵀ.

Each program owns BLOCK_M query rows of one (batch, head) and walks the keys in BLOCK_N blocks,
keeping the running row maximum m, the running denominator l and the fp32 accumulator acc in
registers (online softmax): for each key block, with s = q·kᵀ·scale·log2(e) (+ mask·log2(e)),

    m' = max(m, rowmax(s)),   p = 2^(s - m'),   l = l·2^(m - m') + rowsum(p),   acc = acc·2^(m - m') + p·v

and out = acc / l at the end. log2(e) is folded into the scale so the exponential is one exp2.

Every tensor is addressed through four strides (B, H, S, D), so the layouts kiln's optimizer
hands the op need no copies: q, k and v as column slices of one [B, S, 3·H·D] QKV GEMM output,
[B, S, H, D] views permuted to [B, H, S, D], and the output written straight into a [B, S, H, D]
buffer (out_perm + out_merge_heads are then free views). A mask broadcast to [B, H, S, T] has
stride 0 on its broadcast axes; a [B, 1, 1, T] padding mask is read as one key vector per block.
Grouped-query attention maps query head h to key/value head h // (H / Hkv): no repeat_interleave.

Key blocks are visited in two loops: the blocks every query row of the tile sees in full (no
causal or tail test per element), then the diagonal / tail blocks, which test each key.

A padding mask that keeps a prefix of each sequence's keys is a length per sequence: given key
lengths (int32 [B], kiln/ops/tokens.py `key_lengths`), a program whose length is n >= 0 walks keys
0..n-1 only and never reads the mask (a full mask costs what no mask costs, a half-padded row half
the work); a length of -1 (left padding, holes) takes the mask path. One branch per program.

FP8 (Float8Scales: an FP8 engine's attention, issue 12): both products run on Hopper's E4M3 tensor cores. q, k and v
are E4M3 at one scale each (x = x8·s): an E4M3 input is read as is, a float16/bfloat16 one is put on the grid as it
is loaded (x / s, saturating); s_q·s_k folds into the exponent's scale. The probabilities are E4M3 too, at the
fixed scale 1/448 (P_SCALE): p' = 448·2^(s - m') = 2^(s - (m' - log2 448)), so the exponent's one subtraction
scales them and p' <= 448 uses E4M3's whole range (p <= 1 as is would leave its top eight binades empty and
flush every p < 2^-9 to zero). The row sum l is taken over p' before its rounding, so the 448 cancels in
acc / l, and s_v (over the output's scale, for an E4M3 output) is one multiply per row at the end.
On Hopper the E4M3 products accumulate with ~13 mantissa bits inside the wgmma (not fp32): q·kᵀ was off by up to
1.7e-4 of Σ|q_i·k_i| on the H200 (BERT-like scores, 2026-12-04), moving p by ~1e-3 relative, far under its E4M3
rounding (2^-4), but enough to round a p' near a grid midpoint the other way than a float64 reference does.
Float8Scales.pv False keeps p·v in v's half dtype (q·kᵀ alone in E4M3): Hopper's E4M3 wgmma reads its B operand
K-major, so p·v in E4M3 wants v stored keys-contiguous, which a QKV GEMM's [B, S, 3·H·D] output is not.

Semantics follow kiln/ops/fused.py `attention` (torch SDPA): a mask that is not bool is first
rounded to q's dtype; causal is top-left aligned (query i sees keys 0..i); a row whose every
key is masked gives 0, as torch's SDPA does, and nan_to_zero also maps NaN to 0 and ±inf to the
dtype's largest finite value (torch.nan_to_num).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.kernels.cuda.triton import qmath

LOG2E = 1.4426950408889634  # log2(e): e^x = 2^(x·log2 e)
MAX_HEAD_DIM = 128  # one register tile of q and of acc per program; wider heads spill (SDPA covers them)
HALF_DTYPES = (torch.float16, torch.bfloat16)
FP8_DTYPE = torch.float8_e4m3fn
P_SCALE = 1.0 / 448.0  # the E4M3 probabilities' fixed scale: p' = p / P_SCALE <= 448, E4M3's largest value
LOG2_INVERSE_P_SCALE = 8.807354922057604  # log2(448)


@dataclass(frozen=True)
class AttentionConfig:
    block_m: int  # query rows per program
    block_n: int  # keys per inner step
    num_warps: int = 4
    num_stages: int = 2

    @property
    def name(self) -> str:
        return f"{self.block_m}x{self.block_n}.w{self.num_warps}s{self.num_stages}"


@dataclass(frozen=True)
class Float8Scales:
    """E4M3 attention: the per-tensor scales of q, k and v (x = x8·scale) and of an E4M3 output (None: the output
    is float16/bfloat16); `pv`: whether p·v runs in E4M3 as well as q·kᵀ."""
    q: float
    k: float
    v: float
    out: float | None = None
    pv: bool = True  # p·v in E4M3 too; False: q·kᵀ only, p·v in v's float16/bfloat16 (v unscaled, s_v unused)

    def __post_init__(self):
        for name in ("q", "k", "v", "out"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"Float8Scales.{name} = {value}: a scale must be positive and finite")


ATTENTION_CONFIGS = (  # Hopper-friendly tiles (Triton's fused-attention tutorial); the tactics time them
    AttentionConfig(128, 64, num_warps=4, num_stages=3),
    AttentionConfig(128, 128, num_warps=8, num_stages=3),
    AttentionConfig(64, 64, num_warps=4, num_stages=3),
    AttentionConfig(128, 32, num_warps=4, num_stages=2),
    AttentionConfig(64, 32, num_warps=4, num_stages=2),
    AttentionConfig(64, 128, num_warps=4, num_stages=2),
    AttentionConfig(128, 64, num_warps=8, num_stages=2),
)


@triton.jit
def _to_e4m3(x, inverse_scale, HARDWARE_E4M3: tl.constexpr):
    """x / scale on the E4M3 grid (saturating at ±448); an E4M3 x as it is. HARDWARE_E4M3: the conversion
    rounds (cvt.rn.satfinite on sm_90); the interpreter's conversion does not round correctly (qmath)."""
    if x.dtype == tl.float8e4nv:
        return x
    v = x.to(tl.float32) * inverse_scale
    if not HARDWARE_E4M3:
        v = qmath.round_to_e4m3(v)
    return v.to(tl.float8e4nv)


@triton.jit
def _attend_key_blocks(acc, l_i, m_i, q, k_base, v_base, mask_base, offs_m, mask_rows, start, end, T,
                       stride_kt, stride_kd, stride_vt, stride_vd, stride_ms, stride_mt, qk_scale, k_inverse,
                       v_inverse, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, HAS_MASK: tl.constexpr,
                       MASK_BOOL: tl.constexpr, MASK_ROWS: tl.constexpr, CAUSAL: tl.constexpr,
                       CHECK_KEYS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_DV: tl.constexpr, STAGES: tl.constexpr, HARDWARE_E4M3: tl.constexpr,
                       PV_FP8: tl.constexpr):
    """Key blocks [start, end) folded into (acc, l, m). CHECK_KEYS: test key < T; CAUSAL: key <= query.
    An E4M3 q (FP8 products): k put on the grid at 1 / k_inverse as it is loaded; PV_FP8: v too (at 1 / v_inverse)
    and the probabilities, else p·v in v's half dtype."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < HEAD_DIM  # constant-folded when HEAD_DIM == BLOCK_D
    dv_ok = offs_dv < HEAD_DIM_V
    for start_n in tl.range(start, end, BLOCK_N, num_stages=STAGES):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # offs_n: [BN]
        k_ptrs = k_base + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kt  # kᵀ tile: [BD, BN]
        v_ptrs = v_base + offs_n[:, None] * stride_vt + offs_dv[None, :] * stride_vd  # v tile: [BN, BDV]
        if CHECK_KEYS:
            key_ok = offs_n < T
            k = tl.load(k_ptrs, mask=d_ok[:, None] & key_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=key_ok[:, None] & dv_ok[None, :], other=0.0)  # padding rows: 0, not garbage
        else:
            k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=dv_ok[None, :], other=0.0)
        if q.dtype == tl.float8e4nv:
            k = _to_e4m3(k, k_inverse, HARDWARE_E4M3)
        if PV_FP8:
            v = _to_e4m3(v, v_inverse, HARDWARE_E4M3)
        qk = tl.dot(q, k)  # qk: [BM, BN] fp32, not yet scaled
        if HAS_MASK:
            if MASK_ROWS:  # [.., S, T] masks: one value per (query, key)
                m_ptrs = mask_base + mask_rows[:, None] * stride_ms + offs_n[None, :] * stride_mt
                if CHECK_KEYS:
                    bias = tl.load(m_ptrs, mask=key_ok[None, :], other=0)
                else:
                    bias = tl.load(m_ptrs)
            else:  # [.., 1, T] padding masks: one key vector, the same for every query row
                m_ptrs = mask_base + offs_n * stride_mt
                if CHECK_KEYS:
                    bias = tl.load(m_ptrs, mask=key_ok, other=0)[None, :]
                else:
                    bias = tl.load(m_ptrs)[None, :]
            if MASK_BOOL:
                qk = tl.where(bias != 0, qk, float("-inf"))
            elif q.dtype == tl.float8e4nv:  # the op's q is then float32 (dequantized): the mask is not rounded
                qk = qk * qk_scale + bias.to(tl.float32) * 1.4426950408889634
            else:  # scaled now, in log2 units; the op rounds an additive mask to q's dtype before adding it
                qk = qk * qk_scale + bias.to(q.dtype).to(tl.float32) * 1.4426950408889634
        if CAUSAL:
            qk = tl.where(offs_m[:, None] >= offs_n[None, :], qk, float("-inf"))
        if CHECK_KEYS:
            qk = tl.where(key_ok[None, :], qk, float("-inf"))
        # Without an additive mask qk is still unscaled: as the scale is positive, the row maximum is taken
        # first and the scaling folds into the one FMA of the exponent (softmax is ALU-bound at these sizes).
        if HAS_MASK and not MASK_BOOL:  # constexpr: resolved at compile time
            m_new = tl.maximum(m_i, tl.max(qk, 1))
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        if HAS_MASK:  # only a mask can hide every key seen so far: keep 2^(-inf - -inf) from making NaN
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new
        if PV_FP8:  # p' = p / P_SCALE = 2^(s - (m' - log2 448)): E4M3's whole range
            m_shift = m_new_safe - 8.807354922057604
        else:
            m_shift = m_new_safe
        if HAS_MASK and not MASK_BOOL:
            p = tl.math.exp2(qk - m_shift[:, None])  # p: [BM, BN]
        else:
            p = tl.math.exp2(qk * qk_scale - m_shift[:, None])
        alpha = tl.math.exp2(m_i - m_new_safe)  # rescales what was accumulated under the old maximum
        l_i = l_i * alpha + tl.sum(p, 1)
        if PV_FP8:
            p = _to_e4m3(p, 1.0, HARDWARE_E4M3)
        else:
            p = p.to(v.dtype)
        acc = tl.dot(p, v, acc * alpha[:, None])  # acc: [BM, BDV] fp32
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attend_keys(acc, l_i, m_i, q, k_base, v_base, mask_base, offs_m, mask_rows, start_m, T,
                 stride_kt, stride_kd, stride_vt, stride_vd, stride_ms, stride_mt, qk_scale, k_inverse, v_inverse,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
                 MASK_ROWS: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, STAGES: tl.constexpr, HARDWARE_E4M3: tl.constexpr,
                 PV_FP8: tl.constexpr):
    """Keys 0..T-1 folded into (acc, l, m): the blocks every query row of the tile sees in full, then the rest.
    STAGES: the key loops' software pipeline depth; None: the launch's num_stages."""
    whole_blocks_end = (T // BLOCK_N) * BLOCK_N  # key blocks with no tail
    if CAUSAL:  # blocks whose last key is <= the tile's first query are seen in full by every row
        full_end = tl.minimum(((start_m + 1) // BLOCK_N) * BLOCK_N, whole_blocks_end)
        end = tl.minimum(T, start_m + BLOCK_M)
    else:
        full_end = whole_blocks_end
        end = T
    acc, l_i, m_i = _attend_key_blocks(acc, l_i, m_i, q, k_base, v_base, mask_base, offs_m, mask_rows, 0, full_end,
                                       T, stride_kt, stride_kd, stride_vt, stride_vd, stride_ms, stride_mt, qk_scale,
                                       k_inverse, v_inverse, HEAD_DIM, HEAD_DIM_V, HAS_MASK, MASK_BOOL, MASK_ROWS,
                                       False, False, BLOCK_N, BLOCK_D, BLOCK_DV, STAGES, HARDWARE_E4M3, PV_FP8)
    return _attend_key_blocks(acc, l_i, m_i, q, k_base, v_base, mask_base, offs_m, mask_rows, full_end, end, T,
                              stride_kt, stride_kd, stride_vt, stride_vd, stride_ms, stride_mt, qk_scale,
                              k_inverse, v_inverse, HEAD_DIM, HEAD_DIM_V, HAS_MASK, MASK_BOOL, MASK_ROWS, CAUSAL,
                              True, BLOCK_N, BLOCK_D, BLOCK_DV, STAGES, HARDWARE_E4M3, PV_FP8)


@triton.jit
def _flash_attention_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, key_lengths_ptr, out_ptr,
                            stride_qb, stride_qh, stride_qs, stride_qd,
                            stride_kb, stride_kh, stride_kt, stride_kd,
                            stride_vb, stride_vh, stride_vt, stride_vd,
                            stride_mb, stride_mh, stride_ms, stride_mt,
                            stride_ob, stride_oh, stride_os, stride_od,
                            S, T, kv_group, qk_scale, q_inverse, k_inverse, v_inverse, out_scale, out_max,
                            HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, HAS_MASK: tl.constexpr,
                            MASK_BOOL: tl.constexpr, MASK_ROWS: tl.constexpr, CAUSAL: tl.constexpr,
                            HAS_KEY_LENGTHS: tl.constexpr, NAN_TO_ZERO: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                            FP8: tl.constexpr, HARDWARE_E4M3: tl.constexpr, PV_FP8: tl.constexpr):
    """FP8: q·kᵀ in E4M3 (q, k put on the grid at 1 / *_inverse where they are not E4M3 already), PV_FP8: p·v too;
    out_scale multiplies the output (1, or s_v, over an E4M3 output's scale)."""
    pid_m = tl.program_id(0)
    if CAUSAL:  # the last query tiles see the most keys: start them first so the short ones fill the tail
        pid_m = tl.num_programs(0) - 1 - pid_m
    head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)  # 64-bit slab offsets; offsets inside one (batch, head) fit 32 bits
    kv_head = (head // kv_group).to(tl.int64)
    head = head.to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)  # offs_m: [BM]
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < S

    q_ptrs = q_ptr + batch * stride_qb + head * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)  # q: [BM, BD]
    if FP8:
        q = _to_e4m3(q, q_inverse, HARDWARE_E4M3)
    k_base = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head * stride_vh
    mask_base = mask_ptr + batch * stride_mb + head * stride_mh
    mask_rows = tl.minimum(offs_m, S - 1)  # rows past S read row S-1 of the mask (their output is not stored)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if HAS_KEY_LENGTHS:
        key_length = tl.load(key_lengths_ptr + batch)
        if key_length >= 0:  # the batch's keys are its first key_length: no mask read, no key past them visited
            acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, k_base, v_base, mask_base, offs_m, mask_rows, start_m,
                                         tl.minimum(key_length, T), stride_kt, stride_kd, stride_vt, stride_vd,
                                         stride_ms, stride_mt, qk_scale, k_inverse, v_inverse, HEAD_DIM, HEAD_DIM_V,
                                         False, False, False, False, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, None,
                                         HARDWARE_E4M3, PV_FP8)
        else:  # -1: the mask says which keys (not a prefix of them). Unpipelined: its mask buffers and registers
            # would lower the occupancy of the length path, the one that runs where the mask is a padding mask
            acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, k_base, v_base, mask_base, offs_m, mask_rows, start_m, T,
                                         stride_kt, stride_kd, stride_vt, stride_vd, stride_ms, stride_mt, qk_scale,
                                         k_inverse, v_inverse, HEAD_DIM, HEAD_DIM_V, HAS_MASK, MASK_BOOL, MASK_ROWS,
                                         CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, 1, HARDWARE_E4M3, PV_FP8)
    else:
        acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, k_base, v_base, mask_base, offs_m, mask_rows, start_m, T,
                                     stride_kt, stride_kd, stride_vt, stride_vd, stride_ms, stride_mt, qk_scale,
                                     k_inverse, v_inverse, HEAD_DIM, HEAD_DIM_V, HAS_MASK, MASK_BOOL, MASK_ROWS,
                                     CAUSAL, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, None, HARDWARE_E4M3, PV_FP8)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # a row with every key masked: acc is 0, and so is its output
    out = acc * (out_scale / l_safe)[:, None]
    if NAN_TO_ZERO:  # torch.nan_to_num: NaN -> 0, ±inf -> the largest finite value of the output dtype
        out = tl.where(out != out, 0.0, out)
        out = tl.minimum(tl.maximum(out, -out_max), out_max)
    if out_ptr.dtype.element_ty == tl.float8e4nv and not HARDWARE_E4M3:  # the store's conversion rounds on the GPU
        out = qmath.round_to_e4m3(out)
    o_ptrs = (out_ptr + batch * stride_ob + head * stride_oh + offs_m[:, None] * stride_os
              + offs_dv[None, :] * stride_od)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))


def _block_dim(d: int) -> int:
    return max(16, triton.next_power_of_2(d))  # tl.dot wants every tile dim >= 16


def _extent(t: torch.Tensor, dims: tuple[int, ...]) -> int:
    """The largest element offset inside one (batch, head) slab: it is computed in 32 bits."""
    return sum((t.shape[d] - 1) * abs(t.stride(d)) for d in dims)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                    key_lengths: torch.Tensor | None = None, *, scale: float | None = None, is_causal: bool = False,
                    nan_to_zero: bool = False, out: torch.Tensor | None = None,
                    config: AttentionConfig | None = None, fp8: Float8Scales | None = None) -> torch.Tensor:
    """softmax(q·kᵀ·scale + mask)·v in q's dtype (fp16/bf16), accumulated in fp32.

    q: [B, H, S, D]; k: [B or 1, Hkv, T, D]; v: [B or 1, Hkv, T, Dv], any strides, H a multiple of
    Hkv (grouped-query attention). mask: bool (True = attend) or additive float, broadcastable to
    [B, H, S, T]; is_causal (top-left aligned) applies only without a mask, as in the op. out: the
    [B, H, S, Dv] view to write into (e.g. a permuted view of a [B, S, H, Dv] buffer); allocated
    when None. scale: positive; None is 1/sqrt(D).
    key_lengths: int32 [B], a padding mask's per-sequence length (kiln/ops/tokens.py `key_lengths`): where
    key_lengths[b] >= 0, batch b attends to its first key_lengths[b] keys and its mask is not read (the key loop
    stops there: a full mask costs what no mask costs); where it is negative, the mask applies. Not with is_causal.
    fp8: E4M3 products at these scales (the module's docstring): q, k and v each float8_e4m3fn (x8·scale) or
    float16/bfloat16 (quantized as loaded); the output float16 (or `out`'s bfloat16), E4M3 with fp8.out.
    """
    if fp8 is None and (q.dtype not in HALF_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype):
        raise TypeError(f"flash_attention: q, k and v must share float16 or bfloat16, "
                        f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if fp8 is not None and any(t.dtype not in (FP8_DTYPE, *HALF_DTYPES) for t in (q, k, v)):
        raise TypeError(f"flash_attention: FP8 attention reads float8_e4m3fn, float16 or bfloat16 q, k and v, "
                        f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if fp8 is not None and not fp8.pv and v.dtype not in HALF_DTYPES:
        raise TypeError(f"flash_attention: p·v in half precision (Float8Scales.pv False) reads a float16 or "
                        f"bfloat16 v, got {v.dtype}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"flash_attention: q, k, v must be [B, H, S, D], got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    batch, heads, s_len, d = q.shape
    kv_heads, t_len, dv = k.shape[1], k.shape[2], v.shape[3]
    if k.shape[3] != d or v.shape[1:3] != k.shape[1:3] or k.shape[0] not in (1, batch) or v.shape[0] != k.shape[0]:
        raise ValueError(f"flash_attention: k {tuple(k.shape)} / v {tuple(v.shape)} do not fit q {tuple(q.shape)}")
    if heads % kv_heads:
        raise ValueError(f"flash_attention: {heads} query heads are not a multiple of {kv_heads} key/value heads")
    if max(d, dv) > MAX_HEAD_DIM:
        raise ValueError(f"flash_attention: head dims {d}/{dv} exceed {MAX_HEAD_DIM}")
    if fp8 is None:
        out_dtypes = (q.dtype,)
    elif fp8.out is not None:
        out_dtypes = (FP8_DTYPE,)
    else:
        out_dtypes = next(((t.dtype,) for t in (v, q) if t.dtype in HALF_DTYPES), HALF_DTYPES)
    if out is None:
        out = torch.empty((batch, heads, s_len, dv), dtype=out_dtypes[0], device=q.device)
    elif out.shape != (batch, heads, s_len, dv) or out.dtype not in out_dtypes:
        raise ValueError(f"flash_attention: out is {out.dtype}{tuple(out.shape)}, "
                         f"expected {' or '.join(map(str, out_dtypes))}{(batch, heads, s_len, dv)}")
    if key_lengths is not None:
        if key_lengths.dtype != torch.int32 or key_lengths.shape != (batch,) or key_lengths.device != q.device:
            raise ValueError(f"flash_attention: key_lengths must be int32 [{batch}] on {q.device}, got "
                             f"{key_lengths.dtype}{tuple(key_lengths.shape)} on {key_lengths.device}")
        if is_causal:
            raise ValueError("flash_attention: key_lengths with is_causal: a causal mask is not a prefix of keys")
    if out.numel() == 0:
        return out
    if t_len == 0:  # no keys: every row is fully masked
        return out.zero_()
    k, v = k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)  # a batch-broadcast k/v: stride 0
    mask_strides = (0, 0, 0, 0)
    if mask is not None:
        mask = mask.expand(batch, heads, s_len, t_len)  # broadcast axes: stride 0, nothing copied
        if mask.dtype == torch.bool:
            mask = mask.view(torch.uint8)  # the same bytes; Triton loads i1 pointers less portably
        elif not mask.dtype.is_floating_point:
            raise TypeError(f"flash_attention: the mask must be bool or float, got {mask.dtype}")
        mask_strides = mask.stride()
    extents = [_extent(q, (2, 3)), _extent(k, (2, 3)), _extent(v, (2, 3)), _extent(out, (2, 3))]
    if mask is not None:
        extents.append(_extent(mask, (2, 3)))
    if max(extents) >= 2**31:
        raise ValueError("flash_attention: one (batch, head) slab spans more than 2^31 elements")
    if max(heads, batch) > 65535:
        raise ValueError(f"flash_attention: {batch} batches x {heads} heads exceed the 65535 grid limit per axis")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if not scale > 0:  # the kernel takes the row maximum before scaling
        raise ValueError(f"flash_attention: scale {scale} is not positive")
    qk_scale, inverses, out_scale = scale * LOG2E, (1.0, 1.0, 1.0), 1.0
    if fp8 is not None:  # x = x8·s: s_q·s_k scales the scores, s_v (over the output's scale) the output
        qk_scale *= fp8.q * fp8.k
        inverses = (1.0 / fp8.q, 1.0 / fp8.k, 1.0 / fp8.v)
        out_scale = (fp8.v if fp8.pv else 1.0) / (fp8.out if fp8.out is not None else 1.0)
    config = config or default_config(s_len)
    grid = (triton.cdiv(s_len, config.block_m), heads, batch)
    _flash_attention_kernel[grid](
        q, k, v, mask if mask is not None else q, key_lengths if key_lengths is not None else q, out,
        *q.stride(), *k.stride(), *v.stride(), *mask_strides, *out.stride(),
        s_len, t_len, heads // kv_heads, qk_scale, *inverses, out_scale, float(torch.finfo(out.dtype).max),
        HEAD_DIM=d, HEAD_DIM_V=dv, HAS_MASK=mask is not None, MASK_BOOL=mask is not None and mask.dtype == torch.uint8,
        MASK_ROWS=mask is not None and mask_strides[2] != 0 and s_len > 1, CAUSAL=bool(is_causal) and mask is None,
        HAS_KEY_LENGTHS=key_lengths is not None, NAN_TO_ZERO=bool(nan_to_zero), BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_D=_block_dim(d), BLOCK_DV=_block_dim(dv), FP8=fp8 is not None,
        HARDWARE_E4M3=fp8 is not None and q.is_cuda, PV_FP8=fp8 is not None and fp8.pv, num_warps=config.num_warps,
        num_stages=config.num_stages)
    return out


def default_config(s_len: int) -> AttentionConfig:
    """A starting point only (the tactics time every config): 64-row tiles for short sequences."""
    return ATTENTION_CONFIGS[0] if s_len > 64 else ATTENTION_CONFIGS[2]
