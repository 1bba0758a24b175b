"""Peak memory of kiln's ONNX import alone (kiln/frontend/onnx.py load, then the build's _own_weights), two checkouts
A/B, each in a process of its own.

    git archive BASE | tar -x -C /tmp/base
    python bench/import_memory.py --before /tmp/base --models resnet50,mobilenet_v2

The child imports onnxruntime, torch, kiln and kiln's frontend and builder first (the build's lazy imports, ~40 MiB,
are not the import's), then reports the peak RSS growth of the import over that (VmHWM reset, kiln/runtime/rss.py)
and what is held after it, in MiB and as a multiple of the model's weights. Results: bench/results/mem6-2026-12-05.md.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from memory import run_script  # noqa: E402  bench/memory.py

_CHILD = textwrap.dedent("""
    import json, sys
    import onnxruntime, torch, kiln
    from kiln import zoo
    from kiln.builder import build
    from kiln.frontend import onnx as onnx_frontend
    from kiln.runtime.rss import PeakMemory, resident_bytes, return_free_memory

    path = str(zoo.export(sys.argv[1]).path)
    return_free_memory()
    peak = PeakMemory.start()
    graph = onnx_frontend.load(path)
    weights = build._weight_bytes(graph)
    build._own_weights(graph)
    return_free_memory()
    print(json.dumps({"weights": weights, "peak": peak.delta(), "held": resident_bytes() - peak.start_rss}))
""")


def child(root: Path, name: str) -> dict:
    return run_script(_CHILD, [name], root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="the A checkout (B: this one)")
    parser.add_argument("--models", default="resnet50,mobilenet_v2")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from kiln.builder.timing_cache import cpu_name

    roots = ([("A", args.before.resolve())] if args.before else []) + [("B", ROOT)]
    print(f"{cpu_name()}; the import's peak RSS growth and what it holds after, MiB (x the weights)\n")
    labels = [label for label, _ in roots]
    header = ["model", "weights MiB"] + [f"{label} peak" for label in labels] + [f"{label} held" for label in labels]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    mib = 1 << 20
    for name in args.models.split(","):
        reports = [child(root, name) for _, root in roots]
        weights = reports[0]["weights"]
        cells = [name, f"{weights / mib:.1f}"]
        cells += [f"{r['peak'] / mib:.0f} ({r['peak'] / weights:.2f}x)" for r in reports]
        cells += [f"{r['held'] / mib:.0f}" for r in reports]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
