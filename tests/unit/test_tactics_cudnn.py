"""cuDNN conv and GEMM tactics without a GPU: the graph each layer becomes, the supports() reasons, configure,
fallbacks. The norm tactics (LayerNorm, RMSNorm) are tests/unit/test_tactics_cudnn_norm.py, which shares this
file's node-list evaluator (evaluate_all, RecordingGraph).

The graph description (kiln/kernels/cuda/cudnn_graph.py: describe_conv / describe_gemm) is pure data, checked here
against torch as the oracle for shapes and memory layout (conv output sizes, channels-last strides, the strides
that read wᵀ out of an [N, K] weight). What only a GPU can show — that cuDNN builds and runs these graphs, and
their numbers — is tests/gpu/test_cudnn_conv.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from kiln.kernels.cuda import cudnn_graph
from kiln.kernels.cuda.cudnn_graph import (activation_refusal, describe_conv, describe_gemm, fused_graph,
                                           CudnnGraphError)
from kiln.ops.fused import fused_conv, fused_gemm
from kiln.plan.spec import StepSpec
from kiln.tactics.cuda import cudnn as tactics
from kiln.tactics import registry
from kiln.tactics.tactic import InputMeta

FP16, BF16 = torch.float16, torch.bfloat16


def conv_step(n_inputs: int = 3, **attributes) -> StepSpec:
    return StepSpec(op_type="FusedConv", name="conv_0", inputs=[f"in{i}" for i in range(n_inputs)],
                    outputs=["out0"], attributes=attributes, domain="kiln")


def gemm_step(n_inputs: int = 3, **attributes) -> StepSpec:
    return StepSpec(op_type="FusedGemm", name="gemm_0", inputs=[f"in{i}" for i in range(n_inputs)],
                    outputs=["out0"], attributes=attributes, domain="kiln")


def meta(shape, dtype=FP16, constant=False) -> InputMeta:
    return InputMeta(tuple(shape), dtype, constant)


def conv_inputs(x, w, bias=True, residual=None, dtype=FP16) -> list[InputMeta]:
    found = [meta(x, dtype), meta(w, dtype, constant=True)]
    if bias or residual is not None:
        found.append(meta((w[0],), dtype, constant=True) if bias else InputMeta(None, None, False))
    if residual is not None:
        found.append(meta(residual, dtype))
    return found


def reference_conv_shape(step: StepSpec, x, w) -> tuple[int, ...]:
    """The registered FusedConv's output shape (torch's conv on meta tensors): the oracle for output dims."""
    attrs = {k: v for k, v in step.attributes.items() if k in ("auto_pad", "dilations", "group", "kernel_shape",
                                                                "pads", "strides")}
    return tuple(fused_conv(None, torch.empty(x, device="meta"), torch.empty(w, device="meta"), **attrs).shape)


def channels_last_strides(shape) -> tuple[int, ...]:
    return tuple(torch.empty(shape, device="meta").contiguous(memory_format=torch.channels_last).stride())


def addresses_like_channels_last(desc) -> bool:
    """desc's strides address memory as torch's channels_last tensor of its dims (size-1 dims address nothing)."""
    torch_strides = channels_last_strides(desc.dims)
    return all(size == 1 or a == b for size, a, b in zip(desc.dims, desc.strides, torch_strides))


# ---- the graph description -----------------------------------------------------------------------

def test_resnet_bottleneck_end_is_conv_bias_add_relu_on_nhwc_tensors():
    """ResNet's last 1x1 conv of a block: act(conv + b + residual), every tensor channels-last."""
    step = conv_step(4, kernel_shape=[1, 1], activation="Relu")
    x, w = (256, 64, 56, 56), (256, 64, 1, 1)
    pattern = tactics.conv_pattern(step, x, w, bias=True, residual=True, dtype=FP16)
    assert pattern.dtype == "float16"
    assert pattern.node_ops() == ["conv_fprop", "bias", "add", "relu"]
    assert [t.name for t in pattern.inputs] == ["x", "w", "b", "residual"]
    by_name = {t.name: t for t in pattern.inputs}
    y = reference_conv_shape(step, x, w)
    assert pattern.output.dims == y == (256, 256, 56, 56)
    assert by_name["x"].strides == channels_last_strides(x)
    assert addresses_like_channels_last(by_name["w"])  # KRSC: what w.contiguous(channels_last) stores
    assert by_name["residual"].dims == y and by_name["residual"].strides == channels_last_strides(y)
    assert pattern.output.strides == channels_last_strides(y)
    stem = tactics.conv_pattern(conv_step(2, kernel_shape=[7, 7]), (2, 3, 32, 32), (64, 3, 7, 7), False, False, FP16)
    assert stem.inputs[1].strides == channels_last_strides((64, 3, 7, 7))
    assert by_name["b"].dims == (1, 256, 1, 1)
    # The nodes are wired in a chain that ends in y: conv -> +b -> +residual -> relu.
    conv, bias, add, relu = pattern.nodes
    assert conv.inputs == ("x", "w") and bias.inputs == (conv.output, "b")
    assert add.inputs == (bias.output, "residual") and relu.inputs == (add.output,) and relu.output == "y"


