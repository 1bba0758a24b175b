"""BERT-base's attention layer as onnxruntime's QDQ model quantizes it (issue 12), on the GPU: the op's torch reference
(what a quantized attention ran on CUDA before cuda.attention.quantized), each quantized tactic (session 19's
two-pass kernel, the one-pass kernel), and kiln's fp16 flash attention on the same shape (the fp16 engine's layer) for
scale.

    python3 bench/quantized_attention.py [--batch 64 --seq 384] [--iters 20] [--two-pass N] [--only A,B]
                                         [--kinds fp8,int8] [--dry-run]

E4M3 and int8 q/k/v [B, S, 768] (the projections' outputs, the fused BERT layout: heads split by the op, output
merged), a padding mask [B, 1, 1, S] (fp16, rows padded from a random length >= S/2). ms per call: median of CUDA
events after a warm-up (bench/gpu.py time_cuda). Each tactic's output is checked against the reference first (the
builder's check: QUANTIZED_ATTENTION_STEPS, E4M3 also QUANTIZED_ATTENTION_FLOAT8_SLACK); a table last. --dry-run:
on the CPU under Triton's interpreter at 1 x 64 (checks the script; its times mean nothing). --only: the one-pass
tactics whose names end with one of these (e.g. `w8r128,w8r128l,w4h`); a tactic that fails to compile or run prints
a row saying so and the rest go on.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from tests.gpu.test_quantized_attention_cuda import QUANT  # noqa: E402  the GPU test's scales, one table

HEADS, HEAD_DIM = 12, 64
LAYOUT = {"scale": 1.0, "nan_to_zero": 1, "q_num_heads": HEADS, "kv_num_heads": HEADS, "q_perm": [0, 2, 1, 3],
          "k_perm": [0, 2, 1, 3], "v_perm": [0, 2, 1, 3], "out_perm": [0, 2, 1, 3], "out_merge_heads": 1}
TWO_PASS = ("cuda.attention.quantized.64x64.w4s2", "cuda.attention.quantized.128x64.w8s2",
            "cuda.attention.quantized.64x32.w4s2")  # session 19's kernel (issue 12: 0.53-0.61 ms on the H100)
ONE_PASS = ("cuda.attention.quantized_one_pass.32x128.w8", "cuda.attention.quantized_one_pass.32x128.w8r128",
            "cuda.attention.quantized_one_pass.16x128.w4",
            "cuda.attention.quantized_one_pass.16x64.w4", "cuda.attention.quantized_one_pass.32x64.w4",
            "cuda.attention.quantized_one_pass.64x64.w4",  # for <= 256 keys
            # session 21's lean kernel (l: loads ahead, one row reduction, E4M3 by conversion; h: scores held as
            # bytes, 64/128-row wgmma tiles; k: k/v converted to fp16 once a call)
            "cuda.attention.quantized_one_pass.32x128.w8r128l", "cuda.attention.quantized_one_pass.32x128.w8r128lk",
            "cuda.attention.quantized_one_pass.16x128.w4l", "cuda.attention.quantized_one_pass.64x64.w4h",
            "cuda.attention.quantized_one_pass.64x64.w4hk", "cuda.attention.quantized_one_pass.128x64.w8h",
            "cuda.attention.quantized_one_pass.64x128.w4h")


def _time_once(fn, warmup: int, iters: int) -> list[float]:
    """--dry-run's stand-in for time_cuda: one call, wall clock."""
    start = time.perf_counter()
    fn()
    return [(time.perf_counter() - start) * 1e3]


