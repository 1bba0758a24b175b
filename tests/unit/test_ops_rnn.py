"""LSTM, GRU and RNN against onnxruntime: the fused path on every option combination it takes,
the step-by-step path on every reason it is kept (kiln/ops/rnn.py's docstring), and an engine.

The op is called as the runtime calls it (registry function, torch tensors in), on fresh random
inputs per case, beside onnxruntime's CPU kernel on the same node. onnxruntime has no batch-first
RNNs (layout=1) and no float64 ones: a layout-1 case is checked against onnxruntime's layout-0
kernel on the transposed inputs (outputs transposed back), a float64 one against
onnx.reference (which ignores sequence_lens, so those cases give none). Each case also asserts
which path ran.
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

import kiln
from kiln.ops import recurrent_fused
from kiln.ops.registry import OpContext, lookup
from tests.unit.oracle import assert_close, case_rng, one_node_model, run_oracle

# (rtol, atol) per output dtype. float32: the fused kernels (oneDNN's brgemm LSTM, torch's loop)
# and onnxruntime's MLAS sum each gate's dot products in different orders, and the recurrence
# carries each step's rounding into the next ones: observed max |diff| 2.4e-7 over 9 steps with
# outputs of order 1, so atol 2e-6 leaves a tenfold margin
TOLERANCE = {np.dtype(np.float32): (1e-5, 2e-6), np.dtype(np.float64): (1e-10, 1e-10)}
# cuDNN's RNN kernels (H200, TF32 off) differ from onnxruntime by up to 1.2e-5 over 9 steps on
# outputs of order 1, most on the tanh RNN: its fp32 activations are not rounded like libm's
CUDA_TOLERANCE = {np.dtype(np.float32): (1e-5, 5e-5)}

SEQ, BATCH, INPUT, HIDDEN = 9, 4, 5, 8
INPUT_NAMES = {
    "RNN": ["X", "W", "R", "B", "sequence_lens", "initial_h"],
    "GRU": ["X", "W", "R", "B", "sequence_lens", "initial_h"],
    "LSTM": ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"],
}
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def layer_inputs(rng: np.random.Generator, op: str, *, directions: int, layout: int, lengths: str,
                 initial: bool, bias: bool, peepholes: str = "none", dtype=np.float32) -> dict[str, np.ndarray]:
    """Fresh inputs by ONNX name, in `layout`'s order; lengths: none | full | mixed | zero."""
    gates = GATES[op]
    x_shape = (BATCH, SEQ, INPUT) if layout else (SEQ, BATCH, INPUT)
    state_shape = (BATCH, directions, HIDDEN) if layout else (directions, BATCH, HIDDEN)
    values = {
        "X": rng.uniform(-1, 1, x_shape),
        "W": rng.uniform(-0.5, 0.5, (directions, gates * HIDDEN, INPUT)),
        "R": rng.uniform(-0.5, 0.5, (directions, gates * HIDDEN, HIDDEN)),
    }
    if bias:
        values["B"] = rng.uniform(-0.5, 0.5, (directions, 2 * gates * HIDDEN))
    if lengths != "none":
        seq_lens = {"full": np.full(BATCH, SEQ),
                    "mixed": np.array([SEQ, 1, *rng.integers(2, SEQ, BATCH - 2)]),
                    "zero": np.array([SEQ, 0, *rng.integers(1, SEQ, BATCH - 2)])}[lengths]
        values["sequence_lens"] = rng.permutation(seq_lens).astype(np.int32)
    if initial:
        values["initial_h"] = rng.uniform(-1, 1, state_shape)
        if op == "LSTM":
            values["initial_c"] = rng.uniform(-1, 1, state_shape)
    if peepholes != "none":
        values["P"] = (rng.uniform(-0.5, 0.5, (directions, 3 * HIDDEN)) if peepholes == "random"
                       else np.zeros((directions, 3 * HIDDEN)))
    return {k: v if k == "sequence_lens" else v.astype(dtype) for k, v in values.items()}


def onnx_node(op: str, values: dict, attrs: dict) -> onnx.NodeProto:
    names = [n if n in values else "" for n in INPUT_NAMES[op]]
    while not names[-1]:
        names.pop()
    outputs = ["Y", "Y_h", "Y_c"] if op == "LSTM" else ["Y", "Y_h"]
    return helper.make_node(op, names, outputs, hidden_size=HIDDEN, **attrs)


