"""The decode GEMV's fusions (kiln/llm/kernels/gemv.py: norm, residual, swiglu, rope) against torch in fp64 on
the dequantized weights, under TRITON_INTERPRET=1 at small shapes: RMSNorm folded into the product, the residual
add in the epilogue, SwiGLU over matching gate and up columns, RoPE and the KV cache write after q|k|v; every
variant, bf16 and FP8 weights, ragged shapes; the same bits run to run, and row 0 the same bits at M = 1 and 8
(batch invariance)."""

import os
import zlib

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kiln.llm.kernels.fused import add_rms_norm, rope_kv_write  # noqa: E402
from kiln.llm.kernels.gemv import GemvConfig, RopeKV, gemv  # noqa: E402
from tests.llm.test_gemv_kernel import DEVICE, weight  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.kernels.conftest import _fix_interpreter_bf16_dot, _fix_interpreter_scalar_index

    _fix_interpreter_bf16_dot()
    _fix_interpreter_scalar_index()

EPS = 1e-5
WHOLE_K = [GemvConfig("dot", 16, 32, 1, 4, 1), GemvConfig("dot_swap", 32, 64, 1, 4, 1),
           GemvConfig("fma", 8, 64, 1, 4, 1), GemvConfig("fma_rows", 4, 32, 1, 4, 1, rows=4),
           # the knobs (kernels/gemv.py GemvConfig: prefetch, w_cache, pdl) under every fusion
           GemvConfig("fma", 8, 64, 1, 4, 1, prefetch=True, w_cache="evict_first", pdl=True),
           GemvConfig("fma_rows", 4, 32, 1, 4, 1, rows=2, prefetch=True, pdl=True)]
SPLIT = [GemvConfig("dot_swap", 32, 32, 3, 4, 1, "last"), GemvConfig("fma", 8, 32, 2, 4, 1, "kernel"),
         GemvConfig("fma", 8, 32, 3, 4, 1, "last", prefetch=True, pdl=True)]


def rms_norm(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The unfused reference in fp64: x / sqrt(mean(x²) + eps) · g."""
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * g.double()


def check(got: torch.Tensor, ref: torch.Tensor, roundings: int = 2, magnitude: torch.Tensor | None = None) -> None:
    """bf16 results: `roundings` bf16 steps of 2^-7 relative each (the interpreter's cast truncates; a GPU
    rounds to half that): the output's, and x·g's before the MMA in the dot variants; SwiGLU rounds gate, up,
    silu and the product (4). `magnitude` (elementwise) is the size of what was rounded where that exceeds the
    result's own: a sum that cancels keeps the error of its rounded terms."""
    if magnitude is None:
        torch.testing.assert_close(got.double().cpu(), ref, atol=2e-2, rtol=roundings * 2**-7)
        return
    error = (got.double().cpu() - ref).abs()
    bound = 2e-2 + roundings * 2**-7 * torch.maximum(magnitude.abs(), ref.abs())
    worst = (error - bound).argmax()
    assert bool((error <= bound).all()), (f"{int((error > bound).sum())} of {error.numel()} beyond the bound; "
                                          f"worst {error.flatten()[worst]:.4g} > {bound.flatten()[worst]:.4g}")


@pytest.mark.parametrize("config", WHOLE_K, ids=lambda c: c.name.replace(" ", "-"))
@pytest.mark.parametrize("kind", ("bf16", "fp8"))
@pytest.mark.parametrize("m,n,k", [(1, 48, 128), (5, 37, 200)])
def test_norm_folded_into_the_product(config, kind, m, n, k):
    g = torch.Generator().manual_seed(zlib.crc32(repr(("norm", config.name, kind, m, n, k)).encode()))
    q, scale, ref_w = weight(n, k, kind, torch.bfloat16, g)
    x = (torch.randn((m, k), generator=g) * 3).to(torch.bfloat16)
    norm = (1 + 0.5 * torch.randn(k, generator=g)).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16) if m == 5 else None
    got = gemv(x.to(DEVICE), q, scale, None if bias is None else bias.to(DEVICE), config, norm=norm.to(DEVICE),
               eps=EPS)
    ref = rms_norm(x, norm) @ ref_w.T + (0 if bias is None else bias.double())
    assert got.shape == (m, n)
    check(got, ref)


