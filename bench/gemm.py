"""FP32 GEMM on the CPU, per transformer shape: GFLOP/s and % of the cores' FMA peak for each kernel
kiln can pick, side by side with onnxruntime's MLAS (a one-node MatMul + Add model), same threads.

    python bench/gemm.py [--threads 2] [--rounds 5] [--shapes 128x768x3072,...] [--write]

Kernels: kiln's packed GEMM (cpu.gemm.kiln_packed), torch's F.linear (MKL), MKL's packed GEMM
(cpu.gemm.mkl), oneDNN's inner product through its C API with the weight in its kernel's layout
(cpu.gemm.onednn_direct) and onnxruntime's MatMul + Add (MLAS); each computes x Wᵀ + b. kiln's writes
into one preallocated output (in an engine its GEMMs write into a native segment's arena, as
onnxruntime's into its own); the others allocate theirs per call (MLAS from onnxruntime's arena).

Two peaks: nominal = cores x the MHz /proc/cpuinfo reports x FLOPs per cycle (2 FMA units x lanes x 2:
32 on AVX2, 64 on AVX-512), and measured = the cores running independent FMA chains at once (a
virtual CPU that boosts runs above its nominal clock: the measured peak is the honest ceiling).
Timed in interleaved rounds (each kernel a block of calls per round, a shared machine's drift lands
on all alike). Per round, each block's median call and its fastest call; the table gives the median
over rounds of both. On a machine shared with other work the fastest calls are the kernel's own speed
(% of peak and 'by round', kiln / MLAS, are computed from them), the medians what a caller got.
`--clock thread` (with --threads 1) counts the calling thread's CPU time instead of wall time: on a
machine shared with other work it leaves out the time the kernel was descheduled, so it measures what
each kernel does with a core while it has one (every kernel then runs in the calling thread).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu import commit, wait_for_quiet  # noqa: E402  bench/cpu.py

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = [(m, k, n) for m in (1, 8, 128, 512) for k, n in ((768, 768), (768, 3072), (3072, 768))] + [
    (128, 768, 2304)]  # BERT-base: attention output (768 -> 768), FFN up, FFN down at M tokens; fused QKV
KILN, MLAS = "kiln packed GEMM (cpu.gemm.kiln_packed)", "onnxruntime MatMul[+Add] (MLAS)"

_FMA_PEAK = r"""
#include <omp.h>
#include <time.h>
typedef float v8 __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));
#define CHAINS(V, TARGET, NAME)                                                                  \
    __attribute__((target(TARGET))) static float NAME(long iters) {                            \
        V a0 = (V){0} + 0.1f, a1 = (V){0} + 0.2f, a2 = (V){0} + 0.3f, a3 = (V){0} + 0.4f,        \
          a4 = (V){0} + 0.5f, a5 = (V){0} + 0.6f, a6 = (V){0} + 0.7f, a7 = (V){0} + 0.8f,        \
          a8 = (V){0} + 0.9f, a9 = (V){0} + 1.0f, a10 = (V){0} + 1.1f, a11 = (V){0} + 1.2f;      \
        const V b = (V){0} + 0.999999f, c = (V){0} + 1e-7f;                                      \
        for (long i = 0; i < iters; ++i) {                                                       \
            a0 = a0 * b + c; a1 = a1 * b + c; a2 = a2 * b + c; a3 = a3 * b + c;                  \
            a4 = a4 * b + c; a5 = a5 * b + c; a6 = a6 * b + c; a7 = a7 * b + c;                  \
            a8 = a8 * b + c; a9 = a9 * b + c; a10 = a10 * b + c; a11 = a11 * b + c;              \
        }                                                                                        \
        V s = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;                       \
        return s[0];                                                                             \
    }
CHAINS(v8, "avx2,fma", chains8)
CHAINS(v16, "avx512f", chains16)
static double thread_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
/* GFLOP/s of `threads` threads each running 12 independent FMA chains for `iters` steps; thread_clock
   (one thread): over the thread's CPU time, not the wall clock */
