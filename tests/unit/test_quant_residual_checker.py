"""The fused residual layer's rule (kiln/tactics/cuda/quant_residual_check.py): a QConv with its residual add fused
is judged by the unfused pair's tolerance. Fake kernel outputs exactly at the bound pass, one step past it fail;
the unfused pair itself (c a step off, then the add's arithmetic) passes; a kernel with a wrong scale fails."""

from __future__ import annotations

import math

import torch

from kiln.ops.quantized import qadd, qconv
from kiln.ops.registry import OpContext
from kiln.tactics import registry
from kiln.tactics.cuda.quant_residual_check import e4m3_at, fp8_bounds, ordinal, residual_layer_checker
from tests.kernels.qlayers import FP8, conv_layer, residual_layer

I8, U8 = torch.int8, torch.uint8


def _checker(layer):
    return residual_layer_checker(qconv, layer.ctx, layer.args, layer.attributes)


def _int8_layer(sum_scale: float = 0.45):
    return residual_layer(conv_layer(I8, I8, activation="", seed=21), I8, I8, seed=22, sum_scale=sum_scale)


def _fp8_layer(sum_scale: float = 0.5):
    conv = conv_layer(FP8, FP8, activation="", seed=23)
    return residual_layer(conv, FP8, FP8, seed=24, sum_scale=sum_scale)


def test_int8_fake_outputs_at_the_bound_pass_one_step_past_fails():
    layer = _int8_layer()
    want = layer.reference()
    steps = math.ceil(float(layer.args[12]) / float(layer.args[6])) + 1
    assert steps == 4  # s_c / s_y = 1 / 0.45: a step of c is 2.2 steps of the sum, the add's rounding one more
    check = _checker(layer)
    free = (want.int() + steps + 1 <= 127) & (want.int() - steps - 1 >= -128)  # not saturated either way
    assert float(free.float().mean()) > 0.5
    for sign in (1, -1):
        at_bound = torch.where(free, want.int() + sign * steps, want.int()).to(I8)
        assert check(at_bound) is None
        past = at_bound.clone()
        past.view(-1)[int(free.view(-1).nonzero()[0])] += sign
        problem = check(past)
        assert problem is not None and f"{steps + 1} steps" in problem and f"tolerance is {steps}" in problem


def test_int8_sum_as_fine_as_c_allows_two_steps():
    layer = _int8_layer(sum_scale=1.7)  # s_c < s_y: ceil(0.59) + 1
    check = _checker(layer)
    want = layer.reference().int()
    assert check(want.clamp(-128, 125).add(2).to(I8)) is None
    assert check(want.clamp(-128, 124).add(3).to(I8)) is not None


def test_fp8_fake_outputs_at_the_bound_pass_one_step_past_fails():
    layer = _fp8_layer()
    low, high, low_value, high_value, want = fp8_bounds(qconv, layer.ctx, layer.args, layer.attributes)
    check = _checker(layer)
    assert want.dtype == FP8 and bool((low <= ordinal(want)).all()) and bool((ordinal(want) <= high).all())
    assert check(want) is None
    assert check(e4m3_at(high).to(FP8)) is None
    assert check(e4m3_at(low).to(FP8)) is None
    # one step past the top: an element where that step is also beyond the value slack (a large, unsaturated output)
    candidates = (high < 124) & (e4m3_at(high + 1) > high_value)
    i = int((e4m3_at(high) * candidates).view(-1).argmax())
    assert bool(candidates.view(-1)[i])
    past = e4m3_at(high).clone()
    past.view(-1)[i] = e4m3_at(high.view(-1)[i] + 1)
    problem = check(past.to(FP8))
    assert problem is not None and "1 outputs beyond" in problem
    # the bound is per element: c's step near a cancellation is many steps of the sum, elsewhere one or two
    width = (high - low).float()
    assert float(width.max()) >= 6 and float(width.median()) <= 4


def test_fp8_the_unfused_pair_with_c_a_step_off_passes_a_wrong_scale_fails():
    layer = _fp8_layer()
    check = _checker(layer)
    x_args, (y_scale, y_zero, bias, res, r_scale, r_zero, c_scale, c_zero) = layer.args[:6], layer.args[6:14]
    conv_alone = {**layer.attributes, "activation": ""}
    c = qconv(layer.ctx, *x_args, c_scale, c_zero, bias, **conv_alone)
    gen = torch.Generator().manual_seed(25)
    nudge = torch.randint(-1, 2, c.shape, generator=gen)  # c one step down, up or as is, everywhere
    c_off = e4m3_at(ordinal(c) + nudge).to(FP8)
    add_ctx = OpContext(name="qadd_0", op_type="QAdd", domain="kiln", opset=1, num_inputs=8, num_outputs=1)
    pair = qadd(add_ctx, c_off, c_scale, c_zero, res, r_scale, r_zero, y_scale, y_zero, activation="Relu")
    assert check(pair) is None
    wrong = qadd(add_ctx, c, c_scale, c_zero, res, r_scale * 1.15, r_zero, y_scale, y_zero, activation="Relu")
    assert check(wrong) is not None


def test_no_residual_leaves_the_builder_s_check_and_every_cuda_qconv_tactic_has_the_rule():
    plain = conv_layer(I8, I8, seed=26)
    assert residual_layer_checker(qconv, plain.ctx, plain.args, plain.attributes) is None
    qconvs = [t for t in registry.all_tactics("cuda").values() if t.op_type == "QConv"]
    assert qconvs and all(t.checker is residual_layer_checker for t in qconvs)


def test_autotune_keeps_the_builder_s_check_where_the_checker_says_none():
    """A QConv tactic on a layer without a residual is judged by the builder's check (one step)."""
    from kiln.builder.layer_records import Recorded, reference_check as builder_checker

    plain = conv_layer(I8, I8, seed=27)
    want = plain.reference()
    check = residual_layer_checker(qconv, plain.ctx, plain.args, plain.attributes) or \
        builder_checker(qconv, plain.ctx, Recorded(plain.args, want), plain.attributes)
    free = want.int() < 126
    assert check(torch.where(free, want.int() + 1, want.int()).to(I8)) is None
    assert check(torch.where(free, want.int() + 2, want.int()).to(I8)) is not None
