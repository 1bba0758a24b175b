"""Which of kiln's CPU kernel libraries load on this machine, and why not: oneDNN (libdnnl.so.3), kiln's
packed GEMM, the transformer/attention C kernels, the recurrent loops.

    python bench/cpu_native_diag.py

A layer whose native tactic is unavailable runs its default (registered) implementation: a zoo table's
"N default" tactics on one machine and not on another starts here. Also prints the OpenMP runtimes mapped
into the process (libdnnl must share torch's: kiln/kernels/cpu/onednn.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kiln.kernels.cpu import cpu_features, gemm_native, onednn, recurrent, transformer  # noqa: E402
from kiln.kernels.cpu.onednn import OneDNNError  # noqa: E402


def main() -> None:
    flags = cpu_features.flags()
    print(f"torch {torch.__version__}; avx2={'avx2' in flags} avx512f={'avx512f' in flags} "
          f"amx_tile={'amx_tile' in flags}")
    print("KILN_DNNL_LIBRARY:", os.environ.get("KILN_DNNL_LIBRARY", "(unset)"))
    try:
        library = onednn.load()
        print(f"onednn       available=True version={library.version}")
    except OneDNNError as e:
        print(f"onednn       available=False {e}")
    for name, module in (("gemm_native", gemm_native), ("transformer", transformer), ("recurrent", recurrent)):
        ok = module.available()
        print(f"{name:12s} available={ok} {'' if ok else module.reason()}")
    print("OpenMP runtimes mapped:", onednn._openmp_runtimes())


if __name__ == "__main__":
    main()
