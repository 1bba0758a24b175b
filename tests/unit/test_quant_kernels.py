"""kiln's quantized layers (kiln/ops/quantized.py) and their CPU tactics (kiln/tactics/cpu/quantized.py).

The reference implementations against onnx.reference's QLinearConv / QLinearMatMul (exact integer
arithmetic: equal, element for element) and against the contract's formula in numpy (float outputs,
QAdd); the oneDNN int8 tactics and the float-layer tactic against the reference, within the contract's
one quantization step, on fresh random inputs; and the refusals that keep the int8 kernels exact on a
CPU without VNNI (signed sources, weights whose pair sums saturate vpmaddubsw).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from kiln.kernels.cpu import onednn
from kiln.kernels.cpu.cpu_features import has_int8_dot_product
from kiln.kernels.cpu.onednn_int8 import pair_overflow_possible
from kiln.ops.registry import OpContext, lookup
from kiln.plan.spec import StepSpec
from kiln.tactics import registry
from kiln.tactics.tactic import InputMeta

needs_onednn = pytest.mark.skipif(not onednn.available(), reason="libdnnl.so.3 is not loadable here")
T = torch.tensor


def _ctx(op: str, n: int) -> OpContext:
    return OpContext(name=op.lower(), op_type=op, domain="kiln", num_inputs=n, num_outputs=1)


def _conv_case(rng, *, x_dtype=np.uint8, groups=1, stride=1, per_channel=True, wmax=127, y_dtype=np.uint8,
               c=8, o=16, size=9, x_zero=None, bias=True):
    lo, hi = (0, 256) if x_dtype == np.uint8 else (-128, 128)
    if groups > 1:
        c = o = groups
    x = rng.integers(lo, hi, (2, c, size, size)).astype(x_dtype)
    w = rng.integers(-wmax, wmax + 1, (o, c // groups, 3, 3)).astype(np.int8)
    x_scale = np.float32(rng.uniform(0.01, 0.05))
    x_zero = np.array(rng.integers(lo // 2, hi // 2) if x_zero is None else x_zero, x_dtype)
    w_scale = (rng.uniform(0.001, 0.01, o) if per_channel else np.array([rng.uniform(0.001, 0.01)])).astype(np.float32)
    w_zero = np.zeros(w_scale.shape, np.int8)
    b = rng.integers(-3000, 3000, o).astype(np.int32) if bias else None
    y_scale = np.float32(rng.uniform(0.2, 0.6))
    y_zero = np.array(rng.integers(0, 20) if y_dtype == np.uint8 else rng.integers(-20, 20), y_dtype)
    attrs = {"pads": [1, 1, 1, 1], "strides": [stride, stride], "group": groups}
    return [x, x_scale, x_zero, w, w_scale if per_channel else w_scale.reshape(()), w_zero if per_channel
            else w_zero.reshape(()), y_scale, y_zero, b], attrs


def _onnx_reference(op: str, args: list, attrs: dict) -> np.ndarray:
    names = ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"][:len(args)]
    inits = [numpy_helper.from_array(np.asarray(a), n) for n, a in zip(names[1:], args[1:]) if a is not None]
    names = [n if a is not None else "" for n, a in zip(names, args)]
    node = helper.make_node(op, names, ["y"], **attrs)
    x_type = helper.np_dtype_to_tensor_dtype(args[0].dtype)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", x_type, args[0].shape)],
                              [helper.make_tensor_value_info("y", TensorProto.UNDEFINED, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    return ReferenceEvaluator(model).run(None, {"x": args[0]})[0]


def _torch(args: list) -> list:
    return [None if a is None else torch.from_numpy(np.array(a)) for a in args]


@pytest.mark.parametrize("x_dtype, groups, stride, per_channel, y_dtype", [
    (np.uint8, 1, 1, True, np.uint8), (np.int8, 1, 2, False, np.int8), (np.uint8, 4, 1, True, np.int8),
    (np.int8, 16, 2, True, np.uint8)])
def test_qconv_reference_is_qlinearconv(x_dtype, groups, stride, per_channel, y_dtype):
    rng = np.random.default_rng(11 + groups + stride)
    args, attrs = _conv_case(rng, x_dtype=x_dtype, groups=groups, stride=stride, per_channel=per_channel,
                             y_dtype=y_dtype)
    got = lookup("QConv", "kiln").fn(_ctx("QConv", 9), *_torch(args), **attrs).numpy()
    want = _onnx_reference("QLinearConv", args, attrs)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_qgemm_reference_is_qlinearmatmul_with_the_bias_added_before_requantization():
    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, (2, 5, 24)).astype(np.uint8)
    w = rng.integers(-127, 128, (12, 24)).astype(np.int8)  # [N, K]
    xs, xz = np.float32(0.03), np.array(131, np.uint8)
    ws, wz = rng.uniform(0.001, 0.01, 12).astype(np.float32), np.zeros(12, np.int8)
    ys, yz = np.float32(0.9), np.array(-4, np.int8)
    got = lookup("QGemm", "kiln").fn(_ctx("QGemm", 8), *_torch([x, xs, xz, w, ws, wz, ys, yz])).numpy()
    want = _onnx_reference("QLinearMatMul", [x, xs, xz, w.T.copy(), ws, wz, ys, yz], {})
    np.testing.assert_array_equal(got, want)
    # with a bias and a float output: the contract's formula in float64
    b = rng.integers(-500, 500, 12).astype(np.int32)
    got = lookup("QGemm", "kiln").fn(_ctx("QGemm", 9), *_torch([x, xs, xz, w, ws, wz, None, None, b]),
                                     activation="Clip", alpha=-1.0, beta=2.0).numpy()
    acc = (x.astype(np.float64) - 131) @ w.T.astype(np.float64) + b
    want = np.clip(acc * (np.float64(xs) * ws.astype(np.float64)), -1.0, 2.0)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_qadd_reference_is_the_formula_with_relu():
    rng = np.random.default_rng(5)
    a, b = rng.integers(0, 256, (2, 3, 4, 5)).astype(np.uint8), rng.integers(-128, 128, (2, 3, 4, 5)).astype(np.int8)
    sa, za, sb, zb, sy, zy = np.float32(0.02), np.array(100, np.uint8), np.float32(0.05), np.array(3, np.int8), \
        np.float32(0.04), np.array(7, np.uint8)
    got = lookup("QAdd", "kiln").fn(_ctx("QAdd", 8), *_torch([a, sa, za, b, sb, zb, sy, zy]), activation="Relu").numpy()
    r = np.maximum(np.float64(sa) * (a.astype(np.float64) - 100) + np.float64(sb) * (b.astype(np.float64) - 3), 0)
    want = np.clip(np.round((r.astype(np.float32) / sy).astype(np.float64)) + 7, 0, 255).astype(np.uint8)
    assert (np.abs(got.astype(int) - want.astype(int)) <= 1).all() and (got != want).mean() < 1e-2


# ---- the CPU tactics ---------------------------------------------------------------------------

CONSTANT_INPUTS = {"QConv": {1, 2, 3, 4, 5, 6, 7, 8}, "QGemm": {1, 2, 3, 4, 5, 6, 7, 8}, "QAdd": {1, 2, 4, 5, 6, 7}}


def _tactic_output(name: str, op: str, args: list, attrs: dict):
    """The autotuner's path for a candidate: check, configure, prepare on the constants, launch."""
    tactic = registry.get(name)
    step = StepSpec(op_type=op, name=op.lower(), inputs=[f"in{i}" for i in range(len(args))], outputs=["y"],
                    attributes=attrs, domain="kiln")
    metas = [InputMeta.of(a, i in CONSTANT_INPUTS[op]) for i, a in enumerate(args)]
    ok = tactic.check(step, metas)
    if ok is not True:
        return ok
    step = dataclasses.replace(step, tactic=name, tactic_config=tactic.configure(step, metas))
    launch = tactic.prepare(step, [a if i in CONSTANT_INPUTS[op] else None for i, a in enumerate(args)],
                            torch.device("cpu"))
    return launch(_ctx(op, len(args)), *[tactic.to_layout(a) for a in args], **attrs)