def test_residual_after_activation_adds_last_and_silu_is_swish_with_beta_1():
    step = conv_step(4, kernel_shape=[1, 1], activation="SiLU", residual_after_activation=1)
    pattern = tactics.conv_pattern(step, (8, 32, 14, 14), (32, 32, 1, 1), bias=True, residual=True, dtype=BF16)
    assert pattern.dtype == "bfloat16"
    assert pattern.node_ops() == ["conv_fprop", "bias", "swish", "add"]
    assert dict(pattern.nodes[2].params) == {"swish_beta": 1.0}
    assert pattern.nodes[-1].inputs == (pattern.nodes[2].output, "residual") and pattern.nodes[-1].output == "y"


def test_a_plain_convolution_is_one_node_whose_output_is_y():
    pattern = tactics.conv_pattern(conv_step(2), (1, 16, 9, 9), (8, 16, 3, 3), bias=False, residual=False,
                                   dtype=FP16)
    assert pattern.node_ops() == ["conv_fprop"]
    assert pattern.nodes[0].output == "y" and [t.name for t in pattern.inputs] == ["x", "w"]
    assert pattern.output.dims == (1, 8, 7, 7)


@pytest.mark.parametrize("attributes, x, w", [
    ({"kernel_shape": [7, 7], "pads": [3, 3, 3, 3], "strides": [2, 2]}, (4, 3, 224, 224), (64, 3, 7, 7)),
    ({"pads": [0, 1, 1, 0], "strides": [2, 2]}, (2, 16, 15, 16), (8, 16, 3, 3)),
    ({"auto_pad": "SAME_UPPER", "strides": [2, 2]}, (2, 16, 15, 16), (8, 16, 3, 3)),
    ({"auto_pad": "SAME_LOWER", "strides": [1, 3]}, (1, 8, 10, 11), (8, 8, 4, 2)),
    ({"auto_pad": "VALID", "strides": [2, 1]}, (1, 8, 10, 11), (8, 8, 3, 3)),
])
def test_padding_and_strides_give_the_reference_output_shape(attributes, x, w):
    step = conv_step(3, **attributes)
    pattern = tactics.conv_pattern(step, x, w, bias=True, residual=False, dtype=FP16)
    assert pattern.output.dims == reference_conv_shape(step, x, w)
    conv = dict(pattern.nodes[0].params)
    pads, strides, _dilations = tactics.conv_geometry(step, x, w)
    assert conv["pre_padding"] == tuple(pads[:2]) and conv["post_padding"] == tuple(pads[2:])
    assert conv["stride"] == tuple(attributes.get("strides", [1, 1])) and conv["dilation"] == (1, 1)
    if attributes.get("auto_pad") == "SAME_UPPER":
        assert pads[2:] >= pads[:2] and pads != [0, 0, 0, 0]  # the odd pad goes at the end