def oracle(op: str, values: dict, attrs: dict, dtype=np.float32) -> list[np.ndarray]:
    """onnxruntime on the node (layout 1: its layout-0 kernel on transposed data); float64: the reference."""
    layout = attrs.get("layout", 0)
    if layout:
        values = {k: np.swapaxes(v, 0, 1) if k in ("X", "initial_h", "initial_c") else v for k, v in values.items()}
        attrs = {**attrs, "layout": 0}
    node = onnx_node(op, values, attrs)
    outputs = run_oracle(one_node_model(node, values), values, "ref" if dtype == np.float64 else "ort")
    if layout:  # Y [S, D, N, H] -> [N, S, D, H]; states [D, N, H] -> [N, D, H]
        outputs = [outputs[0].transpose(2, 0, 1, 3)] + [np.swapaxes(s, 0, 1) for s in outputs[1:]]
    return outputs


def run_op(op: str, values: dict, attrs: dict, device: str = "cpu") -> list[np.ndarray]:
    """kiln's registered implementation, called as the runtime calls it."""
    ctx = OpContext(name=f"test_{op}", op_type=op, opset=21)
    args = [torch.from_numpy(values[n]).to(device) if n in values else None for n in INPUT_NAMES[op]]
    return [t.cpu().numpy() for t in lookup(op).fn(ctx, *args, hidden_size=HIDDEN, **attrs)]


@pytest.fixture
def fused_calls(monkeypatch) -> list[str]:
    """The modes recurrent_fused.run_fused was called with."""
    calls: list[str] = []
    real = recurrent_fused.run_fused

    def spy(mode, *args, **kwargs):
        calls.append(mode)
        return real(mode, *args, **kwargs)

    monkeypatch.setattr(recurrent_fused, "run_fused", spy)
    return calls


def check(op: str, values: dict, attrs: dict, label: str, dtype=np.float32, device: str = "cpu") -> None:
    got, want = run_op(op, values, attrs, device), oracle(op, values, attrs, dtype)
    for name, g, w in zip(["Y", "Y_h", "Y_c"], got, want):
        assert_close(g, w, CUDA_TOLERANCE if device == "cuda" else TOLERANCE, f"{label} {name}")


# Every option the fused path takes: cell x direction x layout x sequence_lens x initial states x bias
FUSED_CELLS = [("LSTM", {}, "LSTM"), ("GRU", {"linear_before_reset": 1}, "GRU"), ("RNN", {}, "RNN_TANH"),
               ("RNN", {"activations": ["Relu"]}, "RNN_RELU")]
DIRECTIONS = ["forward", "reverse", "bidirectional"]


@pytest.mark.parametrize("cell", FUSED_CELLS, ids=[c[2] for c in FUSED_CELLS])
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("lengths", ["none", "full", "mixed", "zero"])
def test_fused_matches_onnxruntime(cell, direction, layout, lengths, fused_calls):
    op, attrs, mode = cell
    directions = 2 if direction == "bidirectional" else 1
    attrs = {**attrs, "direction": direction, "layout": layout}
    if "activations" in attrs:
        attrs["activations"] = attrs["activations"] * directions
    for initial, bias in itertools.product([False, True], [False, True]):
        label = f"{mode} {direction} layout={layout} lengths={lengths} initial={initial} bias={bias}"
        rng = case_rng(label)
        values = layer_inputs(rng, op, directions=directions, layout=layout, lengths=lengths,
                              initial=initial, bias=bias)
        check(op, values, attrs, label)
    assert fused_calls == [mode] * 4


# Every reason a layer stays step by step (kiln/ops/rnn.py), each beside options the fused path takes
FALLBACKS = [
    ("LSTM", "clip", {"clip": 0.4}, {}),
    ("LSTM", "input_forget", {"input_forget": 1}, {}),
    ("LSTM", "peepholes", {}, {"peepholes": "random"}),
    ("LSTM", "activations", {"activations": ["HardSigmoid", "Tanh", "Tanh"]}, {}),
    ("LSTM", "activation_alpha_beta", {"activations": ["Sigmoid", "ScaledTanh", "Tanh"],
                                       "activation_alpha": [0.9], "activation_beta": [1.1]}, {}),
    ("GRU", "linear_before_reset_0", {}, {}),
    ("GRU", "linear_before_reset_0_explicit", {"linear_before_reset": 0}, {}),
    ("GRU", "clip", {"linear_before_reset": 1, "clip": 0.3}, {}),
    ("GRU", "activations", {"linear_before_reset": 1, "activations": ["Sigmoid", "Relu"]}, {}),
    ("RNN", "sigmoid", {"activations": ["Sigmoid"]}, {}),
    ("RNN", "clip", {"clip": 0.2}, {}),
]


