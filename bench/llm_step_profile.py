"""Where a large-batch decode step's time goes on the GPU, part by part, and what the parts could take instead.

    python bench/llm_step_profile.py [--batch 256] [--quantization fp8] [--baseline .cache/llm2-base] --out $OUT

Issue 15: an FP8 Llama-3-8B decode step at batch 256 replays in ~11 ms on the H200 where its bytes and FLOPs
allow ~3-4 ms. One process, one engine (Llama-3-8B shape, random weights made on the device, FP8 weights, bf16 KV,
CUDA graphs, decode GEMVs and fusion off: they cover <= 16 rows only, kiln/llm/decode_gemv.py ROW_BUCKETS):

1. A generate of `batch` 128-token prompts for --decoded tokens leaves the decode graph's static inputs holding a
   batch at ~128 + decoded keys (192 by default: the middle of a 128/128 run). The forward graphs of a few buckets
   are replayed and timed (CUDA events), then the --batch bucket's under torch.profiler (CUPTI sees the kernels in
   a replay). Each kernel is labelled by its role and, for GEMMs and FP8 activation quantization, by the projection
   it serves (the order of a Llama layer's kernels: norm, quantize, qkv GEMM, rope + KV write, attention split and
   merge, quantize, o GEMM, add + norm, quantize, gate|up GEMM, SwiGLU, quantize, down GEMM, add + norm; the LM head
   after the last layer). Per label: GPU us per step, the kernel's name, bytes it must read and the rate reached.
2. The GEMMs alone, each a CUDA graph of calls over the 32 layers' weights (reads from HBM, as in a step), at rows
   64 / 256 / 512 / 1024: FP8 with per-token x per-channel scales (torch._scaled_mm rowwise: the engine's path),
   FP8 with unit per-tensor scales (bf16 and fp32 out: what a consumer applying the scales itself would read),
   bf16 (F.linear on dequantized weights); and the engine's FP8 activation quantization kernel.
3. Paged decode attention alone at batch 1 / 64 / 256 / 1024 and ~192 keys, bf16 and FP8 KV, over 4 layers' caches:
   the baseline tree's kernel (--baseline: its kiln/ folder, if given) against this tree's, at several tiles,
   warps, pipeline stages and (FP8 cache) fp16 products; each checked against the torch reference on a few rows.
   The fastest per KV dtype goes to $OUT/decode_attention_best.json (llm_throughput.py --attention-json reads it).
4. (--parts prefill) One prefill step of --batch 128-token prompts, eager as the engine runs it, kernel by kernel.
5. (--parts prefill-attention) Prefill attention alone on one layer of --batch whole 128-token prompts, bf16 and FP8
   caches: the paged kernel at a few launches (warps, key tile, stages; fp16 or bf16 products on an FP8 cache) and
   prefill_attention="flash" (K/V gathered back from the cache, torch's varlen flash attention), against the torch
   reference on 2 requests; ms per layer (CUDA events) and TFLOP/s over the causal half.
Prints the tables (markdown) and writes them to $OUT/step_profile.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from llm import write_checkpoint  # noqa: E402  bench/llm.py

from kiln.llm import LLM, SamplingParams  # noqa: E402
from kiln.llm.attention import AttentionMetadata, paged_attention  # noqa: E402
from kiln.llm.decode_gemv import graph_time  # noqa: E402
from kiln.llm.kernels import paged_decode  # noqa: E402
from kiln.llm.kernels.fused import fp8_quantize_rows  # noqa: E402

PROJECTIONS = ("qkv", "o", "gate_up", "down")
HBM_TBS = 4.8  # H200 HBM3e peak
FP8_TFLOPS, BF16_TFLOPS = 1979.0, 989.0  # H200 SXM dense peaks
LINES: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LINES.append(line)


def projection_layers(model, name: str) -> list:
    out = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        out.append({"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}[name])
    return out


# ---- 1. in situ -------------------------------------------------------------------------------------------------

def role(name: str) -> str:
    n = name.lower()
    for key, label in (("_rms_norm", "rms norm (+ residual add)"), ("_fp8_rows", "fp8 quantize"),
                       ("_rope_kv", "rope + kv write"), ("_decode_split", "attention: split kernel"),
                       ("_prefill_kernel", "attention: prefill kernel"),
                       ("flash_fwd", "attention: flash (prefill)"),
                       ("_merge_splits", "attention: merge kernel"), ("_silu_mul", "silu * up"),
                       ("argmax", "argmax (greedy)"), ("embedding", "embedding"), ("index", "embedding")):
        if key in n:
            return label
    if any(k in n for k in ("gemm", "cutlass", "nvjet", "xmma", "sm90_", "gemv", "scaled_mm", "f8f8", "splitk")):
        return "gemm"
    return "other"


def label_kernels(names: list[str], num_layers: int) -> list[str]:
    """Per kernel of one replay: its role, GEMMs and quantizations with the projection they serve (by the order
    of a layer's kernels: a merge is followed by o, silu by down, a norm after o by gate_up, any other norm by qkv,
    the norm after the last layer's down by the LM head)."""
    labels, phase, last_gemm, layers_done = [], "qkv", None, 0
    for name in names:
        r = role(name)
        if r.startswith("rms norm"):
            phase = "gate_up" if last_gemm == "o" else ("lm_head" if layers_done == num_layers else "qkv")
        elif r.startswith("attention"):
            phase = "o"
        elif r == "silu * up":
            phase = "down"
        if r == "gemm":
            labels.append(f"gemm {phase}")
            if phase == "down" and last_gemm != "down":
                layers_done += 1
            last_gemm = phase
        elif r == "fp8 quantize":
            labels.append(f"fp8 quantize ({phase} input)")
        else:
            labels.append(r)
    return labels


def kernel_events(prof) -> list:
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(events, key=lambda e: e.time_range.start)


def profile_replay(llm, batch: int, replays: int) -> None:
    engine = llm.engine
    graphs, model = engine.runner.graphs, engine.model
    bucket = graphs.bucket(batch)
    graph = graphs.forward_graphs[bucket]
    seq_lens = graphs.seq_lens[:bucket].tolist()
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    events = kernel_events(prof)
    per = len(events) // replays
    if per * replays != len(events):
        say(f"(profile: {len(events)} kernel events for {replays} replays: not a multiple; using the first {per})")
    names = [e.name for e in events[:per]]
    labels = label_kernels(names, len(model.layers))
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0, set()])  # label -> calls, us, kernel names
    for i, e in enumerate(events[:per * replays]):
        entry = totals[labels[i % per]]
        entry[0] += 1
        entry[1] += e.time_range.elapsed_us()
        entry[2].add(e.name)
    step_ms = graphs.time_replay(batch, repeats=20)
    kernel_ms = sum(v[1] for v in totals.values()) / replays / 1e3
    say(f"\n### In situ: the batch-{batch} forward graph (bucket {bucket}), keys per row {min(seq_lens)}-"
        f"{max(seq_lens)} (mean {sum(seq_lens) / len(seq_lens):.0f})")
    say(f"replay {step_ms:.3f} ms (CUDA events); kernels {kernel_ms:.3f} ms in {per} launches; "
        f"gaps {step_ms - kernel_ms:.3f} ms")
    kv = engine.kv_caches[0][0]
    kv_bytes = sum(seq_lens) * kv.shape[2] * kv.shape[3] * kv.element_size() * 2  # k and v, one layer
    need = {}  # label -> (bytes read per call, flops per call)
    for p in PROJECTIONS:
        layer = projection_layers(model, p)[0]
        w = layer.quantized.q if layer.quantized is not None else layer.weight
        need[f"gemm {p}"] = (w.numel() * w.element_size(), 2 * bucket * w.numel())
    head = model.lm_head if model.lm_head is not None else model.embed_tokens
    need["gemm lm_head"] = (head.weight.numel() * head.weight.element_size(), 2 * bucket * head.weight.numel())
    need["attention: split kernel"] = (kv_bytes, 0)
    say("| part | calls / step | us / step | share | us / call | bytes read / call | TB/s | TFLOP/s | kernel |")
    say("|---|---|---|---|---|---|---|---|---|")
    total_us = kernel_ms * 1e3
    for label, (calls, us, kernels) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        calls_step, us_step = calls / replays, us / replays
        per_call = us / calls
        nbytes, flops = need.get(label, (0, 0))
        rate = f"{nbytes / per_call / 1e6:.2f}" if nbytes else ""
        tflops = f"{flops / per_call / 1e6:.0f}" if flops else ""
        kernel = sorted(kernels, key=len)[0][:70] + (f" (+{len(kernels) - 1})" if len(kernels) > 1 else "")
        say(f"| {label} | {calls_step:.0f} | {us_step:,.0f} | {us_step / total_us:.1%} | {per_call:.1f} | "
            f"{nbytes / 1e6:,.1f} MB | {rate} | {tflops} | `{kernel}` |" if nbytes else
            f"| {label} | {calls_step:.0f} | {us_step:,.0f} | {us_step / total_us:.1%} | {per_call:.1f} | | | | "
            f"`{kernel}` |")
    gemm_names = sorted({e.name for e, lab in zip(events[:per], labels) if lab.startswith("gemm")})
    say("GEMM kernels in the step: " + "; ".join(n[:160] for n in gemm_names))