double kiln_fma_peak(int threads, long iters, int wide, int thread_clock) {
    volatile float sink = 0.0f;
    double t0 = thread_clock ? thread_seconds() : omp_get_wtime();
    #pragma omp parallel num_threads(threads)
    {
        float s = wide ? chains16(iters) : chains8(iters);
        #pragma omp atomic
        sink += s;
    }
    double seconds = (thread_clock ? thread_seconds() : omp_get_wtime()) - t0;
    return threads * (double)iters * 12 * (wide ? 16 : 8) * 2 / seconds / 1e9;
}
"""


def cpu_facts() -> tuple[str, float, int]:
    """(model name, nominal GHz, FP32 FLOPs per cycle per core at the ISA kiln uses: KILN_CPU_ISA=avx2 caps it)."""
    from kiln.kernels.cpu import cpu_features

    name, mhz = "?", 0.0
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and name == "?":
            name = value.strip()
        elif key == "cpu MHz" and not mhz:
            mhz = float(value)
    return name, mhz / 1000, cpu_features.fma_flops_per_cycle()


def measured_peak(threads: int, per_cycle: int, thread_clock: bool) -> float | None:
    """Best of 5 runs of the FMA chains on `threads` threads (GFLOP/s), or None without a C compiler."""
    import ctypes

    from kiln.kernels.cpu import native_loop

    built = native_loop.build("fma_peak", _FMA_PEAK)
    if isinstance(built, str):
        return None
    fn = ctypes.CDLL(str(built)).kiln_fma_peak
    fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_int, ctypes.c_long, ctypes.c_int, ctypes.c_int]
    return max(fn(threads, 20_000_000, int(per_cycle == 64), int(thread_clock)) for _ in range(5))


def mlas_runner(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, threads: int):
    """onnxruntime's MatMul (+ Add with a bias b; MLAS) computing x Wᵀ (+ b), one call per call of the returned
    function (its output a list of one array). ImportError without onnxruntime."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    (m, k), n = x.shape, w.shape[0]
    nodes = [helper.make_node("MatMul", ["x", "wt"], ["y" if b is None else "xw"])]
    constants = [numpy_helper.from_array(w.numpy().T.copy(), "wt")]
    if b is not None:
        nodes.append(helper.make_node("Add", ["xw", "b"], ["y"]))
        constants.append(numpy_helper.from_array(b.numpy(), "b"))
    graph = helper.make_graph(nodes, "gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])], constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = min(model.ir_version, 10)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {"x": x.numpy()}
    return lambda: session.run(None, feeds)


def runners(m: int, k: int, n: int, threads: int, bias: bool = True) -> dict:
    """Every kernel computing x Wᵀ (+ b with `bias`) on fresh random operands, checked against float64 first."""
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
    w = torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32))
    b = torch.from_numpy(rng.standard_normal(n, dtype=np.float32)) if bias else None
    out = {}
    from kiln.kernels.cpu import gemm, gemm_native, mkl_available, onednn

    if gemm_native.available():
        y = torch.empty(m, n)
        default = gemm_native.linear_kernel()
        for kernel in gemm_native.kernels():  # the default tile, and the other tiles of its ISA
            if kernel.supported and not kernel.test_only and kernel.name.split()[0] == default.name.split()[0]:
                packed = gemm_native.PackedLinear(w, b, kernel=kernel)
                key = KILN if kernel == default else f"kiln packed GEMM, its {kernel.name} tile"
                out[key] = lambda packed=packed: packed(x, out=y)  # into a buffer of its own, as into a segment's arena
    out["torch F.linear (MKL)"] = lambda: F.linear(x, w, b)
    from kiln.kernels.cpu.conv import post_op

    none = post_op("", 0.0, 0.0)
    if mkl_available():
        mkl = gemm.pack_linear_mkl(w, m)
        out["MKL packed GEMM (cpu.gemm.mkl)"] = lambda: gemm.linear_mkl(x, mkl, w, b, m, None, none, True)
    if torch.backends.mkldnn.is_available():
        packed_dnnl = gemm.pack_linear_onednn(w, m)
        out["torch's oneDNN linear (cpu.gemm.onednn)"] = lambda: gemm.linear_onednn(x, packed_dnnl, b, None, none, True)
    if onednn.available():
        from kiln.kernels.cpu.onednn_matmul import Matmul
        from kiln.kernels.cpu.onednn_primitives import InnerProduct

        ip = InnerProduct(w, b, m, None, False, True)
        out[f"oneDNN inner product (cpu.gemm.onednn_direct, {ip.implementation})"] = lambda: ip(x)
        at_rows = Matmul(w, b, None).rows(m)  # the tactic takes it only at <= 2 or >= 256 rows (RUNTIME_ROWS_*)
        out[f"oneDNN matmul, runtime M ({at_rows.implementation})"] = lambda: at_rows(x)
    try:
        out[MLAS] = mlas_runner(x, w, b, threads)
    except ImportError:
        return out
    reference = F.linear(x.double(), w.double(), None if b is None else b.double())
    for name, fn in out.items():  # every kernel computes the same thing before it is timed
        got = torch.as_tensor(np.asarray(fn()[0] if name == MLAS else fn()))
        assert torch.allclose(got.double(), reference, rtol=1e-3, atol=1e-3 * k ** 0.5), name
    return out


@dataclass
class Rounds:
    """Seconds per call of one kernel, per round: the block's median and its fastest call."""

    median: list[float] = field(default_factory=list)
    fastest: list[float] = field(default_factory=list)


def call_times(fn, calls: int, clock) -> list[float]:
    """`calls` calls of fn, each timed on `clock` (time.thread_time or time.perf_counter)."""
    times = []
    for _ in range(calls):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return times


