"""kiln serve's system calls per gRPC request at concurrency 1: `strace -c -f` attached to a `kiln serve` of the
empty model (bench/serve_overhead.py's repository: y = Identity(x), FP32 [1, 4], dynamic batching on) while one
client (bench/serve_overhead_client.py's h2 or tritonclient) makes calls for a fixed time; strace's count of each
system call, divided by the calls made, one column per tree.

    python bench/serve_c1_syscalls.py --trees /tmp/base . --clients h2 tritonclient --seconds 3

strace slows every system call (a ptrace stop each), so its window's rate and CPU say nothing; the counts are
what it is for. Needs strace and ptrace rights over a child process (the default on Linux: the server is ours).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import _start  # noqa: E402 - bench/serve.py's server start (ports read from its log)
from serve_overhead import MODELS, _write_repository  # noqa: E402


def _counts(summary: str) -> dict[str, int]:
    """strace -c's table: calls per system call name."""
    counts = {}
    for line in summary.splitlines():
        fields = line.split()
        # % time, seconds, usecs/call, calls, [errors,] syscall
        if len(fields) >= 5 and re.fullmatch(r"[\d.]+", fields[0]) and fields[-1] != "total":
            counts[fields[-1]] = int(fields[3])
    return counts


def _traced(pid: int, port: int, client: str, seconds: float, python: str) -> tuple[dict[str, int], int]:
    """System calls of the server's threads while `client` calls it for `seconds`; and the calls made."""
    load = subprocess.Popen([python, str(ROOT / "bench" / "serve_overhead_client.py"), "grpc", client, str(port),
                             MODELS["on"], "1", str(seconds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    if load.stdout.readline().strip() != "go":
        load.kill()
        raise RuntimeError(f"the {client} client did not start")
    out = tempfile.NamedTemporaryFile(suffix=".strace", delete=False)
    out.close()
    tracer = subprocess.Popen(["strace", "-c", "-f", "-o", out.name, "-p", str(pid)], stderr=subprocess.DEVNULL)
    time.sleep(0.5)  # attached to every thread before the window opens
    load.stdin.write("\n")
    load.stdin.flush()
    result = json.loads(load.stdout.readline())
    load.wait(30)
    tracer.send_signal(signal.SIGINT)
    tracer.wait(30)
    summary = Path(out.name).read_text()
    os.unlink(out.name)
    return _counts(summary), result["requests"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs="+", default=[str(ROOT)])
    parser.add_argument("--clients", nargs="+", default=["h2", "tritonclient"], choices=["h2", "raw", "tritonclient"])
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    if shutil.which("strace") is None:
        raise SystemExit("strace is not installed")
    python = sys.executable
    table: dict[tuple[str, str], dict[str, float]] = {}
    traced: dict[tuple[str, str], int] = {}
    with tempfile.TemporaryDirectory(prefix="kiln-syscalls-") as tmp:
        for k, tree in enumerate(args.trees):
            repo = Path(tmp) / f"repo{k}"
            _write_repository(repo, python, Path(tree).resolve())
            process, ports = _start(repo, 0, None, tree=Path(tree).resolve(), python=python)
            try:
                for client in args.clients:
                    counts, requests = _traced(process.pid, ports["gRPC"], client, args.seconds, python)
                    table[tree, client] = {name: n / requests for name, n in counts.items()}
                    traced[tree, client] = requests
            finally:
                process.terminate()
                process.wait(30)
    print(f"load average: {os.getloadavg()[0]:.2f}")
    for client in args.clients:
        columns = [table[tree, client] for tree in args.trees]
        names = sorted({n for c in columns for n in c}, key=lambda n: -max(c.get(n, 0) for c in columns))
        print(f"\nclient {client}: system calls per request (server, all threads)\n"
              f"| syscall | {' | '.join(args.trees)} |\n|---|{'---|' * len(args.trees)}")
        for name in names:
            if max(c.get(name, 0) for c in columns) >= 0.01:
                print(f"| {name} | {' | '.join(f'{c.get(name, 0):.2f}' for c in columns)} |")
        print(f"| **all** | {' | '.join(f'{sum(c.values()):.2f}' for c in columns)} |")
        print(f"| (requests traced) | {' | '.join(str(traced[tree, client]) for tree in args.trees)} |")


if __name__ == "__main__":
    main()
