"""`kiln build | run | bench | inspect` end to end on a small ONNX model; onnxruntime is the oracle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.cli import main

REPO = Path(__file__).resolve().parents[2]


def _model(rng: np.random.Generator) -> onnx.ModelProto:
    """y = Identity(Relu(x @ W) + x2), x: [batch, 4], x2: [batch, 3]."""
    weight = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "W")
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"], name="matmul"),
        helper.make_node("Relu", ["xw"], ["relu_out"], name="relu"),
        helper.make_node("Add", ["relu_out", "x2"], ["sum"], name="add"),
        helper.make_node("Identity", ["sum"], ["y"], name="identity"),
    ]
    graph = helper.make_graph(
        nodes, "small",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
         helper.make_tensor_value_info("x2", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="test_cli",
                            ir_version=10)  # onnxruntime 1.30 (on the GPU machine) reads IR <= 13


@pytest.fixture
def model_path(tmp_path: Path) -> Path:
    path = tmp_path / "small.onnx"
    onnx.save(_model(np.random.default_rng()), path)
    return path


@pytest.fixture
def engine_path(model_path: Path, tmp_path: Path) -> Path:
    path = tmp_path / "small.kiln"
    assert main(["build", str(model_path), "-o", str(path)]) == 0
    return path


@pytest.fixture
def plain_engine_path(model_path: Path, tmp_path: Path) -> Path:
    """Built at --opt-level 0, so the layers are the model's nodes one for one."""
    path = tmp_path / "plain.kiln"
    assert main(["build", str(model_path), "-o", str(path), "--opt-level", "0"]) == 0
    return path


def _onnxruntime(model_path: Path, feeds: dict) -> dict:
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds)))


def test_build_writes_engine_and_prints_summary(model_path, tmp_path, capsys):
    out = tmp_path / "sub" / "engine.kiln"
    assert main(["build", str(model_path), "-o", str(out), "--opt-level", "1", "--shapes", "x:8x4,x2:8x3"]) == 0
    text = capsys.readouterr().out
    assert out.is_file()
    for word in ("layers", "weights", "planned peak", "naive sum", "build time"):
        assert word in text
    header = kiln.load(out).plan.header
    assert header["build_config"]["opt_level"] == 1
    assert header["build_config"]["shapes"] == {"x": [8, 4], "x2": [8, 3]}
    assert header["source"]["path"] == str(model_path.resolve())


def test_build_default_output_path_and_verbose(model_path, capsys):
    assert main(["build", str(model_path), "--verbose"]) == 0
    assert model_path.with_suffix(".kiln").is_file()
    assert "importing" in capsys.readouterr().err  # verbose: each stage and its time


def test_run_outputs_equal_onnxruntime(model_path, engine_path, tmp_path, capsys):
    rng = np.random.default_rng()
    feeds = {"x": rng.standard_normal((5, 4)).astype(np.float32),
             "x2": rng.standard_normal((5, 3)).astype(np.float32)}
    np.savez(tmp_path / "in.npz", **feeds)
    out = tmp_path / "out.npz"
    assert main(["run", str(engine_path), "--inputs", str(tmp_path / "in.npz"), "--outputs", str(out)]) == 0
    text = capsys.readouterr().out
    assert "y" in text and "float" in text and "[5, 3]" in text
    expected = _onnxruntime(model_path, feeds)
    with np.load(out) as got:
        assert sorted(got.files) == ["y"]
        # float32 MatMul over K=4: one rounding per product and sum; both sum in the same order or not.
        np.testing.assert_allclose(got["y"], expected["y"], rtol=1e-5, atol=1e-6)


def test_run_random_inputs_follow_shapes(model_path, engine_path, tmp_path):
    saved, out = tmp_path / "in.npz", tmp_path / "out.npz"
    # x:6x4 fixes the symbol "batch", so x2 (batch, 3) is drawn as 6x3 too.
    assert main(["run", str(engine_path), "--shapes", "x:6x4", "--save-inputs", str(saved),
                 "--outputs", str(out)]) == 0
    with np.load(saved) as inputs, np.load(out) as outputs:
        assert inputs["x"].shape == (6, 4) and inputs["x"].dtype == np.float32
        assert inputs["x2"].shape == (6, 3) and inputs["x2"].dtype == np.float32
        assert np.std(inputs["x"]) > 0  # random, not zeros
        expected = _onnxruntime(model_path, {k: inputs[k] for k in inputs.files})
        np.testing.assert_allclose(outputs["y"], expected["y"], rtol=1e-5, atol=1e-6)


