"""The CPU's padding-free kernels (kiln/kernels/cpu/tokens.c, attention.c varlen; tactics/cpu/tokens.py): each kernel
against numpy or a per-sequence torch SDPA on fresh random masks, the tactics' refusals, and a padding-free BERT
run as one native segment against onnxruntime on masks of every kind."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln import zoo
from kiln.builder import autotune
from kiln.kernels.cpu import tokens as kernels
from kiln.kernels.cpu import transformer as transformer_kernels
from kiln.ops.registry import OpContext
from kiln.ops.tokens import packed_attention, token_index
from kiln.plan.spec import StepSpec
from kiln.tactics import registry
from kiln.tactics.cpu.tokens import packed_attention_plan
from kiln.tactics.tactic import InputMeta

pytestmark = pytest.mark.skipif(not transformer_kernels.available(),
                                reason=f"kiln's C kernels are not built: {transformer_kernels.reason()}")

CTX = OpContext("tokens", "TokenIndex", "kiln")
# fp32 against onnxruntime / torch: other summation orders over other row counts
RTOL, ATOL = 1e-5, 2e-5
KINDS = ("right", "left", "half", "holes", "full", "one_real", "one_padding")


def random_mask(rng: np.random.Generator, batch: int, seq: int, kind: str) -> np.ndarray:
    """[batch, seq] int64. right/left: lengths in [S/2, S] at the start/end of each row; half: lengths in [1, S];
    holes: random positions; full: no padding; one_real: one real token a row; one_padding: one padding
    position in the whole batch (all but one real). With batch > 2 (not full, one_padding) row 1 is all padding."""
    mask = np.zeros((batch, seq), np.int64)
    for row in range(batch):
        n = int(rng.integers(1 if kind == "half" else max(1, seq // 2), seq + 1))
        if kind in ("right", "half"):
            mask[row, :n] = 1
        elif kind == "left":
            mask[row, seq - n:] = 1
        elif kind == "holes":
            mask[row] = rng.random(seq) < 0.6
        elif kind == "one_real":
            mask[row, rng.integers(seq)] = 1
    if kind in ("full", "one_padding"):
        mask[:] = 1
        if kind == "one_padding":
            mask.reshape(-1)[rng.integers(mask.size)] = 0
    elif batch > 2:
        mask[1] = 0
    return mask


def numpy_token_index(mask: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The oracle: (index, scatter, cu_seqlens) as kiln/ops/tokens.py defines them, in numpy."""
    batch, seq = mask.shape
    if rows == mask.size:
        spans = np.minimum(np.arange(batch + 2) * seq, mask.size)
        return np.arange(rows), np.arange(rows), spans
    real = np.flatnonzero(mask)
    index = np.concatenate([real, np.zeros(rows - len(real), np.int64)])
    scatter = np.concatenate([real, np.full(rows - len(real), mask.size)])
    return index, scatter, np.concatenate([[0], np.cumsum((mask != 0).sum(1))])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
@pytest.mark.parametrize("kind", KINDS)
def test_token_index_pack_and_unpack_match_numpy(kind, dtype):
    rng = np.random.default_rng()
    batch, seq, width = int(rng.integers(1, 5)), int(rng.integers(1, 23)), int(rng.integers(1, 40))
    mask = random_mask(rng, batch, seq, kind)
    m = torch.from_numpy(mask).to(dtype)
    tokens = int(mask.sum())
    x = torch.randn(batch, seq, width)
    for rows in sorted({tokens, tokens + int(rng.integers(1, 9)), mask.size}):  # exact, a bucket, the identity
        index, scatter, cu_seqlens = kernels.TokenIndex(mask.shape, dtype, rows)(
            {0: m, 1: torch.empty(rows, dtype=torch.uint8)})
        want = numpy_token_index(mask, rows)
        for got, expected in zip((index, scatter, cu_seqlens), want):
            np.testing.assert_array_equal(got.numpy(), expected)
        assert cu_seqlens.dtype == torch.int32 and index.dtype == scatter.dtype == torch.int64
        packed = kernels.PackRows(tuple(x.shape), rows)({0: x, 1: index})  # [T', width]
        np.testing.assert_array_equal(packed.numpy(), x.reshape(-1, width).numpy()[want[0]])
        for zero_padding in (True, False):
            out = kernels.UnpackRows(tuple(packed.shape), mask.shape, dtype, zero_padding)({0: packed, 1: scatter,
                                                                                            2: m})
            expected = np.zeros((mask.size + 1, width), np.float32)
            expected[want[1]] = packed.numpy()
            expected = expected[:-1].reshape(batch, seq, width)
            if zero_padding or rows != mask.size:
                expected[mask == 0] = 0
            np.testing.assert_array_equal(out.numpy(), expected)


