"""GPT-2's LM head (x [4096, 768] fp16 · W [50257, 768]ᵀ) stored as the engine's fp32 logits, five ways, timed with CUDA
events on one GPU (issue 11: bench/results/zoo-cuda-h100-2026-12-07.md, the LM head is GPT-2's gap to torch.compile).

    eager fp16 out        F.linear, unaligned [M, 50257] fp16 rows (torch eager's kernel)
    fp32 into a view      aten::mm.dtype_out into the [M, N] view of 50264-float rows (session 30's tactic)
    fp32 contiguous       the weight zero-padded to N_pad rows, mm.dtype_out into a contiguous [M, N_pad] (this tactic)
    fp16 padded + cast    fp16 GEMM into [M, N_pad] then one cast pass into fp32 [M, N_pad]
    fp16 padded           torch.compile's form (fp16 logits: not the engine's contract, the bound on the GEMM)

    python3 bench/lm_head_variants.py [--m 4096 --k 768 --n 50257]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from gpu import time_cuda  # bench/gpu.py: CUDA events around each call


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, default=4096)
    parser.add_argument("--k", type=int, default=768)
    parser.add_argument("--n", type=int, default=50257)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("lm_head_variants: no CUDA device")
    m, k, n = args.m, args.k, args.n
    n_pad = -(-n // 32) * 32
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda").half()
    w = (torch.randn(n, k, device="cuda") * 0.04).half()
    w_pad = F.pad(w, (0, 0, 0, n_pad - n)).contiguous()
    rows = torch.empty(m, n_pad, device="cuda")
    half_rows = torch.empty(m, n_pad, device="cuda", dtype=torch.half)
    want = F.linear(x.float(), w.float())

    def view_out():
        torch.ops.aten.mm.dtype_out(x, w.t(), torch.float32, out=rows[:, :n])

    def contiguous_out():
        torch.ops.aten.mm.dtype_out(x, w_pad.t(), torch.float32, out=rows)

    def half_then_cast():
        torch.mm(x, w_pad.t(), out=half_rows)
        rows.copy_(half_rows)

    variants = [("eager fp16 out", lambda: F.linear(x, w)), ("fp32 into a view", view_out),
                ("fp32 contiguous", contiguous_out), ("fp16 padded + cast", half_then_cast),
                ("fp16 padded", lambda: torch.mm(x, w_pad.t(), out=half_rows))]
    flop = 2 * m * k * n
    print(f"# LM head {m} x {k} x {n} (N_pad {n_pad}) on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| variant | ms (median) | TFLOP/s | max abs err vs fp32 |")
    print("|---|---|---|---|")
    for name, fn in variants:
        ms = statistics.median(time_cuda(fn, warmup=5, iters=40))
        fn()
        got = rows[:, :n] if name in ("fp32 into a view", "fp32 contiguous", "fp16 padded + cast") else None
        if name == "fp16 padded":
            got = half_rows[:, :n].float()
        err = "-" if got is None else f"{(got - want).abs().max().item():.2e}"
        print(f"| {name} | {ms:.3f} | {flop / ms / 1e9:.0f} | {err} |")


if __name__ == "__main__":
    main()
