"""Peak memory of kiln and onnxruntime on the zoo, each phase in a process of its own.

    python bench/memory.py                                    # resnet50, bert_base, albert_base, mobilenet_v2
    python bench/memory.py --models albert_tiny,resnet_tiny --runs 5 --no-write
    python bench/memory.py --zoo full                         # bench/zoo.py's architectures, full sizes (or ci)

Per model, three child processes start from the same imports (torch, onnxruntime, kiln) and report the
growth of their resident memory over what they held after importing (VmHWM reset at each phase,
kiln/runtime/rss.py):

- kiln build: kiln.build on the ONNX file (import, passes, tactic search, the engine's load), saved;
- kiln run: kiln.load of that engine, then --runs runs of the zoo's example input;
- onnxruntime: InferenceSession (CPU, ORT_ENABLE_ALL, same threads), then the same runs.

"load" is what a runtime holds once ready (weights, packed copies, the libraries it loads on first
use); "runs" the peak above that during the runs (activations, arenas, scratch); "total" the peak over
both, the number a deployment sizes for. "of it engine file": the engine file's pages resident after the
runs, weights read where they lie (an embedding table's Gather): kiln.load lets them go once packed copies
are made, and a run maps back what it reads; the kernel maps 64 KiB around each page a read faults in
(fault-around), so a Gather of a few thousand random rows brings back nearly a whole table (DCN: 317 MiB),
in the first run, and no more after it. The model's weight bytes (its initializers) are the unit the
issue states its build target in (<= 3x). Writes bench/results/memory-<date>.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from cpu import commit  # noqa: E402  bench/cpu.py

RESULTS = ROOT / "bench" / "results"
MiB = 1 << 20

# One child: `phase` is build | kiln | onnxruntime. Prints one JSON line.
_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import onnxruntime as ort
    import torch
    import kiln
    from kiln import zoo
    from kiln.runtime.rss import PeakMemory, resident_bytes

    def mapped_bytes(path):  # what of the file at `path` is resident here: its mappings' Rss in /proc/self/smaps
        total, mine = 0, False
        for line in open("/proc/self/smaps"):
            if line[0] in "0123456789abcdef" and " " in line and "-" in line.split()[0]:
                mine = line.rstrip().endswith(path)
            elif mine and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
        return total

    phase, name, engine_path, runs, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    torch.set_num_threads(threads)
    exported = zoo.export(name)
    feeds = exported.inputs()
    report = {"imported_rss": resident_bytes()}
    if phase == "build":
        peak = PeakMemory.start()
        engine = kiln.build(str(exported.path))
        report["build"] = peak.delta()
        report["weights"] = engine.plan.header["build_memory"]["model_weight_bytes"]
        report["engine_weights"] = engine.plan.header["weights_bytes"]
        report["in_context"] = engine.plan.header["tactics"].get("in_context")
        engine.save(engine_path)
    else:
        base = resident_bytes()
        peak = PeakMemory.start()
        if phase == "kiln":
            engine = kiln.load(engine_path)
            context = engine.create_execution_context()
            run = lambda: context.run(feeds)
        else:
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
            run = lambda: session.run(None, feeds)
        report["load"] = peak.delta()
        loaded = resident_bytes()
        peak = PeakMemory.start()
        for _ in range(runs):
            run()
        report["runs"] = max(peak.peak() - loaded, 0)
        report["total"] = max(peak.peak(), base + report["load"]) - base
        report["file_pages"] = mapped_bytes(engine_path) if phase == "kiln" else 0
    print(json.dumps(report))
""")


def run_script(code: str, args: list[str], root: Path = ROOT, label: str = "", timeout: float = 1800) -> dict:
    """`code` in a process of its own, importing kiln from `root` (a checkout of another commit: an A/B); the JSON
    object its last line of output prints."""
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=root,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(root)})
    if done.returncode != 0:
        why = done.stderr.strip().splitlines()[-1] if done.stderr else str(done.returncode)
        raise RuntimeError(f"{label}: {why}" if label else why)
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(phase: str, name: str, engine_path: str, runs: int, threads: int, root: Path = ROOT) -> dict:
    """One phase in a process of its own, importing kiln from `root` (a checkout of another commit: an A/B)."""
    return run_script(_CHILD, [phase, name, engine_path, str(runs), str(threads)], root, f"{phase} {name}", 3600)


def mib(v: int | None) -> str:
    return "-" if v is None else f"{v / MiB:.0f}"


def measure(name: str, args, folder: str) -> list[str]:
    from kiln import zoo

    zoo.export(name)  # exported (or found) here: the export's memory is no runtime's
    engine_path = str(Path(folder) / f"{name}.kiln")
    built = child("build", name, engine_path, args.runs, args.threads)
    kiln_run = child("kiln", name, engine_path, args.runs, args.threads)
    ort_run = child("onnxruntime", name, engine_path, args.runs, args.threads)
    weights = built["weights"]
    row = [name, mib(weights), f"{mib(built['build'])} ({built['build'] / weights:.1f}x)",
           mib(kiln_run["load"]), mib(kiln_run["runs"]), mib(kiln_run["total"]), mib(kiln_run["file_pages"]),
           mib(ort_run["load"]), mib(ort_run["runs"]), mib(ort_run["total"]),
           f"**{kiln_run['total'] / max(ort_run['total'], 1):.2f}x**"]
    print("  " + " | ".join(row), flush=True)
    return row


def zoo_names(size: str) -> list[str]:
    from zoo import ARCHITECTURES  # bench/zoo.py

    return [a.full if size == "full" else a.ci for a in ARCHITECTURES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,bert_base,albert_base,mobilenet_v2")
    parser.add_argument("--zoo", choices=("ci", "full"), help="every architecture of bench/zoo.py instead of --models")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    from kiln.builder.timing_cache import cpu_name

    header = ["model", "weights MiB", "kiln build MiB (x weights)", "kiln load", "kiln runs", "kiln total",
              "of it engine file",
              "ort load", "ort runs", "ort total", "kiln / ort total"]
    rows = []
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as folder:
        for name in zoo_names(args.zoo) if args.zoo else args.models.split(","):
            try:
                rows.append(measure(name.strip(), args, folder))
            except Exception as e:  # noqa: BLE001  a failing model is a row saying how
                rows.append([name, f"failed: {e}"] + [""] * (len(header) - 2))
                print(f"  {name}: failed: {e}", flush=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [f"Peak memory, kiln vs onnxruntime, {now:%Y-%m-%d %H:%M} UTC", "",
             f"- device: {cpu_name()}, {args.threads} threads; commit {commit()}; 1-min load average {load:.1f} "
             f"on {os.cpu_count()} cores",
             f"- each phase in its own process, peak RSS growth over the process after its imports (MiB); runs: "
             f"{args.runs} runs of the zoo's example input; 'runs' is the peak above the loaded runtime, 'total' "
             "the peak over load and runs", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header),
             *["| " + " | ".join(r) + " |" for r in rows], ""]
    print("\n".join(lines))
    if not args.no_write:
        path = RESULTS / f"memory-{now:%Y-%m-%d}.md"
        earlier = path.read_text() if path.exists() else ""
        path.write_text(earlier + ("\n## " if earlier else "# ") + "\n".join(lines) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
