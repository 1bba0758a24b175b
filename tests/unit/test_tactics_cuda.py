"""CUDA tactics (kiln/tactics/cuda/library.py, memory_bound.py) without a GPU: each tactic's launch on CPU tensors
against the op's registered implementation — Triton kernels under TRITON_INTERPRET=1, torch library calls on their CPU
kernels — plus what supports() refuses, and one engine built with the tactics standing in for CPU ones.

The same tactics at real sizes on the H200, fp16, with timings: tests/gpu/test_cuda_tactics.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tests.kernels.conftest  # noqa: F401  TRITON_INTERPRET=1 before triton loads (jit reads it); interpreter shims

pytest.importorskip("triton")

from kiln.ops.registry import OpContext  # noqa: E402
from kiln.tactics import registry  # noqa: E402
from tests.unit.tactic_check import (  # noqa: E402
    cuda_tactics_on_cpu, make_step, run_against_reference, tuned_candidates,
)
from tests.unit.tactic_check import reason as _reason  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes


def _interpreted() -> str | None:
    """Why the Triton tactics cannot run here, or None (kernels may have been imported compiled earlier)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "TRITON_INTERPRET is not 1"
    from kiln.kernels.cuda.triton import epilogue
    if type(epilogue._bias_activation_kernel).__name__ != "InterpretedFunction":
        return "kiln's Triton kernels were imported before TRITON_INTERPRET=1 was set in this session"
    return None


needs_interpreter = pytest.mark.skipif(_interpreted() is not None, reason=str(_interpreted()))
CPU = torch.device("cpu")
EXPECTED = {
    "cuda.elementwise.triton", "cuda.layer_norm.triton", "cuda.layer_norm.triton.onnx", "cuda.rms_norm.triton",
    "cuda.rms_norm.triton.onnx", "cuda.softmax.triton", "cuda.softmax.triton.onnx_softmax",
    "cuda.softmax.triton.onnx_logsoftmax", "cuda.gemm.cublas_triton_epilogue", "cuda.gemm.cublas_addmm_act",
    "cuda.gemm.triton.128x128x64", "cuda.gemm.triton.64x128x32", "cuda.gemm.triton.16x64x64",
    "cuda.gemm.triton.128x256x64", "cuda.conv.channels_last", "cuda.conv.channels_last_triton_epilogue",
    "cuda.attention.flash", "cuda.attention.efficient", "cuda.attention.cudnn", "cuda.conv.patchify_gemm",
    "cuda.rotary.triton",
}


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype)


# ---- registration ------------------------------------------------------------------------------

def test_every_cuda_tactic_is_registered_for_its_op():
    cuda = {n: t for n, t in registry.all_tactics().items() if t.device == "cuda"}
    assert EXPECTED <= set(cuda)
    gemm = [t.name for t in registry.candidates("FusedGemm", "kiln", "cuda", opt_level=2)]
    assert gemm[:2] == ["cuda.gemm.cublas_triton_epilogue", "cuda.gemm.cublas_addmm_act"]
    assert "cuda.gemm.triton.128x256x64" not in gemm  # the widest tile is tried from opt_level 3
    # the padded cuBLAS ones take only unaligned K or N (kiln/tactics/cuda/gemm_padded.py, gemm_float32_out.py)
    plain = [n for n in gemm if ".swiglu." not in n and n not in ("cuda.gemm.cublas_padded",
                                                                  "cuda.gemm.cublas_float32_out")]
    assert len(plain) == 5  # a modest candidate list at default builds
    assert "cuda.gemm.cublas_float32_out" in gemm
    # the gated MLP's tactics (kiln/tactics/cuda/swiglu.py) take only SwiGLU layers, which the others refuse
    assert [n for n in gemm if ".swiglu." in n] == [
        "cuda.gemm.swiglu.cublas_elementwise", "cuda.gemm.swiglu.triton.128x64x64", "cuda.gemm.swiglu.triton.64x64x64",
        "cuda.gemm.swiglu.triton.16x64x64"]


