"""What this CPU's instruction set offers 8-bit kernels: it decides which int8 tactics are exact and
which weights kiln's own quantization may use (7-bit on a CPU without int8 dot products).

VNNI (vpdpbusd, AVX512_VNNI or AVX_VNNI) and AMX multiply u8·s8 into int32 without an intermediate;
without them oneDNN, fbgemm and onnxruntime's MLAS use vpmaddubsw, whose int16 pair sums saturate.
"""

from __future__ import annotations

import functools
from pathlib import Path

INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


@functools.cache
def flags() -> frozenset[str]:
    """The CPU flags /proc/cpuinfo lists (empty where there is none: then nothing is assumed)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def has_int8_dot_product() -> bool:
    return any(f in flags() for f in INT8_DOT_FLAGS)


def describe() -> str:
    """'avx2, no VNNI' style: what a benchmark or a build record says about the int8 kernels' CPU."""
    f = flags()
    isa = "avx512" if "avx512f" in f else "avx2" if "avx2" in f else "sse/other"
    dots = [d for d in INT8_DOT_FLAGS if d in f]
    return f"{isa}, " + (", ".join(dots) if dots else "no VNNI/AMX (8-bit products through vpmaddubsw)")
