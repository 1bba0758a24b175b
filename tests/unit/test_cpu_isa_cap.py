"""KILN_CPU_ISA=avx2 (kiln/kernels/cpu/cpu_features.py): kiln on an AVX-512 CPU as on an AVX2-only one.

The parsing, the libraries' variables, the flags hidden and the compiler's options are checked here on
made-up inputs; a fresh process under the cap checks what it changes for real: kiln's GEMM takes its AVX2
tile (against torch in float64), torch's ATen dispatch reports AVX2, and the timing cache keys it apart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.kernels.cpu import cpu_features, native_loop

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("value", "cap"), [(None, None), ("", None), ("native", None), ("avx2", "avx2"),
                                            ("AVX2", "avx2"), (" avx2 ", "avx2")])
def test_the_cap_is_read_from_kiln_cpu_isa(value, cap):
    environ = {} if value is None else {"KILN_CPU_ISA": value}
    assert cpu_features.isa_cap(environ) == cap


@pytest.mark.parametrize("value", ["avx512", "sse", "avx-2"])
def test_an_unknown_cap_is_an_error_naming_the_variable(value):
    with pytest.raises(ValueError, match=rf"KILN_CPU_ISA={value!r} is not an ISA kiln can cap to.*'avx2'"):
        cpu_features.isa_cap({"KILN_CPU_ISA": value})


def test_the_libraries_are_told_the_cap_and_a_users_own_setting_is_kept():
    environ = {"KILN_CPU_ISA": "avx2", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}
    assert cpu_features.cap_libraries(environ) == {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    assert environ["MKL_ENABLE_INSTRUCTIONS"] == "SSE4_2"
    environ = {"PATH": "/bin"}
    assert cpu_features.cap_libraries(environ) == {} and environ == {"PATH": "/bin"}


SAPPHIRE_RAPIDS = frozenset("sse4_2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16 avx_vnni "
                            "amx_tile amx_int8 amx_bf16".split())


def test_the_flags_above_avx2_are_hidden_under_the_cap(monkeypatch):
    monkeypatch.setattr(cpu_features, "_cpuinfo_flags", lambda: SAPPHIRE_RAPIDS)
    monkeypatch.delenv("KILN_CPU_ISA", raising=False)
    assert cpu_features.isa() == "avx512" and cpu_features.fma_flops_per_cycle() == 64
    assert cpu_features.has_int8_dot_product()
    monkeypatch.setenv("KILN_CPU_ISA", "avx2")
    assert cpu_features.flags() == {"sse4_2", "avx", "avx2", "fma", "f16c"}
    assert cpu_features.isa() == "avx2" and cpu_features.fma_flops_per_cycle() == 32
    assert not cpu_features.has_int8_dot_product()  # an AVX2-only EPYC has no VNNI: 8-bit through vpmaddubsw
    assert cpu_features.describe().startswith("avx2 (capped by KILN_CPU_ISA), no VNNI")


def test_the_c_kernels_are_compiled_for_x86_64_v3_under_the_cap(monkeypatch):
    monkeypatch.delenv("KILN_CPU_ISA", raising=False)
    assert native_loop.compile_flags() == native_loop.FLAGS
    monkeypatch.setenv("KILN_CPU_ISA", "avx2")
    capped = native_loop.compile_flags()
    assert len(capped) == len(native_loop.FLAGS)
    assert capped[0][:4] == ("-O3", "-march=x86-64-v3", "-mtune=native", "-fopenmp")
    assert all(flags[-1] == "-DKILN_MAX_ISA_AVX2=1" and "-march=native" not in flags for flags in capped)


_UNDER_THE_CAP = r"""
import json, torch
import kiln
from kiln.builder.timing_cache import environment
from kiln.kernels.cpu import gemm_native

kernel = gemm_native.best_kernel()
g = torch.Generator().manual_seed(3)
x, w, b = torch.randn(37, 96, generator=g), torch.randn(70, 96, generator=g), torch.randn(70, generator=g)
y = gemm_native.PackedLinear(w, b, activation="Relu")(x)
want = torch.relu(x.double() @ w.double().T + b.double())
print(json.dumps({"kernel": kernel.name, "err": float((y.double() - want).abs().max()),
                  "aten": torch.backends.cpu.get_cpu_capability(), "env": environment(torch.device("cpu"))}))
"""


def test_a_process_under_the_cap_runs_kilns_avx2_gemm_and_caps_aten():
    if cpu_features.isa() not in ("avx2", "avx512") or native_loop.find_compiler() is None:
        pytest.skip("needs an x86 CPU with AVX2 and a C compiler")
    env = {**os.environ, "KILN_CPU_ISA": "avx2", "PYTHONPATH": str(ROOT)}
    for name in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", _UNDER_THE_CAP], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["kernel"] == "avx2 6x16"
    assert found["err"] < 1e-4 * 96 ** 0.5, found  # fp32 sums of 96 products against float64
    assert found["aten"] == "AVX2"
    assert found["env"]["isa_cap"] == "avx2"  # a cache tuned under the cap is not read without it
