"""kiln's Triton kernels on CUDA at real sizes: correctness against torch in fp32, and a printed
timing comparison with the torch equivalent (`pytest tests/gpu/test_triton_kernels.py -s`;
never asserted: tests do not assert on time). Skipped without CUDA.

Run it on its own, not in one pytest session with tests/kernels: that directory's conftest sets
TRITON_INTERPRET=1, which would run these kernels in the (CPU) interpreter.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.tolerances import assert_close
from tests.gpu.common import median_ms

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "0",
                       reason="TRITON_INTERPRET is set (tests/kernels ran in this session): run tests/gpu alone"),
]
triton_kernels = pytest.importorskip("kiln.kernels.cuda.triton", exc_type=ImportError)

DEVICE = "cuda"


def report(name: str, kiln_fn, torch_fn, bytes_moved: int | None = None) -> None:
    kiln_ms, torch_ms = median_ms(kiln_fn), median_ms(torch_fn)
    bandwidth = f"  kiln {bytes_moved / kiln_ms / 1e6:7.0f} GB/s" if bytes_moved else ""
    print(f"\n[triton] {name:44s} kiln {kiln_ms:8.4f} ms  torch {torch_ms:8.4f} ms  "
          f"speed-up {torch_ms / kiln_ms:5.2f}x{bandwidth}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_layer_norm_bert(dtype):
    x = torch.randn(8192, 768, device=DEVICE).to(dtype)
    weight, bias = torch.randn(768, device=DEVICE).to(dtype), torch.randn(768, device=DEVICE).to(dtype)
    expected = F.layer_norm(x.float(), (768,), weight.float(), bias.float(), 1e-12)
    assert_close(triton_kernels.layer_norm(x, weight, bias, 1e-12), expected, dtype)
    report(f"LayerNorm 8192x768 {dtype}", lambda: triton_kernels.layer_norm(x, weight, bias, 1e-12),
           lambda: F.layer_norm(x, (768,), weight, bias, 1e-12), 2 * x.numel() * x.element_size())


@pytest.mark.parametrize("n", [4096, 20000], ids=["one_pass", "chunked"])
def test_rms_norm_llama(n):
    x = torch.randn(4096, n, device=DEVICE, dtype=torch.bfloat16)
    weight = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)

    def torch_rms():
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * weight

    xf = x.float()
    expected = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()
    assert_close(triton_kernels.rms_norm(x, weight, 1e-6), expected, torch.bfloat16)
    report(f"RMSNorm 4096x{n} bf16", lambda: triton_kernels.rms_norm(x, weight, 1e-6), torch_rms,
           2 * x.numel() * x.element_size())


@pytest.mark.parametrize("shape", [(64 * 12 * 384, 384), (4096, 50257)], ids=["attention_scores", "vocab"])
def test_softmax(shape):
    x = (torch.randn(shape, device=DEVICE) * 3).half()
    assert_close(triton_kernels.softmax(x), torch.softmax(x.float(), -1), torch.float16)
    report(f"Softmax {shape[0]}x{shape[1]} fp16", lambda: triton_kernels.softmax(x), lambda: torch.softmax(x, -1),
           2 * x.numel() * x.element_size())


def test_bert_gelu_chain():
    """The exported BERT GELU after the intermediate dense layer: batch 64 x seq 384 x 3072, fp16."""
    x = torch.randn(64, 384, 3072, device=DEVICE, dtype=torch.float16)
    bias = torch.randn(3072, device=DEVICE, dtype=torch.float16)
    constants = [torch.tensor(v, device=DEVICE, dtype=torch.float16) for v in (math.sqrt(2.0), 1.0, 0.5)]
    code = ["Add i0 i1", "Div t0 i2", "Erf t1", "Add t2 i3", "Mul t0 t3", "Mul t4 i4"]
    kernel = triton_kernels.compile_elementwise(code, 5)
    inputs = [x, bias, *constants]
    expected = F.gelu(x.float() + bias.float())
    assert_close(kernel(*inputs), expected, torch.float16, scale=2.0)

    def torch_chain():  # what eager torch runs for the exported graph: one kernel per op
        y = x + bias
        return (y * (torch.erf(y / constants[0]) + constants[1])) * constants[2]

    report("BERT GELU chain 64x384x3072 fp16 (6 ops)", lambda: kernel(*inputs), torch_chain,
           2 * x.numel() * x.element_size())
    report("  vs torch F.gelu(x + bias)", lambda: kernel(*inputs), lambda: F.gelu(x + bias))


def test_broadcast_chain_channels_last():
    """A conv-style chain: x * scale[C] + shift[C], clipped (ReLU6), NHWC fp16."""
    x = torch.randn(256, 64, 56, 56, device=DEVICE, dtype=torch.float16).to(memory_format=torch.channels_last)
    scale, shift = torch.randn(64, 1, 1, device=DEVICE).half(), torch.randn(64, 1, 1, device=DEVICE).half()
    low, high = torch.tensor(0.0, device=DEVICE).half(), torch.tensor(6.0, device=DEVICE).half()
    code = ["Mul i0 i1", "Add t0 i2", "Max t1 i3", "Min t2 i4"]
    kernel = triton_kernels.compile_elementwise(code, 5)
    out = kernel(x, scale, shift, low, high)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_close(out, (x.float() * scale.float() + shift.float()).clamp(0, 6), torch.float16)
    report("scale-shift-ReLU6 256x64x56x56 NHWC fp16", lambda: kernel(x, scale, shift, low, high),
           lambda: torch.minimum(torch.maximum(x * scale + shift, low), high), 2 * x.numel() * x.element_size())


@pytest.mark.parametrize("activation", ["Gelu", "Relu"])
def test_bias_activation_after_cublas(activation):
    """BERT FFN up-projection epilogue: y = x @ Wᵀ by cuBLAS, then act(y + b) + residual in one pass."""
    y = torch.randn(64 * 384, 3072, device=DEVICE, dtype=torch.float16)
    bias, residual = torch.randn(3072, device=DEVICE).half(), torch.randn(64 * 384, 3072, device=DEVICE).half()
    act = {"Gelu": F.gelu, "Relu": torch.relu}[activation]
    expected = act(y.float() + bias.float()) + residual.float()
    out = triton_kernels.bias_activation(y, bias, residual, activation=activation, residual_after_activation=True)
    assert_close(out, expected, torch.float16, scale=2.0)
    report(f"bias+{activation}+residual 24576x3072 fp16",
           lambda: triton_kernels.bias_activation(y, bias, residual, activation=activation),
           lambda: act(y + bias) + residual, 3 * y.numel() * y.element_size())


def test_conv_epilogue_channels_last():
    y = torch.randn(256, 256, 14, 14, device=DEVICE, dtype=torch.float16).to(memory_format=torch.channels_last)
    bias, residual = torch.randn(256, device=DEVICE).half(), torch.randn_like(y)
    expected = torch.relu(y.float() + bias.float()[:, None, None] + residual.float())
    run = lambda: triton_kernels.bias_activation(y, bias, residual, activation="Relu",  # noqa: E731
                                                 residual_after_activation=False, axis=1)
    assert run().is_contiguous(memory_format=torch.channels_last)
    assert_close(run(), expected, torch.float16, scale=2.0)
    report("conv bias+residual+ReLU 256x256x14x14 NHWC", run, lambda: torch.relu(y + bias[:, None, None] + residual),
           3 * y.numel() * y.element_size())


@pytest.mark.parametrize("m, n, k", [(4096, 4096, 4096), (64 * 128, 3072, 768), (8, 3072, 768)],
                         ids=["square", "bert_ffn", "batch8"])
def test_fused_gemm(m, n, k):
    x = torch.randn(m, k, device=DEVICE, dtype=torch.float16)
    w = (torch.randn(n, k, device=DEVICE) / math.sqrt(k)).half()
    bias, residual = torch.randn(n, device=DEVICE).half(), torch.randn(m, n, device=DEVICE).half()
    expected = F.gelu(F.linear(x.float(), w.float(), bias.float())) + residual.float()
    timings = {}
    for config in triton_kernels.GEMM_CONFIGS:
        out = triton_kernels.gemm(x, w, bias, residual, activation="Gelu", config=config)
        # fp32 accumulation in another order than cuBLAS's over K ≤ 4096 terms, then fp16 rounding
        assert_close(out, expected, torch.float16, scale=4.0)
        timings[config] = median_ms(lambda c=config: triton_kernels.gemm(x, w, bias, residual, activation="Gelu",
                                                                         config=c), iters=20)
    best = min(timings, key=timings.get)
    report(f"GEMM+bias+GELU+residual {m}x{n}x{k} fp16 (best of {len(timings)} configs)",
           lambda: triton_kernels.gemm(x, w, bias, residual, activation="Gelu", config=best),
           lambda: F.gelu(F.linear(x, w, bias)) + residual)
    print(f"[triton]   best config {best}; flops {2 * m * n * k / timings[best] / 1e9:.1f} TFLOP/s")
