"""Where MobileNetV2's and EfficientNet-B0's run-to-run scatter against onnxruntime comes from (issue 11, Zen 3).

    python bench/cnn_scatter.py build mobilenet_v2 --builds 3          # fresh builds: their picks, saved engines
    python bench/cnn_scatter.py spin mobilenet_v2 ENGINE --processes 6  # libgomp's wait x one busy neighbour

`build`: `--builds` engines of the model, each built in a fresh process with no timing cache (as bench/zoo.py builds
at every run), saved under --out; prints the layers whose tactic differs between them.

`spin`: one saved engine, each configuration in its own fresh process, the configurations interleaved
(A B C ... A B C ..., `--processes` rounds): in each process kiln and onnxruntime (2 threads, the same input) in
`--rounds` alternating blocks of `--runs` calls (50 ms slept before each block: onnxruntime's pool spins after
its block). A configuration is libgomp's wait (`governed`: kiln's per-call governor, as users get it, or told
that nothing else is runnable, as on a quiet machine, with this checkout's kiln or --baseline's; or a fixed
GOMP_SPINCOUNT with the governor off) and whether a busy neighbour runs (`+hog`: one process spinning in
a loop, as another program on a 2-vCPU machine). Each process runs at nice -20 (root), the hog too: on a VM
other helpers load, their tasks then take ~1% of a core each and the two cases are "quiet" and "quiet with
one busy program". Prints per configuration the kiln / onnxruntime ratio of the block medians (p10 / p50 /
p90 over every block of every process, and the spread of the per-process medians), kiln's and onnxruntime's
own block medians, the share of kiln's calls the governor ran under the short spin, and in how many processes
the governor governed (located libgomp's count).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]  # the checkout whose kiln the children import (PYTHONPATH), --baseline aside
SETTLE_S = 0.05


def build_one(model: str, out: str) -> None:
    """A fresh build (no timing cache), saved, with its per-layer picks beside it as JSON."""
    import torch

    import kiln
    from kiln import zoo

    torch.set_num_threads(2)
    engine = kiln.build(str(zoo.export(model).path), timing_cache=None)
    engine.save(out)
    picks = {name: found["tactic"] for name, found in engine.plan.header["tactics"]["layers"].items()}
    Path(out + ".picks.json").write_text(json.dumps(picks, indent=0))


def builds(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [str(out / f"{args.model}_{i}.kiln") for i in range(args.builds)]
    for path in paths:
        subprocess.run([sys.executable, __file__, "build-child", args.model, path], check=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    picks = [json.loads(Path(p + ".picks.json").read_text()) for p in paths]
    layers = sorted(set().union(*picks))
    differ = [name for name in layers if len({p.get(name) for p in picks}) > 1]
    print(f"{args.model}: {args.builds} builds, {len(layers)} layers, {len(differ)} picked differently")
    for name in differ:
        print(f"  {name}: " + ", ".join(p.get(name, "-").removeprefix("cpu.") for p in picks))


def spin_child(model: str, engine_path: str, rounds: int, runs: int) -> None:
    """One process of `spin`: kiln and onnxruntime in alternating blocks; prints one JSON line."""
    import kiln  # noqa: I001  first: kiln/openmp.py chooses the wait policy before torch loads libgomp
    import onnxruntime as ort
    import torch

    from kiln import zoo
    from kiln.kernels.cpu import omp_governor

    torch.set_num_threads(2)
    exported = zoo.export(model)
    feeds = exported.inputs()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
    governor = omp_governor.governor()
    if os.environ.get("KILN_SCATTER_QUIET") == "1":
        governor._runnable = lambda readings=1: 1  # before the engine's load locates the count and reads
    engine = kiln.load(engine_path)
    short = [0, 0]  # kiln calls begun under the short spin, all kiln calls

    def run_kiln():
        engine.run(feeds)
        short[0] += governor.governed() is True and not governor._spinning
        short[1] += 1

    calls = {"kiln": run_kiln, "onnxruntime": lambda: session.run(None, feeds)}
    medians: dict[str, list[float]] = {k: [] for k in calls}
    for fn in calls.values():
        for _ in range(5):
            fn()
    for r in range(rounds):
        for name, fn in (list(calls.items()) if r % 2 == 0 else list(calls.items())[::-1]):
            time.sleep(SETTLE_S)
            fn(), fn()
            block = []
            for _ in range(runs):
                start = time.perf_counter()
                fn()
                block.append(time.perf_counter() - start)
            medians[name].append(1e3 * statistics.median(block))
    print(json.dumps({"medians": medians, "short_share": short[0] / max(short[1], 1),
                      "governed": governor.governed() is True, "governor": governor.describe()}))


def hog() -> subprocess.Popen:
    """A busy neighbour: one process spinning until killed."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


@contextlib.contextmanager
def session_first(nice: int = -20):
    """This session's scheduler autogroup at `nice` while the block runs, then back (where there are autogroups)."""
    path = Path("/proc/self/autogroup")
    before = path.read_text().split()[-1] if path.exists() else None
    if before is not None:
        path.write_text(str(nice))
    try:
        yield
    finally:
        if before is not None:
            path.write_text(before)


