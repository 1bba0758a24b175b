"""A Triton GEMM of 8-bit operands with the requantizing epilogue fused (kiln::QGemm's arithmetic).

    acc[m, n] = Σ_k x[m, k]·w[n, k]                  int8 x int8 -> int32 (exact), or
                                                     float8e4m3fn x float8e4m3fn -> fp32
    y[m, n]   = requantize((acc + bias[n])·scale[n])  kiln/kernels/cuda/triton/qmath.py
    (or, the product quantized: the E4M3 rounding, + product_bias[n], act, ·multiplier, then the output:
     qmath.finish_product_columns, the chain after onnxruntime's FP8 QDQ MatMuls)

x: [M, K] int8/uint8/float8e4m3fn (K contiguous), w: [N, K] of the same family, K contiguous: both
operands are K-major, the layout Hopper's wgmma reads 8-bit operands in (an N-major int8/fp8 B
would need a transpose through shared memory). The zero point of x is not subtracted per element:
Σ (x − z)·w = Σ x·w − z·Σ_k w[n, k], so the caller folds −z·colsum(w) into the int32 bias once, at
prepare (`fold_zero_point`). A uint8 x is shifted to int8 in registers (x − 128, its zero point
with it): the tensor cores multiply int8 by int8 only.

FP8 products are exact in fp32, but Hopper's tensor cores add them into the accumulator with fewer
bits than fp32 (~14, as DeepSeek-V3's report measured); `max_num_imprecise_acc = BLOCK_K` makes
Triton add each K step's partial sums into an fp32 accumulator with CUDA-core adds (its default on
sm_90 is never), as cuBLASLt does without fast accumulation. `QGemmConfig.fast_accum` leaves the whole K
to the tensor cores (Triton's sm_90 default): no second accumulator, no adds per step; a tactic of its
own, kept only where the builder's check passes on the layer.

`QGemmConfig.persistent` (FP8): one program per SM walks the output tiles (`_qgemm_persistent_kernel`), x and w
read by TMA (host tensor descriptors) and the epilogue run on two [BLOCK_M, BLOCK_N/2] halves of the accumulator
(half the registers live at once) whose 8-bit (or fp16) results the TMA writes back; the loop over tiles is
flattened, so the next tile's loads are issued while this one's epilogue computes. The form cuBLASLt's FP8 GEMM
cannot take: an FFN up projection's Gelu before its fp8 output, in the GEMM (issue 12).

The tile config is a tactic parameter (kiln/tactics/cuda/quant_gemm.py), timed by the autotuner.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kiln.kernels.cuda.triton import device_math as dm
from kiln.kernels.cuda.triton import qmath

QUANTIZED_INPUTS = (torch.int8, torch.uint8, torch.float8_e4m3fn)
OUTPUTS = (torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float32, torch.float16, torch.bfloat16)
INT_RANGE = {torch.int8: (-128, 127), torch.uint8: (0, 255)}
PRESCALED_ACTIVATIONS = ("", "Relu", "Clip")  # commute with a positive scale: y_scale may fold into the multiplier
ACTIVATIONS = PRESCALED_ACTIVATIONS + ("Gelu", "GeluTanh")  # qmath.requantize's


@dataclass(frozen=True)
class QGemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    fast_accum: bool = False  # FP8: the tensor cores' own accumulation over the whole K
    persistent: bool = False  # FP8: one program per SM over the tiles, TMA loads and stores

    @property
    def name(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}"


QGEMM_CONFIGS = (  # 8-bit operands: twice the K of the fp16 tiles in the same shared memory
    QGemmConfig(128, 256, 128, num_warps=8, num_stages=3),
    QGemmConfig(128, 128, 128, num_warps=8, num_stages=3),
    QGemmConfig(64, 128, 128, num_warps=4, num_stages=4),
    QGemmConfig(16, 64, 128, num_warps=2, num_stages=4),  # decode-sized M
)


@dataclass(frozen=True)
class Epilogue:
    """What the layer does after the products, fixed at prepare: per-channel fp32 scale [N], bias [N]
    (int32 for an int8 layer, the zero-point correction folded in; fp32 for FP8), the activation and
    the output (`out_dtype`: int8/uint8/float8e4m3fn quantized by y_scale/y_zero, else float). A `product_scale`
    (> 0) rounds the product onto its E4M3 grid before the activation, then adds `product_bias` [N] (fp32) and
    multiplies by `multiplier` after it (kiln/ops/quantized.py: a QGemm's inputs 9-11)."""

    scale: torch.Tensor
    bias: torch.Tensor | None
    out_dtype: torch.dtype
    y_scale: float = 1.0
    y_zero: float = 0.0
    activation: str = ""
    alpha: float = 0.0
    beta: float = 0.0
    product_scale: float = 0.0  # 0: the product is not quantized
    product_bias: torch.Tensor | None = None
    multiplier: float = 1.0

    @property
    def quantized_product(self) -> bool:
        return self.product_scale > 0.0

    def product_arguments(self) -> tuple[torch.Tensor, float, float]:
        """The kernels' (product_bias_ptr, product_scale, multiplier): a pointer is passed even when unread."""
        bias = self.product_bias if self.product_bias is not None else self.scale
        return bias, float(self.product_scale or 1.0), float(self.multiplier)

    def product_constants(self) -> dict[str, bool]:
        return dict(PRODUCT=self.quantized_product, HAS_PRODUCT_BIAS=self.product_bias is not None,
                    MULTIPLY=self.multiplier != 1.0)

    @property
    def out_kind(self) -> int:
        if self.out_dtype in INT_RANGE:
            return qmath.OUT_INT
        return qmath.OUT_FP8 if self.out_dtype == torch.float8_e4m3fn else qmath.OUT_FLOAT

    @property
    def qrange(self) -> tuple[int, int]:
        return INT_RANGE.get(self.out_dtype, (0, 0))

    @property
    def prescaled(self) -> bool:
        """scale and the Clip bounds already divided by y_scale (`prescale`): y_scale is 1."""
        return self.y_scale == 1.0 and self.out_kind != qmath.OUT_FLOAT

    def prescale(self) -> Epilogue:
        """The same layer with y_scale folded into the per-channel scale (in float64, rounded once to
        fp32) and the Clip bounds, for kernels that multiply instead of dividing (qmath.finish_prescaled).
        Quantized outputs only: a float output has no y_scale."""
        if self.out_kind == qmath.OUT_FLOAT:
            raise ValueError("quantized epilogue: a float output has no y_scale to fold into the scale")
        if self.activation not in PRESCALED_ACTIVATIONS or self.quantized_product:
            raise ValueError(f"quantized epilogue: {self.activation} does not commute with the output scale: "
                             "it cannot be prescaled")
        y_scale = float(self.y_scale)
        return dataclasses.replace(self, scale=(self.scale.double() / y_scale).float(), y_scale=1.0,
                                   alpha=self.alpha / y_scale, beta=self.beta / y_scale)

    def check(self, channels: int) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"quantized epilogue: activation {self.activation!r} is not one of {ACTIVATIONS}")
        if self.out_dtype not in OUTPUTS:
            raise TypeError(f"quantized epilogue: output dtype {self.out_dtype} is not one of {OUTPUTS}")
        if self.scale.numel() != channels or self.scale.dtype != torch.float32:
            raise ValueError(f"quantized epilogue: scale must be {channels} fp32 values, got "
                             f"{self.scale.dtype}{list(self.scale.shape)}")
        if self.bias is not None and self.bias.numel() != channels:
            raise ValueError(f"quantized epilogue: bias has {self.bias.numel()} values, expected {channels}")
        if self.product_bias is not None and (not self.quantized_product or self.product_bias.numel() != channels
                                              or self.product_bias.dtype != torch.float32):
            raise ValueError(f"quantized epilogue: a product bias needs a product scale and {channels} fp32 values, "
                             f"got {self.product_bias.dtype}{list(self.product_bias.shape)}")
        if self.multiplier != 1.0 and not self.quantized_product:
            raise ValueError("quantized epilogue: a multiplier follows a quantized product only")