def test_a_mask_of_more_real_tokens_than_rows_is_an_error_naming_the_layer():
    mask = torch.ones(2, 5, dtype=torch.int64)
    with pytest.raises(Exception, match="token index"):
        kernels.TokenIndex((2, 5), torch.int64, 7)({0: mask, 1: torch.empty(7, dtype=torch.uint8)})
    with pytest.raises(Exception, match="pack"):  # an index past B·S
        kernels.PackRows((2, 5, 3), 2)({0: torch.randn(2, 5, 3), 1: torch.tensor([0, 10])})


def _packed_step(attrs: dict) -> StepSpec:
    return StepSpec("PackedAttention", "a", ["q", "k", "v", "m", "i", "s", "c"], ["o"], attrs, domain="kiln")


ATTRIBUTES = {
    "split qkv, merged heads (an exported BERT's)": {
        "scale": 0.25, "q_perm": [0, 2, 1, 3], "k_perm": [0, 2, 1, 3], "v_perm": [0, 2, 1, 3],
        "out_perm": [0, 2, 1, 3], "q_num_heads": 3, "kv_num_heads": 3, "qkv_split": [48, 48, 48],
        "out_merge_heads": 1},
    "q, k, v [T, H, D]": {"scale": 0.3, "q_perm": [0, 2, 1, 3], "k_perm": [0, 2, 1, 3], "v_perm": [0, 2, 1, 3],
                          "out_perm": [0, 2, 1, 3]},
}


@pytest.mark.parametrize("layout", list(ATTRIBUTES))
@pytest.mark.parametrize("kind", KINDS)
def test_the_native_packed_attention_is_per_sequence_sdpa(kind, layout):
    rng = np.random.default_rng()
    _packed_attention_is_per_sequence_sdpa(rng, int(rng.integers(1, 5)), int(rng.integers(1, 70)), kind, layout)


@pytest.mark.parametrize("layout", list(ATTRIBUTES))
def test_the_native_packed_attention_of_no_real_token_writes_nothing(layout):
    """1 x 1 with its one position padding (one_padding's draw at batch 1, seq 1): no rows packed; the kernel returns
    its empty output instead of calling oneDNN with S = 0 (which refuses it: a CI failure of session 21)."""
    _packed_attention_is_per_sequence_sdpa(np.random.default_rng(), 1, 1, "one_padding", layout)


