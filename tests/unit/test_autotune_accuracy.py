"""The tuner's whole-engine check (kiln/builder/accuracy.py): a tuned engine is judged against the error
the default engine itself makes at its precision; only the layers to blame go back to their default,
and the header, `kiln build` and `kiln inspect` say which and why.

The models are chains of kiln::FusedGemm layers (MatMul + Add [+ activation] after optimization);
throwaway tactics, registered for the test and picked per layer by name, stand in for real kernels,
and `measure` is replaced so that they always win: the timings decide nothing here.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.builder import autotune
from kiln.builder.accuracy import WHOLE_MODEL_TOLERANCE, mismatch, upcast
from kiln.cli import main
from kiln.ops.fused import fused_gemm
from kiln.tactics.tactic import DEFAULT
from tests.unit.tactic_check import winning_test_tactics

F32 = TensorProto.FLOAT
WIDTH, ROWS = 16, 8


def gemm_chain(path, layers: int, *, gain: float = 1.0, activations: list[str] | None = None,
               orthogonal: bool = False, seed: int = 0) -> str:
    """x: [ROWS, WIDTH] -> layers x (MatMul W_k + b_k -> activation_k) -> y; after optimization one
    FusedGemm per layer named matmul{k} (a Sin stays a layer of its own)."""
    rng = np.random.default_rng(seed)
    nodes, inits, value = [], [], "x"
    for k in range(layers):
        if orthogonal:  # keeps the activations' scale through a deep linear stack
            w = np.linalg.qr(rng.standard_normal((WIDTH, WIDTH)))[0] * gain
        else:
            w = rng.standard_normal((WIDTH, WIDTH)) * gain / np.sqrt(WIDTH)
        inits += [numpy_helper.from_array(w.astype(np.float32), f"w{k}"),
                  numpy_helper.from_array((rng.standard_normal(WIDTH) * 0.1).astype(np.float32), f"b{k}")]
        nodes += [helper.make_node("MatMul", [value, f"w{k}"], [f"m{k}"], name=f"matmul{k}"),
                  helper.make_node("Add", [f"m{k}", f"b{k}"], [f"a{k}"], name=f"add{k}")]
        value = f"a{k}"
        activation = (activations or [""] * layers)[k]
        if activation:
            nodes.append(helper.make_node(activation, [value], [f"h{k}"], name=f"{activation.lower()}{k}"))
            value = f"h{k}"
    nodes.append(helper.make_node("Identity", [value], ["y"], name="output"))
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", F32, [ROWS, WIDTH])],
                              [helper.make_tensor_value_info("y", F32, [ROWS, WIDTH])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    out = str(path / "chain.onnx")
    onnx.save(model, out)
    return out


@pytest.fixture
def gemm_tactics(monkeypatch):
    """Register test tactics for kiln::FusedGemm (each for the layers named, or all); they win every
    timing. Removed afterwards."""
    yield from winning_test_tactics(monkeypatch, "FusedGemm", (torch.float32, torch.float16))


def row_major(x: torch.Tensor) -> torch.Tensor:
    """x's storage read as if it were row-major, whatever its strides: what a kernel that takes a
    raw data pointer without asking for a contiguous tensor computes on."""
    strides, step = [], 1
    for d in reversed(x.shape):
        strides.append(step)
        step *= d
    return x.as_strided(x.shape, tuple(reversed(strides)))


def layout_tactics(add) -> None:
    """matmul0 returns the right values column-major; matmul1 misreads a column-major input (right
    on the row-major inputs the default engine gives it, so it passes its own check); matmul2 is right."""
    add("cpu.test.gemm.column_major", lambda ctx, *a, **k: fused_gemm(ctx, *a, **k).t().contiguous().t(),
        layers={"matmul0"})
    add("cpu.test.gemm.reads_row_major", lambda ctx, x, *a, **k: fused_gemm(ctx, row_major(x), *a, **k),
        layers={"matmul1"})
    add("cpu.test.gemm.plain", fused_gemm, layers={"matmul2"})


def chosen(engine) -> dict[str, str]:
    return {s.name: s.tactic for s in engine.plan.program.steps if s.op_type == "FusedGemm"}


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_tactic_wrong_only_in_combination_is_reverted_alone(tmp_path, gemm_tactics, precision):
    layout_tactics(gemm_tactics)
    model = gemm_chain(tmp_path, 3, activations=["Relu", "Relu", ""])
    log: list[str] = []
    engine = kiln.build(model, tactics=["cpu.test"], precision=precision, progress=log.append)
    record = engine.plan.header["tactics"]
    assert chosen(engine) == {"matmul0": "cpu.test.gemm.column_major", "matmul1": "",
                              "matmul2": "cpu.test.gemm.plain"}
    # Each passed its own check on the default engine's inputs: the search chose all three.
    assert all(isinstance(record["layers"][f"matmul{k}"]["candidates"][t], float)
               for k, t in enumerate(("cpu.test.gemm.column_major", "cpu.test.gemm.reads_row_major",
                                      "cpu.test.gemm.plain")))
    assert list(record["reverted_layers"]) == ["matmul1"]
    why = record["reverted_layers"]["matmul1"]
    assert why.startswith("cpu.test.gemm.reads_row_major: wrong in this engine") and "max abs error" in why
    assert record["layers"]["matmul1"]["tactic"] == DEFAULT and record["layers"]["matmul1"]["reverted"] == why
    assert "reverted" not in record  # not the whole engine
    assert record["accuracy"]["tuned_engine"].startswith("output 'y': max abs error")
    assert record["accuracy"]["reference"] == ("the default engine" if precision == "fp32"
                                               else "a float32 run of the default engine")
    assert any("layer matmul1 reverted to its default (was cpu.test.gemm.reads_row_major)" in line for line in log)
    assert "tactics: 1 layer(s) reverted to their default: matmul1" in log

    # The engine as kept computes the model: numpy on the same weights, within the dtype's rounding.
    x = np.random.default_rng(1).standard_normal((ROWS, WIDTH)).astype(np.float32)
    want = kiln.build(model, precision="fp32", tactics=["none"]).run({"x": x})["y"]
    got = engine.run({"x": x})["y"]
    # fp16: x, the weights and two activations stored in half, outputs ~1: a few half ulps
    tolerance = {"fp32": (1e-5, 1e-5), "fp16": (1e-2, 1e-2)}[precision]
    np.testing.assert_allclose(got, want, rtol=tolerance[0], atol=tolerance[1])


def test_a_tactic_that_fails_on_its_neighbours_layout_is_reverted_alone(tmp_path, gemm_tactics):
    def contiguous_only(ctx, x, *a, **k):
        if not x.is_contiguous():
            raise RuntimeError("input is not row-major")
        return fused_gemm(ctx, x, *a, **k)

    gemm_tactics("cpu.test.gemm.column_major", lambda ctx, *a, **k: fused_gemm(ctx, *a, **k).t().contiguous().t(),
                 layers={"matmul0", "matmul2"})
    gemm_tactics("cpu.test.gemm.contiguous_only", contiguous_only, layers={"matmul1"})
    engine = kiln.build(gemm_chain(tmp_path, 3, activations=["Relu", "Relu", ""]), tactics=["cpu.test"])
    record = engine.plan.header["tactics"]
    assert chosen(engine) == {"matmul0": "cpu.test.gemm.column_major", "matmul1": "",
                              "matmul2": "cpu.test.gemm.column_major"}
    assert record["accuracy"]["tuned_engine"].startswith("it failed: ExecutionError")
    assert "failed: RuntimeError: input is not row-major" in record["reverted_layers"]["matmul1"]


def test_errors_that_compound_revert_the_fewest_layers_that_fix_them(tmp_path, gemm_tactics):
    # Each layer 8e-5 off relative to its output: within its own fp32 check (1e-4), but through 16
    # layers (1 + 8e-5)^16 - 1 = 1.3e-3 of the output's scale, beyond the whole engine's 1e-3.
    gemm_tactics("cpu.test.gemm.slightly_off", lambda ctx, *a, **k: fused_gemm(ctx, *a, **k) * (1 + 8e-5))
    layers = 16
    engine = kiln.build(gemm_chain(tmp_path, layers, orthogonal=True), tactics=["cpu.test"])
    record = engine.plan.header["tactics"]
    kept = [name for name, tactic in chosen(engine).items() if tactic]
    reverted = record["reverted_layers"]
    # 12 layers at 8e-5 give 9.6e-4: a few reverts fix it (fewer than 4 where the biases added after a
    # layer dilute its share of the output), never most of the layers
    assert 1 <= len(reverted) <= 5 and len(kept) == layers - len(reverted)
    assert all(why.startswith("cpu.test.gemm.slightly_off: errors that compound: right on the inputs it is given")
               for why in reverted.values())
    assert "reverted" not in record
    outputs = record["accuracy"]["outputs"]["y"]
    assert outputs["error"] <= outputs["allowed"]


def test_a_model_whose_default_drifts_from_fp32_in_half_precision_keeps_its_tactics(tmp_path, gemm_tactics):
    # Sin after GEMMs of gain 6: a half-ulp of rounding grows ~30x a layer, so after four layers the
    # fp16 engine has nothing left in common with the float32 run, whichever kernels it runs (random
    # BatchNorm statistics did the same to ResNet-50 in fp16: 13% off).
    def rounds_once(ctx, *args, **attrs):  # another fp16 kernel: fp32 inside, rounded differently
        y = fused_gemm(ctx, *upcast(list(args)), **attrs)
        return (y * (1 + 2 ** -11)).to(args[0].dtype)

    gemm_tactics("cpu.test.gemm.rounds_once", rounds_once)
    model = gemm_chain(tmp_path, 4, gain=6.0, activations=["Sin"] * 4)
    engine = kiln.build(model, tactics=["cpu.test"], precision="fp16")
    record = engine.plan.header["tactics"]
    assert "reverted" not in record and "reverted_layers" not in record
    assert all(t == "cpu.test.gemm.rounds_once" for t in chosen(engine).values()) and len(chosen(engine)) == 4
    accuracy = record["accuracy"]
    assert accuracy["reference"] == "a float32 run of the default engine" and accuracy["tuned_engine"] == "accepted"
    y = accuracy["outputs"]["y"]
    assert y["default_error"] > 0.5  # the default fp16 engine itself: outputs in [-1, 1], off by > 0.5
    assert y["error"] <= y["allowed"]

    # Judged against the default fp16 engine, as the tuner did before, the tuned engine fails.
    x = np.random.default_rng(2).standard_normal((ROWS, WIDTH)).astype(np.float32)
    default = kiln.build(model, tactics=["none"], precision="fp16")
    tuned, reference = (torch.from_numpy(e.run({"x": x})["y"]).half() for e in (engine, default))
    assert mismatch(tuned, reference, WHOLE_MODEL_TOLERANCE) is not None


def test_build_summary_and_inspect_say_what_was_reverted(tmp_path, gemm_tactics, capsys):
    layout_tactics(gemm_tactics)
    model = gemm_chain(tmp_path, 3, activations=["Relu", "Relu", ""])
    path = tmp_path / "chain.kiln"
    assert main(["build", model, "-o", str(path)]) == 0
    summary = " ".join(capsys.readouterr().out.split())  # as read, whatever the table wrapped
    assert "1 reverted to their default by the whole-engine check: matmul1" in summary
    assert "layer matmul1 runs its default (whole-engine check): cpu.test.gemm.reads_row_major: wrong" in summary
    assert main(["inspect", str(path)]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "1 reverted to their default by the whole-engine check: matmul1" in shown
    assert "layer matmul1 runs its default (whole-engine check): cpu.test.gemm.reads_row_major: wrong" in shown
    header = kiln.load(path).plan.header["tactics"]
    assert list(header["reverted_layers"]) == ["matmul1"]


def test_where_the_default_overflows_in_half_precision_the_tuned_engine_is_judged_against_it(tmp_path, gemm_tactics):
    # Gain 3000: the second layer's outputs (~1e7) overflow fp16 to infinity, not float32; the default
    # engine's own error is then unbounded, and the tuned engine is held to the default's outputs.
    gemm_tactics("cpu.test.gemm.plain", fused_gemm)
    engine = kiln.build(gemm_chain(tmp_path, 2, gain=3000.0), tactics=["cpu.test"], precision="fp16")
    record = engine.plan.header["tactics"]
    y = record["accuracy"]["outputs"]["y"]
    assert y["default_error"] == "inf" and y["against"].startswith("the default engine")
    assert record["accuracy"]["tuned_engine"] == "accepted" and "reverted_layers" not in record
    assert chosen(engine)["matmul0"] == "cpu.test.gemm.plain"


def test_a_layer_whose_every_candidate_fails_its_check_is_named_with_why(tmp_path, gemm_tactics, capsys):
    """A layer left on its default because the per-layer check rejected every candidate (the H200's int8
    ResNet-50: 16 fused residual layers on the reference, 12x slower, and nothing said so) is named with the
    reasons in the build log, the header (fallback_layers), the quantization/inspect lines; a layer whose
    candidate passed is not, and neither is one whose only candidate lost on time."""
    gemm_tactics("cpu.test.gemm.one_percent_off", lambda ctx, *a, **k: fused_gemm(ctx, *a, **k) * 1.01,
                 layers={"matmul1"})
    gemm_tactics("cpu.test.gemm.plain", fused_gemm, layers={"matmul0"})
    log: list[str] = []
    engine = kiln.build(gemm_chain(tmp_path, 2), tactics=["cpu.test"], progress=log.append)
    record = engine.plan.header["tactics"]
    assert chosen(engine) == {"matmul0": "cpu.test.gemm.plain", "matmul1": ""}
    assert list(record["fallback_layers"]) == ["matmul1"]
    why = record["fallback_layers"]["matmul1"]
    assert "every candidate (1) was rejected by the per-layer check" in why
    assert "cpu.test.gemm.one_percent_off" in why and "max abs error" in why
    assert any(line.startswith("tactics: WARNING layer matmul1 (FusedGemm) runs its default") for line in log)
    path = tmp_path / "chain.kiln"
    engine.save(path)
    assert main(["inspect", str(path)]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "1 on their default because every candidate failed its check: matmul1" in shown
    assert "WARNING layer matmul1 runs its default (per-layer check): FusedGemm: every candidate (1)" in shown

    losing = autotune.LayerTuning(DEFAULT, 1.0, candidates={DEFAULT: 1.0, "cpu.test.gemm.plain": 2.0,
                                                            "cpu.test.gemm.one_percent_off": "rejected: off"})
    assert autotune.fallback_reason(losing) is None  # a candidate passed and lost on time: a choice, not a fallback
