"""Transformer GEMMs per model (issue 11): GFLOP/s and % of the core's FMA peak per GEMM shape for kiln's pick
(a one-layer engine, tuned here), kiln's own packed GEMM, torch's linear (MKL), MKL's packed GEMM, oneDNN
(inner product and matmul) and onnxruntime's MLAS (a one-node MatMul model, + Add where the model has a bias),
side by side, at the ISA kiln runs (KILN_CPU_ISA=avx2 caps kiln and the libraries it calls; bench/avx2_gemm.py
caps onnxruntime's MLAS too).

    python bench/gemm_models.py [--threads 1] [--rounds 5] [--models t5,bert] [--batches 1] [--cold] [--write]

The peak: cores x clock x FLOPs per cycle (2 FMA units x lanes x 2: 32 on AVX2, 64 on AVX-512). The clock is
measured, not read from /proc/cpuinfo (a VM reports the TSC's 2.6 GHz, its cores boost past it, and a core
may run AVX-512 at a lower clock than AVX2): a chain of dependent FMAs at the ISA's width retires one per 4
cycles (FMA latency on Intel since Skylake and on AMD Zen 2-4), so chain steps per second x 4 is the clock.
Also measured: the throughput of 12 independent FMA chains per core. Both in every round, just before the
kernels; a round's peak is the larger of the two (interference from other work makes either read low, never
high); "% of peak" is per round (the kernel's fastest call over the peak of its round), the median over rounds. --threads 1 counts the calling thread's CPU time (steady on a shared machine); more threads
count wall time, which on a machine others load says more about the load than the kernels. Not the process's
CPU time: Linux adds another thread's running slice to it only at the next tick or switch.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemm as gemm_bench  # noqa: E402  bench/gemm.py: the kernels side by side

from cpu import commit  # noqa: E402  bench/cpu.py

# model -> (bias, its GEMMs per token row: (what, K, N)). BERT-base and DistilBERT share their shapes (hidden 768,
# FFN 3072); MiniLM-L6 is hidden 384, FFN 1536; T5-small is d_model 512, 8 heads x 64, d_ff 2048, no biases
# (kiln merges q|k|v into one GEMM).
MODELS = {
    "bert": (True, [("QKV fused", 768, 2304), ("Q/K/V or attention out", 768, 768), ("FFN up", 768, 3072),
                    ("FFN down", 3072, 768)]),
    "minilm": (True, [("QKV fused", 384, 1152), ("Q/K/V or attention out", 384, 384), ("FFN up", 384, 1536),
                      ("FFN down", 1536, 384)]),
    "t5": (False, [("QKV fused", 512, 1536), ("q/k/v or attention out", 512, 512), ("FFN wi", 512, 2048),
                   ("FFN wo", 2048, 512)]),
}
SEQ = 128
COLD_BYTES = 64 << 20  # --cold: written between calls, more than this VM's cores' L2 and their share of L3

_CLOCK = r"""
#include <omp.h>
#include <time.h>
typedef float v8 __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));
static double thread_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
/* 4 dependent FMA chains of V: each step waits on the last (4-cycle latency); steps per second x 4 */
#define CLOCK(V, TARGET, NAME)                                                                         \
    __attribute__((target(TARGET))) static double NAME(long iters, int thread_clock) {                \
        V a0 = (V){0} + 0.1f, a1 = (V){0} + 0.2f, a2 = (V){0} + 0.3f, a3 = (V){0} + 0.4f;               \
        const V b = (V){0} + 0.999999f, c = (V){0} + 1e-7f;                                            \
        double t0 = thread_clock ? thread_seconds() : omp_get_wtime();                                 \
        for (long i = 0; i < iters; ++i) {                                                             \
            a0 = a0 * b + c; a1 = a1 * b + c; a2 = a2 * b + c; a3 = a3 * b + c;                        \
            __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3));                             \
        }                                                                                              \
        double seconds = (thread_clock ? thread_seconds() : omp_get_wtime()) - t0;                     \
        volatile float sink = (a0 + a1 + a2 + a3)[0];                                                  \
        (void)sink;                                                                                    \
        return iters * 4.0 / seconds / 1e9;                                                            \
    }
