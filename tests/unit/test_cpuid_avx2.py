"""bench/cpuid_avx2.py: cpuid faulting hides AVX-512/AMX from every library of a process (the AVX2 benches' cap
for onnxruntime's MLAS, which has no switch). Each case runs in a fresh interpreter: the mask is process-wide."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())


pytestmark = pytest.mark.skipif("cpuid_fault" not in _flags() or sys.platform != "linux",
                                reason="needs Linux and a CPU (or hypervisor) that offers CPUID faulting")


def _run(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "KILN_CPU_ISA")}
    prelude = f"import sys; sys.path.insert(0, {str(BENCH)!r}); import cpuid_avx2; cpuid_avx2.enable()\n"
    done = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_torch_sees_avx2_with_no_switch_of_its_own():
    """ATen's dispatch reads cpuid (cpuinfo): with the mask and no ATEN_CPU_CAPABILITY it says AVX2, not AVX512."""
    out = _run("import torch; print(torch.backends.cpu.get_cpu_capability()); print(cpuid_avx2.faults())")
    capability, faults = out.split()
    assert capability == "AVX2" and int(faults) > 0


def test_onnxruntime_runs_right_under_the_mask():
    """MLAS picks its kernels from cpuid as its library loads: under the mask it must still compute the MatMul right
    (its AVX2 path), checked against numpy in float64 on fresh random inputs."""
    out = _run("""
import numpy as np, onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
rng = np.random.default_rng()
w = rng.standard_normal((300, 130), dtype=np.float32)
x = rng.standard_normal((77, 300), dtype=np.float32)
g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [77, 300])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [77, 130])], [numpy_helper.from_array(w, "w")])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]); m.ir_version = 10
y = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
print(float(np.abs(y - x.astype(np.float64) @ w).max()))
""")
    assert float(out) < 1e-3  # K = 300 fp32 products of N(0, 1) terms: ~1e-5 expected, an index error is O(10)


def test_a_real_segfault_still_reaches_the_previous_handler():
    """The handler answers only cpuid: any other SIGSEGV goes back to the handler that was there (here the
    default: the process dies by SIGSEGV, not hangs re-faulting)."""
    prelude = f"import sys; sys.path.insert(0, {str(BENCH)!r}); import cpuid_avx2; cpuid_avx2.enable()\n"
    done = subprocess.run([sys.executable, "-c", prelude + "import ctypes; ctypes.string_at(8)"], capture_output=True,
                          timeout=60)
    assert done.returncode == -11