def _within_one_step(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.is_floating_point():
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        return
    diff = (got.to(torch.int64) - want.to(torch.int64)).abs()
    assert int(diff.max()) <= 1, int(diff.max())
    # near-ties are rare (a few per 1e5 here): a kernel off at more than a handful of elements is wrong
    assert int((diff > 0).sum()) <= max(2, diff.numel() // 1000), int((diff > 0).sum())


KERNEL_CASES = {
    "plain": dict(), "zero point 0, no bias": dict(x_zero=0, bias=False), "stride 2, int8 out": dict(stride=2,
                                                                                                    y_dtype=np.int8),
    "depthwise": dict(groups=16), "grouped": dict(groups=4), "per tensor": dict(per_channel=False),
    "wide": dict(c=96, o=40, size=7),
}


@needs_onednn
@pytest.mark.parametrize("activation", ["", "Relu", "Clip"])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=list(KERNEL_CASES))
def test_the_int8_convolution_is_the_reference_within_one_step(case, activation):
    rng = np.random.default_rng(len(case) + len(activation))
    args, attrs = _conv_case(rng, wmax=64, **KERNEL_CASES[case])  # 7-bit weights: exact without VNNI
    attrs |= {"activation": activation, "alpha": -0.5 if activation == "Clip" else 0.0, "beta": 3.0}
    targs = _torch(args)
    want = lookup("QConv", "kiln").fn(_ctx("QConv", 9), *targs, **attrs)
    for name in ("cpu.qconv.onednn", "cpu.qconv.dequantized"):
        _within_one_step(_tactic_output(name, "QConv", targs, attrs), want)
    # the float-output form: no y_scale / y_zero_point
    float_args = targs[:6] + [None, None, targs[8]]
    want = lookup("QConv", "kiln").fn(_ctx("QConv", 9), *float_args, **attrs)
    for name in ("cpu.qconv.onednn", "cpu.qconv.dequantized"):
        _within_one_step(_tactic_output(name, "QConv", float_args, attrs), want)


@needs_onednn
@pytest.mark.parametrize("activation", ["Relu", "Gelu"])
@pytest.mark.parametrize("rows, quantized_out", [((3, 40), True), ((2, 7, 40), False), ((1, 40), True)])
def test_the_int8_matmul_is_the_reference_within_one_step(rows, quantized_out, activation):
    rng = np.random.default_rng(sum(rows))
    x = torch.from_numpy(rng.integers(0, 256, rows).astype(np.uint8))
    w = torch.from_numpy(rng.integers(-64, 65, (24, 40)).astype(np.int8))
    args = [x, T(0.02), T(17, dtype=torch.uint8), w, torch.rand(24) * 0.01 + 1e-3, torch.zeros(24, dtype=torch.int8),
            T(0.3) if quantized_out else None, T(9, dtype=torch.uint8) if quantized_out else None,
            torch.from_numpy(rng.integers(-900, 900, 24).astype(np.int32))]
    attrs = {"activation": activation, "alpha": 0.0, "beta": 0.0}
    want = lookup("QGemm", "kiln").fn(_ctx("QGemm", 9), *args, **attrs)
    _within_one_step(_tactic_output("cpu.qgemm.onednn", "QGemm", args, attrs), want)
    _within_one_step(_tactic_output("cpu.qgemm.dequantized", "QGemm", args, attrs), want)


@pytest.mark.parametrize("activation", ["", "Relu", "Clip"])
def test_the_quantized_add_is_the_reference_within_one_step(activation):
    rng = np.random.default_rng(len(activation))
    a = torch.from_numpy(rng.integers(0, 256, (1, 8, 6, 6)).astype(np.uint8)).contiguous(
        memory_format=torch.channels_last)
    b = torch.from_numpy(rng.integers(0, 256, (1, 8, 6, 6)).astype(np.uint8))
    args = [a, T(0.03), T(120, dtype=torch.uint8), b, T(0.02), T(5, dtype=torch.uint8), T(0.05),
            T(0, dtype=torch.uint8)]
    attrs = {"activation": activation, "alpha": 0.3, "beta": 4.1}
    want = lookup("QAdd", "kiln").fn(_ctx("QAdd", 8), *args, **attrs)
    _within_one_step(_tactic_output("cpu.qadd.torch", "QAdd", args, attrs), want)
    if onednn.available():
        _within_one_step(_tactic_output("cpu.qadd.onednn", "QAdd", args, attrs), want)


def test_pair_overflow_is_possible_exactly_past_128():
    w = torch.zeros(2, 10, dtype=torch.int8)
    w[0, :2] = torch.tensor([64, 64])
    assert not pair_overflow_possible(w, torch.uint8)  # 255 * 128 = 32640 fits int16
    w[1, :2] = torch.tensor([-65, -64])
    assert pair_overflow_possible(w, torch.uint8)
    w[1, :2] = torch.tensor([-127, 127])  # opposite signs never add up
    assert not pair_overflow_possible(w, torch.uint8)
    assert pair_overflow_possible(torch.full((4, 4, 3, 3), 127, dtype=torch.int8), torch.uint8)  # dense: pairs
    depthwise = torch.full((4, 1, 3, 3), 127, dtype=torch.int8)
    assert not pair_overflow_possible(depthwise, torch.uint8, groups=4)  # each product widened to int32
    assert pair_overflow_possible(torch.cat([depthwise, depthwise]), torch.uint8, groups=4)  # 2 outputs a group


@needs_onednn
def test_the_int8_convolution_refuses_what_it_would_get_wrong_here():
    rng = np.random.default_rng(2)
    args, attrs = _conv_case(rng, x_dtype=np.int8, wmax=64)
    reason = _tactic_output("cpu.qconv.onednn", "QConv", _torch(args), attrs)
    assert isinstance(reason, str) and "takes uint8" in reason  # signed sources: inexact without VNNI
    args, attrs = _conv_case(rng, wmax=127)
    args[3][0, 0, 0, :2] = 127  # two full-range weights of one sign in one output channel
    if has_int8_dot_product():
        pytest.skip("this CPU multiplies 8-bit pairs into int32 (VNNI/AMX): full-range weights are exact")
    with pytest.raises(ValueError, match="vpmaddubsw would saturate"):
        _tactic_output("cpu.qconv.onednn", "QConv", _torch(args), attrs)
    # the float layer takes them, within a step of the exact integer arithmetic
    targs = _torch(args)
    want = lookup("QConv", "kiln").fn(_ctx("QConv", 9), *targs, **attrs)
    _within_one_step(_tactic_output("cpu.qconv.dequantized", "QConv", targs, attrs), want)


def _worst_pairs_case(magnitude: int, layer: str, groups: int = 1) -> tuple[list, torch.Tensor]:
    """The largest pair sums vpmaddubsw can meet: every source byte 255 (zero point 0), every weight of an output
    channel `magnitude` with one sign (channel 0 +, channel 1 -, the rest random signs); float output. Returns
    the args (QConv 3x3 over [2, 32, 6, 6], of `groups`, or QGemm over [5, 96]) and numpy's exact int64 sums,
    scaled."""
    rng = np.random.default_rng(magnitude)
    o = 16 if groups == 1 else groups
    w = rng.choice(np.array([-magnitude, magnitude]), (o, 32 // groups, 3, 3) if layer == "QConv" else (o, 96))
    w[0], w[1] = magnitude, -magnitude
    x = np.full((2, 32, 6, 6) if layer == "QConv" else (5, 96), 255, np.int64)
    w_scale = rng.uniform(0.001, 0.01, o).astype(np.float32)
    if layer == "QConv":  # 'same' padding: the border sums fewer products
        acc = torch.nn.functional.conv2d(torch.from_numpy(x).double(), torch.from_numpy(w).double(), padding=1,
                                         groups=groups)
        acc = acc * torch.from_numpy(w_scale).double().reshape(1, -1, 1, 1)
    else:
        acc = torch.from_numpy(x).double() @ torch.from_numpy(w).double().T * torch.from_numpy(w_scale).double()
    args = [torch.from_numpy(x.astype(np.uint8)), T(0.02), T(0, dtype=torch.uint8),
            torch.from_numpy(w.astype(np.int8)), torch.from_numpy(w_scale), torch.zeros(o, dtype=torch.int8),
            None, None, None]
    return args, acc * 0.02


@needs_onednn
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layer, groups, magnitude", [("QConv", 1, 64), ("QGemm", 1, 64), ("QConv", 32, 127)])
def test_the_int8_kernels_are_exact_at_the_pair_bound_on_the_largest_sources(layer, groups, magnitude, threads):
    """Weights of 64 (pair sums 255·128 = 32640, the largest that fits int16) on all-255 sources: exact here,
    on vpmaddubsw (no VNNI) as on VNNI; what the refusal past 128 (pair_overflow_possible) relies on. A depthwise
    convolution (32 groups) at full range, 127: its kernel pairs no bytes, and the tactic takes it without VNNI."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        args, want = _worst_pairs_case(magnitude, layer, groups)
        attrs = {"activation": "", "alpha": 0.0, "beta": 0.0, "output_dtype": 1}
        if layer == "QConv":
            attrs |= {"pads": [1, 1, 1, 1], "strides": [1, 1], "group": groups, "kernel_shape": [3, 3]}
        name = "cpu.qconv.onednn" if layer == "QConv" else "cpu.qgemm.onednn"
        got = _tactic_output(name, layer, args, attrs)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
    finally:
        torch.set_num_threads(before)


@needs_onednn
def test_without_int8_dot_products_oneDNN_saturates_past_the_bound():
    """Why the rule exists, and that its bound is tight: on this CPU's vpmaddubsw, weights of 65 on all-255 sources
    (pair sums 255·130 = 33,150) come out wrong from oneDNN's int8 matmul (the kernel made directly, past the
    tactic's refusal); 64 is exact (the test above). Measured on a Zen 3 (AVX2 only): 65 1.2% off, 127 49%."""
    if has_int8_dot_product():
        pytest.skip("this CPU multiplies 8-bit pairs into int32 (VNNI/AMX): no pair sum saturates")
    from kiln.kernels.cpu.onednn_int8 import QMatMul

    args, want = _worst_pairs_case(65, "QGemm")
    matmul = QMatMul(args[3], args[4], None, 5, torch.uint8, 0.02, 0, None)
    got = matmul(args[0]).double()
    assert float((got - want).abs().max()) > 1e-3 * float(want.abs().max())


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_max_pooling_on_8_bit_values_is_the_reference(dtype):
    info = torch.iinfo(dtype)
    x = torch.randint(info.min, info.max + 1, (1, 16, 13, 13), dtype=dtype)
    attrs = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]}
    want = lookup("MaxPool", "").fn(OpContext(name="p", op_type="MaxPool"), x, **attrs)
    tactic = registry.get("cpu.pool.onednn_int8.MaxPool")
    step = StepSpec(op_type="MaxPool", name="p", inputs=["x"], outputs=["y"], attributes=attrs)
    metas = [InputMeta.of(x, False)]
    assert tactic.check(step, metas) is True
    step = dataclasses.replace(step, tactic=tactic.name, tactic_config=tactic.configure(step, metas))
    got = tactic.prepare(step, [None], torch.device("cpu"))(OpContext(name="p", op_type="MaxPool"),
                                                          tactic.to_layout(x), **attrs)
    assert torch.equal(got, want)  # max picks a value: exact


@needs_onednn
@pytest.mark.parametrize("dtype, zero", [(torch.uint8, 128), (torch.uint8, 0), (torch.int8, -3)])
@pytest.mark.parametrize("shape", [(1, 3, 17, 19), (2, 5, 24)])
def test_quantize_and_dequantize_as_one_reorder_are_the_reference(dtype, zero, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape) + zero)) * 5
    x.view(-1)[:8] = (torch.arange(8) - 4 + 0.5) * 0.25  # ties at a scale whose reciprocal is exact
    # oneDNN rounds x·(1/s) + zero point, ONNX round(x/s) + zero point: at an exact tie (odd zero point, or
    # an inexact reciprocal) one step apart; everywhere else the same
    for s in (0.25, 0.037):
        scale, zp = T(s), T(zero, dtype=dtype)
        want = lookup("QuantizeLinear", "").fn(OpContext(name="q", op_type="QuantizeLinear"), x, scale, zp)
        got = _run_plain_tactic("cpu.quantize.onednn", "QuantizeLinear", [x, scale, zp])
        diff = (got.to(torch.int32) - want.to(torch.int32)).abs()
        ties = torch.zeros(shape, dtype=torch.bool)
        ties.view(-1)[:8] = True
        # elsewhere a value within an ulp of a tie (x·(1/s) and x/s differ in the last bit): rare
        assert int(diff.max()) <= 1 and float((diff[~ties] > 0).double().mean()) < 1e-2
        back = lookup("DequantizeLinear", "").fn(OpContext(name="d", op_type="DequantizeLinear"), want, scale, zp)
        torch.testing.assert_close(_run_plain_tactic("cpu.dequantize.onednn", "DequantizeLinear", [want, scale, zp]),
                                   back, rtol=1e-6, atol=1e-6)


