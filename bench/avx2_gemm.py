"""Transformer GEMMs on an AVX2-only CPU (issue 11), emulated on an AVX-512 one: bench/gemm_models.py's table
(kiln's pick, kiln's packed GEMM, MKL, oneDNN, onnxruntime's MLAS; % of the AVX2 FMA peak at the measured
clock) with every library capped to AVX2.

    python bench/avx2_gemm.py [--threads 1] [--rounds 5] [--models t5,bert,minilm] [--batches 1,8] [--write]

The caps, all set before any library loads: `KILN_CPU_ISA=avx2` (kiln's C kernels built for x86-64-v3 and
dispatched to the AVX2 tile; ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2, ATEN_CPU_CAPABILITY=avx2),
and cpuid itself (bench/cpuid_avx2.py: CPUID faulting hides AVX-512, AMX and AVX-VNNI from every library in
the process, onnxruntime's MLAS included, which has no switch of its own). `--no-cpuid-cap` leaves MLAS on
the CPU's own ISA. The cores stay what they are (here Sapphire Rapids: 2 x 256-bit FMA ports, 48 KB L1d):
an AVX2 EPYC may rank the kernels differently.
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

import gemm_models  # noqa: E402  bench/gemm_models.py

if __name__ == "__main__":
    import torch  # noqa: E402  (loaded by gemm_models, after the caps)

    from kiln.kernels.cpu import cpu_features  # noqa: E402

    cpu_features.cap_libraries()  # what `import kiln` does: oneDNN, MKL and ATen told before their first kernel
    gemm_models.main(
        capped=f"KILN_CPU_ISA={os.environ['KILN_CPU_ISA']}; torch ATen {torch.backends.cpu.get_cpu_capability()}, "
        f"MKL_ENABLE_INSTRUCTIONS={os.environ.get('MKL_ENABLE_INSTRUCTIONS')}, "
        f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA')}, "
        + ("cpuid NOT masked (MLAS on AVX-512)" if "--no-cpuid-cap" in sys.argv
           else "cpuid masked (no AVX-512/AMX/AVX-VNNI for any library: MLAS on its AVX2 kernels)"),
        out_stem="avx2-gemm")
