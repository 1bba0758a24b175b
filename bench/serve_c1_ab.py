"""kiln serve's gRPC request at concurrency 1 over a loopback socket, old tree against new, interleaved: per round,
each tree's `kiln serve` of the empty model (y = Identity(x), FP32 [1, 4], dynamic batching on; the repository of
bench/serve_overhead.py) is called by three clients in turn, each for a fixed window, one call after another:

- h2: bench/serve_overhead_client.py's HTTP/2 frames encoded once (~20 us of client CPU a call: the server's
  share),
- tritonclient: tritonclient.grpc's blocking client (what users run; ~200 us of client CPU a call),
- wire: `kiln perf --client wire` (kiln's own load generator, every answer checked against its request).

For each: the server's CPU per request from /proc (utime + stime of all its threads over the client's run, split
user / system, over the requests the server says it answered: its statistics' inference count, read over HTTP before
and after, so that a client's own warm-up and set-up calls are counted too), the loop thread's context switches per
request (voluntary: it slept in epoll; involuntary: preempted), and the client's p50 / p99. Medians over rounds
per tree and client, and the ratio of each tree's median to the first tree's.

    python bench/serve_c1_ab.py --trees /tmp/base . --rounds 5 --seconds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import _start  # noqa: E402 - bench/serve.py's server start (ports read from its log)
from serve_overhead import MODELS, _cpu_model, _write_repository  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
CLIENTS = ("h2", "tritonclient", "wire")


def _server_times(pid: int) -> tuple[float, float, int, int]:
    """(user s, system s) of every thread of the process; the loop (main) thread's voluntary and involuntary
    context switches."""
    user = system = 0.0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # a thread gone meanwhile
            continue
        user += int(fields[11]) / TICK
        system += int(fields[12]) / TICK
    switches = {}
    with open(f"/proc/{pid}/task/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.endswith("ctxt_switches"):
                switches[key] = int(value)
    return user, system, switches["voluntary_ctxt_switches"], switches["nonvoluntary_ctxt_switches"]


def _answered(port: int) -> int:
    """The empty model's inference count so far (kiln serve's statistics, over HTTP)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/{MODELS['on']}/stats", timeout=30) as answer:
        return json.loads(answer.read())["model_stats"][0]["inference_count"]


def _client(client: str, port: int, seconds: float, python: str, tmp: Path) -> Callable[[], tuple[int, float, float]]:
    """The client started (warmed up, where it waits for a line to begin): a function that runs its window and
    returns (requests, p50 us, p99 us). kiln perf starts when called (its window after its own set-up)."""
    if client == "wire":
        out = tmp / "perf.json"
        command = [python, "-m", "kiln", "perf", "-m", MODELS["on"], "-i", "grpc", "-u", f"127.0.0.1:{port}",
                   "--concurrency", "1", "--measurement-interval", str(int(seconds * 1000)), "--warmup", "0",
                   "--json", str(out)]

        def run() -> tuple[int, float, float]:
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
            level = json.loads(out.read_text())["results"][0]
            if level["wrong"] or level["errors"]:
                raise RuntimeError(f"kiln perf: {level['wrong']} wrong answers, {level['errors']} errors")
            return level["requests"], level["p50_us"], level["p99_us"]

        return run
    load = subprocess.Popen([python, str(ROOT / "bench" / "serve_overhead_client.py"), "grpc", client, str(port),
                             MODELS["on"], "1", str(seconds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if load.stdout.readline().strip() != "go":
        load.kill()
        raise RuntimeError(f"the {client} client did not start")

    def run() -> tuple[int, float, float]:
        load.stdin.write("\n")
        load.stdin.flush()
        result = json.loads(load.stdout.readline())
        load.wait(30)
        return result["requests"], result["p50_s"] * 1e6, result["p99_s"] * 1e6

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs="+", default=[str(ROOT)])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=CLIENTS)
    args = parser.parse_args()
    python = sys.executable
    rows: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="kiln-c1-ab-") as tmp:
        repos = {}
        for k, tree in enumerate(args.trees):
            repos[tree] = Path(tmp) / f"repo{k}"
            _write_repository(repos[tree], python, Path(tree).resolve())
        print(f"CPU: {_cpu_model()}; load average before: {os.getloadavg()[0]:.2f}", flush=True)
        print("| round | tree | client | requests | p50 us | p99 us | server CPU us/req | user | system "
              "| loop thread switches/req vol / invol | load |\n" + "|---" * 10 + "|", flush=True)
        for r in range(args.rounds):
            for tree in args.trees:
                process, ports = _start(repos[tree], 0, None, tree=Path(tree).resolve(), python=python)
                try:
                    for client in args.clients:
                        run = _client(client, ports["gRPC"], args.seconds, python, Path(tmp))
                        count, before = _answered(ports["HTTP"]), _server_times(process.pid)
                        requests, p50, p99 = run()
                        after = _server_times(process.pid)
                        answered = _answered(ports["HTTP"]) - count
                        user, system, voluntary, involuntary = (
                            (a - b) / answered for a, b in zip(after, before))
                        row = {"p50": p50, "p99": p99, "cpu": (user + system) * 1e6, "user": user * 1e6,
                               "system": system * 1e6, "voluntary": voluntary, "involuntary": involuntary}
                        rows.setdefault((tree, client), []).append(row)
                        print(f"| {r} | {tree} | {client} | {requests} | {p50:.0f} | {p99:.0f} | {row['cpu']:.1f} "
                              f"| {row['user']:.1f} | {row['system']:.1f} | {voluntary:.2f} / {involuntary:.2f} "
                              f"| {os.getloadavg()[0]:.2f} |", flush=True)
                finally:
                    process.terminate()
                    process.wait(30)
    print(f"\nmedians over {args.rounds} rounds; ratio: this tree's median over the first tree's\n"
          "| client | tree | p50 us | p99 us | server CPU us/req | user | system | p50 ratio | CPU ratio |\n"
          + "|---" * 9 + "|")
    for client in args.clients:
        first = None
        for tree in args.trees:
            med = {f: statistics.median(row[f] for row in rows[tree, client]) for f in rows[tree, client][0]}
            first = first or med
            print(f"| {client} | {tree} | {med['p50']:.0f} | {med['p99']:.0f} | {med['cpu']:.1f} | {med['user']:.1f} "
                  f"| {med['system']:.1f} | {med['p50'] / first['p50']:.3f} | {med['cpu'] / first['cpu']:.3f} |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
