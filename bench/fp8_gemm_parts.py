"""BERT-base's GEMMs at 64 x 384 tokens on the GPU in parts: what each piece of an FP8 QGemm tactic costs (issue 12).

    python3 bench/fp8_gemm_parts.py [--triton] [--gemms "ffn up"]

Per GEMM (M = 24,576 rows): the fp16 layer through cuBLAS (addmm; the FFN up projection with cuBLASLt's GELU
epilogue too), cuBLASLt's FP8 GEMM (torch._scaled_mm, per-tensor scales) writing fp16 / fp16 with the bias / bf16 /
fp32 / fp8, each with fp32 accumulation and with Hopper's fast accumulation; the one-pass requantize kernel alone
(the product in fp16 -> bias, activation, fp8: cuda.qgemm.scaled_mm_half's second half); with --triton, kiln's
Triton FP8 GEMM with the Gelu and the fp8 output fused (the FFN up), per tile. Milliseconds per call, 20 calls in
one CUDA graph, median of 10 replays (bench/gpu.py), and TFLOP/s. Nothing is checked here: the tactics' accuracy
is the builder's and the tests' business (tests/gpu/test_quant_cuda.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu import graph_ms  # noqa: E402

FP8 = torch.float8_e4m3fn
TOKENS = 64 * 384
# (name, K, N, activation)
GEMMS = [("qkv 768->2304", 768, 2304, ""), ("attn-out 768->768", 768, 768, ""), ("ffn up 768->3072", 768, 3072, "Gelu"),
         ("ffn down 3072->768", 3072, 768, "")]
# (block_m, block_n, block_k, warps, stages, fast accumulation)
TRITON_TILES = [(128, 128, 128, 8, 3, False), (128, 256, 128, 8, 3, False), (64, 128, 128, 4, 4, False),
                (128, 128, 128, 8, 3, True), (128, 256, 128, 8, 3, True)]


def rows_for(name: str, k: int, n: int, activation: str, triton: bool) -> list[tuple[str, float | str]]:
    from kiln.kernels.cuda.triton.qelementwise import requantize
    from kiln.kernels.cuda.triton.qgemm import Epilogue, QGemmConfig, qgemm

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(TOKENS, k, device="cuda", generator=gen).half()  # [M, K]
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.05).half()  # [N, K]
    b = torch.randn(n, device="cuda", generator=gen).half()
    x8, w8t = x.to(FP8), w.to(FP8).t()  # [M, K] row-major, [K, N] column-major: cuBLASLt's FP8 layout
    one = torch.ones((), device="cuda")
    rows: list[tuple[str, float | str]] = []

    def timed(label: str, fn) -> None:
        try:
            rows.append((label, graph_ms(fn)))
        except Exception as e:  # noqa: BLE001  a variant this torch refuses is a row, not the end
            rows.append((label, f"failed: {type(e).__name__}: {str(e)[:100]}"))

    if activation:
        timed("fp16 cuBLASLt + GELU epilogue", lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True))
    timed("fp16 cuBLAS addmm", lambda: torch.addmm(b, x, w.t()))
    for fast in (False, True):
        accum = "fast accum" if fast else "fp32 accum"
        for out, label in ((torch.float16, "fp16"), (torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            timed(f"fp8 -> {label} ({accum})", lambda out=out, fast=fast: torch._scaled_mm(
                x8, w8t, scale_a=one, scale_b=one, out_dtype=out, use_fast_accum=fast))
        timed(f"fp8 -> fp16 + bias ({accum})", lambda fast=fast: torch._scaled_mm(
            x8, w8t, scale_a=one, scale_b=one, bias=b, out_dtype=torch.float16, use_fast_accum=fast))
        timed(f"fp8 -> fp8 ({accum})", lambda fast=fast: torch._scaled_mm(
            x8, w8t, scale_a=one, scale_b=one, scale_result=one, out_dtype=FP8, use_fast_accum=fast))
    product = torch.randn(TOKENS, n, device="cuda", generator=gen).half()
    epilogue = Epilogue(scale=torch.ones(n, device="cuda"), bias=b.float(), out_dtype=FP8, y_scale=0.02,
                        activation=activation)
    timed(f"requantize pass fp16 -> {activation or 'bias'} -> fp8", lambda: requantize(product, epilogue, -1))
    if triton:
        w8 = w.to(FP8)
        for bm, bn, bk, warps, stages, fast in TRITON_TILES:
            config = QGemmConfig(bm, bn, bk, num_warps=warps, num_stages=stages, fast_accum=fast)
            accum = "fast accum" if fast else "fp32 accum"
            timed(f"triton fp8 GEMM {bm}x{bn}x{bk}w{warps}s{stages} -> {activation or 'bias'} -> fp8 ({accum})",
                  lambda config=config: qgemm(x8, w8, epilogue, config))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--triton", action="store_true", help="also kiln's Triton FP8 GEMM tiles (compiles: ~+30 s)")
    ap.add_argument("--gemms", default="", help="only the GEMMs whose names start so (comma-separated)")
    args = ap.parse_args()
    print(f"# BERT-base GEMMs at {TOKENS} tokens, {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| GEMM | variant | ms | TFLOP/s |\n|---|---|---|---|")
    wanted = [w for w in args.gemms.split(",") if w]
    for name, k, n, activation in GEMMS:
        if wanted and not name.startswith(tuple(wanted)):
            continue
        flops = 2.0 * TOKENS * k * n
        for label, ms in rows_for(name, k, n, activation, args.triton and bool(activation)):
            rate = f"{flops / ms / 1e9:,.0f}" if isinstance(ms, float) and "pass" not in label else ""
            print(f"| {name} | {label} | {ms if isinstance(ms, str) else f'{ms:.4f}'} | {rate} |", flush=True)


if __name__ == "__main__":
    main()
