"""One FP8 linear of onnxruntime's QDQ BERT-base, y = Q(act(DQ(Q(x·W)) + b)·m), as two kernels (the QGemm writing
E4M3, then the Elementwise chain reading it back: the engine before session 22) against one (the QGemm with its
product quantized and the chain in its epilogue, kiln/passes/fusion/qgemm_epilogue.py); and the LayerNormQuantize
reading the previous norm's E4M3 output as its residual against a DequantizeLinear then the norm. Side by side in
one process, CUDA events, medians of interleaved rounds; the fused output's agreement with the unfused pair.

    python3 bench/fp8_gemm_epilogue.py              BERT-base at 64 x 384 tokens (H100/H200)
    python3 bench/fp8_gemm_epilogue.py --dry-run    tiny shapes under the Triton interpreter (checks the script)

Prints a table last: per layer, ms of the pair, of the fused kernel, the ratio, and the share of outputs equal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

FP8 = torch.float8_e4m3fn
# (name, K, N, chain after the product, output): BERT-base's linears, onnxruntime's FP8 QDQ chains
LINEARS = [("q 768->768 (Mul, Q)", 768, 768, ["Add t0 i0", "Mul t1 i1"], FP8),
           ("v 768->768 (Q)", 768, 768, ["Add t0 i0"], FP8),
           ("attn-out 768->768 (fp16)", 768, 768, ["Add t0 i0"], torch.float16),
           ("ffn1 768->3072 (Gelu, Q)", 768, 3072, ["Add t0 i0", "Gelu t1"], FP8),
           ("ffn2 3072->768 (fp16)", 3072, 768, ["Add t0 i0"], torch.float16)]


def _time(fns: dict, rounds: int, device: str) -> dict[str, float]:
    """Median ms of each callable, the candidates interleaved round by round."""
    if device != "cuda":
        for fn in fns.values():
            fn()
        return {name: float("nan") for name in fns}
    from gpu import time_cuda  # bench/gpu.py

    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(statistics.median(time_cuda(fn, warmup=3, iters=10)))
    return {name: statistics.median(t) for name, t in times.items()}


def linear_row(name: str, k: int, n: int, chain: list[str], out: torch.dtype, tokens: int, device: str,
               rounds: int) -> list[str]:
    from kiln.kernels.cuda.triton.elementwise import compile_elementwise
    from kiln.kernels.cuda.triton.qgemm import Epilogue, QGemmConfig, qgemm

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(tokens, k, generator=gen) * 2).to(FP8).to(device)
    w = (torch.randn(n, k, generator=gen) * 2).to(FP8).to(device)
    scale = torch.full((n,), 0.031 * 0.0123, device=device)
    product_scale = float((x[:64].float() @ w.float().t() * 0.031 * 0.0123).abs().max()) / 300.0
    bias = (torch.randn(n, generator=gen) * product_scale * 40).to(device)
    multiplier = 0.35355339 if any(line.startswith("Mul") for line in chain) else 1.0
    activation = "Gelu" if any(line.startswith("Gelu") for line in chain) else ""
    y_scale = product_scale * 1.37
    config = QGemmConfig(128, 256, 128, num_warps=8, num_stages=3, fast_accum=True, persistent=True) \
        if device == "cuda" else QGemmConfig(16, 64, 128, num_warps=2, num_stages=4)
    # two kernels: the GEMM writing E4M3 at the product's scale, the chain (DQ, bias, act / Mul, Q) reading it
    gemm_alone = Epilogue(scale, None, FP8, y_scale=product_scale)
    lines = ["Dequantize i1 i2"] + [line.replace("i1", "i3") if line.startswith("Mul") else line for line in chain]
    inputs = 4 + (out == FP8)
    code = lines + ([f"Quantize t{len(lines) - 1} i4"] if out == FP8 else [])
    kernel = compile_elementwise(code, inputs, out)
    constants = [torch.tensor(product_scale, device=device), torch.tensor(multiplier, device=device)] + \
        ([torch.tensor(y_scale, device=device)] if out == FP8 else [])

    def pair():
        p = qgemm(x, w, gemm_alone, config)
        return kernel(bias, p, *constants)

    fused_epilogue = Epilogue(scale, None, out, y_scale=y_scale if out == FP8 else 1.0, activation=activation,
                              product_scale=product_scale, product_bias=bias.float(), multiplier=multiplier)

    def fused():
        return qgemm(x, w, fused_epilogue, config)

    a, b = pair(), fused()
    same = (a.view(torch.uint8) == b.view(torch.uint8)).float().mean() if out == FP8 else \
        ((a.float() - b.float()).abs() <= 2.0**-10 * a.float().abs()).float().mean()
    ms = _time({"pair": pair, "fused": fused}, rounds, device)
    return [name, f"{ms['pair']:.4f}", f"{ms['fused']:.4f}", f"{ms['pair'] / ms['fused']:.2f}x", f"{float(same):.4%}"]


def norm_row(tokens: int, hidden: int, device: str, rounds: int) -> list[str]:
    from kiln.kernels.cuda.triton.qelementwise import dequantize
    from kiln.kernels.cuda.triton.qnorm import layer_norm_quantize

    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(tokens, hidden, generator=gen) * 2).half().to(device)
    r_q = (torch.randn(tokens, hidden, generator=gen) * 2).to(FP8).to(device)
    gamma, beta = (torch.rand(hidden, generator=gen) + 0.5).half().to(device), torch.zeros(hidden).half().to(device)
    s_r, s_y = 0.043, 4.0 / 448

    def pair():
        r = dequantize(r_q, s_r, 0.0, torch.float16)
        return layer_norm_quantize(x, gamma, beta, 1e-12, s_y, 0.0, FP8, residual=r, write_y=False)[0]

    def fused():
        return layer_norm_quantize(x, gamma, beta, 1e-12, s_y, 0.0, FP8, residual=r_q, residual_scale=s_r,
                                   write_y=False)[0]

    a, b = pair(), fused()
    same = (a.view(torch.uint8) == b.view(torch.uint8)).float().mean()
    ms = _time({"pair": pair, "fused": fused}, rounds, device)
    return [f"LayerNormQuantize {hidden}, E4M3 residual", f"{ms['pair']:.4f}", f"{ms['fused']:.4f}",
            f"{ms['pair'] / ms['fused']:.2f}x", f"{float(same):.4%}"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, Triton under its interpreter")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    device = "cpu" if args.dry_run else "cuda"
    tokens = 40 if args.dry_run else 64 * 384
    rows = []
    for name, k, n, chain, out in LINEARS:
        if args.dry_run:
            k, n = 128, 64
        rows.append(linear_row(name, k, n, chain, out, tokens, device, args.rounds))
    rows.append(norm_row(tokens, 96 if args.dry_run else 768, device, args.rounds))
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter: times nothing)"
    print(f"\n{gpu}, {tokens} tokens; pair = the two kernels of the engine before, fused = one kernel")
    print("| layer | pair ms | fused ms | pair / fused | outputs equal |\n|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