def profile_prefill(llm, batch: int) -> None:
    """One prefill step of `batch` 128-token prompts (eager, as the engine runs it: LLM.generate of one token),
    kernel by kernel, and its wall time."""
    engine, model = llm.engine, llm.engine.model
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False)
    llm.generate([torch.randint(3, vocab, (128,)).tolist() for _ in range(batch)], params)  # compile, warm up
    engine.block_manager.reset_prefix_cache()
    prompts = [torch.randint(3, vocab, (128,)).tolist() for _ in range(batch)]
    torch.cuda.synchronize()
    started = time.perf_counter()
    llm.generate(prompts, params)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - started) * 1e3
    engine.block_manager.reset_prefix_cache()
    prompts = [torch.randint(3, vocab, (128,)).tolist() for _ in range(batch)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)
        torch.cuda.synchronize()
    events = kernel_events(prof)
    labels = label_kernels([e.name for e in events], len(model.layers))
    totals: dict[str, list] = defaultdict(lambda: [0, 0.0, set()])
    for e, label in zip(events, labels):
        totals[label][0] += 1
        totals[label][1] += e.time_range.elapsed_us()
        totals[label][2].add(e.name)
    tokens = batch * 128
    kernel_ms = sum(v[1] for v in totals.values()) / 1e3
    say(f"\n### Prefill: {batch} prompts x 128 tokens = {tokens:,} tokens in one step (eager)")
    say(f"wall {wall_ms:.1f} ms (LLM.generate of one token, unprofiled); kernels {kernel_ms:.1f} ms in {len(events)} "
        f"launches")
    flops = {}
    for p in PROJECTIONS:
        layer = projection_layers(model, p)[0]
        w = layer.quantized.q if layer.quantized is not None else layer.weight
        flops[f"gemm {p}"] = 2 * tokens * w.numel()
    say("| part | calls | ms | share | TFLOP/s | kernel |")
    say("|---|---|---|---|---|---|")
    for label, (calls, us, kernels) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        rate = f"{flops[label] * calls / us / 1e6:.0f}" if label in flops else ""
        kernel = sorted(kernels, key=len)[0][:70] + (f" (+{len(kernels) - 1})" if len(kernels) > 1 else "")
        say(f"| {label} | {calls} | {us / 1e3:.2f} | {us / 1e3 / kernel_ms:.1%} | {rate} | `{kernel}` |")


