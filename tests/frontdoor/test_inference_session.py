"""kiln.InferenceSession driven as applications drive onnxruntime, against a real onnxruntime session
on the same model: what it reports (inputs, outputs, metadata), what it returns (None / [] / named
outputs), the errors it raises, io binding, the engine cache, and the options it does not honour."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import kiln
import kiln.compat as kort
from kiln import zoo

RTOL, ATOL = 1e-5, 1e-5  # float32; the same graph computed by two runtimes in a different order


def _mixed_model() -> bytes:
    """Symbolic, unknown and scalar input dims, an overridable initializer, an output declared without shape."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    w = helper.make_tensor_value_info("w", TensorProto.FLOAT, [4])
    z = helper.make_tensor_value_info("z", TensorProto.INT64, [None, 3])
    s = helper.make_tensor_value_info("s", TensorProto.FLOAT, [])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 4])
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, None)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["a"]), helper.make_node("Mul", ["a", "s"], ["m"]),
         helper.make_node("Tanh", ["m"], ["out"]), helper.make_node("Mul", ["z", "z"], ["ids"])],
        "mixed", [x, w, z, s], [out, ids],
        initializer=[helper.make_tensor("w", TensorProto.FLOAT, [4], [0.5, -1.0, 2.0, 0.25])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="kiln-tests",
                              doc_string="a model for session tests")
    model.ir_version = 8
    helper.set_model_props(model, {"author": "tests"})
    return model.SerializeToString()


def _mlp_model(path=None) -> bytes:
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 16])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 8])
    h = helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["N", 32])
    inits = [onnx.numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in [("W1", (16, 32)), ("b1", (32,)), ("W2", (32, 8)), ("b2", (8,))]]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input", "W1"], ["mm1"]), helper.make_node("Add", ["mm1", "b1"], ["pre"]),
         helper.make_node("Relu", ["pre"], ["hidden"]), helper.make_node("MatMul", ["hidden", "W2"], ["mm2"]),
         helper.make_node("Add", ["mm2", "b2"], ["logits"])], "mlp", [x], [y, h], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # a newer onnx writes an IR version an older onnxruntime refuses (the GPU machine's)
    data = model.SerializeToString()
    if path is not None:
        path.write_bytes(data)
    return data


def _feed(rng):
    return {"x": rng.standard_normal((3, 4)).astype(np.float32), "z": rng.integers(-5, 5, (3, 3)),
            "s": np.array(0.7, np.float32)}


