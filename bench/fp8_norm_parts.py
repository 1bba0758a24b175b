"""BERT-base's LayerNorms at 64 x 384 tokens on the GPU: what the FP8 engine's LayerNormQuantize costs against the
fp16 engine's LayerNorm (issue 12: 0.061 vs ~0.037 ms in the H200 runs of 2026-12-03b).

    python3 bench/fp8_norm_parts.py

Rows (x and the residual fp16 [24,576, 768], γ/β fp16): torch's layer_norm alone (on x + r formed beforehand),
kiln's fp16 LayerNorm with the residual joined (the fp16 engine's op), the unfused pair (kiln's LayerNorm, then its
QuantizeLinear pass to fp8), and kiln's LayerNormQuantize (fp8 and the fp16 y) per RowsConfig (rows per program,
warps). Milliseconds per call (20 calls in one CUDA graph, median of 10 replays: bench/gpu.py) and the bandwidth
that is (bytes read and written once). Each LayerNormQuantize row is checked against the unfused pair: y against
kiln's LayerNorm (the largest difference: its 2-D reductions sum in another order than the 1-D kernel, so a last-bit
fp16 difference is no error) and q bit for bit the QuantizeLinear pass of its own y.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu import graph_ms  # noqa: E402

FP8 = torch.float8_e4m3fn
ROWS, HIDDEN = 64 * 384, 768
CONFIGS = [(1, 4), (2, 4), (4, 8)]  # the tactics' (run 1 also timed 4 rows x 4 warps and 8 x 8: slower)  # (rows per program, warps)


def main() -> None:
    from kiln.kernels.cuda.triton.normalization import layer_norm
    from kiln.kernels.cuda.triton.qelementwise import quantize
    from kiln.kernels.cuda.triton.qnorm import RowsConfig, layer_norm_quantize

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(ROWS, HIDDEN, device="cuda", generator=gen) * 2).half()
    r = torch.randn(ROWS, HIDDEN, device="cuda", generator=gen).half()
    gamma = (torch.rand(HIDDEN, device="cuda", generator=gen) + 0.5).half()
    beta = (torch.randn(HIDDEN, device="cuda", generator=gen) * 0.1).half()
    y_scale = 6.0 / 448
    s = x + r
    print(f"# BERT-base LayerNorm at {ROWS} x {HIDDEN} fp16, {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| variant | ms | GB/s | check |\n|---|---|---|---|")

    def row(label: str, fn, moved: int, check: str = "") -> None:
        try:
            ms = graph_ms(fn)
            print(f"| {label} | {ms:.4f} | {moved / ms / 1e6:,.0f} | {check} |", flush=True)
        except Exception as e:  # noqa: BLE001  a variant that fails is a row, not the end
            print(f"| {label} | failed: {type(e).__name__}: {str(e)[:120]} | | |", flush=True)

    numel = ROWS * HIDDEN
    row("torch layer_norm (x + r formed before)", lambda: torch.nn.functional.layer_norm(s, [HIDDEN], gamma, beta),
        4 * numel)
    row("kiln LayerNorm + residual (fp16 engine)", lambda: layer_norm(x, gamma, beta, 1e-12, residual=r), 6 * numel)
    unfused_y = layer_norm(x, gamma, beta, 1e-12, residual=r)
    row("kiln LayerNorm + residual, then quantize (unfused)",
        lambda: quantize(layer_norm(x, gamma, beta, 1e-12, residual=r), y_scale, 0.0, FP8), 9 * numel)
    for rows, warps in CONFIGS:
        config = RowsConfig(rows, warps)
        q, y = layer_norm_quantize(x, gamma, beta, 1e-12, y_scale, 0.0, FP8, residual=r, config=config)
        again = quantize(y, y_scale, 0.0, FP8)
        apart = (y.float() - unfused_y.float()).abs().max()
        check = (f"y {'=' if torch.equal(y, unfused_y) else f'within {float(apart):.2g} of'} unfused, q "
                 f"{'=' if torch.equal(q.view(torch.uint8), again.view(torch.uint8)) else 'DIFFERS from'} quantize(y)")
        row(f"LayerNormQuantize rows {rows} warps {warps} (fp8 + y)", lambda config=config: layer_norm_quantize(
            x, gamma, beta, 1e-12, y_scale, 0.0, FP8, residual=r, config=config), 7 * numel, check)


if __name__ == "__main__":
    main()