@pytest.mark.parametrize("op, reason, attrs, extra", FALLBACKS, ids=[f"{f[0]}-{f[1]}" for f in FALLBACKS])
@pytest.mark.parametrize("direction, lengths", [("forward", "none"), ("reverse", "zero"), ("bidirectional", "mixed")])
def test_fallback_matches_onnxruntime(op, reason, attrs, extra, direction, lengths, fused_calls):
    directions = 2 if direction == "bidirectional" else 1
    attrs = {**attrs, "direction": direction}
    for key in ("activations", "activation_alpha", "activation_beta"):
        if key in attrs:
            attrs[key] = attrs[key] * directions
    label = f"{op} {reason} {direction} lengths={lengths}"
    values = layer_inputs(case_rng(label), op, directions=directions, layout=0, lengths=lengths, initial=True,
                          bias=True, **extra)
    check(op, values, attrs, label)
    assert fused_calls == []


def test_rnn_directions_with_different_activations_stay_step_by_step(fused_calls):
    attrs = {"direction": "bidirectional", "activations": ["Tanh", "Relu"]}
    values = layer_inputs(case_rng("rnn-tanh-relu"), "RNN", directions=2, layout=0, lengths="mixed",
                          initial=True, bias=True)
    check("RNN", values, attrs, "RNN Tanh/Relu")
    assert fused_calls == []


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_lstm_zero_peepholes_run_fused(direction, fused_calls):
    directions = 2 if direction == "bidirectional" else 1
    values = layer_inputs(case_rng(f"zero-p-{direction}"), "LSTM", directions=directions, layout=0,
                          lengths="mixed", initial=True, bias=True, peepholes="zero")
    check("LSTM", values, {"direction": direction}, f"LSTM zero P {direction}")
    assert fused_calls == ["LSTM"]


@pytest.mark.parametrize("cell", FUSED_CELLS[:3], ids=[c[2] for c in FUSED_CELLS[:3]])  # the reference has no Relu RNN
def test_fused_float64_matches_reference(cell, fused_calls):
    op, attrs, mode = cell
    attrs = {**attrs, "direction": "bidirectional"}
    if "activations" in attrs:
        attrs["activations"] = attrs["activations"] * 2
    values = layer_inputs(case_rng(f"f64-{mode}"), op, directions=2, layout=0, lengths="none", initial=True,
                          bias=True, dtype=np.float64)
    check(op, values, attrs, f"{mode} float64", dtype=np.float64)
    assert fused_calls == [mode]


@pytest.mark.parametrize("bad", [[9, 10, 3, 2], [1, -1, 2, 3], [9, 9, 9]])
def test_sequence_lens_out_of_range_names_the_node(bad):
    values = layer_inputs(case_rng("bad-lengths"), "LSTM", directions=1, layout=0, lengths="none",
                          initial=False, bias=True)
    values["sequence_lens"] = np.array(bad, np.int32)
    with pytest.raises(ValueError, match=r"LSTM node 'test_LSTM': sequence_lens must hold 4 lengths in \[0, 9\]"):
        run_op("LSTM", values, {})


def test_direction_and_weights_disagree():
    values = layer_inputs(case_rng("bad-direction"), "GRU", directions=1, layout=0, lengths="none",
                          initial=False, bias=True)
    with pytest.raises(ValueError, match=r"GRU node 'test_GRU': direction='bidirectional' takes W of shape \[2"):
        run_op("GRU", values, {"direction": "bidirectional", "linear_before_reset": 1})


def engine_model(op: str, values: dict, attrs: dict, outputs: list[str], weights=("W", "R", "B", "P")):
    """The node in a model whose weights are initializers (engine constants); the rest graph inputs."""
    node = onnx_node(op, values, attrs)
    del node.output[:]
    node.output.extend(outputs)
    inputs = {k: v for k, v in values.items() if k not in weights}
    model = one_node_model(node, inputs)
    model.graph.initializer.extend(onnx.numpy_helper.from_array(v, k) for k, v in values.items() if k in weights)
    return model, inputs


