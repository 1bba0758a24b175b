"""Padding-free encoders (issue 10, remove padding): kiln without and with `remove_padding`, beside torch.

    python bench/remove_padding.py                         # H200: BERT-base fp16, CUDA events
    python bench/remove_padding.py --device cpu            # CPU: bert_tiny fp32, against onnxruntime

One ONNX export with symbolic batch x seq and an attention_mask; two kiln engines of one profile, built without
and with remove_padding. Each case is a batch x seq shape and a padding mask: right padding with real lengths
drawn uniformly in [S/2, S] (seed 0: ~25% padding), and at the largest shape also lengths in [1, S] (~50%, a
random stream's), no padding at all (the cost of packing), and left padding with one row all padding.

CUDA: GPU time per call by CUDA events around the call (the padding-free run's one host sync, counting the real
tokens, included), median of --calls after warm-up (its bucket's graph captured), for kiln, kiln padding-free (auto,
always packed, never packed: the plain program without counting tokens; the kiln engines timed call by call in
turn), torch eager fp16 and torch.compile(dynamic=True); correctness: the padding-free engine's outputs at real tokens
against torch fp16 (max abs error, tolerance TOLERANCE_FP16) and zeros at padding. CPU: per shape, right padding of
--padding fractions of the positions; process time per call (median of interleaved rounds) of kiln, kiln
padding-free with packing "auto", "always" and "never" (the identity packing) and onnxruntime (fp32, the oracle;
tolerance TOLERANCE_FP32); then the wall time of a call at a token count not run before (a view of the native
segment bound at its rows) against the same call again.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kiln  # noqa: E402
from kiln import zoo  # noqa: E402
from kiln.runtime.buckets import packed_rows  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import time_cuda  # noqa: E402  bench/gpu.py: CUDA-event times of single calls
from large_shapes import family  # noqa: E402  bench/large_shapes.py: kernel name -> family (gemm, attention...)

# fp16 storage through 12 layers against torch's own fp16 run: both round differently at every layer; the
# hidden state is LayerNorm'd (O(1) values), the plain engine's error measured beside it shows the baseline.
TOLERANCE_FP16 = 6e-2
TOLERANCE_FP32 = 1e-4  # fp32 against onnxruntime: summation order only


def masks(batch: int, seq: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """[batch, seq] int64 padding mask. right: lengths uniform in [S/2, S]; half: in [1, S]; full: no padding;
    left: lengths in [S/2, S] aligned right, the last row all padding."""
    mask = np.zeros((batch, seq), np.int64)
    low = 1 if kind == "half" else max(1, seq // 2)
    lengths = np.full(batch, seq) if kind == "full" else rng.integers(low, seq + 1, batch)
    for row, n in enumerate(lengths):
        if kind == "left":
            mask[row, seq - n:] = 1
        else:
            mask[row, :n] = 1
    if kind == "left" and batch > 1:
        mask[-1] = 0
    return mask


def cases(shapes: list[tuple[int, int]]) -> list[tuple[int, int, str]]:
    big = max(shapes, key=lambda bs: bs[0] * bs[1])
    return [(b, s, "right") for b, s in shapes] + [(*big, "half"), (*big, "full"), (*big, "left")]


def gpu_ms(fn, calls: int, warmup: int = 3) -> float:
    """Median GPU ms of one call between CUDA events, after `warmup` calls."""
    return statistics.median(time_cuda(fn, warmup=warmup, iters=calls))


def interleaved_gpu_ms(fns: dict[str, object], calls: int, warmup: int = 3) -> dict[str, float]:
    """Median ms of one call of each fn between CUDA events (synchronized after each), the fns taking turns call by
    call: a drift of the GPU's clocks over the run (a sustained load at 32x512) hits them alike, where timed one
    after the other the first would be timed at the highest clocks."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(calls):
        for name, fn in fns.items():
            times[name] += time_cuda(fn, warmup=0, iters=1)
    return {name: statistics.median(t) for name, t in times.items()}