CONFIGS = {
    "governed": {},
    "governed+hog": {"hog": True},
    "governed+hog (baseline)": {"hog": True, "baseline": True},
    # the governor reading "nothing else runnable", as on a quiet machine (here the other sessions' tasks stay runnable
    # at their low weight, and it would read them): the count it sets where the team fits the free cores
    "governed quiet": {"env": {"KILN_SCATTER_QUIET": "1"}},
    "governed quiet (baseline)": {"env": {"KILN_SCATTER_QUIET": "1"}, "baseline": True},
    "spin 4000": {"env": {"KILN_OMP_GOVERN": "0", "GOMP_SPINCOUNT": "4000"}},
    "spin 4000+hog": {"env": {"KILN_OMP_GOVERN": "0", "GOMP_SPINCOUNT": "4000"}, "hog": True},
    "spin 16000": {"env": {"KILN_OMP_GOVERN": "0", "GOMP_SPINCOUNT": "16000"}},
    "spin 40000": {"env": {"KILN_OMP_GOVERN": "0", "GOMP_SPINCOUNT": "40000"}},
    "spin 100000": {"env": {"KILN_OMP_GOVERN": "0", "GOMP_SPINCOUNT": "100000"}},
    "spin 300000": {"env": {"KILN_OMP_GOVERN": "0", "GOMP_SPINCOUNT": "300000"}},
    "spin 128": {"env": {"KILN_OMP_GOVERN": "0", "GOMP_SPINCOUNT": "128"}},
    "spin 128+hog": {"env": {"KILN_OMP_GOVERN": "0", "GOMP_SPINCOUNT": "128"}, "hog": True},
}


def spin(args) -> None:
    chosen = args.configs.split(",") if args.configs else list(CONFIGS)
    if any(CONFIGS[name].get("baseline") for name in chosen) and not args.baseline:
        raise SystemExit("a '(baseline)' configuration needs --baseline CHECKOUT")
    found: dict[str, list[dict]] = {c: [] for c in chosen}
    loads = []
    for p in range(args.processes):
        for name in chosen[p % len(chosen):] + chosen[:p % len(chosen)]:
            config = CONFIGS[name]
            checkout = args.baseline if config.get("baseline") else str(ROOT)
            env = {**os.environ, "PYTHONPATH": checkout, **config.get("env", {})}
            neighbour = hog() if config.get("hog") else None
            loads.append(os.getloadavg()[0])
            try:
                done = subprocess.run([sys.executable, __file__, "spin-child", args.model,
                                       args.engine, str(args.rounds), str(args.runs)],
                                      env=env, capture_output=True, text=True, check=True)
            finally:
                if neighbour is not None:
                    neighbour.kill()
                    neighbour.wait()
            found[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"process round {p + 1}/{args.processes} done, 1-min load {os.getloadavg()[0]:.1f}", flush=True)
    from kiln.builder.timing_cache import cpu_name

    print(f"\n{args.model}, engine {args.engine}, {cpu_name()}, 2 threads, {args.processes} processes per "
          f"configuration x {args.rounds} blocks of {args.runs} calls; 1-min load {min(loads):.1f}-{max(loads):.1f}")
    print("| configuration | kiln / ort p10 | p50 | p90 | per-process medians | kiln ms p50 | ort ms p50 "
          "| short-spin share | processes governed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, results in found.items():
        per_block = [by_block(r) for r in results]
        q = np.percentile([x for blocks in per_block for x in blocks], [10, 50, 90])
        per_process = sorted(statistics.median(blocks) for blocks in per_block)
        kiln_ms = statistics.median(m for r in results for m in r["medians"]["kiln"])
        ort_ms = statistics.median(m for r in results for m in r["medians"]["onnxruntime"])
        share = statistics.mean(r["short_share"] for r in results)
        governed = sum(r["governed"] for r in results)
        print(f"| {name} | {q[0]:.2f} | {q[1]:.2f} | {q[2]:.2f} | " + ", ".join(f"{x:.2f}" for x in per_process)
              + f" | {kiln_ms:.2f} | {ort_ms:.2f} | {share:.0%} | {governed}/{len(results)} |")


def by_block(result: dict) -> list[float]:
    """kiln / onnxruntime of each round's block medians in one process."""
    return [a / b for a, b in zip(result["medians"]["kiln"], result["medians"]["onnxruntime"])]


def main() -> None:
    if sys.argv[1:2] == ["build-child"]:
        return build_one(*sys.argv[2:4])
    if sys.argv[1:2] == ["spin-child"]:
        return spin_child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    b = sub.add_parser("build")
    b.add_argument("model")
    b.add_argument("--builds", type=int, default=3)
    b.add_argument("--out", default="/tmp/cnn_scatter")
    s = sub.add_parser("spin")
    s.add_argument("model")
    s.add_argument("engine")
    s.add_argument("--processes", type=int, default=4)
    s.add_argument("--rounds", type=int, default=6)
    s.add_argument("--runs", type=int, default=20)
    s.add_argument("--configs", default="", help="comma-separated names of CONFIGS (default: all)")
    s.add_argument("--baseline", default="", help="a checkout whose kiln the '(baseline)' configurations run")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))  # the driver's own imports (kiln's cpu_name); its children import PYTHONPATH's
    if args.what == "build":
        return builds(args)
    with session_first():
        spin(args)


if __name__ == "__main__":
    main()