def test_run_symbolic_dims_default_to_one(engine_path, tmp_path):
    saved = tmp_path / "in.npz"
    assert main(["run", str(engine_path), "--save-inputs", str(saved)]) == 0
    with np.load(saved) as inputs:
        assert inputs["x"].shape == (1, 4)


def test_run_defaults_to_build_shapes_and_shapes_option_wins(model_path, tmp_path):
    engine, saved = tmp_path / "planned.kiln", tmp_path / "in.npz"
    assert main(["build", str(model_path), "-o", str(engine), "--shapes", "x:8x4", "--shapes", "x2:8x3"]) == 0
    assert main(["run", str(engine), "--save-inputs", str(saved)]) == 0
    with np.load(saved) as inputs:
        assert inputs["x"].shape == (8, 4) and inputs["x2"].shape == (8, 3)
    assert main(["run", str(engine), "--shapes", "x:2x4", "--save-inputs", str(saved)]) == 0
    with np.load(saved) as inputs:
        assert inputs["x"].shape == (2, 4) and inputs["x2"].shape == (2, 3)


def test_inspect_table(plain_engine_path, capsys):
    assert main(["inspect", str(plain_engine_path)]) == 0
    text = capsys.readouterr().out
    for word in ("format version", "kiln version", "bindings", "matmul", "MatMul", "relu", "Add",
                 "[batch, 3]", "planned peak", "naive sum", "weights", "OpenMP wait"):
        assert word in text
    # what kiln/kernels/cpu/omp_governor.py decided, or why libgomp's own policy applies
    assert "governs libgomp's spin" in text or "libgomp's own" in text


