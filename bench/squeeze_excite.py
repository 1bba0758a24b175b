"""EfficientNet / MobileNet blocks on the CPU before and after the squeeze-excitation fusion, vs onnxruntime.

    python bench/squeeze_excite.py                       # efficientnet_b0 and mobilenet_v2, batch 1
    python bench/squeeze_excite.py --models efficientnet_tiny --rounds 3 --no-write

One process, one input, the same thread count for every runtime: kiln as built today ("after"), kiln
built without the rules fuse_squeeze_excite and global_average_pool ("before": the SE blocks as four
layers, the head's ceil-mode AveragePool as a pooling), and onnxruntime (ORT_ENABLE_ALL). Both kiln
engines share one timing cache, so the layers they have in common get the same tactics and the difference
is the fusion's. Outputs are checked against onnxruntime first. Timed in interleaved rounds of blocks
(before, after, onnxruntime, before, ...; blocks, not alternating calls: see kiln/zoo/timing.py); the
latency is the median of every run, and each round's after / onnxruntime and after / before ratios are
printed too, with the machine's load. MobileNetV2 has no SE block: its two kiln engines are the same
graph, a check of the noise. Writes bench/results/squeeze-excite-<date>.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from cpu import commit, wait_for_quiet  # noqa: E402  bench/cpu.py

import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.passes import fusion  # noqa: E402
from kiln.runtime.native import Segment  # noqa: E402
from kiln.zoo.timing import peer_runners, time_samples  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PEERS = ("kiln before", "kiln after", "onnxruntime")
NEW_RULES = ("fuse_squeeze_excite", "global_average_pool")


def build_without_new_rules(path: str, cache: str) -> kiln.Engine:
    saved = list(fusion.RULES)
    fusion.RULES[:] = [(n, r) for n, r in saved if n not in NEW_RULES]
    try:
        return kiln.build(path, timing_cache=cache)
    finally:
        fusion.RULES[:] = saved


def structure(engine: kiln.Engine) -> str:
    steps = engine.program.run_steps
    segments = [s.fn for s in steps if isinstance(s.fn, Segment)]
    ops = [s.op_type for s in engine.plan.program.steps]
    return (f"{len(ops)} layers ({ops.count('SqueezeExcite')} SqueezeExcite), {len(steps)} run steps, "
            f"{len(segments)} native segment(s) of {[len(s.members) for s in segments]} layers")


def run_model(name: str, args, cache: str) -> list[str]:
    import torch

    torch.set_num_threads(args.threads)
    exported = zoo.export(name, batch=args.batch)
    feeds = exported.inputs()
    start = time.perf_counter()
    after = kiln.build(str(exported.path), timing_cache=cache)
    built_after = time.perf_counter() - start
    start = time.perf_counter()
    before = build_without_new_rules(str(exported.path), cache)
    built_before = time.perf_counter() - start
    runners = peer_runners(name, exported.path, feeds, threads=args.threads, engine=after)
    runners = {"kiln before": lambda: before.run(feeds), "kiln after": runners["kiln"],
               "onnxruntime": runners["onnxruntime"]}
    want = runners["onnxruntime"]()
    errors = {}
    for peer in ("kiln before", "kiln after"):
        got = runners[peer]()
        errors[peer] = max(float(np.abs(got[n] - w).max()) / max(1.0, float(np.abs(w).max()))
                           for n, w in zip(after.output_names, want))
    samples: dict[str, list[float]] = {p: [] for p in PEERS}
    by_round = []
    for _ in range(args.rounds):
        medians = {}
        for peer in PEERS:
            wait_for_quiet(args.quiet_wait)
            block = time_samples(runners[peer], iterations=args.iterations, warmup=args.warmup,
                                 budget_s=args.budget / len(PEERS) / args.rounds, min_runs=5)
            samples[peer] += block
            medians[peer] = float(np.median(block))
        by_round.append((medians["kiln after"] / medians["onnxruntime"], medians["kiln after"] / medians["kiln before"],
                         os.getloadavg()[0]))
    median = {p: float(np.median(v)) for p, v in samples.items()}
    lines = [
        f"### {name} ({', '.join(f'{k} {list(v.shape)}' for k, v in feeds.items())})", "",
        f"- before: {structure(before)}; built in {built_before:.0f} s; max err vs onnxruntime "
        f"{errors['kiln before']:.1e}",
        f"- after: {structure(after)}; built in {built_after:.0f} s; max err vs onnxruntime {errors['kiln after']:.1e}",
        "",
        "| kiln before ms | kiln after ms | onnxruntime ms | after / ort | before / ort | after / before | runs |",
        "|---|---|---|---|---|---|---|",
        f"| {median['kiln before']:.3f} | {median['kiln after']:.3f} | {median['onnxruntime']:.3f} | "
        f"**{median['kiln after'] / median['onnxruntime']:.2f}x** | "
        f"{median['kiln before'] / median['onnxruntime']:.2f}x | {median['kiln after'] / median['kiln before']:.2f}x | "
        f"{'/'.join(str(len(samples[p])) for p in PEERS)} |",
        "",
        "by round (after / ort, after / before, 1-min load average): "
        + "; ".join(f"{a:.2f}, {b:.2f}, load {c:.1f}" for a, b, c in by_round),
        "",
    ]
    print("\n".join(lines), flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="efficientnet_b0,mobilenet_v2")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=100, help="runs per block at most")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--budget", type=float, default=60.0, help="seconds of timed blocks per model at most")
    parser.add_argument("--quiet-wait", type=float, default=0.0)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    import torch

    load = os.getloadavg()[0]
    head = [f"squeeze-excitation fusion on the CPU, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            "", f"- device: {cpu_name()} ({torch.backends.cpu.get_cpu_capability()}), {args.threads} threads for every "
            f"runtime, fp32, batch {args.batch}; commit {commit()}",
            f"- 1-min load average {load:.2f} at the start on {os.cpu_count()} cores (a shared machine: other "
            "engineers' jobs run beside this one)",
            f"- {args.rounds} interleaved rounds of blocks (before, after, onnxruntime), each {args.warmup} warm-up runs "
            f"then up to {args.iterations} runs; latency: the median of every run", ""]
    print("\n".join(head), flush=True)
    lines = list(head)
    with tempfile.TemporaryDirectory() as folder:
        cache = str(Path(folder) / "timing.json")
        for name in args.models.split(","):
            lines += run_model(name.strip(), args, cache)
    if not args.no_write:
        path = RESULTS / f"squeeze-excite-{datetime.date.today():%Y-%m-%d}.md"
        earlier = path.read_text() if path.exists() else ""
        path.write_text(earlier + ("\n## " if earlier else "# ") + "\n".join(lines) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
