"""How many OpenMP parallel regions a kiln call enters, how long they are, and how late their worker starts.

    python bench/openmp_regions.py                       # EfficientNet-B0, 2 threads
    python bench/openmp_regions.py --model dcn --runs 40

Re-runs itself under an LD_PRELOAD shim (bench/openmp_regions.c, compiled into /tmp) that wraps libgomp's two
region entry points. Prints the process's thread pools (which OpenMP runtime files are mapped, the wait policy in
force, kiln's own pool), then for each form of the engine's native segments (parallel; serial where there is one)
and each thing run just before the kiln call (nothing, a torch eager call, an onnxruntime call, a 50 ms sleep):
regions per call, those of two or more threads, the median region, when the worker thread started its share
(< 5 µs: it was spinning; tens to hundreds: it was woken; >= 1 ms: it was descheduled) and the call's wall time.
Issue 11: kiln's time must not depend on who else ran in the process (bench/results/zoo-cpu-2026-12-04d.md).
"""

from __future__ import annotations

import kiln  # noqa: I001  first, as a user imports it (kiln/openmp.py)

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402

SHIM_SOURCE = Path(__file__).with_name("openmp_regions.c")
LATE_BINS = (5, 20, 50, 100, 200, 500, 1000)  # µs


def build_shim() -> Path:
    """The shim compiled into the temp folder (once per source)."""
    target = Path(tempfile.gettempdir()) / f"kiln-openmp-regions-{abs(hash(SHIM_SOURCE.read_text())) % 10**8}.so"
    if not target.exists():
        cc = os.environ.get("CC", "cc")
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(target), str(SHIM_SOURCE), "-ldl"], check=True)
    return target


class Shim:
    """The preloaded shim's counters (None when it is not preloaded)."""

    def __init__(self):
        process = ctypes.CDLL(None)
        self.reset = process.kiln_shim_reset
        self.regions = ctypes.c_long.in_dll(process, "kiln_shim_regions")
        self.multi = ctypes.c_long.in_dll(process, "kiln_shim_multi")
        self.threads = (ctypes.c_int * 1024).in_dll(process, "kiln_shim_threads")
        self.us = (ctypes.c_double * 1024).in_dll(process, "kiln_shim_us")
        self.late = (ctypes.c_double * 1024).in_dll(process, "kiln_shim_late_us")

    @staticmethod
    def loaded() -> bool:
        return hasattr(ctypes.CDLL(None), "kiln_shim_reset")


def thread_pools() -> list[str]:
    """What runs threads in this process: OpenMP runtime files mapped, the wait policy, kiln's pool."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    mapped = sorted({line.split()[-1] for line in maps if any(k in line for k in ("libgomp", "libiomp", "libomp"))})
    dnnl = sorted({line.split()[-1] for line in maps if "libdnnl" in line})
    from kiln.kernels.cpu import gemm_native

    lib = gemm_native.load()
    pool = ctypes.c_int.in_dll(lib, "kiln_pool_enabled").value if lib is not None else None
    threads = len(os.listdir("/proc/self/task"))
    return [f"OpenMP runtimes mapped: {', '.join(mapped) or 'none'}",
            f"oneDNN: {', '.join(dnnl) or 'not loaded'}",
            f"wait policy: OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
            f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')} (None: libgomp's default, 300000 polls)",
            f"kiln's own pool (pool.c) for its GEMM/attention loops: {'on' if pool else 'off (OpenMP loops)'}",
            f"threads in the process now: {threads}"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="efficientnet_b0")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=30, help="kiln calls per form and condition")
    parser.add_argument("--engine", help="a saved .kiln engine of the model (else built here)")
    args = parser.parse_args(argv)
    if not Shim.loaded():
        env = {**os.environ, "LD_PRELOAD": str(build_shim())}
        sys.exit(subprocess.run([sys.executable, *sys.argv], env=env).returncode)

    import onnxruntime as ort
    import torch

    torch.set_num_threads(args.threads)
    exported = zoo.export(args.model)
    feeds = exported.inputs()
    engine = kiln.load(args.engine) if args.engine else kiln.build(str(exported.path))
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
    session = ort.InferenceSession(str(exported.path), options, providers=["CPUExecutionProvider"])
    model = zoo.torch_model(args.model)
    tensors = {k: torch.from_numpy(v) for k, v in feeds.items()}

    def torch_eager():
        with torch.inference_mode():
            model(**tensors)

    before = {"nothing": lambda: None, "torch eager": torch_eager, "onnxruntime": lambda: session.run(None, feeds),
              "sleep 50 ms": lambda: time.sleep(0.05)}
    for fn in (lambda: engine.run(feeds), *before.values()):
        for _ in range(3):
            fn()
    shim = Shim()
    segments = [s for s in engine.program.segments if s.chooser is not None]
    forms = ("parallel", "serial") if segments else ("parallel",)
    print(f"{args.model} on {cpu_name()}, {args.threads} threads, load {os.getloadavg()[0]:.1f}; "
          f"kiln {kiln.__version__}; {len(engine.program.segments)} native segment(s), {len(segments)} with a serial form")
    for line in thread_pools():
        print("  " + line)
    samples: dict[tuple[str, str], dict[str, list]] = {}
    for _ in range(args.runs):  # interleaved: every form and condition in every moment
        for form in forms:
            for s in segments:
                s.chooser.choose = (lambda f=form: f)
            for label, fn in before.items():
                fn()
                shim.reset()
                start = time.perf_counter()
                engine.run(feeds)
                wall = (time.perf_counter() - start) * 1e3
                n = min(shim.regions.value, 1024)
                d = samples.setdefault((form, label), {"wall": [], "regions": [], "multi": [], "us": [], "late": []})
                d["wall"].append(wall)
                d["regions"].append(shim.regions.value)
                d["multi"].append(shim.multi.value)
                d["us"] += [shim.us[i] for i in range(n)]
                d["late"] += [shim.late[i] for i in range(n) if shim.threads[i] != 1 and shim.late[i] >= 0]
    edges = ", ".join(f"<{b}" for b in LATE_BINS) + f", >={LATE_BINS[-1]}"
    print(f"\n| form | run before | regions / call | of 2+ threads | median region µs | worker start µs ({edges}) "
          f"| kiln ms (median) |")
    print("|---|---|---|---|---|---|---|")
    for (form, label), d in samples.items():
        counts = np.histogram(d["late"], bins=[0, *LATE_BINS, np.inf])[0] if d["late"] else np.zeros(8, int)
        share = counts / max(counts.sum(), 1)
        print(f"| {form} | {label} | {statistics.median(d['regions']):.0f} | {statistics.median(d['multi']):.0f} | "
              f"{statistics.median(d['us']):.0f} | {' / '.join(f'{100 * x:.0f}%' for x in share)} | "
              f"{statistics.median(d['wall']):.2f} |")


if __name__ == "__main__":
    main()
