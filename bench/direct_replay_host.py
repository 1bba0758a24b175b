"""Host time of run()'s replay path per call on the CPU, a stand-in graph whose replay() does nothing: what the Python
and the dispatch around a replay cost, apart from the GPU (the GPU's side: bench/jitter.py --ways direct).

    python bench/direct_replay_host.py [--calls 20000] [--rounds 7] [--out DIR]

Three ways, interleaved in rounds of --calls calls (a shared machine's load lands on all alike), tiny tensors (the
copies' own work out of the way), shaped as BERT's two int64 inputs and an fp16 engine's output handed back in fp32:
- old path:  ExecutionContext._replay_static as of ae5182c (its device check dropped for CPU tensors): checks, a
             torch.inference_mode block, a copy_ an input, replay, LRU and stats, the output cast
- direct:    StaticReplay (kiln/runtime/static_replay.py)
- floor:     the copies and replay alone (torch._foreach_copy_, replay(), the cast): no checks, no dict
And a bucketed run's inputs into its graph's (BERT's ids and mask, 4 x 100 padded to the 4 x 128 bucket):
- pad, then copy:  Buckets.pad (one F.pad an input, a new tensor) and GraphRunner.run's copy into the graph's input
- fill:            _Captured.fill (buckets.pad_to: zeros, then the input into the leading corner; nothing allocated)
Prints per way the median over rounds of each round's median and p99 per call, in µs.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from collections import OrderedDict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kiln.plan.spec import Binding  # noqa: E402
from kiln.runtime.buckets import plan_buckets  # noqa: E402
from kiln.runtime.cuda_graphs import _Captured  # noqa: E402
from kiln.runtime.host import ShapePlan  # noqa: E402
from kiln.runtime.static_replay import StaticReplay  # noqa: E402


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _old_path(names, signature, key, outputs, entries, stats):
    """ExecutionContext._replay_static at ae5182c, `not value.is_cuda` dropped (CPU tensors here)."""
    def run(feeds):
        if len(feeds) != len(names):
            return None
        entry = entries.get(key)
        if entry is None or entry.graph is None:
            return None
        values = []
        for name, (dtype, shape) in zip(names, signature):
            value = feeds.get(name)
            if type(value) is not torch.Tensor or value.dtype != dtype or value.shape != shape:
                return None
            values.append(value)
        with torch.inference_mode():
            for dst, src in zip(entry.static_inputs, values):
                dst.copy_(src)
            entry.graph.replay()
            entries.move_to_end(key)
            stats.replays += 1
            return {name: r if dtype is None else r.to(dtype) for (name, dtype), r in zip(outputs, entry.static_outputs)}
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = ["input_ids", "attention_mask"]
    signature = [(torch.int64, torch.Size([1, 8])), (torch.int64, torch.Size([1, 8]))]
    outputs = [("y", torch.float32)]
    static = [torch.zeros(1, 8, dtype=torch.int64), torch.zeros(1, 8, dtype=torch.int64)]
    entry = types.SimpleNamespace(static_inputs=static, static_outputs=[torch.zeros(1, 8, 4, dtype=torch.float16)],
                                  graph=types.SimpleNamespace(replay=lambda: None))
    stats = types.SimpleNamespace(replays=0)
    key = (((1, 8), torch.int64), ((1, 8), torch.int64))
    with torch.inference_mode():  # the old path's graph inputs: inference tensors, as GraphRunner captured them
        old_entry = types.SimpleNamespace(static_inputs=[t.clone() for t in static],
                                          static_outputs=entry.static_outputs, graph=entry.graph)
    old = _old_path(names, signature, key, outputs, OrderedDict({key: old_entry}), stats)
    direct = StaticReplay(names, signature, outputs, entry, stats, on_cuda=False)
    feeds = {"input_ids": torch.randint(0, 100, (1, 8)), "attention_mask": torch.ones(1, 8, dtype=torch.int64)}
    sources = list(feeds.values())
    replay, out = entry.graph.replay, entry.static_outputs[0]

    def floor():
        torch._foreach_copy_(static, sources)
        replay()
        return out.to(torch.float32)
    buckets = plan_buckets([Binding("input_ids", "int64", ["batch", "seq"]),
                            Binding("attention_mask", "int64", ["batch", "seq"])],
                           [Binding("y", "float", ["batch", "seq", 4])])
    targets = {"batch": (4, 4), "seq": (100, 128)}
    real = [torch.randint(0, 100, (4, 100)), torch.ones(4, 100, dtype=torch.int64)]
    captured = _Captured(entry.graph, ShapePlan(), [torch.zeros(4, 128, dtype=torch.int64) for _ in real], [])

    def pad_then_copy():
        with torch.inference_mode():
            for dst, src in zip(captured.static_inputs, buckets.pad(real, targets)):
                dst.copy_(src)

    def fill():
        with torch.inference_mode():
            captured.fill(real)
    ways = {"old path": lambda: old(feeds), "direct": lambda: direct(feeds), "floor": floor,
            "bucketed: pad, then copy": pad_then_copy, "bucketed: fill": fill}
    for fn in list(ways.values())[:3]:
        assert fn() is not None
    pad_then_copy()
    want = [t.clone() for t in captured.static_inputs]
    captured.static_inputs[0].fill_(7)  # stale values where the padding goes
    fill()
    assert all(torch.equal(a, b) for a, b in zip(captured.static_inputs, want)), "fill differs from pad, then copy"
    for fn in ways.values():
        for _ in range(2000):
            fn()
    medians: dict[str, list[float]] = {w: [] for w in ways}
    p99s: dict[str, list[float]] = {w: [] for w in ways}
    clock = time.perf_counter_ns
    for _ in range(args.rounds):
        for way, fn in ways.items():
            times = []
            for _ in range(args.calls):
                t0 = clock()
                fn()
                times.append(clock() - t0)
            times.sort()
            medians[way].append(times[len(times) // 2] / 1e3)
            p99s[way].append(times[int(0.99 * (len(times) - 1))] / 1e3)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    lines = [f"CPU {_cpu()}, {os.cpu_count()} vCPUs, load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}, "
             f"Python {platform.python_version()}, commit {commit}, {args.rounds} rounds x {args.calls} calls, µs",
             "| way | median (median of rounds) | p99 (median of rounds) | round medians min-max |", "|---|---|---|---|"]
    for way in ways:
        lines.append(f"| {way} | {statistics.median(medians[way]):.2f} | {statistics.median(p99s[way]):.2f} | "
                     f"{min(medians[way]):.2f}-{max(medians[way]):.2f} |")
    print("\n".join(lines))
    if args.out:
        Path(args.out, "direct-replay-host.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
