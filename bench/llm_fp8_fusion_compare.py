"""Where the fused FP8 path and the unfused one part, layer by layer: a prefill and a few decode steps of a random
Llama-3-8B at a large batch, run eagerly in both modes on the same engine, the same weights and the same inputs.

    python bench/llm_fp8_fusion_compare.py [--tree PATH] [--batch 512] [--prompt-len 128] [--decode-steps 2]
    python bench/llm_fp8_fusion_compare.py --preset tiny --device cpu --batch 4 --prompt-len 20   # a dry run

fused: the norms (after the residual add) and SwiGLU quantize their output per token for the FP8 GEMM that reads it
(kiln/llm/models/layers.py takes_fp8_rows); unfused: each FP8 GEMM quantizes its own bf16 input (fp8_quantize_rows).
Both must give the same bits. The output of every layer's q|k|v, o, gate|up and down GEMM is recorded as a hash of
each row's bits; per step the first (layer, GEMM) whose rows differ between the modes and the rows whose greedy
token differs are printed, and the fused mode runs twice (its own repeatability). --tree: the kiln tree to import
(e.g. a copy with another kernel), default this one. Random weights made on the GPU (load_format="dummy", seed 0);
the decode steps feed fixed random tokens, so both modes see the same inputs however their tokens differ.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # a layer's GEMMs, in the order they run


def row_hashes(t: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[T, C] bf16 -> [T] int64: a weighted sum of each row's 16-bit patterns (wrapping), equal iff the bits are
    (but for a 2^-64 chance). In chunks of rows: the int64 copy of a 65k x 28672 output would take 15 GB."""
    bits = t.view(torch.int16)
    out = torch.empty(t.shape[0], dtype=torch.int64, device=t.device)
    for r in range(0, t.shape[0], 2048):
        out[r:r + 2048] = (bits[r:r + 2048].to(torch.int64) * weights[:t.shape[1]]).sum(-1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default=str(ROOT), help="the kiln tree to import")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="llama3-8b", help="bench/llm.py's (tiny: a dry run on the CPU)")
    args = parser.parse_args()
    sys.path.insert(0, args.tree)  # before anything imports kiln
    from kiln.llm import LLM
    from kiln.llm.models import layers
    from kiln.llm.request import Request
    from kiln.llm.scheduler import ScheduledRequest
    from llm import write_checkpoint  # bench/llm.py (its kiln import finds the tree's, already loaded)

    device = torch.device(args.device)
    print(f"kiln from {Path(layers.__file__).parents[2]}; "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}", flush=True)
    folder = Path(tempfile.mkdtemp())
    write_checkpoint(args.preset, torch.bfloat16, folder, weights=False)
    llm = LLM(folder, dtype="bfloat16", device=args.device, load_format="dummy", seed=0, quantization="fp8",
              kv_cache_memory="16GiB", max_num_seqs=args.batch, max_num_batched_tokens=args.batch * args.prompt_len,
              max_model_len=512, gemv="cublas", decode_fusion="off", cuda_graphs=False)
    runner, model = llm.engine.runner, llm.engine.model
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (args.batch, args.prompt_len), generator=generator).tolist()
    fed = torch.randint(3, vocab, (args.decode_steps, args.batch), generator=generator).tolist()
    per_request = math.ceil((args.prompt_len + args.decode_steps) / 16)
    requests = [Request(f"r{b}", p) for b, p in enumerate(prompts)]
    blocks = [list(range(1 + b * per_request, 1 + (b + 1) * per_request)) for b in range(args.batch)]
    steps = [[ScheduledRequest(r, p, 0, t) for r, p, t in zip(requests, prompts, blocks)]]
    steps += [[ScheduledRequest(r, [tokens[b]], args.prompt_len + s, blocks[b]) for b, r in enumerate(requests)]
              for s, tokens in enumerate(fed)]

    weights = torch.randint(1, 2**62, (16 * 4096,), generator=generator).to(device)
    record: dict[tuple[int, str], torch.Tensor] = {}
    for index, layer in enumerate(model.layers):
        for name in PROJECTIONS:
            module = getattr(layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp, name)
            module.register_forward_hook(lambda m, inputs, out, key=(index, name): record.__setitem__(
                key, row_hashes(out, weights)))

    def run(fused: bool) -> list[tuple[dict, torch.Tensor]]:
        """Per step: the GEMM outputs' row hashes and the greedy tokens."""
        original = layers.takes_fp8_rows
        if not fused:
            layers.takes_fp8_rows = lambda linear, rows: False
        try:
            out = []
            for scheduled in steps:
                record.clear()
                tokens = runner.forward(runner.prepare(scheduled)).argmax(-1)
                out.append((dict(record), tokens))
            return out
        finally:
            layers.takes_fp8_rows = original

    runs = {"fused": run(True), "unfused": run(False), "fused again": run(True)}
    print("| against fused | step | GEMM outputs differing | first differing (layer, GEMM): rows | tokens differing |")
    print("|---|---|---|---|---|")
    reference = runs["fused"]
    for name in ("unfused", "fused again"):
        for step, ((hashes, tokens), (ref_hashes, ref_tokens)) in enumerate(zip(runs[name], reference)):
            differing = [(key, int((hashes[key] != ref_hashes[key]).sum())) for key in ref_hashes
                         if not torch.equal(hashes[key], ref_hashes[key])]
            first = f"layer {differing[0][0][0]} {differing[0][0][1]}: {differing[0][1]}" if differing else "-"
            label = "prefill" if step == 0 else f"decode {step}"
            print(f"| {name} | {label} | {len(differing)} of {len(ref_hashes)} | {first} | "
                  f"{int((tokens != ref_tokens).sum())} of {len(tokens)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
