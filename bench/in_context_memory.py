"""Where a build's in-context stage (kiln/builder/in_context.py) peaks: resident memory and the peak since the line
before at each of its steps (the chosen program bound, warmed up; each rival program bound, its rounds; the stage's
end), one build of one model in this process, with the tuner's choices that set what the build packs.

    TMPDIR=/dev/shm python bench/in_context_memory.py --model resnet50

The stage's steps are wrapped from outside (Program in in_context's namespace, _rounds, retime): nothing in kiln is
changed to measure. Each line: MiB above the start (after the imports), the peak since the line before, heap in use
and free (mallinfo2), mappings of 2 MiB or more (packed weights, arenas). The last lines count the chosen tactics
and the bytes of every 2 MiB+ mapping at the end (what the build keeps). Results: bench/results/mem7-2026-12-05.md.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from memory_attribution import MiB, heap_in_use_and_free, resident_by_kind  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--as-memory-py", action="store_true",
                        help="import numpy and onnxruntime first, as bench/memory.py's build child does")
    args = parser.parse_args()
    if args.as_memory_py:
        import numpy  # noqa: F401
        import onnxruntime  # noqa: F401

    import torch

    torch.set_num_threads(args.threads)
    import kiln
    from kiln import zoo
    from kiln.builder import in_context
    from kiln.runtime.rss import PeakMemory

    path = str(zoo.export(args.model).path)
    base = resident_by_kind()
    start = PeakMemory.start()
    stage = [start]
    peaks: list[int] = []

    def say(msg: str) -> None:
        peaks.append(stage[0].peak() - start.start_rss)
        stage[0] = PeakMemory.start()
        now = resident_by_kind()
        grown = sum(now.values()) - sum(base.values())
        used, free = heap_in_use_and_free()
        print(f"  {msg[:52]:52s} +{grown / MiB:5.0f} MiB, peak before it +{peaks[-1] / MiB:4.0f}; heap in use "
              f"{used / MiB:.0f}, free {free / MiB:.0f}; " + ", ".join(
                  f"{kind} {(now[kind] - base[kind]) / MiB:.0f}" for kind in ("anon>=2M", "heap", "other")), flush=True)

    program_class, rounds, retime = in_context.Program, in_context._rounds, in_context.retime

    def bound(*a, **k):
        program = program_class(*a, **k)
        chosen = k.get("turns_with")
        shared = sum(s in chosen.segments for s in program.segments) if chosen is not None else 0
        say(f"in context: a program bound ({len(program.segments)} segments, {shared} the chosen one's)")
        return program

    def timed(programs, *a, **k):
        found = rounds(programs, *a, **k)
        say("in context: a signature's rounds")
        return found

    def whole(*a, **k):
        say("in context: start")
        found = retime(*a, **k)
        say("in context: end")
        return found

    in_context.Program, in_context._rounds, in_context.retime = bound, timed, whole
    engine = kiln.build(path, progress=lambda msg: say(msg) if not msg.startswith("tactics: ") or "/" not in
                        msg.split()[1] else None)
    say("built")
    weights = engine.plan.header["build_memory"]["model_weight_bytes"]
    print(f"  build peak +{max(peaks) / MiB:.0f} MiB, {max(peaks) / weights:.2f}x the weights ({weights / MiB:.0f} MiB)")
    tactics = collections.Counter(step.tactic or "default" for step in engine.plan.program.steps)
    print("  tactics: " + ", ".join(f"{name} x{n}" for name, n in tactics.most_common()))


if __name__ == "__main__":
    main()
