"""Paged decode attention alone on an FP8 cache (bf16 q, fp16 products: the engine's FP8-KV path): the engine's
launch against KILN_LLM_DECODE_FP8-style launches of the split kernel and of the packed kernel (hN: N K/V heads a
program), at batch 512 and 1, and the fastest picked for the end-to-end run (issue 15, helper llm7, 2026-12-04).

    python bench/llm7_decode_sweep.py [--batches 512 1] [--keys 192] [--launches "h4 n16 w1 s4" ...] --out $OUT

Llama-3-8B heads (32 q / 8 K/V x 128), page 16, scattered block tables, a grid for max_model_len 512 (as the
engine's graph), `keys` keys a row; us per layer: one CUDA graph of 24 calls rotating over 4 layers' caches (the
K/V read from HBM, not L2), median of 5 replays; effective TB/s = K+V bytes / time. Every launch is first checked
against the torch reference (fp32 over the widened cache) on 4 rows at 3e-2 (bf16 q, fp16 p: ~2^-8 relative on
values of ~1), and a row computed alone must equal its bits in the batch (batch invariance); a launch that fails
either, or fails to compile (shared memory), is named and never picked. The pick: the fastest at the first batch
(512: the throughput target) among launches right at every batch. Writes $OUT/llm7_best.txt (the
KILN_LLM_DECODE_FP8 string; empty: the engine's launch) and $OUT/llm7_sweep.json. Then (--read-only) a kernel that
only reads the K/V as the decode kernels do, at the largest batch: the bandwidth the access pattern allows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kiln.llm.attention import AttentionMetadata, paged_attention  # noqa: E402
from kiln.llm.decode_gemv import graph_time  # noqa: E402
from kiln.llm.kernels import paged_decode  # noqa: E402
from kiln.llm.kernels.paged_decode import parse_launch  # noqa: E402

# without CUDA (a dry run of this script under TRITON_INTERPRET=1: small --batches, few --launches) the tensors live
# on the CPU and a launch is timed by the wall clock of one call
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def time_us(calls) -> float:
    if DEVICE == "cuda":
        return graph_time(calls)
    start = time.perf_counter()
    for call in calls:
        call()
    return (time.perf_counter() - start) / len(calls) * 1e6


DEFAULT_LAUNCHES = [  # in priority order (the budget may cut the tail)
    "",  # the engine's FP8 launch: the split kernel, 32-key tiles, 1 warp, 5 stages, 256-key splits
    # packed: GQA 4:1 x 4 K/V heads = 16 rows (no padded rows), a key's 4 heads 512 contiguous bytes
    "h4 n16 w1 s4", "h4 n16 w1 s3", "h4 n16 w1 s2", "h4 n32 w1 s3", "h4 n16 w2 s4", "h4 n32 w2 s3", "h4 n32 w4 s3",
    "h4 n64 w4 s2",
    # 8 heads (a key's whole 1 KB slot row): 32 rows, so 2 warps split the rows (no cross-warp softmax exchange)
    "h8 n16 w2 s3", "h8 n16 w2 s2", "h8 n32 w2 s3", "h8 n16 w4 s3", "h8 n32 w4 s2", "h8 n32 w8 s2",
    "h2 n32 w1 s4", "h2 n32 w1 s3", "h2 n16 w1 s5", "h2 n32 w2 s3",
    # the split kernel: fewer stages (less shared memory: more programs an SM), and 192 keys in 2 / 3 splits
    "n32 w1 s2", "n16 w1 s3", "hf1", "n32 w1 s3 hf1", "sp128", "sp64",
    "h4 n16 w1 s4 sp64", "h4 n32 w2 s3 sp64", "h2 n32 w1 s4 sp128", "h8 n16 w2 s3 sp64",
]


@triton.jit
def _gather_read_kernel(k_cache, v_cache, block_tables, seq_lens, out_ptr, stride_kb, stride_kt, stride_kh, stride_tb,
                        HPP: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The decode kernel's reads and nothing else (the bandwidth bound of its access pattern): program (request,
    HPP K/V heads) walks the request's keys through the block table in tiles of BLOCK_N keys x HPP heads, as
    _decode_packed_kernel does, and sums the widened K and V into one row it stores."""
    b = tl.program_id(0).to(tl.int64)
    kv0 = tl.program_id(1) * HPP
    seq_len = tl.load(seq_lens + b)
    cols = tl.arange(0, BLOCK_N * HPP)
    d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for n0 in range(0, seq_len, BLOCK_N):
        pos = n0 + cols // HPP
        ok = pos < seq_len
        block = tl.load(block_tables + b * stride_tb + pos // PAGE, mask=ok, other=0).to(tl.int64)
        off = block * stride_kb + (pos % PAGE) * stride_kt + (kv0 + cols % HPP) * stride_kh
        k = tl.load(k_cache + off[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(tl.float16)
        v = tl.load(v_cache + off[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(tl.float16)
        acc += tl.sum((k + v).to(tl.float32), 0)
    tl.store(out_ptr + (b * tl.num_programs(1) + tl.program_id(1)) * BLOCK_D + d, acc)


def gather_read(k, v, tables, lens, hpp: int, block_n: int, warps: int, stages: int):
    batch = tables.shape[0]
    out = torch.empty((batch, k.shape[2] // hpp, k.shape[3]), dtype=torch.float32, device=k.device)
    _gather_read_kernel[(batch, k.shape[2] // hpp)](k, v, tables, lens, out, k.stride(0), k.stride(1), k.stride(2),
                                                   tables.stride(0), HPP=hpp, BLOCK_D=k.shape[3], PAGE=k.shape[1],
                                                   BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    return out


READ_ONLY = ["h1 n32 w1 s5", "h1 n32 w1 s2", "h1 n32 w4 s3", "h4 n16 w1 s4", "h4 n32 w4 s3", "h8 n32 w4 s3",
             "h8 n64 w8 s3"]


def cases(batch: int, keys: int, layers: int = 4, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
          page: int = 16):
    blocks = -(-keys // page)
    num_blocks = batch * blocks + 1
    g = torch.Generator(device=DEVICE).manual_seed(batch)
    caches = []
    for _ in range(layers):
        k = torch.randn((num_blocks, page, kv_heads, head_dim), device=DEVICE, generator=g).to(torch.float8_e4m3fn)
        v = torch.randn((num_blocks, page, kv_heads, head_dim), device=DEVICE, generator=g).to(torch.float8_e4m3fn)
        caches.append((k, v))
    order = torch.randperm(num_blocks - 1, device=DEVICE, generator=g) + 1  # scattered, never the null block
    tables = torch.zeros((batch, 512 // page), dtype=torch.int32, device=DEVICE)
    tables[:, :blocks] = order[:batch * blocks].view(batch, blocks).to(torch.int32)
    lens = torch.full((batch,), keys, dtype=torch.int32, device=DEVICE)
    q = torch.randn((batch, heads, head_dim), device=DEVICE, generator=g).to(torch.bfloat16)
    return q, caches, tables, lens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[512, 1])
    parser.add_argument("--keys", type=int, default=192)
    parser.add_argument("--launches", nargs="+", default=DEFAULT_LAUNCHES)
    parser.add_argument("--read-only", nargs="*", default=READ_ONLY,
                        help="launches (hN nN wN sN) of a kernel that only reads the K/V as the decode kernel does, "
                             "at the largest batch: the access pattern's bandwidth bound")
    parser.add_argument("--budget", type=float, default=150.0, help="seconds; launches not reached are skipped")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = parser.parse_args()
    started = time.monotonic()
    launches = [text for text in args.launches if text == "" or parse_launch(text) is not None]
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (dry run)"
    print(f"{device}, torch {torch.__version__}; engine FP8 launch: h1 n{paged_decode.TILE_TOKENS}"
          f" w{paged_decode.FP8_NUM_WARPS} s{paged_decode.NUM_STAGES} sp{paged_decode.MIN_SPLIT_TOKENS}", flush=True)
    results: dict[str, dict[int, str | float]] = {text: {} for text in launches}
    read_rows: list[str] = []
    for batch in args.batches:
        q, caches, tables, lens = cases(batch, args.keys)
        kv_bytes = batch * args.keys * 8 * 128 * 2  # FP8: one byte an element, K and V
        rows = min(batch, 4)
        meta = AttentionMetadata(slot_mapping=torch.empty(0), query_start=list(range(rows)), query_lens=[1] * rows,
                                 seq_lens=lens[:rows].tolist(), block_tables=tables[:rows], seq_lens_tensor=lens[:rows])
        k0, v0 = caches[0]
        ref = paged_attention(q[:rows].float(), k0.float(), v0.float(), meta, 128 ** -0.5)
        limit = args.budget * (0.8 if batch == args.batches[0] else 1.0)  # time left for the later batches
        order = launches if batch == args.batches[0] else sorted(  # the default, then the fastest first
            launches, key=lambda t: (t != "", results[t].get(args.batches[0]) if isinstance(
                results[t].get(args.batches[0]), float) else float("inf")))
        for text in order:
            if time.monotonic() - started > limit:
                results[text][batch] = "skipped (budget)"
                continue
            launch = parse_launch(text)

            def call(k, v, q=q, tables=tables, lens=lens, launch=launch):
                return paged_decode.paged_decode_attention(q, k, v, tables, lens, 128 ** -0.5, None, 512, **launch)
            try:
                got = call(k0, v0)
                err = (got[:rows].float() - ref).abs().max().item()
                alone = call(k0, v0, q=q[rows - 1:rows], tables=tables[rows - 1:rows], lens=lens[rows - 1:rows])
                if not err < 3e-2:
                    results[text][batch] = f"OFF ({err:.2g})"
                    continue
                if not torch.equal(alone, got[rows - 1:rows]):
                    results[text][batch] = "OFF (batch-variant)"
                    continue
                results[text][batch] = time_us([lambda k=k, v=v: call(k, v) for k, v in caches])
            except Exception as failure:  # past this GPU's shared memory, or a compile error: named, not fatal
                results[text][batch] = f"fails: {type(failure).__name__}: {str(failure)[:60]}"
            cell = results[text][batch]
            shown = f"{cell:.1f} us ({kv_bytes / cell / 1e6:.2f} TB/s)" if isinstance(cell, float) else cell
            print(f"  b{batch} [{text or 'engine default'}]: {shown}", flush=True)
        if batch == max(args.batches) and args.read_only:  # the bound of the access pattern: reads, no math
            k0f, v0f = k0.float(), v0.float()
            for text in args.read_only:
                launch = parse_launch(text)
                try:
                    hpp, n, w, st = (launch.get(x, 1) for x in ("kv_heads_per_program", "block_n", "num_warps",
                                                                "num_stages"))
                    got = gather_read(k0, v0, tables, lens, hpp, n, w, st)
                    blocks = tables[0, :-(-args.keys // k0.shape[1])].long()
                    want = (k0f[blocks] + v0f[blocks]).flatten(0, 1)[:args.keys].sum(0)  # request 0: [Hkv, D]
                    want = want.view(-1, hpp, want.shape[-1]).sum(1)  # a program's heads summed
                    if not torch.allclose(got[0], want, atol=1e-2, rtol=1e-4):
                        raise AssertionError("read-only sums differ from torch's")
                    us = time_us([lambda k=k, v=v: gather_read(k, v, tables, lens, hpp, n, w, st) for k, v in caches])
                    shown = f"{us:.1f} us ({kv_bytes / us / 1e6:.2f} TB/s)"
                except Exception as failure:
                    shown = f"fails: {type(failure).__name__}: {str(failure)[:60]}"
                print(f"  b{batch} read-only bound [{text}]: {shown}", flush=True)
                read_rows.append(f"| {text} | {batch} | {shown} |")
        del caches, q
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    def total(text):
        """The pick's score: the time at the first batch (512: the throughput target); a launch wrong or failing at
        any batch is never picked (one skipped for the budget at a later batch still is)."""
        cells = [results[text].get(b) for b in args.batches]
        if not isinstance(cells[0], float) or any(isinstance(c, str) and not c.startswith("skipped") for c in cells):
            return float("inf")
        return cells[0]

    base = results[""]
    print(f"\n### FP8-KV decode attention alone, {args.keys} keys a row, us per layer (TB/s of FP8 KV); "
          "x: against the engine's launch")
    print("| launch (KILN_LLM_DECODE_FP8) | " + " | ".join(f"batch {b}" for b in args.batches) + " |")
    print("|---|" + "---|" * len(args.batches))
    for text in sorted(launches, key=total):
        cells = []
        for b in args.batches:
            c = results[text].get(b, "-")
            if isinstance(c, float):
                kv_bytes = b * args.keys * 8 * 128 * 2
                ratio = f", {base[b] / c:.2f}x" if isinstance(base.get(b), float) else ""
                c = f"{c:.1f} ({kv_bytes / c / 1e6:.2f}{ratio})"
            cells.append(str(c))
        print(f"| {text or '(engine default)'} | " + " | ".join(cells) + " |")
    if read_rows:
        print("\nreads only (the decode kernel's access pattern, no math): the bandwidth its loads can reach")
        print("| launch | batch | us (TB/s) |\n|---|---|---|")
        for row in read_rows:
            print(row)
    best = min(launches, key=total)
    if total(best) == float("inf"):
        best = ""
    print(f"\npicked: {best!r} ({'the engine default' if not best else 'KILN_LLM_DECODE_FP8'}); "
          f"batch {args.batches[0]}: {total(best):.1f} us against the default's {total(''):.1f}")
    Path(args.out, "llm7_best.txt").write_text(best)
    Path(args.out, "llm7_sweep.json").write_text(json.dumps({"best": best, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
