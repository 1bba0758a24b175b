"""BERT-base's GEMMs at 64 x 384 tokens on the GPU in parts: what each piece of an FP8 QGemm tactic costs (issue 12).

    python3 bench/fp8_gemm_parts.py [--triton] [--persistent] [--gemms "ffn up"]

Per GEMM (M = 24,576 rows): the fp16 layer through cuBLAS (addmm; the FFN up projection with cuBLASLt's GELU
epilogue too), cuBLASLt's FP8 GEMM (torch._scaled_mm, per-tensor scales) writing fp16 / fp16 with the bias / bf16 /
fp32 / fp8, each with fp32 accumulation and with Hopper's fast accumulation; the one-pass requantize kernel alone
(the product in fp16 -> bias, activation, fp8: cuda.qgemm.scaled_mm_half's second half); with --triton, kiln's
Triton FP8 GEMM with the Gelu and the fp8 output fused (the FFN up), per tile; with --persistent, its persistent
TMA form (qgemm.QGemmConfig.persistent) per tile, on every GEMM (fp16 out where the layer's output is float).
Milliseconds per call, 20 calls in one CUDA graph, median of 10 replays (bench/gpu.py), and TFLOP/s. A Triton row
with an fp8 output is also judged against torch in fp32 (Gelu of the dequantized product, divided by y_scale,
E4M3 by torch's conversion): "steps" is the largest distance in E4M3 steps and the share of outputs off by one.
The tactics' accuracy on real layers is the builder's and the tests' business (tests/gpu/test_quant_cuda.py).
"""

from __future__ import annotations

import argparse
import dataclasses
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
# the tactics' two (h-fp8c run 1 on the H200: fp32 accumulation 0.355 ms against 0.294 fast; Triton's producer/consumer
# warp specialization on the first 0.294, as without it)
PERSISTENT_TILES = [(128, 256, 128, 8, 3, True), (128, 128, 128, 8, 4, True)]
# --sweep (h-fp8att): the persistent kernel's main loop toward cuBLASLt's (K = 768 is only 6 steps of 128: a deeper
# pipeline of shorter K steps, wider M tiles, 4-warp tiles)
SWEEP_TILES = [(128, 256, 64, 8, 4, True), (128, 256, 64, 8, 6, True), (256, 128, 64, 8, 4, True),
               (256, 128, 128, 8, 3, True), (128, 128, 64, 4, 6, True), (128, 256, 128, 8, 4, True)]


def _e4m3_steps(got: torch.Tensor, want: torch.Tensor) -> str:
    """Largest distance in E4M3 steps between two fp8 tensors, and the share one step off (the ordinals of the
    grid: bit patterns as signed magnitudes)."""
    def ordinal(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.uint8).to(torch.int32)
        return torch.where(bits >= 128, -(bits - 128), bits)
    apart = (ordinal(got) - ordinal(want)).abs()
    return f"{int(apart.max())} (1 step: {float((apart == 1).float().mean()):.3%})"