def cpu_ms(fn, calls: int, warmup: int = 2) -> float:
    """Median process-CPU ms of one call (this process' threads: the load of other processes does not count)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        t = time.process_time()
        fn()
        times.append(1000 * (time.process_time() - t))
    return statistics.median(times)


def kernel_ms(fn, calls: int = 5) -> dict[str, tuple[float, float]]:
    """GPU ms and launches per call of each kernel fn runs (torch.profiler, `calls` calls after 3 warm-up ones)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(event.name, [0.0, 0.0])
            entry[0] += event.device_time_total / calls / 1000
            entry[1] += 1 / calls
    return {name: (ms, n) for name, (ms, n) in kernels.items()}


def kernel_comparison(label: str, plain: dict, free: dict, top: int = 8) -> list[str]:
    """Kernel families side by side (plain vs padding-free GPU ms per call), then the kernels whose time differs
    most: where the padding-free engine's time goes that the plain one's does not."""
    rows = [f"\n{label}: GPU kernel ms per call, plain {sum(v[0] for v in plain.values()):.3f}, padding-free "
            f"{sum(v[0] for v in free.values()):.3f}", "| family | plain ms | padding-free ms |", "|---|---|---|"]
    families = sorted({family(n) for n in [*plain, *free]})
    for fam in families:
        p = sum(ms for n, (ms, _) in plain.items() if family(n) == fam)
        f = sum(ms for n, (ms, _) in free.items() if family(n) == fam)
        rows.append(f"| {fam} | {p:.3f} | {f:.3f} |")
    rows += ["| kernel (largest differences) | plain ms (launches) | padding-free ms (launches) |", "|---|---|---|"]
    names = sorted({*plain, *free}, key=lambda n: -abs(free.get(n, (0, 0))[0] - plain.get(n, (0, 0))[0]))
    for name in names[:top]:
        (p, pn), (f, fn) = plain.get(name, (0.0, 0)), free.get(name, (0.0, 0))
        rows.append(f"| {name[:90]} | {p:.3f} ({pn:.0f}) | {f:.3f} ({fn:.0f}) |")
    return rows


def real_error(got: np.ndarray, want: np.ndarray, mask: np.ndarray) -> tuple[float, float]:
    """(max abs error at real tokens, max abs value at padding positions)."""
    keep = mask != 0
    err = float(np.abs(got[keep].astype(np.float32) - want[keep].astype(np.float32)).max()) if keep.any() else 0.0
    pad = float(np.abs(got[~keep]).max()) if (~keep).any() else 0.0
    return err, pad


def build(path: str, device: str, profile: str, remove_padding: bool, log, timing_cache: str | None = None) -> kiln.Engine:
    """One engine; both with one timing cache (the plain one first): the padding-free engine's plain program is
    then given the plain engine's tactics (kiln/builder/padding_free.py), and is that engine where it runs."""
    t = time.perf_counter()
    engine = kiln.build(path, device=device, precision="fp16" if device == "cuda" else "fp32",
                        profiles=[{"input_ids": profile}], remove_padding=remove_padding, timing_cache=timing_cache)
    removal = engine.plan.header.get("remove_padding")
    chosen = sorted({s.tactic or "default" for s in engine.plan.program.steps
                     if s.op_type in ("Attention", "PackedAttention")})
    tuned = (removal or {}).get("tuned_at")
    log(f"built {'padding-free' if remove_padding else 'plain'} engine in {time.perf_counter() - t:.1f} s"
        + (f": {removal['layers']} layers packed, {removal['attention']} attention" if removal else "")
        + (f", plain program of {removal['plain_program']} steps" if removal and removal.get("plain_program") else "")
        + (f", packed program tuned at {tuned['tokens']} rows ({tuned['mask']} mask)" if tuned else "")
        + f", attention tactic(s) {chosen}")
    return engine


