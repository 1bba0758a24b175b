"""Where the stream's tail comes from (issue 10): each request of bench/dynamic.py's stream, host time beside
device time, and each request's own steady cost.

    python bench/stream_timeline.py [--requests 200] [--passes 3] [--ceiling] [--out DIR]
    python bench/stream_timeline.py --device cpu --model bert_tiny --max-batch 4 --max-seq 64   # a smoke run

One engine as bench/dynamic.py builds it (BERT-base fp16, padding-free, profile 1x1,8x128,32x512, warmed up at
load: every graph captured before the stream), the same stream (seed 0: batch 1-32 x seq 1-512, every row at least
half real). Per request:

- wall:   perf_counter from the call to its synchronized result (what bench/dynamic.py reports);
- host:   the call's own time until it returns (its Python, its launches, the token count's sync);
- device: CUDA events recorded just before and just after the call: the GPU's timeline of the call, idle included;
- graph:  the GPU time of the graph it replayed alone (GraphRunner measures each graph at its capture);
- gap:    device - graph: the GPU idle inside the call, waiting for the host (the sync, the launches);
- gc:     the collector's passes during the call (generation 2's counted apart), captures and evictions.

The stream runs `passes` times in each mode (as is; inside kiln.static_heap(); the collector off), the modes
interleaved pass by pass. A request's steady cost is the least wall time it took in any pass: its shape's own cost.
The tail then splits into the shapes' (p99/p50 of the steady costs: what a jitter-free kiln would show) and the
jitter's (p99 of wall / steady). `--ceiling`: at 32x512 with a full mask, kiln's and torch eager's kernels and the
bound on the ratio the GEMMs leave (bench/per_shape.py); kiln's kernels in a packed run at 24x384; the four
BERT-base GEMMs at 16,384 rows timed the ways kiln and torch call cuBLAS. Prints the tables last; writes them
under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dynamic import commit, stream  # noqa: E402  bench/dynamic.py (imports kiln before torch)
from _setup import dynamic_profile  # noqa: E402  bench/_setup.py
from gpu import graph_ms  # noqa: E402  bench/gpu.py

import torch  # noqa: E402

import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
from kiln.runtime.profiler import percentile  # noqa: E402

MODES = ("as is", "static_heap", "gc off")


@dataclass
class Call:
    wall: float
    host: float
    device: float  # nan on the CPU
    graph: float  # nan where no graph replayed
    program: str  # "packed N rows" / "plain BxS" / "-"
    gc_ms: float = 0.0
    gc_full: int = 0  # generation-2 passes
    captures: int = 0
    evictions: int = 0


@dataclass
class Collector:
    """gc.callbacks: the passes of the collector during the current call."""
    ms: float = 0.0
    full: int = 0
    _start: float = 0.0
    spans: list = field(default_factory=list)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.ms += 1000 * (time.perf_counter() - self._start)
            self.full += info["generation"] == 2


def _last_program(context) -> tuple[str, float]:
    """What the last run replayed (the runner's most recently used graph) and that graph's own GPU ms."""
    runner = context.runner
    if runner is None or not runner.entries:
        return "-", float("nan")
    key, entry = next(reversed(runner.entries.items()))
    ms = entry.ms if entry.ms is not None else float("nan")
    if key[0] == ("other program",):
        return f"plain {'x'.join(map(str, key[1][0]))}", ms
    return f"packed {key[-1][0][0]} rows", ms


def timed_call(run, feeds, context, collector: Collector, cuda: bool) -> Call:
    stats = context.runner.stats if context.runner is not None else None
    captures, evictions = (stats.captures, stats.evictions) if stats else (0, 0)
    collector.ms, collector.full = 0.0, 0
    if cuda:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    if cuda:
        a.record()
    run(feeds)
    t1 = time.perf_counter()
    if cuda:
        b.record()
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    program, graph = _last_program(context)
    return Call(wall=1000 * (t2 - t0), host=1000 * (t1 - t0), device=a.elapsed_time(b) if cuda else float("nan"),
                graph=graph, program=program, gc_ms=collector.ms, gc_full=collector.full,
                captures=(stats.captures - captures) if stats else 0,
                evictions=(stats.evictions - evictions) if stats else 0)


@contextlib.contextmanager
def mode_of(name: str):
    if name == "static_heap":
        with kiln.static_heap():
            yield
    elif name == "gc off":
        gc.disable()
        try:
            yield
        finally:
            gc.enable()
    else:
        yield


def pct(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if x == x)  # nan left out
    return percentile(xs, q) if xs else float("nan")


def gemm_table(log) -> None:
    """BERT-base's four GEMMs at 16,384 rows (32x512), fp16: the ways torch eager (F.linear, then GELU) and kiln
    (addmm on w.t(); _addmm_activation's tanh-GELU epilogue) call cuBLAS. 20 calls in a CUDA graph, median of
    10 replays, TFLOP/s."""
    m, d, f = 16384, 768, 3072
    g = torch.Generator(device="cuda").manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.half) * 0.05

    cases = {"QKV 768->2304": (t(m, d), t(3 * d, d), t(3 * d)), "out 768->768": (t(m, d), t(d, d), t(d)),
             "FFN1 768->3072": (t(m, d), t(f, d), t(f)), "FFN2 3072->768": (t(m, f), t(d, f), t(d))}
    ways = {
        "F.linear (torch eager)": lambda x, w, b: torch.nn.functional.linear(x, w, b),
        "addmm(b, x, w.t()) (kiln)": lambda x, w, b: torch.addmm(b, x, w.t()),
        "F.linear + gelu tanh": lambda x, w, b: torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b),
                                                                        approximate="tanh"),
        "_addmm_activation gelu (kiln FFN1)": lambda x, w, b: torch._addmm_activation(b, x, w.t(), use_gelu=True),
    }
    log("")
    log(f"## BERT-base GEMMs at {m} rows, fp16 (ms a call, CUDA graph of 20 calls, median of 10 replays; TFLOP/s)")
    log("| GEMM | " + " | ".join(ways) + " |")
    log("|---|" + "---|" * len(ways))
    for name, (x, w, b) in cases.items():
        cells = []
        for way, fn in ways.items():
            if "gelu" in way and "FFN1" not in name:
                cells.append("-")
                continue
            ms = graph_ms(lambda: fn(x, w, b))
            cells.append(f"{ms:.4f} ({2 * m * w.shape[0] * w.shape[1] / ms / 1e9:.0f})")
        log(f"| {name} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--model", default="bert_base")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-seq", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--passes", type=int, default=3, help="stream passes per mode, the modes interleaved")
    ap.add_argument("--ceiling", action="store_true", help="CUDA: the 32x512 full-mask ceiling and the GEMM table")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    cuda = args.device == "cuda"
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    model = zoo.get(args.model)
    t0 = time.perf_counter()
    exported = zoo.export(args.model, batch=2, seq=16, dynamic=True)
    engine = kiln.build(str(exported.path), device=args.device, precision="fp16" if cuda else "fp32",
                        profiles=[dynamic_profile(args.max_batch, args.max_seq)], remove_padding=cuda)
    t1 = time.perf_counter()
    context = engine.create_execution_context(warm_up=True)
    log(f"export + build {t1 - t0:.1f} s, warm-up at load {time.perf_counter() - t1:.1f} s"
        + (f", {context.runner.stats.captures} graphs" if context.runner is not None else ""))
    requests = stream(args.requests, args.max_batch, args.max_seq, model.vocab_size, args.seed)
    feeds = [{k: torch.from_numpy(v).to(args.device) for k, v in r.items()} for r in requests]
    if cuda:  # correct first: a few requests (plain and packed runs) against torch fp32 at their real tokens
        reference = zoo.torch_model(args.model).cuda().float().eval()
        with torch.inference_mode():
            for k in range(0, len(feeds), max(1, len(feeds) // 6)):
                got = next(iter(context.run(feeds[k]).values())).float()
                want = reference(**feeds[k])
                real = feeds[k]["attention_mask"].bool()
                error = float((got[real] - want[real]).abs().max())
                program, _ = _last_program(context)
                log(f"request {k} {list(feeds[k]['input_ids'].shape)} ({program}): max |kiln fp16 - torch fp32| "
                    f"over real tokens {error:.3g}")
                if error > 0.05:  # fp16 through 12 layers measured 0.011-0.015 here (|ref| <= 5.2)
                    raise SystemExit(f"request {k}: kiln differs from torch fp32 by {error:.3g}")
        del reference
    collector = Collector()
    gc.callbacks.append(collector)
    calls: dict[str, list[list[Call]]] = {m: [] for m in MODES}
    with torch.inference_mode():
        for _ in range(args.passes):
            for mode in MODES:
                with mode_of(mode):
                    calls[mode].append([timed_call(context.run, f, context, collector, cuda) for f in feeds])
    gc.callbacks.remove(collector)
    steady = [min(calls[m][p][i].wall for m in MODES for p in range(args.passes)) for i in range(len(feeds))]
    tokens = [int(r["attention_mask"].sum()) for r in requests]
    first = calls["as is"][0]

    device = torch.cuda.get_device_name() if cuda else "cpu"
    log("")
    log(f"# The stream's tail, request by request: {args.model} {args.device} ({device}), commit {commit()}")
    log(f"{len(feeds)} requests (batch 1-{args.max_batch} x seq 1-{args.max_seq}, padding masks, seed {args.seed}), "
        f"{args.passes} passes per mode, modes interleaved; ms")
    log("")
    log("| mode | pass | p50 | p99 | p99/p50 | 2nd-half p99/p50 | jitter p99 (wall / steady) | worst wall / steady "
        "| host p50 | host p99 | gap p50 | gap p99 | gc passes (gen 2) | gc ms | captures | evictions |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mode in MODES:
        for p, run in enumerate(calls[mode]):
            wall = [c.wall for c in run]
            half = wall[len(wall) // 2:]
            jitter = [c.wall / s for c, s in zip(run, steady)]
            gaps = [c.device - c.graph for c in run]
            log(f"| {mode} | {p + 1} | {pct(wall, 50):.3f} | {pct(wall, 99):.3f} | {pct(wall, 99) / pct(wall, 50):.2f} "
                f"| {pct(half, 99) / pct(half, 50):.2f} | {pct(jitter, 99):.3f} | {max(jitter):.2f} | "
                f"{pct([c.host for c in run], 50):.3f} | {pct([c.host for c in run], 99):.3f} | {pct(gaps, 50):.3f} | "
                f"{pct(gaps, 99):.3f} | {sum(c.gc_ms > 0 for c in run)} ({sum(c.gc_full for c in run)}) | "
                f"{sum(c.gc_ms for c in run):.2f} | {sum(c.captures for c in run)} | {sum(c.evictions for c in run)} |")
    half = slice(len(feeds) // 2, None)
    graph = [c.graph for c in first]
    log("")
    log("The shapes' own spread (no jitter in it):")
    log(f"- steady cost (least wall of any pass): p50 {pct(steady, 50):.3f}, p99 {pct(steady, 99):.3f}, "
        f"p99/p50 {pct(steady, 99) / pct(steady, 50):.2f}; 2nd half {pct(steady[half], 99) / pct(steady[half], 50):.2f}")
    log(f"- the replayed graphs' GPU time alone: p50 {pct(graph, 50):.3f}, p99 {pct(graph, 99):.3f}, "
        f"p99/p50 {pct(graph, 99) / pct(graph, 50):.2f}")
    log(f"- real tokens: p50 {pct(tokens, 50):.0f}, p99 {pct(tokens, 99):.0f}, p99/p50 "
        f"{pct(tokens, 99) / pct(tokens, 50):.2f} (work proportional to tokens would give this)")
    log(f"- wall - graph (the host's share of each call): p50 {pct([c.wall - c.graph for c in first], 50):.3f}, "
        f"p99 {pct([c.wall - c.graph for c in first], 99):.3f}")
    by_program: dict[str, list[Call]] = {}
    for c in first:
        by_program.setdefault(c.program.split()[0], []).append(c)
    for kind, cs in sorted(by_program.items()):
        log(f"- {kind} runs: {len(cs)}, wall p50 {pct([c.wall for c in cs], 50):.3f}, host p50 "
            f"{pct([c.host for c in cs], 50):.3f}, gap p50 {pct([c.device - c.graph for c in cs], 50):.3f}, "
            f"gap p99 {pct([c.device - c.graph for c in cs], 99):.3f}")
    log("")
    log("Slowest calls against their own steady cost (every mode and pass):")
    log("| # | shape | real | program | mode | pass | wall | steady | host | device | graph | gap | gc ms (gen 2) |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    every = [(c.wall / steady[i], i, m, p, c) for m in MODES for p in range(args.passes)
             for i, c in enumerate(calls[m][p])]
    for ratio, i, m, p, c in sorted(every, key=lambda e: -e[0])[:10]:
        log(f"| {i} | {'x'.join(map(str, requests[i]['input_ids'].shape))} | {tokens[i]} | {c.program} | {m} | {p + 1} "
            f"| {c.wall:.3f} | {steady[i]:.3f} | {c.host:.3f} | {c.device:.3f} | {c.graph:.3f} | "
            f"{c.device - c.graph:.3f} | {c.gc_ms:.2f} ({c.gc_full}) |")
    if cuda and args.ceiling:
        from per_shape import per_shape_table
        module = zoo.torch_model(args.model).cuda().half().eval()
        per_shape_table("32x512:full,24x384", context, {"kiln": context.run, "torch eager": lambda r: module(**r)},
                        model.vocab_size, 6, log, kernels_at=("24x384",))  # 24x384: a packed run's kernels
        gemm_table(log)
    if args.out:
        Path(args.out, "stream-timeline.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