def rows_for(name: str, k: int, n: int, activation: str, triton: bool,
             persistent: bool, sweep: bool = False) -> list[tuple[str, float | str, str]]:
    from kiln.kernels.cuda.triton.qelementwise import requantize
    from kiln.kernels.cuda.triton.qgemm import Epilogue, QGemmConfig, qgemm

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(TOKENS, k, device="cuda", generator=gen).half()  # [M, K]
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.05).half()  # [N, K]
    b = torch.randn(n, device="cuda", generator=gen).half()
    x8, w8t = x.to(FP8), w.to(FP8).t()  # [M, K] row-major, [K, N] column-major: cuBLASLt's FP8 layout
    one = torch.ones((), device="cuda")
    rows: list[tuple[str, float | str, str]] = []

    def timed(label: str, fn, want: torch.Tensor | None = None) -> None:
        try:
            steps = _e4m3_steps(fn(), want) if want is not None else ""
            rows.append((label, graph_ms(fn), steps))
        except Exception as e:  # noqa: BLE001  a variant this torch refuses is a row, not the end
            rows.append((label, f"failed: {type(e).__name__}: {str(e)[:100]}", ""))

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
    if activation:  # the same pass without the activation: what moving its bytes takes
        timed("requantize pass fp16 -> bias -> fp8, no activation",
              lambda: requantize(product, dataclasses.replace(epilogue, activation=""), -1))
    if not (triton or persistent):
        return rows
    w8 = w.to(FP8)
    # the layer's own output: fp8 after the FFN up's Gelu, fp16 for the others (as the FP8 engine runs them)
    out = FP8 if activation else torch.float16
    epilogue = dataclasses.replace(epilogue, out_dtype=out, y_scale=0.02 if activation else 1.0)
    exact = x8.float() @ w8.float().t() + b.float()  # [M, N]: exact products, fp32 sums
    want = (torch.nn.functional.gelu(exact) / 0.02).clamp(-448, 448).to(FP8) if activation else None
    if activation:  # the tactic the engine ran before (cuda.qgemm.scaled_mm_half.fast_accum), judged the same way
        timed("cuBLASLt fp8 -> fp16 (fast accum), then the pass (scaled_mm_half.fast_accum)", lambda: requantize(
            torch._scaled_mm(x8, w8t, scale_a=one, scale_b=one, out_dtype=torch.float16, use_fast_accum=True),
            epilogue, -1), want)
    tiles = [(t, False) for t in TRITON_TILES if triton] + [(t, True) for t in PERSISTENT_TILES if persistent]
    tiles += [(t, True) for t in SWEEP_TILES if sweep]
    for (bm, bn, bk, warps, stages, fast), persist in tiles:
        config = QGemmConfig(bm, bn, bk, num_warps=warps, num_stages=stages, fast_accum=fast, persistent=persist)
        accum = "fast accum" if fast else "fp32 accum"
        kind = "persistent" if persist else "triton"
        timed(f"{kind} fp8 GEMM {bm}x{bn}x{bk}w{warps}s{stages} -> {activation or 'bias'} -> {'fp8' if activation else 'fp16'}"
              f" ({accum})", lambda config=config: qgemm(x8, w8, epilogue, config), want)
    if persistent and activation:  # the same GEMM and fp8 store without the Gelu: what the Gelu costs in the epilogue
        config = QGemmConfig(*PERSISTENT_TILES[0][:3], num_warps=PERSISTENT_TILES[0][3],
                             num_stages=PERSISTENT_TILES[0][4], fast_accum=True, persistent=True)
        timed(f"persistent fp8 GEMM {config.name} -> bias -> fp8, no Gelu (fast accum)",
              lambda: qgemm(x8, w8, dataclasses.replace(epilogue, activation=""), config))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--triton", action="store_true", help="also kiln's Triton FP8 GEMM tiles (compiles: ~+30 s)")
    ap.add_argument("--persistent", action="store_true", help="also the persistent TMA kernel's tiles, every GEMM")
    ap.add_argument("--gemms", default="", help="only the GEMMs whose names start so (comma-separated)")
    ap.add_argument("--sweep", action="store_true", help="also SWEEP_TILES of the persistent kernel")
    args = ap.parse_args()
    print(f"# BERT-base GEMMs at {TOKENS} tokens, {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| GEMM | variant | ms | TFLOP/s | E4M3 steps vs torch fp32 |\n|---|---|---|---|---|")
    wanted = [w for w in args.gemms.split(",") if w]
    for name, k, n, activation in GEMMS:
        if wanted and not name.startswith(tuple(wanted)):
            continue
        flops = 2.0 * TOKENS * k * n
        for label, ms, steps in rows_for(name, k, n, activation, args.triton and bool(activation),
                                         args.persistent or args.sweep, args.sweep):
            rate = f"{flops / ms / 1e9:,.0f}" if isinstance(ms, float) and "pass" not in label else ""
            print(f"| {name} | {label} | {ms if isinstance(ms, str) else f'{ms:.4f}'} | {rate} | {steps} |", flush=True)


if __name__ == "__main__":
    main()