def main() -> int:
    dry = "--dry-run" in sys.argv
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        import tests.kernels.conftest  # noqa: F401  the interpreter's scalar-index fix for older Triton
    from gpu import time_cuda

    from kiln.builder.accuracy import (QUANTIZED_ATTENTION_FLOAT8_SHARE, QUANTIZED_ATTENTION_FLOAT8_SLACK,
                                       QUANTIZED_ATTENTION_STEPS, float8_ordinal, mismatch)
    from kiln.ops.fused import attention
    from kiln.ops.registry import OpContext
    from kiln.plan.spec import StepSpec
    from kiln.tactics import registry
    from kiln.tactics.cuda.attention import ONE_PASS_TILES

    one_pass_keys = {f"cuda.attention.quantized_one_pass.{bm}x{bn}.w{w}{f'r{r}' if r else ''}{form}": keys
                     for bm, bn, w, keys, _, r, form in ONE_PASS_TILES}
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=384)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--two-pass", type=int, default=len(TWO_PASS), help="how many two-pass tiles to time (compiles)")
    ap.add_argument("--only", default="", help="one-pass tactics whose names end with one of these (comma-separated)")
    ap.add_argument("--kinds", default="fp8,int8", help="q/k/v kinds to time: fp8, int8")
    args = ap.parse_args()
    cuda = torch.device("cpu" if dry else "cuda")
    if dry:
        args.batch, args.seq, time_cuda = 1, 64, _time_once
    g = torch.Generator(device=cuda).manual_seed(0)
    width = HEADS * HEAD_DIM
    lengths = torch.randint(args.seq // 2, args.seq + 1, (args.batch, 1, 1, 1), device=cuda, generator=g)
    mask = torch.where(torch.arange(args.seq, device=cuda) < lengths, 0.0, torch.finfo(torch.float16).min).half()
    ctx = OpContext("attention", "Attention", domain="kiln")
    device = "CPU, Triton interpreter (dry run)" if dry else torch.cuda.get_device_name()
    print(f"device: {device}  torch {torch.__version__}  BERT-base attention "
          f"{args.batch} x {args.seq}, padding mask")
    rows = []
    ends = tuple("." + e.lstrip(".") for e in args.only.split(",") if e)
    one_pass = [name for name in ONE_PASS if not ends or name.endswith(ends)]
    for kind, attributes in QUANT.items():
        if kind not in args.kinds.split(","):
            continue
        attributes = {**LAYOUT, **attributes}
        if kind == "fp8":
            q, k, v = ((torch.randn(args.batch, args.seq, width, device=cuda, generator=g) * 60).clamp(-448, 448)
                       .to(torch.float8_e4m3fn) for _ in range(3))
        else:
            q, k, v = (torch.randint(-128, 128, (args.batch, args.seq, width), device=cuda, generator=g,
                                     dtype=torch.int32).to(torch.int8) for _ in range(3))
        with torch.inference_mode():
            want = attention(ctx, q, k, v, mask, **attributes)
            reference_ms = statistics.median(time_cuda(lambda: attention(ctx, q, k, v, mask, **attributes), 3,
                                                       args.iters))
            rows.append((kind, "op reference (torch; CUDA's only way before)", reference_ms, "-"))
            step = StepSpec(op_type="Attention", domain="kiln", name="attention", inputs=["q", "k", "v", "mask"],
                            outputs=["y"], attributes=attributes)
            for name in TWO_PASS[:args.two_pass] + tuple(one_pass):
                if one_pass_keys.get(name, args.seq) < args.seq:
                    continue  # the tile's registers do not hold this many keys' scores
                try:
                    launch = registry.get(name).prepare(step, [None] * 4, cuda)
                    got = launch(ctx, q, k, v, mask, **attributes)
                except Exception as e:  # a tile that does not compile (or run) here: a row, not the end
                    rows.append((kind, name, float("nan"), f"FAILED: {type(e).__name__}: {str(e)[:120]}"))
                    print(f"{name} {kind}: {type(e).__name__}: {str(e)[:400]}", flush=True)
                    continue
                apart = ((float8_ordinal(got) - float8_ordinal(want)) if kind == "fp8"
                         else (got.int() - want.int())).abs().float()
                agreement = (f"max {apart.max().item():.0f} steps, {(apart > 0).float().mean().item():.4%} off, "
                             f"max |diff| {(got.float() - want.float()).abs().max().item():g} units")
                slack = QUANTIZED_ATTENTION_FLOAT8_SLACK if kind == "fp8" else 0.0
                if mismatch(got, want, integer_steps=QUANTIZED_ATTENTION_STEPS, float8_slack=slack,
                            float8_slack_share=QUANTIZED_ATTENTION_FLOAT8_SHARE):
                    agreement += " (FAILS the builder's check)"
                try:
                    ms = statistics.median(time_cuda(lambda: launch(ctx, q, k, v, mask, **attributes), 3,
                                                     args.iters))
                except Exception as e:
                    ms, agreement = float("nan"), f"{agreement}; timing FAILED: {type(e).__name__}"
                rows.append((kind, name, ms, agreement))
    half = {"scale": 0.125, "nan_to_zero": 1, **{n: LAYOUT[n] for n in LAYOUT if n not in ("scale", "nan_to_zero")}}
    q, k, v = (torch.randn(args.batch, args.seq, width, device=cuda, generator=g, dtype=torch.float16) for _ in range(3))
    step = StepSpec(op_type="Attention", domain="kiln", name="attention", inputs=["q", "k", "v", "mask"],
                    outputs=["y"], attributes=half)
    with torch.inference_mode():
        for name in ("cuda.attention.triton.64x64.w4s3", "cuda.attention.triton.128x64.w4s3"):
            try:
                launch = registry.get(name).prepare(step, [None] * 4, cuda)
                ms = statistics.median(time_cuda(lambda: launch(ctx, q, k, v, mask, **half), 3, args.iters))
                rows.append(("fp16", f"{name} (an fp16 engine's tile)", ms, "-"))
            except Exception as e:
                rows.append(("fp16", name, float("nan"), f"FAILED: {type(e).__name__}: {str(e)[:120]}"))
    fp16_ms = min([ms for kind, _, ms, _ in rows if kind == "fp16" and ms == ms] or [float("nan")])
    print("\n| q/k/v | kernel | ms | x the fastest fp16 tile | vs the op reference |\n|---|---|---|---|---|")
    for kind, name, ms, agreement in rows:
        print(f"| {kind} | {name} | {ms:.3f} | {ms / fp16_ms:.2f}x | {agreement} |".replace("\n", " "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