def time_shape(m: int, k: int, n: int, args) -> dict[str, Rounds]:
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    fns = runners(m, k, n, args.threads)
    calls = max(3, min(200, int(args.seconds_per_block * 60e9 / (2 * m * k * n))))  # ~0.1 s at 60 GFLOP/s
    samples = {key: Rounds() for key in fns}
    for fn in fns.values():
        for _ in range(3):
            fn()
    for _ in range(args.rounds):
        wait_for_quiet(args.quiet_wait)
        for key, fn in fns.items():
            times = call_times(fn, calls, clock)
            samples[key].median.append(statistics.median(times))
            samples[key].fastest.append(min(times))
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds-per-block", type=float, default=0.1, help="about this long per kernel per round")
    ap.add_argument("--shapes", default="", help="MxKxN,... (default: BERT-base's at M = 1, 8, 128, 512)")
    ap.add_argument("--quiet-wait", type=float, default=0.0,
                    help="before each round, wait up to this many seconds for the machine to go idle")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread: the calling thread's CPU time (needs --threads 1)")
    ap.add_argument("--write", action="store_true", help="append the table to bench/results/gemm-<date>.md")
    args = ap.parse_args()
    if args.clock == "thread" and args.threads != 1:
        ap.error("--clock thread counts one thread's CPU time: use it with --threads 1")
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES
    name, ghz, per_cycle = cpu_facts()
    nominal = args.threads * ghz * per_cycle  # GFLOP/s
    measured = measured_peak(args.threads, per_cycle, args.clock == "thread")
    load_before = os.getloadavg()[0]
    from kiln.kernels.cpu import gemm_native

    from kiln.kernels.cpu import cpu_features

    kernel = gemm_native.linear_kernel().name if gemm_native.available() else "not built"
    if cpu_features.isa_cap():  # onnxruntime has no such cap: MLAS still runs the CPU's widest kernels
        name += (f" capped to {cpu_features.isa_cap()} (KILN_CPU_ISA; torch ATen {torch.backends.cpu.get_cpu_capability()},"
                 f" MKL {os.environ.get('MKL_ENABLE_INSTRUCTIONS')}, oneDNN {os.environ.get('ONEDNN_MAX_CPU_ISA')};"
                 " onnxruntime's MLAS uncapped)")
    head = [f"FP32 GEMM, {name}, {args.threads} threads; nominal peak {nominal:.0f} GFLOP/s ({ghz:.2f} GHz x "
            f"{per_cycle} FLOP/cycle/core), measured FMA peak "
            + (f"{measured:.0f} GFLOP/s" if measured else "n/a (no C compiler)")
            + f"; kiln's microkernel: {kernel}; {args.rounds} interleaved rounds"
            + ("; CPU time of the calling thread" if args.clock == "thread" else "; wall time")]
    print(head[0], flush=True)
    lines = ["| M x K x N | kernel | ms (median) | GFLOP/s (median) | GFLOP/s (fastest calls) | % nominal peak "
             "| % measured peak | kiln / MLAS by round (fastest calls) |", "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for m, k, n in shapes:
        samples = time_shape(m, k, n, args)
        flops = 2 * m * k * n
        ratios = [a / b for a, b in zip(samples[KILN].fastest, samples[MLAS].fastest)] \
            if KILN in samples and MLAS in samples else []
        for key, r in sorted(samples.items(), key=lambda kv: statistics.median(kv[1].fastest)):
            seconds, fastest = statistics.median(r.median), statistics.median(r.fastest)
            capability = flops / fastest / 1e9  # the kernel while it had the cores: what % of peak speaks of
            of_measured = f"{100 * capability / measured:.0f}%" if measured else "n/a"
            by_round = ", ".join(f"{v:.2f}" for v in ratios) if key == KILN else ""
            line = (f"| {m} x {k} x {n} | {key} | {1000 * seconds:.3f} | {flops / seconds / 1e9:.1f} | {capability:.1f} "
                    f"| {100 * capability / nominal:.0f}% | {of_measured} | {by_round} |")
            lines.append(line)
            print(line, flush=True)
    load_after = os.getloadavg()[0]
    tail = f"machine load (1-min load average) {load_before:.2f} before, {load_after:.2f} after, on {os.cpu_count()} cores"
    print(tail)
    if args.write:
        now = datetime.datetime.now(datetime.timezone.utc)
        out = RESULTS / f"gemm-{now:%Y-%m-%d}.md"
        earlier = out.read_text() if out.exists() else ""
        out.write_text(earlier + ("\n---\n\n" if earlier else "") + "\n".join([
            f"{'##' if earlier else '#'} FP32 GEMM, {now:%Y-%m-%d %H:%M} UTC, commit {commit()}", "", head[0], "",
            f"- {tail}: above the thread count, other work shared the cores", "", *lines, ""]))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
