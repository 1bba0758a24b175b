"""What the cpu.conv.onednn_graph candidates of a tactic search leave behind: heap in use and RSS after each
candidate of ResNet-50's 3x3 convolutions is compiled, run and dropped, as the search does; A/B of two checkouts.

    git archive BASE | tar -x -C /tmp/base
    python bench/graph_conv_memory.py --before /tmp/base --layers 16

Each checkout in a process of its own (the same imports first); the candidates are GraphConv layers
(kiln/kernels/cpu/conv_graph.py) made for ResNet-50's 3x3 layer shapes in network order, each run once and
dropped, the heap's free pages given back after each (malloc_trim, as the search does). "heap in use" is
mallinfo2's allocated bytes (what is still referenced); RSS also counts code and free heap blocks below the top.
Prints one row per checkout: the growth from after the first candidate (a warm-up that loads the fusion code) to
after the last, in all and per candidate. Results: bench/results/mem6-2026-12-05.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from memory import run_script  # noqa: E402  bench/memory.py
MiB = 1 << 20

# ResNet-50's 3x3 convolutions at batch 1: (channels, input side, stride), network order (3, 4, 6, 3 blocks).
_LAYERS = [(64, 56, 1)] * 3 + [(128, 56, 2)] + [(128, 28, 1)] * 3 + [(256, 28, 2)] + [(256, 14, 1)] * 5 + \
    [(512, 14, 2)] + [(512, 7, 1)] * 2

_CHILD = textwrap.dedent("""
    import ctypes, gc, json, sys
    import torch
    from kiln.kernels.cpu.conv_graph import GraphConv
    from kiln.runtime.rss import return_free_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2

    def heap_in_use():
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd

    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024

    torch.set_num_threads(int(sys.argv[2]))
    layers = json.loads(sys.argv[1])
    generator = torch.Generator().manual_seed(0)
    points = []
    for channels, side, stride in layers:
        w = torch.randn(channels, channels, 3, 3, generator=generator) * 0.05
        b = torch.randn(channels, generator=generator)
        layer = GraphConv(w, b, [1, 1], [stride, stride], [1, 1], 1, "Relu", 0.0, 0.0, False,
                          [1, channels, side, side], False)
        layer(torch.randn(1, channels, side, side, generator=generator))
        del layer, w, b
        gc.collect()
        return_free_memory()  # as the search does after each layer (kiln/builder/autotune.py)
        points.append((heap_in_use(), rss()))
    weights = sum(c * c * 9 * 4 for c, _s, _t in layers[1:])
    print(json.dumps({"points": points, "weights": weights}))
""")


def child(root: Path, layers: list, threads: int) -> dict:
    return run_script(_CHILD, [json.dumps(layers), str(threads)], root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="the A checkout (B: this one)")
    parser.add_argument("--layers", type=int, default=len(_LAYERS), help=f"candidates, at most {len(_LAYERS)}")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from kiln.builder.timing_cache import cpu_name

    layers = _LAYERS[:args.layers]
    roots = ([("A", args.before.resolve())] if args.before else []) + [("B", ROOT)]
    print(f"{cpu_name()}, {args.threads} thread(s); {len(layers)} onednn_graph candidates of ResNet-50's 3x3 layers, "
          "each compiled, run once and dropped; growth after the first (MiB)\n")
    header = ["checkout", "their weights", "heap in use", "per candidate", "RSS", "per candidate"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for label, root in roots:
        report = child(root, layers, args.threads)
        (heap0, rss0), (heap1, rss1) = report["points"][0], report["points"][-1]
        n = max(len(layers) - 1, 1)
        print(f"| {label} {root} | {report['weights'] / MiB:.1f} | +{(heap1 - heap0) / MiB:.1f} | "
              f"{(heap1 - heap0) / n / MiB:.2f} | +{(rss1 - rss0) / MiB:.1f} | {(rss1 - rss0) / n / MiB:.2f} |",
              flush=True)


if __name__ == "__main__":
    main()
