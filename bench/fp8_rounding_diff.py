"""Where the fp8 store's hardware rounding (HARDWARE_E4M3: the conversion Triton emits for fp32 -> float8e4m3fn)
and qmath.round_to_e4m3 (the arithmetic rule) disagree: the values of tests/gpu/test_quant_cuda.py's
test_the_fp8_stores_hardware_rounding_is_qmaths_rounding (every E4M3 value, the ties between them, ±448 and
beyond, subnormals, random ones) through the rows requantize kernel both ways, and torch's own conversion as a
third opinion. Prints the first disagreements (input, fp32 bits, arithmetic, hardware, torch) and their count.

    python3 bench/fp8_rounding_diff.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FP8 = torch.float8_e4m3fn


def main() -> None:
    from kiln.kernels.cuda.triton import qelementwise

    gen = torch.Generator(device="cuda").manual_seed(2)
    grid = torch.arange(0, 127, dtype=torch.uint8, device="cuda").view(FP8).float()
    ties = (grid[:-1] + grid[1:]) / 2
    special = torch.tensor([0.0, -0.0, 448.0, 464.0, 465.0, 500.0, 1e6, 2.0**-10, 2.0**-9 * 1.5], device="cuda")
    values = torch.cat([grid, ties, special, torch.randn(4096 * 64, device="cuda", generator=gen) * 50])
    values = torch.cat([values, -values])
    channels = 64
    acc = torch.nn.functional.pad(values, (0, (-values.numel()) % channels)).reshape(-1, channels).contiguous()
    scale = torch.ones(channels, device="cuda")
    outs = []
    for hardware in (False, True):
        out = torch.empty_like(acc, dtype=FP8)
        qelementwise._requantize_rows_kernel[(triton.cdiv(acc.shape[0], 64), 1)](
            acc, scale, scale, out, acc.shape[0], channels, 1.0, 0.0, 0.0, 0.0, scale, 1.0, 1.0, PRODUCT=False,
            HAS_PRODUCT_BIAS=False, MULTIPLY=False, HAS_BIAS=False, ACTIVATION="", OUT=2,
            QMIN=0, QMAX=0, HARDWARE_E4M3=hardware, INDEX64=False, BLOCK_R=64, BLOCK_C=64)
        outs.append(out.view(torch.uint8).reshape(-1))
    flat = acc.reshape(-1)
    torch_bits = flat.clamp(-448, 448).to(FP8).view(torch.uint8)
    differ = (outs[0] != outs[1]).nonzero().reshape(-1)
    print(f"{differ.numel()} of {flat.numel()} values differ (arithmetic vs hardware); torch's conversion differs "
          f"from the arithmetic on {int((outs[0] != torch_bits).sum())}, from the hardware on "
          f"{int((outs[1] != torch_bits).sum())}")
    print("| value | fp32 bits | arithmetic | hardware | torch |\n|---|---|---|---|---|")
    for i in differ[:24].tolist():
        v = float(flat[i])
        bits = int(flat[i:i + 1].view(torch.int32))
        show = lambda b: f"0x{int(b):02x} ({float(torch.tensor([int(b)], dtype=torch.uint8).view(FP8).float()):g})"  # noqa: E731
        print(f"| {v!r} | 0x{bits & 0xFFFFFFFF:08x} | {show(outs[0][i])} | {show(outs[1][i])} | {show(torch_bits[i])} |")


if __name__ == "__main__":
    main()
