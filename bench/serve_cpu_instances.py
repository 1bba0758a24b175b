"""kiln serve with `instance_group { count: 2 kind: KIND_CPU }` at 1 OpenMP thread an instance, against one instance
at 1 and at 2 threads, under `kiln perf` at concurrency 2 (no dynamic batching: each request its own engine call).

    python bench/serve_cpu_instances.py /tmp/kiln-bench-engines/mobilenet_v2.kiln --rounds 2

Each configuration is a `kiln serve` of its own (OMP_NUM_THREADS = its threads an instance: oneDNN fixes a kernel's
thread count at load) over a repository holding the engine, alternating round by round. Per row: kiln perf's
inferences/s and p50 latency, and the server's own CPU (its process's, all threads) per request it answered meanwhile
(kiln perf's warm-up included). On a
machine other work shares, read the CPU per request and bench/contexts_at_once.py's blocked shares, not the wall.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {"1 instance x 1 thread": (1, 1), "1 instance x 2 threads": (1, 2), "2 instances x 1 thread": (2, 1)}


def repository(engine: Path, instances: int, folder: Path) -> Path:
    version = folder / "model" / "1"
    version.mkdir(parents=True)
    (version / "model.kiln").symlink_to(engine)
    (folder / "model" / "config.pbtxt").write_text(
        f"max_batch_size: 0\ninstance_group [{{ count: {instances} kind: KIND_CPU }}]\n")
    return folder


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def served(port: int) -> int:
    """Requests the model has answered so far (its statistics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/model/stats", timeout=30) as answer:
        return int(json.loads(answer.read())["model_stats"][0]["inference_count"])


def serve_and_measure(engine: Path, instances: int, threads: int, window_ms: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        root = repository(engine, instances, Path(folder))
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        server = subprocess.Popen([sys.executable, "-m", "kiln", "serve", str(root), "--http-port", "0",
                                   "--grpc-port", "-1", "--metrics-port", "-1"], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            port = None
            for line in server.stdout:
                found = re.match(r"kiln serve: HTTP on [^:]+:(\d+)", line)
                port = int(found.group(1)) if found else port
                if line.strip() == "kiln serve: ready":
                    break
            before, answered = cpu_s(server.pid), served(port)
            perf = subprocess.run([sys.executable, "-m", "kiln", "perf", "-m", "model", "-u", f"127.0.0.1:{port}",
                                   "--concurrency", "2", "--measurement-interval", str(window_ms), "--warmup", "3"],
                                  cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                                  check=True).stdout
            spent, answered = cpu_s(server.pid) - before, served(port) - answered
        finally:
            server.terminate()
            server.wait(60)
    row = next(line for line in perf.splitlines() if line.split()[:1] == ["2"])  # concurrency infer/s p50 ms ...
    infer_s, p50_ms = (float(x) for x in row.split()[1:3])
    return {"perf": row.strip(), "infer_s": infer_s, "p50_ms": p50_ms, "cpu_ms": 1e3 * spent / answered,
            "load": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window-ms", type=int, default=8000)
    args = parser.parse_args()
    found: dict[str, list[dict]] = {config: [] for config in CONFIGS}
    for _ in range(args.rounds):
        for config, (instances, threads) in CONFIGS.items():
            found[config].append(serve_and_measure(args.engine.resolve(), instances, threads, args.window_ms))
            print(config, found[config][-1]["perf"], flush=True)
    print(f"\n{args.engine.name}, kiln perf concurrency 2 over HTTP, medians of {args.rounds} rounds\n\n"
          "| run | infer/s | p50 ms | server CPU ms a request | load |\n|---|---|---|---|---|")
    for config, rows in found.items():
        print(f"| {config} | " + " | ".join(f"{statistics.median(r[key] for r in rows):.{digits}f}" for key, digits
                                              in (("infer_s", 2), ("p50_ms", 1), ("cpu_ms", 1), ("load", 1))) + " |")


if __name__ == "__main__":
    main()
