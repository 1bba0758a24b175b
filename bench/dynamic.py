"""kiln at every shape: one engine, a stream of requests of random batch x sequence, each with a real
padding mask, side by side with the peers on the same stream (issue 10's benchmark).

    python bench/dynamic.py --device cuda                  # BERT-base, batch 1-32 x seq 1-512, 200 requests
    python bench/dynamic.py --device cpu --max-batch 4 --max-seq 128 --requests 60

Peers: on CUDA torch eager fp16 and torch.compile(dynamic=True) fp16 (the same module kiln's ONNX was
exported from); on the CPU onnxruntime (all graph optimisations, same thread count). Every request is
run by every runtime back to back (same shape, same data), so each request has its own kiln / fastest
peer ratio. Reported: p50/p99 over all calls (first calls, captures and compiles included), p99/p50
after warm-up (the second half), mean first-call cost, the stream's total time, CUDA graphs captured,
device memory peak, and where kiln is slower than the fastest peer. Correctness first: kiln's output is
compared with the fp32 reference on a few requests (real tokens only). Prints a table last; writes
bench/results/dynamic-<device>-<date>.md (appended).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if "--no-spin" in sys.argv:  # read by libgomp when torch loads it: before the import
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

importlib.import_module("kiln")  # before torch: its OpenMP wait policy is read when torch loads libgomp

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
from kiln.runtime.profiler import percentile  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
STARTED = time.perf_counter()


def stream(requests: int, max_batch: int, max_seq: int, vocab: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(requests):
        b, s = int(rng.integers(1, max_batch + 1)), int(rng.integers(1, max_seq + 1))
        mask = np.ones((b, s), np.int64)
        for row in range(b):
            mask[row, rng.integers(max(1, s // 2), s + 1):] = 0  # padded at the end, at least half real
        out.append({"input_ids": rng.integers(0, vocab, (b, s), dtype=np.int64), "attention_mask": mask})
    return out


def summary(samples: list[float], first: list[float]) -> dict:
    ordered = sorted(samples)
    warm = sorted(samples[len(samples) // 2:])
    return {"p50": percentile(ordered, 50), "p99": percentile(ordered, 99),
            "warm_p50": percentile(warm, 50), "warm_p99": percentile(warm, 99),
            "first_ms": statistics.fmean(first) if first else float("nan"), "total_s": sum(samples) / 1000}


def commit() -> str:
    root = Path(__file__).resolve().parents[1]
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout
    return os.environ.get("KILN_COMMIT") or sha.strip() or "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", default="bert_base", help="zoo encoder: bert_base, bert_tiny, minilm")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-seq", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (kiln and onnxruntime)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine", help="a saved engine of the model (else built here with the stream's profile)")
    ap.add_argument("--no-compile", action="store_true", help="CUDA: skip torch.compile(dynamic=True)")
    ap.add_argument("--reduce-overhead", action="store_true", help="CUDA: torch.compile(mode='reduce-overhead', "
                    "dynamic=True) too (CUDA graphs recorded per shape)")
    ap.add_argument("--warm-compile-cache", choices=["dynamic", "reduce-overhead"],
                    help="CUDA: only compile that torch.compile mode at the warm-up shapes and exit: run beside the "
                         "build (another process), it fills Inductor's on-disk caches, so the bench's own compile "
                         "hits them (a device call's time limit)")
    ap.add_argument("--no-split", action="store_true",
                    help="CUDA: pad a batch to its bucket as one run, never split it into bucket-sized chunks")
    ap.add_argument("--no-warm-up", action="store_true",
                    help="skip the warm-up before the stream (kiln: every bucket once, capturing its CUDA graph; "
                         "torch.compile: the smallest and largest shape, compiling its dynamic graph)")
    ap.add_argument("--remove-padding", action=argparse.BooleanOptionalAction, default=None,
                    help="build the padding-free engine (kiln build --remove-padding; default on CUDA: the engine a "
                         "stream of padded requests wants, outputs zero at padding positions)")
    ap.add_argument("--shapes", default="",
                    help="CUDA: after the stream, a per-shape table at these shapes (e.g. 32x512,17x300,32x512:full; "
                         "masks with every row at least half real, ':full' none padded), the three runtimes timed in "
                         "turn, and the GEMM ceiling at the largest full-mask shape")
    ap.add_argument("--calls", type=int, default=15, help="per-shape table: timed calls per runtime")
    ap.add_argument("--packing-ab", default="", help="shapes (as --shapes) where the stream context is timed beside "
                    "one that never packs (the plain program at the run's bucket)")
    ap.add_argument("--kernels-at", default="", help="per-shape table: shapes (as in --shapes) where kiln's GPU "
                    "kernels are tabled beside its wall time")
    ap.add_argument("--stream-deadline-s", type=float, default=0.0,
                    help="stop the stream this many seconds after the script started (a device call's time limit); "
                         "the requests run so far are reported")
    ap.add_argument("--per-request", action="store_true", help="also table every request: its shape, each runtime's "
                    "time and kiln / fastest peer")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="also write the table and log here")
    ap.add_argument("--no-spin", action="store_true",
                    help="CPU: idle threads sleep instead of spinning, in both runtimes (OMP_WAIT_POLICY=PASSIVE for "
                         "kiln's OpenMP, session.intra_op.allow_spinning=0 for onnxruntime): on a host with more "
                         "runnable threads than cores a spinning worker takes the core its own caller needs")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    torch.set_num_threads(args.threads)
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    model = zoo.get(args.model)
    if args.warm_compile_cache:
        module = zoo.torch_model(args.model).cuda().half().eval()
        compiled = torch.compile(module, dynamic=True, mode=None if args.warm_compile_cache == "dynamic" else
                                 args.warm_compile_cache)
        warm_up_compiled({f"torch.compile {args.warm_compile_cache}": lambda r: compiled(**r)}, args.max_batch,
                         args.max_seq, log)
        return
    t0 = time.perf_counter()
    exported = zoo.export(args.model, batch=2, seq=16, dynamic=True)
    log(f"export (symbolic batch, seq): {time.perf_counter() - t0:.1f} s -> {exported.path}")
    requests = stream(args.requests, args.max_batch, args.max_seq, model.vocab_size, args.seed)
    profile = {"input_ids": f"1x1,{min(8, args.max_batch)}x{min(128, args.max_seq)},{args.max_batch}x{args.max_seq}"}
    remove_padding = cuda if args.remove_padding is None else args.remove_padding
    t0 = time.perf_counter()
    if args.engine:  # built before (an A/B of runtime switches then compares one engine's tactics)
        engine = kiln.load(args.engine)
    else:
        engine = kiln.build(str(exported.path), device=args.device, precision="fp16" if cuda else "fp32",
                            profiles=[profile], remove_padding=remove_padding)
    build_s = time.perf_counter() - t0
    free = engine.plan.header.get("remove_padding")
    log(f"kiln {'load' if args.engine else 'build'} {build_s:.1f} s, profile {engine.plan.profiles[0].describe()}, "
        + (f"padding-free ({free['layers']} layers packed, plain program of {free.get('plain_program')} steps)"
           if free else "plain"))
    for program in ("tactics", "plain_tactics"):  # what each attention kernel was chosen over, and where timed
        layers = engine.plan.header.get(program, {}).get("layers", {})
        tuned = next((t for t in layers.values() if any("attention" in k for k in t.get("candidates", {}))), None)
        if tuned is not None:
            log(f"{program} attention: {tuned['tactic']}; candidates {tuned['candidates']}; at {tuned.get('at')}")
    warm_up_s: dict[str, float] = {}
    t0 = time.perf_counter()
    context = engine.create_execution_context(warm_up=not args.no_warm_up)  # at load: the stream captures nothing
    if not args.no_warm_up:
        warm_up_s["kiln"] = time.perf_counter() - t0
        g = context.runner.stats if context.runner is not None else None
        log(f"kiln warm-up at load: {warm_up_s['kiln']:.1f} s"
            + (f", {g.captures} graphs captured ({g.graph_bytes / 2**20:.0f} MiB)" if g is not None else ""))
    if args.no_split and context.buckets is not None:
        context.buckets.batch = None  # every run padded whole to its bucket (the behaviour before splitting)

    runners: dict[str, object] = {}
    if cuda:
        module = zoo.torch_model(args.model).cuda().half().eval()
        device_requests = [{k: torch.from_numpy(v).cuda() for k, v in r.items()} for r in requests]

        def eager(r):
            return module(**r)

        runners["kiln"] = lambda r: context.run(r)
        runners["torch eager"] = eager
        if not args.no_compile:
            compiled = torch.compile(module, dynamic=True)
            runners["torch.compile dynamic"] = lambda r: compiled(**r)
        if args.reduce_overhead:
            graphed = torch.compile(module, mode="reduce-overhead", dynamic=True)
            runners["torch.compile reduce-overhead"] = lambda r: graphed(**r)
        feeds = device_requests
        reference32 = zoo.torch_model(args.model).cuda().float().eval()
    else:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        options.inter_op_num_threads = 1
        if args.no_spin:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
        runners["kiln"] = lambda r: context.run(r)
        runners["onnxruntime"] = lambda r: session.run(None, r)
        feeds = requests
        reference32 = None

    # correctness on a few requests: real tokens only (padded positions are free to differ)
    with torch.inference_mode():
        for k in range(0, len(requests), max(1, len(requests) // 4)):
            got = np.asarray(next(iter(context.run(feeds[k]).values())).float().cpu() if cuda
                             else next(iter(context.run(feeds[k]).values())), dtype=np.float32)
            if cuda:
                want = reference32(**{n: v for n, v in feeds[k].items()})
                want = np.asarray(want.float().cpu())
            else:
                want = runners["onnxruntime"](feeds[k])[0]
            real = requests[k]["attention_mask"].astype(bool)
            err = float(np.abs(got[real] - want[real]).max())
            log(f"request {k} {list(requests[k]['input_ids'].shape)}: max |kiln - reference| over real tokens "
                f"{err:.3g} (|ref| max {float(np.abs(want[real]).max()):.3g})")

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if not args.no_warm_up:
        warm_up_s.update(warm_up_compiled({n: r for n, r in runners.items() if n.startswith("torch.compile")},
                                          args.max_batch, args.max_seq, log))
    load_before = os.getloadavg()[0]
    times: dict[str, list[float]] = {name: [] for name in runners}
    firsts: dict[str, list[float]] = {name: [] for name in runners}
    seen: dict[str, set] = {name: set() for name in runners}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    memory_before = torch.cuda.memory_allocated() if cuda else 0
    captures_before = context.runner.stats.captures if cuda else 0
    with torch.inference_mode():
        for done, (r, shapes) in enumerate(zip(feeds, requests)):
            if args.stream_deadline_s and done >= 10 and time.perf_counter() - STARTED > args.stream_deadline_s:
                log(f"stream stopped at its deadline ({args.stream_deadline_s:.0f} s after the start): {done} of "
                    f"{len(requests)} requests run")
                requests, feeds = requests[:done], feeds[:done]
                break
            key = shapes["input_ids"].shape
            for name, run in runners.items():
                sync()
                t0 = time.perf_counter()
                run(r)
                sync()
                ms = 1000 * (time.perf_counter() - t0)
                times[name].append(ms)
                if key not in seen[name]:
                    firsts[name].append(ms)
                    seen[name].add(key)
    peers = [n for n in runners if n != "kiln"]
    fastest = [min(times[p][i] for p in peers) for i in range(len(requests))]
    ratios = [k / f for k, f in zip(times["kiln"], fastest)]
    warm_ratios = ratios[len(ratios) // 2:]
    stats = {name: summary(times[name], firsts[name]) for name in runners}

    device = torch.cuda.get_device_name() if cuda else _cpu_name()
    log("")
    log(f"# kiln at every shape: {args.model}, {args.device} ({device}), commit {commit()}, "
        f"{datetime.date.today().isoformat()}")
    log(f"{len(requests)} requests, batch 1-{args.max_batch} x seq 1-{args.max_seq}, each with a padding mask; "
        f"{'fp16' if cuda else 'fp32, ' + str(args.threads) + ' threads'}; ms per request (wall, synchronized)"
        + ("" if cuda else f"; idle threads {'sleep (--no-spin)' if args.no_spin else _spin()}; load average "
           f"{load_before:.1f} before the stream, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} cores)"))
    log("")
    log("| runtime | p50 | p99 | 2nd-half p50 | 2nd-half p99 | 2nd-half p99/p50 | first call (mean) | stream total s "
        "| warm-up s |")
    log("|---|---|---|---|---|---|---|---|---|")
    for name, s in stats.items():
        log(f"| {name} | {s['p50']:.3f} | {s['p99']:.3f} | {s['warm_p50']:.3f} | {s['warm_p99']:.3f} | "
            f"{s['warm_p99'] / s['warm_p50']:.2f} | {s['first_ms']:.1f} | {s['total_s']:.2f} | "
            f"{warm_up_s.get(name, 0):.1f} |")
    total_fastest = min(stats[p]["total_s"] for p in peers)
    log("")
    log(f"kiln / fastest peer per request: median {statistics.median(ratios):.2f}, worst {max(ratios):.2f}; after "
        f"warm-up median {statistics.median(warm_ratios):.2f}, worst {max(warm_ratios):.2f}, slower than the "
        f"fastest peer on {sum(r > 1 for r in warm_ratios)} of {len(warm_ratios)} requests; "
        f"stream total {stats['kiln']['total_s'] / total_fastest:.2f}x the fastest peer's")
    if cuda:  # issue 10's target: kiln >= 1.5x the fastest torch mode at every shape (kiln / fastest <= 0.667)
        missed = [i for i, x in enumerate(ratios) if x > 1 / 1.5]
        log(f"target 1.5x the fastest torch mode: met on {len(ratios) - len(missed)} of {len(ratios)} requests "
            f"(after warm-up {sum(x <= 1 / 1.5 for x in warm_ratios)} of {len(warm_ratios)}); stream total "
            f"{total_fastest / stats['kiln']['total_s']:.2f}x; missed at: "
            + (", ".join(f"#{i} {list(requests[i]['input_ids'].shape)} "
                         f"({int(requests[i]['attention_mask'].sum())} real) {1 / ratios[i]:.2f}x"
                         for i in sorted(missed, key=lambda i: ratios[i], reverse=True)[:12]) or "none"))
    tokens = [int(r["input_ids"].size) for r in requests]
    for low, high in ((0, 512), (512, 4096), (4096, 1 << 30)):
        picked = [x for x, n in zip(ratios, tokens) if low <= n < high]
        if picked:
            log(f"  batch x seq in [{low}, {high}): {len(picked)} requests, kiln / fastest median "
                f"{statistics.median(picked):.2f}, worst {max(picked):.2f}")
    worst = sorted(range(len(ratios)), key=lambda i: -ratios[i])[:5]
    log("  worst requests: " + ", ".join(f"#{i} {list(requests[i]['input_ids'].shape)} {ratios[i]:.2f}"
                                         for i in worst))
    if args.per_request:
        log("")
        log("| request | batch x seq | real tokens | " + " | ".join(f"{name} ms" for name in runners)
            + " | kiln / fastest |")
        log("|---|---|---|" + "---|" * len(runners) + "---|")
        for i, r in enumerate(requests):
            log(f"| #{i} | {'x'.join(map(str, r['input_ids'].shape))} | {int(r['attention_mask'].sum())} | "
                + " | ".join(f"{times[name][i]:.1f}" for name in runners) + f" | {ratios[i]:.2f} |")
    if cuda:
        g = context.runner.stats
        log(f"CUDA graphs: {g.captures} captured, {g.replays} replays, {g.evictions} evicted, {g.eager_runs} eager "
            f"runs, {g.split_runs} runs split into chunks{' (splitting off)' if args.no_split else ''}, {g.graphs} "
            f"held ({g.graph_bytes / 2**20:.0f} MiB); {g.captures - captures_before} captured during the stream; "
            f"device memory peak {(torch.cuda.max_memory_allocated() - memory_before) / 2**20:.0f} MiB above the "
            f"start, {torch.cuda.memory_reserved() / 2**30:.1f} GiB reserved")
        for signature, reason in list(g.eager_reasons.items())[:3]:
            log(f"  eager {signature}: {reason}")
    padding = context._first_calls if not cuda else None  # kiln/runtime/first_calls.py (KILN_PAD_FIRST_CALLS=0: off)
    log(f"kiln {'load' if args.engine else 'build'} {build_s:.1f} s; buckets: "
        f"{sorted(context.buckets.symbols) if context.buckets else 'off'}; padded first calls: "
        + (f"{padding.padded_runs} runs" if padding is not None else "off"))
    if cuda and args.shapes:
        from per_shape import per_shape_table
        per_shape_table(args.shapes, context, runners, model.vocab_size, args.calls, log,
                        tuple(filter(None, args.kernels_at.split(","))))
    if cuda and args.packing_ab:
        from per_shape import packing_ab
        packing_ab(args.packing_ab, engine, context, model.vocab_size, args.calls, log)
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / f"dynamic-{args.device}-{datetime.date.today().isoformat()}.md", "a") as f:
        f.write(text + "\n")
    if args.out:
        Path(args.out, f"dynamic-{args.device}.md").write_text(text)


def warm_up_compiled(runners: dict, max_batch: int, max_seq: int, log) -> dict[str, float]:
    """Each torch.compile runner called at three shapes (batch 1, the largest, a small odd one: its compiles, the
    dynamic graph's included); the seconds each took."""
    took = {}
    for name, run in runners.items():
        t0 = time.perf_counter()
        with torch.inference_mode():
            for b, s in ((1, 8), (max_batch, max_seq), (2, 33)):
                ones = torch.ones(b, s, dtype=torch.int64, device="cuda")
                run({"input_ids": ones, "attention_mask": ones})
        torch.cuda.synchronize()
        took[name] = time.perf_counter() - t0
        log(f"{name} warm-up: 3 shapes in {took[name]:.1f} s")
    return took


def _spin() -> str:
    count = os.environ.get("GOMP_SPINCOUNT")
    return f"spin GOMP_SPINCOUNT={count}" if count else "spin (libgomp default)"


def _cpu_name() -> str:
    """The CPU model and the vector ISA kiln's kernels see (AVX2/FMA, AVX-512 or neither)."""
    name, flags = "?", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and name == "?":
            name = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    isa = "AVX-512" if "avx512f" in flags else "AVX2+FMA, no AVX-512" if {"avx2", "fma"} <= flags else "no AVX2"
    return f"{name}, {isa}"


if __name__ == "__main__":
    main()