@pytest.mark.parametrize("config", WHOLE_K + SPLIT, ids=lambda c: c.name.replace(" ", "-"))
@pytest.mark.parametrize("kind", ("bf16", "fp8"))
def test_residual_added_in_the_epilogue(config, kind):
    g = torch.Generator().manual_seed(zlib.crc32(repr(("residual", config.name, kind)).encode()))
    m, n, k = 3, 40, 136
    q, scale, ref_w = weight(n, k, kind, torch.bfloat16, g)
    x = torch.randn((m, k), generator=g).to(torch.bfloat16)
    residual = (torch.randn((m, n), generator=g) * 4).to(torch.bfloat16)
    got = gemv(x.to(DEVICE), q, scale, None, config, residual=residual.to(DEVICE))
    plain = gemv(x.to(DEVICE), q, scale, None, config)
    product = x.double() @ ref_w.T
    # two roundings: the product's to bf16 (|x·w| may exceed the cancelling sum's) and the sum's
    check(got, residual.double() + product, magnitude=product)
    # the unfused pair's bits exactly: the product rounded to bf16, then fused.add_rms_norm's sum (a Triton cast
    # both: the interpreter's bf16 cast truncates, torch's rounds)
    total, _ = add_rms_norm(residual.to(DEVICE), plain, torch.ones(n, dtype=torch.bfloat16, device=DEVICE), EPS)
    assert torch.equal(got, total)


@pytest.mark.parametrize("config", WHOLE_K, ids=lambda c: c.name.replace(" ", "-"))
@pytest.mark.parametrize("kind", ("bf16", "fp8"))
@pytest.mark.parametrize("with_norm", (False, True))
def test_swiglu_over_matching_gate_and_up_columns(config, kind, with_norm):
    g = torch.Generator().manual_seed(zlib.crc32(repr(("swiglu", config.name, kind, with_norm)).encode()))
    m, inner, k = 4, 40, 96
    q, scale, ref_w = weight(2 * inner, k, kind, torch.bfloat16, g)
    x = torch.randn((m, k), generator=g).to(torch.bfloat16)
    norm = (1 + 0.5 * torch.randn(k, generator=g)).to(torch.bfloat16)
    got = gemv(x.to(DEVICE), q, scale, None, config, swiglu=True, norm=norm.to(DEVICE) if with_norm else None,
               eps=EPS)
    h = rms_norm(x, norm) if with_norm else x.double()
    gate, up = (h @ ref_w.T).split(inner, dim=-1)
    assert got.shape == (m, inner)
    check(got, F.silu(gate) * up, roundings=4 + with_norm)


def test_fp32_activations_fused():
    """fp32 x (the CPU engine's dtype): exact fp32 products, so the fused results meet fp32 tolerances."""
    g = torch.Generator().manual_seed(3)
    m, inner, k = 2, 24, 64
    w = torch.randn((2 * inner, k), generator=g) * 0.1
    x, norm = torch.randn((m, k), generator=g), 1 + 0.5 * torch.randn(k, generator=g)
    residual = torch.randn((m, 2 * inner), generator=g)
    for config in WHOLE_K[:2] + WHOLE_K[2:]:
        got = gemv(x.to(DEVICE), w.to(DEVICE), None, None, config, swiglu=True, norm=norm.to(DEVICE), eps=EPS)
        gate, up = (rms_norm(x, norm) @ w.double().T).split(inner, dim=-1)
        torch.testing.assert_close(got.double().cpu(), F.silu(gate) * up, atol=1e-5, rtol=1e-5)
        got = gemv(x.to(DEVICE), w.to(DEVICE), None, None, config, residual=residual.to(DEVICE))
        torch.testing.assert_close(got.double().cpu(), residual.double() + x.double() @ w.double().T, atol=1e-5,
                                   rtol=1e-5)


