"""The Triton flash-attention kernel and its tactics against a float64 torch reference (interpreter, small shapes).

The reference is written out (q·kᵀ·scale + mask, softmax, ·v in float64), not SDPA, so the kernel
is judged against the maths; the tactics are also judged the way the autotuner judges them, against
kiln's registered op (kiln/ops/fused.py) through `mismatch`.

Tolerances: the kernel accumulates in fp32 but, like every flash kernel, rounds the softmax
probabilities p to the input dtype before the p·v product (tensor cores take fp16/bf16). Each p
then carries a relative error of up to half an ulp (fp16 2⁻¹¹, bf16 2⁻⁸), and the output (a
convex combination of v rows, |v| ~ 1..4 here) one more rounding: about 2 ulps of the output scale.
"""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("triton")

from kiln.kernels.cuda.triton.attention import AttentionConfig, flash_attention  # noqa: E402
from kiln.plan.spec import StepSpec  # noqa: E402
from kiln.tactics import registry  # noqa: E402
from kiln.builder.accuracy import mismatch  # noqa: E402
from kiln.tactics.tactic import InputMeta  # noqa: E402
from tests.unit import tactic_check  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes

TOLERANCE = {torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}  # (rtol, atol): see the docstring
HALF = list(TOLERANCE)
SMALL = AttentionConfig(32, 16)  # small tiles: several query and key blocks even at interpreter sizes
CPU = torch.device("cpu")


def reference(q, k, v, mask=None, *, scale, is_causal=False):
    """softmax(q·kᵀ·scale + mask)·v in float64; GQA by repeating k/v heads; fully masked rows give 0 (as SDPA)."""
    storage = q.dtype  # the op rounds an additive mask to it first
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = q @ k.transpose(-1, -2) * scale  # s: [B, H, S, T]
    if mask is not None and mask.dtype == torch.bool:
        s = s.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        s = s + mask.to(storage).double()
    if is_causal:
        s_len, t_len = s.shape[-2:]
        s = s.masked_fill(~torch.ones(s_len, t_len, dtype=torch.bool).tril(), float("-inf"))  # top-left aligned
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v  # a row of all -inf: softmax NaN -> 0


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCE[dtype]
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol)


def randn(*shape, dtype=torch.float16, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype)


# ---- the kernel ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("config", [SMALL, AttentionConfig(16, 32)], ids=lambda c: c.name)
def test_plain_layout_with_query_and_key_tails(dtype, config):
    torch.manual_seed(0)
    q, k, v = randn(2, 3, 37, 32, dtype=dtype), randn(2, 3, 45, 32, dtype=dtype), randn(2, 3, 45, 32, dtype=dtype)
    out = flash_attention(q, k, v, scale=32 ** -0.5, config=config)
    assert out.shape == (2, 3, 37, 32)
    assert_close(out, reference(q, k, v, scale=32 ** -0.5), dtype)


@pytest.mark.parametrize("head_dim, head_dim_v", [(80, 80), (24, 40), (96, 64)])
def test_head_dims_that_are_not_powers_of_two(head_dim, head_dim_v):
    """BLOCK_D is the next power of two; the padded columns are loaded as 0 and never stored."""
    torch.manual_seed(1)
    q, k, v = randn(1, 2, 20, head_dim), randn(1, 2, 33, head_dim), randn(1, 2, 33, head_dim_v)
    out = flash_attention(q, k, v, scale=0.3, config=SMALL)
    assert out.shape == (1, 2, 20, head_dim_v)
    assert_close(out, reference(q, k, v, scale=0.3), torch.float16)