def test_inspect_json(plain_engine_path, capsys):
    assert main(["inspect", str(plain_engine_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    header = doc["header"]
    for key in ("format_version", "kiln_version", "torch_version", "device", "build_config",
                "inputs", "outputs", "memory", "weights_bytes", "value_types"):
        assert key in header
    assert [b["name"] for b in header["inputs"]] == ["x", "x2"]
    assert header["weights_bytes"] == 4 * 3 * 4
    assert header["memory"]["peak_bytes"] <= header["memory"]["naive_bytes"]
    ops = [layer["op_type"] for layer in doc["layers"]]
    assert ops == ["MatMul", "Relu", "Add", "Identity"]
    first = doc["layers"][0]
    assert first["name"] == "matmul"
    assert first["outputs"] == [{"name": "xw", "dtype": "float", "shape": ["batch", 3]}]


def test_bench_against_onnxruntime(engine_path, tmp_path, capsys):
    stats = tmp_path / "stats.json"
    assert main(["bench", str(engine_path), "--against", "onnxruntime", "--warmup", "1",
                 "--iterations", "4", "--json", str(stats), "--shapes", "x:2x4"]) == 0
    text = capsys.readouterr().out
    for word in ("kiln", "onnxruntime", "median", "p90", "p95", "p99", "qps", "dispatch overhead"):
        assert word in text
    doc = json.loads(stats.read_text())
    assert {"kiln", "onnxruntime"} <= set(doc) <= {"kiln", "onnxruntime", "peak_rss_growth_bytes"}
    for runtime in (doc["kiln"], doc["onnxruntime"]):
        assert runtime["count"] == 4
        assert runtime["min"] <= runtime["median"] <= runtime["p99"]  # never assert on the times themselves


def test_bench_duration(engine_path, tmp_path):
    stats = tmp_path / "stats.json"
    assert main(["bench", str(engine_path), "--duration", "0.05", "--warmup", "0", "--json", str(stats),
                 "--no-overhead"]) == 0
    assert json.loads(stats.read_text())["kiln"]["count"] >= 1


def test_bench_needs_onnx_path_when_engine_does_not_record_one(model_path, tmp_path, capsys):
    path = tmp_path / "from_bytes.kiln"
    kiln.build(model_path.read_bytes()).save(path)
    assert main(["bench", str(path), "--against", "onnxruntime", "--iterations", "1"]) == 1
    assert "--onnx" in capsys.readouterr().err
    assert main(["bench", str(path), "--against", "onnxruntime", "--onnx", str(model_path),
                 "--iterations", "2", "--warmup", "0", "--no-overhead"]) == 0


def test_bench_against_onnxruntime_of_a_newer_ir_version(tmp_path, capsys):
    model = _model(np.random.default_rng())
    model.ir_version = onnx.IR_VERSION + 10  # what a newer onnx than the installed onnxruntime writes
    onnx.save(model, tmp_path / "newer.onnx")
    engine = tmp_path / "newer.kiln"
    kiln.build(str(tmp_path / "newer.onnx")).save(engine)
    assert main(["bench", str(engine), "--against", "onnxruntime", "--iterations", "2", "--warmup", "0",
                 "--no-overhead"]) == 0
    captured = capsys.readouterr()
    assert "onnxruntime" in captured.out and "IR version" in captured.err


@pytest.mark.parametrize("shapes, message", [("x4", "NAME:DIM"), ("x:4xq", "integers"), ("nope:1x4", "nope")])
def test_bad_shapes_option(engine_path, capsys, shapes, message):
    assert main(["run", str(engine_path), "--shapes", shapes]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_wrong_input_file_is_one_clear_error(engine_path, tmp_path, capsys):
    np.savez(tmp_path / "in.npz", x=np.ones((2, 4), np.float64), x2=np.ones((2, 3), np.float32))
    assert main(["run", str(engine_path), "--inputs", str(tmp_path / "in.npz")]) == 1
    err = capsys.readouterr().err
    assert "'x'" in err and "float" in err and "double" in err


@pytest.mark.parametrize("verb", ["build", "run", "bench", "inspect"])
def test_every_verb_has_help(verb, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([verb, "--help"])
    assert exit_.value.code == 0
    assert f"kiln {verb}" in capsys.readouterr().out


def _python_m_kiln(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "kiln", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_python_m_kiln_build_failure_is_one_message_and_no_file(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07" + os.urandom(200))
    out = tmp_path / "out" / "bad.kiln"
    result = _python_m_kiln("build", str(bad), "-o", str(out), cwd=tmp_path)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert "error" in result.stderr and "bad.onnx" in result.stderr
    assert not out.exists()
    assert not any(p.name.endswith(".tmp") for p in tmp_path.rglob("*"))


def test_python_m_kiln_run(engine_path, tmp_path):
    result = _python_m_kiln("run", str(engine_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "y" in result.stdout


def test_inspect_counts_layout_boundaries(tmp_path, capsys):
    """A stack of three channels-last convs converts its input once and its output once."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    import kiln
    from kiln.cli import main
    from kiln.cli.inspect import layout_conversions

    rng = np.random.default_rng(0)
    inits, nodes, prev = [], [], "x"
    for i in range(3):
        w = rng.standard_normal((8, 8 if i else 3, 3, 3)).astype(np.float32)
        inits.append(helper.make_tensor(f"w{i}", TensorProto.FLOAT, w.shape, w.ravel()))
        nodes.append(helper.make_node("Conv", [prev, f"w{i}"], [f"c{i}"], name=f"conv{i}", pads=[1, 1, 1, 1]))
        prev = f"c{i}"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [1, 8, 16, 16])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    plan = kiln.build(model).plan
    assert [s.op_type for s in plan.program.steps] == ["FusedConv"] * 3
    for step in plan.program.steps:  # force the stack channels-last, whatever the timings said
        step.tactic, step.tactic_config = "cpu.conv.torch_nhwc", {}
    engine = kiln.Engine(plan)
    assert layout_conversions(engine.plan) == {"layers": 3, "conversions": 2}
    path = tmp_path / "m.kiln"
    engine.save(path)
    assert main(["inspect", str(path)]) == 0
    assert "3 layer(s) run channels-last; 2 tensor(s) cross a layout boundary" in capsys.readouterr().out


def test_inspect_reports_native_segments(tmp_path, capsys):
    """A CPU engine whose three convs run on the bound oneDNN tactic: inspect loads the program and
    reports the one segment, its arena and the residual accumulated in place; on the torch tactic,
    none."""
    import numpy as np
    from onnx import TensorProto, helper

    import kiln
    from kiln.cli import main
    from kiln.kernels.cpu import onednn

    if not onednn.available():
        pytest.skip("libdnnl.so.3 cannot be loaded")
    rng = np.random.default_rng(0)
    inits = [helper.make_tensor(f"w{i}", TensorProto.FLOAT, (8, 8, 3, 3),
                                rng.standard_normal((8, 8, 3, 3)).astype(np.float32).ravel()) for i in range(2)]
    nodes = [helper.make_node("Conv", ["x", "w0"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("Conv", ["r", "w1"], ["b"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["b", "r"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    plan = kiln.build(model).plan
    assert [s.op_type for s in plan.program.steps] == ["FusedConv"] * 2
    for tactic, expected in (("cpu.conv.onednn_direct", "1 segment(s) run 2 of 2 layers"),
                             ("cpu.conv.torch_nhwc", "none (no run of two or more layers")):
        for step in plan.program.steps:
            step.tactic = tactic
            step.tactic_config = {"input_size": [1, 8, 16, 16], "residual": len(step.inputs) > 3}
        path = tmp_path / f"{tactic}.kiln"
        kiln.Engine(plan).save(path)
        assert main(["inspect", str(path)]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert expected in out, out
