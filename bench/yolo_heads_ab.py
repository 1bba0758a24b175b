"""YOLOv5n's heads with and without fuse_conv_activation_through_layout, one process, interleaved (issue 11).

    python bench/yolo_heads_ab.py [--threads 1] [--rounds 9]

Builds bench/zoo_new_models.py's yolov5n at 416 twice: "before" with the rule taken out of the pass list (each
head's Sigmoid a step of its own after its Relayout), "after" as kiln builds it (the Sigmoid a post-op of the
head's convolution); both are checked against onnxruntime on a fresh input, then timed A B A B ... with
bench/zoo_new.py's `interleaved` (thread clock at 1 thread), with onnxruntime as the third side.
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

RULE = "fuse_conv_activation_through_layout"


def build(path: Path, with_rule: bool):
    import kiln
    from kiln.passes import fusion

    saved = list(fusion.RULES)
    if not with_rule:
        fusion.RULES[:] = [(name, rule) for name, rule in saved if name != RULE]
    try:
        return kiln.build(str(path))
    finally:
        fusion.RULES[:] = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--block-ms", type=float, default=150.0)
    args = parser.parse_args()
    args.clock = "thread" if args.threads == 1 else "wall"
    import torch

    torch.set_num_threads(args.threads)
    from zoo_new import interleaved, ort_session, relative_error
    from zoo_new_models import MODELS, export

    exported = export("yolov5n", 1)
    engines = {"before": build(exported.path, False), "after": build(exported.path, True)}
    session = ort_session(exported.path, args.threads)
    feeds = MODELS["yolov5n"].inputs(1, seed=1)
    for side, engine in engines.items():
        sigmoids = sum(s.op_type == "Sigmoid" for s in engine.program.spec.steps)
        print(f"{side}: {sigmoids} Sigmoid steps, max err vs onnxruntime "
              f"{relative_error(engine.run(feeds), session, feeds):.1e}")
    sides = {side: (lambda e=engine: e.run(feeds)) for side, engine in engines.items()}
    sides["onnxruntime"] = lambda: session.run(None, feeds)
    times, loads = interleaved(sides, args)
    med = {side: statistics.median(t) for side, t in times.items()}
    print(f"{args.threads} thread(s), {args.clock} clock, {args.rounds} rounds, load {min(loads):.1f}-{max(loads):.1f}")
    for side, ms in med.items():
        print(f"  {side:12s} {ms:.3f} ms  (rounds {min(times[side]):.3f}-{max(times[side]):.3f})")
    ratios = [a / b for a, b in zip(times["after"], times["before"])]
    print(f"  after / before {med['after'] / med['before']:.3f} (by round {min(ratios):.3f}-{max(ratios):.3f}); "
          f"after / onnxruntime {med['after'] / med['onnxruntime']:.3f}, before / onnxruntime "
          f"{med['before'] / med['onnxruntime']:.3f}")


if __name__ == "__main__":
    main()