CLOCK(v8, "avx2,fma", clock8)
CLOCK(v16, "avx512f", clock16)
/* GHz of the calling thread's core running FMAs `wide` (16 lanes) or not (8) */
double kiln_fma_clock_ghz(long iters, int wide, int thread_clock) {
    return wide ? clock16(iters, thread_clock) : clock8(iters, thread_clock);
}
"""


def peak_functions():
    """(12-chain FMA throughput (threads, iters, wide, thread_clock) -> GFLOP/s, clock (iters, wide, thread_clock) -> GHz)."""
    from kiln.kernels.cpu import native_loop

    peak = ctypes.CDLL(str(native_loop.build("fma_peak", gemm_bench._FMA_PEAK))).kiln_fma_peak
    peak.restype, peak.argtypes = ctypes.c_double, [ctypes.c_int, ctypes.c_long, ctypes.c_int, ctypes.c_int]
    clock = ctypes.CDLL(str(native_loop.build("fma_clock_isa", _CLOCK))).kiln_fma_clock_ghz
    clock.restype, clock.argtypes = ctypes.c_double, [ctypes.c_long, ctypes.c_int, ctypes.c_int]
    return peak, clock


def kiln_engine(m: int, k: int, n: int, threads: int, bias: bool):
    """A one-layer engine (MatMul, + Add with `bias`; the weight a constant) built and tuned here: (run, pick record)."""
    import kiln
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    wt = rng.standard_normal((k, n), dtype=np.float32) / k ** 0.5
    b = rng.standard_normal(n, dtype=np.float32)
    nodes = [helper.make_node("MatMul", ["x", "wt"], ["xw" if bias else "y"])]
    constants = [numpy_helper.from_array(wt, "wt")]
    if bias:
        nodes.append(helper.make_node("Add", ["xw", "b"], ["y"]))
        constants.append(numpy_helper.from_array(b, "b"))
    graph = helper.make_graph(nodes, "gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])], constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = min(model.ir_version, 10)
    torch.set_num_threads(threads)
    engine = kiln.build(model.SerializeToString())
    layer = next(iter(engine.plan.header["tactics"]["layers"].values()))
    x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
    want = x.double() @ torch.from_numpy(wt).double() + (torch.from_numpy(b).double() if bias else 0)
    got = engine.run({"x": x})["y"]
    error = (torch.as_tensor(got).double() - want).abs().max().item()
    if error > 1e-3 * k ** 0.5:
        raise AssertionError(f"kiln engine {m}x{k}x{n}: max error {error}")
    return (lambda: engine.run({"x": x})), layer


def call_times(fn, calls: int, clock, evict: torch.Tensor | None) -> list[float]:
    """`calls` calls of fn, each timed on `clock`; with `evict`, that buffer is written before each call (not
    timed), so that the weight comes from memory as in a network, where the layers between two calls of one
    GEMM stream tens of MB of other weights through the caches."""
    times = []
    for _ in range(calls):
        if evict is not None:
            evict.add_(1.0)
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return times


def time_shape(m: int, k: int, n: int, bias: bool, args, peak, clock_ghz, per_cycle: int):
    """Per kernel: per round, the fastest call's GFLOP/s and its fraction of the round's peak; plus the rounds'
    12-chain throughputs and clocks, and the engine's pick."""
    thread_clock = args.threads == 1
    clock = time.thread_time if thread_clock else time.perf_counter
    wide = int(per_cycle == 64)
    fns = gemm_bench.runners(m, k, n, args.threads, bias)
    run, pick = kiln_engine(m, k, n, args.threads, bias)
    fns = {f"kiln engine (tuner's pick: {pick['tactic']})": run, **fns}
    flops = 2 * m * k * n
    calls = max(3, min(10 if args.cold else 100, int(args.seconds_per_block * 100e9 / flops)))
    fractions = {key: [] for key in fns}
    gflops = {key: [] for key in fns}
    peaks, clocks = [], []
    evict = torch.zeros(COLD_BYTES // 4) if args.cold else None
    for fn in fns.values():
        fn(), fn()
    for _ in range(args.rounds):
        peaks.append(max(peak(args.threads, 2_000_000, wide, int(thread_clock)) for _ in range(2)))
        ghz = max(clock_ghz(2_000_000, wide, 1) for _ in range(2))  # the core's clock: its CPU time, whatever the load
        clocks.append(ghz)
        round_peak = max(args.threads * ghz * per_cycle, peaks[-1])  # each reads low when interference hits it
        for key, fn in fns.items():
            best = flops / min(call_times(fn, calls, clock, evict)) / 1e9
            gflops[key].append(best)
            fractions[key].append(best / round_peak)
    return {key: (gflops[key], fractions[key]) for key in fns}, peaks, clocks, pick


def main(capped: str = "", out_stem: str = "gemm") -> None:
    """`capped`: what a wrapper (bench/avx2_gemm.py) capped, for the table's head; `out_stem`: --write's file name."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="1: CPU time of the calling thread, else wall time")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds-per-block", type=float, default=0.05)
    ap.add_argument("--models", default="t5,bert", help=f"of {sorted(MODELS)}")
    ap.add_argument("--batches", default="1", help=f"sequences of {SEQ} tokens: M = batch x {SEQ}")
    ap.add_argument("--cold", action="store_true", help=f"evict the caches before each call ({COLD_BYTES >> 20} MB written)")
    ap.add_argument("--no-cpuid-cap", action="store_true", help="bench/avx2_gemm.py: leave cpuid alone")
    ap.add_argument("--write", action="store_true", help=f"append the tables to bench/results/{out_stem}-<date>d.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kiln.kernels.cpu import cpu_features, gemm_native

    peak, clock_ghz = peak_functions()
    name, _, per_cycle = gemm_bench.cpu_facts()
    isa = cpu_features.isa()
    capped = capped or (f"KILN_CPU_ISA={cpu_features.isa_cap()} (kiln, oneDNN, MKL, ATen capped; onnxruntime's MLAS "
                        "NOT: bench/avx2_gemm.py caps it)" if cpu_features.isa_cap() else "no ISA cap")
    head = (f"FP32 GEMM, {name}, {args.threads} thread(s), "
            + ("CPU time of the calling thread" if args.threads == 1 else "wall time")
            + f"; {isa} ({per_cycle} FLOP/cycle/core); {capped}; kiln's tile {gemm_native.linear_kernel().name}; "
            f"torch {torch.__version__}; {args.rounds} interleaved rounds"
            + ("; caches evicted before each call (--cold)" if args.cold else "; caches warm (calls back to back)")
            + f"; load {os.getloadavg()[0]:.1f} at the start")
    print(head, flush=True)
    lines = [f"| model GEMM | M x K x N | kernel | GFLOP/s (fastest call, median of rounds) | % of {isa} peak "
             "(per round, median) | % by round |", "|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    picks, rounds_info = [], []
    for model in args.models.split(","):
        bias, gemms = MODELS[model]
        for batch in (int(b) for b in args.batches.split(",")):
            for what, k, n in gemms:
                m = batch * SEQ
                results, peaks, clocks, pick = time_shape(m, k, n, bias, args, peak, clock_ghz, per_cycle)
                rounds_info.append((statistics.median(clocks), statistics.median(peaks)))
                cands = ", ".join(f"{t} {ms:.2f}" for t, ms in sorted(pick["candidates"].items(), key=lambda kv: kv[1]))
                picks.append(f"- {model} {what} {m}x{k}x{n}: picked {pick['tactic']} ({pick.get('clock', '?')} clock; "
                             f"candidates ms: {cands})")
                for key, (g, f) in sorted(results.items(), key=lambda kv: -statistics.median(kv[1][1])):
                    line = (f"| {model} {what} | {m} x {k} x {n} | {key} | {statistics.median(g):.1f} | "
                            f"{100 * statistics.median(f):.0f}% | {', '.join(f'{100 * v:.0f}' for v in f)} |")
                    lines.append(line)
                    print(line, flush=True)
    ghz = statistics.median(c for c, _ in rounds_info)
    measured = statistics.median(p for _, p in rounds_info)
    tail = [f"- clock measured by dependent {isa} FMA chains: {ghz:.2f} GHz (median over shapes' rounds) -> {isa} peak "
            f"{args.threads} x {ghz:.2f} x {per_cycle} = {args.threads * ghz * per_cycle:.0f} GFLOP/s; 12 independent "
            f"FMA chains measured {measured:.0f} GFLOP/s", f"- load {os.getloadavg()[0]:.1f} at the end, {os.cpu_count()} CPUs",
            "- the tuner's picks (one-layer engines built here, at these threads):", *picks]
    print("\n".join(tail))
    if args.write:
        now = datetime.datetime.now(datetime.timezone.utc)
        out = Path(__file__).resolve().parent / "results" / f"{out_stem}-{now:%Y-%m-%d}d.md"
        earlier = out.read_text() if out.exists() else ""
        out.write_text(earlier + ("\n---\n\n" if earlier else "") + "\n".join([
            f"## bench/{Path(sys.argv[0]).name} --threads {args.threads}, {now:%Y-%m-%d %H:%M} UTC, commit {commit()}",
            "", head, "", *lines, "", *tail, ""]))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
