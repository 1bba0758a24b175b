"""cpu.qconv.kiln_i8 (kiln/tactics/cpu/qconv_kiln.py): a 1x1 kiln::QConv as kiln's AVX2 int8 GEMM (i8gemm.c) on its
NHWC rows.

- the layer against kiln's reference QConv (float64 on exact integers) within one quantization step: uint8 and int8
  sources, uint8/int8/float32 outputs, none/Relu/Clip, channel counts off the 4-byte group and the 32-channel panel,
  batches 1 and 2, 1 and 2 threads, weights at the pair bound (|w1| + |w2| = 128);
- what it cannot run is refused with the reason (3x3, stride 2, padding, groups: the layer stays on oneDNN), and a
  weight with an adjacent pair past the bound is refused at prepare (vpmaddubsw would saturate);
- Q/DQ models built by kiln: the 1x1 layers run as cpu.qconv.kiln_i8 inside a native segment (between a stride-2
  padded 3x3 convolution on oneDNN and another 1x1), the output onnxruntime's (ORT_DISABLE_ALL, the same Q/DQ graph)
  within one output step, at 1 and 2 threads; left alone, the tuner times it beside oneDNN's and the float layer.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.kernels.cpu import i8gemm
from kiln.ops.registry import OpContext, lookup
from kiln.plan.spec import StepSpec
from kiln.tactics import registry
from kiln.tactics.tactic import InputMeta
from tests.unit.oracle import case_rng
from tests.unit.test_i8gemm import _pair_bound_weight, _within_one_step

pytestmark = pytest.mark.skipif(not i8gemm.available() or not i8gemm.vector_products(),
                                reason=f"i8gemm with AVX2: {i8gemm.reason() or 'compiled without AVX2'}")
TACTIC = "cpu.qconv.kiln_i8"
CONSTANT = {1, 2, 3, 4, 5, 6, 7, 8}


def _qconv_args(rng, shape, w, quantized_out, dtype=torch.uint8, y_dtype=torch.uint8):
    """x [N, C, H, W] channels-last (both ends of its range), w int8 [O, C, 1, 1]."""
    o = w.shape[0]
    lo, hi = (0, 256) if dtype == torch.uint8 else (-128, 128)
    x = rng.integers(lo, hi, shape)
    x.reshape(-1)[:2] = [lo, hi - 1]
    x = torch.from_numpy(x).to(dtype).contiguous(memory_format=torch.channels_last)
    x_zero = torch.tensor(int(rng.integers(lo, hi)), dtype=dtype)
    y_zero = torch.tensor(int(rng.integers(0, 40) if y_dtype == torch.uint8 else rng.integers(-20, 20)), dtype=y_dtype)
    return [x, torch.tensor(0.02), x_zero, w, torch.from_numpy(rng.uniform(1e-3, 1e-2, o).astype(np.float32)),
            torch.zeros(o, dtype=torch.int8), torch.tensor(0.3) if quantized_out else None,
            y_zero if quantized_out else None, torch.from_numpy(rng.integers(-900, 900, o).astype(np.int32))]


def _ctx() -> OpContext:
    return OpContext(name="qconv", op_type="QConv", domain="kiln", num_inputs=9, num_outputs=1)


def _step(args: list, attrs: dict) -> StepSpec:
    return StepSpec(op_type="QConv", name="qconv", inputs=[f"in{i}" for i in range(len(args))], outputs=["y"],
                    attributes=attrs, domain="kiln")


def _metas(args: list) -> list[InputMeta]:
    return [InputMeta.of(a, i in CONSTANT) for i, a in enumerate(args)]


def _tactic_output(args: list, attrs: dict):
    """The autotuner's path for the candidate: check, configure, prepare on the constants, launch."""
    tactic = registry.get(TACTIC)
    step = _step(args, attrs)
    metas = _metas(args)
    ok = tactic.check(step, metas)
    assert ok is True, ok
    step = dataclasses.replace(step, tactic=TACTIC, tactic_config=tactic.configure(step, metas))
    launch = tactic.prepare(step, [a if i in CONSTANT else None for i, a in enumerate(args)], torch.device("cpu"))
    return launch(_ctx(), *args, **attrs)


