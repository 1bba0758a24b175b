"""A weight shared by several layers is folded, fused and stored once (issue 11: ALBERT).

ALBERT reuses one layer's weights in every layer. Exporters reach the shared weight either
through one Transpose read by every layer (torch.onnx dynamo) or through one Transpose per layer;
before, constant folding stored the transposed weight once per Transpose node, every GEMM fusion
stored its own transposed copy (new_initializer), and lowering stored every initializer name as
its own engine weight. Structural tests count the large weights after each stage; numerical ones
compare the built engine with onnxruntime on fresh random inputs.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.builder import build
from kiln.builder.lower import lower
from kiln.cli import main
from kiln.frontend import onnx as onnx_frontend
from kiln.passes import PassOptions, PassReport, optimize
from kiln.passes._rewrite import SHARE_MIN_ELEMENTS, new_initializer
from kiln.passes.fold import fold_constants

D = 96  # a [96, 96] weight: 9216 elements, above SHARE_MIN_ELEMENTS
LAYERS = 4
RTOL, ATOL = 1e-5, 1e-5  # fp32: kiln's GEMM and onnxruntime's sum in different orders


def _weight(seed: int, *shape: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)


def shared_layers_model(transpose_per_layer: bool, duplicate_names: bool = False) -> onnx.ModelProto:
    """x -> LAYERS x (MatMul(., W^T) + b -> Relu), every layer reading the same W and b.

    transpose_per_layer: each layer has its own Transpose(W) (else one Transpose read by all);
    duplicate_names: each layer reads its own initializer holding W^T's very bytes (what an
    exporter that folded the shared weight once per layer writes), no Transpose at all."""
    w, b = _weight(1, D, D), _weight(2, D)
    initializers = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")]
    nodes = []
    if not transpose_per_layer and not duplicate_names:
        nodes.append(helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0], name="transpose"))
    x = "x"
    for i in range(LAYERS):
        if duplicate_names:
            initializers.append(numpy_helper.from_array(np.ascontiguousarray(w.T), f"Wt_{i}"))
            wt = f"Wt_{i}"
        elif transpose_per_layer:
            wt = f"Wt_{i}"
            nodes.append(helper.make_node("Transpose", ["W"], [wt], perm=[1, 0], name=f"transpose_{i}"))
        else:
            wt = "Wt"
        nodes += [helper.make_node("MatMul", [x, wt], [f"mm_{i}"], name=f"matmul_{i}"),
                  helper.make_node("Add", [f"mm_{i}", "b"], [f"add_{i}"], name=f"add_{i}"),
                  helper.make_node("Relu", [f"add_{i}"], [f"h_{i}"], name=f"relu_{i}")]
        x = f"h_{i}"
    graph = helper.make_graph(nodes, "shared", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, D])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [2, 8, D])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)  # the GEMM fusion reads the activations' shapes


def large_initializers(model: ir.Model) -> list[ir.Value]:
    return [v for v in model.graph.initializers.values() if v.const_value.size >= SHARE_MIN_ELEMENTS]


def large_weights(engine: kiln.Engine) -> list[str]:
    return [k for k, w in engine.plan.weights.items() if getattr(w, "numel", lambda: 0)() >= SHARE_MIN_ELEMENTS]


def check_against_onnxruntime(model: onnx.ModelProto, engine: kiln.Engine, seed: int) -> None:
    x = np.random.default_rng(seed).standard_normal((2, 8, D)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = engine.run({"x": x})[engine.output_names[0]]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


# ---- constant folding


def test_folding_one_transpose_per_layer_stores_the_transposed_weight_once():
    model = ir.from_proto(shared_layers_model(transpose_per_layer=True))
    report = PassReport()
    assert fold_constants(model, report) == LAYERS  # every Transpose went: one computed, the rest read it
    matmuls = [n for n in model.graph if n.op_type == "MatMul"]
    assert len({n.inputs[1].name for n in matmuls}) == 1
    folded = matmuls[0].inputs[1]
    np.testing.assert_array_equal(folded.const_value.numpy(), _weight(1, D, D).T)
    assert [v.name for v in large_initializers(model)] == ["W", folded.name]  # W itself: DCE's business


def test_folding_into_an_initializer_that_already_holds_the_result_reads_it():
    proto = shared_layers_model(transpose_per_layer=True)
    proto.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(_weight(1, D, D).T), "W_t_stored"))
    model = ir.from_proto(proto)
    fold_constants(model, PassReport())
    assert {n.inputs[1].name for n in model.graph if n.op_type == "MatMul"} == {"W_t_stored"}


def test_a_folded_graph_output_keeps_its_name():
    """A shared fold may not take a graph output's name away: that output gets its own value."""
    proto = shared_layers_model(transpose_per_layer=True)
    proto.graph.output.append(helper.make_tensor_value_info("Wt_3", TensorProto.FLOAT, [D, D]))
    model = ir.from_proto(proto)
    fold_constants(model, PassReport())
    assert [v.name for v in model.graph.outputs] == ["h_3", "Wt_3"]
    np.testing.assert_array_equal(model.graph.outputs[1].const_value.numpy(), _weight(1, D, D).T)