def _packed_attention_is_per_sequence_sdpa(rng, batch: int, seq: int, kind: str, layout: str) -> None:
    attrs = ATTRIBUTES[layout]
    mask = random_mask(rng, batch, seq, kind)
    m = torch.from_numpy(mask)
    tokens = int(mask.sum())
    registry.load_device("cpu")
    tactic = registry.get("cpu.packed_attention.native")
    for rows in sorted({tokens, mask.size}):  # packed; the identity packing (padding keys hidden by the mask)
        index, scatter, cu_seqlens = token_index(CTX, m, torch.empty(rows, dtype=torch.uint8))
        if "qkv_split" in attrs:  # q|k|v side by side, [T', 3 · 3 heads · 16]
            args = (torch.randn(rows, 144), None, None)
        else:
            args = tuple(torch.randn(rows, 3, 16) for _ in range(3))
        inputs = (*args, m, index, scatter, cu_seqlens)
        step = _packed_step(attrs)
        metas = [InputMeta.of(x, False) for x in inputs]
        assert tactic.supports(step, metas) is True
        step.tactic_config = tactic.configure(step, metas)
        launch = tactic.prepare(step, [None] * 7, torch.device("cpu"))
        got = launch(CTX, *inputs, **attrs)
        want = packed_attention(CTX, *inputs, **attrs)  # the reference: scattered back, masked attention
        real = scatter < mask.size
        if rows == mask.size:  # the identity packing: rows of padding are the kernel's 0 (and dropped later)
            real = torch.from_numpy(mask.reshape(-1) != 0)
        torch.testing.assert_close(got[real], want[real], rtol=RTOL, atol=ATOL)
        if rows == tokens:  # and per sequence against plain SDPA over the sequence's own rows
            q, k, v = (args[0].split(48, dim=-1) if args[1] is None else args)
            q, k, v = (t.reshape(rows, 3, 16) for t in (q, k, v))
            for b in range(batch):
                span = slice(int(cu_seqlens[b]), int(cu_seqlens[b + 1]))
                if span.stop > span.start:
                    one = [t[span].transpose(0, 1)[None] for t in (q, k, v)]  # [1, H, n, D]
                    expected = F.scaled_dot_product_attention(*one, scale=attrs["scale"])[0].transpose(0, 1)
                    torch.testing.assert_close(got[span].reshape(expected.shape), expected, rtol=RTOL, atol=ATOL)


def test_the_packed_attention_plan_refuses_what_it_cannot_run():
    attrs = ATTRIBUTES["q, k, v [T, H, D]"]
    sizes = {0: (10, 3, 16), 1: (10, 3, 16), 2: (10, 3, 16), 3: (2, 7)}
    assert "cu_seqlens" in packed_attention_plan(attrs, sizes)
    assert "identity packing" in packed_attention_plan(attrs, {**sizes, 6: (4,)})  # B + 2 entries, 10 != 14 rows
    assert isinstance(packed_attention_plan(attrs, {**sizes, 6: (3,)}), dict)
    registry.load_device("cpu")
    tactic = registry.get("cpu.packed_attention.native")
    q = torch.randn(10, 3, 16)
    metas = [InputMeta.of(x, False) for x in (q, q, q, torch.ones(2, 7, dtype=torch.int32), torch.zeros(10),
                                              torch.zeros(10), torch.zeros(3, dtype=torch.int32))]
    assert "int64" in tactic.supports(_packed_step(attrs), metas)


@pytest.fixture(scope="module")
def bert():
    exported = zoo.export("bert_tiny", dynamic=True)
    with pytest.MonkeyPatch.context() as patch:  # the native tactics win: the segment, not a loaded machine's timing
        patch.setattr(autotune, "NATIVE_CREDIT_MS", 1e3)
        engine = kiln.build(str(exported.path), remove_padding=True, profiles=[{"input_ids": "1x1,3x24,4x64"}])
    return engine, ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("packing", ["auto", "always", "never"])
def test_a_padding_free_bert_on_the_cpu_matches_onnxruntime_on_every_mask(bert, packing):
    engine, session = bert
    assert len(engine.program.segments) == 1
    context = engine.create_execution_context(packing=packing)
    rng = np.random.default_rng()
    for kind in (*KINDS, "none_real"):
        batch, seq = int(rng.integers(1, 5)), int(rng.integers(1, 65))
        mask = random_mask(rng, batch, seq, "right" if kind == "none_real" else kind)
        if kind == "none_real":
            mask[:] = 0
        feeds = {"input_ids": rng.integers(0, 1024, (batch, seq), dtype=np.int64), "attention_mask": mask}
        got = context.run(feeds)["layer_norm_4"]
        keep = mask != 0
        if keep.any():
            want = session.run(None, feeds)[0]
            np.testing.assert_allclose(got[keep], want[keep], rtol=RTOL, atol=ATOL, err_msg=f"{batch}x{seq} {kind}")
        assert not got[~keep].any(), f"{batch}x{seq} {kind}: outputs at padding positions must be zero"
