"""Offline throughput, 128-token prompts and 128-token outputs, at large batches: kiln.llm trees side by side.

    python bench/llm_throughput.py --trees .cache/llmtp-base . --batch 64 128 256 --configs bf16 fp8 fp8-kv8

Issue 15's throughput target: 128 prompt + 128 output tokens with FP8 on one H200 (TensorRT-LLM's record:
27,911 output tok/s). A Llama-3-8B-shaped model with random weights made on the GPU (load_format="dummy", the
same seed in every tree, so the trees run the same weights). Each (tree, config) runs in its own process: one
engine with max_num_seqs = the largest batch and a token budget that admits a whole batch's prompts in one
step; then per batch a warm-up and one timed LLM.generate of `batch` prompts (random ids, greedy, ignore EOS,
exactly 128 tokens each, no detokenization). Configs: bf16 (weights and KV cache), fp8 (E4M3 weights, bf16 KV),
fp8-kv8 (E4M3 weights and KV cache). Decode GEMV tuning and decode-layer fusion are off (they apply to <= 16
rows only; off saves start-up time).

Reported per run: output tok/s (batch x 128 / wall time of generate: TensorRT-LLM's measure), total tok/s
(prompt + output), TTFT (the batch's last first token), decode step wall ms (the time after the last first token /
127 steps), the decode graph's replay time (CUDA events, at the end's sequence lengths) and the difference:
the host's time per step not hidden under the GPU's. Trees must produce the same tokens (greedy, the same
weights): the script compares a digest of every run's tokens across trees and says MISMATCH if not.
Processes run in priority order within a time budget (--budget seconds); what does not fit is listed as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = r"""
import hashlib, json, sys, tempfile, time
from pathlib import Path
import torch, transformers
from kiln.llm import LLM, SamplingParams

a = json.loads(sys.argv[1])
if a["variant"] in ("unfused-fp8", "unfused-fp8+attn"):  # the A/B's baseline: FP8 GEMMs quantize their own input
    from kiln.llm.models import layers
    layers.takes_fp8_rows = lambda linear, rows: False
if a["variant"] == "heap-unfrozen":  # static_heap freezing nothing: kiln before llm6 on CPython 3.12
    from kiln.runtime import heap
    heap.INTERPRETER_FROZEN = -1
if a["variant"] in ("main-attn", "main-attn+flash"):  # FP8-KV attention as main ran it (before llm8): decode
    import functools  # with 4 warps, the prefill kernel's products in bf16
    from kiln.llm.kernels import paged_decode, paged_prefill
    paged_decode.FP8_NUM_WARPS = 4
    paged_prefill.paged_prefill_attention = functools.partial(paged_prefill.paged_prefill_attention, fp8_f16_dot=False)
if a["variant"].endswith("flash"):  # whole prompts through torch's flash attention (prefill_attention="flash")
    import os
    os.environ["KILN_LLM_PREFILL"] = "flash"
if a["decode_attention"]:  # the decode kernel's launch settings for this run (the sweep's fastest)
    import functools
    from kiln.llm.kernels import paged_decode
    paged_decode.paged_decode_attention = functools.partial(paged_decode.paged_decode_attention,
                                                            **a["decode_attention"])
config_name, batches, input_len, output_len = a["config"], a["batch"], a["input_len"], a["output_len"]
SHAPES = {"llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
          "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512)}  # tiny: a dry run of this script on the CPU
folder = Path(tempfile.mkdtemp())
config = transformers.LlamaConfig(**SHAPES[a["preset"]], max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                                  tie_word_embeddings=False)
config.dtype = torch.bfloat16
config.save_pretrained(folder)
options = {"bf16": {}, "fp8": {"quantization": "fp8"}, "fp8-kv8": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}
largest = max(batches)
started = time.perf_counter()
llm = LLM(folder, dtype=a["dtype"], device=a["device"], load_format="dummy", seed=0, kv_cache_memory=a["kv_cache_memory"],
          max_num_seqs=largest, max_num_batched_tokens=max(input_len * largest, 2048), max_model_len=a["max_model_len"],
          gemv="cublas", decode_fusion="off", **options[config_name])
sync = torch.cuda.synchronize if a["device"] == "cuda" else lambda: None
load_s = time.perf_counter() - started
vocab = config.vocab_size
generator = torch.Generator().manual_seed(0)
params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True, detokenize=False)
llm.generate([torch.randint(3, vocab, (input_len,), generator=generator).tolist() for _ in range(largest)],
             SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False))  # compile, warm up
if a["variant"] == "gc-off":  # the timed runs without automatic garbage collection (the collector's A/B)
    import gc
    gc.disable()
