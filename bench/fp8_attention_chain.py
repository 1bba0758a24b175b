"""BERT-base's attention block in an FP8 engine, QKV GEMM to the attention-out GEMM's E4M3 input (issue 12): what
the FP8 engine runs today against the two ways to hand FP8 attention the v it is fast on (keys contiguous).

    python3 bench/fp8_attention_chain.py [--batch 64] [--seq 384]

Chains (x an E4M3 [B·S, 768] activation, one E4M3 scale for q, k and v as the builder's fp8_scale gives them):

- today: cuBLASLt FP8 QKV GEMM writing fp16 (scaled_mm_direct), kiln's fp16 flash attention, the quantize pass
  that makes the attention-out GEMM's E4M3 input;
- QKV E4M3 + v transposed: the QKV GEMM writing E4M3 itself (cuBLASLt's D scale), v's third copied to [B, H, D, S]
  (torch), kiln's FP8 attention (E4M3 products, E4M3 output);
- QK + Vᵀ GEMMs: q, k from one E4M3 GEMM, vᵀ = W_v·xᵀ from a second with its operands swapped, so cuBLASLt writes
  v keys-contiguous itself ([768, B·S]: a [B, H, S, D] view with strides (S, 64·B·S, 1, B·S)); v's bias is left
  out of the GEMM (cuBLASLt adds a bias per output column, here per token): softmax rows sum to 1, so P·(v + b) =
  P·v + b, and b would go to the attention-out GEMM's bias (W_o·b_v) -- not built, so this chain's output lacks b;
- fp16 QKV + v transposed by the attention: what a tactic could do in today's engine graph (QKV GEMM unchanged):
  v quantized and transposed (two torch passes here), q and k quantized as the kernel loads them; fp16 out then
  the quantize pass, or E4M3 out.

Scales: an E4M3 GEMM output's 1/s is folded into x's scale and the bias, as torch 2.11's _scaled_mm ignores
scale_result for E4M3 outputs (the lost attempt's Vᵀ chain error ~1.0 was that; H200, 2026-12-04: the swapped
GEMM's vᵀ equals the plain GEMM's v transposed bit for bit, and kiln's FP8 attention gives the same bytes on its
[B, H, S, D] view as on a contiguous copy). Each piece is timed alone too. Accuracy: the chain's output (dequantized) against torch fp32 attention on the
fp32 QKV product (max error / max |reference|, mean error / mean |reference|); the Vᵀ chain against the reference
without v's bias. Timing: 20 calls in one CUDA graph, median of 10 replays (bench/gpu.py graph_ms).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_attention import FP8_MAX, HEAD_DIM, HEADS, errors, print_table  # noqa: E402  bench/fp8_attention.py
from gpu import graph_ms  # noqa: E402  bench/gpu.py
from kiln.kernels.cuda.triton.attention import ATTENTION_CONFIGS, FP8_DTYPE, Float8Scales, flash_attention  # noqa: E402
from kiln.kernels.cuda.triton.qelementwise import quantize  # noqa: E402

WIDTH = HEADS * HEAD_DIM


def e4m3(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """x at its per-tensor min-max scale (kiln's calibration), saturating."""
    scale = x.abs().amax().item() / FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def heads(t: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """A [B·S, 768] column slice as the [B, H, S, D] view attention reads (no copy)."""
    return t.view(b, s, HEADS, HEAD_DIM).permute(0, 2, 1, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=384)
    args = parser.parse_args()
    device = torch.device("cuda")
    b, s = args.batch, args.seq
    tokens = b * s
    g = torch.Generator(device=device).manual_seed(0)
    x8, s_x = e4m3(torch.randn(tokens, WIDTH, device=device, generator=g))  # a LayerNormQuantize output
    # q, k weights scaled so the scores are a few units (peaked rows, as a trained layer's); v's ~N(0, 1)
    w = torch.cat([torch.randn(2 * WIDTH, WIDTH, device=device, generator=g) * 0.06,
                   torch.randn(WIDTH, WIDTH, device=device, generator=g) * 0.036])
    w8, s_w = e4m3(w)
    bias = torch.randn(3 * WIDTH, device=device, generator=g) * 0.1
    x_real, w_real = x8.float() * s_x, w8.float() * s_w
    qkv = x_real @ w_real.t() + bias  # [T, 2304] fp32: the block's exact QKV
    s_qkv = qkv.abs().amax().item() / FP8_MAX  # one scale for q, k and v (the builder's fp8_scale)
    lengths = torch.full((b,), s, dtype=torch.int32, device=device)
    mask = torch.zeros(b, 1, 1, s, dtype=torch.float16, device=device)
    scale = HEAD_DIM ** -0.5
    q, k, v = (heads(t, b, s) for t in qkv.split(WIDTH, -1))
    reference = F.scaled_dot_product_attention(q, k, v, scale=scale)  # [B, H, S, D] fp32
    reference_no_v_bias = reference - bias[2 * WIDTH:].view(HEADS, 1, HEAD_DIM)
    s_o = reference.abs().amax().item() / FP8_MAX
    config = {c.name: c for c in ATTENTION_CONFIGS}["64x64.w4s3"]  # the best tile of both forms (h-fp8att)

    one = torch.ones((), device=device)
    sx, sw = torch.tensor(s_x, device=device), torch.tensor(s_w, device=device)
    # E4M3 outputs at s_qkv: 1/s_qkv folded into x's scale and the bias (torch 2.11's _scaled_mm ignores scale_result
    # for an E4M3 output: an eye·eye probe gave 1.0 with 4 and 0.25; the lost attempt's Vᵀ chain error ~1.0 was that)
    sx_out = torch.tensor(s_x / s_qkv, device=device)
    bias_out = (bias / s_qkv).bfloat16()
    w8t = w8.t()  # [768, 2304] column-major: cuBLASLt's B
    wqk8t, wv8 = w8[:2 * WIDTH].t(), w8[2 * WIDTH:].contiguous()
    bias16 = bias.half()
    fp8_attention = Float8Scales(s_qkv, s_qkv, s_qkv, out=s_o)
    o16 = torch.empty(b, s, HEADS, HEAD_DIM, dtype=torch.float16, device=device)
    o8 = torch.empty(b, s, HEADS, HEAD_DIM, dtype=FP8_DTYPE, device=device)
    as_bhsd = [0, 2, 1, 3]

    def qkv_fp16() -> torch.Tensor:  # cuda.qgemm.scaled_mm_direct.fast_accum
        return torch._scaled_mm(x8, w8t, scale_a=sx, scale_b=sw, bias=bias16, out_dtype=torch.float16,
                                use_fast_accum=True)

    def qkv_e4m3(with_bias: bool = True) -> torch.Tensor:
        return torch._scaled_mm(x8, w8t, scale_a=sx_out, scale_b=sw, bias=bias_out if with_bias else None,
                                out_dtype=FP8_DTYPE, use_fast_accum=True)

    def qk_e4m3() -> torch.Tensor:
        return torch._scaled_mm(x8, wqk8t, scale_a=sx_out, scale_b=sw, bias=bias_out[:2 * WIDTH],
                                out_dtype=FP8_DTYPE, use_fast_accum=True)

    def v_transposed_gemm() -> torch.Tensor:  # vᵀ = W_v·xᵀ: [768, T], tokens contiguous
        return torch._scaled_mm(wv8, x8.t(), scale_a=sw, scale_b=sx_out, out_dtype=FP8_DTYPE, use_fast_accum=True)

    def v_transpose(v8: torch.Tensor) -> torch.Tensor:  # [T, 768] v -> [B, H, D, S] memory, viewed [B, H, S, D]
        return v8.view(b, s, HEADS, HEAD_DIM).permute(0, 2, 3, 1).contiguous().transpose(-1, -2)

    def today() -> torch.Tensor:
        y = qkv_fp16()
        qh, kh, vh = (heads(t, b, s) for t in y.split(WIDTH, -1))
        out = flash_attention(qh, kh, vh, mask, lengths, scale=scale, out=o16.permute(as_bhsd), config=config)
        return quantize(out.permute(as_bhsd), s_o, 0.0, FP8_DTYPE)

    try:
        qkv_e4m3()
        qkv_bias = True
    except RuntimeError as e:  # cuBLASLt's FP8 output with a bias: a torch/cuBLASLt version may refuse it
        print(f"QKV E4M3 with a bias refused ({str(e)[:100]}): timed without it")
        qkv_bias = False

    def e4m3_then_transpose() -> torch.Tensor:
        y = qkv_e4m3(qkv_bias)
        qh, kh = (heads(t, b, s) for t in y[:, :2 * WIDTH].split(WIDTH, -1))
        return flash_attention(qh, kh, v_transpose(y[:, 2 * WIDTH:]), mask, lengths, scale=scale,
                               out=o8.permute(as_bhsd), config=config, fp8=fp8_attention)

    def qk_and_v_transposed() -> torch.Tensor:
        y = qk_e4m3()
        qh, kh = (heads(t, b, s) for t in y.split(WIDTH, -1))
        vt = v_transposed_gemm().view(HEADS, HEAD_DIM, b, s).permute(2, 0, 3, 1)  # [B, H, S, D], s contiguous
        return flash_attention(qh, kh, vt, mask, lengths, scale=scale, out=o8.permute(as_bhsd), config=config,
                               fp8=fp8_attention)

    def v_quantized_transposed(y: torch.Tensor) -> torch.Tensor:  # fp16 v -> E4M3 [B, H, D, S] (two torch passes)
        return v_transpose((y[:, 2 * WIDTH:] * (1.0 / s_qkv)).to(FP8_DTYPE))

    def fp16_qkv_v_transposed(out_e4m3: bool) -> Callable[[], torch.Tensor]:
        """What an attention tactic could do inside today's engine: v quantized and transposed by the tactic,
        q and k quantized as the kernel loads them (fp16 QKV GEMM unchanged)."""
        def chain() -> torch.Tensor:
            y = qkv_fp16()
            qh, kh = (heads(t, b, s) for t in y[:, :2 * WIDTH].split(WIDTH, -1))
            vt = v_quantized_transposed(y)
            if out_e4m3:
                return flash_attention(qh, kh, vt, mask, lengths, scale=scale, out=o8.permute(as_bhsd),
                                       config=config, fp8=fp8_attention)
            out = flash_attention(qh, kh, vt, mask, lengths, scale=scale, out=o16.permute(as_bhsd), config=config,
                                  fp8=Float8Scales(s_qkv, s_qkv, s_qkv))
            return quantize(o16, s_o, 0.0, FP8_DTYPE)
        return chain

    y16, y8 = qkv_fp16(), qkv_e4m3(qkv_bias)
    q16, k16, v16 = (heads(t, b, s) for t in y16.split(WIDTH, -1))
    q8, k8 = (heads(t, b, s) for t in y8[:, :2 * WIDTH].split(WIDTH, -1))
    v8t = v_transpose(y8[:, 2 * WIDTH:])
    rows: list[tuple[str, Callable[[], torch.Tensor], torch.Tensor | None]] = [
        ("today: QKV fp16 + fp16 attention + quantize", today, reference),
        ("QKV E4M3 + v transposed (torch copy) + FP8 attention -> E4M3", e4m3_then_transpose,
         reference if qkv_bias else None),
        ("QK E4M3 + Vᵀ E4M3 GEMM (swapped) + FP8 attention -> E4M3 (no v bias)", qk_and_v_transposed,
         reference_no_v_bias),
        ("fp16 QKV + v quantized, transposed (torch) + FP8 attention, q/k quantized on load -> fp16 + quantize",
         fp16_qkv_v_transposed(False), reference),
        ("the same, the attention writing E4M3 (no quantize pass)", fp16_qkv_v_transposed(True), reference),
        ("  QKV GEMM -> fp16 (scaled_mm_direct.fast_accum)", qkv_fp16, None),
        ("  QKV GEMM -> E4M3" + (" + bias" if qkv_bias else ", no bias"), lambda: qkv_e4m3(qkv_bias), None),
        ("  QK GEMM -> E4M3 + bias (768 -> 1536)", qk_e4m3, None),
        ("  Vᵀ GEMM -> E4M3, swapped operands (768 x 768 x T)", v_transposed_gemm, None),
        ("  v transpose to [B, H, D, S] (torch copy, E4M3)", lambda: v_transpose(y8[:, 2 * WIDTH:]), None),
        ("  fp16 attention 64x64 (the engine's)", lambda: flash_attention(
            q16, k16, v16, mask, lengths, scale=scale, out=o16.permute(as_bhsd), config=config), None),
        ("  quantize pass of the attention output", lambda: quantize(o16, s_o, 0.0, FP8_DTYPE), None),
        ("  FP8 attention, v transposed -> E4M3", lambda: flash_attention(
            q8, k8, v8t, mask, lengths, scale=scale, out=o8.permute(as_bhsd), config=config, fp8=fp8_attention),
         None),
        ("  v quantized and transposed to [B, H, D, S] E4M3 (torch, two passes)", lambda: v_quantized_transposed(y16),
         None),
        ("  FP8 attention, q/k fp16 quantized on load, v E4M3 transposed -> fp16", lambda: flash_attention(
            q16, k16, v8t, mask, lengths, scale=scale, out=o16.permute(as_bhsd), config=config,
            fp8=Float8Scales(s_qkv, s_qkv, s_qkv)), None),
        ("  FP8 attention, fp16 in (quantized on load) -> E4M3", lambda: flash_attention(
            q16, k16, v16, mask, lengths, scale=scale, out=o8.permute(as_bhsd), config=config, fp8=fp8_attention),
         None),
    ]
    print(f"BERT-base attention block, batch {b}, seq {s}; scales x {s_x:.3g} w {s_w:.3g} qkv {s_qkv:.3g} "
          f"out {s_o:.3g}; attention tile {config.name}")

    def measure(fn: Callable[[], torch.Tensor], check: torch.Tensor | None) -> Callable[[], list[str]]:
        def cells() -> list[str]:  # ms, errors (blank for a piece)
            out = fn()
            torch.cuda.synchronize()
            accuracy = ""
            if check is not None:
                got = out.float() * s_o if out.dtype == FP8_DTYPE else out.float()
                accuracy = errors(got.permute(as_bhsd) if got.shape != check.shape else got, check)
            return [f"{graph_ms(fn):.4f}", accuracy]
        return cells

    print_table(["chain / piece", "ms", "error vs fp32: max / mean (relative)"],
                [(name, measure(fn, check)) for name, fn, check in rows])


if __name__ == "__main__":
    main()