def _ort(model: bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3  # the overridable initializer's warning
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _pair(model: bytes):
    return kiln.InferenceSession(model, providers=["CPUExecutionProvider"]), _ort(model)


def _same(kiln_outputs, ort_outputs):
    assert len(kiln_outputs) == len(ort_outputs)
    for got, want in zip(kiln_outputs, ort_outputs):
        assert got.dtype == want.dtype and got.shape == want.shape
        if np.issubdtype(want.dtype, np.integer):
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def _args(args):
    return [(a.name, a.type, list(a.shape)) for a in args]


def test_reports_inputs_outputs_and_metadata_as_onnxruntime():
    model = _mixed_model()
    session, reference = _pair(model)
    assert _args(session.get_inputs()) == _args(reference.get_inputs())
    assert _args(session.get_outputs()) == _args(reference.get_outputs())
    assert _args(session.get_overridable_initializers()) == _args(reference.get_overridable_initializers())
    got, want = session.get_modelmeta(), reference.get_modelmeta()
    for field in ("producer_name", "graph_name", "domain", "description", "graph_description", "version",
                  "custom_metadata_map"):
        assert getattr(got, field) == getattr(want, field), field
    assert session.get_providers() == reference.get_providers() == ["CPUExecutionProvider"]
    assert repr(session.get_inputs()[0]) == "NodeArg(name='x', type='tensor(float)', shape=['batch', 4])"


def test_run_all_named_and_reordered_outputs():
    session, reference = _pair(_mixed_model())
    rng = np.random.default_rng(1)
    for _ in range(2):
        feed = _feed(rng)
        _same(session.run(None, feed), reference.run(None, feed))
        _same(session.run([], feed), reference.run([], feed))
        _same(session.run(["ids"], feed), reference.run(["ids"], feed))
        _same(session.run(["ids", "out"], feed), reference.run(["ids", "out"], feed))
    # onnxruntime's own first example: names from get_inputs()/get_outputs(), a list input
    name = session.get_inputs()[0].name
    feed = {**_feed(rng), name: [[0.1, 0.2, 0.3, 0.4]]}
    _same(session.run([session.get_outputs()[0].name], feed), reference.run([reference.get_outputs()[0].name], feed))


@pytest.mark.parametrize("case", ["output_name", "missing", "input_name", "dtype", "rank", "dims"])
def test_errors_match_onnxruntime(case):
    session, reference = _pair(_mixed_model())
    feed = _feed(np.random.default_rng(2))
    names, bad = None, dict(feed)
    if case == "output_name":
        names = ["nope"]
    elif case == "missing":
        del bad["z"], bad["s"]
    elif case == "input_name":
        bad["q"] = feed["x"]
    elif case == "dtype":
        bad["x"] = feed["x"].astype(np.float64)
    elif case == "rank":
        bad["x"] = feed["x"][..., None]
    elif case == "dims":
        bad["x"] = np.ones((3, 5), np.float32)
    with pytest.raises(Exception) as want:
        reference.run(names, bad)
    with pytest.raises(Exception) as got:
        session.run(names, bad)
    assert type(got.value).__name__ == type(want.value).__name__  # ValueError, or InvalidArgument
    ort_text = str(want.value).split("INVALID_ARGUMENT : ")[-1]
    # kiln says what onnxruntime says (first line), and may name the valid choices after it
    assert str(got.value).splitlines()[0].startswith(ort_text.splitlines()[0].split(" Please fix")[0])
    assert isinstance(got.value, (kort.InvalidArgument, ValueError))


def test_overriding_an_initializer_is_a_clear_error():
    session = kiln.InferenceSession(_mixed_model())
    with pytest.raises(kort.InvalidArgument, match="'w' is an initializer .* cannot be overridden"):
        session.run(None, {**_feed(np.random.default_rng(3)), "w": np.zeros(4, np.float32)})


def test_engine_is_built_once_then_cached(tmp_path, capfd, engine_cache):
    path = tmp_path / "mlp.onnx"
    _mlp_model(path)
    feed = {"input": np.random.default_rng(4).standard_normal((5, 16)).astype(np.float32)}
    first = kiln.InferenceSession(str(path))
    assert capfd.readouterr().err == ""  # nothing built before the first run
    out = first.run(None, feed)
    err = capfd.readouterr().err
    assert "building an engine for mlp.onnx on cpu (first run)" in err and str(engine_cache) in err
    first.run(None, feed)
    assert capfd.readouterr().err == ""  # said once
    assert len(list(engine_cache.glob("*.kiln"))) == 1
    second = kiln.InferenceSession(path)
    _same(second.run(None, feed), out)
    assert "loaded the cached engine for mlp.onnx" in capfd.readouterr().err
    assert first.engine.plan.header["source"]["path"] == str(path.resolve())
    # other options, another engine: the key holds the options
    options = kort.SessionOptions()
    options.graph_optimization_level = kort.GraphOptimizationLevel.ORT_DISABLE_ALL
    third = kiln.InferenceSession(path, options)
    _same(third.run(None, feed), out)
    assert "building an engine" in capfd.readouterr().err
    assert third.engine.plan.header["build_config"]["opt_level"] == 0
    assert len(list(engine_cache.glob("*.kiln"))) == 2
    # log_severity_level 3 silences the notice; the cache can be turned off
    quiet = ort.SessionOptions()
    quiet.log_severity_level = 3
    kiln.InferenceSession(path, quiet, providers=[("KilnExecutionProvider", {"cache": False})]).run(None, feed)
    assert capfd.readouterr().err == ""
    assert len(list(engine_cache.glob("*.kiln"))) == 2


def test_unhonoured_options_are_named():
    options = ort.SessionOptions()  # onnxruntime's own object, as applications pass it
    options.enable_profiling = True
    options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    with pytest.warns(kort.UnhonouredOptionWarning) as caught:
        session = kiln.InferenceSession(_mlp_model(), options,
                                        providers=["OpenVINOExecutionProvider", "CPUExecutionProvider"])
    text = str(caught[0].message)
    for name in ("enable_profiling=True", "execution_mode", "'OpenVINOExecutionProvider'"):
        assert name in text
    assert "graph_optimization_level" not in text  # honoured: opt level 1
    session.run(None, {"input": np.ones((2, 16), np.float32)})
    assert session.engine.plan.header["build_config"]["opt_level"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # defaults warn about nothing
        kiln.InferenceSession(_mlp_model(), ort.SessionOptions(), providers=["CPUExecutionProvider"])


def test_tensorrt_provider_options_become_the_build():
    providers = [("TensorrtExecutionProvider", {"trt_fp16_enable": True, "trt_profile_min_shapes": "input:1x16",
                                                "trt_profile_opt_shapes": "input:4x16",
                                                "trt_profile_max_shapes": "input:8x16",
                                                "trt_max_workspace_size": 1 << 30}),
                 "CPUExecutionProvider"]
    with pytest.warns(kort.UnhonouredOptionWarning) as caught:
        session = kiln.InferenceSession(_mlp_model(), providers=providers)
    text = str(caught[0].message)
    assert "trt_max_workspace_size" in text
    if not __import__("torch").cuda.is_available():
        assert "no CUDA device here" in text
    engine = session.engine
    assert engine.plan.header["build_config"]["precision"] == "fp16"
    assert [p.describe() for p in engine.profiles] == ["input [1..8, 16]"]


def test_shapes_outside_the_profile_rebuild_once_with_a_warning():
    model = _mlp_model()
    session = kiln.InferenceSession(model, providers=[("KilnExecutionProvider", {"profiles": [{"input": "1x16,2x16,4x16"}]})])
    reference = _ort(model)
    rng = np.random.default_rng(5)
    small = {"input": rng.standard_normal((3, 16)).astype(np.float32)}
    _same(session.run(None, small), reference.run(None, small))
    big = {"input": rng.standard_normal((9, 16)).astype(np.float32)}
    with pytest.warns(kort.EngineRebuildWarning, match="outside the engine's optimization profile"):
        _same(session.run(None, big), reference.run(None, big))
    assert [p.describe() for p in session.engine.profiles] == ["input [1..9, 16]"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _same(session.run(None, small), reference.run(None, small))


def test_io_binding():
    model = _mlp_model()
    session, reference = kiln.InferenceSession(model), _ort(model)
    x = np.random.default_rng(6).standard_normal((4, 16)).astype(np.float32)
    binding, ort_binding = session.io_binding(), reference.io_binding()
    for b in (binding, ort_binding):
        b.bind_cpu_input("input", x)
        b.bind_output("logits")
    session.run_with_iobinding(binding)
    reference.run_with_iobinding(ort_binding)
    _same(binding.copy_outputs_to_cpu(), ort_binding.copy_outputs_to_cpu())
    assert binding.get_outputs()[0].shape() == [4, 8] and binding.get_outputs()[0].data_type() == "tensor(float)"
    # an OrtValue input and a preallocated output, filled in place
    target = kort.OrtValue.ortvalue_from_numpy(np.zeros((4, 32), np.float32))
    binding = session.io_binding()
    binding.bind_ortvalue_input("input", kort.OrtValue.ortvalue_from_numpy(x))
    binding.bind_ortvalue_output("hidden", target)
    session.run_with_iobinding(binding)
    np.testing.assert_allclose(target.numpy(), reference.run(["hidden"], {"input": x})[0], rtol=RTOL, atol=ATOL)
    with pytest.raises(kiln.KilnError, match="raw device pointers"):
        binding.bind_input("input", "cpu", 0, np.float32, [4, 16], x.ctypes.data)


def test_threads_share_a_session():
    model = _mlp_model()
    session, reference = kiln.InferenceSession(model), _ort(model)
    feeds = [{"input": np.random.default_rng(10 + k).standard_normal((k + 1, 16)).astype(np.float32)} for k in range(4)]
    session.run(None, feeds[0])  # built before the threads start
    results, errors = {}, []

    def work(k):
        try:
            for _ in range(5):
                results[k] = session.run(None, feeds[k])
        except Exception as e:  # noqa: BLE001  reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for k, feed in enumerate(feeds):
        _same(results[k], reference.run(None, feed))


def test_bert_tiny_export_matches_onnxruntime_at_several_shapes():
    exported = zoo.export("bert_tiny", dynamic=True)
    session, reference = kiln.InferenceSession(str(exported.path)), _ort(exported.path.read_bytes())
    assert _args(session.get_inputs()) == _args(reference.get_inputs())
    assert _args(session.get_outputs()) == _args(reference.get_outputs())
    vocab = zoo.get("bert_tiny").vocab_size
    rng = np.random.default_rng(7)
    for batch, seq in [(2, 16), (1, 7), (3, 33)]:
        ids = rng.integers(0, vocab, (batch, seq))
        mask = np.ones((batch, seq), np.int64)
        mask[0, seq // 2:] = 0  # real padding on one row
        feed = {"input_ids": ids, "attention_mask": mask}
        got, want = session.run(None, feed), reference.run(None, feed)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)  # 2 layers of fp32 attention, reordered sums


def test_one_import_switch(tmp_path):
    """An application written against onnxruntime, given kiln.compat in its place."""
    path = tmp_path / "mlp.onnx"
    _mlp_model(path)

    def application(runtime):
        options = runtime.SessionOptions()
        options.graph_optimization_level = runtime.GraphOptimizationLevel.ORT_ENABLE_ALL
        session = runtime.InferenceSession(str(path), sess_options=options,
                                           providers=runtime.get_available_providers())
        name = session.get_inputs()[0].name
        x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(2, 16)
        return session.run(None, {name: x})

    _same(application(kort), application(ort))


def _one_node(node, inputs, outputs) -> bytes:
    graph = helper.make_graph([node], "one", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("case", ["bool", "string", "sequence"])
def test_other_types_as_onnxruntime(case):
    """onnxruntime's own test patterns for non-float tensors: booleans, strings, a sequence output."""
    if case == "bool":
        model = _one_node(helper.make_node("And", ["a", "b"], ["c"]),
                          [helper.make_tensor_value_info(n, TensorProto.BOOL, [3]) for n in "ab"],
                          [helper.make_tensor_value_info("c", TensorProto.BOOL, [3])])
        feed = {"a": np.array([True, False, True]), "b": np.array([True, True, False])}
    elif case == "string":
        model = _one_node(helper.make_node("Identity", ["s"], ["t"]),
                          [helper.make_tensor_value_info("s", TensorProto.STRING, [2])],
                          [helper.make_tensor_value_info("t", TensorProto.STRING, [2])])
        feed = {"s": np.array(["kiln", "onnxruntime"], dtype=object)}
    else:
        model = _one_node(helper.make_node("SplitToSequence", ["x"], ["parts"], axis=0),
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 2])],
                          [helper.make_tensor_sequence_value_info("parts", TensorProto.FLOAT, None)])
        feed = {"x": np.random.default_rng(8).standard_normal((3, 2)).astype(np.float32)}
    session, reference = _pair(model)
    assert _args(session.get_inputs()) == _args(reference.get_inputs())
    assert _args(session.get_outputs()) == _args(reference.get_outputs())
    got, want = session.run(None, feed), reference.run(None, feed)
    if case == "sequence":
        assert isinstance(got[0], list) and len(got[0]) == len(want[0])
        _same(got[0], want[0])
    else:
        assert got[0].dtype == want[0].dtype
        np.testing.assert_array_equal(got[0], want[0])