@pytest.mark.parametrize("config", WHOLE_K, ids=lambda c: c.name.replace(" ", "-"))
def test_fused_results_are_deterministic_and_batch_invariant(config):
    g = torch.Generator().manual_seed(9)
    q, _, _ = weight(64, 128, "bf16", torch.bfloat16, g)
    x = torch.randn((8, 128), generator=g).to(torch.bfloat16).to(DEVICE)
    norm = (1 + 0.5 * torch.randn(128, generator=g)).to(torch.bfloat16).to(DEVICE)
    first = gemv(x, q, None, None, config, swiglu=True, norm=norm, eps=EPS)
    assert torch.equal(first, gemv(x, q, None, None, config, swiglu=True, norm=norm, eps=EPS))
    assert torch.equal(first[:1], gemv(x[:1], q, None, None, config, swiglu=True, norm=norm, eps=EPS))


def test_fusions_refuse_what_they_cannot_do():
    x, w = torch.zeros((1, 64), dtype=torch.bfloat16), torch.zeros((32, 64), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="split_k 1"):
        gemv(x, w, config=SPLIT[0], norm=torch.ones(64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="swiglu"):
        gemv(x, w, config=WHOLE_K[0], swiglu=True, residual=torch.zeros((1, 16), dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="residual"):
        gemv(x, w, config=WHOLE_K[0], residual=torch.zeros((1, 16), dtype=torch.bfloat16))


@pytest.mark.parametrize("config", WHOLE_K, ids=lambda c: c.name.replace(" ", "-"))
@pytest.mark.parametrize("cache,kv_heads", (("bf16", 1), ("fp8", 2)))
def test_rope_and_cache_write_in_the_epilogue(config, cache, kv_heads):
    """The same bits as the unfused pair at the same config: the GEMV's qkv, then fused.rope_kv_write."""
    g = torch.Generator().manual_seed(zlib.crc32(repr(("rope", config.name, cache)).encode()))
    heads, dim, m, k = 4, 16, 3, 64
    q_w, _, _ = weight((heads + 2 * kv_heads) * dim, k, "bf16", torch.bfloat16, g)
    x = torch.randn((m, k), generator=g).to(torch.bfloat16).to(DEVICE)
    norm = (1 + 0.5 * torch.randn(k, generator=g)).to(torch.bfloat16).to(DEVICE)
    bias = torch.randn((heads + 2 * kv_heads) * dim, generator=g).to(torch.bfloat16).to(DEVICE)
    freqs = torch.arange(32.0)[:, None] * (1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))[None, :]
    cos, sin = freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)
    positions = torch.tensor([3, 17, 30]).to(DEVICE)
    slots = torch.tensor([5, 0, 9]).to(DEVICE)
    dtype = torch.float8_e4m3fn if cache == "fp8" else torch.bfloat16

    def caches():
        return (torch.zeros((2, 8, kv_heads, dim), device=DEVICE).to(dtype),
                torch.zeros((2, 8, kv_heads, dim), device=DEVICE).to(dtype))

    k_fused, v_fused = caches()
    q = gemv(x, q_w, None, bias, config, norm=norm, eps=EPS,
             rope=RopeKV(positions, slots, cos, sin, k_fused, v_fused, heads, kv_heads, dim))
    k_pair, v_pair = caches()
    qkv = gemv(x, q_w, None, bias, config, norm=norm, eps=EPS)
    q_pair = rope_kv_write(qkv, positions, slots, cos, sin, k_pair, v_pair, heads, kv_heads, dim)
    assert q.shape == (m, heads * dim)
    assert torch.equal(q.view(m, heads, dim), q_pair)
    assert torch.equal(k_fused.view(torch.uint8), k_pair.view(torch.uint8))
    assert torch.equal(v_fused.view(torch.uint8), v_pair.view(torch.uint8))
    assert k_fused.float().abs().sum() > 0 and v_fused.float().abs().sum() > 0  # the slots were written
    # and against torch: rotate-half RoPE of the fp64 reference projection
    ref = (rms_norm(x.cpu(), norm.cpu()) @ q_w.double().cpu().T + bias.double().cpu()).view(m, -1, dim)
    c, s_ = cos.cpu().double()[positions.cpu()][:, None, :], sin.cpu().double()[positions.cpu()][:, None, :]
    x1, x2 = ref[..., :dim // 2], ref[..., dim // 2:]
    rotated = torch.cat((x1 * c - x2 * s_, x2 * c + x1 * s_), dim=-1)
    check(q.view(m, heads, dim), rotated[:, :heads], roundings=4)