def test_importing_the_cuda_tactics_does_not_import_triton():
    code = "import sys, kiln.tactics.cuda.library; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


# ---- each tactic against the reference ---------------------------------------------------------

@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_elementwise_chain(dtype):
    code = ["Mul i0 i1", "Add t0 i2", "Gelu t1", "Sub t2 i0"]
    step = make_step("Elementwise", "kiln", 3, code=code)
    run_against_reference("cuda.elementwise.triton", step,
                          [randn(4, 3, 33, dtype=dtype), randn(33, dtype=dtype), torch.tensor(0.5, dtype=dtype)])


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_skip_layer_norm_with_the_sum_as_second_output(dtype):
    step = make_step("LayerNorm", "kiln", 4, n_outputs=2, axis=-1, epsilon=1e-5)
    args = [randn(2, 5, 48, dtype=dtype, scale=3), randn(48, dtype=dtype), randn(48, dtype=dtype),
            randn(2, 5, 48, dtype=dtype)]
    run_against_reference("cuda.layer_norm.triton", step, args, constant={1, 2})


@needs_interpreter
def test_layer_norm_over_two_trailing_dims_one_output():
    step = make_step("LayerNorm", "kiln", 3, axis=-2, epsilon=1e-6)
    run_against_reference("cuda.layer_norm.triton", step, [randn(3, 4, 10), randn(4, 10), randn(10)], {1, 2})


@needs_interpreter
def test_onnx_layer_normalization():
    step = make_step("LayerNormalization", "", 3, opset=17, axis=-1, epsilon=1e-5)
    run_against_reference("cuda.layer_norm.triton.onnx", step, [randn(3, 7, 40), randn(40), randn(40)], {1, 2})