# ---- 2. GEMMs alone ---------------------------------------------------------------------------------------------

def gemm_table(model, rows_list: list[int]) -> None:
    """FP8 projections alone: the engine's rowwise-scaled GEMM against cuBLAS's per-tensor FP8 GEMM with unit scales
    (bf16 out, and fp32 out: what a consumer kernel that applies the row x channel scales itself would read)."""
    say("\n### GEMMs alone (CUDA graph over the 32 layers' weights; us per call)")
    say("| projection | K x N | rows | fp8 quantize x | fp8 rowwise (engine) | fp8 per-tensor, bf16 out | "
        "fp8 per-tensor, fp32 out | bf16 | engine TB/s | engine TFLOP/s |")
    say("|---|---|---|---|---|---|---|---|---|---|")
    for p in PROJECTIONS:
        layers = projection_layers(model, p)
        fp8 = [layer.quantized for layer in layers]
        if any(q is None or not hasattr(q, "scale") or q.q.dtype != torch.float8_e4m3fn for q in fp8):
            say(f"| {p} | not FP8 weights: skipped |")
            continue
        n, k = fp8[0].q.shape
        bf16 = [q.dequantize(torch.bfloat16) for q in fp8[:8]]  # 8 layers: > L2 each round, 14 GB less memory
        one = torch.ones((), device=fp8[0].q.device)
        for rows in rows_list:
            x = torch.randn((rows, k), device=fp8[0].q.device, dtype=torch.bfloat16)
            xq, xs = fp8_quantize_rows(x)
            times = {
                "quant": graph_time([lambda: fp8_quantize_rows(x)]),
                "rowwise": graph_time([lambda w=w: torch._scaled_mm(xq, w.q.t(), scale_a=xs, scale_b=w.scale[None, :],
                                                                    out_dtype=x.dtype) for w in fp8]),
                "tensor": graph_time([lambda w=w: torch._scaled_mm(xq, w.q.t(), scale_a=one, scale_b=one,
                                                                   out_dtype=x.dtype) for w in fp8]),
                "tensor32": graph_time([lambda w=w: torch._scaled_mm(xq, w.q.t(), scale_a=one, scale_b=one,
                                                                     out_dtype=torch.float32) for w in fp8]),
                "bf16": graph_time([lambda w=w: F.linear(x, w) for w in bf16]),
            }
            us = times["rowwise"]
            say(f"| {p} | {k} x {n} | {rows} | {times['quant']:.1f} | {us:.1f} | {times['tensor']:.1f} | "
                f"{times['tensor32']:.1f} | {times['bf16']:.1f} | {n * k / us / 1e6:.2f} | "
                f"{2 * rows * n * k / us / 1e6:.0f} |")
        del bf16
        torch.cuda.empty_cache()


