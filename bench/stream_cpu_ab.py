"""bench/dynamic.py's stream on the CPU, kiln and onnxruntime alternating in one process, timed by the calling thread's
CPU clock (issue 10, bench/results/stream-zen4-2026-12-07c.md).

    python bench/stream_cpu_ab.py --engine /tmp/bert_tiny_8x128.kiln --model bert_tiny --rounds 3
    python bench/stream_cpu_ab.py --engine E --model bert_tiny --pad-ab     # first calls padded vs never padded

Why not dynamic.py's wall clock: on a machine with more runnable tasks than cores the alternating loop's preemption
waits land on one runtime in a steady phase, not on both alike. Beside two busy loops on the 2-vCPU Zen 4, bert_tiny
at 1 thread read kiln p50 11 ms / onnxruntime 1.9 ms with kiln's first calls padded and kiln 1.8 / onnxruntime 19
with them off (same code, same stream): the thread's CPU clock is the comparison that holds there.

Each round: a fresh context (and, with --pad-ab, a second engine loaded whose context never pads first calls: the two
alternate which goes first, request by request), the stream of --requests shapes from seed = the round, each request
run once by each, onnxruntime last. Per round: thread CPU ms summed over the stream per runtime, kiln / onnxruntime,
the small requests' (at most --small positions) sums, the wall sums beside; with --pad-ab, the padded engine's
requests by what its FirstCalls did (padded in a host, bound at the call, a shape met before) and what each kind cost
against the same requests on the engine that never pads. At 2 threads the caller's CPU clock leaves the workers out:
read the wall sums there.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import kiln  # noqa: E402, F401  (before torch: kiln sets OpenMP's wait policy)
import torch  # noqa: E402
from dynamic import _cpu_name, commit, stream  # noqa: E402
from stream_cpu_time import timed  # noqa: E402  (thread CPU ms, wall ms) of one call

from kiln import zoo  # noqa: E402


def kind_of(padding, before: tuple[int, int]) -> str:
    """What the padded engine's FirstCalls did with the call just run: `before` its (padded runs, bound shapes)."""
    if padding.padded_runs > before[0]:
        return "padded"
    return "bound" if len(padding.bound) > before[1] else "known"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True, help="a saved engine of --model, symbolic batch x sequence")
    ap.add_argument("--model", default="bert_tiny")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--small", type=int, default=255, help="a small request: at most this many positions")
    ap.add_argument("--pad-ab", action="store_true", help="a second engine whose context never pads first calls")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    options.inter_op_num_threads = 1
    exported = zoo.export(args.model, batch=2, seq=16, dynamic=True)
    session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
    print(f"# {args.model} stream, {args.requests} requests b 1-{args.max_batch} x s 1-{args.max_seq}, "
          f"{args.threads} thread(s), {_cpu_name()}, kiln {kiln.__file__.rsplit('/kiln/', 1)[0]} at {commit()}, "
          f"torch {torch.__version__}, onnxruntime {ort.__version__}", flush=True)
    for round_ in range(args.rounds):
        load = os.getloadavg()[0]
        runs = {"kiln": kiln.load(args.engine).create_execution_context(warm_up=True)}
        if args.pad_ab:
            runs["kiln unpadded"] = kiln.load(args.engine).create_execution_context(warm_up=True,
                                                                                   pad_first_calls=False)
        padding = runs["kiln"]._first_calls
        requests = stream(args.requests, args.max_batch, args.max_seq, zoo.get(args.model).vocab_size, round_)
        cpu = {name: [] for name in [*runs, "onnxruntime"]}
        wall = {name: [] for name in cpu}
        kinds = []
        for i, feeds in enumerate(requests):
            names = list(runs) if i % 2 == 0 else list(reversed(runs))
            for name in names:
                before = (padding.padded_runs, len(padding.bound)) if padding is not None else None
                c, w = timed(runs[name].run, feeds)
                cpu[name].append(c)
                wall[name].append(w)
                if name == "kiln" and padding is not None:
                    kinds.append(kind_of(padding, before))
            c, w = timed(lambda f: session.run(None, f), feeds)
            cpu["onnxruntime"].append(c)
            wall["onnxruntime"].append(w)
        small = [i for i, r in enumerate(requests) if r["input_ids"].size <= args.small]
        ort_cpu, ort_small = sum(cpu["onnxruntime"]), sum(cpu["onnxruntime"][i] for i in small)
        line = [f"round {round_} (load {load:.1f} -> {os.getloadavg()[0]:.1f}): thread CPU ms"]
        for name in cpu:
            total = sum(cpu[name])
            line.append(f"{name} {total:.0f} ({total / ort_cpu:.3f})")
        line.append(f"| small ({len(small)}): " + ", ".join(
            f"{name} {sum(cpu[name][i] for i in small):.0f} ({sum(cpu[name][i] for i in small) / ort_small:.3f})"
            for name in cpu))
        line.append("| wall ms: " + ", ".join(f"{name} {sum(wall[name]):.0f}" for name in wall))
        if args.pad_ab and kinds:
            over = [a - b for a, b in zip(cpu["kiln"], cpu["kiln unpadded"])]
            line.append("| padded engine by kind, n and ms over the unpadded one: " + ", ".join(
                f"{k} {kinds.count(k)} {sum(d for d, x in zip(over, kinds) if x == k):+.1f}"
                for k in ("padded", "bound", "known")))
        if padding is not None:
            line.append(f"| padded runs {padding.padded_runs}, budget {padding.budget_ms():.3f} ms"
                        + (f", own cost {padding.pad_overhead_ms():.3f} ms" if hasattr(padding, "pad_overhead_ms")
                           else ""))
        print(" ".join(line), flush=True)


if __name__ == "__main__":
    main()
