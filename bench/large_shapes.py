"""Where kiln's time goes at the stream's large shapes on the GPU, beside torch.compile (issue 10).

    python bench/large_shapes.py [--model bert_base] [--shapes 32x512,16x256,8x128] [--out DIR]

One engine with a profile (as bench/dynamic.py builds it), fed each shape with a padding mask (every row at
least half real). For each shape: kiln's `context.run` (graph replay after its bucket's capture), torch eager
fp16 and torch.compile(dynamic=True) wall time per call (CUDA-synchronized, median of 20), then a
torch.profiler kernel table for kiln and for torch.compile at the largest shape: the kernels by total GPU time,
grouped by family (GEMM, attention, norm, elementwise, copy), so the gap can be read kernel by kernel.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kiln  # noqa: E402
from kiln import zoo  # noqa: E402

FAMILIES = [("attention", r"flash|fmha|attention|attn|sdpa|efficient"),  # first: FlashAttention's kernels name cutlass
            ("gemm", r"gemm|cutlass|sm90_xmma|nvjet|cublas|matmul|_mm_|mm_kernel"),
            ("norm", r"norm|layer_norm|welford|rms"),
            ("softmax", r"softmax"),
            ("copy", r"copy|memcpy|memset|cat|fill"),
            ("elementwise/fused", r".")]


def family(name: str) -> str:
    low = name.lower()
    for fam, pattern in FAMILIES:
        if re.search(pattern, low):
            return fam
    return "other"


def timed(fn, calls: int = 20, warmup: int = 3) -> float:
    """Median wall ms of `calls` synchronized calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(1000 * (time.perf_counter() - t))
    return statistics.median(out)


def kernel_table(fn, label: str, lines: list[str]) -> dict[str, float]:
    """Appends `fn`'s GPU kernels per call by family and the top kernels to `lines`; returns ms per family."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            by_name[ev.name][0] += ev.device_time_total / 5 / 1000  # ms per call
            by_name[ev.name][1] += 1
    fams: dict[str, float] = defaultdict(float)
    for name, (ms, _) in by_name.items():
        fams[family(name)] += ms
    total = sum(fams.values())
    lines.append(f"\n### {label}: GPU kernel time {total:.3f} ms per call")
    lines.append("| family | ms | share |")
    lines.append("|---|---|---|")
    for fam, ms in sorted(fams.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {fam} | {ms:.3f} | {ms / total:.0%} |")
    lines.append("| top kernels | ms per call | launches per call |")
    lines.append("|---|---|---|")
    for name, (ms, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:14]:
        lines.append(f"| {name[:110]} | {ms:.3f} | {n / 5:.0f} |")
    return dict(fams)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert_base")
    ap.add_argument("--shapes", default="32x512,16x256,8x128")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, model {args.model}, fp16, "
             f"commit {os.environ.get('KILN_COMMIT', '?')}"]
    model = zoo.get(args.model)
    exported = zoo.export(args.model, batch=2, seq=16, dynamic=True)
    max_b, max_s = max(b for b, _ in shapes), max(s for _, s in shapes)
    engine = kiln.build(str(exported.path), device="cuda", precision="fp16",
                        profiles=[{"input_ids": f"1x1,8x128,{max(32, max_b)}x{max(512, max_s)}"}])
    ctx = engine.create_execution_context()
    module = zoo.torch_model(args.model).cuda().half().eval()
    compiled = None if args.no_compile else torch.compile(module, dynamic=True)
    rng = np.random.default_rng(0)
    lines.append("| shape | tokens | real tokens | kiln ms | torch eager ms | torch.compile dynamic ms | "
                 "kiln / fastest |")
    lines.append("|---|---|---|---|---|---|---|")
    feeds_at = {}
    with torch.inference_mode():
        for b, s in shapes:
            mask = np.ones((b, s), np.int64)
            for row in range(b):
                mask[row, rng.integers(max(1, s // 2), s + 1):] = 0
            ids = rng.integers(0, model.vocab_size, (b, s), dtype=np.int64)
            feeds = {"input_ids": torch.from_numpy(ids).cuda(), "attention_mask": torch.from_numpy(mask).cuda()}
            feeds_at[(b, s)] = feeds
            k = timed(lambda: ctx.run(feeds))
            e = timed(lambda: module(**feeds))
            c = timed(lambda: compiled(**feeds)) if compiled is not None else float("nan")
            fastest = min(e, c) if compiled is not None else e
            lines.append(f"| {b}x{s} | {b * s} | {int(mask.sum())} | {k:.3f} | {e:.3f} | {c:.3f} | "
                         f"{k / fastest:.2f} |")
            print(lines[-1], flush=True)
        big = max(shapes, key=lambda bs: bs[0] * bs[1])
        feeds = feeds_at[big]
        kernel_table(lambda: ctx.run(feeds), f"kiln {big[0]}x{big[1]}", lines)
        if compiled is not None:
            kernel_table(lambda: compiled(**feeds), f"torch.compile dynamic {big[0]}x{big[1]}", lines)
        kernel_table(lambda: module(**feeds), f"torch eager {big[0]}x{big[1]}", lines)
    stats = ctx.runner.stats if ctx.runner is not None else None
    if stats is not None:
        lines.append(f"\nkiln graphs: {stats.captures} captured, {stats.replays} replays, {stats.split_runs} split runs")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out, "large-shapes.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
