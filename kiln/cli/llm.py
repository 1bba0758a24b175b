"""kiln llm: serve, generate with and benchmark an LLM from a Hugging Face folder.

    kiln llm serve PATH [--port 8000] [--kv-cache-memory 4GiB] [--dtype bfloat16] ...
    kiln llm generate PATH --prompt "Hello" [--max-tokens 64] [--temperature 0]
    kiln llm bench [PATH | --url URL] [--num-prompts 100] [--input-len 128] [--output-len 128]
                   [--request-rate inf] [--max-concurrency N] [--goodput ttft:500 tpot:50]

See docs/llm.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import urllib.request
from pathlib import Path

from kiln.errors import KilnError


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", help="auto (the checkpoint's on CUDA, float32 on the CPU), float32, "
                                                   "bfloat16, float16")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--kv-cache-memory", default="1GiB", metavar="SIZE",
                   help="the KV cache's budget, e.g. 8GiB (default 1GiB; kiln never sizes it from free memory)")
    g.add_argument("--num-kv-blocks", type=int, metavar="N", help="exactly N KV blocks (overrides --kv-cache-memory)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once (default 64)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step (default 2048)")
    g.add_argument("--max-model-len", type=int, help="prompt + output limit (default: the model's)")
    g.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached prompt blocks")
    g.add_argument("--no-chunked-prefill", action="store_true", help="prefill a prompt in one step")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument("--quantization", choices=["fp8", "int8", "int4"],
                   help="quantize the projections' weights at load (fp8: E4M3 per channel; int8/int4: weight-only)")
    g.add_argument("--speculative-ngram", type=int, default=0, metavar="K",
                   help="propose K draft tokens per step by n-gram prompt lookup (greedy requests; default off)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="auto: the model's dtype; fp8: E4M3 with unit scale (twice the tokens per byte)")
    g.add_argument("--speculative-model", metavar="PATH",
                   help="a smaller draft model of the same vocabulary proposing tokens (greedy requests)")
    g.add_argument("--speculative-tokens", type=int, default=4, metavar="K",
                   help="draft tokens the --speculative-model proposes per step (default 4)")
    g.add_argument("--seed", type=int, help="seed of the sampler for requests without their own")
    g.add_argument("--no-async-scheduling", action="store_true",
                   help="wait for each decode step's tokens before planning the next (default: plan it while the "
                        "GPU runs, with CUDA graphs)")


def _engine_config(args: argparse.Namespace):
    from kiln.llm.config import EngineConfig
    return EngineConfig(dtype=args.dtype, device=args.device, kv_cache_memory=args.kv_cache_memory,
                        num_kv_blocks=args.num_kv_blocks, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                        enable_prefix_caching=not args.no_prefix_caching,
                        enable_chunked_prefill=not args.no_chunked_prefill, attention_backend=args.attention_backend,
                        quantization=args.quantization, speculative_ngram=args.speculative_ngram,
                        speculative_model=args.speculative_model, speculative_tokens=args.speculative_tokens,
                        kv_cache_dtype=args.kv_cache_dtype, seed=args.seed,
                        async_scheduling=False if args.no_async_scheduling else "auto")


def add_parser(verbs) -> None:
    llm = verbs.add_parser("llm", help="serve, run and benchmark LLMs (Hugging Face folders)",
                           description="An LLM runtime: paged KV cache, in-flight batching, an OpenAI-compatible "
                                       "server. See docs/llm.md.")
    sub = llm.add_subparsers(dest="llm_verb", metavar="{serve,generate,bench}", required=True)

    p = sub.add_parser("serve", help="serve a model over the OpenAI API (/v1/completions, /v1/chat/completions)")
    p.add_argument("model", help="a Hugging Face model folder (config.json, *.safetensors, tokenizer.json)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000; 0: a free one)")
    p.add_argument("--served-model-name", help="the model's name in the API (default: the folder's name)")
    p.add_argument("--max-pending", type=int, default=1024, help="requests in flight before 429 (default 1024)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    _engine_arguments(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="generate from prompts and print the text as it comes")
    p.add_argument("model")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    p.add_argument("--chat", action="store_true", help="send each prompt as a user message through the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sample-seed", type=int, help="the requests' own seed")
    _engine_arguments(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("bench", help="benchmark a server like `vllm bench serve` (TTFT, TPOT, ITL, throughput)")
    p.add_argument("model", nargs="?", help="a model folder to serve on a free port for the run (or give --url)")
    p.add_argument("--url", help="an OpenAI-compatible server already running (e.g. http://127.0.0.1:8000)")
    p.add_argument("--served-model-name", help="the model name to send (default: the server's first model)")
    p.add_argument("--vocab-size", type=int, help="random prompt ids below this (default: from the tokenizer)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths vary by +- this fraction")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (default inf)")
    p.add_argument("--max-concurrency", type=int)
    p.add_argument("--goodput", nargs="*", default=[], metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT.json", help="also write the report as JSON")
    _engine_arguments(p)
    p.set_defaults(func=cmd_bench)


def _server_module():
    try:
        from kiln.llm import server
    except ImportError as e:
        raise KilnError(f"kiln llm serve needs the llm extra ({e.name} is missing): pip install 'kiln[llm]'") from None
    return server


def cmd_serve(args: argparse.Namespace) -> int:
    server_module = _server_module()
    logging.basicConfig(level=args.log_level.upper(), format="kiln llm: %(message)s")
    options = server_module.ServerOptions(model=args.model, served_model_name=args.served_model_name, host=args.host,
                                          port=args.port, engine=_engine_config(args), max_pending=args.max_pending,
                                          log_level=args.log_level)
    server = server_module.LLMServer(options)
    engine = server.llm.engine

    def started(s) -> None:
        print(f"kiln llm: model {s.model_name} ({engine.model_config.model_type}, {engine.dtype}, {engine.device}), "
              f"{engine.num_kv_blocks} KV blocks x {engine.config.block_size} tokens, max_model_len "
              f"{engine.max_model_len}", flush=True)
        print(f"kiln llm: OpenAI API on {s.url}/v1", flush=True)
        print("kiln llm: ready", flush=True)

    asyncio.run(server.serve_forever(started))
    print("kiln llm: stopped", flush=True)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from kiln.llm import LLM, SamplingParams
    llm = LLM(args.model, **vars(_engine_config(args)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sample_seed)
    prompts = args.prompt
    if args.chat:
        prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    for i, prompt in enumerate(prompts):
        print(f"--- prompt {i}: {args.prompt[i]!r}", flush=True)
        for out in llm.stream(prompt, params):
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
            if out.finished:
                print(f"\n--- {len(out.outputs[0].token_ids)} tokens, finish_reason {out.outputs[0].finish_reason}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from kiln.llm.bench import BenchConfig, format_report, run_bench
    if (args.model is None) == (args.url is None):
        raise KilnError("give a model folder to serve for the run, or --url of a running server (one of them)")
    goodput = {}
    for item in args.goodput:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise KilnError(f"--goodput {item!r}: expected ttft:MS, tpot:MS or e2el:MS")
        goodput[key] = float(value)
    server = None
    url = args.url
    if url is None:
        server_module = _server_module()
        server = server_module.LLMServer(server_module.ServerOptions(model=args.model, port=0,
                                                                     engine=_engine_config(args)))
        server.start_in_thread()
        url = server.url
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=30) as response:
            models = json.load(response)["data"]
        name = args.served_model_name or models[0]["id"]
        vocab = args.vocab_size
        if vocab is None:
            root = Path(models[0].get("root") or "")
            if not (root / "config.json").is_file():
                raise KilnError("cannot find the model's vocabulary size from the server: give --vocab-size")
            vocab = json.loads((root / "config.json").read_text())["vocab_size"]
        config = BenchConfig(url=url, model=name, vocab_size=vocab, num_prompts=args.num_prompts,
                             input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
                             request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                             seed=args.bench_seed, goodput=goodput)
        report = asyncio.run(run_bench(config))
    finally:
        if server is not None:
            server.stop()
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0 if report["failed"] == 0 else 2