for batch, overlap in [(b, m) for b in batches for m in a["overlap"]]:
    if overlap != "default":  # async scheduling off / on in the same process: the same weights, A/B
        llm.engine.async_scheduling = overlap == "on"
    generator = torch.Generator().manual_seed(batch)  # each mode of a batch gets the same prompts,
    llm.engine.block_manager.reset_prefix_cache()  # computed again (no prefix-cache hits from the mode before)
    prompts = [torch.randint(3, vocab, (input_len,), generator=generator).tolist() for _ in range(batch)]
    sync()
    steps_before = llm.engine.runner.num_graph_steps
    start_wall, start_mono = time.perf_counter(), time.monotonic()
    outs = llm.generate(prompts, params)
    sync()
    end_mono = time.monotonic()
    elapsed = time.perf_counter() - start_wall
    first = max(o.metrics.first_token_time for o in outs)
    graphs = llm.engine.runner.graphs
    replay_ms = graphs.time_replay(batch) if graphs is not None else float("nan")
    tokens = [o.outputs[0].token_ids for o in outs]
    assert all(len(t) == output_len for t in tokens), [len(t) for t in tokens]
    decode_step_ms = (end_mono - first) / (output_len - 1) * 1e3
    if a["tokens_file"]:
        Path(a["tokens_file"]).write_text(json.dumps(tokens))
    print(json.dumps({"config": config_name, "batch": batch, "overlap": overlap, "load_s": load_s, "elapsed_s": elapsed,
                      "output_tok_s": batch * output_len / elapsed,
                      "total_tok_s": batch * (input_len + output_len) / elapsed,
                      "ttft_ms": (first - start_mono) * 1e3, "decode_step_ms": decode_step_ms,
                      "replay_ms": replay_ms, "host_ms": decode_step_ms - replay_ms,
                      "graph_steps": llm.engine.runner.num_graph_steps - steps_before,
                      "digest": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]}), flush=True)