@pytest.mark.parametrize("s_len, t_len", [(40, 40), (19, 50), (50, 19)])
def test_causal_is_top_left_aligned(s_len, t_len):
    """S < T and S > T: query i sees keys 0..i (the op's SDPA convention, not flash-attn's bottom-right)."""
    torch.manual_seed(2)
    q, k, v = randn(2, 2, s_len, 32), randn(2, 2, t_len, 32), randn(2, 2, t_len, 32)
    out = flash_attention(q, k, v, scale=0.2, is_causal=True, config=SMALL)
    assert_close(out, reference(q, k, v, scale=0.2, is_causal=True), torch.float16)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_grouped_query_attention_by_head_index(dtype):
    """8 query heads over 2 key/value heads, causal: query head h reads key/value head h // 4."""
    torch.manual_seed(3)
    q, k, v = randn(2, 8, 24, 32, dtype=dtype), randn(2, 2, 24, 32, dtype=dtype), randn(2, 2, 24, 32, dtype=dtype)
    out = flash_attention(q, k, v, scale=0.25, is_causal=True, config=SMALL)
    assert_close(out, reference(q, k, v, scale=0.25, is_causal=True), dtype)


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.float16])
def test_additive_padding_mask_broadcast_over_heads_and_queries(mask_dtype):
    """A [B, 1, 1, T] mask (BERT's padding): read as one key vector per block (stride 0 on H and S).
    -1e9 in fp32 becomes -inf once the op rounds the mask to fp16; a finite -10000 stays finite."""
    torch.manual_seed(4)
    q, k, v = randn(3, 2, 29, 32), randn(3, 2, 29, 32), randn(3, 2, 29, 32)
    mask = torch.where(torch.rand(3, 1, 1, 29) < 0.3, -10000.0, 0.0)
    mask[0, 0, 0, :20] = -1e9  # batch 0: most keys hidden
    mask[2, 0, 0, :] = -1e9  # batch 2: every key; -inf in fp16, so 0 out, where fp32 -1e9 would average v
    mask[1] += torch.randn(1, 1, 29)  # a non-binary bias as well
    mask = mask.to(mask_dtype)
    out = flash_attention(q, k, v, mask, scale=0.3, config=SMALL)
    assert_close(out, reference(q, k, v, mask, scale=0.3), torch.float16)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_per_query_masks_bool_and_float(dtype):
    """[1, 1, S, T] float and [B, H, S, T] bool masks, including rows with every key hidden (output 0)."""
    torch.manual_seed(5)
    q, k, v = randn(2, 2, 21, 32, dtype=dtype), randn(2, 2, 35, 32, dtype=dtype), randn(2, 2, 35, 32, dtype=dtype)
    additive = torch.randn(1, 1, 21, 35).to(dtype) * 2
    assert_close(flash_attention(q, k, v, additive, scale=0.3, config=SMALL),
                 reference(q, k, v, additive, scale=0.3), dtype)
    allowed = torch.rand(2, 2, 21, 35) < 0.6
    allowed[0, 1, 3] = False  # every key hidden for one row
    allowed[1, 0, 20] = False  # and for the last (tail) row of another
    out = flash_attention(q, k, v, allowed, scale=0.3, config=SMALL)
    assert_close(out, reference(q, k, v, allowed, scale=0.3), dtype)
    assert torch.equal(out[0, 1, 3], torch.zeros(32, dtype=dtype))


def test_two_dimensional_mask_and_minus_inf_rows():
    torch.manual_seed(6)
    q, k, v = randn(2, 2, 17, 32), randn(2, 2, 17, 32), randn(2, 2, 17, 32)
    mask = torch.zeros(17, 17)
    mask[4] = float("-inf")  # one query sees nothing
    mask[:, 16] = float("-inf")  # nobody sees the last key
    out = flash_attention(q, k, v, mask, scale=0.3, config=SMALL)
    assert_close(out, reference(q, k, v, mask, scale=0.3), torch.float16)
    assert not out.isnan().any()


def test_strided_views_need_no_copies_and_output_goes_into_a_given_view():
    """q/k/v as column slices of a [B, S, 3·H·D] buffer permuted to [B, H, S, D]; the output written
    through a permuted view of a [B, S, H, D] buffer (what the tactic does for out_perm)."""
    torch.manual_seed(7)
    b, s, h, d = 2, 27, 3, 32
    qkv = randn(b, s, 3 * h * d)
    q, k, v = (t.unflatten(-1, (h, d)).permute(0, 2, 1, 3) for t in qkv.split(h * d, dim=-1))
    assert q.stride() == (s * 3 * h * d, d, 3 * h * d, 1)  # a view into qkv, not a copy
    buffer = torch.empty(b, s, h, d, dtype=torch.float16)
    out = flash_attention(q, k, v, scale=0.2, out=buffer.permute(0, 2, 1, 3), config=SMALL)
    assert out.data_ptr() == buffer.data_ptr()
    assert_close(buffer.permute(0, 2, 1, 3), reference(q, k, v, scale=0.2), torch.float16)


def test_batch_broadcast_key_value_and_default_scale():
    torch.manual_seed(8)
    q, k, v = randn(3, 2, 18, 32), randn(1, 2, 22, 32), randn(1, 2, 22, 32)
    out = flash_attention(q, k, v, config=SMALL)  # scale None: 1/sqrt(D), as SDPA
    assert_close(out, reference(q, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1), scale=32 ** -0.5),
                 torch.float16)


