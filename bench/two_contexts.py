"""Contexts of one CPU engine running at once, on threads of their own (what `kiln serve` does with instance_group
count 2): each row of their answers against the same request run alone on another context, then throughput, one
context on one thread against two contexts on two threads, at once and taking turns (rounds interleaved, medians).

    python bench/two_contexts.py bert_base --engine /tmp/bert_base.kiln   # 5 min build, then loaded from there
    python bench/two_contexts.py bert_tiny

Issue 14: two BERT-base contexts at once answered 4.4 off (values up to 5.3) until each binding ran a oneDNN
primitive handle of its own (kiln/kernels/cpu/onednn.py own_primitive; bench/results/race-2026-12-05c.md).
"""

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import kiln  # noqa: E402
from kiln import zoo  # noqa: E402

SEQ = 128
SIZES = (1, 3, 5, 2, 7, 4)  # each context's batches, in turn: contexts at once at different and at equal shapes


def engine_of(name: str, saved: str | None):
    if saved and os.path.exists(saved):
        return kiln.load(saved)
    exported = zoo.export(name, dynamic=True, batch=2)
    engine = kiln.build(str(exported.path), device="cpu", precision="fp32", tuning_runs=1,
                        profiles=[{"input_ids": f"1x{SEQ},64x{SEQ},64x{SEQ}"}])
    if saved:
        engine.save(saved)
    return engine


def feeds(rows: list[np.ndarray]) -> dict[str, np.ndarray]:
    return {"input_ids": np.concatenate(rows), "attention_mask": np.ones((len(rows), SEQ), np.int64)}


def at_once(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def check(engine, contexts: int, rounds: int) -> list[float]:
    """Each of `contexts` contexts on a thread of its own runs `rounds` x SIZES batches at once: the largest
    difference of each from the requests' answers alone."""
    output = engine.outputs[0].name
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 100, (1, SEQ)).astype(np.int64) for _ in range(contexts + max(SIZES))]
    alone_context = engine.create_execution_context()
    alone = [alone_context.run(feeds([i]))[output][0] for i in ids]
    worst = [0.0] * contexts

    def serve(k: int, context) -> None:
        for _ in range(rounds):
            for size in SIZES:
                got = context.run(feeds(ids[k:k + size]))[output]
                worst[k] = max(worst[k], *(float(np.abs(got[r] - alone[k + r]).max()) for r in range(size)))

    at_once([threading.Thread(target=serve, args=(k, engine.create_execution_context())) for k in range(contexts)])
    return worst


# (contexts, one at a time): one context; two at once; two taking turns (the stopgap of 186e527, Engine.cpu_runs)
RUNS = {"1 context": (1, False), "2 contexts at once": (2, False), "2 contexts, one at a time": (2, True)}


def throughput(engine, contexts: int, one_at_a_time: bool, batch: int, window: float) -> tuple[float, float, float]:
    """(infer/s over all contexts, median ms a call, process CPU ms an inference) with `contexts` contexts on
    threads of their own, each calling run() at `batch` rows for `window` seconds (`one_at_a_time`: under one
    lock)."""
    rng = np.random.default_rng(1)
    request = feeds([rng.integers(0, 100, (1, SEQ)).astype(np.int64) for _ in range(batch)])
    made = [engine.create_execution_context() for _ in range(contexts)]
    for context in made:
        context.run(request)  # bound before the window
    calls: list[list[float]] = [[] for _ in range(contexts)]
    turns = threading.Lock() if one_at_a_time else contextlib.nullcontext()

    def serve(k: int) -> None:
        end = time.perf_counter() + window
        while (start := time.perf_counter()) < end:
            with turns:
                made[k].run(request)
            calls[k].append(time.perf_counter() - start)

    cpu = time.process_time()
    at_once([threading.Thread(target=serve, args=(k,)) for k in range(contexts)])
    cpu = time.process_time() - cpu
    every = [c for per in calls for c in per]
    return batch * len(every) / window, 1e3 * statistics.median(every), 1e3 * cpu / (batch * len(every))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="bert_base")
    parser.add_argument("--engine", help="the engine file: built and saved there once, then loaded")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of SIZES each context runs in the check (0: none)")
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 4], help="throughput: rows a call")
    parser.add_argument("--window", type=float, default=3.0, help="throughput: seconds a round")
    parser.add_argument("--repeats", type=int, default=3, help="throughput: interleaved rounds of each")
    args = parser.parse_args()
    engine = engine_of(args.model, args.engine)
    print(f"{args.model}: {torch.get_num_threads()} OpenMP threads a run, load {os.getloadavg()[0]:.1f}\n")
    print("| contexts at once | rounds | max off, each context |\n|---|---|---|")
    for contexts in (2, 4) if args.rounds else ():
        worst = check(engine, contexts, args.rounds)
        print(f"| {contexts} | {args.rounds} x {len(SIZES)} | {', '.join(f'{w:.3g}' for w in worst)} |", flush=True)
    print("\n| batch | run | infer/s | ms a call | process CPU ms an inference |\n|---|---|---|---|---|")
    for batch in args.batches:
        found: dict[str, list[tuple[float, float, float]]] = {run: [] for run in RUNS}
        for _ in range(args.repeats):
            for run, (contexts, one_at_a_time) in RUNS.items():  # interleaved: the machine's load drifts
                found[run].append(throughput(engine, contexts, one_at_a_time, batch, args.window))
        for run, rows in found.items():  # medians of the rounds
            print(f"| {batch} | {run} | {statistics.median(r[0] for r in rows):.2f} | "
                  f"{statistics.median(r[1] for r in rows):.0f} | {statistics.median(r[2] for r in rows):.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