# ---- new_initializer (every rewrite's way to store a weight)


def test_new_initializer_returns_an_identical_large_weight_instead_of_a_copy():
    graph = ir.from_proto(shared_layers_model(transpose_per_layer=False)).graph
    big = _weight(5, D, D)
    first = new_initializer(graph, "big", big)
    assert new_initializer(graph, "big_again", big.copy()) is first
    assert new_initializer(graph, "other", _weight(6, D, D)) is not first
    assert new_initializer(graph, "as_half", big.astype(np.float16)) is not first  # same values, other dtype
    small = np.arange(8, dtype=np.float32)
    assert new_initializer(graph, "s1", small) is not new_initializer(graph, "s2", small)  # small: kept apart


def test_new_initializer_never_returns_an_initializer_the_caller_can_override():
    proto = shared_layers_model(transpose_per_layer=False)
    proto.graph.input.append(helper.make_tensor_value_info("W", TensorProto.FLOAT, [D, D]))  # W: also an input
    graph = ir.from_proto(proto).graph
    assert new_initializer(graph, "w_copy", _weight(1, D, D)).name != "W"


# ---- the whole build


@pytest.mark.parametrize("transpose_per_layer", [False, True], ids=["one-transpose", "transpose-per-layer"])
def test_shared_weight_is_one_engine_weight(transpose_per_layer):
    proto = shared_layers_model(transpose_per_layer)
    after_passes = optimize(ir.from_proto(proto), PassOptions(opt_level=2))
    assert len(large_initializers(after_passes)) == 1, "the GEMM fusion stored a copy per layer"
    engine = kiln.build(proto)
    assert len(large_weights(engine)) == 1
    # W once; each fused layer keeps its own copy of the small bias (below SHARE_MIN_ELEMENTS).
    assert engine.plan.header["weights_bytes"] <= (D * D + LAYERS * D) * 4
    check_against_onnxruntime(proto, engine, seed=11)


def test_lowering_stores_identical_initializers_once():
    """Four names, one content (an exporter that folded the shared weight per layer): one engine weight,
    even at opt_level 0 where no pass runs."""
    proto = shared_layers_model(transpose_per_layer=False, duplicate_names=True)
    for opt_level in (0, 2):
        engine = kiln.build(proto, opt_level=opt_level)
        constants = engine.plan.program.constants
        if opt_level == 0:
            assert len({constants[f"Wt_{i}"] for i in range(LAYERS)}) == 1
        assert len(large_weights(engine)) == (2 if opt_level == 0 else 1)  # at 0, W itself stays (unread)
        check_against_onnxruntime(proto, engine, seed=12 + opt_level)


def test_lowering_keeps_equal_small_constants_apart():
    """A small constant that equals another (Resize scales and a Mul's factor) keeps its own weight:
    half-precision lowering may keep one fp32 and convert the other."""
    proto = shared_layers_model(transpose_per_layer=False)
    engine = kiln.build(proto, opt_level=0)
    assert "b" in engine.plan.program.constants


# ---- build memory, recorded and reported


