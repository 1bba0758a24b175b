"""What a kiln build and a loaded kiln engine hold, by kind: code pages, packed weights and arenas, the C heap
(in use and free), the engine file's pages. One model, one process per phase (as bench/memory.py).

    python bench/memory_attribution.py --model yolos_ti            # build (stages) then load + runs
    python bench/memory_attribution.py --model dcn --phase run --engine /tmp/dcn.kiln

The build phase prints, at each stage kiln.build reports and each layer of the tactic search, the resident memory
above the start by kind and the peak since the line before (VmHWM reset at every message, so kiln.build's own
measure is too: the build's peak is the lines' largest); the run phase the same after the load and after --runs
runs, with the native segments' arena bytes. The kinds are /proc/self/smaps' mappings grouped: a shared library's
pages ("code"), anonymous mappings of 2 MiB or more (packed weights, segment arenas: kiln/kernels/cpu/hugepages.py),
the C heap ([heap], with mallinfo2's in-use and free bytes), the engine file. Results:
bench/results/memory-cpu-2026-12-05b.md, bench/results/mem3-2026-12-05c.md.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MiB = 1 << 20
_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def resident_by_kind(engine_path: str | None = None) -> collections.Counter:
    """Resident bytes per kind of mapping: code (a .so), anon>=2M, anon<2M, heap, engine file, other."""
    kinds: collections.Counter = collections.Counter()
    kind = "other"
    with open("/proc/self/smaps") as f:
        for line in f:
            if _MAPPING.match(line):
                parts = line.split()
                low, high = (int(x, 16) for x in parts[0].split("-"))
                path = parts[5] if len(parts) > 5 else ""
                if engine_path and path == engine_path:
                    kind = "engine file"
                elif ".so" in path:
                    kind = "code"
                elif path == "[heap]":
                    kind = "heap"
                elif not path:
                    kind = "anon>=2M" if high - low >= 2 * MiB else "anon<2M"
                else:
                    kind = "other"
            elif line.startswith("Rss:"):
                kinds[kind] += int(line.split()[1]) * 1024
    return kinds


def heap_in_use_and_free() -> tuple[int, int]:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks, info.fordblks


def line(label: str, base: collections.Counter, engine_path: str | None = None, extra: str = "") -> str:
    now = resident_by_kind(engine_path)
    grown = {k: (now[k] - base.get(k, 0)) / MiB for k in now}
    used, free = heap_in_use_and_free()
    kinds = ", ".join(f"{k} {v:.0f}" for k, v in sorted(grown.items(), key=lambda kv: -kv[1]) if abs(v) >= 1)
    return (f"  {label[:44]:44s} +{sum(grown.values()):5.0f} MiB: {kinds}; heap in use {used / MiB:.0f}, "
            f"free {free / MiB:.0f}{extra}")


def build_phase(name: str, engine_path: str) -> None:
    import kiln
    from kiln import zoo
    from kiln.runtime.rss import PeakMemory

    path = str(zoo.export(name).path)
    base = resident_by_kind()
    start = PeakMemory.start()
    stage = [start]  # the current stage's VmHWM, reset at every message
    peaks: list[int] = []

    def say(msg: str) -> None:
        peaks.append(stage[0].peak() - start.start_rss)
        stage[0] = PeakMemory.start()
        print(line(msg, base, extra=f"; peak before it +{peaks[-1] / MiB:.0f}"), flush=True)

    engine = kiln.build(path, progress=say)
    say("built")
    weights = engine.plan.header["build_memory"]["model_weight_bytes"]
    peak = max(peaks)
    print(f"  build peak +{peak / MiB:.0f} MiB, {peak / weights:.1f}x the weights ({weights / MiB:.0f} MiB)")
    engine.save(engine_path)


def run_phase(name: str, engine_path: str, runs: int) -> None:
    import kiln
    from kiln import zoo

    feeds = zoo.export(name).inputs()
    base = resident_by_kind(engine_path)
    engine = kiln.load(engine_path)
    context = engine.create_execution_context()
    print(line("loaded", base, engine_path))
    for _ in range(runs):
        context.run(feeds)
    segments = engine.program.segments
    arenas: dict[int, int] = {}  # storage -> the most of it a segment plans into (segments share one arena)
    for segment in segments:
        for buffer in segment.buffers:
            storage = buffer.untyped_storage().data_ptr()
            arenas[storage] = max(arenas.get(storage, 0), buffer.numel() * 4)
    print(line(f"after {runs} runs", base, engine_path,
               f"; {len(segments)} segment(s), their arena(s) {sum(arenas.values()) / MiB:.1f} MiB in {len(arenas)}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--phase", choices=("both", "build", "run"), default="both")
    parser.add_argument("--engine", help="the engine file (default: built into a temporary folder)")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", choices=("build", "run"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        build_phase(args.model, args.engine) if args.child == "build" else run_phase(args.model, args.engine, args.runs)
        return
    with tempfile.TemporaryDirectory() as folder:
        engine = args.engine or os.path.join(folder, f"{args.model}.kiln")
        phases = ("build", "run") if args.phase == "both" else (args.phase,)
        for phase in phases:
            print(f"{args.model}: {phase}", flush=True)
            subprocess.run([sys.executable, __file__, "--model", args.model, "--engine", engine, "--runs",
                            str(args.runs), "--threads", str(args.threads), "--child", phase], cwd=ROOT, check=True)


if __name__ == "__main__":
    main()