def lm_head_time(model, rows: int) -> None:
    head = model.lm_head if model.lm_head is not None else model.embed_tokens
    x = torch.randn((rows, head.weight.shape[1]), device=head.weight.device, dtype=torch.bfloat16)
    us = graph_time([lambda: head.logits(x)])
    lin = graph_time([lambda: F.linear(x, head.weight)])
    arg = graph_time([lambda: head.logits(x).argmax(dim=-1)])
    say(f"LM head at {rows} rows: logits (bf16 GEMM + fp32 copy) {us:.1f} us, the GEMM alone {lin:.1f} us, "
        f"logits + argmax {arg:.1f} us ({head.weight.numel() * 2 / lin / 1e6:.2f} TB/s)")


# ---- 3. paged decode attention alone ----------------------------------------------------------------------------

def load_kernel_module(tree: Path):
    path = tree / "kiln" / "llm" / "kernels" / "paged_decode.py"
    spec = importlib.util.spec_from_file_location(f"baseline_paged_decode_{abs(hash(str(tree)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def attention_cases(batch: int, keys: int, kv_dtype: torch.dtype, layers: int = 4, heads: int = 32,
                    kv_heads: int = 8, head_dim: int = 128, page: int = 16):
    blocks = -(-keys // page)
    num_blocks = batch * blocks + 1
    g = torch.Generator(device="cuda").manual_seed(batch)
    caches = []
    for _ in range(layers):
        k = torch.randn((num_blocks, page, kv_heads, head_dim), device="cuda", generator=g).to(kv_dtype)
        v = torch.randn((num_blocks, page, kv_heads, head_dim), device="cuda", generator=g).to(kv_dtype)
        caches.append((k, v))
    order = torch.randperm(num_blocks - 1, device="cuda", generator=g) + 1  # scattered, never the null block
    tables = torch.zeros((batch, 512 // page), dtype=torch.int32, device="cuda")  # max_model_len 512's width
    tables[:, :blocks] = order[:batch * blocks].view(batch, blocks).to(torch.int32)
    lens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    q = torch.randn((batch, heads, head_dim), device="cuda", generator=g).to(torch.bfloat16)
    return q, caches, tables, lens


VARIANTS = [  # name, split_tokens, block_n, num_warps, num_stages, fp8_f16_dot, heads_first ("base": --baseline's)
    ("base", 256, 64, 4, 3, False, False), ("n64 w4 s3 (main)", 256, 64, 4, 3, False, False),
    ("n64 w4 s5", 256, 64, 4, 5, False, False), ("n32 w4 s5", 256, 32, 4, 5, False, False),
    ("n32 w2 s5", 256, 32, 2, 5, False, False), ("n64 w4 s3 hf", 256, 64, 4, 3, False, True),
    ("n64 w4 s5 hf", 256, 64, 4, 5, False, True), ("n64 w4 s3 f16", 256, 64, 4, 3, True, False),
    ("n64 w4 s5 f16", 256, 64, 4, 5, True, False), ("n32 w4 s5 f16", 256, 32, 4, 5, True, False),
    ("n32 w2 s5 f16", 256, 32, 2, 5, True, False), ("n64 w4 s3 f16 hf", 256, 64, 4, 3, True, True),
    ("n64 w4 s5 f16 hf", 256, 64, 4, 5, True, True),
    # more of a request's keys in flight per program (llm6): a split's 192-256 keys in one or two tiles, 8 warps
    ("n64 w8 s4", 256, 64, 8, 4, False, False), ("n128 w8 s2", 256, 128, 8, 2, False, False),
    ("n128 w8 s3", 256, 128, 8, 3, False, False), ("n256 w8 s1", 256, 256, 8, 1, False, False),
    ("n256 w8 s2", 256, 256, 8, 2, False, False), ("n64 w8 s4 f16", 256, 64, 8, 4, True, False),
    ("n128 w8 s2 f16", 256, 128, 8, 2, True, False), ("n128 w8 s3 f16", 256, 128, 8, 3, True, False),
    ("n256 w8 s1 f16", 256, 256, 8, 1, True, False), ("n256 w8 s2 f16", 256, 256, 8, 2, True, False),
    # one warp a program (llm7: FP8 81 us at batch 512; the engine's FP8 launch since llm8), and neighbours
    ("n32 w1 s5", 256, 32, 1, 5, False, False), ("n32 w1 s5 f16", 256, 32, 1, 5, True, False),
    ("n32 w1 s4 f16", 256, 32, 1, 4, True, False), ("n32 w1 s6 f16", 256, 32, 1, 6, True, False),
    ("n64 w1 s4 f16", 256, 64, 1, 4, True, False), ("n16 w1 s6 f16", 256, 16, 1, 6, True, False),
    ("n64 w2 s5 f16", 256, 64, 2, 5, True, False), ("n32 w1 s5 f16 hf", 256, 32, 1, 5, True, True),
    ("n32 w1 s3 f16", 256, 32, 1, 3, True, False), ("n32 w2 s4 f16", 256, 32, 2, 4, True, False)]


def attention_table(baseline, batches: list[int], keys: int, best_json: Path,
                    selected: dict[str, list[str] | None]) -> None:
    """Prints the table; writes the fastest variant per KV dtype (the sum of its times over `batches`) as the
    launch settings paged_decode_attention takes to best_json (after each dtype: a timeout keeps the first).
    selected: per KV dtype ("bf16", "fp8") the variant names to run, None for all."""
    say(f"\n### Paged decode attention alone: {keys} keys a row, 32 q heads / 8 kv heads x 128, page 16, grid for "
        "max_model_len 512; us per layer (CUDA graph over 4 layers' caches), effective KV TB/s. sN: split_tokens, "
        "nN: block_n, wN: num_warps, sN: num_stages, f16: fp8_f16_dot (FP8 cache only), hf: heads_first")
    columns = [v for v in VARIANTS if any(v[0] in (names or [v[0]]) for names in selected.values())]
    say("| kv | batch | " + " | ".join(v[0] for v in columns) + " |")
    say("|---|---|" + "---|" * len(columns))
    best = {}
    for kv_dtype in (torch.float8_e4m3fn, torch.bfloat16):  # FP8 first: its kernel is furthest from the bandwidth
        kv_name = "fp8" if kv_dtype == torch.float8_e4m3fn else "bf16"
        totals = defaultdict(float)
        for batch in batches:
            q, caches, tables, lens = attention_cases(batch, keys, kv_dtype)
            kv_bytes = batch * keys * 8 * 128 * 2 * caches[0][0].element_size()
            # the reference on the first rows (torch SDPA over gathered blocks, fp32)
            rows = min(batch, 4)
            meta = AttentionMetadata(slot_mapping=torch.empty(0), query_start=list(range(rows)), query_lens=[1] * rows,
                                     seq_lens=lens[:rows].tolist(), block_tables=tables[:rows],
                                     seq_lens_tensor=lens[:rows])
            k0, v0 = caches[0]
            ref = paged_attention(q[:rows].float(), k0.float(), v0.float(), meta, 128 ** -0.5)
            cells = []
            for name, split, block_n, warps, stages, f16, heads_first in columns:
                if (f16 and kv_dtype != torch.float8_e4m3fn) or name not in (selected[kv_name] or [name]):
                    cells.append("")
                    continue
                if name == "base":
                    if baseline is None:
                        cells.append("-")
                        continue

                    def call(k, v):
                        return baseline.paged_decode_attention(q, k, v, tables, lens, 128 ** -0.5, None, 512)
                else:
                    def call(k, v, split=split, block_n=block_n, warps=warps, stages=stages, f16=f16,
                             heads_first=heads_first):
                        return paged_decode.paged_decode_attention(q, k, v, tables, lens, 128 ** -0.5, None, 512,
                                                                   split_tokens=split, block_n=block_n,
                                                                   num_warps=warps, num_stages=stages, fp8_f16_dot=f16,
                                                                   heads_first=heads_first)
                try:
                    got = call(k0, v0)[:rows].float()
                    err = (got - ref).abs().max().item()
                    if not err < 3e-2:  # bf16 q and p·v: ~2^-8 relative on values of ~1
                        cells.append(f"OFF ({err:.2g})")
                        totals[name] = float("inf")
                        continue
                    us = graph_time([lambda k=k, v=v: call(k, v) for k, v in caches])
                    cells.append(f"{us:.1f} ({kv_bytes / us / 1e6:.2f})")
                    totals[name] += us
                except Exception as failure:  # a config past this GPU's shared memory: named, not fatal
                    cells.append(f"fails: {type(failure).__name__}")
                    totals[name] = float("inf")
            say(f"| {str(kv_dtype).removeprefix('torch.')} | {batch} | " + " | ".join(cells) + " |")
            del caches, q
            torch.cuda.empty_cache()
        name = min((n for n in totals if n != "base"), key=totals.get)
        _, _, block_n, warps, stages, f16, heads_first = next(v for v in VARIANTS if v[0] == name)
        best[kv_name] = {
            "name": name, "block_n": block_n, "num_warps": warps, "num_stages": stages, "fp8_f16_dot": f16,
            "heads_first": heads_first}
        say(f"fastest {kv_dtype}: {name} ({totals[name]:.1f} us over batches {batches})")
        best_json.write_text(json.dumps(best))


# ---- 5. prefill attention alone ---------------------------------------------------------------------------------

PREFILL_VARIANTS = [  # name, num_warps, block_n, num_stages, fp8_f16_dot ("w4 n32 s3": the engine's launch)
    ("w4 n32 s3", 4, 32, 3, True), ("w4 n32 s3 bf16-dot", 4, 32, 3, False), ("w8 n32 s3", 8, 32, 3, True),
    ("w4 n64 s3", 4, 64, 3, True)]


def event_ms(call, reps: int = 5) -> float:
    """Median ms of eager calls (each ~1 ms: launch overhead is noise; the flash path copies its bounds from the
    host, which a CUDA graph cannot capture)."""
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


def prefill_attention_table(batch: int, prompt: int = 128, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                            page: int = 16) -> None:
    """One layer's prefill attention of `batch` whole prompts as the engine's prefill step calls it: the paged
    kernel at each PREFILL_VARIANTS launch and the flash path; each checked against the torch reference on 2
    requests (bf16 q, p: ~2^-8 relative on values of ~1)."""
    from kiln.llm.attention import PREFILL_BLOCK_M, flash_prefill_attention, prefill_tiles, write_kv
    from kiln.llm.kernels.paged_prefill import paged_prefill_attention

    say(f"\n### Prefill attention alone: {batch} whole prompts x {prompt} tokens, {heads} q / {kv_heads} kv heads x "
        f"{head_dim}, page {page}; ms per layer (TFLOP/s over the causal half); paged kernel: wN warps, nN keys a "
        "tile, sN stages (FP8: fp16 products unless bf16-dot); flash: K/V gathered from the cache + varlen flash")
    columns = [v[0] for v in PREFILL_VARIANTS] + ["flash"]
    say("| kv | " + " | ".join(columns) + " |")
    say("|---|" + "---|" * len(columns))
    g = torch.Generator(device="cuda").manual_seed(batch)
    tokens = batch * prompt
    flops = 4 * batch * heads * prompt * (prompt + 1) / 2 * head_dim
    blocks = prompt // page
    q = torch.randn((tokens, heads, head_dim), device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn((tokens, kv_heads, head_dim), device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn((tokens, kv_heads, head_dim), device="cuda", generator=g).to(torch.bfloat16)
    order = (torch.randperm(batch * blocks, device="cuda", generator=g) + 1).to(torch.int32)  # never the null block
    tables = order.view(batch, blocks)
    slots = (tables.long()[:, :, None] * page + torch.arange(page, device="cuda")).reshape(-1)  # token -> slot
    lens = torch.full((batch,), prompt, dtype=torch.int32, device="cuda")
    starts = torch.arange(0, tokens, prompt, dtype=torch.int32, device="cuda")
    tiles = prefill_tiles([prompt] * batch, 0, torch.device("cuda"))
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        k_cache = torch.zeros((batch * blocks + 1, page, kv_heads, head_dim), device="cuda", dtype=kv_dtype)
        v_cache = torch.zeros_like(k_cache)
        write_kv(k, v, k_cache, v_cache, slots)
        rows = 2
        meta = AttentionMetadata(slot_mapping=slots, query_start=list(range(0, tokens, prompt)),
                                 query_lens=[prompt] * batch, seq_lens=[prompt] * batch, block_tables=tables,
                                 seq_lens_tensor=lens, backend="triton", prefill_kernel="flash",
                                 query_start_tensor=starts, query_lens_tensor=lens, prefill_tiles=tiles)
        ref_meta = AttentionMetadata(slot_mapping=torch.empty(0), query_start=[0, prompt], query_lens=[prompt] * rows,
                                     seq_lens=[prompt] * rows, block_tables=tables[:rows], seq_lens_tensor=lens[:rows])
        ref = paged_attention(q[:rows * prompt].float(), k_cache.float(), v_cache.float(), ref_meta, head_dim ** -0.5)
        cells = []
        calls = [lambda warps=w, block_n=n, stages=st, f16=f16: paged_prefill_attention(
            q, k_cache, v_cache, tables, starts, lens, lens, tiles, head_dim ** -0.5, block_m=PREFILL_BLOCK_M,
            block_n=block_n, num_warps=warps, num_stages=stages, fp8_f16_dot=f16)
            for _, w, n, st, f16 in PREFILL_VARIANTS]
        out = torch.empty_like(q)
        calls.append(lambda: flash_prefill_attention(q, k_cache, v_cache, meta, head_dim ** -0.5, out) or out)
        for (name, *_), call in zip(PREFILL_VARIANTS + [("flash",)], calls):
            if kv_dtype != torch.float8_e4m3fn and name.endswith("bf16-dot"):
                cells.append("")
                continue
            try:
                err = (call()[:rows * prompt].float() - ref).abs().max().item()
                if not err < 3e-2:
                    cells.append(f"OFF ({err:.2g})")
                    continue
                ms = event_ms(call)
                cells.append(f"{ms:.3f} ({flops / ms / 1e9:.0f})")
            except Exception as failure:  # a launch past this GPU's resources, or flash missing: named, not fatal
                cells.append(f"fails: {type(failure).__name__}: {str(failure)[:60]}")
        say(f"| {str(kv_dtype).removeprefix('torch.')} | " + " | ".join(cells) + " |")
        del k_cache, v_cache
        torch.cuda.empty_cache()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--quantization", default="fp8")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--decoded", type=int, default=64, help="tokens generated before the profile (keys: 128 + it)")
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--kv-cache-memory", default="10GiB", help="bf16 KV at batch 512 and 192 keys needs ~13 GB")
    parser.add_argument("--baseline", default=None, help="a tree whose kiln/ holds the baseline attention kernel")
    parser.add_argument("--parts", nargs="+", default=["situ", "gemm", "attention"])
    parser.add_argument("--situ-batches", type=int, nargs="+", default=None,
                        help="buckets profiled in situ (default: --batch, and 64 when it is larger)")
    parser.add_argument("--attention-batches", type=int, nargs="+", default=[1, 64, 256, 1024])
    parser.add_argument("--bf16-variants", nargs="+", default=None,
                        help="the attention variants (VARIANTS' names) run on the bf16 cache (default: all)")
    parser.add_argument("--fp8-variants", nargs="+", default=None, help="and on the FP8 cache (default: all)")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = parser.parse_args()
    started = time.perf_counter()
    say(f"## Decode step profile: {args.preset}, quantization {args.quantization}, kv {args.kv_cache_dtype}, "
        f"batch {args.batch}; {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if {"situ", "gemm", "prefill"} & set(args.parts):
        with tempfile.TemporaryDirectory() as tmp:
            write_checkpoint(args.preset, torch.bfloat16, Path(tmp), weights=False)
            llm = LLM(tmp, dtype="bfloat16", kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.batch,
                      max_num_batched_tokens=max(128 * args.batch, 2048), max_model_len=512,
                      quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, device="cuda",
                      cuda_graphs=True, load_format="dummy", gemv="cublas", decode_fusion="off")
            run_engine_parts(llm, args, started)
    if "attention" in args.parts:
        baseline = load_kernel_module(Path(args.baseline)) if args.baseline else None
        attention_table(baseline, args.attention_batches, 128 + args.decoded,
                        Path(args.out, "decode_attention_best.json"), {"bf16": args.bf16_variants,
                                                                       "fp8": args.fp8_variants})
    if "prefill-attention" in args.parts:  # after the decode sweep: a timeout cuts this one
        prefill_attention_table(args.batch)
    say(f"(done after {time.perf_counter() - started:.0f} s)")
    Path(args.out, "step_profile.md").write_text("\n".join(LINES) + "\n")
    return 0


def run_engine_parts(llm, args, started: float) -> None:
    """Parts 1 and 2 on the engine's own model."""
    say(f"engine up in {time.perf_counter() - started:.0f} s; decode GEMVs and fusion off (they cover <= 16 "
        "rows: a step of more rows always takes the layers' own path)")
    vocab = llm.engine.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (128,)).tolist() for _ in range(args.batch)]
    llm.generate(prompts, SamplingParams(max_tokens=args.decoded, temperature=0, ignore_eos=True,
                                         detokenize=False))
    graphs = llm.engine.runner.graphs
    say("replay ms by bucket (keys ~" f"{128 + args.decoded}): " + ", ".join(
        f"{b}: {graphs.time_replay(b):.2f}" for b in graphs.buckets if b >= 16))
    if "situ" in args.parts:
        for batch in args.situ_batches or ([args.batch, 64] if args.batch > 64 else [args.batch]):
            profile_replay(llm, batch, args.replays)
    if "prefill" in args.parts:
        profile_prefill(llm, args.batch)
    if "gemm" in args.parts:
        gemm_table(llm.engine.model, [64, 256, 512, 1024])
        lm_head_time(llm.engine.model, args.batch)
    say(f"(after {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    raise SystemExit(main())
