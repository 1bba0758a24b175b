"""The decode layer's fused GEMVs (kiln/llm/decode_fusion.py) on the GPU, in one run: each fused kernel checked
against torch on the real shapes, timed against the unfused kernels it replaces, and the end-to-end decode with
the fusions off, auto (engine start's choice) and on.

    python bench/llm_fusion.py [--preset llama3-8b] [--rows 1 8] [--batch 1 8] [--modes off auto on]

1. Kernels, Llama-3-8B's shapes in bf16, `--copies` weights of each shape rotated through (reads from HBM, not
   L2, as in a decode step). Per projection and rows: every engine candidate config checked against torch fp32
   (max relative error), the fastest fused one, against the unfused pair it replaces, whose product is the
   faster of cuBLAS and the plain GEMV's best config:
     qkv      rmsnorm folded in       vs qkv                   (its norm is the previous add + norm)
     qkv_rope norm, RoPE + cache write vs qkv, rope_kv_write    (checked on q against torch's rotate-half)
     o        + residual              vs o, add + norm
     gate_up  norm folded, + SwiGLU   vs gate_up, silu·up
     down     + residual              vs down, add + norm
   The sums of qkv (or qkv_rope), o, gate_up and down are one layer's projections both ways.
2. End to end (random weights, load_format="dummy", CUDA graphs): per mode the engine's fusion decisions,
   then per batch size the decode step's graph replay (ms, CUDA events), decode tok/s (wall clock) and the
   fraction of the bytes-read roofline (--bandwidth TB/s).
Each case runs in its own try: one that fails prints its error and the rest go on.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from llm import PRESETS, write_checkpoint  # noqa: E402  bench/llm.py

from kiln.llm import LLM, SamplingParams  # noqa: E402
from kiln.llm.decode_fusion import WHOLE_K, engine_candidates  # noqa: E402
from kiln.llm.decode_gemv import graph_time  # noqa: E402
from kiln.llm.kernels.fused import add_rms_norm, rope_kv_write, silu_mul  # noqa: E402
from kiln.llm.kernels.gemv import RopeKV, gemv  # noqa: E402
from kiln.llm.quantization import weight_bytes  # noqa: E402

EPS = 1e-5


def shapes(preset: str) -> dict[str, tuple[int, int]]:
    """role -> weight [N, K] of a Llama preset."""
    p = PRESETS[preset]
    hidden, inter = p["hidden_size"], p["intermediate_size"]
    head = hidden // p["num_attention_heads"]
    qkv = (p["num_attention_heads"] + 2 * p["num_key_value_heads"]) * head
    return {"qkv": (qkv, hidden), "qkv_rope": (qkv, hidden), "o": (hidden, p["num_attention_heads"] * head),
            "gate_up": (2 * inter, hidden),
            "down": (hidden, inter)}


def rope_target(preset: str, rows: int, device: str) -> RopeKV:
    """RoPE tables (theta 500000) and a one-block cache of `rows` slots for the preset's heads."""
    p = PRESETS[preset]
    dim = p["hidden_size"] // p["num_attention_heads"]
    freqs = torch.arange(4096.0)[:, None] * (1.0 / 500000 ** (torch.arange(0, dim, 2) / dim))[None, :]
    cache = (1, rows, p["num_key_value_heads"], dim)
    k_cache, v_cache = (torch.zeros(cache, device=device, dtype=torch.bfloat16) for _ in range(2))
    return RopeKV(torch.arange(rows, device=device) * 131 + 7, torch.arange(rows, device=device),
                  freqs.cos().to(device), freqs.sin().to(device), k_cache, v_cache, p["num_attention_heads"],
                  p["num_key_value_heads"], dim)


