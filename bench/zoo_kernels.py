"""Where a zoo model's GPU time goes: kiln's kernels beside torch.compile's and torch eager's (issue 11).

    python bench/zoo_kernels.py --model gpt2 --batch 8 --seq 512 [--out DIR]

Builds the zoo's fp32 ONNX export with device='cuda', precision='fp16' (as bench/zoo.py does), times kiln's
`context.run`, torch eager fp16 and torch.compile (default) on the same module (CUDA events, median), then a
torch.profiler kernel table for each (bench/large_shapes.py's `kernel_table`: GPU time by family and the top
kernels), and the engine's outputs (name, dtype, shape), so a row under its target can be read kernel by kernel.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
from large_shapes import kernel_table  # noqa: E402
from zoo import tensors  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    from gpu import time_cuda  # bench/gpu.py: CUDA events around each call, after warm-up

    exported = zoo.export(args.model, batch=args.batch, seq=args.seq)
    feeds = exported.inputs()
    inputs32, inputs16 = tensors(feeds, "cuda", half=False), tensors(feeds, "cuda", half=True)
    module = zoo.torch_model(args.model).cuda().half()
    start = time.perf_counter()
    engine = kiln.build(str(exported.path), device="cuda", precision="fp16")
    build_s = time.perf_counter() - start
    context = engine.create_execution_context()
    outputs = context.run(inputs32)
    lines = [f"# {args.model} {args.batch}x{args.seq} on {torch.cuda.get_device_name()}, kiln build {build_s:.1f} s",
             "engine outputs: " + ", ".join(f"{n} {outputs[n].dtype} {tuple(outputs[n].shape)}"
                                            for n in engine.output_names)]
    # the layers writing the engine's outputs: the tactic the tuner kept and every candidate's time or refusal
    # (an fp32 output of a half engine is stored by its GEMM, output_float32: GPT-2's LM head, issue 11)
    records = engine.plan.header.get("tactics", {}).get("layers", {})
    for step in engine.plan.program.steps:
        if set(step.outputs) & set(engine.output_names):
            record = records.get(step.name, {})
            lines.append(f"output layer {step.name} ({step.op_type}, output_float32="
                         f"{step.attributes.get('output_float32', 0)}): {step.tactic}"
                         + (f", reverted: {record['reverted']}" if record.get("reverted") else ""))
            for name, note in record.get("candidates", {}).items():
                lines.append(f"  {name}: " + (f"{note:.3f} ms" if isinstance(note, float) else str(note)[:160]))
    runs = {"kiln": lambda: context.run(inputs32)}
    with torch.inference_mode():
        runs["torch eager"] = lambda: module(**inputs16)
        if not args.no_compile:
            compiled = torch.compile(module)
            runs["torch.compile"] = lambda: compiled(**inputs16)
        lines.append("| runtime | ms (median) |")
        lines.append("|---|---|")
        for label, fn in runs.items():
            lines.append(f"| {label} | {statistics.median(time_cuda(fn)):.3f} |")
        for label, fn in runs.items():
            kernel_table(fn, label, lines)
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out, f"kernels-{args.model}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