@triton.jit
def _qgemm_kernel(x_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
                  y_scale, y_zero, alpha, beta, product_bias_ptr, product_scale, multiplier,
                  PRODUCT: tl.constexpr, HAS_PRODUCT_BIAS: tl.constexpr, MULTIPLY: tl.constexpr, FP8: tl.constexpr,
                  FAST_ACCUM: tl.constexpr, X_UNSIGNED: tl.constexpr, HAS_BIAS: tl.constexpr,
                  ACTIVATION: tl.constexpr, OUT: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr,
                  HARDWARE_E4M3: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    tile_m, tile_n = dm.grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rm = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rk = tl.arange(0, BLOCK_K)  # [BK]
    row_ok = rm < M
    col_ok = rn < N
    x_tile = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]  # [BM, BK], K contiguous
    w_tile = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]  # [BK, BN] = wᵀ tile, K contiguous
    if FP8:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k in range(0, K, BLOCK_K):
        k_ok = rk < K - k
        if FP8:
            a = tl.load(x_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if FAST_ACCUM:
                acc = tl.dot(a, b, acc)
            else:
                acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            a = tl.load(x_tile, mask=row_ok[:, None] & k_ok[None, :], other=0)
            b = tl.load(w_tile, mask=k_ok[:, None] & col_ok[None, :], other=0)
            if X_UNSIGNED:
                a = (a.to(tl.int32) - 128).to(tl.int8)  # its zero point moved by 128 as well (fold_zero_point)
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)  # int8 x int8 -> int32 (triton 3.6 needs out_dtype with an int acc)
        x_tile += BLOCK_K
        w_tile += BLOCK_K

    if PRODUCT:
        y = qmath.finish_product_columns(acc, bias_ptr, scale_ptr, product_bias_ptr, rn, col_ok, product_scale,
                                         multiplier, y_scale, y_zero, alpha, beta, HAS_BIAS, HAS_PRODUCT_BIAS, MULTIPLY,
                                         ACTIVATION, OUT, QMIN, QMAX, HARDWARE_E4M3)
    else:
        y = qmath.finish_columns(acc, bias_ptr, scale_ptr, rn, col_ok, y_scale, y_zero, alpha, beta, HAS_BIAS,
                                 ACTIVATION, OUT, QMIN, QMAX, HARDWARE_E4M3)
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _finish_half(acc, y_desc, bias_ptr, scale_ptr, off_m, off_n, N, y_scale, y_zero, alpha, beta, product_bias_ptr,
                 product_scale, multiplier, PRODUCT: tl.constexpr, HAS_PRODUCT_BIAS: tl.constexpr,
                 MULTIPLY: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, OUT: tl.constexpr,
                 QMIN: tl.constexpr,
                 QMAX: tl.constexpr, HARDWARE_E4M3: tl.constexpr, HALF_N: tl.constexpr):
    """One [BLOCK_M, HALF_N] half of a persistent tile: the epilogue, then a TMA store (rows and columns past the
    output are clipped by the TMA unit)."""
    rn = off_n + tl.arange(0, HALF_N)  # [HN]
    if PRODUCT:
        y = qmath.finish_product_columns(acc, bias_ptr, scale_ptr, product_bias_ptr, rn, rn < N, product_scale,
                                         multiplier, y_scale, y_zero, alpha, beta, HAS_BIAS, HAS_PRODUCT_BIAS, MULTIPLY,
                                         ACTIVATION, OUT, QMIN, QMAX, HARDWARE_E4M3)
    else:
        y = qmath.finish_columns(acc, bias_ptr, scale_ptr, rn, rn < N, y_scale, y_zero, alpha, beta, HAS_BIAS,
                                 ACTIVATION, OUT, QMIN, QMAX, HARDWARE_E4M3)
    y_desc.store([off_m, off_n], y.to(y_desc.dtype))