def reference(role: str, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, residual: torch.Tensor,
              rope: RopeKV) -> torch.Tensor:
    """The fused kernel's maths in fp32 torch (qkv_rope: the rotated q)."""
    x = x.float()
    if role in WHOLE_K:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * g.float()
    y = x @ w.float().T
    if role == "gate_up":
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
    if role == "qkv_rope":
        q = y[:, :rope.num_heads * rope.head_dim].view(y.shape[0], rope.num_heads, rope.head_dim)
        cos, sin = rope.cos[rope.positions][:, None, :], rope.sin[rope.positions][:, None, :]
        first, second = q.chunk(2, dim=-1)
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1).view(y.shape[0], -1)
    return y if role == "qkv" else residual.float() + y


def fused(role: str, x, w, g, residual, rope, config):
    if role in WHOLE_K:
        return gemv(x, w, None, None, config, norm=g, eps=EPS, swiglu=role == "gate_up",
                    rope=rope if role == "qkv_rope" else None)
    return gemv(x, w, None, None, config, residual=residual)


def unfused(role: str, x, w, g, residual, rope, product):
    """The kernels the fused one replaces; product(x, w) is cuBLAS or a plain GEMV config."""
    y = product(x, w)
    if role == "gate_up":
        return silu_mul(y)
    if role in ("o", "down"):
        return add_rms_norm(residual, y, g, EPS)
    if role == "qkv_rope":
        r = rope
        return rope_kv_write(y, r.positions, r.slot_mapping, r.cos, r.sin, r.k_cache, r.v_cache, r.num_heads,
                             r.num_kv_heads, r.head_dim)
    return y


def kernel_table(args) -> None:
    print(f"\n## Fused kernels vs the unfused pairs ({args.preset} shapes, bf16, {args.copies} weight copies)\n")
    print("| projection | rows | candidates ok | max rel err | fused best | fused us | unfused (cuBLAS) us | "
          "unfused (GEMV best) us | fused / best unfused |")
    print("|---|---|---|---|---|---|---|---|---|")
    totals: dict[int, list[float]] = {}
    for role, (n, k) in shapes(args.preset).items():
        weights = [torch.randn((n, k), device=args.device, dtype=torch.bfloat16) * 0.02 for _ in range(args.copies)]
        for rows in args.rows:
            try:
                x = torch.randn((rows, k), device=args.device, dtype=torch.bfloat16)
                width = n // 2 if role == "gate_up" else n
                g = (1 + 0.1 * torch.randn(k, device=args.device)).to(torch.bfloat16)
                residual = torch.randn((rows, width), device=args.device, dtype=torch.bfloat16)
                g_out = (1 + 0.1 * torch.randn(width, device=args.device)).to(torch.bfloat16)
                rope = rope_target(args.preset, rows, args.device)
                ref = reference(role, x, weights[0], g, residual, rope)
                ok, worst, times = 0, 0.0, {}
                candidates = [c for c in engine_candidates(role, 2) if role not in WHOLE_K or c.split_k == 1]
                for config in candidates:
                    try:
                        got = fused(role, x, weights[0], g, residual, rope, config).float()
                        err = ((got - ref).abs().max() / ref.abs().max()).item()
                        again = fused(role, x, weights[0], g, residual, rope, config)
                        if err > 2e-2 or not torch.equal(again.float(), got):
                            print(f"  {role} rows {rows} {config.name}: OFF (rel err {err:.3g}, deterministic "
                                  f"{torch.equal(again.float(), got)})")
                            continue
                        ok += 1
                        worst = max(worst, err)
                        times[config.name] = graph_time([lambda w=w, c=config: fused(role, x, w, g, residual, rope, c)
                                                         for w in weights])
                    except Exception as failure:  # one config that does not run: the others go on
                        print(f"  {role} rows {rows} {config.name}: {type(failure).__name__}: {str(failure)[:200]}")
                cublas = graph_time([lambda w=w: unfused(role, x, w, g_out, residual, rope, F.linear)
                                     for w in weights])
                plain = {c.name: graph_time([lambda w=w, c=c: unfused(role, x, w, g_out, residual, rope,
                                                                      lambda a, b: gemv(a, b, config=c))
                                             for w in weights]) for c in engine_candidates(role, 2)}
                best_plain = min(plain.values())
                best = min(times, key=times.get) if times else None
                fused_us = times[best] if best else float("nan")
                for with_rope in (False, True):  # the layer with qkv, or with qkv_rope
                    if role != ("qkv" if with_rope else "qkv_rope"):
                        total = totals.setdefault((rows, with_rope), [0.0, 0.0])
                        total[0] += fused_us
                        total[1] += min(cublas, best_plain)
                print(f"| {role} {n}x{k} | {rows} | {ok}/{len(candidates)} | {worst:.2e} | {best} | {fused_us:.1f} | "
                      f"{cublas:.1f} | {best_plain:.1f} | {fused_us / min(cublas, best_plain):.3f} |")
            except Exception:
                print(f"| {role} | {rows} | FAILED | {traceback.format_exc(limit=2)[-300:]!r} |")
        del weights
        if args.device == "cuda":
            torch.cuda.empty_cache()
    for (rows, with_rope), (f, u) in totals.items():
        what = "with RoPE + cache write" if with_rope else "qkv, o, gate_up, down"
        print(f"| layer sum ({what}; unfused: each pair's best) | {rows} | | | | {f:.1f} | {u:.1f} | {u:.1f} | "
              f"{f / u:.3f} |")


