"""The fused Triton kernels of kiln/llm/kernels/fused.py against the torch reference code they replace
(RMSNorm, Rotary + write_kv, silu(gate)·up, FP8Weight's per-token scales): under TRITON_INTERPRET=1 on the
CPU, on the GPU with TRITON_INTERPRET=0."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kiln.llm.attention import write_kv  # noqa: E402
from kiln.llm.config import RopeConfig  # noqa: E402
from kiln.llm.kernels.fused import (add_rms_norm, fp8_quantize_rows, rms_norm, rms_norm_fp8, rope_kv_write,  # noqa: E402
                                    silu_mul, silu_mul_fp8)
from kiln.llm.models.layers import RMSNorm, Rotary  # noqa: E402

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu"
# bf16 tolerance: two bf16 steps (the interpreter's bf16 stores may round a step differently from the GPU's)
BF16 = 2e-2


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, BF16)])
@pytest.mark.parametrize("width", [64, 100])
def test_rms_norm_and_add(dtype, tol, width):
    g = torch.Generator().manual_seed(width)
    x = (torch.randn((5, width), generator=g) * 3).to(dtype)
    delta = torch.randn((5, width), generator=g).to(dtype)
    weight = (1 + torch.randn(width, generator=g) * 0.1).to(dtype)
    norm = RMSNorm(width, 1e-5).to(dtype)
    norm.weight.data.copy_(weight)
    got = rms_norm(x.to(DEVICE), weight.to(DEVICE), 1e-5).cpu()
    expected = norm(x)
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    total, normed = add_rms_norm(x.to(DEVICE), delta.to(DEVICE), weight.to(DEVICE), 1e-5)
    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(total.cpu(), x + delta)  # the sum rounded to the storage dtype, as torch's add
    torch.testing.assert_close(total.cpu().float(), (x + delta).float(), atol=tol, rtol=tol)
    torch.testing.assert_close(normed.cpu().float(), norm(x + delta).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, BF16)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (6, 2, 32), (3, 3, 8)])
def test_rope_kv_write(dtype, tol, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(heads * 100 + head_dim)
    tokens, blocks, page = 7, 6, 4
    rotary = Rotary(RopeConfig(theta=10000.0, kind="llama3", factor=8.0, original_max_position=16), head_dim, 64, 64)
    qkv = torch.randn((tokens, (heads + 2 * kv_heads) * head_dim), generator=g).to(dtype)
    positions = torch.randint(0, 64, (tokens,), generator=g)
    slots = torch.randperm(blocks * page, generator=g)[:tokens]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q_ref, k_ref = rotary(positions, q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim))
    k_cache_ref = torch.randn((blocks, page, kv_heads, head_dim), generator=g).to(dtype)
    v_cache_ref = torch.randn((blocks, page, kv_heads, head_dim), generator=g).to(dtype)
    k_cache, v_cache = k_cache_ref.clone().to(DEVICE), v_cache_ref.clone().to(DEVICE)
    write_kv(k_ref, v.reshape(tokens, kv_heads, head_dim), k_cache_ref, v_cache_ref, slots)
    got = rope_kv_write(qkv.to(DEVICE), positions.to(DEVICE), slots.to(DEVICE), rotary.cos.to(DEVICE),
                        rotary.sin.to(DEVICE), k_cache, v_cache, heads, kv_heads, head_dim)
    torch.testing.assert_close(got.cpu().float(), q_ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(k_cache.cpu().float(), k_cache_ref.float(), atol=tol, rtol=tol)
    assert torch.equal(v_cache.cpu(), v_cache_ref)  # v is copied, and no slot but the step's was touched


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, BF16)])
def test_silu_mul(dtype, tol):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn((4, 2 * 1500), generator=g) * 2).to(dtype)  # two column tiles, the last partial
    gate, up = x.split(1500, dim=-1)
    torch.testing.assert_close(silu_mul(x.to(DEVICE)).cpu().float(), (F.silu(gate) * up).float(), atol=tol, rtol=tol)


@pytest.mark.skipif(DEVICE != "cuda", reason="float8 conversions: on the GPU only")
def test_fp8_rows_match_the_reference_quantization():
    x = (torch.randn((3, 5000), device="cuda") * 4).to(torch.bfloat16)
    q, scale = fp8_quantize_rows(x)
    expected_scale = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
    torch.testing.assert_close(scale, expected_scale, atol=0, rtol=1e-6)
    expected = (x.float() / expected_scale).to(torch.float8_e4m3fn)
    mismatch = (q.float() != expected.float()).float().mean().item()
    assert mismatch < 1e-3  # a division rounded once differently may move a value by one E4M3 step
    torch.testing.assert_close(q.float(), expected.float(), atol=0, rtol=0.07)


@pytest.mark.skipif(DEVICE != "cuda", reason="float8 conversions: on the GPU only")
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # the E4M3 store's vector follows the row's dtype
def test_norm_quantized_in_one_pass_equals_the_two_kernels(with_delta, dtype):
    """rms_norm_fp8 against add_rms_norm (or rms_norm) then fp8_quantize_rows: the same bits (the fused kernel
    quantizes the row the norm would have stored, with the same fp32 arithmetic in the same order). A prefill
    step's 65,536 rows: a sum of squares added in another order changes a bf16 row's E4M3 values in only ~0.04-0.07%
    of rows (bench/fp8_norm_sum_order.py), so 37 rows passed with the wrong order."""
    g = torch.Generator(device="cuda").manual_seed(7)
    x = (torch.randn((65536, 4096), device="cuda", generator=g) * 3).to(dtype)
    delta = torch.randn((65536, 4096), device="cuda", generator=g).to(dtype)
    weight = (1 + torch.randn(4096, device="cuda", generator=g) * 0.1).to(dtype)
    total, normed = add_rms_norm(x, delta, weight, 1e-5) if with_delta else (x, rms_norm(x, weight, 1e-5))
    q, scale = fp8_quantize_rows(normed)
    got_total, got_q, got_scale = rms_norm_fp8(x, delta if with_delta else None, weight, 1e-5)
    assert torch.equal(got_total, total)
    assert torch.equal(got_scale, scale)
    assert torch.equal(got_q.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.skipif(DEVICE != "cuda", reason="float8 conversions: on the GPU only")
@pytest.mark.parametrize("rows,width", [(5, 1500), (64, 14336), (3, 20000)])  # whole rows; two passes
def test_silu_quantized_in_one_pass_equals_the_two_kernels(rows, width):
    g = torch.Generator(device="cuda").manual_seed(width)
    x = (torch.randn((rows, 2 * width), device="cuda", generator=g) * 2).to(torch.bfloat16)
    q, scale = fp8_quantize_rows(silu_mul(x))
    got_q, got_scale = silu_mul_fp8(x)
    assert torch.equal(got_scale, scale)
    assert torch.equal(got_q.view(torch.uint8), q.view(torch.uint8))


def _compile_check(module: str) -> str:
    """Run one of the sm_90 compile checks (tests/llm/*_sm90.py) with the real compiler; its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", module], env=env, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    return done.stdout


def test_row_offsets_are_64_bit_in_the_compiled_kernels():
    """The real compiler (no GPU): the fused kernels and the paged decode kernels take the program's row into
    addresses as a 64-bit value (tests/llm/offsets_compile_sm90.py): a 32-bit row * stride wrapped past 2^31 in a
    262k-token prefill step on the H200 (illegal address) and read the wrong rows past 75k tokens."""
    assert _compile_check("tests.llm.offsets_compile_sm90").count("ok  ") == 8


def test_norm_sums_squares_in_one_layout_with_and_without_fp8():
    """The real compiler (no GPU): rms_norm_fp8 reduces a row's squares in the register layout rms_norm reduces
    them in (tests/llm/reduction_layout_sm90.py), so it adds them in the same order: with the E4M3 store's own
    16-wide vectors it did not, and the fused FP8 path of a random Llama-3-8B decoded other tokens (H200)."""
    assert _compile_check("tests.llm.reduction_layout_sm90").count("ok  ") == 18