def same_at_real(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> str:
    """"bitwise" when a and b agree to the bit at the real tokens, else their max abs difference there."""
    keep = mask != 0
    if np.array_equal(a[keep], b[keep]):
        return "bitwise"
    return f"{np.abs(a[keep].astype(np.float32) - b[keep].astype(np.float32)).max():.1e}"


def run_cuda(args, exported, shapes, log) -> list[str]:
    model = zoo.get(args.model)
    max_b, max_s = max(b for b, _ in shapes), max(s for _, s in shapes)
    profile = f"1x1,8x128,{max(32, max_b)}x{max(512, max_s)}"
    cache = str(Path(args.out or "/tmp", "remove-padding-timing.json"))
    if os.path.exists(cache):
        os.remove(cache)  # this run's own: the plain build's timings, then the padding-free build's cache hits
    plain = None if args.skip_plain else build(str(exported.path), "cuda", profile, False, log, cache)
    packed = build(str(exported.path), "cuda", profile, True, log, cache)
    plain_ctx = plain.create_execution_context() if plain is not None else None
    packed_ctx = packed.create_execution_context()  # packing "auto": where it pays (runtime/buckets.py)
    always_ctx = packed.create_execution_context(packing="always")  # every run packed: what packing costs
    never_ctx = packed.create_execution_context(packing="never")  # the plain program always: no token count
    module = zoo.torch_model(args.model).cuda().half().eval()
    compiled = None if args.no_compile else torch.compile(module, dynamic=True)
    rng = np.random.default_rng(0)
    big = max(shapes, key=lambda bs: bs[0] * bs[1])
    profiled = {(8, 128, "right"), (*big, "full"), (*big, "right")}  # the kernel tables: small, no padding, padded
    rows = ["| shape | mask | padding | packed rows (auto) | kiln ms | kiln padding-free ms | ... always packed ms | "
            "... never packed ms | torch eager ms | torch.compile ms | best torch / padding-free | kiln / padding-free | "
            "max err real (plain, free, always) vs torch fp16 | padding-free vs plain at real tokens | max at padding | ok |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    log(rows[0])
    with torch.inference_mode():
        for b, s, kind in cases(shapes):
            mask = masks(b, s, kind, rng)
            ids = rng.integers(0, model.vocab_size, (b, s), dtype=np.int64)
            feeds = {"input_ids": torch.from_numpy(ids).cuda(), "attention_mask": torch.from_numpy(mask).cuda()}
            want = module(**feeds).float().cpu().numpy()
            got = next(iter(packed_ctx.run(feeds).values())).float().cpu().numpy()
            err, pad = real_error(got, want, mask)
            always = next(iter(always_ctx.run(feeds).values())).float().cpu().numpy()
            always_err, always_pad = real_error(always, want, mask)
            rows_auto = packed_rows(feeds["attention_mask"], None, True)  # before the buckets' padding of B and S
            base_err, same = float("nan"), "-"
            if plain_ctx is not None:
                base = next(iter(plain_ctx.run(feeds).values())).float().cpu().numpy()
                base_err = real_error(base, want, mask)[0]
                same = same_at_real(got, base, mask)
            ok = max(err, always_err) <= TOLERANCE_FP16 and pad == always_pad == 0.0
            peers = {"free": lambda: packed_ctx.run(feeds), "always": lambda: always_ctx.run(feeds),
                     "never": lambda: never_ctx.run(feeds)}
            if plain_ctx is not None:
                peers["plain"] = lambda: plain_ctx.run(feeds)
            timed = interleaved_gpu_ms(peers, args.calls)  # the kiln peers call by call in turn
            k, f, a, n = timed.get("plain", float("nan")), timed["free"], timed["always"], timed["never"]
            e = gpu_ms(lambda: module(**feeds), args.calls)
            c = gpu_ms(lambda: compiled(**feeds), args.calls) if compiled is not None else float("nan")
            best = min(e, c) if compiled is not None else e
            rows.append(f"| {b}x{s} | {kind} | {1 - mask.mean():.0%} | {rows_auto} of {b * s} | {k:.3f} | {f:.3f} | "
                        f"{a:.3f} | {n:.3f} | {e:.3f} | {c:.3f} | {best / f:.2f}x | {k / f:.2f}x | "
                        f"{base_err:.2e}, {err:.2e}, {always_err:.2e} | {same} | {max(pad, always_pad):.1e} | "
                        f"{'ok' if ok else 'FAIL'} |")
            log(rows[-1])
            if plain_ctx is not None and args.kernels and (b, s, kind) in profiled:
                table = kernel_comparison(f"{b}x{s} {kind}, padding-free (auto)", kernel_ms(lambda: plain_ctx.run(feeds)),
                                          kernel_ms(lambda: packed_ctx.run(feeds)))
                rows += table
                log("\n".join(table))
    for label, context in (("padding-free", packed_ctx), ("always packed", always_ctx), ("never packed", never_ctx)):
        stats = context.runner.stats
        rows.append(f"\n{label} context: {stats.captures} graphs captured, {stats.replays} replays, "
                    f"{stats.eager_runs} eager runs"
                    + "".join(f"\n  eager: {r}" for r in set(stats.eager_reasons.values())))
    return rows


def right_padded(batch: int, seq: int, fraction: float) -> np.ndarray:
    """[batch, seq] int64 mask with round(fraction · B·S) padding positions at the rows' ends, spread evenly."""
    lengths = np.full(batch, seq)
    for k in range(int(round(fraction * batch * seq))):
        lengths[k % batch] -= 1
    return (np.arange(seq)[None, :] < np.maximum(lengths, 0)[:, None]).astype(np.int64)


def interleaved_cpu_ms(fns: dict[str, Callable[[], Any]], rounds: int, clock: str = "process") -> dict[str, float]:
    """Median ms of one call of each, in interleaved rounds (a burst of other processes' load hits every peer
    alike). "process": this process' CPU time (leaves out what other processes take, counts what its threads
    spin: an OpenMP pool waiting after a oneDNN GEMM); "wall": elapsed time."""
    now = time.process_time if clock == "process" else time.perf_counter
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = now()
            fn()
            times[name].append(1000 * (now() - t))
    return {name: statistics.median(v) for name, v in times.items()}


def fresh_tokens_ms(context, ids: np.ndarray, calls: int) -> tuple[float, float]:
    """(wall ms of a call at a real-token count the context has not run yet, of the same call again), medians:
    a new token count binds the native segment at its packed rows (kiln/runtime/native_views.py)."""
    batch, seq = ids.shape
    fresh, again = [], []
    for pad in range(1, calls + 1):
        feeds = {"input_ids": ids, "attention_mask": right_padded(batch, seq, 0.0)}
        feeds["attention_mask"].reshape(-1)[-pad:] = 0
        for out in (fresh, again):
            t = time.perf_counter()
            context.run(feeds)
            out.append(1000 * (time.perf_counter() - t))
    return statistics.median(fresh), statistics.median(again)


def run_cpu(args, exported, shapes, log) -> list[str]:
    """Per shape and padding fraction: kiln plain, padding-free ("auto", "always" packed, "never": the identity
    packing) and onnxruntime, process ms per call in interleaved rounds; then what a new token count costs."""
    import onnxruntime as ort

    max_b, max_s = max(b for b, _ in shapes), max(s for _, s in shapes)
    profile = f"1x1,{max_b}x{max_s},{max_b}x{max_s}"
    plain = build(str(exported.path), "cpu", profile, False, log)
    packed = build(str(exported.path), "cpu", profile, True, log)
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    # in one process beside kiln: onnxruntime's pool threads spinning after a run took the CPUs from kiln's next
    # calls (bert_tiny 8x128: kiln 30 ms per call in the rounds, 8.6 ms alone)
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
    contexts = {"kiln": plain.create_execution_context(),
                **{f"free {p}": packed.create_execution_context(packing=p) for p in ("auto", "always", "never")}}
    rng = np.random.default_rng(0)
    rows = [f"{args.clock} ms per call, median of {args.calls} interleaved rounds", "",
            "| shape | padding | packed rows (auto) | kiln ms | free auto ms | free always ms | free never (identity) ms "
            "| onnxruntime ms | kiln / free auto | ort / free auto | max err real vs onnxruntime | max at padding | "
            "ok | load |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    log(rows[0])
    vocab = zoo.get(args.model).vocab_size
    for b, s in shapes:
        for fraction in args.padding:
            mask = right_padded(b, s, fraction)
            feeds = {"input_ids": rng.integers(0, vocab, (b, s), dtype=np.int64), "attention_mask": mask}
            want = session.run(None, feeds)[0]
            errors = [real_error(next(iter(c.run(feeds).values())), want, mask) for n, c in contexts.items()
                      if n != "kiln"]
            err, pad = max(e for e, _ in errors), max(p for _, p in errors)
            ok = err <= TOLERANCE_FP32 and pad == 0.0
            fns = {n: (lambda c=c: c.run(feeds)) for n, c in contexts.items()}
            fns["onnxruntime"] = lambda: session.run(None, feeds)
            ms = interleaved_cpu_ms(fns, args.calls, args.clock)
            auto_rows = packed_rows(torch.from_numpy(mask), None, False)
            rows.append(f"| {b}x{s} | {1 - mask.mean():.0%} | {auto_rows} of {b * s} | {ms['kiln']:.3f} | "
                        f"{ms['free auto']:.3f} | {ms['free always']:.3f} | {ms['free never']:.3f} | "
                        f"{ms['onnxruntime']:.3f} | {ms['kiln'] / ms['free auto']:.2f}x | "
                        f"{ms['onnxruntime'] / ms['free auto']:.2f}x | {err:.2e} | {pad:.1e} | "
                        f"{'ok' if ok else 'FAIL'} | {open('/proc/loadavg').read().split()[0]} |")
            log(rows[-1])
    rows += ["", "A new real-token count (packing \"always\", right padding of 1, 2, ... positions): wall ms per call",
             "", "| shape | first call at its token count | the same call again |", "|---|---|---|"]
    always = packed.create_execution_context(packing="always")
    for b, s in shapes:
        fresh, again = fresh_tokens_ms(always, rng.integers(0, vocab, (b, s), dtype=np.int64), min(args.calls, 10))
        rows.append(f"| {b}x{s} | {fresh:.3f} | {again:.3f} |")
        log(rows[-1])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default=None, help="zoo encoder (default: bert_base on cuda, bert_tiny on cpu)")
    ap.add_argument("--shapes", default=None, help="BxS,... (default: 1x128,8x128,32x128,8x512,32x512 on cuda)")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per peer and case (median; CPU: rounds)")
    ap.add_argument("--clock", default="process", choices=["process", "wall"], help="CPU: what a call's ms are")
    ap.add_argument("--padding", type=lambda v: [float(x) for x in v.split(",")], default=[0.0, 0.06, 0.25, 0.5],
                    help="CPU: fractions of padding positions per shape (right padding)")
    ap.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
    ap.add_argument("--skip-plain", action="store_true", help="leave the engine without remove_padding out")
    ap.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=True,
                    help="CUDA: kernel tables of both engines at 8x128 and at the largest shape (full and right masks)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for remove-padding.md")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    args.model = args.model or ("bert_base" if cuda else "bert_tiny")
    default = "1x128,8x128,32x128,8x512,32x512" if cuda else "1x64,4x128,8x128"
    shapes = [tuple(int(x) for x in s.split("x")) for s in (args.shapes or default).split(",")]
    machine = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads, load " \
        + open("/proc/loadavg").read().split()[0]
    lines = [f"# remove padding: {args.model} on {machine}, torch {torch.__version__}, "
             f"commit {os.environ.get('KILN_COMMIT', '?')}"]

    def log(line: str) -> None:
        print(line, flush=True)

    log(lines[0])
    exported = zoo.export(args.model, batch=2, seq=16, dynamic=True)
    lines += (run_cuda if cuda else run_cpu)(args, exported, shapes, log)
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "remove-padding.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