def test_gemm_weight_strides_read_the_transpose_of_the_stored_weight():
    """kiln stores W as [N, K]; the graph's B operand is Wᵀ [1, K, N] through strides, with no copy."""
    rows, k, n = 6, 5, 7
    pattern = describe_gemm(rows, k, n, bias=True, residual=True, activation="Gelu", alpha=0.0, beta=0.0,
                            residual_after_activation=True, dtype="float16")
    assert pattern.node_ops() == ["matmul", "bias", "gelu", "add"]
    x, w, b, r = pattern.inputs
    weight = torch.randn(n, k)
    as_described = weight.as_strided(w.dims, w.strides)
    assert torch.equal(as_described[0], weight.t())
    # The tactic binds w.unsqueeze(0).transpose(1, 2): the same dims and strides.
    bound = weight.unsqueeze(0).transpose(1, 2)
    assert tuple(bound.shape) == w.dims and tuple(bound.stride()) == w.strides
    rows_major = torch.randn(rows, k)
    assert torch.equal(rows_major.as_strided(x.dims, x.strides)[0], rows_major)
    assert b.dims == (1, 1, n) and r.dims == pattern.output.dims == (1, rows, n)


def test_activation_table_and_what_it_refuses():
    assert activation_refusal("", 0.0, 0.0) is None
    for name in ("Relu", "Clip", "LeakyRelu", "Sigmoid", "SiLU", "Tanh", "Gelu", "GeluTanh"):
        assert activation_refusal(name, 0.0, 6.0) is None, name
    assert "HardSwish" in activation_refusal("HardSwish", 0.0, 0.0)
    assert "HardSigmoid" in activation_refusal("HardSigmoid", 0.2, 0.5)
    assert "finite lower bound" in activation_refusal("Clip", -math.inf, 6.0)
    relu6 = describe_conv((1, 8, 4, 4), (8, 8, 1, 1), pads=(0, 0, 0, 0), strides=(1, 1), dilations=(1, 1),
                          bias=False, residual=False, activation="Clip", alpha=0.0, beta=6.0,
                          residual_after_activation=False, dtype="float16")
    assert relu6.nodes[-1].op == "relu" and dict(relu6.nodes[-1].params) == {"lower_clip": 0.0, "upper_clip": 6.0}
    unbounded_above = describe_conv((1, 8, 4, 4), (8, 8, 1, 1), pads=(0, 0, 0, 0), strides=(1, 1),
                                    dilations=(1, 1), bias=False, residual=False, activation="Clip", alpha=-1.0,
                                    beta=math.inf, residual_after_activation=False, dtype="float16")
    assert dict(unbounded_above.nodes[-1].params) == {"lower_clip": -1.0}
    leaky = describe_gemm(4, 8, 8, bias=False, residual=False, activation="LeakyRelu", alpha=0.1, beta=0.0,
                          residual_after_activation=True, dtype="float16")
    assert leaky.nodes[-1].op == "leaky_relu" and dict(leaky.nodes[-1].params) == {"negative_slope": 0.1}
    with pytest.raises(ValueError, match="HardSwish"):
        describe_gemm(4, 8, 8, bias=False, residual=False, activation="HardSwish", alpha=0.0, beta=0.0,
                      residual_after_activation=True, dtype="float16")


def test_patterns_are_hashable_and_equal_for_equal_layers():
    """Built graphs are cached per pattern: two layers of one shape must describe the same graph."""
    step = conv_step(3, kernel_shape=[3, 3], pads=[1, 1, 1, 1], activation="Relu")
    a = tactics.conv_pattern(step, (8, 64, 56, 56), (64, 64, 3, 3), True, False, FP16)
    b = tactics.conv_pattern(dataclasses.replace(step, name="conv_9"), (8, 64, 56, 56), (64, 64, 3, 3), True, False,
                             FP16)
    c = tactics.conv_pattern(step, (16, 64, 56, 56), (64, 64, 3, 3), True, False, FP16)
    assert a == b and hash(a) == hash(b) and a != c


# ---- supports / configure -----------------------------------------------------------------------

def test_static_supports_accepts_resnet_layers():
    step = conv_step(4, kernel_shape=[1, 1], activation="Relu")
    assert tactics.conv_static_supports(step, conv_inputs((32, 64, 56, 56), (256, 64, 1, 1),
                                                          residual=(32, 256, 56, 56))) is True
    stem = conv_step(3, kernel_shape=[7, 7], pads=[3, 3, 3, 3], strides=[2, 2], activation="Relu")
    assert tactics.conv_static_supports(stem, conv_inputs((1, 3, 224, 224), (64, 3, 7, 7), dtype=BF16)) is True


