"""How often the order of an RMSNorm row's sum of squares shows in its FP8 rows: a CPU emulation, no GPU.

    python bench/fp8_norm_sum_order.py [--rows 4096] [--width 4096]

A Triton reduction over a row adds the elements each thread holds in register order, then across the warp's lanes
(butterfly shuffles), then across warps; which elements a thread holds follows the register layout the compiler
chose. kiln's rms_norm kernel got 8 contiguous elements a thread (the bf16 store's 16-byte vector), the FP8 variant
16 (the E4M3 store's) before 580d136 (tests/llm/reduction_layout_sm90.py). This emulates both orders in fp32 on
random bf16 rows (4 warps, as launched) and counts the rows whose rstd, bf16 normed row, E4M3 row or scale differ:
what the 37-row GPU test could not see and a 65k-token prefill of 32 layers could not miss.
"""

from __future__ import annotations

import argparse

import torch

LANES, WARPS = 32, 4


def triton_order_sum(sq: torch.Tensor, per_thread: int) -> torch.Tensor:
    """[R, N] fp32 -> [R]: summed as a blocked layout of `per_thread` contiguous elements a thread reduces it."""
    rows, width = sq.shape
    threads = LANES * WARPS
    reps = width // (per_thread * threads)  # the layout repeats over the row
    held = sq.view(rows, reps, threads, per_thread).permute(0, 2, 1, 3).reshape(rows, threads, reps * per_thread)
    acc = held[:, :, 0].clone()
    for k in range(1, reps * per_thread):  # in the thread, register order
        acc = acc + held[:, :, k]
    acc = acc.view(rows, WARPS, LANES)
    for offset in (16, 8, 4, 2, 1):  # across the warp's lanes
        acc = acc + acc[:, :, torch.arange(LANES) ^ offset]
    acc = acc[:, :, 0]
    for offset in (2, 1):  # across warps
        acc = acc + acc[:, torch.arange(WARPS) ^ offset]
    return acc[:, 0]


def norm_then_fp8(x: torch.Tensor, weight: torch.Tensor, per_thread: int):
    """rms_norm's arithmetic (kiln/llm/kernels/fused.py) with the sum in that order, then per-token E4M3."""
    xf = x.float()
    rstd = 1.0 / torch.sqrt(triton_order_sum(xf * xf, per_thread) / x.shape[1] + 1e-5)
    normed = (weight.float() * (xf * rstd[:, None]).bfloat16().float()).bfloat16().float()
    scale = normed.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return rstd, normed, scale, (normed / scale).to(torch.float8_e4m3fn).view(torch.uint8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--width", type=int, default=4096)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    x = (torch.randn((args.rows, args.width), generator=g) * 3).bfloat16()
    weight = (1 + torch.randn(args.width, generator=g) * 0.1).bfloat16()
    eight, sixteen = norm_then_fp8(x, weight, 8), norm_then_fp8(x, weight, 16)
    print(f"{args.rows} rows x {args.width}, sums of squares added 8 vs 16 elements a thread; rows that differ in:")
    for name, a, b in zip(("rstd", "bf16 normed row", "scale", "E4M3 row"), eight, sixteen):
        differ = (a != b).reshape(args.rows, -1).any(-1)
        print(f"- {name}: {int(differ.sum())} ({differ.float().mean().item():.3%})")


if __name__ == "__main__":
    main()
