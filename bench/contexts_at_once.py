"""Execution contexts of one CPU engine computing at once (issue 14: a lane, so an activation arena, each context):
2 contexts x 1 thread against 1 context x 2 threads and 1 context x 1 thread, and 2 contexts x 1 thread over one
arena (the lanes' programs replaced by the engine's own: its segments' lock makes them take turns, as before).

    python bench/contexts_at_once.py                       # ResNet-50 b1, BERT-base 1x128, MobileNetV2 b1
    python bench/contexts_at_once.py mobilenet_v2 --rounds 2 --seconds 6

Each configuration runs in a process of its own (OMP_NUM_THREADS = its threads a context: oneDNN fixes a kernel's
thread count when it is created, at load), the configurations alternating round by round. Each context's thread
calls run() on one fixed request for the window, all starting together; per call its wall interval and its thread's
CPU time. On a machine other work shares, wall clock says little, nor does the CPU the contexts got together (Linux's
autogroup gives this process's threads one share between them: when one context waits, the other gets its CPU).
What says whether contexts computed at once is where each context's thread spent the window:

    lock wait    waiting to enter a native segment another context runs (its lock: one arena, one lock)
    on CPU       computing (the kernel's accounting, /proc/self/task/<tid>/schedstat)
    runnable     ready to compute, waiting for a CPU the machine's other work holds (a thread woken for a lock
                 it then finds taken again waits here too: read it with lock wait)
    overlap      of each call's wall time, the share during which another context's call was in progress too (a
                 context waiting for the lock counts as in progress: read it with lock wait)

Engines are built once (tactics tuned at the machine's default thread count) and saved under --engines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODELS = {  # name -> (zoo export arguments, label)
    "resnet50": ({"batch": 1}, "ResNet-50 b1"),
    "bert_base": ({"batch": 1, "seq": 128}, "BERT-base 1x128"),
    "mobilenet_v2": ({"batch": 1}, "MobileNetV2 b1"),
}
# label -> (contexts, OpenMP threads a context, one arena for all contexts)
CONFIGS = {
    "1 context x 1 thread": (1, 1, False),
    "1 context x 2 threads": (1, 2, False),
    "2 contexts x 1 thread": (2, 1, False),
    "2 contexts x 1 thread, one arena": (2, 1, True),
}


def engine_path(name: str, folder: Path) -> Path:
    """The model's engine file, built and saved there on first use."""
    import kiln
    from kiln import zoo

    path = folder / f"{name}.kiln"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        exported = zoo.export(name, **MODELS[name][0])
        kiln.build(str(exported.path), device="cpu", precision="fp32").save(str(path))
    return path


def request(name: str) -> dict[str, np.ndarray]:
    from kiln import zoo

    exported = zoo.export(name, **MODELS[name][0])
    return zoo.random_inputs(name, exported, seed=1)


