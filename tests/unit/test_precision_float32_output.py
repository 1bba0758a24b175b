"""output_float32 (kiln/builder/precision.py): in a half-precision engine the GEMM producing an fp32 output binding
stores fp32 itself (no boundary cast pass); the tactics that cannot are refused such a layer (Tactic.float32_output),
the Triton GEMM stores its fp32 accumulator (TRITON_INTERPRET=1), the engine matches onnxruntime."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

import tests.kernels.conftest  # noqa: F401  TRITON_INTERPRET=1 before triton loads (jit reads it); interpreter shims
import kiln
from tests.unit.tactic_check import make_step, metas
from tests.unit.test_passes_cleanup import make_model


def _two_gemms(n_out: int = 8):
    rng = np.random.default_rng()
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, n_out])]
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], transB=1)]
    inits = [("w1", rng.standard_normal((12, 16)).astype(np.float32)), ("b1", rng.standard_normal(12).astype(np.float32)),
             ("w2", rng.standard_normal((n_out, 12)).astype(np.float32)),
             ("b2", rng.standard_normal(n_out).astype(np.float32))]
    return make_model(nodes, [x], outs, inits), rng


def test_the_last_gemm_of_an_fp16_engine_writes_its_fp32_output_and_matches_onnxruntime():
    """On a CUDA build's program: marked as the builder marks it (the CPU engine runs the ops' own code)."""
    from kiln.builder.precision import write_float32_outputs

    proto, rng = _two_gemms()
    plain = kiln.build(proto, precision="fp16")
    assert not any(s.attributes.get("output_float32") for s in plain.plan.program.steps)  # CPU builds: not marked
    write_float32_outputs(plain.plan.program, "fp16")
    first, last = plain.plan.program.steps
    assert not first.attributes.get("output_float32") and first.output_dtypes == ["float16"]
    assert last.attributes["output_float32"] == 1 and last.output_dtypes == ["float"]
    engine = kiln.Engine(plain.plan)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for _ in range(2):
        x = rng.standard_normal((4, 16)).astype(np.float32)
        got = engine.run({"x": x})["y"]
        assert got.dtype == np.float32
        # fp16 weights and hidden activations (the output itself is not rounded to fp16 any more)
        np.testing.assert_allclose(got, session.run(None, {"x": x})[0], rtol=2e-2, atol=2e-2)


def test_a_gemm_whose_output_is_also_read_inside_is_not_marked():
    from kiln.builder.precision import write_float32_outputs
    from kiln.plan.spec import ProgramSpec, StepSpec

    gemm = StepSpec("FusedGemm", "g", ["x", "w"], ["y"], domain="kiln", output_dtypes=["float16"])
    reader = StepSpec("Relu", "r", ["y"], ["z"], output_dtypes=["float16"])
    write_float32_outputs(ProgramSpec(["x"], ["y", "z"], [gemm, reader]), "fp16")
    assert "output_float32" not in gemm.attributes


@pytest.mark.parametrize("name", ["cuda.gemm.cublas_triton_epilogue", "cuda.gemm.swiglu.cublas_elementwise",
                                  "cpu.gemm.mkl", "cuda.gemm.cudnn_fused"])
def test_tactics_that_store_the_inputs_dtype_are_refused_such_a_layer(name):
    from kiln.tactics import registry

    step = make_step("FusedGemm", "kiln", 2, output_float32=1)
    result = registry.get(name).check(step, metas([torch.randn(4, 32).half(), torch.randn(48, 32).half()], {1}))
    assert isinstance(result, str) and ("output_float32" in result or "not available" in result)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes
def test_the_triton_gemm_stores_its_fp32_accumulator():
    from kiln.ops.registry import OpContext, lookup
    from kiln.tactics import registry
    from tests.unit.test_tactics_cuda import needs_interpreter

    if needs_interpreter.args[0]:
        pytest.skip(needs_interpreter.kwargs["reason"])
    x, w, b = (torch.randn(3, 5, 40) * 2).half(), (torch.randn(72, 40) / 7).half(), torch.randn(72).half()
    op = "FusedGemm"
    step = make_step(op, "kiln", 3, output_float32=1, activation="Gelu")
    tactic = registry.get("cuda.gemm.triton.16x64x64")
    assert tactic.check(step, metas([x, w, b], {1, 2})) is True
    ctx = OpContext(name=step.name, op_type=op, domain="kiln", opset=21, num_inputs=3, num_outputs=1)
    got = tactic.prepare(step, [None, w, b], torch.device("cpu"))(ctx, x, w, b)
    want = lookup(op, "kiln").fn(ctx, x.float(), w.float(), b.float(), **step.attributes)  # fp32 throughout
    assert got.dtype == torch.float32 and got.shape == (3, 5, 72)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # fp32 sums of fp16 products, not half-rounded (5e-4)


def test_an_engine_storing_its_fp32_output_from_half_layers_is_judged_as_a_half_engine():
    """The tuner's whole-engine check: against the float32 run with the default's own half error allowed, not
    against the default engine at fp32 tolerance (which reverted 12 of DCN's 14 tuned layers on the H200)."""
    from kiln.builder import accuracy
    from kiln.builder.precision import write_float32_outputs
    from kiln.runtime.program import Program

    proto, rng = _two_gemms()
    engine = kiln.build(proto, precision="fp16", tactics=["none"])
    spec = engine.plan.program
    write_float32_outputs(spec, "fp16")
    default = Program(spec, dict(engine.plan.weights), torch.device("cpu"))
    inputs = [torch.from_numpy(rng.standard_normal((4, 16)).astype(np.float32)).half()]
    outputs = default.run(inputs)
    assert outputs[0].dtype == torch.float32
    base = accuracy.baseline(spec, default, outputs, inputs)
    assert base.source == "a float32 run of the default engine" and base.own_errors[0] > 0
