"""cuda.gemm.cublas_float32_out (kiln/tactics/cuda/gemm_float32_out.py) on the GPU: cuBLAS's half GEMM storing
fp32 (aten::mm.dtype_out) into 128-byte-pitched rows, against torch's float64 matmul of the same half inputs, at
GPT-2's LM head (8 x 512 x 768 -> 50257, no bias) and a small bf16 layer with a bias and K not a multiple of 8;
then through an fp16 engine whose last GEMM (an odd N) the tactic runs, CUDA graph included. Times are printed beside
cuda.gemm.cublas_addmm_act's fp32 path (contiguous output) and the Triton GEMM, never asserted."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from kiln.ops.registry import OpContext
from kiln.tactics import registry
from kiln.tactics.tactic import InputMeta
from tests.gpu.common import graph_replay, median_ms
from tests.unit.tactic_check import make_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "0",
                       reason="TRITON_INTERPRET is set (an interpreter test ran in this session): run tests/gpu alone"),
]

NAME = "cuda.gemm.cublas_float32_out"
DEVICE = torch.device("cuda")
PEERS = ("cuda.gemm.cublas_addmm_act", "cuda.gemm.triton.128x128x64", "cuda.gemm.triton.128x256x64")


def _launch(name: str, step, args: list, constant: set[int]):
    tactic = registry.get(name)
    verdict = tactic.check(step, [InputMeta.of(a, i in constant) for i, a in enumerate(args)])
    if verdict is not True:
        return None, verdict
    ctx = OpContext(name=step.name, op_type=step.op_type, domain=step.domain, opset=step.opset,
                    num_inputs=len(args), num_outputs=1)
    constants = [a if i in constant else None for i, a in enumerate(args)]
    launch = tactic.prepare(dataclasses.replace(step, tactic=name), constants, DEVICE)
    return (lambda: launch(ctx, *args, **step.attributes)), None


@pytest.mark.parametrize("shape, n, dtype, bias", [
    ((8, 512, 768), 50257, torch.float16, False),  # GPT-2's LM head at 8 x 512 (the zoo row)
    ((3, 5, 40), 13, torch.bfloat16, True),  # K padded to 48, a bias, an odd N
])
def test_fp32_output_against_torch_float64_matmul(shape, n, dtype, bias):
    torch.manual_seed(0)
    k = shape[-1]
    args = [torch.randn(shape, device=DEVICE).to(dtype), (torch.randn(n, k, device=DEVICE) * 0.04).to(dtype)]
    if bias:
        args.append(torch.randn(n, device=DEVICE).to(dtype))
    step = make_step("FusedGemm", "kiln", len(args), output_float32=1)
    run, verdict = _launch(NAME, step, args, {1, 2} if bias else {1})
    assert verdict is None, verdict
    got = run()
    torch.cuda.synchronize()
    # the same half values multiplied in float64 (no TF32, whatever the process set): 1.6 GB at GPT-2's size
    want = torch.nn.functional.linear(*(a.double() for a in args)).float()
    assert got.dtype == torch.float32 and got.shape == (*shape[:-1], n)
    assert got.stride(-2) == -(-n // 32) * 32 and got.stride(-1) == 1  # the padded rows, no copy
    # cuBLAS sums exact products of half values in fp32 (|y| ~ 1: ~1e-6 off float64). A result
    # rounded to half on the way would be off by up to 2^-11 |y| (~5e-4): this tolerance catches it.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(graph_replay(run), want, rtol=1e-4, atol=1e-4)  # captured, as the engine runs it

    print(f"\n[{shape} x {n} {str(dtype).removeprefix('torch.')}] {NAME}: {median_ms(run):.3f} ms")
    for peer in PEERS:
        peer_run, why = _launch(peer, step, args, {1, 2} if bias else {1})
        print(f"  {peer}: " + (f"{median_ms(peer_run):.3f} ms" if peer_run else f"declined: {why}"))


def test_an_fp16_engine_runs_its_odd_lm_head_through_the_tactic(tmp_path):
    """x [32, 256] -> Gemm -> Relu -> Gemm -> logits [32, 1001] fp32: the last layer marked output_float32 by the CUDA
    build, forced onto this tactic; the engine's output (a strided view) against onnxruntime, twice (the second call a
    CUDA-graph replay)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    import kiln
    from kiln.runtime.engine import Engine

    rng = np.random.default_rng(0)
    w1, b1 = (rng.standard_normal((512, 256)) / 16).astype(np.float32), rng.standard_normal(512).astype(np.float32)
    w2 = (rng.standard_normal((1001, 512)) / 22).astype(np.float32)
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "w2"], ["logits"], transB=1)]
    graph = helper.make_graph(nodes, "lm_head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 256])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [32, 1001])],
                              [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"))])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)  # the device's onnxruntime reads IR <= 13
    path = tmp_path / "lm_head.onnx"
    path.write_bytes(proto.SerializeToString())

    built = kiln.build(str(path), device="cuda", precision="fp16")
    last = [s for s in built.plan.program.steps if s.op_type == "FusedGemm"][-1]
    assert last.attributes.get("output_float32") == 1, last.attributes
    record = built.plan.header["tactics"].get("layers", {}).get(last.name, {})
    print(f"\n[engine] {last.name}: chosen {record.get('tactic')}, candidates {record.get('candidates')}")
    last.tactic, last.tactic_config = NAME, {}
    engine = Engine(built.plan)
    context = engine.create_execution_context()
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for _ in range(3):
        x = rng.standard_normal((32, 256)).astype(np.float32)
        got = context.run({"x": torch.from_numpy(x).to(DEVICE)})["logits"]
        assert got.dtype == torch.float32 and tuple(got.shape) == (32, 1001)
        # fp16 weights and hidden activations; the logits are fp32 sums (not rounded to half)
        np.testing.assert_allclose(got.cpu().numpy(), session.run(None, {"x": x})[0], rtol=2e-2, atol=2e-2)
