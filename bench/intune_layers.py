"""GEMM tactics in context: each FusedGemm layer's time as the network runs it vs the autotuner's time for it alone.

    python bench/intune_layers.py --model t5_small_encoder --threads 2 --rounds 20
    python bench/intune_layers.py --model bert_base --threads 1

Three builds of the model (no timing cache): the default, one without cpu.gemm.kiln_packed (oneDNN's inner
product, cpu.gemm.onednn_direct, takes its GEMMs) and one with kiln_packed as the only GEMM tactic. The three
engines then run in interleaved rounds with every native-segment call timed by the segment's own compiled loop
(kiln/runtime/profiler.py: profile_segments), so a layer's time is what it costs after the layers before it, as
the engine runs it. Per GEMM shape: each tactic's median in the network and the tuner's time alone (the engine
header's candidates: least of its rounds, by the clock the tuner used), and the whole run's median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
import torch  # noqa: E402

import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
from kiln.runtime.profiler import profile_segments  # noqa: E402
from kiln.tactics import registry  # noqa: E402

GEMMS = ("cpu.gemm.kiln_packed", "cpu.gemm.onednn_direct")
CASES = {"bert_base": {"batch": 1, "seq": 128}, "t5_small_encoder": {"batch": 1}}


def builds(path: str) -> dict[str, kiln.Engine]:
    registry.load_device("cpu")
    every = sorted(registry.all_tactics("cpu"))
    other_gemms = [t for t in every if t.startswith("cpu.gemm.") and t != GEMMS[0]]
    sets = {"default": None, "onednn": [t for t in every if t != GEMMS[0]],
            "kiln_packed": [t for t in every if t not in other_gemms]}
    engines = {}
    for label, tactics in sets.items():
        start = time.perf_counter()
        engines[label] = kiln.build(path, tactics=tactics, timing_cache=None)
        print(f"built {label} in {time.perf_counter() - start:.1f} s", flush=True)
    return engines


def gemm_shape(step, widths: dict[str, int]) -> str:
    size = step.tactic_config.get("input_size") or ["?"]
    activation = step.attributes.get("activation") or ""
    return (f"{size} -> {widths.get(step.inputs[1], '?')}" + (f" {activation}" if activation else "")
            + (" +res" if step.tactic_config.get("residual") else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="t5_small_encoder")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="in-network calls by the wall clock or the calling thread's CPU time")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.CLOCK_MONOTONIC if args.clock == "wall" else time.CLOCK_THREAD_CPUTIME_ID
    exported = zoo.export(args.model, **CASES.get(args.model, {}))
    feeds = exported.inputs()
    engines = builds(str(exported.path))
    inputs = {label: e.program_inputs(feeds) for label, e in engines.items()}
    in_network: dict[str, dict[str, list[float]]] = {label: defaultdict(list) for label in engines}
    whole: dict[str, list[float]] = {label: [] for label in engines}
    for label, e in engines.items():  # warm-up
        profile_segments(e.program, inputs[label], 3, clock)
    for _ in range(args.rounds):
        for label, e in engines.items():
            start = time.perf_counter()
            for name, ms in profile_segments(e.program, inputs[label], 1, clock).items():
                in_network[label][name] += ms
            whole[label].append(1e3 * (time.perf_counter() - start))

    # per GEMM shape and tactic: the in-network medians of its layers, and the tuner's times alone
    rows: dict[str, dict[str, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for label, e in engines.items():
        layers = e.plan.header["tactics"].get("layers", {})
        widths = {name: e.plan.weights[key].shape[0] for name, key in e.plan.program.constants.items()
                  if key in e.plan.weights and e.plan.weights[key].dim() == 2}
        for step in e.plan.program.steps:
            if step.op_type != "FusedGemm" or step.name not in in_network[label]:
                continue
            tactic = step.tactic or "default"
            cell = rows[gemm_shape(step, widths)][f"{label}: {tactic.replace('cpu.gemm.', '')}"]
            cell["network"].append(statistics.median(in_network[label][step.name]))
            alone = layers.get(step.name, {}).get("candidates", {}).get(step.tactic or "default")
            if isinstance(alone, float):
                cell["alone"].append(alone)
            cell["clock"] = layers.get(step.name, {}).get("clock")
    print(f"\n{args.model}, {args.threads} threads, {args.rounds} interleaved rounds, load average "
          f"{os.getloadavg()[0]:.2f}, in-network clock {args.clock}, KILN_POOL={os.environ.get('KILN_POOL', '(by load)')}")
    print("| GEMM [rows, K] -> N | build: tactic | layers | in network ms (median of layer medians) | alone ms (tuner) | network / alone |")
    print("|---|---|---|---|---|---|")
    for shape, by_tactic in rows.items():
        for label, cell in sorted(by_tactic.items()):
            net = statistics.median(cell["network"])
            alone = statistics.median(cell["alone"]) if cell["alone"] else float("nan")
            print(f"| {shape} | {label} | {len(cell['network'])} | {net:.3f} | {alone:.3f} ({cell['clock']}) | "
                  f"{net / alone:.2f} |")
    context = {name: layer["in_network"] for name, layer in engines["default"].plan.header["tactics"]["layers"].items()
               if "in_network" in layer}
    print(f"default build: {len(context)} layers timed in context; first of each result: "
          + "; ".join(f"{name} {times}" for name, times in {repr(t): (n, t) for n, t in context.items()}.values()))
    print("| whole run | " + " | ".join(f"{label} {statistics.median(v):.2f} ms" for label, v in whole.items()) + " |")


if __name__ == "__main__":
    main()