@triton.jit
def _qgemm_persistent_kernel(x_desc, w_desc, y_desc, bias_ptr, scale_ptr, M, N, K, y_scale, y_zero, alpha, beta,
                             product_bias_ptr, product_scale, multiplier, PRODUCT: tl.constexpr,
                             HAS_PRODUCT_BIAS: tl.constexpr, MULTIPLY: tl.constexpr, FAST_ACCUM: tl.constexpr,
                             HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                             OUT: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr, HARDWARE_E4M3: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr):
    """FP8 x [M, K] · w [N, K]ᵀ, K-major both (TMA tiles [BLOCK_M, BLOCK_K] and [BLOCK_N, BLOCK_K]; a tile past
    M, N or K reads zeros), program p taking tiles p, p + PROGRAMS, ..."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    # the epilogue counts its own tile: with the loop flattened, the next tile's loads are issued before this
    # tile's epilogue runs (Triton's persistent matmul tutorial), and a separate counter keeps them independent
    epilogue_tile = tl.program_id(0) - PROGRAMS
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=True):
        tile_m, tile_n = dm.grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(k_steps):
            a = x_desc.load([tile_m * BLOCK_M, k * BLOCK_K])  # [BM, BK]
            b = w_desc.load([tile_n * BLOCK_N, k * BLOCK_K])  # [BN, BK]
            if FAST_ACCUM:
                acc = tl.dot(a, b.T, acc)
            else:
                acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
        epilogue_tile += PROGRAMS
        tile_m, tile_n = dm.grouped_tile(epilogue_tile, tiles_m, tiles_n, GROUP_M)
        halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))  # [BM, BN/2, 2]
        left, right = tl.split(halves)  # columns [0, BN/2) and [BN/2, BN) of the tile
        _finish_half(left, y_desc, bias_ptr, scale_ptr, tile_m * BLOCK_M, tile_n * BLOCK_N, N, y_scale, y_zero,
                     alpha, beta, product_bias_ptr, product_scale, multiplier, PRODUCT, HAS_PRODUCT_BIAS, MULTIPLY,
                     HAS_BIAS, ACTIVATION, OUT, QMIN, QMAX, HARDWARE_E4M3, BLOCK_N // 2)
        _finish_half(right, y_desc, bias_ptr, scale_ptr, tile_m * BLOCK_M, tile_n * BLOCK_N + BLOCK_N // 2, N,
                     y_scale, y_zero, alpha, beta, product_bias_ptr, product_scale, multiplier, PRODUCT,
                     HAS_PRODUCT_BIAS, MULTIPLY, HAS_BIAS, ACTIVATION, OUT, QMIN, QMAX, HARDWARE_E4M3, BLOCK_N // 2)


def fold_zero_point(w: torch.Tensor, bias: torch.Tensor | None, x_zero: int, x_dtype: torch.dtype) -> torch.Tensor:
    """The int32 bias an int8 kernel adds to Σ x·w so that the sum is Σ (x − x_zero)·w + bias:
    bias − z·Σ_k w[n, k], with z the zero point as the kernel sees x (a uint8 x is shifted by −128 in
    registers, its zero point too). w: [N, ...] int8 (a conv's [Cout, Cin, KH, KW] as well)."""
    z = x_zero - 128 if x_dtype == torch.uint8 else x_zero
    folded = -z * w.reshape(w.shape[0], -1).to(torch.int64).sum(dim=1)  # [N]
    if bias is not None:
        folded = folded + bias.reshape(-1).to(torch.int64)
    if folded.numel() and int(folded.abs().max()) >= 2**31:
        raise ValueError("the bias with the zero-point correction does not fit int32")
    return folded.to(torch.int32)


def qgemm(x: torch.Tensor, w: torch.Tensor, epilogue: Epilogue, config: QGemmConfig | None = None) -> torch.Tensor:
    """requantize(x @ wᵀ) with the epilogue fused: x [..., K] int8/uint8 (with w int8) or float8e4m3fn (with w
    float8e4m3fn), w [N, K] K-contiguous -> [..., N] in epilogue.out_dtype.

    The zero point of x must already be folded into epilogue.bias (fold_zero_point); FP8 has none.
    A `persistent` config takes FP8 with K and N multiples of 16 and an output of at most 2 bytes
    (`persistent_refusal`).
    """
    fp8 = x.dtype == torch.float8_e4m3fn
    if x.dtype not in QUANTIZED_INPUTS or w.dtype != (torch.float8_e4m3fn if fp8 else torch.int8):
        raise TypeError(f"triton qgemm: x int8/uint8 with w int8, or both float8e4m3fn; got {x.dtype}, {w.dtype}")
    if w.dim() != 2 or x.shape[-1] != w.shape[1] or w.stride(1) != 1:
        raise ValueError(f"triton qgemm: x {tuple(x.shape)} @ wᵀ needs w as a K-contiguous [N, {x.shape[-1]}], "
                         f"got {tuple(w.shape)} with strides {w.stride()}")
    n, k = w.shape
    epilogue.check(n)
    if epilogue.bias is not None and epilogue.bias.dtype != (torch.float32 if fp8 else torch.int32):
        raise TypeError(f"triton qgemm: the bias of an {'fp8' if fp8 else 'int8'} layer is "
                        f"{'float32' if fp8 else 'int32'}, got {epilogue.bias.dtype}")
    lead = x.shape[:-1]
    out = torch.empty((*lead, n), dtype=epilogue.out_dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = x.reshape(-1, k)
    if k and x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if config is None:
        config = next((c for c in QGEMM_CONFIGS if c.block_m <= max(m, 16)), QGEMM_CONFIGS[-1])
    qmin, qmax = epilogue.qrange
    common = dict(HAS_BIAS=epilogue.bias is not None, ACTIVATION=epilogue.activation, OUT=epilogue.out_kind,
                  QMIN=qmin, QMAX=qmax, HARDWARE_E4M3=x.is_cuda,  # on the GPU the fp8 store rounds (qmath)
                  BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
                  num_warps=config.num_warps, num_stages=config.num_stages)
    bias = epilogue.bias if epilogue.bias is not None else epilogue.scale
    numbers = (float(epilogue.y_scale), float(epilogue.y_zero), float(epilogue.alpha), float(epilogue.beta),
               *epilogue.product_arguments())
    common.update(epilogue.product_constants())
    if epilogue.quantized_product and not fp8:
        raise ValueError("triton qgemm: a quantized product (E4M3) follows FP8 operands only")
    if config.persistent:
        refusal = persistent_refusal(x.dtype, k, n, epilogue.out_dtype)
        if refusal:
            raise ValueError(f"triton qgemm: {config.name} persistent: {refusal}")
        if x2.data_ptr() % 16:
            x2 = x2.clone()  # TMA reads from 16-byte aligned addresses
        programs = min(_programs(x.device), triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n))
        _qgemm_persistent_kernel[(programs,)](
            TensorDescriptor.from_tensor(x2, [config.block_m, config.block_k]),
            TensorDescriptor.from_tensor(w, [config.block_n, config.block_k]),
            TensorDescriptor.from_tensor(out.view(m, n), [config.block_m, config.block_n // 2]),
            bias, epilogue.scale, m, n, k, *numbers, FAST_ACCUM=config.fast_accum, PROGRAMS=programs, **common)
        return out
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    _qgemm_kernel[grid](
        x2, w, bias, epilogue.scale, out, m, n, k, x2.stride(0), w.stride(0), *numbers, FP8=fp8,
        FAST_ACCUM=fp8 and config.fast_accum, X_UNSIGNED=x.dtype == torch.uint8, **common)
    return out


def persistent_refusal(x_dtype: torch.dtype, k: int, n: int, out_dtype: torch.dtype) -> str:
    """Why the persistent (TMA) kernel cannot take the layer, or "": TMA needs 16-byte aligned rows."""
    if x_dtype != torch.float8_e4m3fn:
        return "FP8 operands only"
    if k % 16 or n % 16:
        return f"K = {k}, N = {n}: TMA needs both multiples of 16"
    if out_dtype.itemsize > 2:
        return f"a {out_dtype} output: the kernel writes 8-bit or half-precision tiles"
    return ""


def _programs(device: torch.device) -> int:
    """One persistent program per SM (a few on the interpreter, where the device is the CPU)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
