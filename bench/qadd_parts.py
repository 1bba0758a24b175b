"""Where a residual QAdd's time goes on the GPU (issue 12: ResNet-50's 16 residual adds took 3.64 ms of the FP8
engine's 11.1 eager, 0.52 ms each at 56x56, where moving the bytes takes ~0.15 ms).

    python3 bench/qadd_parts.py [--out DIR]

At ResNet-50's four residual shapes (batch 256, NHWC, int8 and FP8 E4M3): the floor (torch's int8 add: the
same two reads and one write, no arithmetic), kiln's QAdd kernel as the engine runs it, the kernel before this
branch (its arithmetic copied here) and candidates, each first compared with kiln's reference op
(kiln/ops/quantized.py) on 16 images of the same data: more than one step off, or one step off on more than 1%
of the outputs (near-ties only may be), marks the row WRONG. ms per call: 20 calls in one CUDA graph, median of
10 replays (bench/gpu.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kiln.kernels.cuda.triton import qelementwise, qmath  # noqa: E402
from kiln.ops.quantized import qadd as reference_qadd  # noqa: E402

FP8 = torch.float8_e4m3fn
SHAPES = [("256x256 @56", 256, 56), ("512 @28", 512, 28), ("1024 @14", 1024, 14), ("2048 @7", 2048, 7)]
A_SCALE, A_ZERO, B_SCALE, B_ZERO, Y_SCALE, Y_ZERO = 0.031, -3.0, 0.047, 5.0, 0.043, -128.0
CHECKED = 16  # images of the batch compared with the reference


@triton.jit
def _qadd_before_kernel(a_ptr, b_ptr, out_ptr, numel, a_scale, a_zero, b_scale, b_zero, y_scale, y_zero,
                        OUT: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr, HARDWARE_E4M3: tl.constexpr,
                        BLOCK: tl.constexpr):
    """kiln's same-layout QAdd kernel before this branch (main at c18c90c: HARDWARE_E4M3 False): loads converted
    by cvt, r in real units, qmath.requantize's IEEE division by y_scale, fp8 rounded in arithmetic."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    a = tl.load(a_ptr + offs, mask=mask).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask).to(tl.float32)
    r = (a - a_zero) * a_scale + (b - b_zero) * b_scale
    y = qmath.requantize(r, y_scale, y_zero, 0.0, 0.0, "Relu", OUT, QMIN, QMAX, HARDWARE_E4M3)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qadd_fp8_bits_kernel(a_ptr, b_ptr, out_ptr, numel, a_multiplier, b_multiplier, BLOCK: tl.constexpr):
    """A candidate for kiln's FP8 QAdd: E4M3 in by the bits (sign-extended, shifted into an fp32's sign, exponent
    and mantissa: the value times 2^-120, subnormals included; the 2^120 folded into the multipliers), no cvt."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    a = tl.load(a_ptr + offs, mask=mask).to(tl.int8, bitcast=True).to(tl.int32)
    b = tl.load(b_ptr + offs, mask=mask).to(tl.int8, bitcast=True).to(tl.int32)
    a = ((a << 20) & -2014314496).to(tl.float32, bitcast=True)  # 0x87F00000: the sign and E4M3's 7 bits
    b = ((b << 20) & -2014314496).to(tl.float32, bitcast=True)
    v = tl.where(a * a_multiplier + b * b_multiplier < 0, 0.0, a * a_multiplier + b * b_multiplier)
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)  # cvt.rn.satfinite: the store rounds


def _fp8_bits(a, b):
    out = torch.empty_like(a)
    _qadd_fp8_bits_kernel[(triton.cdiv(a.numel(), 4096),)](
        a, b, out, a.numel(), A_SCALE / Y_SCALE * 2.0**120, B_SCALE / Y_SCALE * 2.0**120, BLOCK=4096, num_warps=8)
    return out


def _before(a, b, dtype, za, zb, zy, hardware_e4m3):
    out = torch.empty_like(a, dtype=dtype)
    qmin, qmax = (-128, 127) if dtype == torch.int8 else (0, 0)
    _qadd_before_kernel[(triton.cdiv(a.numel(), 4096),)](
        a, b, out, a.numel(), A_SCALE, za, B_SCALE, zb, Y_SCALE, zy, OUT=1 if dtype == torch.int8 else 2, QMIN=qmin,
        QMAX=qmax, HARDWARE_E4M3=hardware_e4m3, BLOCK=4096, num_warps=8)
    return out


def main() -> None:
    from gpu import graph_ms

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    lines = ["| shape | dtype | what | ms | GB/s | check |", "|---|---|---|---|---|---|"]
    for label, channels, size in SHAPES:
        shape = (256, channels, size, size)
        for dtype in (torch.int8, FP8):
            if dtype == torch.int8:
                a = torch.randint(-128, 128, shape, device="cuda", generator=g, dtype=torch.int8)
                b = torch.randint(-128, 128, shape, device="cuda", generator=g, dtype=torch.int8)
                zeros = (A_ZERO, B_ZERO, Y_ZERO)
            else:
                a = torch.randn(shape, device="cuda", generator=g).to(FP8)
                b = torch.randn(shape, device="cuda", generator=g).to(FP8)
                zeros = (0.0, 0.0, 0.0)
            a, b = a.contiguous(memory_format=torch.channels_last), b.contiguous(memory_format=torch.channels_last)
            za, zb, zy = zeros
            qz = lambda v, t=dtype: torch.tensor(v, dtype=torch.float32).to(t)  # noqa: E731
            f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
            # checked on the first CHECKED images (the float64 reference on the host: the whole batch takes seconds)
            want = reference_qadd(None, a[:CHECKED].cpu(), f32(A_SCALE), qz(za), b[:CHECKED].cpu(), f32(B_SCALE),
                                  qz(zb), f32(Y_SCALE), qz(zy), activation="Relu")
            moved = 3 * a.numel() / 1e6  # MB: two 8-bit reads, one 8-bit write
            variants = {
                "floor: torch int8 add": lambda: torch.add(a.view(torch.int8), b.view(torch.int8)),
                "kiln qadd (engine)": lambda: qelementwise.qadd(a, A_SCALE, za, b, B_SCALE, zb, out_dtype=dtype,
                                                                y_scale=Y_SCALE, y_zero=zy, activation="Relu"),
                "before (main's kernel)": lambda: _before(a, b, dtype, za, zb, zy, False),
            }
            if dtype == FP8:  # main's kernel with the store's rounding (this branch's first commit)
                variants["before, the store rounding fp8"] = lambda: _before(a, b, dtype, za, zb, zy, True)
                variants["fp8 in by the bits (a candidate)"] = lambda: _fp8_bits(a, b)
            for what, fn in variants.items():
                try:
                    got = fn()
                    check = "—" if what.startswith("floor") else _check(got[:CHECKED].cpu(), want)
                    ms = graph_ms(fn)
                    lines.append(f"| {label} | {str(dtype)[6:]} | {what} | {ms:.4f} | {moved / ms:,.0f} | {check} |")
                except Exception as e:  # noqa: BLE001  a failing variant is a row
                    lines.append(f"| {label} | {str(dtype)[6:]} | {what} | failed: {type(e).__name__}: "
                                 f"{str(e)[:100]} | | |")
                print(lines[-1], flush=True)
            del a, b
            torch.cuda.empty_cache()
    table = "\n".join(lines)
    print("\n" + table)
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "qadd_parts.md").write_text(table + "\n")


def _check(got: torch.Tensor, want: torch.Tensor) -> str:
    g, w = got.double(), want.double()
    if want.dtype == FP8:
        unit = torch.exp2(torch.floor(torch.log2(torch.maximum(g.abs(), w.abs()).clamp_min(2.0**-6))) - 3)
    else:
        unit = torch.ones(())
    diff = (g - w).abs()
    worst, share = float((diff / unit).max()), float((diff > 0).double().mean())
    ok = worst <= 1.0 + 1e-9 and share <= 1e-2
    return f"{'ok' if ok else 'WRONG'}: {share:.4%} off, up to {worst:.2g} steps"


if __name__ == "__main__":
    main()
