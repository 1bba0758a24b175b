"""kiln.llm vs transformers `generate` on the same random-weight model and lengths, side by side in one run.

    python bench/llm.py                                  # CPU: a small Llama shape, fp32, batch 1 and 8
    python bench/llm.py --preset llama3-8b --dtype bfloat16 --batch 1 8 64 --input-len 128 --output-len 128
    python bench/llm.py --quantization fp8 int4          # also kiln with quantized weights

For each batch size: prompts of random token ids, greedy, ignore EOS, exactly output-len tokens each.
kiln runs through LLM.stream (TTFT = first token of the batch; decode tok/s = tokens after the first
step / the time after it), with its decode steps as CUDA graphs on CUDA ("kiln eager" rows: without);
transformers through model.generate with its dynamic cache (total time only). On CUDA the weights are
random and made on the GPU (kiln: load_format="dummy"; transformers: from_config on the device), so no
16 GB checkpoint is written or read; the two models' weights differ, their shapes do not. The table
adds the batch-1 HBM roofline: weight bytes / bandwidth (--bandwidth, TB/s; 4.3 measured on the H200
used for kiln's numbers), kiln's decode rate as a fraction of it, and as a fraction of the bytes a
decode step reads (the weights less the input embedding table, of which a step reads one row).
Writes bench/results/llm-<date>.md (appended) with the device and the commit (KILN_COMMIT overrides).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu import commit as git_commit  # noqa: E402  bench/cpu.py

from kiln.llm import LLM, SamplingParams  # noqa: E402
from kiln.llm.quantization import weight_bytes  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PRESETS = {  # transformers LlamaConfig fields
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=4096),
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=32000),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
}


def commit() -> str:
    return os.environ.get("KILN_COMMIT") or git_commit()


def llama_config(preset: str) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(**PRESETS[preset], max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                                    tie_word_embeddings=False)


def write_checkpoint(preset: str, dtype: torch.dtype, folder: Path, weights: bool = True) -> None:
    config = llama_config(preset)
    if not weights:  # config.json only: kiln makes random weights on the device (load_format="dummy")
        config.dtype = dtype
        config.save_pretrained(folder)
        return
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(folder)


def run_kiln(folder: Path, args, batch: int, quantization: str | None, graphs: bool = True) -> dict:
    llm = LLM(folder, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
              max_num_seqs=max(batch, 1),
              max_num_batched_tokens=max(args.input_len * batch, 2048), quantization=quantization,
              device=args.device, cuda_graphs=graphs and args.device.startswith("cuda"),
              load_format="dummy" if args.dummy else "safetensors", max_model_len=args.max_model_len)
    vocab = llm.engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True, detokenize=False)

    def prompts():
        return [torch.randint(3, vocab, (args.input_len,), generator=generator).tolist() for _ in range(batch)]

    list(llm.stream(prompts(), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, detokenize=False)))
    sync()
    start = time.perf_counter()
    first = None
    for out in llm.stream(prompts(), params):
        if first is None:
            sync()
            first = time.perf_counter()
    sync()
    end = time.perf_counter()
    decode_tokens = batch * (args.output_len - 1)
    model = llm.engine.model
    graphs = llm.engine.runner.graphs
    gpu_ms = graphs.time_replay(batch) if graphs is not None else None  # after the run: its inputs, its lengths
    result = {"ttft_ms": (first - start) * 1e3, "decode_tok_s": decode_tokens / (end - first),
              "total_tok_s": batch * args.output_len / (end - start), "weight_bytes": weight_bytes(model),
              "read_bytes": weight_bytes(model) - model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size(),
              "graph_mib": graphs.memory_bytes / 2**20 if graphs is not None else None,
              "graph_steps": llm.engine.runner.num_graph_steps, "gpu_step_ms": gpu_ms}
    del llm, model, graphs
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def run_transformers(folder: Path, args, batch: int) -> dict:
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else torch.float32
    if args.dummy:  # random weights made on the device
        with torch.device(args.device):
            model = transformers.AutoModelForCausalLM.from_config(llama_config(args.preset), dtype=dtype).eval()
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(args.device).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (batch, args.input_len), generator=generator).to(args.device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)
        sync()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=args.output_len, min_new_tokens=args.output_len, **kwargs)
        sync()
    elapsed = time.perf_counter() - start
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"ttft_ms": float("nan"), "decode_tok_s": float("nan"), "total_tok_s": batch * args.output_len / elapsed}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16, float16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    parser.add_argument("--quantization", nargs="*", default=[], choices=["fp8", "int8", "int4"])
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--eager-batch", type=int, nargs="*", default=[1],
                        help="batch sizes also run without CUDA graphs (CUDA only)")
    parser.add_argument("--max-model-len", type=int, help="kiln's (default: the model's, 4096)")
    parser.add_argument("--checkpoint", action="store_true",
                        help="write and load a safetensors checkpoint (default on the CPU; CUDA uses random weights made on "
                             "the device)")
    parser.add_argument("--bandwidth", type=float, default=4.3, help="HBM TB/s for the roofline (CUDA)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.dummy = args.device.startswith("cuda") and not args.checkpoint
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_checkpoint(args.preset, getattr(torch, args.dtype), folder, weights=not args.dummy)
        for batch in args.batch:
            if args.device.startswith("cuda") and batch in args.eager_batch:
                rows.append(("kiln eager", batch, run_kiln(folder, args, batch, None, graphs=False)))
            for quantization in [None, *args.quantization]:
                result = run_kiln(folder, args, batch, quantization)
                rows.append((f"kiln{'' if quantization is None else ' ' + quantization}", batch, result))
                print(rows[-1], flush=True)
            if not args.no_transformers:
                rows.append(("transformers generate (dynamic cache)", batch, run_transformers(folder, args, batch)))
                print(rows[-1], flush=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    lines = [f"## {datetime.date.today()} {args.preset} {args.dtype} on {device} ({args.device}), commit {commit()}",
             f"input {args.input_len} tokens, output {args.output_len}, greedy, torch {torch.__version__}, "
             f"{torch.get_num_threads()} CPU thread(s)", "",
             "| system | batch | TTFT ms | decode tok/s | total tok/s | batch-1 roofline tok/s | of roofline "
             "| of bytes-read roofline | graph MiB | GPU ms/step (graph replay) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, batch, r in rows:
        roofline = share = share_read = graph = gpu = ""
        if args.device.startswith("cuda") and "weight_bytes" in r:
            rate = args.bandwidth * 1e12 / r["weight_bytes"]
            roofline = f"{rate:.0f}"
            if batch == 1:
                share = f"{r['decode_tok_s'] / rate:.1%}"
                share_read = f"{r['decode_tok_s'] * r['read_bytes'] / (args.bandwidth * 1e12):.1%}"
            graph = f"{r['graph_mib']:.0f}" if r.get("graph_mib") is not None else ""
            gpu = f"{r['gpu_step_ms']:.2f}" if r.get("gpu_step_ms") is not None else ""
        lines.append(f"| {name} | {batch} | {r['ttft_ms']:.1f} | {r['decode_tok_s']:.1f} | {r['total_tok_s']:.1f} | "
                     f"{roofline} | {share} | {share_read} | {graph} | {gpu} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / f"llm-{datetime.date.today()}.md"
        with path.open("a") as f:
            f.write(text + "\n")
        print(f"appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
