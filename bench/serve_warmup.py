"""A CPU model's first requests through `kiln serve`, with and without the warm-up at load (issues 10 and 14).

    python bench/serve_warmup.py                                    # bert_tiny and resnet_tiny, off / 0.5 s / 2 s
    python bench/serve_warmup.py --models bert_tiny --rounds 5 --requests 40

Each zoo model is exported with symbolic batch (and seq), built for the CPU (kiln's default profile) and saved
into a repository (max_batch_size 0: each request its own engine call at its own shape; one instance). Per round
and per `--warm-up` value, interleaved (off, 0.5, 2, off, ...), a fresh `kiln serve` subprocess loads it; we time
Popen -> "ready" (the load, warm-up included) and read /stats' warm_up; then a random shape stream through
tritonclient's HTTP client (the same stream for every mode of a round: batch 1-8, seq 1-128, each shape new),
sent once (each shape's first call: binding it, or padded in a warmed host), then again (repeats). Wall-clock
latency at the client (medians, p90, worst) and the server process's CPU time per request over each pass (what
the machine's load moves least); the machine is shared (load average printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu import commit  # noqa: E402
from dynamic import _cpu_name  # noqa: E402
from serve import _start, process_tree_cpu_s  # noqa: E402 - kiln serve on free ports, once it says ready

CONFIG = 'max_batch_size: 0\ninstance_group [{ count: 1 kind: KIND_CPU }]\n'


def write_repository(root: Path, models: list[str]) -> None:
    import kiln
    from kiln import zoo

    for name in models:
        exported = zoo.export(name, batch=2, seq=16, dynamic=True)
        (root / name / "1").mkdir(parents=True)
        kiln.build(str(exported.path), device="cpu", precision="fp32").save(root / name / "1" / "model.kiln")
        (root / name / "config.pbtxt").write_text(CONFIG)


def shape_stream(name: str, count: int, seed: int) -> list[tuple[int, int]]:
    """`count` distinct (batch, seq) shapes in random order (seq 0 for image models: one dim varies)."""
    from kiln import zoo

    rng = np.random.default_rng(seed)
    image = zoo.get(name).kind == "image"
    shapes: list[tuple[int, int]] = []
    while len(shapes) < min(count, 8 if image else 8 * 128):
        shape = (int(rng.integers(1, 9)), 0 if image else int(rng.integers(1, 129)))
        if shape not in shapes:
            shapes.append(shape)
    return shapes


def run_mode(root: Path, name: str, mode: str, shapes: list[tuple[int, int]], seed: int) -> dict:
    import tritonclient.http as httpclient

    from kiln import zoo

    model = zoo.get(name)
    start = time.perf_counter()
    process, ports = _start(root, 0, None, extra=("--warm-up", mode, "--load-model", name,
                                                   "--model-control-mode", "explicit"))
    ready_s = time.perf_counter() - start
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['HTTP']}/v2/models/{name}/stats", timeout=30) as r:
            warm = json.loads(r.read())["model_stats"][0].get("warm_up", [])
        client = httpclient.InferenceServerClient(f"127.0.0.1:{ports['HTTP']}")
        requests = []
        for k, (batch, seq) in enumerate(shapes):
            inputs = zoo.make_inputs(model, batch=batch, seq=seq, seed=seed + k)
            request = []
            for key, value in inputs.items():
                tensor = httpclient.InferInput(key, list(value.shape), "INT64" if value.dtype == np.int64 else "FP32")
                tensor.set_data_from_numpy(value)
                request.append(tensor)
            requests.append(request)
        passes = {}
        for label in ("first", "repeat"):  # every shape's first call, then every shape again
            times, cpu0 = [], process_tree_cpu_s(process.pid)
            for request in requests:
                t0 = time.perf_counter()
                client.infer(name, request)
                times.append((time.perf_counter() - t0) * 1e3)
            passes[label] = times
            passes[label + "_cpu_ms"] = (process_tree_cpu_s(process.pid) - cpu0) * 1e3 / len(requests)
        client.close()
    finally:
        process.terminate()
        process.wait(timeout=30)
    return {"ready_s": ready_s, "warm": warm, **passes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["bert_tiny", "resnet_tiny"])
    ap.add_argument("--modes", nargs="+", default=["false", "0.5", "2"], help="kiln serve --warm-up values")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=30, help="new shapes per stream (image models: at most 8)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        write_repository(root, args.models)
        results: dict[tuple[str, str], list[dict]] = {}
        loads = []
        for r in range(args.rounds):
            for name in args.models:
                shapes = shape_stream(name, args.requests, seed=100 + r)
                for mode in args.modes:
                    results.setdefault((name, mode), []).append(run_mode(root, name, mode, shapes, seed=1000 * r))
                    loads.append(os.getloadavg()[0])
    print(f"# kiln serve warm-up: first requests at new shapes, HTTP (tritonclient), cpu ({_cpu_name()}), "
          f"commit {commit()}, {time.strftime('%Y-%m-%d')}, {args.rounds} rounds x {args.requests} shapes, "
          f"load average {min(loads):.1f}-{max(loads):.1f}")
    print("\n| model | --warm-up | load to ready s (median) | warm-up s per instance (median) | shapes bound | "
          "first request ms median | p90 | worst | repeat ms median | server CPU ms / first request | "
          "/ repeat |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (name, mode), runs in results.items():
        first = [t for run in runs for t in run["first"]]
        repeat = [t for run in runs for t in run["repeat"]]
        warm = [w for run in runs for w in run["warm"]]
        warm_s = f"{statistics.median(w['seconds'] for w in warm):.2f}" if warm else "-"
        bound = f"{min(w['bound'] for w in warm)}-{max(w['bound'] for w in warm)}" if warm else "-"
        f50, r50 = statistics.median(first), statistics.median(repeat)
        f_cpu = statistics.median(run["first_cpu_ms"] for run in runs)
        r_cpu = statistics.median(run["repeat_cpu_ms"] for run in runs)
        print(f"| {name} | {mode} | {statistics.median(run['ready_s'] for run in runs):.2f} | {warm_s} | {bound} | "
              f"{f50:.2f} | {np.percentile(first, 90):.2f} | {max(first):.2f} | {r50:.2f} | {f_cpu:.2f} | {r_cpu:.2f} |")


if __name__ == "__main__":
    main()
