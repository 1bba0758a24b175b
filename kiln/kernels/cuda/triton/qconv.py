"""A Triton 2-D convolution of 8-bit operands as an implicit GEMM, the requantizing epilogue fused
(kiln::QConv's arithmetic, kiln/ops/quantized.py).

    acc[n, co, oh, ow] = Σ_{r,s,c} (x[n, c, oh·SH − PT + r·DH, ow·SW − PL + s·DW] − x_zero)·w[co, c, r, s]
    y = requantize((acc + bias[co])·scale[co])                          kiln/kernels/cuda/triton/qmath.py

Rows M = N·Ho·Wo output pixels of a dense NHWC x, columns Cout, reduction K = KH·KW·Cin, in one of
three loops (`loop_of`):

  - "gemm": a 1x1, stride-1, unpadded convolution is x viewed as [N·H·W, Cin] times wᵀ: no index math;
  - "taps": one loop over (tap, channel block) steps, so that the software pipeline runs across taps;
    a tap's bounds are one [BM] vector per step;
  - "flat": K decomposed per element, for Cin below BLOCK_K (the 7x7 stem's 3 channels).

What makes it fast on Hopper (sm_90, measured in bench/qconv_sweep.py): no load in the loop has a row
or column mask or a non-zero `other`. A masked load whose `other` is x's zero point cannot be a
zero-filling cp.async, so Triton copied each A tile through registers (select, store back to shared
memory) and waited for every wgmma before the next (seen in the sm_90 PTX of the previous kernel).
Instead, padded taps point at `padding`, a row of Cin zero points (`padding_row`): (z − z)·w = 0, as
the reference's zero padding of the real values; tail rows and columns read the last pixel/channel and
are not stored.

  - operands are int8 (uint8 x flipped to x − 128 in registers) with an int32 accumulator, or
    float8e4m3fn with an fp32 one (partial sums promoted every K step when `fp8_precise`, as qgemm.py);
  - the weight is packed K-major, [Cout, KH·KW·Cin] (`pack_weight`): the layout wgmma reads 8-bit
    B operands in;
  - x's zero point is not subtracted per element: the caller folds −z·Σw into the int32 bias
    (qgemm.fold_zero_point).

Output: [N, Cout, Ho, Wo] with channels-last strides, in the epilogue's dtype.

With a residual (kiln::QConv inputs 9-13, qresidual.ResidualAdd): the epilogue rounds to the layer's own
8-bit result c (int8/uint8 or E4M3, in fp32 as any output), loads the residual tile (dense NHWC, the output's
offsets) and writes requantize(act((c − z_c)·s_c + (res − z_r)·s_r)) in the sum's dtype: kiln::QConv ->
kiln::QAdd on the tile, each rounding within a step of the reference's (the unfused pair's tolerance,
kiln/tactics/cuda/quant_residual_check.py); the 8-bit c never goes to memory and the add's separate
read-read-write pass is gone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.kernels.cuda.triton import device_math as dm
from kiln.kernels.cuda.triton import qmath
from kiln.kernels.cuda.triton.qgemm import INT_RANGE, QUANTIZED_INPUTS, Epilogue
from kiln.kernels.cuda.triton.qresidual import ResidualAdd


@dataclass(frozen=True)
class QConvConfig:
    block_m: int  # output pixels per tile
    block_n: int  # output channels per tile
    block_k: int  # reduction entries per step
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    fp8_precise: bool = True  # FP8: promote the tensor cores' partial sums to fp32 every K step
    prescaled: bool = False  # the caller folds y_scale into the scale (Epilogue.prescale): a multiply per output
    mma_f16: bool = False  # int8 layers on fp16 tensor cores, fp32 accumulator (pack_weight(w, fp16=True))
    persistent: int = 0  # > 0: the 1x1 GEMM loop as that many programs per SM walking the tiles

    @property
    def name(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}"

    @property
    def label(self) -> str:
        """The name with everything else that makes a different kernel (tactic names, sweep tables)."""
        return f"{self.name}w{self.num_warps}s{self.num_stages}" + ("" if self.fp8_precise else "f") + \
            ("p" if self.prescaled else "") + ("h" if self.mma_f16 else "") + \
            (f"P{self.persistent}" if self.persistent else "")


QCONV_CONFIGS = (  # largest first; BLOCK_K 64 keeps ResNet's Cin = 64 layers on the by-tap loop
    QConvConfig(256, 128, 64, num_warps=8, num_stages=4),
    QConvConfig(128, 128, 128, num_warps=8, num_stages=3),
    QConvConfig(128, 128, 64, num_warps=8, num_stages=4),
    QConvConfig(128, 64, 64, num_warps=4, num_stages=4),
    QConvConfig(64, 64, 64, num_warps=4, num_stages=4),  # batch 1: 7x7 and 14x14 stages
)


def _residual_args(residual_add: ResidualAdd | None) -> dict:
    """The kernels' residual constexprs (placeholders when there is none: RESIDUAL = False reads none)."""
    if residual_add is None:
        return dict(RESIDUAL=False, R_ACTIVATION="", R_OUT=0, R_QMIN=0, R_QMAX=0)
    qmin, qmax = residual_add.qrange
    return dict(RESIDUAL=True, R_ACTIVATION=residual_add.activation, R_OUT=residual_add.out_kind, R_QMIN=qmin,
                R_QMAX=qmax)


