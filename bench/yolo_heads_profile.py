"""Where YOLOv5n's detection heads spend their time in kiln: each head step's ms a call (issue 11).

    python bench/yolo_heads_profile.py [--threads 1] [--repeats 3]

Builds bench/zoo_new_models.py's yolov5n at 416 and times every member of its native segments with
kiln/runtime/profiler.py's profile_segments (the engine's own loop, 7 runs each, medians); prints the steps from
the first head convolution (the weights named heads.*) to the output Concat: per scale the 1x1 convolution to
3 x 85 channels, the Relayout to [1, 3·H·W, 85], the Sigmoid, then the Concat of the three scales.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    import kiln
    from kiln.runtime.profiler import profile_segments
    from zoo_new_models import MODELS, export

    engine = kiln.build(str(export("yolov5n", 1).path))
    feeds = MODELS["yolov5n"].inputs(1, seed=1)
    steps = engine.program.spec.steps
    first = next(i for i, s in enumerate(steps) if any(str(n).startswith("heads.") for n in s.inputs))
    heads = steps[first:]
    for repeat in range(args.repeats):
        ms = profile_segments(engine.program, engine.program_inputs(feeds), runs=7)
        total = sum(statistics.median(v) for v in ms.values())
        print(f"repeat {repeat}: all segment members {total:.3f} ms, load {os.getloadavg()[0]:.1f}")
        for s in heads:
            took = f"{statistics.median(ms[s.name]):.3f}" if s.name in ms else "(outside)"
            print(f"  {took:>9} ms  {s.op_type:10s} {s.tactic:24s} {s.name}")
        head_total = sum(statistics.median(ms[s.name]) for s in heads if s.name in ms)
        print(f"  {head_total:.3f} ms the heads in all")


if __name__ == "__main__":
    main()