@needs_interpreter
@pytest.mark.parametrize("op_type,domain,name", [("RMSNorm", "kiln", "cuda.rms_norm.triton"),
                                                 ("RMSNormalization", "", "cuda.rms_norm.triton.onnx")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_rms_norm(op_type, domain, name, dtype):
    step = make_step(op_type, domain, 2, opset=23, epsilon=1e-6)
    run_against_reference(name, step, [randn(6, 64, dtype=dtype, scale=2), randn(64, dtype=dtype)], {1})


@needs_interpreter
@pytest.mark.parametrize("op_type,domain,opset,attributes,name", [
    ("Softmax", "kiln", 21, {"axis": -1}, "cuda.softmax.triton"),
    ("Softmax", "", 13, {}, "cuda.softmax.triton.onnx_softmax"),
    ("Softmax", "", 11, {"axis": 2}, "cuda.softmax.triton.onnx_softmax"),  # old flatten-from-axis, axis last
    ("LogSoftmax", "", 13, {"axis": -1}, "cuda.softmax.triton.onnx_logsoftmax"),
])
def test_softmax(op_type, domain, opset, attributes, name):
    step = make_step(op_type, domain, 1, opset=opset, **attributes)
    run_against_reference(name, step, [randn(2, 3, 37, scale=4)])


def _rotary_table(shape, dtype):
    """cos/sin of random angles (a real table's values, |.| <= 1), full width as kiln::Rotary takes them."""
    angles = torch.rand(*shape) * 6.3
    return angles.cos().to(dtype), angles.sin().to(dtype)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_on_heads(dtype, interleaved):
    # x [B, S, H, D], one table per position shared by batch and heads (stride 0 in the kernel)
    cos, sin = _rotary_table((5, 1, 16), dtype)
    step = make_step("Rotary", "kiln", 3, interleaved=interleaved)
    run_against_reference("cuda.rotary.triton", step, [randn(2, 5, 4, 16, dtype=dtype), cos, sin])


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rotary_on_a_strided_slice_of_packed_qkv(dtype):
    # q sliced out of a packed q|k|v [B, S, 3·H·D] (a strided view, read in place), viewed as H heads
    packed = randn(2, 7, 3 * 4 * 8, dtype=dtype)
    q = packed[..., : 4 * 8]
    assert not q.is_contiguous()
    cos, sin = _rotary_table((2, 7, 1, 8), dtype)
    step = make_step("Rotary", "kiln", 3, num_heads=4)
    got = run_against_reference("cuda.rotary.triton", step, [q, cos, sin])
    assert got.shape == (2, 7, 4, 8)


@needs_interpreter
def test_rotary_rotates_only_the_first_heads_of_a_packed_qkv():
    # q and k heads rotate, v's pass through, the packed shape is kept (fuse_packed_rotary's layer)
    cos, sin = _rotary_table((3, 1, 16), torch.float32)
    step = make_step("Rotary", "kiln", 3, num_heads=6, rotate_heads=4)
    x = randn(1, 3, 6 * 16)
    got = run_against_reference("cuda.rotary.triton", step, [x, cos, sin])
    assert got.shape == x.shape
    torch.testing.assert_close(got[..., 4 * 16:], x[..., 4 * 16:], rtol=0, atol=0)  # v exact


def test_rotary_refusals():
    step = make_step("Rotary", "kiln", 3)
    cos, sin = _rotary_table((5, 1, 16), torch.float32)
    assert "dtype" in _reason("cuda.rotary.triton", step, [randn(2, 5, 4, 16, dtype=torch.float16), cos, sin])
    assert "odd" in _reason("cuda.rotary.triton", step, [randn(2, 5, 4, 15)] + list(_rotary_table((5, 1, 15), torch.float32)))
    wide = _rotary_table((3, 5, 1, 16), torch.float32)  # a batch of 3 tables for a batch of 2
    assert "broadcast" in _reason("cuda.rotary.triton", step, [randn(2, 5, 4, 16), *wide])


GEMM_CASES = [  # tactic, dtype, activation, residual_after_activation, with residual
    ("cuda.gemm.cublas_triton_epilogue", torch.float32, "Gelu", 1, True),
    ("cuda.gemm.cublas_triton_epilogue", torch.float16, "", 1, False),
    ("cuda.gemm.cublas_addmm_act", torch.float32, "Relu", 1, True),
    ("cuda.gemm.cublas_addmm_act", torch.float32, "GeluTanh", 1, False),
    ("cuda.gemm.cublas_addmm_act", torch.float32, "Relu", 0, True),  # residual before ReLU: no fused activation
    ("cuda.gemm.triton.16x64x64", torch.float16, "Relu", 0, True),
    ("cuda.gemm.triton.64x128x32", torch.float16, "SiLU", 1, True),
    ("cuda.gemm.triton.16x64x64", torch.bfloat16, "GeluTanh", 1, False),
]


@needs_interpreter
@pytest.mark.parametrize("name,dtype,activation,after,with_residual", GEMM_CASES)
def test_fused_gemm(name, dtype, activation, after, with_residual):
    step = make_step("FusedGemm", "kiln", 4, activation=activation, residual_after_activation=after)
    x, w, b = randn(3, 25, 40, dtype=dtype), randn(24, 40, dtype=dtype, scale=0.2), randn(24, dtype=dtype)
    residual = randn(3, 25, 24, dtype=dtype) if with_residual else None
    run_against_reference(name, step, [x, w, b, residual], constant={1, 2})


@needs_interpreter
@pytest.mark.parametrize("name", ["cuda.conv.channels_last", "cuda.conv.channels_last_triton_epilogue"])
@pytest.mark.parametrize("group", [1, 2])
def test_fused_conv_channels_last(name, group):
    step = make_step("FusedConv", "kiln", 4, kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2], group=group,
                     activation="Relu", residual_after_activation=0)
    x, w, b = randn(2, 4, 9, 9), randn(8, 4 // group, 3, 3, scale=0.3), randn(8)
    residual = randn(2, 8, 5, 5).contiguous(memory_format=torch.channels_last)
    run_against_reference(name, step, [x, w, b, residual], constant={1, 2})


def test_conv_channels_last_output_stays_channels_last():
    step = make_step("FusedConv", "kiln", 3, kernel_shape=[1, 1], activation="Relu")
    w, b = randn(6, 4, 1, 1), randn(6)
    launch = registry.get("cuda.conv.channels_last").prepare(step, [None, w, b], CPU)
    ctx = OpContext(name="c", op_type="FusedConv", domain="kiln")
    y = launch(ctx, randn(2, 4, 5, 5), w, b, **step.attributes)
    assert y.is_contiguous(memory_format=torch.channels_last)


def test_attention_flash_backend_on_cpu_with_absorbed_head_layout():
    """torch's CPU flash kernel stands in for the CUDA one: the forced backend, kiln's layout handling."""
    step = make_step("Attention", "kiln", 3, scale=0.25, q_num_heads=4, kv_num_heads=4, q_perm=[0, 2, 1, 3],
                     k_perm=[0, 2, 1, 3], v_perm=[0, 2, 1, 3], out_perm=[0, 2, 1, 3], out_merge_heads=1, is_causal=1)
    q, k, v = (randn(2, 12, 64, dtype=torch.float16) for _ in range(3))  # [B, S, H·D], D = 16
    run_against_reference("cuda.attention.flash", step, [q, k, v])


# ---- what supports() refuses -------------------------------------------------------------------

def test_unsupported_layers_say_why():
    x16 = randn(2, 8, 16, 32, dtype=torch.float16)
    assert "not the last" in _reason("cuda.softmax.triton", make_step("Softmax", "kiln", 1, axis=1), [x16])
    assert "not the last" in _reason("cuda.softmax.triton.onnx_softmax", make_step("Softmax", "", 1, opset=11),
                                     [x16])  # opset 11 default axis 1 flattens over three dims
    assert "Mean" in _reason("cuda.layer_norm.triton.onnx", make_step("LayerNormalization", "", 3, n_outputs=3),
                             [x16, randn(32, dtype=torch.float16), None])
    assert "promote" in _reason("cuda.layer_norm.triton", make_step("LayerNorm", "kiln", 2),
                                [x16, randn(32)])  # fp32 scale on fp16 x
    gemm = make_step("FusedGemm", "kiln", 4)
    w = randn(24, 32, dtype=torch.float16)
    assert "broadcast" in _reason("cuda.gemm.cublas_triton_epilogue", gemm,
                                  [randn(4, 32, dtype=torch.float16), w, None, randn(3, 4, 24, dtype=torch.float16)])
    assert "padding" in _reason("cuda.gemm.triton.128x128x64", gemm, [randn(4, 32, dtype=torch.float16), w, None])
    assert "takes float16, bfloat16" in _reason("cuda.gemm.triton.16x64x64", gemm, [randn(4, 32), randn(24, 32)])
    assert "Elementwise" in _reason("cuda.elementwise.triton", make_step("Elementwise", "kiln", 1, code=["Foo i0"]),
                                    [x16])
    conv = make_step("FusedConv", "kiln", 2)
    assert "constant" in _reason("cuda.conv.channels_last", conv, [randn(1, 4, 5, 5), randn(4, 4, 3, 3)])
    attention = make_step("Attention", "kiln", 4, scale=0.125)
    q = randn(2, 4, 16, 64, dtype=torch.float16)
    assert "mask" in _reason("cuda.attention.flash", attention, [q, q, q, randn(16, 16, dtype=torch.float16)])
    causal = make_step("Attention", "kiln", 3, scale=0.125, is_causal=1)
    assert "bottom-right" in _reason("cuda.attention.cudnn", causal, [q, q[:, :, :8], q[:, :, :8]])


# ---- the tactics inside an engine --------------------------------------------------------------

class _Block(torch.nn.Module):
    """A conv stack into a transformer-ish head: FusedConv, FusedGemm, LayerNorm, Softmax, Elementwise."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x):
        y = torch.relu(self.conv1(x))
        y = torch.relu(self.conv2(y) + y)  # [B, 8, 4, 4]
        t = y.flatten(2)  # [B, 8, 16]
        t = self.norm(t + self.fc2(torch.nn.functional.gelu(self.fc1(t))))
        return torch.softmax(t * 2.0 + 1.0, dim=-1)


@needs_interpreter
def test_engine_with_cuda_tactics_standing_in_for_cpu_ones(tmp_path, monkeypatch):
    """The build-time search and the runtime, end to end: the CUDA tactics as if this CPU were the device."""
    import onnxruntime as ort

    import kiln

    cuda_tactics_on_cpu(monkeypatch, lambda name: not name.startswith("cuda.attention"))
    torch.manual_seed(0)
    path = tmp_path / "block.onnx"
    torch.onnx.export(_Block().eval(), (torch.randn(2, 3, 4, 4),), str(path), dynamo=True,
                      input_names=["x"], output_names=["y"])
    engine = kiln.build(str(path), device="cpu", tactics=["cuda"], tuning_runs=3)
    layers = engine.plan.header["tactics"]["layers"]
    _tried, checked = tuned_candidates(engine)  # checked: passed the check, then timed
    assert {"cuda.conv.channels_last_triton_epilogue", "cuda.gemm.cublas_triton_epilogue", "cuda.elementwise.triton",
            "cuda.layer_norm.triton", "cuda.softmax.triton.onnx_softmax"} <= checked  # the norm takes fc2's residual

    # Force the first checked CUDA tactic on every layer (on CPU the interpreter never wins the timing).
    program = engine.plan.program
    for step in program.steps:
        timed = [n for n, note in layers.get(step.name, {}).get("candidates", {}).items()
                 if n.startswith("cuda.") and isinstance(note, float)]
        if timed:
            step.tactic = timed[0]
    forced = kiln.Engine(engine.plan)
    assert {s.tactic for s in program.steps} - {""}
    x = np.random.default_rng(1).standard_normal((2, 3, 4, 4)).astype(np.float32)
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(forced.run({"x": x})["y"], expected, rtol=1e-4, atol=1e-5)


def test_patchify_gemm_matches_the_convolution():
    """ViT's patch embedding (stride == kernel) as patches @ Wᵀ: with bias, a trailing partial window,
    residual + activation, and the refusals."""
    vit = make_step("FusedConv", "kiln", 3, kernel_shape=[16, 16], strides=[16, 16])
    run_against_reference("cuda.conv.patchify_gemm", vit,
                          [randn(2, 3, 64, 48), randn(24, 3, 16, 16, scale=0.05), randn(24)], {1, 2})
    ragged = make_step("FusedConv", "kiln", 4, kernel_shape=[4, 4], strides=[4, 4], activation="Gelu")
    run_against_reference("cuda.conv.patchify_gemm", ragged,
                          [randn(2, 5, 18, 23), randn(8, 5, 4, 4), randn(8), randn(2, 8, 4, 5)], {1, 2})
    assert "overlap" in _reason("cuda.conv.patchify_gemm", make_step("FusedConv", "kiln", 2, kernel_shape=[3, 3]),
                                [randn(1, 4, 8, 8), randn(4, 4, 3, 3)], {1})
    padded = make_step("FusedConv", "kiln", 2, kernel_shape=[2, 2], strides=[2, 2], pads=[1, 1, 1, 1])
    assert "padded" in _reason("cuda.conv.patchify_gemm", padded, [randn(1, 4, 8, 8), randn(4, 4, 2, 2)], {1})