if a["profile"] and a["device"] == "cuda":  # GPU us per kernel role (bench/llm_step_profile.py's labels)
    sys.path.insert(0, "bench")
    from collections import defaultdict
    import llm_step_profile as sp

    def parts(run, repeats=1):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run()
            sync()
        events = sp.kernel_events(prof)
        totals = defaultdict(float)
        for e, label in zip(events, sp.label_kernels([e.name for e in events], len(llm.engine.model.layers))):
            totals[label] += e.time_range.elapsed_us() / repeats
        return dict(totals)

    batch = max(batches)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False)
    llm.engine.block_manager.reset_prefix_cache()
    prompts = [torch.randint(3, vocab, (input_len,), generator=generator).tolist() for _ in range(batch)]
    print(json.dumps({"profile": "prefill", "parts": parts(lambda: llm.generate(prompts, one))}), flush=True)
    llm.engine.block_manager.reset_prefix_cache()
    llm.generate([torch.randint(3, vocab, (input_len,), generator=generator).tolist() for _ in range(batch)],
                 SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, detokenize=False))  # ~192 keys left
    graphs = llm.engine.runner.graphs
    graph = graphs.forward_graphs[graphs.bucket(batch)]
    graph.replay()
    sync()
    print(json.dumps({"profile": "decode", "parts": parts(lambda: [graph.replay() for _ in range(3)], 3)}), flush=True)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs="+", default=[str(ROOT)], help="first: the baseline")
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--configs", nargs="+", default=["bf16", "fp8", "fp8-kv8"], choices=["bf16", "fp8", "fp8-kv8"])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--preset", default="llama3-8b", choices=["llama3-8b", "tiny"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory", default="16GiB")
    parser.add_argument("--overlap", nargs="+", default=["default"], choices=["default", "off", "on"],
                        help="async scheduling per timed run (each batch runs once per mode, in this order)")
    parser.add_argument("--variants", nargs="+", default=["default"],
                        choices=["default", "unfused-fp8", "attn", "unfused-fp8+attn", "gc-off", "heap-unfrozen",
                                 "main-attn", "flash", "main-attn+flash", "decode-fp8", "decode-fp8+flash"],
                        help="per tree, one process each: unfused-fp8: FP8 GEMMs quantize their input themselves (no "
                             "norm/SwiGLU + quantize fusion); attn: the decode attention launch of --attention-json; "
                             "gc-off: automatic garbage collection disabled after the warm-up; heap-unfrozen: "
                             "LLM.generate's static_heap freezes nothing (kiln before llm6 on CPython 3.12); "
                             "main-attn: FP8-KV attention launched as before llm8 (decode 4 warps, prefill bf16 "
                             "products); flash: prefill_attention='flash' (whole prompts through flash attention); decode-fp8: "
                             "the process run with KILN_LLM_DECODE_FP8=--decode-fp8 (an FP8 cache's decode launch); "
                             "decode-fp8+flash: and flash prefill")
    parser.add_argument("--runs", nargs="+", default=None,
                        help="CONFIG:VARIANT in the order to run (instead of configs x variants; the last tree)")
    parser.add_argument("--profile", nargs="*", default=[],
                        help="CONFIG:VARIANT runs whose first process also profiles one prefill step and one decode "
                             "replay (~192 keys) kernel by kernel after its timed generate (one table per step kind)")
    parser.add_argument("--attention-json", default=None,
                        help="bench/llm_step_profile.py's decode_attention_best.json: launch settings per KV dtype")
    parser.add_argument("--decode-fp8", default="",
                        help="KILN_LLM_DECODE_FP8 for the decode-fp8 variant (e.g. 'h4 n16 w1 s4'), or @FILE holding "
                             "it (bench/llm7_decode_sweep.py's llm7_best.txt)")
    parser.add_argument("--budget", type=float, default=200.0, help="seconds for all processes")
    parser.add_argument("--per-run", type=float, default=40.0, help="seconds one process is expected to take")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = parser.parse_args()
    trees = [Path(t).resolve() for t in args.trees]
    deadline = time.monotonic() + args.budget
    rows, skipped = [], []
    best_attention = json.loads(Path(args.attention_json).read_text()) if args.attention_json else {}
    runs = [(c, t, v) for c in args.configs for t in reversed(trees) for v in args.variants]
    if args.runs:  # an explicit order (one tree): its first run of each config is that config's baseline
        runs = [(r.split(":")[0], trees[-1], r.split(":")[1]) for r in args.runs]
    profiled = set()
    profiles: dict[str, dict[str, dict[str, float]]] = {}  # prefill/decode -> run -> role -> us
    for index, (config, tree, variant) in enumerate(runs):  # a variant named twice runs twice (A/B/A/B)
        # the tree under test first: if time runs out, its numbers exist
        left = deadline - time.monotonic()
        if left < args.per_run:
            skipped.append(f"{tree.name} {config} {variant}")
            continue
        launch = None
        if variant in ("attn", "unfused-fp8+attn"):  # the --attention-json launch
            launch = {k: v for k, v in best_attention["fp8" if config == "fp8-kv8" else "bf16"].items()
                      if k != "name"}
        env = {**os.environ, "PYTHONPATH": str(tree)}
        env.pop("KILN_LLM_DECODE_FP8", None)  # only the decode-fp8 variant sets it
        if variant.startswith("decode-fp8"):
            decode_fp8 = args.decode_fp8
            if decode_fp8.startswith("@"):
                decode_fp8 = Path(decode_fp8[1:]).read_text().strip() if Path(decode_fp8[1:]).exists() else ""
            env["KILN_LLM_DECODE_FP8"] = decode_fp8
            print(f"{config} {variant}: KILN_LLM_DECODE_FP8={decode_fp8!r}", flush=True)
        started = time.monotonic()
        try:
            child = {"config": config, "batch": args.batch, "input_len": args.input_len,
                     "output_len": args.output_len, "max_model_len": args.max_model_len, "preset": args.preset,
                     "device": args.device, "dtype": args.dtype, "kv_cache_memory": args.kv_cache_memory,
                     "overlap": args.overlap, "variant": variant, "decode_attention": launch,
                     "tokens_file": str(Path(args.out) / f"tokens-{index}.json"),
                     "profile": f"{config}:{variant}" in args.profile and f"{config}:{variant}" not in profiled}
            profiled.add(f"{config}:{variant}")
            out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(child)], env=env, capture_output=True,
                                 text=True, cwd=tree, timeout=left)
        except subprocess.TimeoutExpired as e:
            print(f"{tree.name} {config} {variant}: timed out after {left:.0f} s", flush=True)
            out = subprocess.CompletedProcess(e.cmd, -1, e.stdout or "", e.stderr or "")
            out.stdout = out.stdout.decode() if isinstance(out.stdout, bytes) else out.stdout
            out.stderr = out.stderr.decode() if isinstance(out.stderr, bytes) else out.stderr
        label = tree.name if variant == "default" else f"{tree.name} {variant}"
        (Path(args.out) / f"{index}-{label.replace(' ', '-')}-{config}.log").write_text(out.stdout + "\n" + out.stderr)
        for line in out.stdout.splitlines():
            if line.startswith('{"profile"'):
                record = json.loads(line)
                profiles.setdefault(record["profile"], {})[f"{label} {config}"] = record["parts"]
            elif line.startswith("{"):
                rows.append({"tree": label, "launch": launch, "index": index, **json.loads(line)})
                r = rows[-1]
                print(f"{label} {config} b{r['batch']}: {r['output_tok_s']:,.0f} tok/s, TTFT {r['ttft_ms']:.0f} ms, "
                      f"step {r['decode_step_ms']:.2f} ms, replay {r['replay_ms']:.2f} ms, {r['digest'][:8]}", flush=True)
        if out.returncode:
            print(f"{label} {config}: exit {out.returncode}\n{out.stderr[-2500:]}", flush=True)
        print(f"{label} {config}: {time.monotonic() - started:.0f} s", flush=True)
    (Path(args.out) / "throughput.json").write_text(json.dumps(rows, indent=1))
    for step, runs_parts in profiles.items():  # one table per step kind: GPU ms (prefill) or us (decode) per role
        unit, scale = ("ms", 1e-3) if step == "prefill" else ("us", 1.0)
        names = list(runs_parts)
        labels = sorted({k for p in runs_parts.values() for k in p}, key=lambda k: -max(p.get(k, 0) for p in
                                                                                         runs_parts.values()))
        print(f"\n{step} step, GPU {unit} by kernel role (decode: one replay, ~192 keys)")
        print("| part | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
        for k in labels + ["total"]:
            cells = [sum(p.values()) if k == "total" else p.get(k, 0.0) for p in runs_parts.values()]
            print(f"| {k} | " + " | ".join(f"{c * scale:,.1f}" for c in cells) + " |")
    first_digest = {}  # (config, batch) -> the first row's tokens: the baseline's
    baseline = trees[0].name if args.variants[0] == "default" else f"{trees[0].name} {args.variants[0]}"
    if args.runs:
        baseline = None  # rows in run order: each config's first row is its baseline
    for r in sorted(rows, key=lambda r: baseline is not None and r["tree"] != baseline):
        first_digest.setdefault((r["config"], r["batch"]), r["digest"])
    print(f"\n{torch_versions()}; input {args.input_len}, output {args.output_len}, max_model_len {args.max_model_len}")
    print("| tree | config | async | batch | output tok/s | total tok/s | TTFT ms | decode step ms (wall) | "
          "graph replay ms | host ms/step not hidden | load s | tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    first_index = {}  # (config, batch) -> the baseline row's index: its tokens file
    for r in sorted(rows, key=lambda r: baseline is not None and r["tree"] != baseline):
        first_index.setdefault((r["config"], r["batch"]), r["index"])
    for r in sorted(rows, key=lambda r: (r["config"], r["batch"], baseline is not None and r["tree"] != baseline)):
        same = "same" if r["digest"] == first_digest[(r["config"], r["batch"])] else \
            f"differ ({r['digest'][:8]}; {agreement(args.out, first_index[(r['config'], r['batch'])], r['index'])})"
        print(f"| {r['tree']} | {r['config']} | {r.get('overlap', '')} | {r['batch']} | {r['output_tok_s']:,.0f} | "
              f"{r['total_tok_s']:,.0f} | "
              f"{r['ttft_ms']:.0f} | {r['decode_step_ms']:.2f} | {r['replay_ms']:.2f} | {r['host_ms']:.2f} | "
              f"{r['load_s']:.0f} | {same} |")
    if skipped:
        print("skipped (time budget): " + ", ".join(skipped))
    return 0


def agreement(out: str, base: int, index: int) -> str:
    """How far two runs' greedy tokens agree: requests whose 128 tokens are all equal, and the median position of
    a request's first different token (random weights make near-ties: one bit may flip a token, then the rest)."""
    try:
        a, b = (json.loads((Path(out) / f"tokens-{i}.json").read_text()) for i in (base, index))
    except (OSError, ValueError):
        return "tokens not saved"
    firsts = sorted(next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s)) for s, t in zip(a, b))
    equal = sum(s == t for s, t in zip(a, b))
    return f"{equal}/{len(a)} requests equal, first difference median at token {firsts[len(firsts) // 2]}"


def torch_versions() -> str:
    out = subprocess.run([sys.executable, "-c", "import torch, triton; print(torch.__version__, triton.__version__, "
                          "torch.cuda.get_device_name() if torch.cuda.is_available() else 'no cuda')"],
                         capture_output=True, text=True)
    return out.stdout.strip() or out.stderr.strip()[-200:]


if __name__ == "__main__":
    sys.exit(main())