@pytest.mark.parametrize("step, inputs, reason", [
    (conv_step(3, group=32, kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
     conv_inputs((8, 32, 28, 28), (32, 1, 3, 3)), "group=32"),
    (conv_step(3, dilations=[2, 2], kernel_shape=[3, 3], pads=[2, 2, 2, 2]),
     conv_inputs((8, 32, 28, 28), (32, 32, 3, 3)), "dilations"),
    (conv_step(3, activation="HardSwish"), conv_inputs((8, 32, 28, 28), (32, 32, 1, 1)), "HardSwish"),
    (conv_step(3, activation="Clip", alpha=-math.inf, beta=6.0), conv_inputs((8, 32, 28, 28), (32, 32, 1, 1)),
     "finite lower bound"),
    (conv_step(4), conv_inputs((8, 32, 28, 28), (32, 32, 1, 1), residual=(1, 32, 1, 1)), "no broadcast"),
    (conv_step(3), [meta((8, 32, 28, 28)), meta((32, 32, 1, 1), constant=False), meta((32,))], "constant"),
    (conv_step(3), [meta((8, 32, 28, 28)), meta((32, 32, 1, 1), BF16, constant=True), meta((32,))], "one float16"),
    (conv_step(3), [meta((8, 32, 28)), meta((32, 32, 1), constant=True), meta((32,))], "2-D"),
    (conv_step(3), conv_inputs((8, 32, 28, 28), (16, 32, 1, 1)) [:2] + [meta((32,), constant=True)],
     "per output channel"),
])
def test_static_supports_says_why_not(step, inputs, reason):
    found = tactics.conv_static_supports(step, inputs)
    assert isinstance(found, str) and reason in found, found


def test_gemm_static_supports():
    ok = [meta((8, 128, 768)), meta((3072, 768), constant=True), meta((3072,), constant=True)]
    assert tactics.gemm_static_supports(gemm_step(3, activation="Gelu"), ok) is True
    assert "SwiGLU" in tactics.gemm_static_supports(gemm_step(3, activation="SwiGLU"), ok)
    bad_w = [meta((8, 128, 768)), meta((3072, 512), constant=True)]
    assert "[N, K=768]" in tactics.gemm_static_supports(gemm_step(2), bad_w)
    broadcast = ok + [meta((1, 1, 3072))]
    assert "no broadcast" in tactics.gemm_static_supports(gemm_step(4), broadcast)


def test_configure_records_the_shapes_the_graph_is_built_for():
    inputs = conv_inputs((32, 64, 56, 56), (256, 64, 1, 1), residual=(32, 256, 56, 56))
    assert tactics._conv_configure(conv_step(4), inputs) == {"input_size": [32, 64, 56, 56], "bias": True,
                                                            "residual": True}
    no_bias = conv_inputs((32, 64, 56, 56), (256, 64, 1, 1), bias=False, residual=(32, 256, 56, 56))
    assert tactics._conv_configure(conv_step(4), no_bias)["bias"] is False
    gemm = [meta((8, 128, 768)), meta((3072, 768), constant=True)]
    assert tactics._gemm_configure(gemm_step(2), gemm) == {"rows": 1024, "bias": False, "residual": False}


def test_not_available_without_cuda_and_the_reason_is_given():
    for name in ("cuda.conv.cudnn_fused", "cuda.gemm.cudnn_fused"):
        tactic = registry.get(name)
        assert tactic is not None, f"{name} is not registered"
        assert tactic in registry.candidates(tactic.op_type, "kiln", "cuda", opt_level=3)
        if torch.cuda.is_available():
            continue
        assert tactic.available() is False
        inputs = conv_inputs((8, 32, 28, 28), (32, 32, 1, 1))
        assert "not available" in tactic.check(conv_step(3), inputs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_a_declined_shape_runs_the_default_implementation_with_a_warning():
    """No GPU here, so cuDNN cannot build anything: the launch-time fallback path is the one taken."""
    step = conv_step(3, kernel_shape=[1, 1])
    calls = []
    graphs = tactics._ShapeGraphs("conv_0", lambda shape: tactics.conv_pattern(step, shape, (8, 4, 1, 1), True,
                                                                               False, FP16),
                                  lambda *args: calls.append(args))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = graphs.get((2, 4, 5, 5), torch.device("cuda", 0))
        again = graphs.get((2, 4, 5, 5), torch.device("cuda", 0))
    assert first is graphs.default and again is graphs.default
    assert len(caught) == 1 and "conv_0" in str(caught[0].message)  # once per shape, naming the layer
    with pytest.raises(CudnnGraphError, match="conv_fprop -> bias"):
        fused_graph(graphs.pattern_for((2, 4, 5, 5)), torch.device("cuda", 0))


def test_bound_tensors_are_checked_against_the_description():
    desc = cudnn_graph.TensorDesc("x", (2, 8, 1, 1), channels_last_strides((2, 8, 1, 1)))
    assert cudnn_graph._matches(torch.empty(2, 8, 1, 1), desc)  # size-1 dims address nothing: NCHW == NHWC here
    desc = cudnn_graph.TensorDesc("x", (2, 8, 3, 3), channels_last_strides((2, 8, 3, 3)))
    assert cudnn_graph._matches(torch.empty(2, 8, 3, 3).contiguous(memory_format=torch.channels_last), desc)
    assert not cudnn_graph._matches(torch.empty(2, 8, 3, 3), desc)
    assert not cudnn_graph._matches(torch.empty(2, 8, 3, 4), desc)


# ---- the pattern as cudnn.pygraph calls (needs the package, not a GPU) -----------------------------

@pytest.mark.skipif(importlib.util.find_spec("cudnn") is None, reason="nvidia-cudnn-frontend is not installed")
def test_the_pattern_becomes_the_same_pygraph_nodes():
    """cudnn's pygraph holds the graph in Python until validate(): the calls we make are checked here."""
    import cudnn

    step = conv_step(4, kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2], activation="Clip", alpha=0.0,
                     beta=6.0, residual_after_activation=1)
    pattern = tactics.conv_pattern(step, (4, 16, 9, 9), (32, 16, 3, 3), True, True, FP16)
    graph, tensors = cudnn_graph.to_pygraph(cudnn, pattern, None)
    nodes = graph.nodes
    assert [n.name for n in nodes] == [n.output for n in pattern.nodes]
    assert str(nodes[0].node_type).endswith("CONV_FPROP")
    assert nodes[0].params == {"pre_padding": [1, 1], "post_padding": [1, 1], "stride": [2, 2], "dilation": [1, 1]}
    assert [n.params.get("mode") for n in nodes[1:]] == ["bias", "relu", "add"]
    assert nodes[2].params["lower_clip"] == 0.0 and nodes[2].params["upper_clip"] == 6.0
    y = tensors["y"]
    assert list(y.dim) == list(pattern.output.dims) and list(y.stride) == list(pattern.output.strides)
    assert not y.is_virtual and y.data_type == cudnn.data_type.HALF
    for desc in pattern.inputs:
        t = tensors[desc.name]
        assert list(t.dim) == list(desc.dims) and list(t.stride) == list(desc.strides), desc.name
    assert all(out.is_virtual for n in nodes[:-1] for out in n.outputs.values())


# ---- the node list's meaning, and what a launch binds ---------------------------------------------
# cuDNN itself runs only on the GPU (tests/gpu/test_cudnn_conv.py). Here the node list is evaluated op by op with
# torch, following cuDNN's documented semantics of each node, and compared with the registered FusedConv /
# FusedGemm: this checks the *description* (order of bias / residual / activation, pads, the wᵀ strides) and what
# the tactic's launch binds to each graph input, not cuDNN.

def evaluate_all(pattern, bound: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every value of the pattern's node list in fp32 torch, by name.

    conv_fprop pads pre/post; RELU_FWD clamps at [lower, upper]; layernorm / rmsnorm normalise each [H, 1, 1]
    row of their [rows, H, 1, 1] input over every dim after the first (cuDNN's norm nodes), with the biased
    variance; in training phase they also give the statistics, mean and 1/sqrt(var + eps)."""
    values = {name: t.float() for name, t in bound.items()}
    values.update({name: torch.tensor(v) for name, v in pattern.scalars})
    for node in pattern.nodes:
        p, a = dict(node.params), [values[i] if i else None for i in node.inputs]
        more = []
        if node.op == "conv_fprop":
            (top, left), (bottom, right) = p["pre_padding"], p["post_padding"]
            y = F.conv2d(F.pad(a[0], [left, right, top, bottom]), a[1], stride=p["stride"], dilation=p["dilation"])
        elif node.op == "matmul":
            y = a[0] @ a[1]
        elif node.op in ("bias", "add"):
            y = a[0] + a[1]
        elif node.op in ("layernorm", "rmsnorm"):
            v, scale, bias, eps = a
            dims = tuple(range(1, v.dim()))
            mean = v.mean(dims, keepdim=True) if node.op == "layernorm" else torch.zeros(())
            inv = torch.rsqrt((v - mean).pow(2).mean(dims, keepdim=True) + eps)
            y = (v - mean) * inv * scale + (bias if bias is not None else 0.0)
            if p["norm_forward_phase"] == "TRAINING":
                more = [mean, inv] if node.op == "layernorm" else [inv]
        elif node.op == "relu":
            y = a[0].clamp(min=p.get("lower_clip", 0.0), max=p.get("upper_clip", math.inf))
        elif node.op == "leaky_relu":
            y = torch.where(a[0] >= 0, a[0], p["negative_slope"] * a[0])
        elif node.op == "swish":
            y = a[0] * torch.sigmoid(p["swish_beta"] * a[0])
        else:
            y = {"sigmoid": torch.sigmoid, "tanh": torch.tanh, "gelu": F.gelu,
                 "gelu_approx_tanh": lambda v: F.gelu(v, approximate="tanh")}[node.op](a[0])
        values[node.output] = y
        assert len(more) == len(node.more_outputs), (node.op, node.more_outputs)
        values.update(zip(node.more_outputs, more))
    return values


def evaluate(pattern, bound: dict[str, torch.Tensor]) -> torch.Tensor:
    """The pattern's output, y (see evaluate_all)."""
    return evaluate_all(pattern, bound)[pattern.output.name]


class RecordingGraph:
    """Stands in for a built cuDNN graph in the launch tests: checks every bound tensor against its TensorDesc,
    then evaluates the node list (see evaluate_all) and returns what CudnnFusedGraph would: y, or (y, *more)."""

    def __init__(self, pattern):
        self.pattern, self.calls = pattern, 0

    def __call__(self, *inputs):
        self.calls += 1
        assert len(inputs) == len(self.pattern.inputs)
        for desc, value in zip(self.pattern.inputs, inputs):
            assert cudnn_graph._matches(value, desc), (desc, tuple(value.shape), value.stride())
            assert value.dtype == {"float16": FP16, "bfloat16": BF16}[self.pattern.dtype], (desc.name, value.dtype)
        values = evaluate_all(self.pattern, {d.name: v for d, v in zip(self.pattern.inputs, inputs)})
        outs = [values[d.name].to(torch.float32 if d.dtype == "float32" else inputs[0].dtype)
                .as_strided(d.dims, d.strides) for d in self.pattern.outputs()]
        return outs[0] if len(outs) == 1 else tuple(outs)


CONV_CASES = [
    ({"kernel_shape": [1, 1], "activation": "Relu"}, (2, 8, 5, 5), (16, 8, 1, 1), True, True),
    ({"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "activation": "SiLU", "residual_after_activation": 1},
     (2, 8, 6, 6), (8, 8, 3, 3), True, True),
    ({"kernel_shape": [3, 3], "pads": [0, 1, 1, 0], "strides": [2, 2], "activation": "Clip", "alpha": -0.5,
      "beta": 0.5}, (1, 4, 7, 8), (6, 4, 3, 3), True, False),
    ({"kernel_shape": [7, 7], "auto_pad": "SAME_UPPER", "strides": [2, 2], "activation": "LeakyRelu",
      "alpha": 0.1}, (1, 3, 15, 15), (8, 3, 7, 7), False, False),
    ({"kernel_shape": [3, 3], "activation": "Gelu"}, (1, 4, 6, 6), (4, 4, 3, 3), False, True),
]


@pytest.mark.parametrize("attributes, x_shape, w_shape, bias, residual", CONV_CASES)
def test_conv_node_list_computes_the_layer_and_the_launch_binds_the_described_tensors(
        attributes, x_shape, w_shape, bias, residual, monkeypatch):
    torch.manual_seed(0)
    step = conv_step(4 if residual else 3, **attributes)
    if not bias:
        step.inputs[2] = ""
    x = torch.randn(x_shape)
    w, b = torch.randn(w_shape) * 0.3, (torch.randn(w_shape[0]) if bias else None)
    out = reference_conv_shape(step, x_shape, w_shape)
    r = torch.randn(out) if residual else None
    expected = fused_conv(None, x, w, b, r, **attributes)

    pattern = tactics.conv_pattern(step, x_shape, w_shape, bias, residual, torch.float16)
    bound = {"x": x, "w": w, **({"b": b.view(1, -1, 1, 1)} if bias else {}), **({"residual": r} if residual else {})}
    torch.testing.assert_close(evaluate(pattern, bound), expected, rtol=1e-5, atol=1e-5)

    graphs: dict = {}
    monkeypatch.setattr(tactics, "fused_graph", lambda p, device: graphs.setdefault(p, RecordingGraph(p)))
    args = [x.half(), w.half(), b.half() if bias else None] + ([r.half()] if residual else [])  # x, r NCHW
    metas = [InputMeta.of(a, i in (1, 2)) for i, a in enumerate(args)]
    assert tactics.conv_static_supports(step, metas) is True
    configured = dataclasses.replace(step, tactic="cuda.conv.cudnn_fused",
                                     tactic_config=tactics._conv_configure(step, metas))
    launch = tactics._prepare_conv(configured, [None, args[1], args[2]] + [None] * residual, torch.device("cpu"))
    got = launch(None, *args, **attributes)
    assert list(graphs) == [pattern] and graphs[pattern].calls == 1
    assert got.dtype == torch.float16 and got.is_contiguous(memory_format=torch.channels_last)
    want = fused_conv(None, *[a.float() if a is not None else None for a in args], **attributes)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)  # fp16 inputs and output rounding


@pytest.mark.parametrize("activation, residual_after, bias, residual", [
    ("Gelu", 1, True, False), ("Relu", 1, True, True), ("", 1, False, True), ("Tanh", 0, True, True)])
def test_gemm_node_list_computes_the_layer_and_the_launch_binds_the_described_tensors(
        activation, residual_after, bias, residual, monkeypatch):
    torch.manual_seed(0)
    step = gemm_step(4 if residual else 3, activation=activation, residual_after_activation=residual_after)
    if not bias:
        step.inputs[2] = ""
    x, w = torch.randn(2, 3, 16), torch.randn(24, 16) * 0.3
    b, r = (torch.randn(24) if bias else None), (torch.randn(2, 3, 24) if residual else None)
    expected = fused_gemm(None, x, w, b, r, activation=activation, residual_after_activation=residual_after)

    pattern = tactics.gemm_pattern(step, 6, (24, 16), bias, residual, torch.bfloat16)
    bound = {"x": x.reshape(1, 6, 16), "w": w.t().unsqueeze(0), **({"b": b.view(1, 1, -1)} if bias else {}),
             **({"residual": r.reshape(1, 6, 24)} if residual else {})}
    torch.testing.assert_close(evaluate(pattern, bound).view(2, 3, 24), expected, rtol=1e-5, atol=1e-5)

    graphs: dict = {}
    monkeypatch.setattr(tactics, "fused_graph", lambda p, device: graphs.setdefault(p, RecordingGraph(p)))
    args = [x.bfloat16(), w.bfloat16(), b.bfloat16() if bias else None] + ([r.bfloat16()] if residual else [])
    metas = [InputMeta.of(a, i in (1, 2)) for i, a in enumerate(args)]
    assert tactics.gemm_static_supports(step, metas) is True
    configured = dataclasses.replace(step, tactic="cuda.gemm.cudnn_fused",
                                     tactic_config=tactics._gemm_configure(step, metas))
    launch = tactics._prepare_gemm(configured, [None, args[1], args[2]] + [None] * residual, torch.device("cpu"))
    got = launch(None, *args, **step.attributes)
    assert graphs[pattern].calls == 1 and got.shape == (2, 3, 24) and got.dtype == torch.bfloat16
    want = fused_gemm(None, *[a.float() if a is not None else None for a in args], **step.attributes)
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)  # bf16 output rounding (2^-8)
