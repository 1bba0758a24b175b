"""The zoo with both sides on an AVX2-only CPU (issue 11), emulated on an AVX-512 one, in one process.

    python bench/zoo_avx2.py --full --models bert_base,distilbert_base --threads 2 --rounds 5   # bench/zoo.py's options
    python bench/zoo_avx2.py --models bert_base,gru_forecaster --threads 1 --clock thread      # a loaded machine

kiln runs under KILN_CPU_ISA=avx2 (its C kernels built for x86-64-v3; oneDNN, MKL and ATen capped by their
variables) and every library, onnxruntime's MLAS included, under bench/cpuid_avx2.py's cpuid mask, both set
before any library loads. MLAS has no switch to ask, so its dispatch is checked by what it does: before and
after the zoo, its GEMM (a MatMul + Add model, 128 x 768 x 3072, one thread, the calling thread's CPU time) is
timed against one core's AVX2 FMA peak (the clock measured by dependent FMA chains x 32 FLOP/cycle). Its AVX2
kernels reach 85-99% of that peak here, its AVX-512 ones 142-154% (bench/results/avx2-gemm-2026-12-04d.md):
above 110% means the cap does not hold and the run stops. Results: bench/results/zoo-cpu-avx2-<date>.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpuid_avx2  # noqa: E402

cpuid_avx2.enable()  # before torch, onnxruntime or kiln read cpuid
os.environ["KILN_CPU_ISA"] = "avx2"

import datetime  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import zoo  # noqa: E402  bench/zoo.py: kiln before torch, as there (kiln/openmp.py's wait policy is set only then)
import torch  # noqa: E402
from gemm_models import peak_functions  # noqa: E402
from gemm import call_times, mlas_runner  # noqa: E402

AVX2_FLOPS_PER_CYCLE = 32
MLAS_AVX512_ABOVE = 1.10  # of the AVX2 peak: no AVX2 kernel gets there, MLAS's AVX-512 ones reach 1.4-1.5


def mlas_share_of_avx2_peak(m: int = 128, k: int = 768, n: int = 3072, calls: int = 20) -> tuple[float, float]:
    """(MLAS's fastest GEMM call over one core's AVX2 peak, the core's clock in GHz), one thread, CPU time."""
    rng = np.random.default_rng(0)
    x, w, b = (torch.from_numpy(rng.standard_normal(s, dtype=np.float32)) for s in ((m, k), (n, k), (n,)))
    run = mlas_runner(x, w, b, threads=1)
    run()
    _, clock_ghz = peak_functions()
    ghz = max(clock_ghz(2_000_000, 0, 1) for _ in range(3))  # 8-lane chains, CPU time
    gflops = 2 * m * k * n / min(call_times(run, calls, time.thread_time)) / 1e9
    return gflops / (ghz * AVX2_FLOPS_PER_CYCLE), ghz


def checked(when: str) -> str:
    share, ghz = mlas_share_of_avx2_peak()
    line = (f"MLAS GEMM 128 x 768 x 3072 {when} the zoo: {100 * share:.0f}% of one core's AVX2 peak "
            f"({ghz:.2f} GHz x 32 FLOP/cycle), cpuids answered masked so far: {cpuid_avx2.faults()}")
    print(line, flush=True)
    if share > MLAS_AVX512_ABOVE:
        raise SystemExit(f"the AVX2 cap does not hold: {line} (AVX-512 kernels)")
    return line


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    before = checked("before")
    args = zoo.parse_args(argv + ["--tag", "avx2"])
    zoo.main_cpu(args)
    after = checked("after")
    if not args.no_write:
        path = zoo.results_file(args, "cpu", datetime.datetime.now(datetime.timezone.utc))
        path.write_text(path.read_text() + "\n".join([
            "", "Both sides capped to AVX2 in this one process (bench/zoo_avx2.py): kiln by KILN_CPU_ISA=avx2, "
            "every library (onnxruntime's MLAS included) by bench/cpuid_avx2.py's cpuid mask.", "",
            f"- {before}", f"- {after}", ""]))


if __name__ == "__main__":
    main()
