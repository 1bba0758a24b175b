"""What the build record says about each quantized layer's precision (builder/calibration.summarize, shown by
`kiln inspect`), checked for truth on the cases the Zen 3 run met (issue 12: "on AVX2-only CPUs kiln keeps FP32
where INT8 is slower and says so"):

- a layer whose int8 kernel was the tuner's pick but which the whole-engine accuracy check sent back to its
  reference kernel is said to be reverted, with the check's reason, not "int8 kernel slower" (the record said
  "int8 kernel slower: 0.086 ms vs 0.509 ms" of 51 MobileNetV2 layers whose int8 kernel was 6x faster);
- a layer kept in fp32 because its int8 kernel timed slower says so, and names the CPU when it has no int8 dot
  products (KILN_CPU_ISA=avx2 makes any x86 CPU one), nothing more where it has them;
- an int8 kernel that timed faster yet was not chosen is never called slower."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kiln.builder.calibration import summarize
from kiln.kernels.cpu import cpu_features
from kiln.plan.spec import StepSpec


def _program(*names: str) -> SimpleNamespace:
    return SimpleNamespace(steps=[StepSpec("QConv", n, ["x"], [f"{n}_y"], domain="kiln", opset=1) for n in names])


def _layer(chosen: str, ms: float, int8_ms: float | str, **more) -> dict:
    return {"tactic": chosen, "time_ms": ms, "candidates": {"default": 2.9, "cpu.qconv.onednn": int8_ms,
                                                            "cpu.qconv.dequantized": 0.4}, **more}


def test_a_reverted_layer_is_said_reverted_not_slower():
    why = "cpu.qconv.onednn: errors that compound: right on the inputs it is given, yet the engine is off"
    tactics = {"layers": {"c": _layer("default", 2.9, 0.3, reverted=why, runner_up="cpu.qconv.onednn",
                                      runner_up_ms=0.3)}}
    found = summarize(_program("c"), tactics)["c"]
    assert found["precision"] == "int8 (reference)" and found["tactic"] == "default"
    assert found["why"] == f"reverted by the engine's accuracy check (was {why})"
    assert "slower" not in found["why"]


@pytest.mark.parametrize("cap", [None, "avx2"])
def test_a_layer_kept_in_fp32_for_speed_says_so_and_names_a_cpu_without_dot_products(monkeypatch, cap):
    if cap is None:
        monkeypatch.delenv(cpu_features.ISA_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(cpu_features.ISA_VARIABLE, cap)
    tactics = {"layers": {"c": _layer("cpu.qconv.dequantized", 0.2, 0.3)}}
    found = summarize(_program("c"), tactics)["c"]
    assert found["precision"] == "fp32" and found["why"].startswith("int8 kernel slower: 0.300 ms vs 0.200 ms")
    if cpu_features.has_int8_dot_product():
        assert found["why"] == "int8 kernel slower: 0.300 ms vs 0.200 ms"
    else:  # always so under the cap
        assert found["why"].endswith(f" on this CPU ({cpu_features.describe()})") and "no VNNI" in found["why"]


def test_a_faster_int8_kernel_not_chosen_is_not_called_slower():
    tactics = {"layers": {"c": _layer("cpu.qconv.dequantized", 0.4, 0.3)}}
    found = summarize(_program("c"), tactics)["c"]
    assert found["why"] == "int8 kernel 0.300 ms, cpu.qconv.dequantized 0.400 ms chosen"


def test_a_refused_int8_kernel_gives_its_reason():
    refusal = "unsupported: two weights of one output channel sum past 128 in magnitude"
    found = summarize(_program("c"), {"layers": {"c": _layer("cpu.qconv.dequantized", 0.4, refusal)}})["c"]
    assert found == {"precision": "fp32", "tactic": "cpu.qconv.dequantized", "why": f"int8 kernel {refusal}"}


def _qgemm_program(name: str) -> SimpleNamespace:
    return SimpleNamespace(steps=[StepSpec("QGemm", name, ["x"], [f"{name}_y"], domain="kiln", opset=1)])


def test_kilns_own_int8_gemm_is_an_int8_kernel():
    """cpu.qgemm.kiln_i8 (i8gemm.c) chosen: the layer is int8, not "fp32"; kept in fp32, the fastest int8 kernel
    timed is the one compared (not the first listed)."""
    candidates = {"default": 3.1, "cpu.qgemm.onednn": 0.94, "cpu.qgemm.dequantized": 1.7, "cpu.qgemm.kiln_i8": 0.81}
    tactics = {"layers": {"g": {"tactic": "cpu.qgemm.kiln_i8", "time_ms": 0.81, "runner_up": "cpu.qgemm.onednn",
                                "runner_up_ms": 0.94, "candidates": candidates}}}
    found = summarize(_qgemm_program("g"), tactics)["g"]
    assert found["precision"] == "int8" and found["tactic"] == "cpu.qgemm.kiln_i8"
    assert found["why"] == "int8 kernel 0.810 ms, next cpu.qgemm.onednn 0.940 ms"
    kept = {"layers": {"g": {"tactic": "cpu.qgemm.dequantized", "time_ms": 0.7, "candidates": candidates}}}
    assert summarize(_qgemm_program("g"), kept)["g"]["why"].startswith("int8 kernel slower: 0.810 ms vs 0.700 ms")
