"""Batch-1 decode GEMV variants at Llama-3-8B's bf16 shapes (issue 15: the large GEMVs at >= 90% of the H200's
bandwidth), then the decode step with the engine choosing among the winners. One device call, < 240 s.

    python3 bench/gemv_sweep.py [--rows 1 2 4 8] [--budget 100] [--skip-e2e] [--tiny]

1. The ceiling: a plain copy (read + write) and a read-only reduction over 2 GiB, in the same CUDA-graph timer.
2. Per projection (q|k|v 4096x6144, o 4096x4096, gate|up 4096x28672, down 14336x4096, LM head 4096x128256) and
   rows M: every variant of sweep_configs() checked against torch.matmul in fp32 (kiln.llm.decode_gemv.gemv_error:
   bf16 output rounding) before and after its timing, timed as bench/gemv.py times (one CUDA graph of 24 calls
   rotating weight copies > 3x the L2, median of 7 replays); GB/s and % of the copy ceiling. The knobs the
   variants add to today's tiles (kiln/llm/kernels/gemv.py GemvConfig): pf (W one tile ahead in registers),
   cg / evict_first (the weight stream's cache hint), pdl (programmatic dependent launch: the next GEMV's first
   W tile is read while this one drains), pN (a persistent grid of N programs per SM). Every variant at M = 1;
   at M > 1 the multi-row ones and M = 1's best.
3. End to end (bench/llm_fusion.py's measurement: decode graph replay ms, bytes-read roofline at 4.3 TB/s):
   the engine's shortlist (decode_gemv.ENGINE_CONFIGS, which decode_fusion's tuner also reads) replaced by the
   sweep's, the fused forms compiled in parallel first, decode_fusion=auto (the engine times and picks at
   start); then, time allowing, the same with today's shortlist (A/B in one run).

Writes $OUT/gemv_sweep.md (the tables), gemv_sweep.json (every timing) and gemv.log. `--tiny`: the CPU under
Triton's interpreter at tiny shapes (checks the script; times nothing real; no end to end).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemv as bench_gemv  # noqa: E402  bench/gemv.py: Problem, measure, precompile, shortlist (sets up --tiny)

from kiln.llm import decode_gemv  # noqa: E402
from kiln.llm.decode_gemv import graph_time  # noqa: E402
from kiln.llm.kernels.gemv import GemvConfig, gemv  # noqa: E402

SHAPES = {"llama3-8b": [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096),
                        ("lm_head", 4096, 128256)],
          "tiny": [("a", 96, 48), ("b", 256, 64)]}
# (pf, w_cache, pdl) tried on every fma tile at M = 1: today's, each knob alone, and together
FMA_KNOBS = [(False, "", False), (True, "", False), (False, "", True), (True, "", True), (True, "evict_first", True),
             (True, "cg", True), (True, "evict_first", False)]
FMA_TILES = [(2, 1024, 4), (4, 1024, 4), (4, 512, 4), (8, 512, 4), (1, 2048, 4), (2, 2048, 8), (4, 2048, 8),
             (8, 1024, 8), (8, 2048, 16), (16, 1024, 16)]
DOT_TILES = [("dot_swap", 64, 256, 1, 4, 4), ("dot_swap", 128, 128, 1, 8, 3), ("dot_swap", 64, 128, 1, 4, 3),
             ("dot_swap", 64, 256, 2, 4, 4), ("dot_swap", 64, 128, 2, 4, 4), ("dot", 64, 256, 1, 4, 3),
             ("dot", 64, 256, 4, 4, 3)]
ROWS_TILES = [(4, 512, 4), (2, 1024, 4), (4, 1024, 8)]
TOP_FMA = 10  # fma configs carried from M = 1 to the other rows


def sweep_configs(n: int, k: int, m: int, tiny: bool = False) -> list[GemvConfig]:
    """The variants timed at [n, k] for m rows (GemvConfig's knobs on today's best tiles; split-K for the long
    K of down)."""
    if tiny:
        return [GemvConfig("fma", 8, 32, 1, 4, 1, prefetch=pf, w_cache=c, pdl=p) for pf, c, p in FMA_KNOBS[:5]] + [
            GemvConfig("fma_rows", 4, 32, 2, 4, 1, "last", rows=2, prefetch=True, pdl=True),
            GemvConfig("dot_swap", 16, 32, 1, 4, 1, pdl=True)]
    configs = []
    if m == 1:
        for block_n, block_k, warps in FMA_TILES:
            for pf, cache, pdl in FMA_KNOBS:
                configs.append(GemvConfig("fma", block_n, block_k, 1, warps, 1, prefetch=pf, w_cache=cache, pdl=pdl))
        for block_n, block_k, warps in ((2, 1024, 4), (4, 1024, 4), (8, 1024, 8)):  # persistent grids
            for per_sm in (8, 16):
                configs.append(GemvConfig("fma", block_n, block_k, 1, warps, 1, prefetch=True, pdl=True,
                                          persistent=per_sm))
        if k >= 8192:  # down: 14336 deep, 1024-2048 programs: split-K evens out the last wave
            for block_n, block_k, warps in ((4, 1024, 4), (8, 1024, 8), (8, 512, 4)):
                for split in (2, 4):
                    configs.append(GemvConfig("fma", block_n, block_k, split, warps, 1, "last", prefetch=True,
                                              pdl=True))
    else:
        for rows in (2, 4, 8):
            if rows > 2 * m:
                continue
            for block_n, block_k, warps in ROWS_TILES:
                for pf, pdl in ((False, False), (True, True)):
                    configs.append(GemvConfig("fma_rows", block_n, block_k, 1, warps if rows < 8 else 8, 1,
                                              rows=rows, prefetch=pf, pdl=pdl))
    for variant, block_n, block_k, split, warps, stages in DOT_TILES:
        for pdl in (False, True):
            configs.append(GemvConfig(variant, block_n, block_k, split, warps, stages,
                                      "last" if split > 1 else "kernel", pdl=pdl))
    for variant, block_n, block_k, split, warps, stages in DOT_TILES[:2]:  # one or two resident per SM
        configs.append(GemvConfig(variant, block_n, block_k, split, warps, stages, pdl=True, persistent=1))
    return configs


def ceilings(log) -> dict[str, float]:
    """TB/s of a 2 GiB copy (bytes read + written) and of a read-only sum: what a streaming kernel can reach
    (bench/gemv.py's timer; on the CPU 4 MiB, which checks the code and measures nothing)."""
    device = bench_gemv.DEVICE
    src = torch.randn(2**30 if device == "cuda" else 2**21, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    out = torch.empty((), device=device, dtype=torch.float32)
    nbytes = src.numel() * src.element_size()
    copy_us = bench_gemv.time_calls([lambda: dst.copy_(src)])
    read_us = bench_gemv.time_calls([lambda: torch.sum(src, dim=0, dtype=torch.float32, out=out)])
    found = {"copy": 2 * nbytes / (copy_us * 1e-6) / 1e12, "read": nbytes / (read_us * 1e-6) / 1e12}
    log(f"ceiling: copy {found['copy']:.3f} TB/s ({copy_us:.0f} us for 2 x {nbytes / 2**30:.3g} GiB), read-only sum "
        f"{found['read']:.3f} TB/s ({read_us:.0f} us)")
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()
    return found


def sweep(args, log, failures: list) -> list[dict]:
    shapes = SHAPES["tiny" if args.tiny else "llama3-8b"]
    started = time.perf_counter()
    rows = []
    for index, (name, k, n) in enumerate(shapes):
        problem = bench_gemv.Problem(name, k, n, "bf16", seed=index)
        fma_ranked: list[str] = []
        for m in args.rows:
            todo = sweep_configs(n, k, m, args.tiny)
            if m > 1:  # M = 1's best fma configs (W re-read per row, from L2) against the multi-row variants
                every = {c.name: c for c in sweep_configs(n, k, 1, args.tiny)}
                todo += [every[c] for c in fma_ranked[:TOP_FMA] if c in every]
            todo = list({c.name: c for c in todo}.values())
            if time.perf_counter() - started > args.budget:  # over budget: the first rows' best and the dots only
                todo = [c for c in todo if not c.variant.startswith("fma")] + [
                    c for c in todo if c.name in fma_ranked[:2]]
            row = bench_gemv.measure(problem, m, todo, log, failures)
            row["bytes"] = problem.bytes
            rows.append(row)
            if m == 1:
                fma_ranked = sorted((c for c in row["configs"] if c.startswith("fma")), key=row["configs"].get)
        del problem
        if bench_gemv.DEVICE == "cuda":
            torch.cuda.empty_cache()
    return rows


def plain(name: str) -> bool:
    """A config without the new knobs (what the engine could pick before)."""
    return not any(flag in ("pf", "cg", "evict_first", "pdl") or flag[0] == "p" and flag[1:].isdigit()
                   for flag in name.split())


def table(rows: list[dict], ceiling: dict[str, float]) -> list[str]:
    lines = ["| shape | K x N | M | best variant | us | GB/s | % copy | % read | best without new knobs | us | "
             "cuBLAS us | vs cuBLAS |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["best"]:
            lines.append(f"| {r['shape']} | {r['k']}x{r['n']} | {r['m']} | (none passed) |" + " |" * 8)
            continue
        us = r["configs"][r["best"]]
        gb_s = (r["bytes"] + r["m"] * (r["k"] + r["n"]) * 2) / (us * 1e-6) / 1e9
        old = {c: t for c, t in r["configs"].items() if plain(c)}
        old_best = min(old, key=old.get, default=None)
        cublas = r["peers"].get("cuBLAS bf16")
        lines.append(f"| {r['shape']} | {r['k']}x{r['n']} | {r['m']} | {r['best']} | {us:.2f} | {gb_s:.0f} | "
                     f"{gb_s / 1e3 / ceiling['copy']:.1%} | {gb_s / 1e3 / ceiling['read']:.1%} | {old_best or ''} | "
                     f"{'' if old_best is None else f'{old[old_best]:.2f}'} | "
                     f"{'' if cublas is None else f'{cublas:.2f}'} | "
                     f"{'' if cublas is None else f'{cublas / us:.2f}x'} |")
    return lines


def knob_table(rows: list[dict]) -> list[str]:
    """M = 1, fma: each knob set's time relative to the same tile's plain config (geometric mean over tiles)."""
    import math

    lines = ["| shape | " + " | ".join(knobs_name(k) for k in FMA_KNOBS[1:]) + " |",
             "|---|" + "---|" * (len(FMA_KNOBS) - 1)]
    for r in rows:
        if r["m"] != 1:
            continue
        cells = []
        for knobs in FMA_KNOBS[1:]:
            ratios = []
            for block_n, block_k, warps in FMA_TILES:
                base = GemvConfig("fma", block_n, block_k, 1, warps, 1).name
                mine = GemvConfig("fma", block_n, block_k, 1, warps, 1, prefetch=knobs[0], w_cache=knobs[1],
                                  pdl=knobs[2]).name
                if r["configs"].get(base) and r["configs"].get(mine):
                    ratios.append(math.log(r["configs"][mine] / r["configs"][base]))
            cells.append(f"{math.exp(sum(ratios) / len(ratios)):.3f}" if ratios else "")
        lines.append(f"| {r['shape']} | " + " | ".join(cells) + " |")
    return lines


def knobs_name(knobs) -> str:
    pf, cache, pdl = knobs
    return "+".join(name for name, on in (("pf", pf), (cache, cache), ("pdl", pdl)) if on)


def compile_fused(configs: list[GemvConfig], workers: int, log) -> None:
    """Each shortlisted config's fused forms (norm, norm+rope, norm+swiglu, residual) compiled in parallel before
    the engine starts (its tuner would compile them one by one). workers 0: in this process at tiny sizes."""
    import multiprocessing

    jobs = [c.to_dict() for c in configs]
    started = time.perf_counter()
    if workers == 0:
        errors = _compile_fused_worker(jobs, tiny=True)
    else:
        with multiprocessing.get_context("spawn").Pool(max(1, min(workers, len(jobs)))) as pool:
            errors = [e for part in pool.map(_compile_fused_worker, [jobs[i::workers] for i in range(workers)])
                      for e in part]
    log(f"compiled the fused forms of {len(jobs)} configs in {time.perf_counter() - started:.1f} s; "
        f"{len(errors)} failed: {errors[:4]}")


def _compile_fused_worker(jobs: list[dict], tiny: bool = False) -> list[str]:
    """Runs each config's fused forms once at Llama-3-8B's sizes (Triton's on-disk cache keeps the binaries)."""
    from kiln.llm.kernels.gemv import RopeKV

    errors = []
    device = bench_gemv.DEVICE if tiny else "cuda"
    hidden, inter, heads, kv_heads, dim = (64, 96, 4, 2, 16) if tiny else (4096, 14336, 32, 8, 128)
    x = torch.zeros((1, hidden), device=device, dtype=torch.bfloat16)
    g = torch.ones(hidden, device=device, dtype=torch.bfloat16)
    for job in jobs:
        config = GemvConfig(**job)
        try:
            if config.split_k == 1:
                qkv = torch.zeros(((heads + 2 * kv_heads) * dim, hidden), device=device, dtype=torch.bfloat16)
                gemv(x, qkv, None, None, config, norm=g, eps=1e-5)
                cache = torch.zeros((1, 1, kv_heads, dim), device=device, dtype=torch.bfloat16)
                table = torch.zeros((8, dim // 2), device=device)
                pos = torch.zeros(1, device=device, dtype=torch.int64)
                gemv(x, qkv, None, None, config, norm=g, eps=1e-5,
                     rope=RopeKV(pos, pos, table, table, cache, cache.clone(), heads, kv_heads, dim))
                gemv(x, torch.zeros((2 * inter, hidden), device=device, dtype=torch.bfloat16), None, None, config,
                     norm=g, eps=1e-5, swiglu=True)
            gemv(x, torch.zeros((hidden, hidden), device=device, dtype=torch.bfloat16), None, None, config,
                 residual=x)
            if device == "cuda":
                torch.cuda.synchronize()
        except Exception as error:
            errors.append(f"{config.name}: {type(error).__name__}: {str(error)[:160]}")
    return errors


def end_to_end(configs: list[GemvConfig] | None, label: str, log) -> None:
    """bench/llm_fusion.py's end to end at batch 1, decode_fusion=auto, with ENGINE_CONFIGS[2] = configs."""
    import llm_fusion

    saved = list(decode_gemv.ENGINE_CONFIGS[2])
    if configs is not None:
        decode_gemv.ENGINE_CONFIGS[2] = list(configs)  # the same dict decode_fusion's engine_candidates reads
    try:
        log(f"\n### end to end, shortlist: {label} ({len(decode_gemv.ENGINE_CONFIGS[2])} configs)")
        args = argparse.Namespace(preset="llama3-8b", input_len=128, output_len=128, modes=["auto"], batch=[1],
                                  bandwidth=4.3)
        llm_fusion.end_to_end(args)
    except Exception:
        log(f"end to end ({label}) FAILED\n{traceback.format_exc(limit=4)}")
    finally:
        decode_gemv.ENGINE_CONFIGS[2] = saved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--budget", type=float, default=100.0, help="seconds of kernel timing before rows are cut")
    parser.add_argument("--workers", type=int, default=14)
    parser.add_argument("--e2e-deadline", type=float, default=170.0,
                        help="start today's-shortlist end to end only if this many seconds have not passed")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.tiny:
        args.rows, args.workers, args.skip_e2e = [1, 3], 0, True
    elif not torch.cuda.is_available():
        raise SystemExit("bench/gemv_sweep.py times CUDA kernels: no CUDA device here (--tiny runs the CPU check)")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    log = bench_gemv.Log(out)
    import triton

    device = torch.cuda.get_device_name() if not args.tiny else "cpu (Triton interpreter)"
    header = (f"bench/gemv_sweep.py on {device}: torch {torch.__version__}, triton {triton.__version__}, "
              f"commit {bench_gemv.commit()}")
    log(header)
    ceiling = ceilings(log)
    shapes = SHAPES["tiny" if args.tiny else "llama3-8b"]
    every = {c.name: c for _, k, n in shapes for m in args.rows for c in sweep_configs(n, k, m, args.tiny)}
    if args.workers > 0:
        k, n = shapes[0][1], shapes[0][2]  # every shape is specialized alike (N, K multiples of 16; EVEN)
        bench_gemv.precompile([("bf16", k, n, name, c.to_dict()) for name, c in every.items()], args.workers, log)
    failures: list[str] = []
    rows = sweep(args, log, failures)
    engine = bench_gemv.shortlist(rows, every)["2"]
    lines = [header, "", f"x, W, y bf16; GB/s = (W + x + y bytes) / time; ceiling: copy {ceiling['copy']:.3f} TB/s, "
             f"read-only sum {ceiling['read']:.3f} TB/s; kernel timing {time.perf_counter() - started:.0f} s in", ""]
    lines += table(rows, ceiling) + ["", "M = 1, fma: time with the knobs / the same tile without (geometric mean "
                                     "over the tiles; < 1 is faster)", ""] + knob_table(rows)
    lines += ["", f"{len(failures)} configs failed a check or did not run:"] + [f"- {f}" for f in failures[:40]]
    lines += ["", "sweep shortlist (ENGINE_CONFIGS[2] candidates):"] + [f"    {c!r}," for c in engine]
    log("\n".join(lines))
    if out:
        (out / "gemv_sweep.md").write_text("\n".join(lines) + "\n")
        (out / "gemv_sweep.json").write_text(json.dumps({"header": header, "ceiling": ceiling, "rows": rows,
                                                         "failures": failures,
                                                         "shortlist": [c.to_dict() for c in engine]}, indent=1))
    if args.tiny:  # the CPU check of what runs before the end to end
        compile_fused(engine, 0, log)
    if not args.skip_e2e:
        compile_fused(engine, args.workers, log)
        end_to_end(engine, "the sweep's", log)
        if time.perf_counter() - started < args.e2e_deadline:
            end_to_end(None, "today's (main)", log)
        else:
            log(f"today's-shortlist end to end skipped: {time.perf_counter() - started:.0f} s in")
    log(f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
