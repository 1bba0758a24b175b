"""An FP8 engine's attention: kiln's calibration finds each attention and its E4M3 scale (kiln/quant/attention.py),
the builder allows it (`fp8_scale`), and the autotuner judges cuda.attention.triton_fp8.* against the op on the
E4M3-rounded q/k/v (its `checker`) beside the exact tactics, which ignore the attribute (interpreter, small shapes).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.builder import autotune, layer_records  # noqa: E402
from kiln.builder.timing_cache import TimingCache  # noqa: E402
from kiln.ops.registry import OpContext, lookup  # noqa: E402
from kiln.tactics import registry  # noqa: E402
from kiln.tactics.cuda.attention import fp8_checker, on_e4m3_grid  # noqa: E402
from tests.unit import tactic_check  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes

FP8_TACTIC = "cuda.attention.triton_fp8.64x32.w4s2"
QK_TACTIC = "cuda.attention.triton_fp8qk.64x32.w4s2"
HALF_TACTIC = "cuda.attention.triton.64x32.w4s2"
HEADS_LAST = [0, 2, 1, 3]
CPU = torch.device("cpu")


def bert_layer(fp8_scale: float | None = 0.02, seed: int = 0):
    """BERT after the layout fusion, as a padding-free plain program has it: Attention(qkv, -, -, mask, lengths)."""
    torch.manual_seed(seed)
    b, s, h, d = 3, 40, 2, 32
    attributes = dict(scale=d ** -0.5, qkv_split=[h * d] * 3, q_num_heads=h, kv_num_heads=h, q_perm=HEADS_LAST,
                      k_perm=HEADS_LAST, v_perm=HEADS_LAST, out_perm=HEADS_LAST, out_merge_heads=1)
    if fp8_scale is not None:
        attributes["fp8_scale"] = fp8_scale
    step = tactic_check.make_step("Attention", "kiln", 5, **attributes)
    lengths = torch.tensor([40, 23, 31], dtype=torch.int32)
    mask = torch.where(torch.arange(s) < lengths.view(-1, 1, 1, 1), 0.0, -10000.0).half()
    qkv = (torch.randn(b, s, 3 * h * d) * 1.5).half()
    return step, [qkv, None, None, mask, lengths]


def context(step, args) -> OpContext:
    return OpContext(name=step.name, op_type=step.op_type, domain=step.domain, opset=step.opset,
                     num_inputs=len(args), num_outputs=1)


def launched(name: str, step, args):
    tactic = registry.get(name)
    assert tactic.check(step, tactic_check.metas(args)) is True
    launch = tactic.prepare(step, [None] * len(args), CPU)
    return launch(context(step, args), *args, **step.attributes)


def test_fp8_tactic_passes_its_check_and_the_exact_tactic_ignores_the_scale():
    step, args = bert_layer()
    op = lookup("Attention", "kiln").fn
    check = fp8_checker(True)(op, context(step, args), args, step.attributes)
    assert check(launched(FP8_TACTIC, step, args)) is None
    tactic_check.run_against_reference(HALF_TACTIC, step, args)  # fp8_scale changes nothing the op computes


def test_the_check_fails_kernels_that_scale_wrong():
    """Per element the bound is the probabilities' rounding of Σ p·|v|: v dequantized 10% too large, or q·k at
    another scale (a sharper softmax), is beyond it."""
    from kiln.kernels.cuda.triton.attention import AttentionConfig, Float8Scales, flash_attention
    from kiln.tactics.cuda.attention import attention_views, output_buffer

    step, args = bert_layer(fp8_scale=0.02)
    check = fp8_checker(True)(lookup("Attention", "kiln").fn, context(step, args), args, step.attributes)
    q, k, v = attention_views(args[0], None, None, step.attributes)
    for scales in (Float8Scales(0.02, 0.02, 0.022), Float8Scales(0.02, 0.024, 0.02)):
        buffer, out = output_buffer(q, v, HEADS_LAST)
        flash_attention(q, k, v, args[3], args[4], scale=step.attributes["scale"], out=out,
                        config=AttentionConfig(64, 32), fp8=scales)
        assert "beyond the FP8 bound" in check(buffer.flatten(-2)), scales
    # and the exact attention, whose q, k, v were not rounded: the check is about E4M3 inputs, not any close result
    assert "beyond the FP8 bound" in check(launched(HALF_TACTIC, step, args))


def test_the_autotuner_keeps_the_fp8_tactic_by_its_own_check(monkeypatch):
    """_tune_layer: both tactics checked (each by its own judge) and timed; nothing rejected."""
    for name in (FP8_TACTIC, HALF_TACTIC):
        monkeypatch.setitem(registry._TACTICS, name, registry.get(name).__class__(
            **{**registry.get(name).__dict__, "device": "cpu"}))
    monkeypatch.setattr(autotune, "measure", lambda fns, device, runs=10, **_: {
        k: 1.0 if k == FP8_TACTIC else 2.0 for k in fns})
    step, args = bert_layer()
    op = lookup("Attention", "kiln").fn
    ctx = context(step, args)
    record = layer_records.Recorded(args, op(ctx, *args, **step.attributes))
    tactics = [registry.get(FP8_TACTIC), registry.get(HALF_TACTIC)]
    found, _ = autotune._tune_layer(step, record, op, ctx, step.attributes, [None] * 5, tactics, CPU, TimingCache(),
                                    {}, runs=1)
    assert found.tactic == FP8_TACTIC, found.candidates
    assert set(found.candidates) >= {FP8_TACTIC, HALF_TACTIC}
    assert not any(isinstance(n, str) and "rejected" in n for n in found.candidates.values()), found.candidates


def test_the_qk_form_rounds_q_and_k_only_and_passes_its_tighter_check():
    """q·kᵀ in E4M3, p·v in fp16: judged with fp16's rounding of the probabilities (2^-10 of Σ p·|v|), which the
    full form's result (v and p in E4M3 too) does not meet."""
    step, args = bert_layer()
    op = lookup("Attention", "kiln").fn
    qk_check = fp8_checker(False)(op, context(step, args), args, step.attributes)
    assert qk_check(launched(QK_TACTIC, step, args)) is None
    assert "beyond the FP8 bound" in qk_check(launched(FP8_TACTIC, step, args))


def test_fp8_tactic_refuses_an_attention_without_a_scale():
    step, args = bert_layer(fp8_scale=None)
    assert "fp8_scale" in tactic_check.reason(FP8_TACTIC, step, args)


def test_e4m3_grid_rounding_saturates_and_is_idempotent():
    x = torch.tensor([0.0, 0.013, -0.2, 1e4, -1e4])
    once = on_e4m3_grid(x, 0.01)
    assert once[3] == 448 * 0.01 and once[4] == -448 * 0.01
    assert torch.equal(on_e4m3_grid(once, 0.01), once)


def test_calibration_finds_each_attention_and_its_shared_scale():
    from kiln import zoo
    from kiln.frontend import onnx as onnx_frontend
    from kiln.passes import PassOptions, optimize
    from kiln.quant import attention

    model = optimize(onnx_frontend.load(str(zoo.export("bert_tiny", batch=2, seq=16, dynamic=True).path)),
                     PassOptions(fusions=False))
    found = attention.find(model.graph)
    assert len(found) == 2  # bert_tiny's two layers
    names = found[0].activations
    scales = attention.scales(found, {names[0]: 4.48, names[1]: 8.96, names[2]: 2.24})
    assert scales == {found[0].name: pytest.approx(0.02)}  # the largest of the three / 448; layer 2 not measured
    consumers = {use.node.op_type for use in found[0].v.uses()}
    assert consumers == {"MatMul"}
