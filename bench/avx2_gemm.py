"""Transformer GEMMs on an AVX2-only CPU (issue 11), emulated on an AVX-512 one: GFLOP/s and % of the AVX2 FMA
peak per GEMM shape for kiln's pick (a one-layer engine, tuned here), kiln's own packed GEMM, torch's linear
(MKL), oneDNN (inner product and matmul) and onnxruntime's MLAS (a MatMul + Add model), side by side.

    python bench/avx2_gemm.py [--threads 2] [--rounds 5] [--models bert,minilm] [--batches 1,8] [--write]

The caps, all set before any library loads: `KILN_CPU_ISA=avx2` (kiln's C kernels built for x86-64-v3 and
dispatched to the AVX2 tile; ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2, ATEN_CPU_CAPABILITY=avx2),
and cpuid itself (bench/cpuid_avx2.py: CPUID faulting hides AVX-512, AMX and AVX-VNNI from every library in
the process, onnxruntime's MLAS included, which has no switch of its own). `--no-cpuid-cap` leaves MLAS on
the CPU's own ISA.

The peak: cores x clock x 32 FLOP/cycle (2 FMA units x 8 lanes x 2). The clock is measured, not read from
/proc/cpuinfo (a VM reports the TSC's 2.6 GHz, its cores boost past it): a chain of dependent FMAs retires one
per 4 cycles (FMA latency on Intel since Skylake and on AMD Zen 2-4), so chain steps per second x 4 is the
clock. Also printed: the measured FMA throughput (12 independent chains per core). Both are measured in
every round, just before the kernels; "% of peak" is per round (the kernel's fastest call over the peak of its
round), the median over rounds. --threads 1 counts the calling thread's CPU time (steady on a shared machine);
more threads count wall time, which on a machine others load says more about the load than the kernels. Not the
process's CPU time: Linux adds another thread's running slice to it only at the next tick or switch, so a call of
a few ms that ran on two threads can read less CPU time than one core's peak allows (seen here: MKL at 2 threads
"205 GFLOP/s per CPU-second" against a 130 GFLOP/s core).
BERT-base and DistilBERT share their GEMM shapes (hidden 768, FFN 3072); MiniLM-L6 is hidden 384, FFN 1536.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--no-cpuid-cap" not in sys.argv:
    import cpuid_avx2  # noqa: E402

    cpuid_avx2.enable()  # before torch, onnxruntime or kiln read cpuid
os.environ.setdefault("KILN_CPU_ISA", "avx2")

import argparse  # noqa: E402
import ctypes  # noqa: E402
import datetime  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gemm as gemm_bench  # noqa: E402  bench/gemm.py: the kernels side by side

from cpu import commit  # noqa: E402  bench/cpu.py

RESULTS = Path(__file__).resolve().parent / "results"

# model -> its GEMMs per token row: (what, K, N)
MODELS = {
    "bert": [("QKV fused", 768, 2304), ("Q/K/V or attention out", 768, 768), ("FFN up", 768, 3072),
             ("FFN down", 3072, 768)],
    "minilm": [("QKV fused", 384, 1152), ("Q/K/V or attention out", 384, 384), ("FFN up", 384, 1536),
               ("FFN down", 1536, 384)],
}
SEQ = 128

_CLOCK = r"""
#include <omp.h>
#include <time.h>
typedef float v8 __attribute__((vector_size(32)));
static double thread_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
/* GHz of the calling thread's core: 4 dependent FMA chains, each step waits on the last (4-cycle latency) */
__attribute__((target("avx2,fma"))) double kiln_fma_clock_ghz(long iters, int thread_clock) {
    v8 a0 = (v8){0} + 0.1f, a1 = (v8){0} + 0.2f, a2 = (v8){0} + 0.3f, a3 = (v8){0} + 0.4f;
    const v8 b = (v8){0} + 0.999999f, c = (v8){0} + 1e-7f;
    double t0 = thread_clock ? thread_seconds() : omp_get_wtime();
    for (long i = 0; i < iters; ++i) {
        a0 = a0 * b + c; a1 = a1 * b + c; a2 = a2 * b + c; a3 = a3 * b + c;
        __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3));
    }
    double seconds = (thread_clock ? thread_seconds() : omp_get_wtime()) - t0;
    volatile float sink = (a0 + a1 + a2 + a3)[0];
    (void)sink;
    return iters * 4.0 / seconds / 1e9;
}
"""


def peak_functions():
    from kiln.kernels.cpu import native_loop

    peak = ctypes.CDLL(str(native_loop.build("fma_peak", gemm_bench._FMA_PEAK))).kiln_fma_peak
    peak.restype, peak.argtypes = ctypes.c_double, [ctypes.c_int, ctypes.c_long, ctypes.c_int, ctypes.c_int]
    clock = ctypes.CDLL(str(native_loop.build("fma_clock", _CLOCK))).kiln_fma_clock_ghz
    clock.restype, clock.argtypes = ctypes.c_double, [ctypes.c_long, ctypes.c_int]
    return peak, clock


def kiln_engine(m: int, k: int, n: int, threads: int):
    """A one-layer engine (MatMul + Add, the weight a constant) built and tuned here: (run, pick record)."""
    import kiln
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(1)
    wt = rng.standard_normal((k, n), dtype=np.float32) / k ** 0.5
    b = rng.standard_normal(n, dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "wt"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])], "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
        [numpy_helper.from_array(wt, "wt"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = min(model.ir_version, 10)
    torch.set_num_threads(threads)
    engine = kiln.build(model.SerializeToString())
    layer = next(iter(engine.plan.header["tactics"]["layers"].values()))
    x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
    want = x.double() @ torch.from_numpy(wt).double() + torch.from_numpy(b).double()
    got = engine.run({"x": x})["y"]
    error = (torch.as_tensor(got).double() - want).abs().max().item()
    if error > 1e-3 * k ** 0.5:
        raise AssertionError(f"kiln engine {m}x{k}x{n}: max error {error}")
    return (lambda: engine.run({"x": x})), layer


def time_shape(m: int, k: int, n: int, args, peak, clock_ghz) -> tuple[dict[str, list[float]], list[float], list[float], dict]:
    """Per kernel: per round, the fastest call's GFLOP/s over the round's peak; plus the rounds' peaks and clocks."""
    thread_clock = args.threads == 1
    clock = time.thread_time if thread_clock else time.perf_counter
    fns = gemm_bench.runners(m, k, n, args.threads)
    run, pick = kiln_engine(m, k, n, args.threads)
    fns = {f"kiln engine (tuner's pick: {pick['tactic']})": run, **fns}
    flops = 2 * m * k * n
    calls = max(3, min(100, int(args.seconds_per_block * 100e9 / flops)))
    fractions = {key: [] for key in fns}
    gflops = {key: [] for key in fns}
    peaks, clocks = [], []
    for fn in fns.values():
        fn(), fn()
    for _ in range(args.rounds):
        round_peak = max(peak(args.threads, 2_000_000, 0, int(thread_clock)) for _ in range(2))
        ghz = max(clock_ghz(2_000_000, 1) for _ in range(2))  # the core's clock: its CPU time, whatever the load
        peaks.append(round_peak)
        clocks.append(ghz)
        nominal = args.threads * ghz * 32
        for key, fn in fns.items():
            best = flops / min(gemm_bench.call_times(fn, calls, clock)) / 1e9
            gflops[key].append(best)
            fractions[key].append(best / nominal)
    return {key: (gflops[key], fractions[key]) for key in fns}, peaks, clocks, pick


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="1: CPU time of the calling thread, else wall time")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds-per-block", type=float, default=0.05)
    ap.add_argument("--models", default="bert,minilm")
    ap.add_argument("--batches", default="1,8", help=f"sequences of {SEQ} tokens: M = batch x {SEQ}")
    ap.add_argument("--no-cpuid-cap", action="store_true", help="leave cpuid alone (MLAS then runs AVX-512)")
    ap.add_argument("--write", action="store_true", help="append the tables to bench/results/avx2-gemm-<date>d.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kiln.kernels.cpu import cpu_features, gemm_native

    peak, clock_ghz = peak_functions()
    name = gemm_bench.cpu_facts()[0]
    capped = (f"KILN_CPU_ISA={cpu_features.isa_cap()}; torch ATen {torch.backends.cpu.get_cpu_capability()}, "
              f"MKL_ENABLE_INSTRUCTIONS={os.environ.get('MKL_ENABLE_INSTRUCTIONS')}, "
              f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA')}, "
              + ("cpuid masked (no AVX-512/AMX/AVX-VNNI for any library: MLAS on its AVX2 kernels)"
                 if not args.no_cpuid_cap else "cpuid NOT masked (MLAS on AVX-512)"))
    head = (f"FP32 GEMM, {name}, {args.threads} thread(s), "
            + ("CPU time of the calling thread" if args.threads == 1 else "wall time")
            + f"; {capped}; kiln's tile {gemm_native.best_kernel().name}; {args.rounds} interleaved rounds; "
            f"load {os.getloadavg()[0]:.1f} at the start")
    print(head, flush=True)
    lines = ["| model GEMM | M x K x N | kernel | GFLOP/s (fastest call, median of rounds) | % of AVX2 peak "
             "(per round, median) | by round |", "|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    picks, rounds_info = [], []
    for model in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for what, k, n in MODELS[model]:
                m = batch * SEQ
                results, peaks, clocks, pick = time_shape(m, k, n, args, peak, clock_ghz)
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
    tail = [f"- clock measured by dependent FMA chains: {ghz:.2f} GHz (median over shapes' rounds) -> AVX2 peak "
            f"{args.threads} x {ghz:.2f} x 32 = {args.threads * ghz * 32:.0f} GFLOP/s; 12 independent FMA chains "
            f"measured {measured:.0f} GFLOP/s", f"- load {os.getloadavg()[0]:.1f} at the end, {os.cpu_count()} CPUs",
            "- the tuner's picks (one-layer engines built here, at these threads):", *picks]
    if not args.no_cpuid_cap:
        tail.append(f"- cpuids answered masked: {cpuid_avx2.faults()}")
    print("\n".join(tail))
    if args.write:
        now = datetime.datetime.now(datetime.timezone.utc)
        out = RESULTS / f"avx2-gemm-{now:%Y-%m-%d}d.md"
        earlier = out.read_text() if out.exists() else ""
        out.write_text(earlier + ("\n---\n\n" if earlier else "") + "\n".join([
            f"## bench/avx2_gemm.py --threads {args.threads}, {now:%Y-%m-%d %H:%M} UTC, commit {commit()}", "",
            head, "", *lines, "", *tail, ""]))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