@pytest.mark.parametrize("op, attrs, outputs, layout, mode", [
    ("LSTM", {"direction": "bidirectional"}, ["Y", "Y_h", "Y_c"], 0, "LSTM"),
    ("LSTM", {"direction": "reverse"}, ["", "", "Y_c"], 1, "LSTM"),
    ("GRU", {"linear_before_reset": 1}, ["", "Y_h"], 1, "GRU"),
    ("RNN", {"direction": "bidirectional"}, ["Y"], 0, "RNN_TANH"),
])
def test_engine_relays_weights_out_once(op, attrs, outputs, layout, mode, monkeypatch, fused_calls):
    """Built with its weights as constants: every run matches onnxruntime, the weights are put in
    torch's layout on the first run only, and the outputs left out are left out."""
    relayouts = []
    real = recurrent_fused._relayout
    monkeypatch.setattr(recurrent_fused, "_relayout", lambda *a: relayouts.append(a[0]) or real(*a))
    directions = 2 if attrs.get("direction") == "bidirectional" else 1
    attrs = {**attrs, "layout": layout}
    rng = case_rng(f"engine-{op}-{outputs}")
    values = layer_inputs(rng, op, directions=directions, layout=layout, lengths="mixed", initial=True, bias=True)
    model, _ = engine_model(op, values, attrs, outputs)
    engine = kiln.build(model)  # may run the layer already (a candidate tactic refused it: the default is timed)
    built_with = len(relayouts)
    relayouts.clear()
    for run in range(3):
        fresh = layer_inputs(rng, op, directions=directions, layout=layout, lengths="mixed", initial=True,
                             bias=True)
        feeds = {k: v for k, v in fresh.items() if k not in ("W", "R", "B")}
        got = engine.run(feeds)
        want = oracle(op, {**values, **feeds}, attrs)
        assert sorted(got) == sorted(n for n in outputs if n)
        for name, w in zip(["Y", "Y_h", "Y_c"], want):
            if name in got:
                assert_close(got[name], w, TOLERANCE, f"{op} engine run {run} {name}")
    assert len(relayouts) == (0 if built_with else 1), \
        f"weights re-laid-out {len(relayouts)} times in 3 runs ({built_with} at build)"
    assert fused_calls and set(fused_calls) == {mode}


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def full_float32_cudnn():
    """cuDNN may multiply float32 in TF32 (torch's default, which kiln's float32 engines keep, as
    for convolutions); these tests check the kernel's semantics at float32's tolerance."""
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = saved


@needs_cuda
@pytest.mark.parametrize("cell", FUSED_CELLS, ids=[c[2] for c in FUSED_CELLS])
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("layout", [0, 1])
def test_fused_on_cuda_matches_onnxruntime(cell, direction, layout, fused_calls, full_float32_cudnn):
    """cuDNN through torch, on weights flattened into cuDNN's one buffer once."""
    op, attrs, mode = cell
    directions = 2 if direction == "bidirectional" else 1
    attrs = {**attrs, "direction": direction, "layout": layout}
    if "activations" in attrs:
        attrs["activations"] = attrs["activations"] * directions
    for lengths in ["none", "mixed", "zero"]:
        label = f"cuda {mode} {direction} layout={layout} lengths={lengths}"
        values = layer_inputs(case_rng(label), op, directions=directions, layout=layout, lengths=lengths,
                              initial=True, bias=True)
        check(op, values, attrs, label, device="cuda")
    assert fused_calls == [mode] * 3


@needs_cuda
def test_cuda_engine_matches_onnxruntime(fused_calls, full_float32_cudnn):
    """A CUDA engine: the first run eager, then a captured CUDA graph (no host sync without sequence_lens)."""
    values = layer_inputs(case_rng("cuda-engine"), "LSTM", directions=2, layout=0, lengths="none", initial=True,
                          bias=True)
    attrs = {"direction": "bidirectional"}
    model, _ = engine_model("LSTM", values, attrs, ["Y", "Y_h", "Y_c"])
    engine = kiln.build(model, device="cuda")
    rng = case_rng("cuda-engine-runs")
    for run in range(3):
        fresh = layer_inputs(rng, "LSTM", directions=2, layout=0, lengths="none", initial=True, bias=True)
        feeds = {k: v for k, v in fresh.items() if k not in ("W", "R", "B")}
        got = engine.run(feeds)
        for name, w in zip(["Y", "Y_h", "Y_c"], oracle("LSTM", {**values, **feeds}, attrs)):
            assert_close(np.asarray(got[name]), w, CUDA_TOLERANCE, f"cuda engine run {run} {name}")
    assert fused_calls and set(fused_calls) == {"LSTM"}
