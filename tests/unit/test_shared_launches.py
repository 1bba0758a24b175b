"""Layers reading one weight share one prepared launch on the CPU (issue 11: ALBERT's packed weights once).

Every CPU GEMM tactic packs its weight when the engine loads (oneDNN's blocked layout, MKL's packed
matrix, kiln's panels); ALBERT's 12 layers read one layer's weights, so each tactic packed 12 copies.
The runtime now prepares a launch once per (op, tactic, configuration, attributes, weight objects)
and hands it to every layer that matches (kiln/runtime/program.py, shared_launch_key). Structural:
which steps share; numerical: the engine equals onnxruntime with the shared launches, for each GEMM
tactic and inside native segments.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

import kiln
from kiln.builder import autotune, layer_records
from tests.unit.test_memory_shared_weights import ATOL, LAYERS, RTOL, D, shared_layers_model

pytestmark = pytest.mark.usefixtures("native_tactics_win")


def gemm_launches(engine: kiln.Engine) -> list[object]:
    return [s.fn for s in engine.program.steps if s.ctx.op_type == "FusedGemm"]


def run_both(engine: kiln.Engine, proto, seed: int) -> None:
    x = np.random.default_rng(seed).standard_normal((2, 8, D)).astype(np.float32)
    want = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(engine.run({"x": x})[engine.output_names[0]], want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("tactic", ["cpu.gemm.onednn_direct", "cpu.gemm.onednn", "cpu.gemm.mkl", "cpu.gemm.kiln_packed"])
def test_layers_of_one_weight_share_one_launch_and_match_onnxruntime(tactic):
    proto = shared_layers_model(transpose_per_layer=False)
    engine = kiln.build(proto, tactics=[tactic])
    chosen = {s.tactic for s in engine.plan.program.steps if s.op_type == "FusedGemm"}
    if chosen != {tactic}:
        pytest.skip(f"{tactic} is not available or not chosen here: {chosen}")
    launches = gemm_launches(engine)
    # layer 0 reads the graph input, which does not die there (a configuration of its own: dying_inputs);
    # layers 1.. read a value that dies at them: one launch, one packed weight
    assert len(launches) == LAYERS and all(f is launches[1] for f in launches[1:])
    assert len({id(f) for f in launches}) == 2
    run_both(engine, proto, seed=3)
    run_both(engine, proto, seed=4)  # a second run through the same launches


def test_layers_of_different_weights_keep_their_own_launches():
    proto = shared_layers_model(transpose_per_layer=False)
    w = next(numpy_helper.to_array(t) for t in proto.graph.initializer if t.name == "W")
    for i in range(LAYERS):  # layer i reads its own (W·(1 + i/10))ᵀ
        proto.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w.T) * (1 + 0.1 * i), f"Wt_{i}"))
    for n in proto.graph.node:
        if n.op_type == "MatMul":
            n.input[1] = f"Wt_{n.name.removeprefix('matmul_')}"
    engine = kiln.build(proto, tactics=["cpu.gemm.onednn_direct"])
    if {s.tactic for s in engine.plan.program.steps if s.op_type == "FusedGemm"} != {"cpu.gemm.onednn_direct"}:
        pytest.skip("the tuner kept a layer on the op's own implementation (one function for every such layer)")
    assert len({id(f) for f in gemm_launches(engine)}) == LAYERS
    run_both(engine, proto, seed=5)


def test_a_shared_launch_runs_in_a_native_segment():
    proto = shared_layers_model(transpose_per_layer=False)
    engine = kiln.build(proto, tactics=["cpu.gemm.onednn_direct"])
    if not engine.program.segments:
        pytest.skip("no native segment on this machine (oneDNN or the C loop is missing)")
    assert sum(len(s.members) for s in engine.program.segments) == LAYERS
    run_both(engine, proto, seed=6)


# ---- import: shapes inferred without the weights in the copy ONNX's inference makes


def test_import_infers_shapes_and_keeps_every_weight_byte(monkeypatch):
    from kiln.frontend import onnx as onnx_frontend

    seen = []  # the largest initializer ONNX's shape inference is handed
    infer = onnx.shape_inference.infer_shapes
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", lambda m, *a, **k: (
        seen.append(max(len(t.raw_data) for t in m.graph.initializer)), infer(m, *a, **k))[1])

    proto = shared_layers_model(transpose_per_layer=True)
    big = np.random.default_rng(9).standard_normal((D, 256)).astype(np.float32)  # 96 KiB: set aside
    assert big.nbytes >= onnx_frontend.WEIGHT_BYTES
    proto.graph.initializer.append(numpy_helper.from_array(big, "big"))
    proto.graph.node.append(onnx.helper.make_node("MatMul", ["h_3", "big"], ["wide"], name="wide"))
    proto.graph.output.append(onnx.helper.make_tensor_value_info("wide", onnx.TensorProto.FLOAT, None))
    proto.graph.ClearField("value_info")
    model = onnx_frontend.load(proto.SerializeToString())
    values = {v.name: v for n in model.graph for v in n.outputs}
    assert seen and seen[0] < onnx_frontend.WEIGHT_BYTES  # the 96 KiB weight was not in the copy
    assert [d for d in values["wide"].shape] == [2, 8, 256]  # inferred through the set-aside weight's dims
    np.testing.assert_array_equal(model.graph.initializers["big"].const_value.numpy(), big)
    w = next(numpy_helper.to_array(t) for t in proto.graph.initializer if t.name == "W")
    np.testing.assert_array_equal(model.graph.initializers["W"].const_value.numpy(), w)


def test_the_search_holds_one_layer_record_at_a_time(monkeypatch):
    """At one tuning point the search tunes each layer as the example run reaches it: when a layer is
    tuned, its record (copied inputs and output) is the only one alive, neither an earlier layer's nor a
    later one's (recording every layer first held all of them: ALBERT-base's build peak went 316-333 ->
    252-289 MiB). The engine still equals onnxruntime."""
    import gc
    import weakref

    proto = shared_layers_model(transpose_per_layer=False)
    made: list[weakref.ref] = []
    tuned = []

    class Recorded(layer_records.Recorded):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    original = autotune._tune_layer

    def spy(step, record, *args, **kwargs):
        gc.collect()
        alive = [r for r in made if r() is not None and r() is not record]
        assert not alive, f"{len(alive)} other layer record(s) alive while {step.name} is tuned"
        tuned.append(step.name)
        return original(step, record, *args, **kwargs)

    monkeypatch.setattr(layer_records, "Recorded", Recorded)
    monkeypatch.setattr(autotune, "_tune_layer", spy)
    engine = kiln.build(proto.SerializeToString())
    assert len(tuned) >= LAYERS and len(made) == len(tuned)
    run_both(engine, proto, seed=3)
