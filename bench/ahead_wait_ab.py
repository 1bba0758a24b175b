"""How long onednn_ahead's wait() takes when the nice-19 thread is starved: the old wait (sleeping until the thread
says it is idle: Ahead._idle.wait) against the new one (the caller makes the queued jobs after the one in hand),
interleaved, on a fresh Ahead each round. Run it beside busy loops to starve the thread, e.g.

    for i in 1 2; do timeout 600 python -c "while True: pass" & done; python bench/ahead_wait_ab.py

Prints each round's seconds (or the timeout) and the 1-min load average."""

from __future__ import annotations

import argparse
import time

from kiln.kernels.cpu import onednn_ahead


def burn(seconds: float):
    def make() -> bool:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
        return True
    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--job-ms", type=float, default=50.0, help="each job's thread CPU time")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    results: dict[str, list[str]] = {"old": [], "new": []}
    for r in range(args.rounds):
        for how in ("old", "new"):
            ahead = onednn_ahead.Ahead()
            ahead.schedule([onednn_ahead.Job((how, r, k), k, burn(args.job_ms / 1e3)) for k in range(args.jobs)], 1)
            start = time.monotonic()
            done = ahead._idle.wait(args.timeout) if how == "old" else ahead.wait(args.timeout)
            results[how].append(f"{time.monotonic() - start:.2f}" if done else f"timeout {args.timeout:.0f}")
            ahead.wait(10 * args.timeout)  # what is left made before the next round
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"{args.jobs} jobs of {args.job_ms:.0f} ms thread CPU, wait's seconds per round (load {load}):")
    for how, seconds in results.items():
        print(f"  {how:>3}: {', '.join(seconds)}")


if __name__ == "__main__":
    main()
