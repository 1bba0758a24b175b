"""kiln serve at concurrency 1, one request after another: where a request's server time goes, by the kernel's own
counters. For each client (bench/serve_overhead_client.py: h2, grpc's raw stub, tritonclient; HTTP raw and
tritonclient) against one `kiln serve` process serving the empty model (y = Identity(x), FP32 [1, 4], batching on):
p50/p99 round trip, the server's user and system CPU per request (/proc, all its threads), its voluntary and
involuntary context switches per request, the client's CPU per request; with --strace, the server's system calls
per request (strace -c -f, one extra window per client on a server of its own: strace slows every system call
100-fold, its window's timings are not printed, and the slowed engine calls' CPU clock soon sends the empty model's
instance from the loop to its thread, whose hand-offs, futex and eventfd writes, are strace's: hence a fresh server
and a short window per client). Rounds interleave the clients.

    python bench/serve_c1_split.py --rounds 2 --seconds 2 [--strace]

Reading (bench/results/serve-cpu-2026-12-06.md, h-grpc section): with the h2 client a request costs the server one
epoll_pwait, one read, one write and two clock_gettime (the inline engine call's CPU clock), no thread hand-off;
its CPU is ~85% user (Python, uvloop, the engine's torch call) and ~15% system (TCP on loopback).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import _start  # noqa: E402 - bench/serve.py's server start (ports read from its log)
from serve_overhead import _cpu_model, _write_repository  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
LOADS = [("grpc", "h2"), ("grpc", "raw"), ("grpc", "tritonclient"), ("http", "raw"), ("http", "tritonclient")]


def _user_system(pid: int) -> tuple[float, float]:
    user = system = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # a thread that ended
            continue
        user, system = user + int(fields[11]), system + int(fields[12])
    return user / TICK, system / TICK


def _switches(pid: int) -> tuple[int, int]:
    """(voluntary, involuntary) context switches of every thread of the process."""
    voluntary = involuntary = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        voluntary += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        involuntary += int(line.split()[1])
        except OSError:
            continue
    return voluntary, involuntary


def _client(protocol: str, client: str, port: int, seconds: float) -> subprocess.Popen:
    load = subprocess.Popen([sys.executable, str(ROOT / "bench" / "serve_overhead_client.py"), protocol, client,
                             str(port), "empty", "1", str(seconds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    if load.stdout.readline().strip() != "go":
        load.kill()
        raise RuntimeError(f"the {protocol} {client} client did not start")
    return load


def _window(process: subprocess.Popen, ports: dict, protocol: str, client: str, seconds: float) -> dict:
    load = _client(protocol, client, ports["gRPC" if protocol == "grpc" else "HTTP"], seconds)
    cpu0, switches0 = _user_system(process.pid), _switches(process.pid)
    load.stdin.write("\n")
    load.stdin.flush()
    result = json.loads(load.stdout.readline())
    cpu1, switches1 = _user_system(process.pid), _switches(process.pid)
    load.wait(30)
    n = result["requests"]
    return {"n": n, "p50": result["p50_s"] * 1e6, "p99": result["p99_s"] * 1e6,
            "user": (cpu1[0] - cpu0[0]) / n * 1e6, "system": (cpu1[1] - cpu0[1]) / n * 1e6,
            "voluntary": (switches1[0] - switches0[0]) / n, "involuntary": (switches1[1] - switches0[1]) / n,
            "client": result["client_cpu_s"] / n * 1e6}


def _syscalls(process: subprocess.Popen, ports: dict, protocol: str, client: str, seconds: float) -> str:
    """The server's system calls per request over one window, as strace -c -f counts them."""
    load = _client(protocol, client, ports["gRPC" if protocol == "grpc" else "HTTP"], seconds)
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as out:
        tracer = subprocess.Popen(["strace", "-c", "-f", "-o", out.name, "-p", str(process.pid)],
                                  stderr=subprocess.DEVNULL)
        time.sleep(0.5)  # attached to every thread
        load.stdin.write("\n")
        load.stdin.flush()
        n = json.loads(load.stdout.readline())["requests"]
        tracer.send_signal(2)
        tracer.wait(30)
        load.wait(30)
        counts = {}
        for line in out.read().splitlines():
            found = re.match(r"\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)$", line)
            if found and found.group(2) != "total":
                counts[found.group(2)] = int(found.group(1)) / n
    return ", ".join(f"{name} {per:.2f}" for name, per in sorted(counts.items(), key=lambda kv: -kv[1]) if per >= 0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--strace", action="store_true", help="also count the server's system calls per request")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-c1-") as tmp:
        _write_repository(Path(tmp), sys.executable, ROOT)
        process, ports = _start(Path(tmp), 0)
        try:
            print(f"CPU: {_cpu_model()}; load average before: {os.getloadavg()[0]:.2f}", flush=True)
            print("| round | protocol | client | requests | p50 us | p99 us | server user us/req | server system us/req "
                  "| voluntary switches/req | involuntary/req | client CPU us/req | load |\n" + "|---" * 12 + "|",
                  flush=True)
            for r in range(args.rounds):
                for protocol, client in LOADS:
                    row = _window(process, ports, protocol, client, args.seconds)
                    print(f"| {r} | {protocol} | {client} | {row['n']} | {row['p50']:.0f} | {row['p99']:.0f} "
                          f"| {row['user']:.0f} | {row['system']:.0f} | {row['voluntary']:.2f} "
                          f"| {row['involuntary']:.2f} | {row['client']:.0f} | {os.getloadavg()[0]:.1f} |", flush=True)
        finally:
            process.terminate()
            process.wait(60)
        if args.strace:
            print("\nserver system calls per request (strace -c -f; a fresh server per client):", flush=True)
            for protocol, client in LOADS:
                process, ports = _start(Path(tmp), 0)
                try:
                    print(f"- {protocol} {client}: {_syscalls(process, ports, protocol, client, args.seconds)}",
                          flush=True)
                finally:
                    process.terminate()
                    process.wait(60)


if __name__ == "__main__":
    main()