CASES = [  # (input [N, C, H, W], O, quantized output, source, output dtype)
    ((1, 16, 12, 12), 96, True, torch.uint8, torch.uint8),  # an expand layer: whole 32-channel panels
    ((2, 96, 7, 5), 24, True, torch.uint8, torch.int8),  # a project layer, batch 2, a channel tail
    ((1, 37, 5, 3), 45, True, torch.uint8, torch.uint8),  # C off the 4-byte group (the padded copy), O off the panel
    ((2, 24, 6, 6), 33, False, torch.uint8, None),  # float32 output
    ((1, 40, 9, 9), 64, True, torch.int8, torch.uint8),  # an int8 source (flipped to uint8 in the copy)
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("activation", ["", "Relu", "Clip"])
@pytest.mark.parametrize("shape, o, quantized_out, dtype, y_dtype", CASES)
def test_the_layer_is_the_reference_within_one_step(shape, o, quantized_out, dtype, y_dtype, activation, threads):
    rng = case_rng(f"qconv {shape} {o} {quantized_out} {dtype} {y_dtype} {activation}")
    w = _pair_bound_weight(rng, o, shape[1]).reshape(o, shape[1], 1, 1)
    args = _qconv_args(rng, shape, w, quantized_out, dtype, y_dtype or torch.uint8)
    attrs = {"activation": activation, "alpha": -0.5 if activation == "Clip" else 0.0, "beta": 2.0}
    want = lookup("QConv", "kiln").fn(_ctx(), *args, **attrs)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _tactic_output(args, attrs)
    finally:
        torch.set_num_threads(before)
    assert got.is_contiguous(memory_format=torch.channels_last)
    _within_one_step(got.contiguous(), want.contiguous())


@pytest.mark.parametrize("attrs, w_shape, expected", [
    ({"pads": [1, 1, 1, 1]}, (8, 16, 3, 3), "kernel [3, 3]"),
    ({"strides": [2, 2]}, (8, 16, 1, 1), "strides [2, 2]"),
    ({"pads": [0, 0, 1, 1]}, (8, 16, 1, 1), "pads [0, 0, 1, 1]"),
    ({"group": 2}, (8, 8, 1, 1), "2 groups"),
])
def test_what_is_not_a_pointwise_gemm_is_refused_with_a_reason(attrs, w_shape, expected):
    rng = case_rng(f"refused {attrs}")
    w = torch.from_numpy(rng.integers(-64, 64, w_shape).astype(np.int8))
    args = _qconv_args(rng, (1, 16, 8, 8), w, True)
    why = registry.get(TACTIC).check(_step(args, attrs), _metas(args))
    assert isinstance(why, str) and expected in why, why


def test_a_pair_past_the_bound_is_refused_at_prepare():
    """(65, 64) on input channels 0, 1 of one output channel: 255·129 > 32767 would saturate vpmaddubsw. The check
    passes (the weight's values are the tuner's to read at prepare), prepare raises: the tuner drops the candidate."""
    rng = case_rng("pair")
    w = torch.from_numpy(rng.integers(-30, 30, (8, 16, 1, 1)).astype(np.int8))
    w[3, 0], w[3, 1] = 65, 64
    args = _qconv_args(rng, (1, 16, 4, 4), w, True)
    with pytest.raises(ValueError, match="saturate"):
        _tactic_output(args, {"activation": ""})


# ---- built engines against onnxruntime ---------------------------------------------------------

def _qdq_layers(rng, shape, layers, out_shape) -> onnx.ModelProto:
    """Q(x) -> each layer (name, weight shape, Conv attributes, Relu after it) with its output Q/DQ'd -> the last DQ:
    each weight int8 per output channel (7-bit: onnxruntime's reduce_range), int32 biases, uint8 activations."""
    inits, nodes, x = [], [helper.make_node("QuantizeLinear", ["x", "s0", "z"], ["q0"]),
                           helper.make_node("DequantizeLinear", ["q0", "s0", "z"], ["d0"])], "d0"
    inits += [numpy_helper.from_array(np.array(0.05, np.float32), "s0"),
              numpy_helper.from_array(np.array(3, np.uint8), "z")]
    for i, (name, w_shape, attrs, relu) in enumerate(layers, start=1):
        w = rng.integers(-63, 64, w_shape).astype(np.int8)
        w_scale = (rng.random(w_shape[0]) * 0.004 + 0.001).astype(np.float32)
        x_scale = np.float32(0.05 if i == 1 else 0.08 + 0.04 * (i - 1))
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(w_scale, f"ws{i}"),
                  numpy_helper.from_array(np.zeros(w_shape[0], np.int8), f"wz{i}"),
                  numpy_helper.from_array(rng.integers(-500, 500, w_shape[0]).astype(np.int32), f"b{i}q"),
                  numpy_helper.from_array(w_scale * x_scale, f"bs{i}"),  # the bias at x_scale·w_scale (ORT's)
                  numpy_helper.from_array(np.zeros(w_shape[0], np.int32), f"bz{i}"),
                  numpy_helper.from_array(np.array(0.08 + 0.04 * i, np.float32), f"s{i}")]
        nodes += [helper.make_node("DequantizeLinear", [f"w{i}", f"ws{i}", f"wz{i}"], [f"wd{i}"], axis=0),
                  helper.make_node("DequantizeLinear", [f"b{i}q", f"bs{i}", f"bz{i}"], [f"bd{i}"], axis=0),
                  helper.make_node("Conv", [x, f"wd{i}", f"bd{i}"], [f"c{i}"], name=name, **attrs)]
        out = f"c{i}"
        if relu:
            nodes.append(helper.make_node("Relu", [out], [f"r{i}"]))
            out = f"r{i}"
        nodes += [helper.make_node("QuantizeLinear", [out, f"s{i}", "z"], [f"q{i}"]),
                  helper.make_node("DequantizeLinear", [f"q{i}", f"s{i}", "z"], [f"d{i}"])]
        x = f"d{i}"
    graph = helper.make_graph(nodes, "qdq_layers", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, out_shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    return model


def _qdq_block(rng, shape, expand: int, project: int) -> onnx.ModelProto:
    """A 3x3 stride-2 padded convolution + Relu, a 1x1 expand + Relu, a 1x1 projection."""
    c, h = shape[1], (shape[2] + 1) // 2
    return _qdq_layers(rng, shape, [("stem", (c, c, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1]), True),
                                    ("expand", (expand, c, 1, 1), {}, True),
                                    ("project", (project, expand, 1, 1), {}, False)], [shape[0], project, h, h])


