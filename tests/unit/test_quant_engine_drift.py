"""The whole-engine check of a quantized engine (kiln/builder/accuracy.py quantized_drift): a network that
amplifies one flipped rounding tie into many steps is judged against the default engine's own drift
under a sub-step nudge of its inputs, so kernels that round ties another way keep their layers; a
network that does not amplify is judged as before (10% of the output's scale), and a layer wrong only
in combination is still reverted there.

The models are QDQ chains (x -> Q -> DQ -> MatMul(DQ(w)) -> Q -> ...), one kiln::QGemm per layer after
the fusion; power-of-two scales put 1/64 of the accumulators on an exact tie. Throwaway QGemm tactics
stand in for kernels, and `measure` is replaced so that they win: the timings decide nothing here.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.builder import accuracy as accuracy_module
from kiln.builder import autotune
from kiln.ops.quantized import qgemm
from tests.unit.tactic_check import winning_test_tactics

ROWS, WIDTH, LAYERS, TIED = 16, 32, 16, 16
X_SCALE, W_SCALE = 2.0 ** -4, 2.0 ** -6  # accumulator -> output step: 2^-6, a tie where acc = 32 mod 64


def qdq_chain(path, *, gain: int, seed: int = 0, table: np.ndarray | None = None) -> str:
    """x [ROWS, WIDTH] float -> LAYERS x (Q -> DQ -> MatMul(DQ(w_k))) -> Q -> DQ -> y; int8 weights in
    [-gain, gain], every activation int8 at X_SCALE, zero point 0. `table`: the graph takes token ids [ROWS]
    instead, and x = Gather(table, ids) (a transformer's embedding)."""
    rng = np.random.default_rng(seed)
    scale = numpy_helper.from_array(np.array(X_SCALE, np.float32), "s")
    zero = numpy_helper.from_array(np.array(0, np.int8), "z")
    inits, nodes, value = [scale, zero], [], "x"
    graph_input = helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, WIDTH])
    if table is not None:
        inits.append(numpy_helper.from_array(table.astype(np.float32), "table"))
        nodes.append(helper.make_node("Gather", ["table", "ids"], ["x"], name="embedding"))
        graph_input = helper.make_tensor_value_info("ids", TensorProto.INT64, [ROWS])
    for k in range(LAYERS):
        w = rng.integers(-gain, gain + 1, (WIDTH, WIDTH)).astype(np.int8)  # [K, N]
        inits += [numpy_helper.from_array(w, f"w{k}"), numpy_helper.from_array(np.array(W_SCALE, np.float32), f"ws{k}")]
        nodes += [helper.make_node("QuantizeLinear", [value, "s", "z"], [f"q{k}"], name=f"quantize{k}"),
                  helper.make_node("DequantizeLinear", [f"q{k}", "s", "z"], [f"d{k}"], name=f"dequantize{k}"),
                  helper.make_node("DequantizeLinear", [f"w{k}", f"ws{k}", "z"], [f"wf{k}"], name=f"weight{k}"),
                  helper.make_node("MatMul", [f"d{k}", f"wf{k}"], [f"m{k}"], name=f"matmul{k}")]
        value = f"m{k}"
    nodes += [helper.make_node("QuantizeLinear", [value, "s", "z"], ["qy"], name="quantize_out"),
              helper.make_node("DequantizeLinear", ["qy", "s", "z"], ["y"], name="dequantize_out")]
    graph = helper.make_graph(nodes, "qdq_chain", [graph_input],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [ROWS, WIDTH])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 10
    out = str(path / "qdq_chain.onnx")
    onnx.save(model, out)
    return out


def rounds_ties_away(ctx, x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale=None, *args, **attrs):
    """The reference QGemm rounding an exact tie away from zero (a kernel's other rounding): its output
    scale shrunk by 2^-20 moves r / y_scale off the tie and no value farther than one step."""
    return qgemm(ctx, x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale * (1 - 2 ** -20), *args, **attrs)


@pytest.fixture
def qgemm_tactics(monkeypatch):
    yield from winning_test_tactics(monkeypatch, "QGemm", (torch.uint8, torch.int8))


def tied_rows() -> torch.Tensor:
    """Random [ROWS, WIDTH], with one element in TIED on a tie of the input quantization ((k + 1/2)·X_SCALE):
    the nudge moves the even-k half of those a step, as another rounding would."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((ROWS, WIDTH)) * 2
    tied = rng.random((ROWS, WIDTH)) < 1 / TIED
    x[tied] = (rng.integers(-30, 30, int(tied.sum())) + 0.5) * X_SCALE
    return torch.from_numpy(x.astype(np.float32))


def on_ties(monkeypatch) -> torch.Tensor:
    """The tuner's example input: tied_rows()."""
    x = tied_rows()
    monkeypatch.setattr(autotune, "example_inputs", lambda bindings, shapes, seed=0: [x.clone()])
    return x


def qgemm_tactics_chosen(engine) -> list[str]:
    return [s.tactic for s in engine.plan.program.steps if s.op_type == "QGemm"]


