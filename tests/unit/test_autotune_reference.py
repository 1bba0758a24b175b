"""The autotuner judges a half-precision candidate against the fp32 reference (issue 4), not against
another fp16 kernel: the layer's default implementation run in float32 on float32 copies of its inputs."""

import torch

from kiln.builder.layer_records import Recorded, reference_check


def _default(ctx, x, w):
    """A default implementation whose half-precision path is off by 0.5 (an inexact fp16 kernel)."""
    y = x * w
    return y + 0.5 if y.dtype == torch.float16 else y


def test_a_half_layer_is_checked_against_its_fp32_reference():
    x, w = torch.randn(64, dtype=torch.float16), torch.full((64,), 3.0, dtype=torch.float16)
    record = Recorded([x, w], _default(None, x, w))
    check = reference_check(_default, None, record, {})
    exact = (x.float() * w.float()).half()
    assert check(exact) is None  # as close to the exact result as fp16 storage allows
    problem = check(record.output)  # the fp16 default's own output: off by 0.5 from the fp32 reference
    assert problem is not None and "max abs error" in problem


def test_float32_layers_and_half_only_defaults_are_checked_against_the_recorded_output():
    x, w = torch.randn(8), torch.randn(8)
    record = Recorded([x, w], _default(None, x, w))
    assert reference_check(_default, None, record, {})(x * w) is None

    def half_only(ctx, x, w):
        if x.dtype != torch.float16:
            raise TypeError("fp16 only")
        return x * w

    xh, wh = x.half(), w.half()
    record = Recorded([xh, wh], half_only(None, xh, wh))
    check = reference_check(half_only, None, record, {})
    assert check(xh * wh) is None and check(xh * wh + 1) is not None


def test_a_layer_whose_output_dtype_is_an_attribute_is_checked_in_float32():
    """A quantized layer's float output in a half engine (output_dtype 10, kiln/builder/precision.py) writes fp16 from
    float32 inputs too: its fp32 reference and the candidate's result are compared as float32 (on the H200 every
    FP8 GEMM with a float output was rejected for "gave float32, the reference float16" and ran its default)."""
    def attribute_dtype(ctx, x, w, *, output_dtype=1):
        return (x.float() * w.float()).to(torch.float16 if output_dtype == 10 else torch.float32)

    x, w = torch.randn(64, dtype=torch.float16), torch.full((64,), 3.0, dtype=torch.float16)
    record = Recorded([x, w], attribute_dtype(None, x, w, output_dtype=10))
    check = reference_check(attribute_dtype, None, record, {"output_dtype": 10})
    assert check(record.output) is None
    problem = check(record.output + 0.5)
    assert problem is not None and "max abs error" in problem


def test_a_checker_shared_by_tactics_judges_the_layer_once():
    """Tactic.checker is a function of the layer (the op, its inputs, attributes), not of the tactic: the tuner makes
    it once for every candidate that shares it (every CUDA QConv tactic carries the FP8 residual bound, which runs the
    reference twice over the layer's outputs), and still judges each candidate by it: a wrong one is dropped."""
    from kiln.builder.autotune import _tune_layer
    from kiln.builder.timing_cache import TimingCache
    from kiln.plan.spec import StepSpec
    from kiln.tactics.tactic import Tactic

    made = []

    def within_a_tenth(reference, ctx, args, attributes):
        made.append(1)
        want = reference(ctx, *args, **attributes)
        return lambda result: None if float((result - want).abs().max()) <= 0.1 else "more than 0.1 off"

    def tactic(name, offset):
        return Tactic(name=f"cpu.test_shared_checker.{name}", op_type="Mul", domain="", device="cpu",
                      dtypes=(torch.float32,), supports=lambda step, inputs: True, checker=within_a_tenth,
                      prepare=lambda step, constants, device: lambda ctx, x, w, **_: x * w + offset)

    x, w = torch.randn(64), torch.randn(64)
    record = Recorded([x, w], _default(None, x, w))
    step = StepSpec(op_type="Mul", name="mul", inputs=["x", "w"], outputs=["y"], attributes={}, domain="", opset=14)
    found, _ = _tune_layer(step, record, _default, None, {}, [None, None],
                           [tactic("exact", 0.0), tactic("close", 0.05), tactic("wrong", 1.0)],
                           torch.device("cpu"), TimingCache(None), {}, runs=3)
    assert len(made) == 1
    assert {"cpu.test_shared_checker.exact", "cpu.test_shared_checker.close"} <= set(found.candidates)
    assert found.candidates["cpu.test_shared_checker.wrong"] == "rejected: more than 0.1 off"
