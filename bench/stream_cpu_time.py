"""Each request of a random stream timed on kiln and onnxruntime back to back, on the CPU: how many requests kiln
takes longer than onnxruntime (issue 10's CPU target: kiln <= onnxruntime at every shape of the stream).

    python bench/stream_cpu_time.py                                   # bert_tiny, 200 requests b 1-8 x s 1-128
    python bench/stream_cpu_time.py --threads 2 --rounds 3 --engine /tmp/bert_tiny.kiln

bench/dynamic.py's stream (random batch x sequence, each with a real padding mask), its requests in order, each
run once by each runtime (which goes first alternates per request): most of kiln's calls are at a shape it has not
bound (padded inside a bound one, kiln/runtime/first_calls.py, or bound then). A request's time is the calling
thread's CPU time (time.thread_time: a loaded machine's preemption is left out; at 1 thread that is all the work;
with 2 threads the workers' time is not in it, so the wall clock is reported too). kiln is warmed up first
(ExecutionContext.warm_up: its bound shapes, time and count reported), onnxruntime by one call at the opt shape.
--rounds: the stream again from a fresh context and engine padding state (engine loaded once), rounds interleaved
with --ab's switch when given: NAME=VALUE an environment variable (e.g. KILN_DIRECT_RUN=0, read per context), or
"before": the direct path off and the warm-up's hosts CUDA's buckets (powers of two, sequences from 16), as before
kiln/runtime/direct_run.py and first_calls.host_sizes.
Prints a table last (one row a round): requests above onnxruntime, the median / p90 / worst ratio, the totals.
--hot 1x7,8x64: before the rounds, each shape bound and then called --calls times by kiln's direct path, kiln's
general path (KILN_DIRECT_RUN=0) and onnxruntime, interleaved: median thread CPU µs a call.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import kiln  # noqa: E402, F401  (before torch: kiln sets OpenMP's wait policy)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from _setup import cpu_peers  # noqa: E402  bench/_setup.py: the engine and onnxruntime session
from dynamic import _cpu_name, commit, stream  # noqa: E402

from kiln import zoo  # noqa: E402
from kiln.runtime import engine as kiln_engine  # noqa: E402
from kiln.runtime import first_calls  # noqa: E402


def timed(run, feeds) -> tuple[float, float]:
    """(thread CPU ms, wall ms) of one call."""
    c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
    run(feeds)
    return (time.thread_time_ns() - c0) / 1e6, (time.perf_counter_ns() - w0) / 1e6


LAYER_CLASSES = ("linear", "attention", "norms and elementwise", "layout and the rest")


def _kiln_class(op_type: str) -> str:
    op = op_type.lower()
    if "attention" in op:
        return "attention"
    if any(k in op for k in ("matmul", "gemm", "linear", "dense")):
        return "linear"
    if any(k in op for k in ("norm", "add", "gelu", "erf", "mul", "bias", "softmax")):
        return "norms and elementwise"
    return "layout and the rest"


@contextlib.contextmanager
def kiln_layer_times(program):
    """Within: every run of any view of the program's native segments adds each layer's thread CPU ms to the dict
    (layer name -> ms per run): Segment.timed's clock wrapped around each bound view's compiled loop."""
    from kiln.kernels.cpu import native_loop

    timed_run = native_loop.load().kiln_run_segment_timed
    found: dict[str, list[float]] = {}
    saved = []
    for segment in program.segments:
        for view in [segment, *(v for v in segment.resized.values() if v is not None)]:
            if not hasattr(view, "_names") or not isinstance(getattr(view, "_c", None), dict):
                continue
            names = view._names
            plain = dict(view._c)
            saved.append((view, plain))

            def clocked(c: tuple, names: list[str] = names) -> tuple:
                elapsed = (ctypes.c_longlong * max(len(names), 1))()

                def run(*args) -> int:
                    status = timed_run(*args, elapsed, time.CLOCK_THREAD_CPUTIME_ID)
                    for name, ns in zip(names, elapsed):
                        found.setdefault(name, [0.0])[-1] += ns / 1e6
                    return status
                return (run, *c[1:])
            view._c = {key: clocked(c) for key, c in plain.items()}
    try:
        yield found
    finally:
        for view, plain in saved:
            view._c = plain


def layer_split(engine, feeds: dict, log) -> None:
    """kiln's time at one shape by class of layer (linear, attention, norms and elementwise, the rest): thread CPU ms
    per layer of its bound view at this shape. (onnxruntime's profile times its nodes by the wall clock: on a
    loaded machine a 15 ms run was profiled at 244 ms, one node at half of it; so no split of its time here.)"""
    context = engine.create_execution_context(pad_first_calls=False)
    for _ in range(2):  # bound at its own shape, then a repeat
        context.run(feeds)
    op_of = {spec.name: spec.op_type for spec in engine.program.spec.steps}
    kiln_ms = dict.fromkeys(LAYER_CLASSES, 0.0)
    with kiln_layer_times(engine.program) as found:
        total = timed(context.run, feeds)[0]
    for name, ms in found.items():
        kiln_ms[_kiln_class(op_of.get(name, name))] += ms[-1]
    shape = "x".join(map(str, next(iter(feeds.values())).shape))
    log(f"| {shape} | {total:.1f} | " + " | ".join(f"{kiln_ms[c]:.1f}" for c in LAYER_CLASSES) + " |")


def buckets_as_hosts(context, symbol: str, low: int, high: int) -> list[int]:
    """The warm-up's hosts before first_calls.host_sizes: CUDA's buckets."""
    return context._first_calls.buckets.sizes(symbol, low, high)


def explain_above(engine, session, requests, above: list[int], kinds: list[str], ratios: list[float],
                  hosts: dict[int, tuple], log, calls: int = 30, split=None) -> None:
    """Why each request above onnxruntime was: after the round, timed hot (interleaved, median thread CPU µs of
    `calls`): onnxruntime; kiln padded in its host as the stream ran it (the host's direct run on zero-padded inputs,
    padding and cropping included); kiln at its own shape, bound. Own shape above onnxruntime: kiln is slower there
    (a small shape's fixed costs); padded above but own below: padding's waste; both below: the stream's (caches
    cold after the other runtime, the machine's load). `split`: called with a request's feeds where kiln is slower at
    its own shape (layer_split's table of where)."""
    if not above:
        return
    from kiln.runtime import first_calls as fc

    context = engine.create_execution_context()
    padding, direct = context._first_calls, context._direct
    log("| request | shape | path | in stream kiln/ort | host | padding (work) | hot ort µs | hot kiln padded µs | "
        "hot kiln own µs | padded/ort | own/ort | class |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|")
    slower = []
    for i in above:
        feeds = requests[i]
        arrays = list(feeds.values())
        shape = "x".join(map(str, arrays[0].shape))
        host = hosts.get(i)
        padded_run = None
        if host is not None and padding is not None and direct is not None:
            record = direct.find(host)
            if record is not None:
                sizes = padding._sizes(host)

                def padded_run(record=record, sizes=sizes, arrays=arrays):
                    padded = [fc._padded_array(a, axes, sizes) for a, axes in zip(arrays, padding._pads)]
                    return [fc._cropped_array(y, axes, padding._sizes(tuple((a.shape, None) for a in arrays)))
                            for y, axes in zip(record.run(padded), padding._crops)]
        for _ in range(3):  # its own shape bound (and its repeat measured), then direct
            context.run(feeds)
        got: dict[str, list[float]] = {"ort": [], "padded": [], "own": []}
        for _ in range(calls):
            got["ort"].append(timed(lambda r: session.run(None, r), feeds)[0] * 1e3)
            if padded_run is not None:
                got["padded"].append(timed(lambda r: padded_run(), feeds)[0] * 1e3)
            got["own"].append(timed(context.run, feeds)[0] * 1e3)
        med = {k: statistics.median(v) if v else float("nan") for k, v in got.items()}
        work = (np.prod(host[0][0]) / arrays[0].size - 1) if host is not None else 0.0
        own, pad = med["own"] / med["ort"], med["padded"] / med["ort"]
        why = ("kiln slower at this shape" if own > 1 else "padding's waste" if pad > 1 else
               "the stream (hot: below onnxruntime)")
        log(f"| #{i} | {shape} | {kinds[i]} | {ratios[i]:.2f} | "
            f"{'x'.join(map(str, host[0][0])) if host is not None else '-'} | {work:+.0%} | {med['ort']:.0f} | "
            f"{med['padded']:.0f} | {med['own']:.0f} | {pad:.2f} | {own:.2f} | {why} |")
        if own > 1:
            slower.append(i)
    if split is not None and slower:
        log("")
        log("Where kiln is slower at its own shape: its run's thread CPU ms by class of layer")
        log("| shape | kiln ms | " + " | ".join(LAYER_CLASSES) + " |")
        log("|---|---|" + "---|" * len(LAYER_CLASSES))
        for i in slower:
            split(requests[i])


def one_round(engine, session, requests, label: str, log, explain: bool = False, explain_calls: int = 30,
              split=None) -> dict:
    """A fresh context (the engine's padding state started over) warmed up, then the stream."""
    engine.first_calls = first_calls.FirstCalls(engine.program, engine.first_calls.buckets, engine.inputs) \
        if engine.first_calls is not None else None
    if hasattr(kiln_engine, "_direct_runs"):  # (absent in a tree before it: the bench also runs from such a copy)
        engine.direct_runs = kiln_engine._direct_runs(engine)
    for segment in engine.program.segments:  # the views of earlier rounds go (shape plans too): a fresh start
        segment.resized.clear()
    if engine.program.shape_plans is not None:
        engine.program.shape_plans.clear()
        engine.program._plan_sizes.clear()
        engine.program.shape_plan_bytes = 0
    context = engine.create_execution_context()
    w0, c0 = time.perf_counter(), time.thread_time()
    context.warm_up()
    warm_s, warm_cpu = time.perf_counter() - w0, time.thread_time() - c0
    bound = len(engine.first_calls.bound) if engine.first_calls is not None else 0
    report = getattr(context, "warmed_up", None)
    log(f"round {label}: {report.describe() if report else f'warm-up {bound} shapes bound, {warm_s:.2f} s'}, "
        f"{warm_cpu:.2f} s CPU")
    ratios, kiln_ms, ort_ms, kiln_wall, ort_wall, errors = [], [], [], [], [], []
    padding = context._first_calls
    kinds: list[str] = []  # how kiln ran each request: at a bound shape, padded in one, or binding its own
    hosts: dict[int, tuple] = {}  # request -> the signature of the bound shape it would run padded in
    for i, feeds in enumerate(requests):
        signature = tuple((v.shape, torch.int64) for v in feeds.values())
        before = (padding.padded_runs, signature in padding.bound) if padding is not None else (0, True)
        got = {}
        pair = [("kiln", lambda r: got.setdefault("kiln", next(iter(context.run(r).values())))),
                ("ort", lambda r: got.setdefault("ort", session.run(None, r)[0]))]
        for name, run in (pair if i % 2 == 0 else pair[::-1]):
            cpu, wall = timed(run, feeds)
            (kiln_ms if name == "kiln" else ort_ms).append(cpu)
            (kiln_wall if name == "kiln" else ort_wall).append(wall)
        ratios.append(kiln_ms[-1] / max(ort_ms[-1], 1e-6))
        real = feeds["attention_mask"].astype(bool)
        errors.append(float(np.abs(got["kiln"][real] - got["ort"][real]).max()))
        kinds.append("bound" if before[1] else "padded" if padding.padded_runs > before[0] else "binds")
        if explain and kinds[-1] == "padded":  # the host it ran in (looked up after the timed run: unchanged since)
            host = padding._host(list(feeds.values()), signature, padding._sizes(signature), paying=False)
            if host is not None:
                hosts[i] = host.signature
    padded = padding.padded_runs if padding is not None else 0
    worst_error = max(range(len(errors)), key=errors.__getitem__)
    log(f"round {label}: max |kiln - onnxruntime| over real tokens {errors[worst_error]:.3g} (request #{worst_error})")
    if errors[worst_error] > 1e-3:
        raise SystemExit(f"kiln differs from onnxruntime by {errors[worst_error]:.3g} at request #{worst_error}")
    log(f"round {label}: above onnxruntime: " + ", ".join(
        f"#{i} {'x'.join(map(str, requests[i]['input_ids'].shape))} {kinds[i]} {ratios[i]:.2f} "
        f"({kiln_ms[i]:.3f}/{ort_ms[i]:.3f})" for i in range(len(ratios)) if ratios[i] > 1))
    by_kind = {kind: [r for r, k in zip(ratios, kinds) if k == kind] for kind in ("bound", "padded", "binds")}
    log(f"round {label}: by path, requests (above onnxruntime, median ratio): " + ", ".join(
        f"{kind} {len(rs)} ({sum(r > 1 for r in rs)}, {statistics.median(rs) if rs else float('nan'):.2f})"
        for kind, rs in by_kind.items()))
    wall_ratios = [k / max(o, 1e-6) for k, o in zip(kiln_wall, ort_wall)]
    worst = sorted(range(len(ratios)), key=lambda i: -ratios[i])[:5]
    log(f"round {label}: padded runs in the stream {padded}; load {os.getloadavg()[0]:.1f}; worst: "
        + ", ".join(f"#{i} {'x'.join(map(str, requests[i]['input_ids'].shape))} {ratios[i]:.2f} "
                    f"({kiln_ms[i]:.3f} / {ort_ms[i]:.3f} ms)" for i in worst))
    if explain:
        explain_above(engine, session, requests, [i for i, r in enumerate(ratios) if r > 1], kinds, ratios, hosts, log,
                      explain_calls, split)
    return {"label": label, "above": sum(r > 1 for r in ratios), "n": len(ratios),
            "median": statistics.median(ratios), "p90": float(np.percentile(ratios, 90)), "worst": max(ratios),
            "kiln_total": sum(kiln_ms), "ort_total": sum(ort_ms), "wall_above": sum(r > 1 for r in wall_ratios),
            "wall_median": statistics.median(wall_ratios), "warm_s": warm_s, "bound": bound,
            "kiln_p50": statistics.median(kiln_ms), "ort_p50": statistics.median(ort_ms),
            "kiln_p99": float(np.percentile(kiln_ms, 99)), "ort_p99": float(np.percentile(ort_ms, 99))}


def hot_table(engine, session, shapes: str, calls: int, vocab: int, log) -> None:
    """Bound shapes called repeatedly: kiln direct / kiln general / onnxruntime, median thread CPU µs."""
    direct = engine.create_execution_context()
    os.environ["KILN_DIRECT_RUN"] = "0"
    general = engine.create_execution_context()
    del os.environ["KILN_DIRECT_RUN"]
    assert direct._direct is not None and general._direct is None, "the engine has no direct path"
    rng = np.random.default_rng(1)
    log("| shape | kiln direct µs | kiln general µs | onnxruntime µs | direct / onnxruntime |")
    log("|---|---|---|---|---|")
    for shape in shapes.split(","):
        b, s = map(int, shape.split("x"))
        feeds = {"input_ids": rng.integers(0, vocab, (b, s)), "attention_mask": np.ones((b, s), np.int64)}
        runners = {"direct": direct.run, "general": general.run, "ort": lambda r: session.run(None, r)}
        for run in runners.values():
            for _ in range(3):  # bound, its binding measured, then direct
                run(feeds)
        got = {name: [] for name in runners}
        for _ in range(calls):
            for name, run in runners.items():
                got[name].append(timed(run, feeds)[0] * 1e3)
        med = {name: statistics.median(v) for name, v in got.items()}
        log(f"| {shape} | {med['direct']:.0f} | {med['general']:.0f} | {med['ort']:.0f} | "
            f"{med['direct'] / med['ort']:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert_tiny")
    ap.add_argument("--engine", help="a saved engine of the model (else built with profile 1x1 / opt / max)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--max-seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--ab", default="", help="every other round: NAME=VALUE with this environment variable set, or "
                    "'before' (no direct path, CUDA's buckets as the warm-up's hosts)")
    ap.add_argument("--out", help="append the log and table to this file")
    ap.add_argument("--hot", default="", help="bound shapes (e.g. 1x7,8x64) timed by path before the rounds")
    ap.add_argument("--calls", type=int, default=200, help="--hot: calls per shape and path")
    ap.add_argument("--subset", type=int, default=0, help="time only this many requests of the stream, drawn "
                    "at random (seeded by --seed) and kept in the stream's order: the same distribution, where the "
                    "whole stream takes too long (BERT-base's b 1-32 x s 1-512 at one thread)")
    ap.add_argument("--tokens-up-to", type=int, default=0, help="time only the stream's requests of at most this "
                    "many positions (batch x sequence), in its order: its small stratum (per-call costs show there)")
    ap.add_argument("--explain-calls", type=int, default=30, help="--explain: hot calls per request and runtime")
    ap.add_argument("--split", action="store_true", help="--explain: where kiln is slower at its own shape, its "
                    "time by class of layer (linear, attention, norms and elementwise, the rest)")
    ap.add_argument("--explain", action="store_true", help="after each round, each request above onnxruntime timed "
                    "hot: onnxruntime, kiln padded in its host, kiln at its own shape bound (why it was above)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    host_sizes = getattr(kiln_engine.ExecutionContext, "_host_sizes", None)

    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    peers = cpu_peers(args.model, args.engine, args.max_batch, args.max_seq, args.threads)
    engine, session = peers.engine, peers.session
    requests = stream(args.requests, args.max_batch, args.max_seq, zoo.get(args.model).vocab_size, args.seed)
    if args.subset:
        picked = sorted(np.random.default_rng(args.seed + 1).choice(len(requests), args.subset, replace=False))
        log(f"a subset of {args.subset} of the {len(requests)} requests (seed {args.seed + 1}), the stream's #"
            + ", #".join(f"{k} {'x'.join(map(str, requests[k]['input_ids'].shape))}" for k in picked)
            + " (numbered 0.. below)")
        requests = [requests[k] for k in picked]
    if args.tokens_up_to:
        picked = [k for k, r in enumerate(requests) if r["input_ids"].size <= args.tokens_up_to]
        log(f"the {len(picked)} requests of at most {args.tokens_up_to} positions: #"
            + ", #".join(f"{k} {'x'.join(map(str, requests[k]['input_ids'].shape))}" for k in picked)
            + " (numbered 0.. below)")
        requests = [requests[k] for k in picked]
    session.run(None, requests[0])
    # correctness first: kiln against onnxruntime over real tokens at a few requests
    check = engine.create_execution_context()
    for k in range(0, len(requests), max(1, len(requests) // 4)) if not args.subset else ():  # (a subset: checked
        got = next(iter(check.run(requests[k]).values()))
        want = session.run(None, requests[k])[0]
        real = requests[k]["attention_mask"].astype(bool)
        err = float(np.abs(got[real] - want[real]).max())
        log(f"request {k} {list(requests[k]['input_ids'].shape)}: max |kiln - onnxruntime| over real tokens {err:.3g}")
        if err > 1e-3:
            raise SystemExit(f"kiln differs from onnxruntime by {err:.3g} at request {k}: not timed")
    # as the stream runs, every request: one_round's error column)
    before = args.ab == "before"
    if args.hot:
        hot_table(engine, session, args.hot, args.calls, zoo.get(args.model).vocab_size, log)
    name, _, value = ("KILN_DIRECT_RUN=0" if before else args.ab).partition("=")
    rows = []
    for r in range(args.rounds):
        switched = bool(name) and r % 2 == 1
        saved = os.environ.get(name) if name else None
        if switched:
            os.environ[name] = value
            if before:
                kiln_engine.ExecutionContext._host_sizes = buckets_as_hosts
        try:
            split = (lambda feeds: layer_split(engine, feeds, log)) if args.split else None
            rows.append(one_round(engine, session, requests, f"{r}{' ' + args.ab if switched else ''}", log,
                                  args.explain, args.explain_calls, split))
        finally:
            if switched:
                kiln_engine.ExecutionContext._host_sizes = host_sizes
                if saved is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = saved
    log("")
    log(f"# kiln vs onnxruntime per request: {args.model}, {_cpu_name()}, commit {commit()}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    log(f"{len(requests)} requests b 1-{args.max_batch} x s 1-{args.max_seq} (seed {args.seed}), {args.threads} "
        f"thread(s) each runtime; thread CPU time per call (wall columns: wall clock); load average "
        f"{os.getloadavg()[0]:.1f} ({os.cpu_count()} cores, shared)")
    log("")
    log("| round | warm-up s (shapes bound) | above onnxruntime | median kiln/ort | p90 | worst | kiln p50 / p99 ms | "
        "ort p50 / p99 ms | kiln / ort total | wall: above, median |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        log(f"| {row['label']} | {row['warm_s']:.2f} ({row['bound']}) | {row['above']} of {row['n']} | "
            f"{row['median']:.2f} | {row['p90']:.2f} | {row['worst']:.2f} | {row['kiln_p50']:.3f} / "
            f"{row['kiln_p99']:.2f} | {row['ort_p50']:.3f} / {row['ort_p99']:.2f} | "
            f"{row['kiln_total'] / row['ort_total']:.2f} | {row['wall_above']}, {row['wall_median']:.2f} |")
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n\n")


if __name__ == "__main__":
    main()