def test_an_amplifying_quantized_network_keeps_kernels_that_round_ties_another_way(tmp_path, qgemm_tactics,
                                                                                   monkeypatch):
    x = on_ties(monkeypatch)
    qgemm_tactics("cpu.test.qgemm.ties_away", rounds_ties_away)
    model = qdq_chain(tmp_path, gain=24)  # (random weights of this gain amplify: checked below)
    engine = kiln.build(model, tactics=["cpu.test"])
    record = engine.plan.header["tactics"]
    assert "reverted_layers" not in record, record.get("reverted_layers")
    assert qgemm_tactics_chosen(engine) == ["cpu.test.qgemm.ties_away"] * LAYERS
    accuracy = record["accuracy"]
    assert accuracy["tuned_engine"] == "accepted"
    assert accuracy["reference"].startswith("the default engine (its own drift with its float inputs scaled by")
    y = accuracy["outputs"]["y"]
    # the flips cascade: the tuned engine is beyond the fixed 10% of the output's scale (it would have
    # reverted layers before), and the default engine itself drifts as far under the nudge
    default = kiln.build(model, tactics=["none"])
    scale = float(np.abs(default.run({"x": x.numpy()})["y"]).max())
    assert y["error"] > 0.1 * scale
    assert y["default_error"] > 0.1 * scale and y["error"] <= y["allowed"]


def test_an_amplifying_network_fed_token_ids_is_judged_by_the_drift_of_its_embeddings(tmp_path, qgemm_tactics,
                                                                                        monkeypatch):
    # No float input to nudge: the drift is measured with the floats made from integers nudged instead (the
    # embedding's output, each dequantized 8-bit activation). Before, such an
    # engine was held to the fixed 10% and reverted layers (onnxruntime's QDQ all-MiniLM-L6-v2: 40 of them).
    table = tied_rows().numpy()
    ids = torch.from_numpy(np.random.default_rng(5).permutation(ROWS).astype(np.int64))
    monkeypatch.setattr(autotune, "example_inputs", lambda bindings, shapes, seed=0: [ids.clone()])
    qgemm_tactics("cpu.test.qgemm.ties_away", rounds_ties_away)
    model = qdq_chain(tmp_path, gain=24, table=table)
    engine = kiln.build(model, tactics=["cpu.test"])
    record = engine.plan.header["tactics"]
    assert "reverted_layers" not in record, record.get("reverted_layers")
    assert qgemm_tactics_chosen(engine) == ["cpu.test.qgemm.ties_away"] * LAYERS
    accuracy = record["accuracy"]
    assert accuracy["reference"].startswith("the default engine (its own drift with its floats made from integer "
                                            "activations scaled by")
    y = accuracy["outputs"]["y"]
    default = kiln.build(model, tactics=["none"])
    scale = float(np.abs(default.run({"ids": ids.numpy()})["y"]).max())
    assert y["error"] > 0.1 * scale  # beyond the fixed tolerance: the drift is what lets it pass
    assert y["default_error"] > 0.1 * scale and y["error"] <= y["allowed"]


def test_the_nudge_keeps_whole_numbers():
    # a mask or a position cast to float is a count: compared for equality later, it must not move
    x = torch.tensor([0.0, 1.0, -3.0, 0.3, 1.5, -2.25, 1e6 + 0.5])
    nudged = accuracy_module._nudge(x)
    assert torch.equal(nudged[:3], x[:3])
    assert (nudged[3:] != x[3:]).all()
    assert torch.allclose(nudged, x, rtol=2 * accuracy_module.INPUT_NUDGE, atol=0)


def test_a_network_that_does_not_amplify_is_judged_as_before(tmp_path, qgemm_tactics, monkeypatch):
    on_ties(monkeypatch)
    qgemm_tactics("cpu.test.qgemm.ties_away", rounds_ties_away)
    engine = kiln.build(qdq_chain(tmp_path, gain=1), tactics=["cpu.test"])  # |w| <= 1/64: the chain shrinks
    record = engine.plan.header["tactics"]
    y = record["accuracy"]["outputs"]["y"]
    assert y["default_error"] == 0.0 and record["accuracy"]["tuned_engine"] == "accepted"
    assert "reverted_layers" not in record



def row_major(x: torch.Tensor) -> torch.Tensor:
    """x's storage read as if it were row-major, whatever its strides (a kernel taking a raw pointer)."""
    return x.as_strided(x.shape, (x.shape[1], 1))


def test_in_an_amplifying_network_a_layer_wrong_only_in_combination_is_still_reverted(tmp_path, qgemm_tactics,
                                                                                       monkeypatch):
    # matmul14 returns its right values column-major; matmul15 misreads a column-major input (right on
    # the row-major inputs the default engine gives it at tuning); every other layer rounds ties away.
    # The drift the nudge measures is capped at a quarter of the output's scale: the misread is more.
    on_ties(monkeypatch)
    qgemm_tactics("cpu.test.qgemm.ties_away", rounds_ties_away, {f"matmul{k}" for k in range(LAYERS - 2)})
    qgemm_tactics("cpu.test.qgemm.column_major", lambda ctx, *a, **k: qgemm(ctx, *a, **k).t().contiguous().t(),
                  {f"matmul{LAYERS - 2}"})
    qgemm_tactics("cpu.test.qgemm.reads_row_major", lambda ctx, x, *a, **k: qgemm(ctx, row_major(x), *a, **k),
                  {f"matmul{LAYERS - 1}"})
    engine = kiln.build(qdq_chain(tmp_path, gain=24), tactics=["cpu.test"])
    record = engine.plan.header["tactics"]
    reverted = record.get("reverted_layers") or {}
    assert set(reverted) & {f"matmul{LAYERS - 2}", f"matmul{LAYERS - 1}"}, record["accuracy"]
    assert len(reverted) <= 2, reverted  # the rounding layers keep their tactic
    y = record["accuracy"]["outputs"]["y"]
    assert y["error"] <= y["allowed"]
