"""The FP8 BERT-base engine against the fp16 engine and torch, in one process (issue 12).

    python3 bench/fp8_bert.py [--batch 64 --seq 384] [--engines kiln_fp16,kiln_fp8,kiln_fp8_o3] [--rounds 5]
                              [--budget 150] [--timing-cache FILE] [--out DIR] [--dry-run]

BERT-base (kiln.zoo bert_base: HF BertModel, random weights) at batch x seq with a padding mask (make_inputs: every
row but the first ends in padding at a random length >= seq/2). Peers, built or loaded once in this process:

    torch_fp32    the reference (HF eager, fp32)
    torch_fp16    HF BertModel in fp16 (its default attention: SDPA)
    kiln_fp16     kiln.build(precision="fp16"), opt_level 2
    kiln_fp8      kiln.build(precision="fp8", calibration=2 batches of 8, calibrator="minmax"), opt_level 2:
                  E4M3 GEMMs, LayerNormQuantize, FFN up's Gelu before its E4M3 output, fp16 attention
    kiln_fp8_o3   the same at opt_level 3: the FP8 attention tactics (cuda.attention.triton_fp8*) are candidates

Accuracy against torch fp32 on the same inputs: the worst cosine of the token states over the real (unpadded)
tokens, and of the sentence embeddings (mean of the token states over the mask, what sentence-transformers pools).
Timing: interleaved rounds (each peer in turn, CUDA events around each call after a warm-up, the median of the
round), the median of the rounds' medians. An engine whose build would pass --budget seconds since the start is
skipped, and said so. Prints per engine the chosen tactics per op kind, then the table last.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEVICE, HALF, MODEL = "cuda", "fp16", "bert_base"
ENGINES = ("kiln_fp16", "kiln_fp8", "kiln_fp8_o3")


def _hidden(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.last_hidden_state


def accuracy(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor) -> dict:
    """Worst token-state cosine over real tokens, worst / mean sentence-embedding cosine, max error / max |want|."""
    got, want = got.double().reshape(want.shape), want.double()
    keep = mask.bool()
    tokens = torch.nn.functional.cosine_similarity(got[keep], want[keep], dim=-1)
    weights = mask.double().unsqueeze(-1)
    pooled = [(t * weights).sum(1) / weights.sum(1) for t in (got, want)]
    embeddings = torch.nn.functional.cosine_similarity(*pooled, dim=-1)
    error = float((got[keep] - want[keep]).abs().max() / want[keep].abs().max())
    return {"token_cos_min": float(tokens.min()), "emb_cos_min": float(embeddings.min()),
            "emb_cos_mean": float(embeddings.mean()), "max_err": error}


def tactic_summary(engine) -> str:
    """Chosen tactics per op kind: 'op: tactic xN, ...' (the tiles' suffixes dropped)."""
    counts: dict[str, int] = {}
    for step in engine.plan.program.steps:
        if step.op_type in ("QGemm", "Attention", "LayerNormQuantize", "FusedGemm", "Gemm", "MatMul", "LayerNorm",
                            "QuantizeLinear", "DequantizeLinear"):
            tactic = step.tactic or "(default)"
            if ".triton" in tactic:
                tactic = tactic.split(".w")[0]
            activation = step.attributes.get("activation", "")
            key = f"{step.op_type}{'/' + activation if activation else ''}: {tactic}"
            counts[key] = counts.get(key, 0) + 1
    return "; ".join(f"{k} x{n}" for k, n in sorted(counts.items()))


def tuner_times(engine, op_type: str, limit: int = 1) -> list[str]:
    """The autotuner's candidate times of the first `limit` layers of op_type (ms, fastest first)."""
    layers = engine.plan.header.get("tactics", {}).get("layers", {})
    out = []
    for step in engine.plan.program.steps:
        if step.op_type == op_type and step.name in layers and len(out) < limit:
            cands = layers[step.name]["candidates"]
            timed = sorted((v, k) for k, v in cands.items() if not isinstance(v, str))
            notes = [f"{k}: {v[:70]}" for k, v in cands.items() if isinstance(v, str)][:3]
            activation = step.attributes.get("activation", "")
            out.append(f"{op_type}{'/' + activation if activation else ''} {step.name[-24:]}: chosen "
                       f"{layers[step.name]['tactic']}; " + ", ".join(f"{k.removeprefix('cuda.')} {v:.4f}"
                                                                     for v, k in timed[:6])
                       + (f"; dropped: {' | '.join(notes)}" if notes else ""))
    return out


def time_rounds(peers: dict, rounds: int, iters: int) -> dict[str, float]:
    """Interleaved: each round times every peer in turn (median of `iters` calls after a warm-up)."""
    from gpu import time_cuda  # bench/gpu.py: CUDA events around each call after a warm-up

    medians: dict[str, list[float]] = {name: [] for name in peers}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, fn in peers.items():
                if DEVICE == "cuda":
                    medians[name].append(statistics.median(time_cuda(fn, warmup=3, iters=iters)))
                else:
                    fn()
                    start = time.perf_counter()
                    fn()
                    medians[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(v) for name, v in medians.items()}


def table(rows: dict, peers: dict, args, device: str, commit: str, start: float) -> None:
    """Times every peer built so far (interleaved rounds) and prints the table (and writes it under --out)."""
    t = time.perf_counter()
    ms = time_rounds(peers, args.rounds, args.iters)
    print(f"timing {time.perf_counter() - t:.1f} s ({args.rounds} interleaved rounds x {args.iters} calls)")
    lines = [f"{MODEL} {args.batch} x {args.seq} with a padding mask, {device}, commit {commit}: ms per batch "
             f"(median of {args.rounds} interleaved rounds' medians), accuracy vs torch fp32", "",
             "| peer | ms / batch | vs kiln fp16 | vs torch fp16 | token cos min | embedding cos min / mean | "
             "max err / max | build s |", "|---|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"| {name} | {row['error']} ||||||| ")
            continue
        m = ms.get(name)
        ratio = lambda base: f"{ms[base] / m:.2f}x" if m and ms.get(base) else "—"  # noqa: E731
        lines.append(f"| {name} | {f'{m:.3f}' if m else '—'} | {ratio('kiln_fp16')} | {ratio('torch_fp16')} | "
                     f"{row['token_cos_min']:.4f} | {row['emb_cos_min']:.5f} / {row['emb_cos_mean']:.5f} | "
                     f"{row['max_err']:.3g} | {row['build_s']:.0f} |")
    print("\n".join(lines))
    print(f"total {time.perf_counter() - start:.0f} s")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "fp8_bert.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    global DEVICE, HALF, MODEL
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=384)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--budget", type=float, default=150.0, help="seconds: later builds are skipped past it")
    ap.add_argument("--timing-cache", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--dry-run", action="store_true", help="CPU, bert_tiny, Triton interpreted: checks the script")
    args = ap.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        DEVICE, HALF, MODEL = "cpu", "fp32", "bert_tiny"
    start = time.perf_counter()

    import kiln
    from kiln import zoo
    from kiln.zoo.models import make_inputs

    commit = os.environ.get("KILN_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    print(f"# fp8_bert: {MODEL} {args.batch} x {args.seq}, {device}, torch {torch.__version__}, commit {commit}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    feeds = make_inputs(zoo.get(MODEL), batch=args.batch, seq=args.seq, seed=0)
    dev = {k: torch.from_numpy(v).to(DEVICE) for k, v in feeds.items()}
    mask = dev["attention_mask"]
    print(f"real tokens {int(mask.sum())} of {mask.numel()} ({float(mask.float().mean()):.1%})")
    module = zoo.torch_model(MODEL).to(DEVICE).eval()
    with torch.inference_mode():
        want = _hidden(module(**dev)).float()
    rows: dict[str, dict] = {"torch_fp32": {"build_s": 0.0, **accuracy(want, want, mask)}}
    peers = {}
    if DEVICE == "cuda":
        m16 = module.half()
        with torch.inference_mode():
            rows["torch_fp16"] = {"build_s": 0.0, **accuracy(_hidden(m16(**dev)).float(), want, mask)}
        peers["torch_fp16"] = lambda: m16(**dev)

    t = time.perf_counter()
    exported = zoo.export(MODEL, batch=2, seq=args.seq, dynamic=True)  # calibration runs at batch 8
    print(f"export {time.perf_counter() - t:.1f} s")
    shapes = {k: list(v.shape) for k, v in feeds.items()}
    common = {"device": DEVICE, "shapes": shapes, "profiles": [{k: [s, s, s] for k, s in shapes.items()}]}
    if args.timing_cache:
        common["timing_cache"] = args.timing_cache
    calibration = [make_inputs(zoo.get(MODEL), batch=8, seq=args.seq, seed=s) for s in (1, 2)]
    engines = {}
    for name in args.engines.split(","):
        elapsed = time.perf_counter() - start
        if elapsed > args.budget:
            rows[name] = {"error": f"skipped: {elapsed:.0f} s of the {args.budget:.0f} s budget spent"}
            print(f"{name}: {rows[name]['error']}")
            continue
        t = time.perf_counter()
        try:
            if name == "kiln_fp16":
                engine = kiln.build(exported.path, precision=HALF, opt_level=2, **common)
            elif name in ("kiln_fp8", "kiln_fp8_o3"):
                engine = kiln.build(exported.path, precision="fp8", calibration=calibration, calibrator="minmax",
                                    opt_level=3 if name.endswith("o3") else 2, **common)
            else:
                raise ValueError(f"unknown engine {name!r}: one of {', '.join(ENGINES)}")
            build_s = time.perf_counter() - t
            ctx = engine.create_execution_context()
            with torch.inference_mode():
                got = next(iter(ctx.run(dev).values()))
            rows[name] = {"build_s": build_s, **accuracy(got.float(), want, mask)}
            engines[name] = engine
            peers[name] = (lambda c: lambda: c.run(dev))(ctx)
            print(f"{name}: built in {build_s:.1f} s; {rows[name]}")
            print(f"  tactics: {tactic_summary(engine)}"[:1500])
            for line in tuner_times(engine, "QGemm", 4) + tuner_times(engine, "Attention", 1) + \
                    tuner_times(engine, "FusedGemm", 2):
                print(f"  tuner {line}"[:600])
            if name == "kiln_fp8" and name != args.engines.split(",")[-1]:  # the numbers that matter, before o3
                table(rows, peers, args, device, commit, start)
        except Exception as e:  # noqa: BLE001  a failing engine is a row
            rows[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(f"{name}: FAILED {rows[name]['error']}")
            traceback.print_exc(limit=4)

    table(rows, peers, args, device, commit, start)


if __name__ == "__main__":
    main()