def _run_plain_tactic(name: str, op: str, args: list):
    tactic = registry.get(name)
    step = StepSpec(op_type=op, name="q", inputs=["x", "s", "z"], outputs=["y"])
    metas = [InputMeta.of(a, i > 0) for i, a in enumerate(args)]
    assert tactic.check(step, metas) is True
    step = dataclasses.replace(step, tactic=name, tactic_config=tactic.configure(step, metas))
    launch = tactic.prepare(step, [None, *args[1:]], torch.device("cpu"))
    return launch(OpContext(name="q", op_type=op), tactic.to_layout(args[0]), *args[1:])


def _reference_quantize_axis1(x: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """onnx.reference's QuantizeLinear of x along axis 1 (per-channel scale and zero point; the output type is
    the zero point's)."""
    elem = TensorProto.UINT8 if zero.dtype == np.uint8 else TensorProto.INT8
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], axis=1)
    graph = helper.make_graph([node], "q", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", elem, x.shape)],
                              [numpy_helper.from_array(scale, "s"), numpy_helper.from_array(zero, "z")])
    return ReferenceEvaluator(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])).run(
        None, {"x": x})[0]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
@pytest.mark.parametrize("channels_last", [False, True])
def test_per_channel_quantize_tactic_is_onnx_references(dtype, channels_last):
    """cpu.quantize.torch_per_channel (a depthwise input written by a float layer) against onnx.reference's
    QuantizeLinear along axis 1: equal (both divide in float32 and round half to even), saturated at the type's ends."""
    rng = np.random.default_rng(3 + channels_last)
    x = (rng.normal(size=(2, 24, 7, 5)) * rng.uniform(0.1, 30, size=(1, 24, 1, 1))).astype(np.float32)
    scale = rng.uniform(0.01, 0.3, size=24).astype(np.float32)
    info = np.iinfo(np.uint8 if dtype == torch.uint8 else np.int8)
    zero = rng.integers(info.min, info.max // 2 + 1, size=24).astype(info.dtype)
    want = _reference_quantize_axis1(x, scale, zero)
    assert (want == info.min).any() and (want == info.max).any()  # the saturation is exercised
    tensor = torch.from_numpy(x)
    if channels_last:
        tensor = tensor.contiguous(memory_format=torch.channels_last)
    args = [tensor, torch.from_numpy(scale), torch.from_numpy(zero)]
    tactic = registry.get("cpu.quantize.torch_per_channel")
    step = StepSpec(op_type="QuantizeLinear", name="q", inputs=["x", "s", "z"], outputs=["y"],
                    attributes={"axis": 1})
    metas = [InputMeta.of(a, i > 0) for i, a in enumerate(args)]
    assert tactic.check(step, metas) is True
    launch = tactic.prepare(dataclasses.replace(step, tactic=tactic.name), [None, *args[1:]], torch.device("cpu"))
    got = launch(OpContext(name="q", op_type="QuantizeLinear"), *args)
    assert got.dtype == dtype and got.is_contiguous(memory_format=torch.channels_last)  # what QConv reads
    np.testing.assert_array_equal(got.numpy(), want)
    wrong_axis = dataclasses.replace(step, attributes={"axis": 2})
    assert "axis 1 only" in tactic.check(wrong_axis, metas)


@pytest.mark.skipif(not onednn.available(), reason="needs oneDNN")
@pytest.mark.parametrize("dtype,zero_point", [(torch.uint8, 0), (torch.uint8, 7), (torch.int8, -3)])
def test_per_channel_quantize_onednn_is_onnx_references(dtype, zero_point):
    """cpu.quantize.onednn_per_channel (one oneDNN reorder, per-channel scales, one zero point) against onnx.reference's
    QuantizeLinear along axis 1: within one step (oneDNN multiplies by 1/s where ONNX divides: a near-tie may round
    the other way), nearly all equal, saturated alike; a native-segment member. Channels of different zero points
    take the torch ops, exactly ONNX's."""
    rng = np.random.default_rng(11 + zero_point)
    x = (rng.normal(size=(2, 40, 9, 6)) * rng.uniform(0.1, 30, size=(1, 40, 1, 1))).astype(np.float32)
    scale = rng.uniform(0.01, 0.3, size=40).astype(np.float32)
    info = np.iinfo(np.uint8 if dtype == torch.uint8 else np.int8)
    tactic = registry.get("cpu.quantize.onednn_per_channel")
    step = StepSpec(op_type="QuantizeLinear", name="q", inputs=["x", "s", "z"], outputs=["y"], attributes={"axis": 1})
    for zero in (np.full(40, zero_point, dtype=info.dtype),
                 rng.integers(info.min, info.max // 2 + 1, size=40).astype(info.dtype)):
        want = _reference_quantize_axis1(x, scale, zero)
        assert (want == info.min).any() and (want == info.max).any()  # the saturation is exercised
        args = [torch.from_numpy(x), torch.from_numpy(scale), torch.from_numpy(zero)]
        metas = [InputMeta.of(a, i > 0) for i, a in enumerate(args)]
        assert tactic.check(step, metas) is True
        bound = dataclasses.replace(step, tactic=tactic.name, tactic_config=tactic.configure(step, metas))
        launch = tactic.prepare(bound, [None, *args[1:]], torch.device("cpu"))
        got = launch(OpContext(name="q", op_type="QuantizeLinear"), tactic.to_layout(args[0]), *args[1:])
        assert got.dtype == dtype and got.is_contiguous(memory_format=torch.channels_last)  # what QConv reads
        off = np.abs(got.numpy().astype(np.int32) - want.astype(np.int32))
        uniform = bool((zero == zero[0]).all())
        assert off.max() <= (1 if uniform else 0) and (off > 0).mean() < 1e-3
        assert (getattr(launch, "native", None) is not None) == uniform  # a segment member only on oneDNN's path
    assert "4-D" in tactic.check(step, [InputMeta((2, 40), torch.float32, False), *metas[1:]])
