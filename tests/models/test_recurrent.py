"""Recurrent sensor-style forecasters exported as users export them, kiln against onnxruntime.

torch.onnx.export(dynamo=True) turns nn.LSTM / nn.GRU into ONNX LSTM / GRU nodes (one per layer,
GRU with linear_before_reset=1), so these models exercise the whole-sequence paths (kiln's LSTM loop,
kiln/tactics/cpu/recurrent.py, or torch's kernels through kiln/ops/recurrent_fused.py) end to end: the weight re-ordering the exporter adds in front of each
node is folded at build, and kiln re-orders the folded weights back into torch's layout once.

Tolerance (fp32): oneDNN's LSTM (kiln) and onnxruntime's MLAS sum each gate's products in their own
order; over 96 recurrent steps and two layers the few-ulp differences of each step compound. We
allow rtol 1e-4 plus 1e-5 of max(1, the largest output) (observed: under 3e-8), while a wrong
gate order or direction is an O(1) error.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import kiln
from kiln.builder import autotune
from kiln.ops import recurrent_fused
from kiln.zoo.export import export_module

BATCH, STEPS, FEATURES = 8, 96, 16


class Forecaster(nn.Module):
    """A recurrent body over [batch, time, features] and a linear head on the last step."""

    def __init__(self, body: nn.Module, hidden: int):
        super().__init__()
        self.body = body
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.body(x)  # y: [B, S, D·H]
        return self.head(y[:, -1])  # [B, 1]


MODELS = {
    # the forecaster: 2-layer LSTM, 16 -> 128
    "lstm": (lambda: Forecaster(nn.LSTM(FEATURES, 128, num_layers=2, batch_first=True), 128), "LSTM", 2),
    "gru": (lambda: Forecaster(nn.GRU(FEATURES, 96, num_layers=2, batch_first=True), 96), "GRU", 2),
    "bilstm": (lambda: Forecaster(nn.LSTM(FEATURES, 64, num_layers=1, batch_first=True, bidirectional=True), 128),
               "LSTM", 1),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forecaster_matches_onnxruntime_and_runs_fused(name, tmp_path, monkeypatch):
    make, op, layers = MODELS[name]
    torch.manual_seed(0)
    module = make().eval()
    example = {"x": np.random.default_rng(0).standard_normal((BATCH, STEPS, FEATURES)).astype(np.float32)}
    export_module(module, example, tmp_path)
    path = str(tmp_path / "model.onnx")
    ops = [n.op_type for n in onnx.load(path).graph.node]
    assert ops.count(op) == layers, f"{name}: the export should hold one {op} node per layer: {ops}"

    calls = []
    real = recurrent_fused.run_fused
    monkeypatch.setattr(recurrent_fused, "run_fused", lambda mode, *a, **k: calls.append(mode) or real(mode, *a, **k))
    engine = kiln.build(path)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for run in range(2):
        calls.clear()
        x = rng.standard_normal((BATCH, STEPS, FEATURES)).astype(np.float32)
        (output,) = engine.run({"x": x}).values()
        (want,) = session.run(None, {"x": x})
        with torch.inference_mode():
            eager = module(torch.from_numpy(x)).numpy()
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(output, want, rtol=1e-4, atol=1e-5 * scale, err_msg=f"{name} run {run}")
        np.testing.assert_allclose(output, eager, rtol=1e-4, atol=1e-5 * scale, err_msg=f"{name} vs torch")
        # every layer one whole-sequence kernel: kiln's own loop (cpu.lstm.native / cpu.gru.native / cpu.lstm.lanes /
        # cpu.lstm.fused(_blocks), the tuner's choice where it was faster) or torch's (run_fused), never the
        # step-by-step path
        loops = (f"cpu.{op.lower()}.native", "cpu.lstm.lanes", "cpu.lstm.fused", "cpu.lstm.fused_blocks")
        native = sum(s.op_type == op and s.tactic in loops for s in engine.plan.program.steps)
        assert calls == [op] * (layers - native), f"{name}: fused calls {calls}, {native} native layer(s)"


@pytest.mark.parametrize("bidirectional", [False, True])
def test_gru_forecaster_in_kilns_loop_matches_onnxruntime(bidirectional, tmp_path, monkeypatch):
    """The exported GRU forecaster (linear_before_reset=1 from torch) with every GRU layer on cpu.gru.native,
    made the tuner's choice whatever this machine's timings say."""
    torch.manual_seed(0)
    body = nn.GRU(FEATURES, 48, num_layers=2, batch_first=True, bidirectional=bidirectional)
    module = Forecaster(body, 96 if bidirectional else 48).eval()
    x0 = np.random.default_rng(0).standard_normal((BATCH, 24, FEATURES)).astype(np.float32)
    export_module(module, {"x": x0}, tmp_path)
    path = str(tmp_path / "model.onnx")
    monkeypatch.setattr(autotune, "measure", lambda fns, device, runs=10, **_: {
        k: 0.0 if k == "cpu.gru.native" else 1.0 for k in fns})
    engine = kiln.build(path, timing_cache=None)
    grus = [s for s in engine.plan.program.steps if s.op_type == "GRU"]
    assert len(grus) == 2 and all(s.tactic == "cpu.gru.native" for s in grus), [(s.op_type, s.tactic) for s in grus]
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(2)
    for run in range(2):
        x = rng.standard_normal((BATCH, 24, FEATURES)).astype(np.float32)
        (output,) = engine.run({"x": x}).values()
        (want,) = session.run(None, {"x": x})
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(output, want, rtol=1e-4, atol=1e-5 * scale, err_msg=f"run {run}")


@pytest.mark.parametrize("name, loop", [("bilstm_forecaster", "cpu.lstm.fused"), ("gru_forecaster", "cpu.gru.native"),
                                        ("lstm_forecaster", "cpu.lstm.fused"),
                                        ("lstm_forecaster", "cpu.lstm.fused_blocks")])
def test_zoo_forecaster_is_one_native_segment(name, loop, monkeypatch):
    """The zoo's recurrent forecasters with kiln's loops picked: every step, the bidirectional layers and the moves
    between them (a Relayout reading Y [S, 2, N, H] row-major) included, runs in one native segment, and the engine
    answers as onnxruntime does on fresh windows."""
    from kiln import zoo

    exported = zoo.export(name)
    monkeypatch.setattr(autotune, "measure", lambda fns, device, runs=10, **_: {
        k: 0.0 if k == loop else 1.0 for k in fns})
    engine = kiln.build(str(exported.path), timing_cache=None)
    layers = [s for s in engine.plan.program.steps if s.op_type in ("LSTM", "GRU")]
    assert len(layers) == 2 and all(s.tactic == loop for s in layers), [(s.name, s.tactic) for s in layers]
    segments = engine.program.segments
    assert len(segments) == 1 and len(segments[0].members) == len(engine.plan.program.steps), \
        [[m.ctx.name for m in s.members] for s in segments]
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    for seed in (3, 4):
        feeds = zoo.random_inputs(name, exported, seed=seed)
        (output,) = engine.run(feeds).values()
        (want,) = session.run(None, feeds)
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(output, want, rtol=1e-4, atol=1e-5 * scale, err_msg=f"{name} seed {seed}")


@pytest.fixture(scope="module", params=[("bilstm_forecaster", "cpu.lstm.fused"), ("gru_forecaster", "cpu.gru.native")],
                ids=["bilstm_forecaster", "gru_forecaster"])
def dynamic_forecaster(request, tmp_path_factory):
    """The zoo's forecaster exported as users export it for serving (a symbolic batch), built with kiln's loop
    picked, a profile of batches 1 to 32, and onnxruntime on the same file."""
    from kiln import zoo

    name, loop = request.param
    folder = tmp_path_factory.mktemp(name)
    x = np.random.default_rng(0).standard_normal((BATCH, STEPS, FEATURES)).astype(np.float32)
    export_module(zoo.torch_model(name), {"x": x}, folder, dynamic_axes={0: "batch"})
    path = str(folder / "model.onnx")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(autotune, "measure", lambda fns, device, runs=10, **_: {
            k: 0.0 if k == loop else 1.0 for k in fns})
        engine = kiln.build(path, timing_cache=None, profiles=[{"x": f"1x{STEPS}x{FEATURES},8x{STEPS}x{FEATURES},"
                                                                      f"32x{STEPS}x{FEATURES}"}])
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return name, loop, engine, session


def test_dynamic_batch_forecaster_is_one_segment_at_every_batch(dynamic_forecaster):
    """At a symbolic batch the exporter's zero initial states, its Transpose + Reshape after each layer's Y (shape
    arithmetic over Shape(t)) and the batch-first Transpose in front become what they are at static shapes
    (kiln/passes/fusion/symbolic_shapes.py, relayout.py): every step, both recurrent layers included, is a member of
    one native segment, which binds each fresh batch of the profile (a view, not the layers one by one) and
    answers as onnxruntime does."""
    name, loop, engine, session = dynamic_forecaster
    steps = engine.plan.program.steps
    layers = [s for s in steps if s.op_type in ("LSTM", "GRU")]
    assert len(layers) == 2 and all(s.tactic == loop for s in layers), [(s.name, s.tactic) for s in layers]
    (segment,) = engine.program.segments
    members = [m.ctx.name for m in segment.members]
    assert members == [s.name for s in steps], f"{name}: steps outside the segment: {members} of {steps}"
    context = engine.create_execution_context(pad_first_calls=False)
    rng = np.random.default_rng()
    batches = [1, 32, *(int(b) for b in rng.choice(np.arange(2, 32), 3, replace=False))]
    for batch in batches:
        x = rng.standard_normal((batch, STEPS, FEATURES)).astype(np.float32)
        (output,) = context.run({"x": x}).values()
        (want,) = session.run(None, {"x": x})
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(output, want, rtol=1e-4, atol=1e-5 * scale, err_msg=f"{name} batch {batch}")
        bound = [key for key, view in segment.resized.items() if view is not None]
        assert any(key[0][0] == batch for key in bound) or batch == BATCH, \
            f"{name}: batch {batch} ran the layers one by one (the segment bound {bound}, refused " \
            f"{[k for k, v in segment.resized.items() if v is None]})"