def measure(name: str, path: Path, contexts: int, one_arena: bool, seconds: float) -> dict:
    """One configuration, in this process: each context's calls (start, end, thread CPU s) over the window."""
    import kiln
    from kiln.runtime import program

    if one_arena:  # every lane on the engine's own program: one arena per segment, its lock shared (before issue 14)
        program.Program.with_own_arena = lambda self: self
    engine = kiln.load(str(path))
    feeds = request(name)
    made = [engine.create_execution_context() for _ in range(contexts)]
    waited: dict[int, float] = {}  # thread -> seconds waiting for segments' locks
    locks: dict[int, TimedLock] = {}
    for segment in {id(s): s for context in made for s in context.program.segments}.values():
        segment._lock = locks.setdefault(id(segment._lock), TimedLock(segment._lock, waited))
    calls: list[list[tuple[float, float, float]]] = [[] for _ in range(contexts)]
    start_together = threading.Barrier(contexts)

    spent: list[tuple[float, ...]] = [(0.0, 0.0, 0.0, 0.0)] * contexts  # (on CPU, runnable, lock wait, wall) s

    def serve(k: int) -> None:
        for _ in range(3):  # warm: bound, its form chosen
            made[k].run(feeds)
        start_together.wait()
        before, wall, waits = schedstat(), time.perf_counter(), waited.get(threading.get_ident(), 0.0)
        end = wall + seconds
        while (start := time.perf_counter()) < end:
            cpu = time.thread_time()
            made[k].run(feeds)
            calls[k].append((start, time.perf_counter(), time.thread_time() - cpu))
        after = schedstat()
        spent[k] = (after[0] - before[0], after[1] - before[1], waited.get(threading.get_ident(), 0.0) - waits,
                    time.perf_counter() - wall)

    threads = [threading.Thread(target=serve, args=(k,)) for k in range(contexts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"calls": calls, "spent": spent, "load": os.getloadavg()[0]}


class TimedLock:
    """A segment's lock that adds each wait for it to the waiting thread's total."""

    def __init__(self, lock: threading.Lock, waited: dict[int, float]):
        self.lock, self.waited = lock, waited

    def __enter__(self) -> None:
        start = time.perf_counter()
        self.lock.acquire()
        thread = threading.get_ident()
        self.waited[thread] = self.waited.get(thread, 0.0) + time.perf_counter() - start

    def __exit__(self, *_exception) -> None:
        self.lock.release()


def schedstat() -> tuple[float, float]:
    """The calling thread's time on a CPU and runnable waiting for one so far (s)."""
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
        on_cpu, waiting, _slices = f.read().split()
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def memory(name: str, path: Path) -> dict:
    """What a second context costs, in this process: the process's resident growth from making it and running it
    (beyond the first's), its lane's arenas (address space; resident: what the largest segment's plan reaches), and
    the time its lane took to bind."""
    import kiln
    from kiln.runtime import rss

    engine = kiln.load(str(path))
    feeds = request(name)
    first = engine.create_execution_context()
    for _ in range(3):
        first.run(feeds)
    rss.return_free_memory()
    before = rss.resident_bytes()
    start = time.perf_counter()
    second = engine.create_execution_context()
    bind_ms = 1e3 * (time.perf_counter() - start)
    for _ in range(3):
        second.run(feeds)
    rss.return_free_memory()
    segments = second.program.segments
    arenas = {id(s.arena): s.arena.planned for s in segments if s.arena is not None}
    return {"rss": rss.resident_bytes() - before, "arena": sum(arenas.values()),
            "touched": max((s.planned_bytes for s in segments), default=0), "segments": len(segments),
            "bind_ms": bind_ms, "own": second.program is not first.program}


def overlap(calls: list[list[tuple[float, float, float]]]) -> float | None:
    """Of every call's wall time, the share during which another context's call was in progress."""
    if len(calls) < 2:
        return None
    shared = total = 0.0
    for k, mine in enumerate(calls):
        others = [c for j, theirs in enumerate(calls) if j != k for c in theirs]
        for start, end, _ in mine:
            total += end - start
            shared += sum(max(0.0, min(end, e) - max(start, s)) for s, e, _ in others)
    return shared / total if total else None


def summary(result: dict) -> dict:
    calls = result["calls"]
    every = [c for per in calls for c in per]
    first, last = min(c[0] for c in every), max(c[1] for c in every)
    spent = result["spent"]  # each context thread's share of its window: on CPU, runnable, waiting for a lock
    return {"per_s": len(every) / (last - first), "wall_ms": 1e3 * statistics.median(e - s for s, e, _ in every),
            "cpu_ms": 1e3 * statistics.median(c for _, _, c in every),
            "lock_wait": statistics.mean(k / w for _, _, k, w in spent),
            "on_cpu": statistics.mean(c / w for c, _, _, w in spent),
            "runnable": statistics.mean(r / w for _, r, _, w in spent), "overlap": overlap(calls),
            "load": result["load"]}


def run_config(name: str, path: Path, config: str, seconds: float) -> dict:
    contexts, threads, one_arena = CONFIGS[config]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, __file__, "--worker", name, "--engine", str(path), "--contexts", str(contexts),
               "--seconds", str(seconds)] + (["--one-arena"] if one_arena else [])
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    return summary(json.loads(out.strip().splitlines()[-1]))


def table(label: str, found: dict[str, list[dict]]) -> list[str]:
    lines = [f"\n{label}: medians of {len(next(iter(found.values())))} rounds\n",
             "| run | calls/s | wall ms a call | thread CPU ms a call | lock wait | on CPU | runnable | overlap | load |",
             "|---|---|---|---|---|---|---|---|---|"]
    for config, rows in found.items():
        def med(key):
            values = [r[key] for r in rows if r[key] is not None]
            return statistics.median(values) if values else None
        share = med("overlap")
        shares = " | ".join(f"{100 * med(key):.0f}%" for key in ("lock_wait", "on_cpu", "runnable"))
        lines.append(f"| {config} | {med('per_s'):.2f} | {med('wall_ms'):.1f} | {med('cpu_ms'):.1f} | {shares} | "
                     f"{'-' if share is None else f'{100 * share:.0f}%'} | {med('load'):.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=list(MODELS))
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of every configuration")
    parser.add_argument("--seconds", type=float, default=8.0, help="each configuration's window")
    parser.add_argument("--engines", default="/tmp/kiln-bench-engines", help="where engines are built and saved")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--engine", help=argparse.SUPPRESS)
    parser.add_argument("--contexts", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--one-arena", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        found = memory(args.worker, Path(args.engine)) if args.memory else \
            measure(args.worker, Path(args.engine), args.contexts, args.one_arena, args.seconds)
        print(json.dumps(found))
        return
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"{cpu}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at the start")
    costs = []
    for name in args.models:
        path = engine_path(name, Path(args.engines))
        found: dict[str, list[dict]] = {config: [] for config in CONFIGS}
        for _ in range(args.rounds):
            for config in CONFIGS:  # alternating: the machine's load drifts
                found[config].append(run_config(name, path, config, args.seconds))
        print("\n".join(table(MODELS[name][1], found)), flush=True)
        out = subprocess.run([sys.executable, __file__, "--worker", name, "--engine", str(path), "--memory"],
                             capture_output=True, text=True, check=True).stdout
        costs.append((MODELS[name][1], json.loads(out.strip().splitlines()[-1])))
    print("\nA second context: its lane's native segments, bound anew\n\n"
          "| model | segments | arena (address space) | arena resident (largest plan) | RSS growth | binding ms |\n"
          "|---|---|---|---|---|---|")
    for label, c in costs:
        print(f"| {label} | {c['segments']} | {c['arena'] / 2**20:.2f} MiB | {c['touched'] / 2**20:.2f} MiB | "
              f"{c['rss'] / 2**20:.2f} MiB | {c['bind_ms']:.1f} |")


if __name__ == "__main__":
    main()