def end_to_end(args) -> None:
    print(f"\n## End to end: {args.preset} bf16, input {args.input_len}, output {args.output_len}\n")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_checkpoint(args.preset, torch.bfloat16, folder, weights=False)
        for mode in args.modes:
            try:
                started = time.perf_counter()
                llm = LLM(folder, dtype="bfloat16", kv_cache_memory="4GiB", max_num_seqs=max(args.batch),
                          device="cuda", cuda_graphs=True, load_format="dummy", decode_fusion=mode)
                print(f"decode_fusion={mode}: engine start {time.perf_counter() - started:.0f} s")
                for decision in llm.engine.fusion_decisions:
                    print(f"  {decision.describe()}")
                model = llm.engine.model
                embedding = model.embed_tokens.weight
                read = weight_bytes(model) - embedding.numel() * embedding.element_size()
                floor_ms = read / (args.bandwidth * 1e12) * 1e3
                vocab = llm.engine.model_config.vocab_size
                generator = torch.Generator().manual_seed(0)
                params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True, detokenize=False)
                for batch in args.batch:
                    prompts = [torch.randint(3, vocab, (args.input_len,), generator=generator).tolist()
                               for _ in range(batch)]
                    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                         detokenize=False))
                    torch.cuda.synchronize()
                    first = None
                    for _ in llm.stream(prompts, params):
                        if first is None:
                            torch.cuda.synchronize()
                            first = time.perf_counter()
                    torch.cuda.synchronize()
                    tok_s = batch * (args.output_len - 1) / (time.perf_counter() - first)
                    step_ms = llm.engine.runner.graphs.time_replay(batch, repeats=50)
                    rows.append((mode, batch, step_ms, tok_s, floor_ms / step_ms))
                del llm, model
                torch.cuda.empty_cache()
            except Exception:
                print(f"decode_fusion={mode}: FAILED\n{traceback.format_exc(limit=4)}")
    print("\n| decode_fusion | batch | step ms (graph replay) | decode tok/s (wall) | roofline (bytes read) |")
    print("|---|---|---|---|---|")
    for mode, batch, step_ms, tok_s, roofline in rows:
        print(f"| {mode} | {batch} | {step_ms:.3f} | {tok_s:.1f} | {roofline:.1%} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--modes", nargs="+", default=["off", "auto", "on"])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--bandwidth", type=float, default=4.3, help="HBM TB/s")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the kernel table (TRITON_INTERPRET=1)")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--skip-e2e", action="store_true")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name() if args.device == 'cuda' else args.device}, torch {torch.__version__}")
    if not args.skip_kernels:
        kernel_table(args)
    if not args.skip_e2e:
        end_to_end(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