def _qdq_inverted_residual(rng, shape, expand: int, stride: int) -> onnx.ModelProto:
    """MobileNetV2's block without its residual: 1x1 expand + Relu, 3x3 depthwise (stride, padding 1) + Relu,
    1x1 projection back to the input's channels."""
    c, h = shape[1], (shape[2] - 1) // stride + 1
    return _qdq_layers(rng, shape, [("expand", (expand, c, 1, 1), {}, True),
                                    ("depthwise", (expand, 1, 3, 3), dict(group=expand, strides=[stride, stride],
                                                                          pads=[1, 1, 1, 1]), True),
                                    ("project", (c, expand, 1, 1), {}, False)], [shape[0], c, h, h])


def _onnxruntime(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the Q/DQ ops as written
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape, expand, project", [((1, 16, 15, 15), 96, 24), ((2, 13, 10, 10), 37, 21)])
def test_the_engine_layers_in_a_native_segment_equal_onnxruntime(shape, expand, project, threads):
    """The tactic allowed alone for QConv (the quantize steps keep theirs; the stride-2 3x3, which it refuses, runs as
    the reference op): both 1x1 layers are cpu.qconv.kiln_i8, members of a native segment, and the dequantized output
    is onnxruntime's within one output step, a few elements off by that step (ties of the float32 requantize)."""
    rng = case_rng(f"engine {shape} {expand} {project} {threads}")
    model = _qdq_block(rng, shape, expand, project)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = kiln.build(model, device="cpu", tactics=[TACTIC, "cpu.quantize", "cpu.dequantize"])
        convs = {s.name: s.tactic for s in engine.plan.program.steps if s.op_type == "QConv"}
        assert convs == {"stem": "", "expand": TACTIC, "project": TACTIC}, convs
        members = {m.ctx.name for s in engine.program.segments for m in s.members}
        assert {"expand", "project"} <= members, members
        context = engine.create_execution_context()
        step = 0.08 + 0.04 * 3
        for _ in range(2):
            x = rng.normal(0, 3, shape).astype(np.float32)
            got, want = context.run({"x": x})[engine.plan.program.outputs[0]], _onnxruntime(model, x)
            steps = np.abs(got - want) / step
            assert steps.max() <= 1.0 + 1e-4, steps.max()
            assert (steps > 0.5).sum() <= max(2, steps.size // 500)
    finally:
        torch.set_num_threads(before)


def test_the_tuner_times_it_beside_onednn_and_the_float_layer():
    rng = case_rng("tuner")
    engine = kiln.build(_qdq_block(rng, (1, 16, 15, 15), 96, 24), device="cpu")
    layers = engine.plan.header["tactics"]["layers"]
    assert "1x1 only" in layers["stem"]["candidates"][TACTIC]
    for name in ("expand", "project"):
        tried = layers[name]["candidates"]
        assert isinstance(tried[TACTIC], float), tried[TACTIC]
        assert isinstance(tried["cpu.qconv.onednn"], float) and isinstance(tried["cpu.qconv.dequantized"], float)


# ---- depthwise (cpu.qconv.kiln_dw, qdepthwise.c) -----------------------------------------------

DW = "cpu.qconv.kiln_dw"

DW_CASES = [  # (input [N, C, H, W], kernel, stride, pads [t, l, b, r], source, output dtype)
    ((1, 32, 17, 15), 3, 1, [1, 1, 1, 1], torch.uint8, torch.uint8),  # MobileNetV2's: 15 = 3 blocks of 4 + 3
    ((2, 24, 12, 13), 3, 2, [1, 1, 1, 1], torch.uint8, torch.int8),  # stride 2, batch 2
    ((1, 37, 9, 10), 3, 1, [0, 2, 1, 0], torch.uint8, torch.uint8),  # odd channels (the scalar tail), uneven padding
    ((1, 16, 11, 11), 5, 2, [2, 2, 2, 2], torch.int8, None),  # 5x5, an int8 source, float32 out
    ((1, 48, 7, 7), 3, 1, [1, 1, 1, 1], torch.int8, torch.uint8),  # 7 = 4 + 3
    ((1, 8, 6, 5), 3, 3, [0, 0, 0, 0], torch.uint8, torch.uint8),  # stride 3, no padding: the run-time geometry
    ((1, 64, 40, 40), 3, 1, [1, 1, 1, 1], torch.uint8, torch.uint8),  # large enough for 2 threads
]


def _dw_args(rng, shape, k, quantized_out, dtype, y_dtype, full_range=True, bias_scale=900):
    """x channels-last, weights over the whole int8 range (exact: no byte pairs in this kernel), int32 bias."""
    c = shape[1]
    lo, hi = (-128, 128) if full_range else (-64, 64)
    w = torch.from_numpy(rng.integers(lo, hi, (c, 1, k, k)).astype(np.int8))
    w.view(-1)[:2] = torch.tensor([-128, 127], dtype=torch.int8)
    args = _qconv_args(rng, shape, w, quantized_out, dtype, y_dtype or torch.uint8)
    args[8] = torch.from_numpy(rng.integers(-bias_scale, bias_scale, c).astype(np.int32))
    return args


def _dw_output(args: list, attrs: dict):
    tactic = registry.get(DW)
    step = _step(args, attrs)
    metas = _metas(args)
    ok = tactic.check(step, metas)
    assert ok is True, ok
    step = dataclasses.replace(step, tactic=DW, tactic_config=tactic.configure(step, metas))
    launch = tactic.prepare(step, [a if i in CONSTANT else None for i, a in enumerate(args)], torch.device("cpu"))
    return launch(_ctx(), *args, **attrs)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("activation", ["", "Relu", "Clip"])
@pytest.mark.parametrize("shape, k, stride, pads, dtype, y_dtype", DW_CASES)
def test_the_depthwise_layer_is_the_reference_within_one_step(shape, k, stride, pads, dtype, y_dtype, activation,
                                                              threads):
    """Weights over the whole int8 range, |w1| + |w2| up to 255 (the 1x1 GEMM's gate would refuse them): the float
    sums are exact integers whatever the weights."""
    rng = case_rng(f"dw {shape} {k} {stride} {pads} {dtype} {y_dtype} {activation}")
    args = _dw_args(rng, shape, k, y_dtype is not None, dtype, y_dtype)
    attrs = {"group": shape[1], "strides": [stride, stride], "pads": pads, "activation": activation,
             "alpha": -0.5 if activation == "Clip" else 0.0, "beta": 2.0}
    want = lookup("QConv", "kiln").fn(_ctx(), *args, **attrs)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _dw_output(args, attrs)
    finally:
        torch.set_num_threads(before)
    assert got.is_contiguous(memory_format=torch.channels_last)
    _within_one_step(got.contiguous(), want.contiguous())


@pytest.mark.parametrize("bias_scale", [900, 2**26])
def test_the_depthwise_int32_sums_are_exact(bias_scale):
    """Float32 output at scale 1: r = float32(t) of the int32 sum t = Σ (x − z_x)·w + bias, equal to torch's int64
    convolution rounded once to float32. A bias near 2^26 takes the int32 path (the bias added to the exact float
    sums in int32); a small one starts the sums at it."""
    rng = case_rng(f"dw sums {bias_scale}")
    shape = (2, 40, 9, 11)
    args = _dw_args(rng, shape, 3, False, torch.uint8, None, bias_scale=bias_scale)
    args[1], args[4] = torch.tensor(1.0), torch.ones(shape[1])
    attrs = {"group": shape[1], "strides": [2, 2], "pads": [1, 1, 1, 1], "activation": ""}
    got = _dw_output(args, attrs)
    x = args[0].to(torch.int64) - int(args[2])
    want = torch.nn.functional.conv2d(x, args[3].to(torch.int64), args[8].to(torch.int64), stride=2, padding=1,
                                      groups=shape[1])
    torch.testing.assert_close(got, want.to(torch.float32), rtol=0, atol=0)


@pytest.mark.parametrize("attrs, w_shape, expected", [
    ({"group": 16, "dilations": [2, 2]}, (16, 1, 3, 3), "dilations"),
    ({"group": 16, "pads": [4, 4, 4, 4]}, (16, 1, 9, 9), "1 to 8 taps"),
    ({"group": 8}, (16, 2, 3, 3), "not depthwise"),
    ({"group": 16, "activation": "LeakyRelu"}, (16, 1, 3, 3), "LeakyRelu"),
])
def test_what_the_depthwise_kernel_cannot_run_is_refused_with_a_reason(attrs, w_shape, expected):
    rng = case_rng(f"dw refused {attrs}")
    w = torch.from_numpy(rng.integers(-64, 64, w_shape).astype(np.int8))
    args = _qconv_args(rng, (1, 16, 12, 12), w, True)
    why = registry.get(DW).check(_step(args, attrs), _metas(args))
    assert isinstance(why, str) and expected in why, why


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape, expand, stride", [((1, 16, 14, 14), 96, 2), ((2, 24, 9, 9), 72, 1)])
def test_an_inverted_residual_block_runs_in_one_segment_equal_to_onnxruntime(shape, expand, stride, threads):
    """kiln's two int8 kernels allowed alone for QConv: the expand and projection run as cpu.qconv.kiln_i8, the
    depthwise layer (stride 1 and 2, padding) as cpu.qconv.kiln_dw, all three members of one native segment; the
    output is onnxruntime's within one output step."""
    rng = case_rng(f"block {shape} {expand} {stride} {threads}")
    model = _qdq_inverted_residual(rng, shape, expand, stride)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = kiln.build(model, device="cpu", tactics=[TACTIC, DW, "cpu.quantize", "cpu.dequantize"])
        convs = {s.name: s.tactic for s in engine.plan.program.steps if s.op_type == "QConv"}
        assert convs == {"expand": TACTIC, "depthwise": DW, "project": TACTIC}, convs
        record = engine.plan.header["quantization"]["layers"]  # what `kiln inspect` says: int8 kernels, not "fp32"
        assert {name: record[name]["precision"] for name in convs} == dict.fromkeys(convs, "int8"), record
        segments = [{m.ctx.name for m in s.members} for s in engine.program.segments]
        assert any({"expand", "depthwise", "project"} <= members for members in segments), segments
        context = engine.create_execution_context()
        step = 0.08 + 0.04 * 3
        for _ in range(2):
            x = rng.normal(0, 3, shape).astype(np.float32)
            got, want = context.run({"x": x})[engine.plan.program.outputs[0]], _onnxruntime(model, x)
            steps = np.abs(got - want) / step
            assert steps.max() <= 1.0 + 1e-4, steps.max()
            assert (steps > 0.5).sum() <= max(2, steps.size // 500)
    finally:
        torch.set_num_threads(before)


def test_the_tuner_times_the_depthwise_kernel_beside_onednn_and_the_float_layer():
    engine = kiln.build(_qdq_inverted_residual(case_rng("dw tuner"), (1, 16, 14, 14), 96, 1), device="cpu")
    layers = engine.plan.header["tactics"]["layers"]
    tried = layers["depthwise"]["candidates"]
    assert isinstance(tried[DW], float), tried[DW]
    assert isinstance(tried["cpu.qconv.onednn"], float) and isinstance(tried["cpu.qconv.dequantized"], float)
    assert "not depthwise" in layers["expand"]["candidates"][DW]


def test_an_engine_of_dynamic_batch_runs_every_size_of_its_profile():
    """[batch, 24, 9, 9] through a profile: the segment binds both kernels at each batch it meets (built on first use,
    the 1x1 layers on the packed weight they share), each run equal to onnxruntime's within one output step."""
    rng = case_rng("dynamic batch")
    model = _qdq_inverted_residual(rng, ["batch", 24, 9, 9], 72, 2)
    engine = kiln.build(model, device="cpu", tactics=[TACTIC, DW, "cpu.quantize", "cpu.dequantize"],
                        profiles=[{"x": "1x24x9x9,2x24x9x9,3x24x9x9"}])
    convs = {s.name: s.tactic for s in engine.plan.program.steps if s.op_type == "QConv"}
    assert convs == {"expand": TACTIC, "depthwise": DW, "project": TACTIC}, convs
    context = engine.create_execution_context()
    for batch in (2, 1, 3, 2):
        x = rng.normal(0, 3, (batch, 24, 9, 9)).astype(np.float32)
        got, want = context.run({"x": x})[engine.plan.program.outputs[0]], _onnxruntime(model, x)
        assert got.shape == (batch, 24, 5, 5)
        steps = np.abs(got - want) / (0.08 + 0.04 * 3)
        assert steps.max() <= 1.0 + 1e-4, (batch, steps.max())
        assert (steps > 0.5).sum() <= max(2, steps.size // 500)


_PLAIN_DEPTHWISE = """
import json, numpy as np, torch
from kiln.kernels.cpu import native_loop
native_loop.compile_flags = lambda: (("-O2", "-fopenmp"),)
from kiln.kernels.cpu import qdepthwise
rng = np.random.default_rng(7)
out = []
for n, c, h, s, dtype, zero in [(1, 20, 9, 2, torch.uint8, 3), (2, 16, 7, 1, torch.int8, -5)]:
    lo, hi = (0, 256) if dtype == torch.uint8 else (-128, 128)
    x = torch.from_numpy(rng.integers(lo, hi, (n, c, h, h))).to(dtype).contiguous(memory_format=torch.channels_last)
    w = torch.from_numpy(rng.integers(-128, 128, (c, 1, 3, 3)).astype(np.int8))
    b = torch.from_numpy(rng.integers(-900, 900, c).astype(np.int32))
    layer = qdepthwise.QDepthwiseConv(w, torch.ones(c), b, (n, c, h, h), [s, s], [1, 1, 1, 1], dtype, 1.0, zero, None)
    want = torch.nn.functional.conv2d(x.to(torch.int64) - zero, w.to(torch.int64), b.to(torch.int64), stride=s,
                                      padding=1, groups=c)
    out.append(bool((layer(x) == want.to(torch.float32)).all()))
print(json.dumps({"lanes": qdepthwise.lanes(), "exact": out}))
"""


@pytest.mark.slow
def test_the_plain_c_depthwise_gives_the_same_sums(tmp_path):
    """qdepthwise.c compiled without -march (no AVX2: its scalar loops) in a subprocess with its own cache: the int32
    sums (float32 output at scale 1) equal torch's int64 convolution."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), KILN_CACHE=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", _PLAIN_DEPTHWISE], env=env, capture_output=True, text=True,
                          timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"lanes": 1, "exact": [True, True]}