def _residual_values(residual_add: ResidualAdd | None) -> tuple[float, ...]:
    """The sum's a_multiplier, a_zero, b_multiplier, b_zero, y_zero (ResidualAdd.multipliers); placeholders
    without a residual."""
    r = residual_add
    if r is None:
        return (0.0,) * 5
    a, b = r.multipliers
    return a, float(r.a_zero), b, float(r.b_zero), float(r.y_zero)


@triton.jit
def _epilogue(acc, rm, rn, M, Cout, scale_ptr, bias_ptr, out_ptr, res_ptr,
              y_scale, y_zero, alpha, beta, ra_multiplier, ra_zero, rb_multiplier, rb_zero, ry_zero,
              FP8: tl.constexpr, HAS_BIAS: tl.constexpr, PRESCALED: tl.constexpr, ACTIVATION: tl.constexpr,
              OUT: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr, RESIDUAL: tl.constexpr,
              R_ACTIVATION: tl.constexpr, R_OUT: tl.constexpr, R_QMIN: tl.constexpr, R_QMAX: tl.constexpr):
    """acc [BM, BN] of output pixels rm, channels rn to the NHWC output: bias, per-channel scale, activation,
    the output's quantization (qmath.finish / finish_prescaled); with RESIDUAL that is the layer's own 8-bit
    result c, and the residual tile at the same offsets is added and the sum requantized (qmath.add_quantized).
    Rows past M and columns past Cout are computed from clamped reads, not stored."""
    col_ok = (rn < Cout)[None, :]  # [1, BN]
    scale = tl.load(scale_ptr + rn[None, :], mask=col_ok, other=0.0)  # [1, BN]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rn[None, :], mask=col_ok, other=0.0 if FP8 else 0)
    else:
        bias = scale  # not read
    offs = rm[:, None].to(tl.int64) * Cout + rn[None, :]  # NHWC: [M, Cout] row-major
    mask = (rm < M)[:, None] & col_ok
    if PRESCALED:  # y_scale is 1: scale is the multiplier scale / y_scale
        y = qmath.finish_prescaled(acc, bias, scale, y_zero, alpha, beta, HAS_BIAS, ACTIVATION, OUT, QMIN, QMAX)
    else:
        y = qmath.finish(acc, bias, scale, y_scale, y_zero, alpha, beta, HAS_BIAS, ACTIVATION, OUT, QMIN, QMAX)
    if RESIDUAL:  # y is c: a whole number in range or an E4M3 grid value, in fp32
        res = qmath.to_float(tl.load(res_ptr + offs, mask=mask, other=0.0 if FP8 else 0))  # FP8: E4M3 throughout
        y = qmath.add_quantized(y, res, ra_multiplier, ra_zero, rb_multiplier, rb_zero, ry_zero, 0.0, 0.0,
                                R_ACTIVATION, R_OUT, R_QMIN, R_QMAX)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dot_step(acc, a, b, FP8: tl.constexpr, FP8_PRECISE: tl.constexpr, X_UNSIGNED: tl.constexpr,
              MMA_F16: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += a @ b on the tensor cores: int8 x int8 -> int32 (triton 3.6 wants out_dtype with an int
    accumulator), e4m3 x e4m3 -> fp32 (promoted to a CUDA-core fp32 add every K step when precise), or
    int8 x (int8 values in fp16) -> fp32 with MMA_F16."""
    if FP8:
        if FP8_PRECISE:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(a, b, acc)  # Hopper's own accumulation (~14 bits of the fp32 sum, as cuBLASLt's fast mode)
    else:
        if X_UNSIGNED:
            a = (a ^ 0x80).to(tl.int8, bitcast=True)  # x − 128: its zero point moved with it (fold_zero_point)
        if MMA_F16:
            # Triton keeps only fp32-accumulator wgmma in flight across iterations (an int32 one is waited
            # for at once): x converted in registers, w packed as fp16, products exact, sums exact below 2^24
            acc = tl.dot(a.to(tl.float16), b, acc)
        else:
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    return acc


@triton.jit
def _qconv_kernel(x_ptr, pad_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr, res_ptr,
                  M, Cout, Cin, H, W, Ho, Wo, sxn, sxh, sxw,
                  SH, SW, PT, PL, DH, DW, y_scale, y_zero, alpha, beta,
                  ra_multiplier, ra_zero, rb_multiplier, rb_zero, ry_zero,
                  KH: tl.constexpr, KW: tl.constexpr, LOOP: tl.constexpr, EVEN_K: tl.constexpr, FP8: tl.constexpr,
                  FP8_PRECISE: tl.constexpr, X_UNSIGNED: tl.constexpr, HAS_BIAS: tl.constexpr, PRESCALED: tl.constexpr,
                  MMA_F16: tl.constexpr, ACTIVATION: tl.constexpr, OUT: tl.constexpr, QMIN: tl.constexpr,
                  QMAX: tl.constexpr, RESIDUAL: tl.constexpr, R_ACTIVATION: tl.constexpr, R_OUT: tl.constexpr,
                  R_QMIN: tl.constexpr, R_QMAX: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    tile_m, tile_n = dm.grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(Cout, BLOCK_N), GROUP_M)
    rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # output pixels: [BM]
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output channels: [BN]
    rk = tl.arange(0, BLOCK_K)  # [BK]
    # Tail rows and columns read the last pixel / channel (their results are not stored): the loads in
    # the loop need no row or column mask, so the copies stay 16-byte cp.async into shared memory.
    pixel = tl.minimum(rm, M - 1)
    K = KH * KW * Cin
    w_cols = w_ptr + tl.minimum(rn, Cout - 1).to(tl.int64) * K  # [BN]: row co of the packed [Cout, K] weight
    if FP8 or MMA_F16:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    if LOOP == "gemm":
        # 1x1, stride 1, no padding, dense NHWC x: the convolution is x[N·H·W, Cin] @ wᵀ
        x_rows = x_ptr + pixel.to(tl.int64) * sxw  # [BM]
        for c0 in range(0, Cin, BLOCK_K):
            c = c0 + rk  # [BK]
            if EVEN_K:
                a = tl.load(x_rows[:, None] + c[None, :])
                b = tl.load(w_cols[None, :] + c[:, None])
            else:  # a channel tail: zeros in both operands add nothing
                a = tl.load(x_rows[:, None] + c[None, :], mask=(c < Cin)[None, :], other=0.0 if FP8 else 0)
                b = tl.load(w_cols[None, :] + c[:, None], mask=(c < Cin)[:, None], other=0.0 if FP8 else 0)
            acc = _dot_step(acc, a, b, FP8, FP8_PRECISE, X_UNSIGNED, MMA_F16, BLOCK_K)
    else:
        ow = pixel % Wo
        oh = (pixel // Wo) % Ho
        ih0 = oh * SH - PT  # [BM]
        iw0 = ow * SW - PL
        x_rows = x_ptr + (pixel // (Wo * Ho)).to(tl.int64) * sxn  # [BM]
        pad_rows = pad_ptr + tl.zeros_like(ih0)  # [BM]: a padded tap reads x's zero point from here
        if LOOP == "flat":
            # K index k = (r·KW + s)·Cin + c decomposed per element: small Cin (the stem) packs several taps per step
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + rk  # [BK]
                c = kk % Cin
                tap = kk // Cin
                ih = ih0[:, None] + ((tap // KW) * DH)[None, :]  # [BM, BK]
                iw = iw0[:, None] + ((tap % KW) * DW)[None, :]
                inside = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                a_ptrs = tl.where(inside, x_rows[:, None] + ih * sxh + iw * sxw, pad_rows[:, None]) + c[None, :]
                a = tl.load(a_ptrs, mask=(kk < K)[None, :], other=0.0 if FP8 else 0)
                b = tl.load(w_cols[None, :] + kk[:, None], mask=(kk < K)[:, None], other=0.0 if FP8 else 0)
                acc = _dot_step(acc, a, b, FP8, FP8_PRECISE, X_UNSIGNED, MMA_F16, BLOCK_K)
        else:
            # one loop over (tap, channel block), so that the pipeline runs across taps; the row masks of
            # a tap are a [BM] vector, folded into the row pointers (padded rows point at the zero point)
            c_blocks = tl.cdiv(Cin, BLOCK_K)
            for step in range(0, KH * KW * c_blocks):
                tap = step // c_blocks
                r = tap // KW
                c = (step - tap * c_blocks) * BLOCK_K + rk  # [BK] input channels of this step
                ih = ih0 + r * DH  # [BM]
                iw = iw0 + (tap - r * KW) * DW
                inside = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
                a_rows = tl.where(inside, x_rows + ih * sxh + iw * sxw, pad_rows)
                if EVEN_K:
                    # Cin a multiple of BLOCK_K (>= 16): every row starts 16-byte aligned, which the compiler
                    # cannot see through the select; without the hint the A copies are single bytes
                    a_rows = tl.multiple_of(a_rows, 16)
                    a = tl.load(a_rows[:, None] + c[None, :])
                    b = tl.load(w_cols[None, :] + (tap * Cin + c)[:, None])
                else:
                    a = tl.load(a_rows[:, None] + c[None, :], mask=(c < Cin)[None, :], other=0.0 if FP8 else 0)
                    b = tl.load(w_cols[None, :] + (tap * Cin + c)[:, None], mask=(c < Cin)[:, None], other=0.0 if FP8 else 0)
                acc = _dot_step(acc, a, b, FP8, FP8_PRECISE, X_UNSIGNED, MMA_F16, BLOCK_K)

    _epilogue(acc, rm, rn, M, Cout, scale_ptr, bias_ptr, out_ptr, res_ptr, y_scale, y_zero,
              alpha, beta, ra_multiplier, ra_zero, rb_multiplier, rb_zero, ry_zero, FP8, HAS_BIAS,
              PRESCALED, ACTIVATION, OUT, QMIN, QMAX, RESIDUAL, R_ACTIVATION, R_OUT, R_QMIN, R_QMAX)


@triton.jit
def _qconv_gemm_persistent_kernel(x_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr, res_ptr,
                                  M, Cout, Cin, sxw, y_scale, y_zero, alpha, beta, ra_multiplier,
                                  ra_zero, rb_multiplier, rb_zero, ry_zero, EVEN_K: tl.constexpr, FP8: tl.constexpr,
                                  FP8_PRECISE: tl.constexpr, X_UNSIGNED: tl.constexpr, HAS_BIAS: tl.constexpr,
                                  PRESCALED: tl.constexpr, MMA_F16: tl.constexpr, ACTIVATION: tl.constexpr,
                                  OUT: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr,
                                  RESIDUAL: tl.constexpr, R_ACTIVATION: tl.constexpr, R_OUT: tl.constexpr,
                                  R_QMIN: tl.constexpr,
                                  R_QMAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """The "gemm" loop with a fixed number of programs walking the tiles: for short K (a 1x1 layer over
    64-512 channels) each tile is one or a few K steps, and a flattened loop lets the next tile's loads
    overlap this tile's epilogue, where one program per tile waits for its own loads each time."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(Cout, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)  # [BK]
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0), flatten=True):
        tile_m, tile_n = dm.grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
        rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
        rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        x_rows = x_ptr + tl.minimum(rm, M - 1).to(tl.int64) * sxw  # [BM]
        w_cols = w_ptr + tl.minimum(rn, Cout - 1).to(tl.int64) * Cin  # [BN]
        if FP8 or MMA_F16:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        for c0 in range(0, Cin, BLOCK_K):
            c = c0 + rk
            if EVEN_K:
                a = tl.load(x_rows[:, None] + c[None, :])
                b = tl.load(w_cols[None, :] + c[:, None])
            else:
                a = tl.load(x_rows[:, None] + c[None, :], mask=(c < Cin)[None, :], other=0.0 if FP8 else 0)
                b = tl.load(w_cols[None, :] + c[:, None], mask=(c < Cin)[:, None], other=0.0 if FP8 else 0)
            acc = _dot_step(acc, a, b, FP8, FP8_PRECISE, X_UNSIGNED, MMA_F16, BLOCK_K)
        _epilogue(acc, rm, rn, M, Cout, scale_ptr, bias_ptr, out_ptr, res_ptr, y_scale,
                  y_zero, alpha, beta, ra_multiplier, ra_zero, rb_multiplier, rb_zero, ry_zero, FP8,
                  HAS_BIAS, PRESCALED, ACTIVATION, OUT, QMIN, QMAX, RESIDUAL, R_ACTIVATION, R_OUT, R_QMIN, R_QMAX)