def test_build_records_its_peak_memory_and_the_model_weight_bytes():
    proto = shared_layers_model(transpose_per_layer=True)
    engine = kiln.build(proto)
    memory = engine.plan.header["build_memory"]
    assert memory["model_weight_bytes"] == (D * D + D) * 4
    assert memory["measured_by"] in ("VmHWM", "ru_maxrss")
    assert memory["peak_rss_delta_bytes"] >= 0


def test_kiln_build_verbose_reports_build_memory(tmp_path, capsys):
    path = tmp_path / "shared.onnx"
    onnx.save(shared_layers_model(transpose_per_layer=True), path)
    assert main(["build", str(path), "-o", str(tmp_path / "shared.kiln"), "-v"]) == 0
    out = capsys.readouterr().out
    assert "build memory" in out and "peak RSS +" in out and "of weights" in out
    assert main(["build", str(path), "-o", str(tmp_path / "shared.kiln")]) == 0
    assert "build memory" not in capsys.readouterr().out  # -v only


def test_an_imported_graph_owns_its_weights_and_lowering_shares_them():
    """A build's own graph has its tensors copied out of the imported proto at once (build._own_weights), so the
    proto goes before the passes run; lowering then shares each weight with the engine instead of copying it.
    Before, the proto's bytes and the engine's copies both lived until lowering was done (BERT-base: +1047 MiB
    there for 415 MiB of weights)."""
    proto = shared_layers_model(transpose_per_layer=True)
    graph = onnx_frontend.load(proto)
    build._own_weights(graph)
    initializers = graph.graph.initializers
    assert not any(isinstance(v.const_value, ir.TensorProtoTensor) for v in initializers.values())
    for tensor in proto.graph.initializer:
        np.testing.assert_array_equal(initializers[tensor.name].const_value.numpy(), numpy_helper.to_array(tensor))
    program, weights, _, _ = lower(graph, copy_weights=False)
    assert sorted(program.constants) == ["W", "b"]
    for name, key in program.constants.items():
        assert weights[key].data_ptr() == initializers[name].const_value.numpy().ctypes.data, name


def test_the_tactic_search_gives_the_heaps_free_pages_back_after_every_layer(monkeypatch):
    """Each layer's candidates (packed weights, outputs) are freed when it is tuned, but the C heap keeps the pages
    of freed blocks below its top: kept, they add up over the layers (ResNet-50's search: ~230 MiB of free heap at
    its end). The search gives them back once per layer tuned, and the engine still agrees with onnxruntime."""
    from kiln.builder import autotune

    given_back = []
    monkeypatch.setattr(autotune, "return_free_memory", lambda: given_back.append(1))
    proto = shared_layers_model(transpose_per_layer=True)
    tuned = []
    engine = kiln.build(proto, progress=lambda msg: tuned.append(msg) if msg.startswith("tactics: ") and
                        msg.split()[1][0].isdigit() and "/" in msg.split()[1] else None)
    assert tuned and len(given_back) == len(tuned)
    x = np.random.default_rng().standard_normal((2, 8, D)).astype(np.float32)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    output = proto.graph.output[0].name
    np.testing.assert_allclose(engine.run({"x": x})[output], session.run(None, {"x": x})[0], rtol=RTOL, atol=ATOL)


def test_a_build_packs_each_weight_once_and_the_engine_binds_those_launches(monkeypatch):
    """The programs the search binds after it (in context, the whole-network check) keep the launches they prepare,
    and the engine binds them: each layer's weights are packed once per build. Before, once per program bound
    (ResNet-50: three times in a row, the engine's load the last, each ~100 MiB). The engine = onnxruntime."""
    import collections

    from kiln.runtime import program as program_module

    packed: collections.Counter = collections.Counter()
    launch_for = program_module.launch_for

    def counted(step, default, constants, device):
        for c in constants:
            if getattr(c, "numel", lambda: 0)() >= program_module.SHARE_MIN_ELEMENTS:
                packed[step.name, step.tactic, id(c)] += 1
        return launch_for(step, default, constants, device)

    monkeypatch.setattr(program_module, "launch_for", counted)
    proto = shared_layers_model(transpose_per_layer=True)
    engine = kiln.build(proto)
    assert engine.plan.header["tactics"].get("accuracy")  # the whole-network check ran (a program bound)
    assert packed and max(packed.values()) == 1, packed
    check_against_onnxruntime(proto, engine, seed=5)
