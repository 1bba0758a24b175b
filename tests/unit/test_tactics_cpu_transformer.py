"""kiln's C kernels for a transformer's layers (kiln/tactics/cpu/transformer.py, attention.py, broadcast.py) against
independent oracles on fresh random inputs: float64 numpy for LayerNorm and attention, numpy for the
exact ops (Add, Gather, Cast, And/Or, Where), onnx.reference for GatherND; and each tactic against
the op's registered implementation, as the autotuner checks it. Tolerances: float32 sums of up to
768 terms and a polynomial exp (~2 ulp), so 2e-5 absolute / 1e-4 relative on O(1) values."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper
from onnx.reference import ReferenceEvaluator

from kiln.kernels.cpu import transformer as kernels
from kiln.ops.registry import OpContext, lookup
from kiln.plan.spec import StepSpec
from kiln.tactics import registry
from kiln.tactics.tactic import InputMeta

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kiln's C kernels: {kernels.reason()}")

rng = np.random.default_rng()
ATOL, RTOL = 2e-5, 1e-4


def prepared(tactic: str, op: str, domain: str, inputs: list, attrs: dict, constants: set[int],
             outputs: tuple[str, ...] = ("y",)):
    """(the tactic's launch, the registered op, its context) for a one-layer step over `inputs`."""
    step = StepSpec(op, "layer", [f"i{k}" if v is not None else "" for k, v in enumerate(inputs)], list(outputs),
                    dict(attrs), domain=domain)
    metas = [InputMeta.of(v, k in constants) for k, v in enumerate(inputs)]
    t = registry.get(tactic)
    ok = t.check(step, metas)
    assert ok is True, ok
    step = dataclasses.replace(step, tactic=tactic, tactic_config=t.configure(step, metas))
    launch = t.prepare(step, [v if k in constants else None for k, v in enumerate(inputs)], torch.device("cpu"))
    ctx = OpContext(name="layer", op_type=op, domain=domain, opset=17, num_inputs=len(inputs),
                    num_outputs=len(outputs))
    return launch, lookup(op, domain).fn, ctx


def refusal(tactic: str, op: str, domain: str, inputs: list, attrs: dict, constants: set[int],
            outputs: tuple[str, ...] = ("y",)) -> str:
    step = StepSpec(op, "layer", [f"i{k}" if v is not None else "" for k, v in enumerate(inputs)], list(outputs),
                    dict(attrs), domain=domain)
    found = registry.get(tactic).check(step, [InputMeta.of(v, k in constants) for k, v in enumerate(inputs)])
    assert found is not True
    return found


def t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


# ---------------------------------------------------------------- LayerNorm


def layer_norm64(x, scale, bias, residual, eps):
    s = x.astype(np.float64) + (residual.astype(np.float64) if residual is not None else 0.0)
    y = (s - s.mean(-1, keepdims=True)) / np.sqrt(s.var(-1, keepdims=True) + eps)
    return y * (scale if scale is not None else 1.0) + (bias if bias is not None else 0.0)


@pytest.mark.parametrize("residual", [None, "same", "rows"])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_matches_float64(residual, affine):
    for n in (1, 7, 64, 768):
        b, s = int(rng.integers(1, 5)), int(rng.integers(1, 90))
        x = rng.standard_normal((b, s, n)).astype(np.float32) * 3 + 1
        r = None if residual is None else rng.standard_normal((b, s, n) if residual == "same" else (1, s, n))
        r = None if r is None else r.astype(np.float32)
        scale = rng.standard_normal(n).astype(np.float32) if affine else None
        bias = rng.standard_normal(n).astype(np.float32) if affine else None
        eps = float(rng.choice([1e-12, 1e-5]))
        inputs = [t(x), None if scale is None else t(scale), None if bias is None else t(bias),
                  None if r is None else t(r)]
        launch, op, ctx = prepared("cpu.layernorm.native", "LayerNorm", "kiln", inputs, {"epsilon": eps}, {1, 2})
        got = launch(ctx, *inputs, epsilon=eps)
        np.testing.assert_allclose(got.numpy(), layer_norm64(x, scale, bias, r, eps), atol=ATOL * 4, rtol=RTOL,
                                   err_msg=f"n={n}")  # 768-term float32 sums: 8e-5
        np.testing.assert_allclose(got.numpy(), op(ctx, *inputs, epsilon=eps).numpy(), atol=ATOL * 4, rtol=RTOL)


@pytest.mark.parametrize("rms", [False, True])
def test_narrow_rows_in_registers_match_the_row_loop_and_float64(rms):
    """Rows of at most 64 floats on AVX-512 are held in registers (transformer.c ln_row_narrow): widths across each
    register's mask (16, 17, 33, 48, 64; 65 takes the row loop), with a residual repeating over the rows and the sum
    kept, against float64 and the row loop (kernels.set_narrow_norm(False))."""
    from kiln.kernels.cpu import transformer as kernels

    for n in (16, 17, 33, 48, 64, 65):
        x = rng.standard_normal((2, 37, n)).astype(np.float32) * 3 + 1
        r = rng.standard_normal((1, 37, n)).astype(np.float32)
        scale, bias = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
        norm = kernels.LayerNorm(x.shape, t(scale), t(bias), 1e-5, residual_size=r.shape, rms=rms, keep_sum=True)
        s64 = x.astype(np.float64) + r
        mean = 0.0 if rms else s64.mean(-1, keepdims=True)
        want = (s64 - mean) / np.sqrt(((s64 - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * scale + bias
        forms = {}
        try:
            for narrow in (True, False):
                kernels.set_narrow_norm(narrow)
                forms[narrow] = [o.numpy() for o in norm({0: t(x), 3: t(r)})]
        finally:
            kernels.set_narrow_norm(True)
        for narrow, (y, total) in forms.items():
            np.testing.assert_array_equal(total, x + r, err_msg=f"n={n} narrow {narrow}")
            np.testing.assert_allclose(y, want, atol=ATOL * 4, rtol=RTOL, err_msg=f"n={n} narrow {narrow}")
        np.testing.assert_allclose(forms[True][0], forms[False][0], atol=ATOL * 4, rtol=RTOL, err_msg=f"n={n}")


@pytest.mark.parametrize("residual", [None, "same", "rows"])
def test_pre_ln_layer_norm_also_gives_the_sum(residual):
    """A pre-LN block's norm: y = LN(x + r) and the sum s = x + r (the residual stream) as a second output."""
    for n in (5, 64, 384):
        b, s = int(rng.integers(1, 4)), int(rng.integers(1, 70))
        x = rng.standard_normal((b, s, n)).astype(np.float32) * 2 - 1
        r = None if residual is None else rng.standard_normal((b, s, n) if residual == "same" else (1, s, n))
        r = None if r is None else r.astype(np.float32)
        scale, bias = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
        inputs = [t(x), t(scale), t(bias), None if r is None else t(r)]
        launch, op, ctx = prepared("cpu.layernorm.native", "LayerNorm", "kiln", inputs, {"epsilon": 1e-6}, {1, 2},
                                   outputs=("y", "sum"))
        y, total = launch(ctx, *inputs, epsilon=1e-6)
        np.testing.assert_array_equal(total.numpy(), x + r if r is not None else x)  # one float32 add: exact
        np.testing.assert_allclose(y.numpy(), layer_norm64(x, scale, bias, r, 1e-6), atol=ATOL * 4, rtol=RTOL)
        want_y, want_total = op(ctx, *inputs, epsilon=1e-6)
        np.testing.assert_allclose(y.numpy(), want_y.numpy(), atol=ATOL * 4, rtol=RTOL)
        np.testing.assert_array_equal(total.numpy(), want_total.numpy())
    assert launch.native.more_outputs == ((tuple(x.shape), torch.float32),)
    # what the autotuner times: the layer bound once, each call one C call, writing what the launch returns
    _, (timed_y, timed_total) = launch.timed(*inputs)()
    torch.testing.assert_close(timed_y, y, rtol=0, atol=0)
    torch.testing.assert_close(timed_total, total, rtol=0, atol=0)


def test_row_kernels_on_two_threads_match():
    """LayerNorm (with the sum kept) and Add at encoder sizes on 2 threads (OpenMP past PARALLEL_ELEMENTS)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows, n in ((197, 768), (1125, 192), (1500, 768)):
            x = rng.standard_normal((1, rows, n)).astype(np.float32)
            r = rng.standard_normal((1, rows, n)).astype(np.float32)
            scale, bias = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
            norm = kernels.LayerNorm((1, rows, n), t(scale), t(bias), 1e-6, (1, rows, n), keep_sum=True)
            y, total = norm({0: t(x), 3: t(r)})
            np.testing.assert_array_equal(total.numpy(), x + r)
            np.testing.assert_allclose(y.numpy(), layer_norm64(x, scale, bias, r, 1e-6), atol=ATOL * 4, rtol=RTOL)
            b = rng.standard_normal((rows, n)).astype(np.float32)
            np.testing.assert_array_equal(kernels.Add((1, rows, n), (rows, n))({0: t(x), 1: t(b)}).numpy(), x + b)
    finally:
        torch.set_num_threads(threads)


def test_layer_norm_at_other_sizes_through_its_native_step():
    x = torch.randn(2, 9, 32)
    w, bias, r = torch.randn(32), torch.randn(32), torch.randn(1, 9, 32)
    launch, op, ctx = prepared("cpu.layernorm.native", "LayerNorm", "kiln", [x, w, bias, r], {}, {1, 2})
    native = launch.native.at({0: (5, 3, 32), 3: (1, 3, 32)})
    assert native.output_size == (5, 3, 32) and native.reads == {0: ((5, 3, 32), torch.float32),
                                                                  3: ((1, 3, 32), torch.float32)}
    x2, r2 = torch.randn(5, 3, 32), torch.randn(1, 3, 32)
    np.testing.assert_allclose(launch(ctx, x2, w, bias, r2).numpy(), op(ctx, x2, w, bias, r2).numpy(),
                               atol=ATOL, rtol=RTOL)


def test_layer_norm_refuses_what_it_cannot_run():
    x, w = torch.randn(2, 3, 8), torch.randn(8)
    assert "last axis" in refusal("cpu.layernorm.native", "LayerNorm", "kiln", [x, w], {"axis": 1}, {1})
    assert "3 outputs" in refusal("cpu.layernorm.native", "LayerNorm", "kiln", [x, w, None, x], {}, {1},
                                  outputs=("y", "sum", "other"))
    assert "repeat" in refusal("cpu.layernorm.native", "LayerNorm", "kiln", [x, w, None, torch.randn(2, 1, 8)],
                               {}, {1})
    assert "constant" in refusal("cpu.layernorm.native", "LayerNorm", "kiln", [x, w], {}, set())


@pytest.mark.parametrize("shape", [(1, 7, 5, 96), (3, 40), (2, 9, 768)])  # ConvNeXt's [N, H, W, C], rows
def test_onnx_layer_normalization_matches_the_onnx_reference(shape):
    x = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
    scale, bias = (rng.standard_normal(shape[-1]).astype(np.float32) for _ in range(2))
    eps = 1e-6
    node = helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y"], axis=-1, epsilon=eps)
    graph = helper.make_graph([node], "ln", [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
                                            for n in ("x", "scale", "bias")],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    want = ReferenceEvaluator(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])).run(
        None, {"x": x, "scale": scale, "bias": bias})[0]
    inputs = [t(x), t(scale), t(bias)]
    launch, op, ctx = prepared("cpu.layernormalization.native", "LayerNormalization", "", inputs,
                               {"axis": -1, "epsilon": eps}, {1, 2})
    got = launch(ctx, *inputs, axis=-1, epsilon=eps)
    np.testing.assert_allclose(got.numpy(), want, atol=ATOL * 4, rtol=RTOL)  # 768-term float32 sums: 8e-5
    if len(shape) <= 3:
        assert launch.native.reads == {0: (shape, torch.float32)}  # a segment member
    else:  # a segment's 4-D values are NHWC in memory: [N, H, W, C] runs as a step of its own
        assert not hasattr(launch, "native")


def test_onnx_layer_normalization_refuses_what_it_cannot_run():
    x, w = torch.randn(2, 3, 8), torch.randn(8)
    name = "cpu.layernormalization.native"
    assert "Mean" in refusal(name, "LayerNormalization", "", [x, w], {}, {1}, outputs=("y", "mean"))
    assert "last axis" in refusal(name, "LayerNormalization", "", [x, w], {"axis": 1}, {1})
    assert "constant" in refusal(name, "LayerNormalization", "", [x, w], {}, set())


# ---------------------------------------------------------------- Add, Gather


def test_add_with_rows_repeating_is_exact():
    for a_shape, b_shape in (((3, 5, 16), (3, 5, 16)), ((1, 5, 16), (4, 5, 16)), ((4, 7, 3), (3,)), ((2, 6), (1, 6))):
        a, b = (rng.standard_normal(s).astype(np.float32) for s in (a_shape, b_shape))
        launch, op, ctx = prepared("cpu.add.native", "Add", "", [t(a), t(b)], {}, set())
        np.testing.assert_array_equal(launch(ctx, t(a), t(b)).numpy(), a + b)
    assert "repeat" in refusal("cpu.add.native", "Add", "", [torch.randn(3, 1, 4), torch.randn(3, 5, 4)], {}, set())


def test_gather_rows_is_exact_with_negative_ids_and_fails_out_of_range():
    table = rng.standard_normal((50, 24)).astype(np.float32)
    ids = rng.integers(-50, 50, (3, 11))
    launch, op, ctx = prepared("cpu.gather.native", "Gather", "", [t(table), t(ids)], {"axis": 0}, {0})
    np.testing.assert_array_equal(launch(ctx, t(table), t(ids)).numpy(), np.take(table, ids, axis=0))
    with pytest.raises(Exception, match="invalid arguments"):
        launch(ctx, t(table), t(np.array([[0, 50]])))
    assert "int64" in refusal("cpu.gather.native", "Gather", "", [t(table), t(ids.astype(np.int32))], {}, {0})
    assert "constant" in refusal("cpu.gather.native", "Gather", "", [t(table), t(ids)], {}, set())


# ---------------------------------------------------------------- attention


def attention64(q, k, v, mask, scale, causal, nan_to_zero):
    """q [B, H, S, D], k/v [B, Hkv, T, D]; mask additive float or bool, broadcast to [B, H, S, T]."""
    repeat = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, repeat, axis=1).astype(np.float64), np.repeat(v, repeat, axis=1).astype(np.float64)
    scores = np.einsum("bhsd,bhtd->bhst", q.astype(np.float64), k) * scale
    if mask is not None:
        scores = np.where(mask, scores, -np.inf) if mask.dtype == np.bool_ else scores + mask
    if causal:
        scores = np.where(np.tril(np.ones(scores.shape[-2:], bool)), scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        e = np.exp(scores - top)
        out = np.einsum("bhst,bhtd->bhsd", e / e.sum(-1, keepdims=True), v)
    return np.nan_to_num(out, nan=0.0) if nan_to_zero else out


def test_attention_on_bert_s_packed_qkv_with_padding_masks():
    # q, k, v side by side in one GEMM output [B, S, 3·H·D]; output merged [B, S, H·D]
    for _ in range(4):
        b, s, h, d = int(rng.integers(1, 5)), int(rng.integers(1, 70)), int(rng.choice([1, 4, 12])), \
            int(rng.choice([8, 16, 64]))
        qkv = rng.standard_normal((b, s, 3 * h * d)).astype(np.float32)
        keep = np.ones((b, s), bool)
        for row in range(b):  # right or left padding; one row may see nothing
            cut = int(rng.integers(0, s + 1))
            keep[row, cut:] = False if rng.random() < 0.5 else keep[row, cut:]
            keep[row, :cut] = keep[row, :cut] if rng.random() < 0.5 else False
        mask = np.where(keep[:, None, None, :], 0.0, -np.inf).astype(np.float32)
        mask = np.broadcast_to(mask, (b, 1, s, s)).copy()
        attrs = {"scale": d ** -0.5, "nan_to_zero": 1, "q_perm": [0, 2, 1, 3], "k_perm": [0, 2, 1, 3],
                 "v_perm": [0, 2, 1, 3], "out_perm": [0, 2, 1, 3], "q_num_heads": h, "kv_num_heads": h,
                 "out_merge_heads": 1, "qkv_split": [h * d] * 3}
        inputs = [t(qkv), None, None, t(mask)]
        launch, op, ctx = prepared("cpu.attention.native", "Attention", "kiln", inputs, attrs, set())
        got = launch(ctx, *inputs, **attrs).numpy()
        heads = qkv.reshape(b, s, 3, h, d).transpose(2, 0, 3, 1, 4)  # [3, B, H, S, D]
        want = attention64(heads[0], heads[1], heads[2], mask, d ** -0.5, False, True)
        want = want.transpose(0, 2, 1, 3).reshape(b, s, h * d)
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL, err_msg=f"{b}x{s}, {h} heads of {d}")
        np.testing.assert_allclose(got, op(ctx, *inputs, **attrs).numpy(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kind", ["additive", "bool"])
def test_attention_leaves_out_keys_hidden_from_every_query(kind):
    """A mask broadcast over the queries ([B, 1, 1, T]: BERT's padding, the dtype's minimum added) whose last keys
    are hidden: the kernel stops at the last visible key of each (batch, head). Rows of every kind: right-padded
    by any amount (one key left, a tile's worth, none), a hidden key before visible ones (kept), every key hidden
    (all attended alike for an additive mask, as softmax does; NaN -> 0 for a boolean one)."""
    b, h, d = 6, 3, 64
    s = int(rng.integers(40, 140))
    q, k, v = (rng.standard_normal((b, h, s, d)).astype(np.float32) for _ in range(3))
    keep = np.ones((b, 1, 1, s), bool)
    keep[0, ..., int(rng.integers(1, s)):] = False  # right-padded
    keep[1, ..., 1:] = False  # one key left
    keep[2, ..., s - int(rng.integers(1, 17)):] = False  # less than a tile of keys hidden
    keep[3, ..., : int(rng.integers(1, s))] = False  # left-padded: the last key visible, nothing left out
    keep[3, ..., -1] = True
    keep[4] = False  # every key hidden
    keep[5, ..., [s // 3, s - 5]] = False  # hidden keys among visible ones, the last visible
    mask = keep if kind == "bool" else np.where(keep, 0.0, np.finfo(np.float32).min).astype(np.float32)
    attrs = {"scale": d ** -0.5, "nan_to_zero": 1}
    inputs = [t(q), t(k), t(v), t(mask)]
    launch, op, ctx = prepared("cpu.attention.native", "Attention", "kiln", inputs, attrs, set())
    got = launch(ctx, *inputs, **attrs).numpy()
    want = attention64(q, k, v, mask, d ** -0.5, False, True)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL, err_msg=f"{kind} mask, {s} keys")
    np.testing.assert_allclose(got, op(ctx, *inputs, **attrs).numpy(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("case", ["causal", "gqa_bool_mask", "cross", "no_mask_default_scale"])
def test_attention_on_separate_heads(case):
    b, h, hkv, s, tt, d = 2, 4, 4, int(rng.integers(1, 40)), None, int(rng.choice([16, 20, 64]))
    tt = int(rng.integers(1, 50)) if case == "cross" else s
    if case == "gqa_bool_mask":
        hkv = 2
    q = rng.standard_normal((b, h, s, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, hkv, tt, d)).astype(np.float32) for _ in range(2))
    mask = None
    attrs = {"scale": 0.3}
    if case == "causal":
        attrs["is_causal"] = 1
    if case == "gqa_bool_mask":
        attrs["gqa"] = 1
        mask = rng.random((b, 1, 1, tt)) < 0.7
        mask[..., 0] = True
    if case == "cross":
        mask = (rng.standard_normal((1, h, s, tt)) * 2).astype(np.float32)  # a float bias, broadcast over batch
    if case == "no_mask_default_scale":
        attrs["scale"] = None  # SDPA's 1/sqrt(D)
    inputs = [t(q), t(k), t(v)] + ([t(mask)] if mask is not None else [])
    launch, op, ctx = prepared("cpu.attention.native", "Attention", "kiln", inputs, attrs, set())
    got = launch(ctx, *inputs, **attrs).numpy()
    scale = d ** -0.5 if attrs["scale"] is None else attrs["scale"]
    want = attention64(q, k, v, mask, scale, case == "causal", False)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(got, op(ctx, *inputs, **attrs).numpy(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("d", [4, 36, 40])
@pytest.mark.parametrize("s", [5, 64])
def test_attention_with_head_dims_past_a_whole_register_tile(d, s):
    """Head dims that are not a multiple of the 16-wide tile (MobileViT-S's 36): v's last chunk is packed
    zero-padded when enough query tiles read it (s = 64), read in place one dim at a time when not (s = 5)."""
    b, h = 4, 4  # MobileViT-S's first transformer: the 4 pixels of its 2x2 patches as the batch, 4 heads
    q, k, v = (rng.standard_normal((b, h, s, d)).astype(np.float32) for _ in range(3))
    inputs = [t(q), t(k), t(v)]
    attrs = {"scale": d ** -0.5}
    launch, op, ctx = prepared("cpu.attention.native", "Attention", "kiln", inputs, attrs, set())
    got = launch(ctx, *inputs, **attrs).numpy()
    np.testing.assert_allclose(got, attention64(q, k, v, None, d ** -0.5, False, False), atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(got, op(ctx, *inputs, **attrs).numpy(), atol=ATOL, rtol=RTOL)



@pytest.mark.parametrize("d, dv", [(64, 64), (64, 40), (20, 20), (48, 80)])
def test_attention_on_t5_s_position_bias_without_scaling(d, dv):
    """T5's attention: heads split from [B, S, H·D], no 1/sqrt(D) scaling, the additive mask the relative
    position bias [1, H, S, S] plus the key padding [B, 1, 1, S]. The head dims cover AVX-512's 32-wide tiles
    (64), a last one that is half padding (40, 80: a masked store) and one 16-wide tile after a pair (48)."""
    b, h, s = 2, 8, int(rng.choice([7, 33, 128]))
    q, k = (rng.standard_normal((b, s, h * d)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((b, s, h * dv)).astype(np.float32)
    bias = (rng.standard_normal((1, h, s, s)) * 3).astype(np.float32)
    keep = np.ones((b, s), bool)
    keep[1, int(rng.integers(1, s + 1)):] = False
    mask = (bias + np.where(keep, 0.0, np.finfo(np.float32).min)[:, None, None, :]).astype(np.float32)
    perm = [0, 2, 1, 3]
    attrs = {"scale": 1.0, "q_perm": perm, "k_perm": perm, "v_perm": perm, "out_perm": perm, "q_num_heads": h,
             "kv_num_heads": h, "out_merge_heads": 1}
    inputs = [t(q), t(k), t(v), t(mask)]
    launch, op, ctx = prepared("cpu.attention.native", "Attention", "kiln", inputs, attrs, set())
    got = launch(ctx, *inputs, **attrs)
    heads = [x.reshape(b, s, h, -1).transpose(0, 2, 1, 3) for x in (q, k, v)]
    want = attention64(*heads, mask, 1.0, False, False).transpose(0, 2, 1, 3).reshape(b, s, h * dv)
    np.testing.assert_allclose(got.numpy(), want, atol=ATOL, rtol=RTOL)
    sdpa = torch.nn.functional.scaled_dot_product_attention(*(t(x) for x in heads), attn_mask=t(mask), scale=1.0)
    torch.testing.assert_close(got, sdpa.transpose(1, 2).reshape(b, s, h * dv), atol=ATOL, rtol=RTOL)

@pytest.mark.parametrize("h, s, tt, case", [(3, 300, 300, "causal"), (1, 200, 200, "bool_mask"),
                                         (3, 301, 257, "float_mask"), (6, 198, 198, "none")])
def test_attention_splits_long_heads_into_row_runs_across_threads(h, s, tt, case):
    """Heads of many query rows run as several work items (a run of rows each) when the heads alone would
    leave a thread idle: every run's rows, the last short one included, against float64."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        b, d = 1, 64
        q = rng.standard_normal((b, h, s, d)).astype(np.float32)
        k, v = (rng.standard_normal((b, h, tt, d)).astype(np.float32) for _ in range(2))
        mask, attrs = None, {"scale": d ** -0.5, "is_causal": int(case == "causal")}
        if case == "bool_mask":
            mask = rng.random((b, 1, s, tt)) < 0.8
            mask[..., 0] = True
        if case == "float_mask":
            mask = rng.standard_normal((b, 1, 1, tt)).astype(np.float32)
        inputs = [t(q), t(k), t(v)] + ([t(mask)] if mask is not None else [])
        launch, op, ctx = prepared("cpu.attention.native", "Attention", "kiln", inputs, attrs, set())
        got = launch(ctx, *inputs, **attrs).numpy()
        want = attention64(q, k, v, mask, d ** -0.5, case == "causal", False)
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    finally:
        torch.set_num_threads(threads)


def _torch_views(attrs, sizes):
    """The oracle for the attention plan's geometry: q, k, v and the output as torch itself views them
    (split, unflatten, permute, expand on meta tensors), as kiln/ops/fused.py attention does."""
    q, k, v = (torch.empty(sizes[i], device="meta") if i in sizes else None for i in (0, 1, 2))
    source = {"q": 0, "k": 1, "v": 2}
    if attrs.get("qkv_split"):
        q, k, v = torch.split(q, list(attrs["qkv_split"]), dim=-1)
        source = {"q": 0, "k": 0, "v": 0}
    if attrs.get("q_num_heads") and q.dim() == 3:
        q = q.unflatten(-1, (attrs["q_num_heads"], -1))
    if attrs.get("kv_num_heads") and k.dim() == 3:
        k = k.unflatten(-1, (attrs["kv_num_heads"], -1))
    if attrs.get("kv_num_heads") and v.dim() == 3:
        v = v.unflatten(-1, (attrs["kv_num_heads"], -1))
    views, shapes = {}, {}
    for name, x in (("q", q), ("k", k), ("v", v)):
        x = x.permute(attrs[f"{name}_perm"]) if attrs.get(f"{name}_perm") else x  # [B, H, S, D]
        views[name], shapes[name] = (source[name], x.storage_offset(), tuple(x.stride()[:3])), x.shape
    B, H, S, _ = shapes["q"]
    T, Dv = shapes["k"][2], shapes["v"][3]
    mask = tuple(torch.empty(sizes[3], device="meta").expand(B, H, S, T).stride()) if 3 in sizes else None
    shape = [B, H, S, Dv]
    out_perm = attrs.get("out_perm")
    out = torch.empty([shape[i] for i in out_perm] if out_perm else shape, device="meta")
    if out_perm:
        out = out.permute([out_perm.index(i) for i in range(4)])
    return views, mask, tuple(out.stride()[:3])


def test_the_attention_plan_has_torch_s_view_geometry_at_every_size():
    """The plan is index arithmetic (it runs per layer at every new input size): its offsets and strides,
    size-1 axes included, are those of the views torch makes, over fresh random sizes and layouts."""
    from kiln.tactics.cpu.attention import attention_plan

    for _ in range(300):
        b, s, tt, h, d = (int(rng.integers(1, 5)), int(rng.integers(1, 9)), int(rng.integers(1, 9)),
                          int(rng.choice([1, 2, 4])), int(rng.choice([2, 8])))
        layout = rng.choice(["packed", "separate rows", "heads"])
        if layout == "packed":
            tt, sizes = s, {0: (b, s, 3 * h * d)}
            attrs = {"qkv_split": [h * d] * 3, "q_num_heads": h, "kv_num_heads": h}
        elif layout == "separate rows":
            sizes = {0: (b, s, h * d), 1: (b, tt, h * d), 2: (b, tt, h * d)}
            attrs = {"q_num_heads": h, "kv_num_heads": h}
        else:
            sizes, attrs = {0: (b, h, s, d), 1: (b, h, tt, d), 2: (b, h, tt, d)}, {}
        if layout != "heads":
            attrs.update(q_perm=[0, 2, 1, 3], k_perm=[0, 2, 1, 3], v_perm=[0, 2, 1, 3])
        if rng.random() < 0.5:
            attrs.update(out_perm=[0, 2, 1, 3], out_merge_heads=int(rng.random() < 0.5))
        mask_dtype = None
        if rng.random() < 0.7:  # any broadcast of [B, H, S, T], leading axes dropped or not
            full = [b, h, s, tt]
            sizes[3] = tuple(x if rng.random() < 0.5 else 1 for x in full)[int(rng.integers(0, 4)):] or (tt,)
            mask_dtype = torch.float32 if rng.random() < 0.5 else torch.bool
        plan = attention_plan(attrs, sizes, mask_dtype)
        assert isinstance(plan, dict), plan
        views, mask, out = _torch_views(attrs, sizes)
        assert (plan["q"], plan["k"], plan["v"]) == (views["q"], views["k"], views["v"]), (attrs, sizes)
        assert plan["out_strides"] == out, (attrs, sizes)
        assert (plan["mask"][1] if plan["mask"] else None) == mask, (attrs, sizes)


def test_layers_of_one_attention_configuration_share_the_kernel_at_a_new_size():
    b, s, h, d = 2, int(rng.integers(2, 40)), 2, 8
    qkv = rng.standard_normal((b, s, 3 * h * d)).astype(np.float32)
    mask = np.zeros((b, 1, s, s), np.float32)
    attrs = {"q_perm": [0, 2, 1, 3], "k_perm": [0, 2, 1, 3], "v_perm": [0, 2, 1, 3], "out_perm": [0, 2, 1, 3],
             "q_num_heads": h, "kv_num_heads": h, "out_merge_heads": 1, "qkv_split": [h * d] * 3}
    first, _, ctx = prepared("cpu.attention.native", "Attention", "kiln", [t(qkv), None, None, t(mask)], attrs, set())
    second, _, _ = prepared("cpu.attention.native", "Attention", "kiln", [t(qkv), None, None, t(mask)], attrs, set())
    other = {0: (b + 1, s + 1, 3 * h * d), 3: (b + 1, 1, s + 1, s + 1)}
    at_first, at_second = first.native.at(other), second.native.at(other)
    assert at_first.primitive(False) is at_second.primitive(False)  # built once, bound by each layer
    inputs = [t(rng.standard_normal(other[0]).astype(np.float32)), None, None, t(np.zeros(other[3], np.float32))]
    np.testing.assert_array_equal(first(ctx, *inputs, **attrs).numpy(), second(ctx, *inputs, **attrs).numpy())


def test_attention_refuses_what_it_cannot_run():
    q = torch.randn(1, 2, 5, 8)
    assert "int64" in refusal("cpu.attention.native", "Attention", "kiln",
                              [q, q, q, torch.ones(1, 1, 1, 5, dtype=torch.int64)], {}, set())
    assert "gqa" in refusal("cpu.attention.native", "Attention", "kiln", [q, torch.randn(1, 1, 5, 8),
                                                                         torch.randn(1, 1, 5, 8)], {}, set())
    assert "broadcast" in refusal("cpu.attention.native", "Attention", "kiln", [q, q, q, torch.zeros(1, 1, 3, 5)],
                                  {}, set())


# ---------------------------------------------------------------- mask preparation ops


def test_cast_and_logical_ops_and_where_are_exact_over_broadcasts():
    m = rng.integers(0, 2, (3, 9))
    launch, op, ctx = prepared("cpu.cast.native", "Cast", "", [t(m)], {"to": 9}, set())
    np.testing.assert_array_equal(launch(ctx, t(m), to=9).numpy(), m != 0)
    f = rng.integers(-3, 3, (4, 5)).astype(np.int32)
    launch, op, ctx = prepared("cpu.cast.native", "Cast", "", [t(f)], {"to": 1}, set())
    np.testing.assert_array_equal(launch(ctx, t(f), to=1).numpy(), f.astype(np.float32))
    a, b = rng.random((1, 1, 7, 1)) < 0.5, rng.random((3, 1, 1, 7)) < 0.5
    for name, expect in (("And", a & b), ("Or", a | b)):
        launch, op, ctx = prepared(f"cpu.{name.lower()}.native", name, "", [t(a), t(b)], {}, set())
        np.testing.assert_array_equal(launch(ctx, t(a), t(b)).numpy(), expect)
    cond = rng.random((3, 1, 6, 6)) < 0.5
    x, y = np.array(0.0, np.float32), np.array(-np.inf, np.float32)
    launch, op, ctx = prepared("cpu.where.native", "Where", "", [t(cond), t(x), t(y)], {}, set())
    np.testing.assert_array_equal(launch(ctx, t(cond), t(x), t(y)).numpy(), np.where(cond, x, y))
    x = rng.standard_normal((6,)).astype(np.float32)
    y = rng.standard_normal((3, 1, 1, 1)).astype(np.float32)
    launch, op, ctx = prepared("cpu.where.native", "Where", "", [t(cond), t(x), t(y)], {}, set())
    np.testing.assert_array_equal(launch(ctx, t(cond), t(x), t(y)).numpy(), np.where(cond, x, y))
    assert "bool and float32" in refusal("cpu.cast.native", "Cast", "", [t(m)], {"to": 7}, set())



@pytest.mark.parametrize("cond_size, x_size, y_size", [
    ((1, 1, 7, 33), (1, 4, 7, 33), ()),        # T5's mask over its position bias, a scalar fill: a unit-stride loop
    ((2, 1, 7, 33), (), (2, 3, 7, 33)),        # the fill first
    ((2, 3, 7, 33), (2, 3, 7, 33), (2, 3, 7, 33)),  # nothing broadcast
    ((2, 3, 7, 1), (1, 3, 7, 33), ()),         # the condition repeating along the last axis: the strided loop
    ((1, 1, 1, 33), (33,), (2, 1, 7, 1)),
])
def test_where_unit_stride_paths_match_numpy(cond_size, x_size, y_size):
    cond = rng.random(cond_size) < 0.5
    x = rng.standard_normal(x_size).astype(np.float32)
    y = np.array(-np.inf, np.float32) if y_size == () else rng.standard_normal(y_size).astype(np.float32)
    launch, op, ctx = prepared("cpu.where.native", "Where", "", [t(cond), t(x), t(y)], {}, set())
    np.testing.assert_array_equal(launch(ctx, t(cond), t(x), t(y)).numpy(), np.where(cond, x, y))

def gather_nd_reference(data: np.ndarray, indices: np.ndarray) -> np.ndarray:
    elem = {np.dtype(np.float32): onnx.TensorProto.FLOAT, np.dtype(np.bool_): onnx.TensorProto.BOOL}[data.dtype]
    graph = helper.make_graph([helper.make_node("GatherND", ["data", "indices"], ["y"])], "g",
                              [helper.make_tensor_value_info("data", elem, list(data.shape)),
                               helper.make_tensor_value_info("indices", onnx.TensorProto.INT64, list(indices.shape))],
                              [helper.make_tensor_value_info("y", elem, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ReferenceEvaluator(model).run(None, {"data": data, "indices": indices})[0]


def test_gather_nd_matches_onnx_reference():
    # BERT's: mask [B, T] by a grid of (b, t) pairs [B, 1, 1, T, 2]
    b, s = 3, 8
    mask = rng.random((b, s)) < 0.6
    grid = np.stack(np.broadcast_arrays(np.arange(b)[:, None, None, None], np.arange(s)[None, None, None, :]), -1)
    data = rng.standard_normal((4, 5, 6)).astype(np.float32)
    single = rng.integers(-4, 4, (2, 3, 1))  # slices of [5, 6], negative indices from the end
    pairs = np.stack([rng.integers(-4, 4, (7,)), rng.integers(0, 5, (7,))], -1)
    for d, i in ((mask, grid), (data, single), (data, pairs)):
        launch, op, ctx = prepared("cpu.gathernd.native", "GatherND", "", [t(d), t(i)], {}, set())
        np.testing.assert_array_equal(launch(ctx, t(d), t(i)).numpy(), gather_nd_reference(d, i))
    assert "batch_dims" in refusal("cpu.gathernd.native", "GatherND", "", [t(data), t(pairs)], {"batch_dims": 1},
                                   set())


@pytest.mark.parametrize("affine", [True, False])
def test_rms_norm_matches_float64(affine):
    """cpu.rmsnorm.native (the LayerNorm kernel without the mean) against float64 and kiln::RMSNorm's reference."""
    for n in (1, 7, 64, 512):
        b, s = int(rng.integers(1, 5)), int(rng.integers(1, 90))
        x = rng.standard_normal((b, s, n)).astype(np.float32) * 3 + 1
        scale = rng.standard_normal(n).astype(np.float32) if affine else None
        eps = float(rng.choice([1e-6, 1e-5]))
        inputs = [t(x)] + ([t(scale)] if scale is not None else [])
        launch, op, ctx = prepared("cpu.rmsnorm.native", "RMSNorm", "kiln", inputs, {"epsilon": eps}, {1})
        got = launch(ctx, *inputs, epsilon=eps)
        x64 = x.astype(np.float64)
        want = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + eps) * (scale if scale is not None else 1.0)
        np.testing.assert_allclose(got.numpy(), want, atol=ATOL * 4, rtol=RTOL, err_msg=f"n={n}")
        np.testing.assert_allclose(got.numpy(), op(ctx, *inputs, epsilon=eps).numpy(), atol=ATOL * 4, rtol=RTOL)


def assert_passes_under_the_avx2_cap(test_file: str, selection: str, skips: bool = True) -> None:
    """The tests of `test_file` that `selection` (pytest's -k) picks, again in a process under KILN_CPU_ISA=avx2 (the
    kernels compiled for x86-64-v3): all pass (and, with `skips` False, none is skipped). The capped process is told
    apart by the cap itself, so a test calling this from there skips rather than start another."""
    from kiln.kernels.cpu import cpu_features, native_loop

    if cpu_features.isa_cap() == "avx2":
        pytest.skip("already under the cap (this is the capped run)")
    if cpu_features.isa() not in ("avx2", "avx512") or native_loop.find_compiler() is None:
        pytest.skip("needs an x86 CPU with AVX2 and a C compiler")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "KILN_CPU_ISA": "avx2", "PYTHONPATH": str(root)}
    for name in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider",
                           str(test_file), "-k", selection], env=env, capture_output=True,
                          text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]
    assert skips or " skipped" not in done.stdout, done.stdout[-2000:]


def test_the_attention_tests_pass_under_the_avx2_cap():
    """This file's attention tests again under KILN_CPU_ISA=avx2: the AVX2 tiles run (pv_tile's six-row tile,
    pack_keys' 8x8 transposes) where the AVX-512 build takes its 32-wide ones."""
    assert_passes_under_the_avx2_cap(__file__, "attention and not avx2_cap")