def test_nan_to_zero_maps_nan_rows_to_zero():
    torch.manual_seed(9)
    q, k, v = randn(1, 2, 16, 32), randn(1, 2, 16, 32), randn(1, 2, 16, 32)
    q[0, 1, 5, 3] = float("nan")  # that query's row of the output is NaN ...
    plain = flash_attention(q, k, v, scale=0.3, config=SMALL)
    assert plain[0, 1, 5].isnan().all() and not plain[0, 0].isnan().any()
    cleaned = flash_attention(q, k, v, scale=0.3, nan_to_zero=True, config=SMALL)  # ... and 0 with nan_to_zero
    expected = reference(q, k, v, scale=0.3).nan_to_num(0.0)
    assert_close(cleaned, expected, torch.float16)


def lengths_mask(lengths: torch.Tensor, keys: int) -> torch.Tensor:
    """The bool [B, 1, 1, T] mask a row of length n >= 0 stands for: its first n keys."""
    return (torch.arange(keys) < lengths.reshape(-1, 1, 1, 1))


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("config", [SMALL, AttentionConfig(16, 32)], ids=lambda c: c.name)
def test_key_lengths_visit_each_rows_first_keys_and_read_no_mask(dtype, config):
    """Lengths 0 (every key hidden: 0 out), 1, a block edge, a tail, T and past T; and -1, where the mask applies.
    The mask of a row with a length is garbage on purpose (NaN): a kernel that read it would show it."""
    torch.manual_seed(14)
    b, t = 7, 45
    q, k, v = randn(b, 2, 37, 32, dtype=dtype), randn(b, 2, t, 32, dtype=dtype), randn(b, 2, t, 32, dtype=dtype)
    lengths = torch.tensor([0, 1, 16, 33, t, -1, t + 5], dtype=torch.int32)
    mask = torch.full((b, 1, 1, t), float("nan"))
    mask[5] = torch.where(torch.rand(1, 1, t) < 0.5, -10000.0, 0.0)  # a row with holes: its mask says which keys
    out = flash_attention(q, k, v, mask, lengths, scale=0.3, config=config)
    expected = reference(q, k, v, torch.where(lengths_mask(lengths.clamp(max=t), t), 0.0, float("-inf")), scale=0.3)
    expected[5] = reference(q[5:6], k[5:6], v[5:6], mask[5:6], scale=0.3)[0]
    assert_close(out, expected, dtype)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.parametrize("mask", ["none", "bool"])
def test_key_lengths_without_a_mask_or_with_a_bool_one(mask):
    torch.manual_seed(15)
    q, k, v = randn(3, 2, 20, 32), randn(3, 2, 50, 32), randn(3, 2, 50, 32)
    lengths = torch.tensor([50, -1, 7], dtype=torch.int32)
    allowed = torch.rand(3, 1, 20, 50) < 0.6 if mask == "bool" else None
    out = flash_attention(q, k, v, allowed, lengths, scale=0.3, config=SMALL)
    given = torch.ones(3, 1, 20, 50, dtype=torch.bool) if allowed is None else allowed
    expected = torch.where(lengths.reshape(-1, 1, 1, 1) >= 0, lengths_mask(lengths, 50), given)
    assert_close(out, reference(q, k, v, expected, scale=0.3), torch.float16)