def pack_weight(w: torch.Tensor, fp16: bool = False) -> torch.Tensor:
    """[Cout, Cin, KH, KW] -> [Cout, KH·KW·Cin] contiguous (K-major): column (r·KW + s)·Cin + c is the
    kernel's K index. fp16: an int8 weight's values as fp16 (exact), for QConvConfig.mma_f16. Once per
    layer, at prepare."""
    if w.dim() != 4:
        raise ValueError(f"triton qconv2d: weight must be [Cout, Cin, KH, KW], got {tuple(w.shape)}")
    if fp16 and w.dtype != torch.int8:
        raise TypeError(f"triton qconv2d: only int8 weights run on fp16 tensor cores, got {w.dtype}")
    cout, cin, kh, kw = w.shape
    packed = w.permute(0, 2, 3, 1).reshape(cout, kh * kw * cin)
    return (packed.to(torch.float16) if fp16 else packed).contiguous()


def output_size(size: int, kernel: int, stride: int, pad_begin: int, pad_end: int, dilation: int) -> int:
    return (size + pad_begin + pad_end - dilation * (kernel - 1) - 1) // stride + 1


def padding_row(x_dtype: torch.dtype, x_zero: int, cin: int, device: torch.device | str) -> torch.Tensor:
    """Cin copies of x's zero point in x's dtype: what a padded tap reads (once per layer, at prepare)."""
    return torch.full((max(cin, 1),), x_zero, dtype=torch.float32, device=device).to(x_dtype)


