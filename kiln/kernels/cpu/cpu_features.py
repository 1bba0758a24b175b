"""What this CPU's instruction set offers kiln's kernels, and the cap a user may put on it.

8-bit kernels: VNNI (vpdpbusd, AVX512_VNNI or AVX_VNNI) and AMX multiply u8·s8 into int32 without an
intermediate; without them oneDNN, fbgemm and onnxruntime's MLAS use vpmaddubsw, whose int16 pair sums
saturate. This decides which int8 tactics are exact and which weights kiln's own quantization may use
(7-bit on a CPU without int8 dot products).

The cap: `KILN_CPU_ISA=avx2` makes kiln run on an AVX-512 machine as it would on an AVX2-only one (an
AMD EPYC before Zen 4, a client Intel CPU): kiln's C kernels are compiled for x86-64-v3 (AVX2 + FMA) and
their run-time dispatch never takes an AVX-512 tile (native_loop.py), `flags()` hides the AVX-512, AMX and
AVX-VNNI flags, and, when kiln is imported before torch first runs a kernel, the libraries kiln calls are
capped as well: oneDNN (ONEDNN_MAX_CPU_ISA=AVX2), MKL (MKL_ENABLE_INSTRUCTIONS=AVX2) and ATen's own
vectorised kernels (ATEN_CPU_CAPABILITY=avx2); a value the user set for one of those is left as it is.
Why: kiln's GEMM and recurrent tiles, and the tuner's choice among them, differ per ISA, and no AVX2-only
machine was at hand to test or tune them on (bench/results/zoo-cpu-avx2-2026-12-03.md). Unset (or
`native`): whatever cpuid says. onnxruntime cannot be capped this way: MLAS dispatches on cpuid alone.
"""

from __future__ import annotations

import functools
import os
from collections.abc import MutableMapping
from pathlib import Path

INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")

ISA_VARIABLE = "KILN_CPU_ISA"
# The caps kiln knows -> what each library is told (its own spelling).
LIBRARY_CAPS = {"avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}
# Flags an AVX2-only CPU lacks: AVX-512 of every kind, AMX, and the VEX-encoded extensions that came with
# them (avx_vnni, avx_ifma, avx_ne_convert ...: oneDNN's AVX2 cap excludes AVX2_VNNI too).
_ABOVE_AVX2 = ("avx512", "amx", "avx_")


def isa_cap(environ: MutableMapping[str, str] | None = None) -> str | None:
    """The ISA kiln is capped to ('avx2'), or None for the CPU's own; a value kiln does not know is an error."""
    environ = os.environ if environ is None else environ
    value = environ.get(ISA_VARIABLE, "").strip().lower()
    if value in ("", "native"):
        return None
    if value not in LIBRARY_CAPS:
        raise ValueError(f"{ISA_VARIABLE}={environ[ISA_VARIABLE]!r} is not an ISA kiln can cap to: use one of "
                         f"{sorted(LIBRARY_CAPS)} or 'native' (or leave it unset)")
    return value


def cap_libraries(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Tell oneDNN, MKL and ATen the cap of KILN_CPU_ISA (each read once, at the library's first kernel: kiln's
    import runs this); a variable already set is kept. Returns what it set."""
    environ = os.environ if environ is None else environ
    cap = isa_cap(environ)
    if cap is None:
        return {}
    wanted = {k: v for k, v in LIBRARY_CAPS[cap].items() if k not in environ}
    environ.update(wanted)
    return wanted


@functools.cache
def _cpuinfo_fields() -> dict[str, str]:
    """The first processor's 'key: value' lines of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def identity() -> str:
    """'AuthenticAMD family 25 model 17; avx512, avx512_vnni': the CPU's vendor, family and model numbers and the ISA
    kiln's kernels use, for the timing cache's key. The brand string is not enough: a cloud VM may call itself
    'AMD EPYC' on Zen 2, 3 and 4 alike (AVX2 only, or AVX-512 on half-width units), whose kernels time differently.
    Empty fields where /proc/cpuinfo has none (the ISA still says what the kernels use)."""
    f = _cpuinfo_fields()
    return f"{f.get('vendor_id', '?')} family {f.get('cpu family', '?')} model {f.get('model', '?')}; {describe()}"


@functools.cache
def _cpuinfo_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def flags() -> frozenset[str]:
    """The CPU flags /proc/cpuinfo lists, less those above the KILN_CPU_ISA cap (empty where there is no
    /proc/cpuinfo: then nothing is assumed)."""
    found = _cpuinfo_flags()
    if isa_cap() == "avx2":
        return frozenset(f for f in found if not f.startswith(_ABOVE_AVX2))
    return found


def has_int8_dot_product() -> bool:
    return any(f in flags() for f in INT8_DOT_FLAGS)


def isa() -> str:
    """'avx512', 'avx2' or 'sse/other': the widest FP32 vector ISA kiln's kernels use here (after the cap)."""
    f = flags()
    return "avx512" if "avx512f" in f else "avx2" if "avx2" in f and "fma" in f else "sse/other"


def fma_flops_per_cycle() -> int:
    """FP32 FLOPs one core can issue per cycle at this ISA: 2 FMA units x lanes x 2 (a multiply and an add)."""
    return {"avx512": 64, "avx2": 32}.get(isa(), 16)


def describe() -> str:
    """'avx2 (capped by KILN_CPU_ISA), no VNNI' style: what a benchmark or a build record says about the CPU."""
    f = flags()
    capped = f" (capped by {ISA_VARIABLE})" if isa_cap() else ""
    dots = [d for d in INT8_DOT_FLAGS if d in f]
    return f"{isa()}{capped}, " + (", ".join(dots) if dots else "no VNNI/AMX (8-bit products through vpmaddubsw)")
