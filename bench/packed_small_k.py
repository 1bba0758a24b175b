"""kiln's packed GEMM (cpu.gemm.kiln_packed) at ConvNeXt-tiny's small-K pointwise shapes and BERT-base's, against
oneDNN's inner product (cpu.gemm.onednn_direct) and onnxruntime's MLAS, with the kernel timed in C.

    python bench/packed_small_k.py [--threads 1|2] [--rounds 7] [--base REV [--base-small-m ROWS]] [--shapes convnext,bert]
                                   [--avx2] [--realtime]

Why: at ~1 MFLOP (512 x 16 x 64) a Python call (ctypes, reshape, a lock: 3-5 us) is a third of the work, so
bench/gemm.py's per-call times blur the kernels. Here each runner is a list of R layers of the shape (distinct
weights, one input, R outputs, as in a network) run R at a time: kiln's and oneDNN's from a C loop over their native
calls (kiln_gemm on a plan; dnnl_primitive_execute on a bound primitive: what a native segment runs), onnxruntime's as
one session of R MatMul[+Add][+Gelu] nodes (its per-run overhead spread over R GEMMs). `--base REV` adds kiln's GEMM
as gemm.c was at REV (git show), built beside the working tree's and run on the same plans and packed weights: the A/B
of a kernel change in one process (`--base-small-m`: the base's plans switch from the whole-K path to the K-blocked
one past this many rows, as its gemm_native.small_rows did). Outputs are checked against float64 first. Interleaved rounds (each runner a block
per round, starting at the next runner each round); per block the median pass; the table gives the median over
rounds, GFLOP/s, % of the measured FMA peak of the same threads (bench/gemm.py's chains) and per round the ratio to
onnxruntime. 1 thread: the calling thread's CPU time (what each runner does with a core while it has one); 2: wall.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--avx2" in sys.argv:  # before torch, onnxruntime or kiln read cpuid (bench/avx2_gemm.py's caps)
    import cpuid_avx2  # noqa: E402  bench/cpuid_avx2.py: MLAS too sees an AVX2-only CPU

    cpuid_avx2.enable()
    os.environ.setdefault("KILN_CPU_ISA", "avx2")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from gemm import cpu_facts, measured_peak  # noqa: E402  bench/gemm.py
from lstm_engine import realtime  # noqa: E402  bench/lstm_engine.py: SCHED_FIFO while the rounds run (root)

from kiln.kernels.cpu import gemm_native, native_loop, onednn  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# ConvNeXt-tiny's two Linears per block at batch 2 (rows = 2 x H x W): stage 0 (56 x 56 / 4 ... 16 x 16 here: the
# zoo's 64 x 64 image), 1, 2, 3; the first of each pair has GELU. BERT-base's at 1 x 128 tokens.
SHAPES = {
    "convnext": [(512, 16, 64, "Gelu"), (512, 64, 16, ""), (128, 32, 128, "Gelu"), (128, 128, 32, ""),
                 (32, 64, 256, "Gelu"), (32, 256, 64, ""), (8, 128, 512, "Gelu"), (8, 512, 128, "")],
    "bert": [(128, 768, 2304, ""), (128, 768, 768, ""), (128, 768, 3072, "Gelu"), (128, 3072, 768, "")],
}

TIMER = r"""
#include <time.h>
typedef int (*call_fn)(void *, void *, int, const void *);
typedef int (*wait_fn)(void *);
static double seconds(int thread_clock) {
    struct timespec t;
    clock_gettime(thread_clock ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
/* Seconds for one pass over `count` calls (function NULL: `execute` on a oneDNN primitive, as segment_loop.c). */
double kiln_bench_pass(int count, void **fns, void **objects, int *nargs, void **args, void *execute, void *wait,
                       void *stream, int thread_clock) {
    double t0 = seconds(thread_clock);
    for (int i = 0; i < count; ++i) {
        if (fns[i]) ((call_fn)fns[i])(objects[i], 0, 0, 0);
        else ((call_fn)execute)(objects[i], stream, nargs[i], args[i]);
    }
    if (wait) ((wait_fn)wait)(stream);
    return seconds(thread_clock) - t0;
}
"""


class NativeCalls:
    """A list of (function, object, nargs, args) native calls timed one pass at a time from C."""

    def __init__(self, timer, calls: list[tuple], keep: list):
        self._timer, self._keep = timer, keep
        n = len(calls)
        self._fns = (ctypes.c_void_p * n)(*[c[0] for c in calls])
        self._objects = (ctypes.c_void_p * n)(*[c[1] for c in calls])
        self._nargs = (ctypes.c_int * n)(*[c[2] for c in calls])
        self._args = (ctypes.c_void_p * n)(*[c[3] for c in calls])
        self._count = n
        if onednn.available():
            lib = onednn.load()
            self._execute = ctypes.cast(lib.lib.dnnl_primitive_execute, ctypes.c_void_p).value
            self._wait = ctypes.cast(lib.lib.dnnl_stream_wait, ctypes.c_void_p).value
            self._stream = lib.stream.value if isinstance(lib.stream, ctypes.c_void_p) else lib.stream
        else:
            self._execute = self._wait = self._stream = None

    def __call__(self, thread_clock: bool) -> float:
        return self._timer(self._count, self._fns, self._objects, self._nargs, self._args, self._execute,
                           self._wait if any(f is None for f in self._fns) else None, self._stream, int(thread_clock))


def base_library(rev: str):
    """kiln's GEMM as gemm.c (and pool.c) were at `rev`, built into kiln's cache: (library, short commit)."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    source = "\n".join(subprocess.run(["git", "show", f"{rev}:kiln/kernels/cpu/{name}"], cwd=ROOT, capture_output=True,
                                      text=True, check=True).stdout for name in ("pool.c", "gemm.c"))
    lib = gemm_native.open_library(f"gemm-{sha}", source, False)
    if isinstance(lib, str):
        raise SystemExit(f"kiln's GEMM at {rev} did not build: {lib}")
    # declared as gemm_native.load() declares the working tree's (an engine built on it calls these)
    lib.kiln_gemm.restype = ctypes.c_int
    lib.kiln_gemm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.kiln_gemm_kernel_name.restype = ctypes.c_char_p
    lib.kiln_gemm_scratch_floats.restype = ctypes.c_long
    lib.kiln_gemm_scratch_floats.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return lib, sha


