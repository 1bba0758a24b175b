"""The host's share of a profiled (symbolic-shape) CUDA engine's call (issue 10): context.run against its
graph's replay alone, per shape, and where the host time goes (cProfile).

    python bench/dynamic_overhead.py [--model bert_base] [--shapes 1x8,8x128,16x256] [--out DIR]

For each shape (a padding mask fed as users feed it, CUDA tensors in): wall time of context.run (synchronized,
median of 50) and of the bucket's captured graph replayed alone;
then a cProfile of 200 context.run calls at the first
shape, top functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kiln  # noqa: E402
from kiln import zoo  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from large_shapes import timed  # noqa: E402  bench/large_shapes.py


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert_base")
    ap.add_argument("--shapes", default="1x8,1x128,8x128,16x256")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    model = zoo.get(args.model)
    exported = zoo.export(args.model, batch=2, seq=16, dynamic=True)
    engine = kiln.build(str(exported.path), device="cuda", precision="fp16",
                        profiles=[{"input_ids": "1x1,8x128,32x512"}])
    ctx = engine.create_execution_context()
    rng = np.random.default_rng(0)
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.model} fp16, profile 1x1..32x512, "
             f"commit {os.environ.get('KILN_COMMIT', '?')}",
             "| shape | context.run ms | graph replay ms | host share ms |", "|---|---|---|---|"]
    first = None
    with torch.inference_mode():
        for b, s in shapes:
            mask = np.ones((b, s), np.int64)
            mask[:, max(1, s // 2):] = 0 if s > 1 else 1
            feeds = {"input_ids": torch.from_numpy(rng.integers(0, model.vocab_size, (b, s))).cuda(),
                     "attention_mask": torch.from_numpy(mask).cuda()}
            first = first or feeds
            run = timed(lambda: ctx.run(feeds), calls=50, warmup=5)
            entry = next(reversed(ctx.runner.entries.values()))  # the most recently used: this shape's bucket
            replay = timed(entry.graph.replay, calls=50, warmup=5) if entry.graph is not None else float("nan")
            lines.append(f"| {b}x{s} | {run:.3f} | {replay:.3f} | {run - replay:.3f} |")
            print(lines[-1], flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            ctx.run(first)
        torch.cuda.synchronize()
        prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    lines.append("\ncProfile, 200 calls at " + "x".join(str(d) for d in shapes[0]) + ":\n```\n"
                 + "\n".join(buf.getvalue().splitlines()[:45]) + "\n```")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out, "dynamic-overhead.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
