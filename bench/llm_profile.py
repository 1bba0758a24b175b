"""Where a batch-1 decode step's time goes on the GPU: kiln.llm's captured decode graph, kernel by kernel.

    python bench/llm_profile.py [--preset llama3-8b] [--dtype bfloat16] [--quantization fp8] [--batch 1]
                                [--gemv auto|cublas|triton] [--fuse auto|on|off]

Random weights made on the device (load_format="dummy"). After a short generate (which captures the decode
graphs), the batch's forward graph is replayed under torch.profiler (CUPTI traces the kernels inside a graph
replay); kernels are grouped by name: calls per step, GPU time per step, and the bytes-read roofline of the
whole step (weight bytes / --bandwidth). Prints a table, longest first; the step's replay time (CUDA events)
against the sum of its kernels says how much is gaps between kernels.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from llm import write_checkpoint  # noqa: E402  bench/llm.py

from kiln.llm import LLM, SamplingParams  # noqa: E402
from kiln.llm.quantization import weight_bytes  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--bandwidth", type=float, default=4.3, help="HBM TB/s")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--gemv", default=None, choices=["auto", "cublas", "triton"],
                        help="decode GEMVs: EngineConfig.gemv (default: KILN_LLM_GEMV, else auto)")
    parser.add_argument("--fuse", default=None, choices=["auto", "on", "off"],
                        help="decode layers' fused GEMVs: EngineConfig.decode_fusion (default: KILN_LLM_FUSE, else auto)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_checkpoint(args.preset, getattr(torch, args.dtype), folder, weights=False)
        llm = LLM(folder, dtype=args.dtype, kv_cache_memory="2GiB", max_num_seqs=max(args.batch, 1),
                  quantization=args.quantization, device="cuda", cuda_graphs=True, load_format="dummy",
                  **({"gemv": args.gemv} if args.gemv else {}), **({"decode_fusion": args.fuse} if args.fuse else {}))
        print(f"decode GEMVs: {llm.engine.config.gemv}")
        for decision in llm.engine.gemv_decisions:
            print(f"  {decision.describe()}")
        print(f"decode fusion: {llm.engine.config.decode_fusion}")
        for decision in llm.engine.fusion_decisions:
            print(f"  {decision.describe()}")
        vocab = llm.engine.model_config.vocab_size
        prompts = [torch.randint(3, vocab, (128,)).tolist() for _ in range(args.batch)]
        llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, detokenize=False))
        graphs = llm.engine.runner.graphs
        step_ms = graphs.time_replay(args.batch, repeats=50)
        graph = graphs.forward_graphs[graphs.bucket(args.batch)]
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.replays):
                graph.replay()
            torch.cuda.synchronize()
        per_name = defaultdict(lambda: [0, 0.0])
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                entry = per_name[event.name]
                entry[0] += 1
                entry[1] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
        model = llm.engine.model
        read = weight_bytes(model) - model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
        floor_ms = read / (args.bandwidth * 1e12) * 1e3
        rows = sorted(per_name.items(), key=lambda kv: -kv[1][1])
        total_us = sum(v[1] for v in per_name.values()) / args.replays
        calls = sum(v[0] for v in per_name.values()) / args.replays
        print(f"{args.preset} {args.dtype} quantization={args.quantization} batch {args.batch}: "
              f"replay {step_ms:.3f} ms (CUDA events), kernels {total_us / 1e3:.3f} ms in {calls:.0f} launches, "
              f"bytes-read floor {floor_ms:.3f} ms ({read / 1e9:.2f} GB at {args.bandwidth} TB/s): "
              f"{floor_ms / step_ms:.1%} of roofline")
        print("| kernel | calls / step | us / step | us / call | share |")
        print("|---|---|---|---|---|")
        for name, (count, us) in rows[:args.top]:
            print(f"| {name[:90]} | {count / args.replays:.0f} | {us / args.replays:.1f} | {us / count:.2f} | "
                  f"{us / args.replays / total_us:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
