"""cuDNN norm tactics (cuda.layer_norm.cudnn, cuda.rms_norm.cudnn) without a GPU: the graph each layer becomes,
the supports() reasons, configure, the inference/training alternatives and fallbacks.

As for conv and GEMM (tests/unit/test_tactics_cudnn.py, whose node-list evaluator this file uses), torch is the
oracle: the node list evaluated op by op, and the registered kiln LayerNorm / RMSNorm on the same inputs.
What only a GPU can show is under tests/gpu.
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
from kiln.kernels.cuda.cudnn_graph import CudnnGraphError
from kiln.ops.fused import layer_norm as fused_layer_norm
from kiln.ops.fused import rms_norm as fused_rms_norm
from kiln.plan.spec import StepSpec
from kiln.tactics import registry
from kiln.tactics.cuda import cudnn as tactics
from kiln.tactics.tactic import InputMeta
from tests.unit.test_tactics_cudnn import BF16, FP16, RecordingGraph, meta


def norm_step(op: str = "LayerNorm", n_inputs: int = 3, n_outputs: int = 1, **attributes) -> StepSpec:
    return StepSpec(op_type=op, name="norm_0", inputs=[f"in{i}" for i in range(n_inputs)],
                    outputs=[f"out{i}" for i in range(n_outputs)], attributes=attributes, domain="kiln")


def norm_inputs(x, dtype=FP16, scale=True, bias=True, residual=None, param_shape=None) -> list[InputMeta]:
    hidden = x[-1]
    shape = param_shape or (hidden,)
    found = [meta(x, dtype), meta(shape, dtype, True) if scale else InputMeta(None, None, False),
             meta(shape, dtype, True) if bias else InputMeta(None, None, False)]
    if residual is not None:
        found.append(meta(residual, dtype))
    return found


def test_skip_layer_norm_is_add_then_layernorm_with_the_sum_as_an_output():
    """BERT's skip-LayerNorm: one add node feeding cuDNN's LayerNorm, epsilon bound by value, y and the sum out."""
    step = norm_step("LayerNorm", 4, 2, epsilon=1e-12)
    inference, training = tactics.norm_patterns(step, 24576, 768, residual=True, dtype=FP16)
    assert inference.node_ops() == ["add", "layernorm"] and inference.summary() == "add -> layernorm[INFERENCE]"
    add, norm = inference.nodes
    assert add.inputs == ("x", "residual") and norm.inputs == (add.output, "scale", "bias", "epsilon")
    assert dict(norm.params) == {"norm_forward_phase": "INFERENCE"} and norm.more_outputs == ()
    assert [t.name for t in inference.inputs] == ["x", "scale", "bias", "residual"]
    assert inference.scalars == (("epsilon", 1e-12),)
    assert [t.name for t in inference.outputs()] == ["y", "sum"] and add.output == "sum"
    rows = torch.empty(24576, 768)  # [rows, hidden] row-major is what a contiguous [B, S, H] activation is
    for desc in (inference.inputs[0], inference.inputs[3], *inference.outputs()):
        assert desc.dims == (24576, 768, 1, 1) and cudnn_graph._matches(rows.view(24576, 768, 1, 1), desc)
    assert cudnn_graph._matches(torch.empty(768).view(1, 768, 1, 1), inference.inputs[1])
    # training phase: the same graph plus the fp32 statistics, per row
    assert dict(training.nodes[-1].params) == {"norm_forward_phase": "TRAINING"}
    assert training.nodes[-1].more_outputs == ("mean", "inv_var")
    stats = training.more_outputs[1:]
    assert [(t.name, t.dims, t.dtype) for t in stats] == [("mean", (24576, 1, 1, 1), "float32"),
                                                          ("inv_var", (24576, 1, 1, 1), "float32")]
    assert inference != training and hash(inference) != hash(training)


def test_rms_norm_has_no_bias_port_and_no_residual():
    step = norm_step("RMSNorm", 2)
    pattern = tactics.norm_patterns(step, 128, 64, residual=False, dtype=BF16)[0]
    assert pattern.dtype == "bfloat16" and pattern.node_ops() == ["rmsnorm"]
    assert pattern.nodes[0].inputs == ("x", "scale", "", "epsilon")  # the bias port left out
    assert [t.name for t in pattern.inputs] == ["x", "scale"] and pattern.scalars == (("epsilon", 1e-6),)
    training = tactics.norm_patterns(step, 128, 64, residual=False, dtype=BF16)[1]
    assert [t.name for t in training.more_outputs] == ["inv_var"]
    with pytest.raises(ValueError, match="no residual"):
        cudnn_graph.describe_norm(4, 8, rms=True, epsilon=1e-6, residual=True, sum_output=False,
                                  phase="INFERENCE", dtype="float16")
    with pytest.raises(ValueError, match="phase"):
        cudnn_graph.describe_norm(4, 8, rms=False, epsilon=1e-6, residual=False, sum_output=False,
                                  phase="INFER", dtype="float16")


def test_norm_static_supports_accepts_transformer_layers():
    assert tactics.norm_static_supports(norm_step("LayerNorm", 4, 2), norm_inputs((64, 384, 768),
                                                                                  residual=(64, 384, 768))) is True
    assert tactics.norm_static_supports(norm_step("LayerNorm", 3), norm_inputs((1, 128, 768), BF16)) is True
    assert tactics.norm_static_supports(norm_step("LayerNorm", 1), [meta((8, 768))]) is True  # no scale, no bias
    assert tactics.norm_static_supports(norm_step("LayerNorm", 3), norm_inputs((8, 768), param_shape=(1, 768))) \
        is True
    assert tactics.norm_static_supports(norm_step("RMSNorm", 2), norm_inputs((8, 512, 2048))[:2]) is True


@pytest.mark.parametrize("step, inputs, reason", [
    (norm_step("LayerNorm", 3, axis=-2), norm_inputs((8, 16, 32), param_shape=(16, 32)), "not the last"),
    (norm_step("LayerNorm", 3, axis=1), norm_inputs((8, 16, 32), param_shape=(16, 32)), "not the last"),
    (norm_step("LayerNorm", 3, axis=3), norm_inputs((8, 16, 32)), "out of range"),
    (norm_step("LayerNorm", 3), norm_inputs((8, 32), param_shape=(16,)), "one value per column"),
    (norm_step("LayerNorm", 3), norm_inputs((8, 32), param_shape=(32, 1)), "one value per column"),
    (norm_step("LayerNorm", 3), norm_inputs((8, 32))[:2] + [meta((32,), BF16, True)], "bias is torch.bfloat16"),
    (norm_step("LayerNorm", 4), norm_inputs((8, 16, 32), residual=(1, 16, 32)), "no broadcast"),
    (norm_step("LayerNorm", 4), norm_inputs((8, 32))[:3] + [meta((8, 32), BF16)], "no broadcast"),
    (norm_step("LayerNorm", 3), norm_inputs((8, 32), torch.float32), "float16/bfloat16"),
    (norm_step("LayerNorm", 3, 3), norm_inputs((8, 32)), "at most 2"),
    (norm_step("RMSNorm", 2, 2), norm_inputs((8, 32))[:2], "at most 1"),
    (norm_step("LayerNorm", 3), norm_inputs((0, 32)), "empty"),
    (norm_step("LayerNorm", 3), [meta(())] + norm_inputs((8, 32))[1:], "scalar"),
])
def test_norm_static_supports_says_why_not(step, inputs, reason):
    found = tactics.norm_static_supports(step, inputs)
    assert isinstance(found, str) and reason in found, found


def test_norm_configure_and_availability():
    inputs = norm_inputs((64, 384, 768), BF16, residual=(64, 384, 768))
    assert tactics._norm_configure(norm_step("LayerNorm", 4, 2), inputs) == {
        "rows": 64 * 384, "hidden": 768, "dtype": "bfloat16", "residual": True}
    assert tactics._norm_configure(norm_step("RMSNorm", 2), norm_inputs((3, 5, 64))[:2])["residual"] is False
    for name, op in (("cuda.layer_norm.cudnn", "LayerNorm"), ("cuda.rms_norm.cudnn", "RMSNorm")):
        tactic = registry.get(name)
        assert tactic is not None and tactic.op_type == op and tactic.domain == "kiln"
        assert tactic in registry.candidates(op, "kiln", "cuda", opt_level=3)
        assert tactic not in registry.candidates(op, "kiln", "cuda", opt_level=2)  # until the H200 table says so
        if not torch.cuda.is_available():
            assert "not available" in tactic.check(norm_step(op, 2), norm_inputs((8, 32))[:2])
        assert "takes float16, bfloat16" in registry.get(name).check(norm_step(op, 2),
                                                                     norm_inputs((8, 32), torch.float32)[:2]) \
            or not tactic.available()


class _Ctx:
    def __init__(self, num_outputs: int):
        self.num_outputs = num_outputs


NORM_CASES = [  # op, x shape, dtype, scale, bias, residual, outputs, epsilon
    ("LayerNorm", (2, 5, 48), FP16, True, True, True, 2, 1e-12),
    ("LayerNorm", (2, 5, 48), BF16, True, True, True, 1, 1e-5),
    ("LayerNorm", (7, 32), FP16, True, True, False, 1, 1e-5),
    ("LayerNorm", (7, 32), FP16, False, False, False, 2, 1e-3),
    ("LayerNorm", (3, 4, 64), BF16, True, False, True, 2, 1e-6),
    ("RMSNorm", (3, 4, 64), FP16, True, False, False, 1, 1e-6),
    ("RMSNorm", (9, 16), BF16, False, False, False, 1, 1e-2),
]


def _norm_args(op, shape, dtype, scale, bias, residual):
    hidden = shape[-1]
    x = (torch.randn(shape) * 2 + 0.5).to(dtype)  # an offset mean: LayerNorm must subtract it, RMSNorm must not
    s = (torch.rand(hidden) + 0.5).to(dtype) if scale else None
    b = torch.randn(hidden).to(dtype) if bias else None
    r = torch.randn(shape).to(dtype) if residual else None
    return [x, s] if op == "RMSNorm" else [x, s, b] + ([r] if residual else [])


@pytest.mark.parametrize("op, shape, dtype, scale, bias, residual, outputs, epsilon", NORM_CASES)
@pytest.mark.parametrize("builds", ["first", "training", "last"])
def test_norm_node_list_computes_the_layer_and_the_launch_binds_the_described_tensors(
        op, shape, dtype, scale, bias, residual, outputs, epsilon, builds, monkeypatch):
    """The launch against the registered kiln op (fp32 on the same rounded inputs), through RecordingGraph.

    cuDNN is made to build only the first alternative, or only the training-phase ones (statistics discarded),
    or only the last (for a skip-LayerNorm without its sum asked for: training phase with the sum written and
    discarded)."""
    torch.manual_seed(0)
    args = _norm_args(op, shape, dtype, scale, bias, residual)
    step = norm_step(op, len(args), outputs, epsilon=epsilon)
    for i, a in enumerate(args):
        if a is None:
            step.inputs[i] = ""
    metas = [InputMeta.of(a, i in (1, 2)) for i, a in enumerate(args)]
    assert tactics.norm_static_supports(step, metas) is True

    graphs: dict = {}

    alternatives = tactics.norm_patterns(step, math.prod(shape[:-1]), shape[-1], residual, dtype)
    if residual and outputs == 1:
        assert [len(p.more_outputs) for p in alternatives] == [0, 2, 1, 3]  # y | +stats | +sum | +sum +stats
    else:
        assert len(alternatives) == 2
    phase = {"first": "INFERENCE", "training": "TRAINING", "last": "TRAINING"}[builds]

    def fake_build(pattern, device):
        if dict(pattern.nodes[-1].params)["norm_forward_phase"] != phase or \
                (builds == "last" and pattern != alternatives[-1]):
            raise CudnnGraphError("declined (test)")
        return graphs.setdefault(pattern, RecordingGraph(pattern))

    monkeypatch.setattr(tactics, "fused_graph", fake_build)
    configured = dataclasses.replace(step, tactic="cuda.layer_norm.cudnn",
                                     tactic_config=tactics._norm_configure(step, metas))
    constants = [None] + [a if i in (1, 2) else None for i, a in enumerate(args) if i]
    launch = tactics._prepare_norm(configured, constants, torch.device("cpu"))
    ctx = _Ctx(outputs)
    got = launch(ctx, *args, **step.attributes)
    assert len(graphs) == 1
    (pattern, recorder), = graphs.items()
    assert recorder.calls == 1
    assert dict(pattern.nodes[-1].params)["norm_forward_phase"] == phase
    assert pattern == (alternatives[-1] if builds == "last" else alternatives[0 if builds == "first" else 1])
    assert pattern.scalars == (("epsilon", epsilon),)

    registered = (fused_rms_norm if op == "RMSNorm" else fused_layer_norm)
    want = registered(ctx, *[a.float() if a is not None else None for a in args], **step.attributes)
    got_all = got if isinstance(got, tuple) else (got,)
    want_all = want if isinstance(want, tuple) else (want,)
    assert len(got_all) == len(want_all) == outputs
    tolerance = {FP16: 4e-3, BF16: 3e-2}[dtype]  # one rounding of y (|y| <~ 4) to the output dtype
    for g, w in zip(got_all, want_all):
        assert g.shape == w.shape and g.dtype == dtype
        torch.testing.assert_close(g.float(), w, rtol=tolerance, atol=tolerance)
    if outputs == 2 and not residual:
        assert got_all[1] is args[0]  # no residual: the "sum" is x itself, as the registered op gives it


def test_norm_graph_is_built_at_load_and_a_refused_shape_falls_back(monkeypatch):
    """prepare() builds the configured shape (a refusal there fails loudly); another shape that cuDNN declines
    runs the registered op, with one warning naming the layer."""
    step = norm_step("LayerNorm", 3)
    metas = norm_inputs((4, 16))
    configured = dataclasses.replace(step, tactic="cuda.layer_norm.cudnn",
                                     tactic_config=tactics._norm_configure(step, metas))
    monkeypatch.setattr(tactics, "fused_graph", lambda p, d: (_ for _ in ()).throw(CudnnGraphError("no (test)")))
    with pytest.raises(CudnnGraphError, match="no \\(test\\) \\| .*no \\(test\\)"):  # both phases tried
        tactics._prepare_norm(configured, [None, None, None], torch.device("cpu"))
    launch = tactics._prepare_norm(dataclasses.replace(configured, tactic_config={}), [None, None, None],
                                   torch.device("cpu"))
    x = torch.randn(3, 16).half()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = launch(_Ctx(1), x)
        launch(_Ctx(1), x)
    assert len(caught) == 1 and "norm_0" in str(caught[0].message)
    torch.testing.assert_close(y.float(), F.layer_norm(x.float(), (16,)), rtol=4e-3, atol=4e-3)


@pytest.mark.skipif(importlib.util.find_spec("cudnn") is None, reason="nvidia-cudnn-frontend is not installed")
def test_the_norm_patterns_become_the_same_pygraph_nodes():
    import cudnn

    step = norm_step("LayerNorm", 4, 2, epsilon=1e-12)
    for pattern in tactics.norm_patterns(step, 256, 768, residual=True, dtype=FP16):
        graph, tensors = cudnn_graph.to_pygraph(cudnn, pattern, None)
        add, norm = graph.nodes
        assert add.params.get("mode") == "add" and str(norm.node_type).endswith("LAYERNORM")
        phase = dict(pattern.nodes[-1].params)["norm_forward_phase"]
        assert norm.params["norm_forward_phase"] == getattr(cudnn.norm_forward_phase, phase)
        assert tensors["epsilon"].is_pass_by_value and tensors["epsilon"].data_type == cudnn.data_type.FLOAT
        assert norm.inputs["epsilon"] is tensors["epsilon"] and norm.inputs["input"] is tensors["sum"]
        for desc in pattern.outputs():
            t = tensors[desc.name]
            assert not t.is_virtual and list(t.dim) == list(desc.dims) and list(t.stride) == list(desc.strides)
            want = cudnn.data_type.FLOAT if desc.dtype == "float32" else cudnn.data_type.HALF
            assert t.data_type == want, desc.name
    rms = tactics.norm_patterns(norm_step("RMSNorm", 2), 8, 64, residual=False, dtype=BF16)[0]
    graph, tensors = cudnn_graph.to_pygraph(cudnn, rms, None)
    (node,) = graph.nodes
    assert str(node.node_type).endswith("RMSNORM") and node.inputs.get("bias") is None
    assert tensors["y"].data_type == cudnn.data_type.BFLOAT16


def test_during_a_capture_the_first_built_alternative_is_used_and_nothing_is_built(monkeypatch):
    """In a CUDA-graph capture a shape takes the first alternative already built (the inference graph) even though
    the later ones were never tried; a shape with nothing built yet runs the default, uncached, and builds nothing."""
    step = norm_step("LayerNorm", 3)
    inference, training = tactics.norm_patterns(step, 4, 16, residual=False, dtype=FP16)
    built = {inference: RecordingGraph(inference)}
    attempts = []

    def fake_build(pattern, device):
        attempts.append(pattern)
        return built[pattern]

    monkeypatch.setattr(tactics, "fused_graph", fake_build)
    monkeypatch.setattr(tactics, "is_built", lambda pattern, device: pattern in built)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    graphs = tactics._ShapeGraphs("norm_0", lambda shape: tactics.norm_patterns(step, *shape, False, FP16),
                                  default="default")
    assert graphs.get((4, 16), torch.device("cpu")) is built[inference] and attempts == [inference]
    assert graphs.get((8, 16), torch.device("cpu")) == "default" and attempts == [inference]
    assert (8, 16) not in graphs.graphs  # tried again after the capture, eagerly