def loop_of(kernel: tuple[int, int], strides: tuple[int, int], pads: tuple[int, int, int, int], cin: int,
            block_k: int) -> str:
    """The kernel's reduction loop for a layer (the module docstring says what each does)."""
    if tuple(kernel) == (1, 1) and tuple(strides) == (1, 1) and not any(pads):
        return "gemm"
    return "flat" if cin < block_k else "taps"


def qconv2d(x: torch.Tensor, w_packed: torch.Tensor, kernel: tuple[int, int], epilogue: Epilogue, *,
            x_zero: int = 0, strides: tuple[int, int] = (1, 1), pads: tuple[int, int, int, int] = (0, 0, 0, 0),
            dilations: tuple[int, int] = (1, 1), config: QConvConfig | None = None,
            padding: torch.Tensor | None = None, residual: torch.Tensor | None = None,
            residual_add: ResidualAdd | None = None) -> torch.Tensor:
    """requantize(conv2d(x − x_zero, w)), groups 1, NHWC out.

    x: [N, Cin, H, W] int8/uint8 (w int8) or float8e4m3fn (w float8e4m3fn); read as dense NHWC (a copy
    when it is not); w_packed: pack_weight(w); x_zero: x's zero point (what padding reads; the correction
    for the rest is in epilogue.bias, qgemm.fold_zero_point); pads in ONNX order (top, left, bottom,
    right); padding: padding_row(x.dtype, x_zero, Cin) made once by the caller (else made here);
    residual [N, Cout, Ho, Wo] (int8/uint8, or float8e4m3fn for an FP8 layer) with residual_add: the epilogue
    writes the layer's own result c, and the sum (ResidualAdd) is what is stored.
    Returns [N, Cout, Ho, Wo] with channels-last strides in epilogue.out_dtype (residual_add.out_dtype).
    """
    fp8 = x.dtype == torch.float8_e4m3fn
    if x.dim() != 4:
        raise ValueError(f"triton qconv2d: x must be [N, C, H, W], got {tuple(x.shape)}")
    if config is None:
        config = next((c for c in QCONV_CONFIGS if c.block_m <= max(x.shape[0] * x.shape[2] * x.shape[3], 16) and
                       c.block_n <= max(w_packed.shape[0], 16)), QCONV_CONFIGS[-1])
    mma_f16 = config.mma_f16 and not fp8
    w_dtype = torch.float8_e4m3fn if fp8 else torch.float16 if mma_f16 else torch.int8
    if x.dtype not in QUANTIZED_INPUTS or w_packed.dtype != w_dtype:
        raise TypeError(f"triton qconv2d: x int8/uint8 with w int8 (fp16 with config.mma_f16), or both "
                        f"float8e4m3fn; got {x.dtype}, {w_packed.dtype}")
    kh, kw = kernel
    n, cin, h, wd = x.shape
    if w_packed.dim() != 2 or w_packed.shape[1] != kh * kw * cin or not w_packed.is_contiguous():
        raise ValueError(f"triton qconv2d: x {tuple(x.shape)} with a {kh}x{kw} kernel needs the packed weight as a "
                         f"contiguous [Cout, {kh * kw * cin}], got {tuple(w_packed.shape)}")
    cout = w_packed.shape[0]
    epilogue.check(cout)
    if epilogue.bias is not None and epilogue.bias.dtype != (torch.float32 if fp8 else torch.int32):  # int32 with mma_f16 too
        raise TypeError(f"triton qconv2d: the bias of an {'fp8' if fp8 else 'int8'} layer is "
                        f"{'float32' if fp8 else 'int32'}, got {epilogue.bias.dtype}")
    if padding is None:
        padding = padding_row(x.dtype, x_zero, cin, x.device)
    elif padding.dtype != x.dtype or padding.numel() < cin:
        raise ValueError(f"triton qconv2d: padding must be padding_row({x.dtype}, x_zero, {cin}), got "
                         f"{padding.dtype}[{padding.numel()}]")
    (sh, sw), (pt, pl, pb, pr), (dh, dw) = strides, pads, dilations
    ho, wo = output_size(h, kh, sh, pt, pb, dh), output_size(wd, kw, sw, pl, pr, dw)
    if ho <= 0 or wo <= 0:
        raise ValueError(f"triton qconv2d: a {kh}x{kw} kernel (dilation {dh}x{dw}) does not fit a padded {h}x{wd} input")
    if (residual is None) != (residual_add is None):
        raise ValueError("triton qconv2d: a residual and its residual_add come together")
    out_dtype = epilogue.out_dtype
    if residual is not None:
        residual_add.check(epilogue, (n, cout, ho, wo), residual)
        residual = residual.contiguous(memory_format=torch.channels_last)  # the output's offsets: no copy if NHWC
        out_dtype = residual_add.out_dtype
    out = torch.empty((n, ho, wo, cout), dtype=out_dtype, device=x.device).permute(0, 3, 1, 2)
    m = n * ho * wo
    if out.numel() == 0:
        return out
    x = x.contiguous(memory_format=torch.channels_last)  # no copy when it is NHWC already
    loop = loop_of(kernel, strides, pads, cin, config.block_k)
    even_k = (kh * kw * cin if loop == "flat" else cin) % config.block_k == 0
    qmin, qmax = epilogue.qrange
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(cout, config.block_n)
    bias = epilogue.bias if epilogue.bias is not None else epilogue.scale
    res = residual if residual is not None else out  # not read without a residual
    residual_args, residual_values = _residual_args(residual_add), _residual_values(residual_add)
    if loop == "gemm" and config.persistent:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
        _qconv_gemm_persistent_kernel[(min(tiles, sms * config.persistent),)](
            x, w_packed, bias, epilogue.scale, out, res, m, cout, cin, x.stride(3), float(epilogue.y_scale),
            float(epilogue.y_zero), float(epilogue.alpha), float(epilogue.beta), *residual_values, EVEN_K=even_k, FP8=fp8,
            FP8_PRECISE=config.fp8_precise, X_UNSIGNED=x.dtype == torch.uint8, HAS_BIAS=epilogue.bias is not None,
            PRESCALED=epilogue.prescaled, MMA_F16=mma_f16, ACTIVATION=epilogue.activation, OUT=epilogue.out_kind,
            QMIN=qmin, QMAX=qmax, **residual_args, BLOCK_M=config.block_m,
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages)
        return out
    grid = (tiles,)
    _qconv_kernel[grid](
        x, padding, w_packed, bias, epilogue.scale, out, res,
        m, cout, cin, h, wd, ho, wo, x.stride(0), x.stride(2), x.stride(3),
        sh, sw, pt, pl, dh, dw, float(epilogue.y_scale), float(epilogue.y_zero),
        float(epilogue.alpha), float(epilogue.beta), *residual_values,
        KH=kh, KW=kw, LOOP=loop, EVEN_K=even_k, FP8=fp8, FP8_PRECISE=config.fp8_precise,
        X_UNSIGNED=x.dtype == torch.uint8, HAS_BIAS=epilogue.bias is not None, PRESCALED=epilogue.prescaled,
        MMA_F16=mma_f16, ACTIVATION=epilogue.activation, OUT=epilogue.out_kind, QMIN=qmin, QMAX=qmax,
        **residual_args, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=config.group_m, num_warps=config.num_warps, num_stages=config.num_stages)
    return out