def test_refusals():
    q = randn(1, 2, 8, 32)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        flash_attention(q.float(), q.float(), q.float())
    with pytest.raises(ValueError, match="multiple"):
        flash_attention(randn(1, 3, 8, 32), q, q)
    with pytest.raises(ValueError, match="exceed 128"):
        flash_attention(randn(1, 2, 8, 256), randn(1, 2, 8, 256), randn(1, 2, 8, 256))
    with pytest.raises(ValueError, match="not positive"):
        flash_attention(q, q, q, scale=-0.1)
    with pytest.raises(TypeError, match="bool or float"):
        flash_attention(q, q, q, torch.zeros(8, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"int32 \[1\]"):
        flash_attention(q, q, q, None, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="is_causal"):
        flash_attention(q, q, q, None, torch.zeros(1, dtype=torch.int32), is_causal=True)


# ---- the tactics, as the autotuner checks them ------------------------------------------------------

def make_step(n_inputs: int, **attributes) -> StepSpec:
    return tactic_check.make_step("Attention", "kiln", n_inputs, **attributes)


def metas(args: list) -> list[InputMeta]:
    return tactic_check.metas(args)


run_against_the_op = tactic_check.run_against_reference  # check, prepare, launch, compare with kiln's op


TACTIC = "cuda.attention.triton.64x32.w4s2"
HEADS_LAST = [0, 2, 1, 3]


def test_tactics_are_registered_with_levels():
    names = [t.name for t in registry.candidates("Attention", "kiln", "cuda", opt_level=2)]
    triton_level2 = [n for n in names if n.startswith("cuda.attention.triton.")]
    assert triton_level2 == ["cuda.attention.triton.128x64.w4s3", "cuda.attention.triton.128x128.w8s3",
                             "cuda.attention.triton.64x64.w4s3"]
    every = [n for n in (t.name for t in registry.candidates("Attention", "kiln", "cuda", opt_level=5))
             if n.startswith("cuda.attention.triton.")]
    assert TACTIC in every and len(every) == 7


def test_tactic_on_a_packed_qkv_gemm_output_with_merged_output_heads():
    """BERT after the layout fusion: Attention(qkv, None, None, mask) with qkv_split, [B, S, H·D] out."""
    torch.manual_seed(10)
    b, s, h, d = 2, 40, 2, 32
    step = make_step(4, scale=d ** -0.5, qkv_split=[h * d] * 3, q_num_heads=h, kv_num_heads=h, q_perm=HEADS_LAST,
                     k_perm=HEADS_LAST, v_perm=HEADS_LAST, out_perm=HEADS_LAST, out_merge_heads=1)
    mask = torch.where(torch.rand(b, 1, 1, s) < 0.25, -10000.0, 0.0).half()
    out = run_against_the_op(TACTIC, step, [randn(b, s, 3 * h * d), None, None, mask])
    assert out.shape == (b, s, h * d) and out.is_contiguous()


def test_tactic_with_key_lengths_from_the_padding_mask():
    """The padding-free plain program's BERT attention on CUDA: qkv_split, a [B, 1, 1, S] key mask and the mask's
    lengths (kiln::KeyLengths) for right padding, a full row, holes (-1: the mask applies) and an empty row."""
    from kiln.ops.tokens import key_lengths

    torch.manual_seed(16)
    b, s, h, d = 4, 40, 2, 32
    step = make_step(5, scale=d ** -0.5, qkv_split=[h * d] * 3, q_num_heads=h, kv_num_heads=h, q_perm=HEADS_LAST,
                     k_perm=HEADS_LAST, v_perm=HEADS_LAST, out_perm=HEADS_LAST, out_merge_heads=1)
    padding = torch.ones(b, s, dtype=torch.int64)
    padding[0, 23:] = 0
    padding[2] = torch.rand(s) < 0.6
    padding[3] = 0
    lengths = key_lengths(None, padding)
    assert lengths.tolist() == [23, s, -1, 0]
    mask = torch.where(padding == 0, torch.finfo(torch.float32).min, 0.0).half()[:, None, None, :]  # -inf in fp16
    run_against_the_op(TACTIC, step, [randn(b, s, 3 * h * d), None, None, mask, lengths])


def test_tactic_gpt2_causal_heads_last_bf16():
    torch.manual_seed(11)
    step = make_step(3, scale=0.125, is_causal=1, q_num_heads=2, kv_num_heads=2, q_perm=HEADS_LAST,
                     k_perm=HEADS_LAST, v_perm=HEADS_LAST, out_perm=HEADS_LAST, out_merge_heads=1)
    run_against_the_op(TACTIC, step, [randn(2, 33, 64, dtype=torch.bfloat16) for _ in range(3)])


def test_tactic_gqa_bool_mask_and_nan_to_zero():
    torch.manual_seed(12)
    step = make_step(4, scale=0.2, gqa=1, nan_to_zero=1)
    allowed = torch.rand(1, 1, 20, 20) < 0.7
    allowed[..., 2, :] = False
    run_against_the_op(TACTIC, step, [randn(2, 4, 20, 32), randn(2, 2, 20, 32), randn(2, 2, 20, 32), allowed])


def test_tactic_refusals_say_why():
    q = randn(1, 2, 16, 32)

    def reason(step, args, name=TACTIC):
        result = registry.get(name).check(step, metas(args))
        assert isinstance(result, str), f"{name} accepted the layer"
        return result

    assert "float16, bfloat16" in reason(make_step(3, scale=0.1), [q.float()] * 3)
    assert "head dims 256" in reason(make_step(3, scale=0.1), [randn(1, 2, 16, 256)] * 3)
    assert "bool or an additive float" in reason(make_step(4, scale=0.1), [q, q, q, torch.zeros(16, 16).long()])
    assert "does not broadcast" in reason(make_step(4, scale=0.1), [q, q, q, torch.zeros(3, 16, 16)])
    assert "without gqa" in reason(make_step(3, scale=0.1), [randn(1, 4, 16, 32), q, q])
    assert "mostly padding" in reason(make_step(3, scale=0.1), [q] * 3, name="cuda.attention.triton.128x64.w4s3")
    assert "not a tensor" in reason(make_step(3, scale=0.1), [q, None, q])
    assert "positive" in reason(make_step(3, scale=-0.1), [q] * 3)
    wide = randn(1, 2, 256, 128)  # a [B, H, S, T] mask tile per stage on top of 128-wide k/v tiles
    assert "shared memory" in reason(make_step(4, scale=0.1), [wide, wide, wide, torch.zeros(1, 2, 256, 256)],
                                     name="cuda.attention.triton.128x128.w8s3")
    lengths = torch.zeros(1, dtype=torch.int32)
    assert "int32 [1]" in reason(make_step(5, scale=0.1), [q, q, q, None, lengths.long()])
    assert "is_causal" in reason(make_step(5, scale=0.1, is_causal=1), [q, q, q, None, lengths])
    assert registry.get("cuda.attention.triton.128x128.w8s3").check(make_step(3, scale=0.1), metas([wide] * 3))


# ---- the tactics inside an engine ------------------------------------------------------------------

class _SelfAttention(torch.nn.Module):
    """One BERT-style attention: a QKV GEMM, heads split by view/transpose, SDPA with a padding mask, out GEMM."""

    def __init__(self, embed: int = 64, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(embed, 3 * embed)
        self.out = torch.nn.Linear(embed, embed)

    def forward(self, x, mask):
        b, s, e = x.shape
        q, k, v = (t.view(b, s, self.heads, e // self.heads).transpose(1, 2) for t in self.qkv(x).split(e, dim=-1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # y: [B, H, S, D]
        return self.out(y.transpose(1, 2).reshape(b, s, e))


def test_engine_autotunes_the_tactic_on_a_packed_qkv_layer(tmp_path, monkeypatch):
    """Build (fp16) with the Triton attention tactics standing in for CPU ones: the optimizer hands the op
    qkv_split + heads-last layouts, the autotuner checks the tactic against the op before timing it; then
    the engine forced onto the tactic against onnxruntime fp32."""
    import numpy as np
    import onnxruntime as ort

    import kiln

    tactic_check.cuda_tactics_on_cpu(monkeypatch, lambda name: name.startswith("cuda.attention.triton."))
    torch.manual_seed(13)
    path = tmp_path / "attention.onnx"
    example = (torch.randn(2, 40, 64), torch.zeros(2, 1, 1, 40))
    torch.onnx.export(_SelfAttention().eval(), example, str(path), dynamo=True, input_names=["x", "mask"],
                      output_names=["y"])
    engine = kiln.build(str(path), device="cpu", precision="fp16", tactics=["cuda.attention.triton"], tuning_runs=3)
    attention = next(s for s in engine.plan.program.steps if s.op_type == "Attention")
    assert attention.attributes.get("qkv_split") and attention.attributes.get("out_merge_heads")
    notes = engine.plan.header["tactics"]["layers"][attention.name]["candidates"]
    assert isinstance(notes[TACTIC_64], float), notes  # passed the check against the op, then timed
    assert "mostly padding" in notes["cuda.attention.triton.128x64.w4s3"]

    attention.tactic = TACTIC_64  # on CPU the interpreter never wins the timing: force it
    forced = kiln.Engine(engine.plan)
    x = np.random.default_rng(1).standard_normal((2, 40, 64)).astype(np.float32)
    mask = np.where(np.random.default_rng(2).random((2, 1, 1, 40)) < 0.3, -10000.0, 0.0).astype(np.float32)
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x, "mask": mask})[0]
    # fp16 storage of x, the weights and every activation: a few fp16 ulps of outputs of size ~1
    np.testing.assert_allclose(forced.run({"x": x, "mask": mask})["y"], expected, rtol=1e-2, atol=1e-2)


TACTIC_64 = "cuda.attention.triton.64x64.w4s3"