def ort_runner(x: np.ndarray, ws: list[np.ndarray], bs: list[np.ndarray], activation: str, threads: int,
               spin: bool = True):
    """One onnxruntime session of len(ws) MatMul + Add [+ Gelu] nodes on the one input x (`spin` False: its
    workers block between runs instead of spinning)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    m, k = x.shape
    n = ws[0].shape[0]
    nodes, constants, outputs = [], [], []
    for i, (w, b) in enumerate(zip(ws, bs)):
        nodes += [helper.make_node("MatMul", ["x", f"w{i}"], [f"xw{i}"]),
                  helper.make_node("Add", [f"xw{i}", f"b{i}"], [f"z{i}" if activation else f"y{i}"])]
        if activation:
            nodes.append(helper.make_node("Gelu", [f"z{i}"], [f"y{i}"]))
        constants += [numpy_helper.from_array(w.T.copy(), f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [m, n]))
    graph = helper.make_graph(nodes, "gemms", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])], outputs,
                              constants)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = min(model.ir_version, 10)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    if not spin:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {"x": x}

    def run(thread_clock: bool) -> float:
        clock = time.thread_time if thread_clock else time.perf_counter
        t0 = clock()
        run.out = session.run(None, feeds)
        return clock() - t0

    return run


def runners(m, k, n, activation, layers, threads, timer, base, base_small_m=None, spin=True):
    """{name: (pass function, outputs to check)} for R = `layers` layers of the shape."""
    rng = np.random.default_rng(m * 7 + k * 3 + n)
    x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
    ws = [torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32) / k ** 0.5) for _ in range(layers)]
    bs = [torch.from_numpy(rng.standard_normal(n, dtype=np.float32)) for _ in range(layers)]
    out = {}
    packed = [gemm_native.PackedLinear(w, b, activation) for w, b in zip(ws, bs)]
    ys = [torch.empty(m, n) for _ in range(layers)]
    plans = []
    for layer, y in zip(packed, ys):
        plan, scratch = layer.plan(m)
        plan.src, plan.dst = x.data_ptr(), y.data_ptr()
        plans.append((plan, scratch))
    libs = [("kiln packed", gemm_native.load(), plans)]
    if base:
        base_plans = plans
        if base_small_m is not None:  # the base revision's whole-K / K-blocked switch: its own plans
            base_plans = []
            for layer, y in zip(packed, ys):
                plan, scratch = layer.plan(m)
                plan.src, plan.dst, plan.small_m = x.data_ptr(), y.data_ptr(), min(base_small_m, plan.small_m)
                base_plans.append((plan, scratch))
        libs.append((f"kiln packed at {base[1]}", base[0], base_plans))
    for name, lib, lib_plans in libs:
        fn = ctypes.cast(lib.kiln_gemm, ctypes.c_void_p).value
        calls = [(fn, ctypes.addressof(p), 0, 0) for p, _ in lib_plans]
        out[name] = (NativeCalls(timer, calls, [packed, lib_plans, x, ys]), ys)  # packed: the weights the plans read
    if threads > 1 and any(p.threads == 1 for p, _ in plans):  # kiln's rule keeps a small layer on one thread
        forked = []
        for layer, y in zip(packed, ys):
            plan, scratch = layer.plan(m)
            plan.src, plan.dst, plan.threads = x.data_ptr(), y.data_ptr(), 0
            forked.append((plan, scratch))
        fn = ctypes.cast(gemm_native.load().kiln_gemm, ctypes.c_void_p).value
        out["kiln packed, all threads"] = (NativeCalls(timer, [(fn, ctypes.addressof(p), 0, 0) for p, _ in forked],
                                                       [packed, forked, x, ys]), ys)
    if onednn.available():
        from kiln.kernels.cpu.onednn_primitives import InnerProduct

        eltwise = onednn.eltwise_for(activation, 0.0, 0.0)
        ips = [InnerProduct(w, b, m, eltwise, False, True) for w, b in zip(ws, bs)]
        zs = [torch.empty(m, n) for _ in range(layers)]
        bound = [ip.bind(x.data_ptr(), z.data_ptr()) for ip, z in zip(ips, zs)]
        calls = [c for b_ in bound for c in b_.calls()]
        out[f"oneDNN inner product ({ips[0].implementation})"] = (NativeCalls(timer, calls, [ips, bound, x, zs]), zs)
        serial = [b_.serial_calls() for b_ in bound]
        if threads > 1 and all(s is not None for s in serial):
            out["oneDNN inner product, serial form"] = (NativeCalls(timer, [c for s in serial for c in s],
                                                                    [ips, bound, x, zs]), zs)
    ort = ort_runner(x.numpy(), [w.numpy() for w in ws], [b.numpy() for b in bs], activation, threads, spin)
    out["onnxruntime (MLAS)"] = (ort, None)
    # every runner computes the same thing before it is timed (float64 oracle; exact erf GELU)
    want = [torch.nn.functional.linear(x.double(), w.double(), b.double()) for w, b in zip(ws, bs)]
    if activation == "Gelu":
        want = [torch.nn.functional.gelu(z) for z in want]
    for name, (fn, got) in out.items():
        fn(False)
        got = [torch.from_numpy(a) for a in ort.out] if got is None else got
        for g, w_ in zip(got, want):
            error = (g.double() - w_).abs().max().item()
            assert error <= 1e-4 * max(w_.abs().max().item(), 1.0), f"{name}: max error {error:.3g}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--passes", type=int, default=0, help="passes per block (default: ~20 ms of work)")
    ap.add_argument("--shapes", default="convnext,bert", help=f"of {sorted(SHAPES)}, or MxKxN[:Gelu],...")
    ap.add_argument("--base", default="", help="also kiln's GEMM as gemm.c was at this git revision")
    ap.add_argument("--base-small-m", type=int, default=None,
                    help="the base's plans read x in place over the whole K up to this many rows (its gemm_native's "
                    "small_rows; default: the working tree's)")
    ap.add_argument("--avx2", action="store_true",
                    help="every library capped to AVX2 (kiln's 6x16 tile, ONEDNN_MAX_CPU_ISA, cpuid masked for MLAS)")
    ap.add_argument("--realtime", action="store_true",
                    help="time the rounds at SCHED_FIFO priority (root); onnxruntime's workers then block between "
                    "runs (set OMP_WAIT_POLICY=passive for OpenMP's): a spinning FIFO thread holds its core against "
                    "every other runner's worker of the same priority")
    args = ap.parse_args()
    if args.avx2:
        from kiln.kernels.cpu import cpu_features
        cpu_features.cap_libraries()  # oneDNN (and MKL, ATen) told before their first kernel
    torch.set_num_threads(args.threads)
    shapes = []
    for part in args.shapes.split(","):
        if part in SHAPES:
            shapes += SHAPES[part]
        else:
            dims, _, act = part.partition(":")
            if act not in ("", "Gelu"):
                ap.error(f"{part}: the oracle here knows no activation but Gelu")
            shapes.append((*(int(v) for v in dims.split("x")), act))
    thread_clock = args.threads == 1
    built = native_loop.build("bench_pass", TIMER)
    if isinstance(built, str):
        raise SystemExit(built)
    timer = ctypes.CDLL(str(built)).kiln_bench_pass
    timer.restype = ctypes.c_double
    timer.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_void_p] * 3 + [ctypes.c_int]
    base = base_library(args.base) if args.base else None
    name, _, per_cycle = cpu_facts()
    # the cores' peak: one core's by its thread CPU time (a busy neighbour does not lower it) times the threads
    peak = args.threads * measured_peak(1, per_cycle, True)
    load = os.getloadavg()[0]
    print(f"# {name}, {args.threads} thread(s), {'thread CPU time' if thread_clock else 'wall'}; measured FMA peak "
          f"{peak:.0f} GFLOP/s ({args.threads} x one core's); kiln's tile {gemm_native.linear_kernel().name}; "
          f"{'SCHED_FIFO; ' if args.realtime else ''}load {load:.2f}", flush=True)
    print("| M x K x N (act) | runner | us per GEMM | GFLOP/s | % peak | / onnxruntime by round |\n|---|---|---|---|---|---|")
    for m, k, n, act in shapes:
        flops = 2 * m * k * n
        layers = max(1, min(32, int(4e6 // flops)))
        fns = runners(m, k, n, act, layers, args.threads, timer, base, args.base_small_m, not args.realtime)
        passes = args.passes or max(3, min(400, int(0.02 * 50e9 / (flops * layers))))
        names = list(fns)
        per_round: dict[str, list[float]] = {key: [] for key in names}
        with realtime(args.realtime):
            for r in range(args.rounds):
                for key in names[r % len(names):] + names[:r % len(names)]:
                    fn = fns[key][0]
                    fn(thread_clock)
                    per_round[key].append(statistics.median(fn(thread_clock) for _ in range(passes)) / layers)
        ort = per_round["onnxruntime (MLAS)"]
        for key in sorted(names, key=lambda key: statistics.median(per_round[key])):
            t = statistics.median(per_round[key])
            ratios = ", ".join(f"{a / b:.2f}" for a, b in zip(per_round[key], ort))
            print(f"| {m} x {k} x {n}{' ' + act if act else ''} | {key} | {1e6 * t:.1f} | {flops / t / 1e9:.1f} | "
                  f"{100 * flops / t / 1e9 / peak:.0f}% | {ratios} |", flush=True)
    print(f"load {load:.2f} -> {os.getloadavg()[0]:.2f} (1-min average, {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
