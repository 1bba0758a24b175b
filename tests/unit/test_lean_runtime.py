"""The lean runtime: loading and running a saved engine imports no ONNX, frontend, passes or builder,
and a CPU engine no CUDA tactic or kernel module (nor triton).

Each check runs in a fresh interpreter, since this test process has imported everything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln

REPO = Path(__file__).resolve().parents[2]

FORBIDDEN = ["onnx", "onnx_ir", "onnxscript", "onnxruntime", "kiln.frontend", "kiln.passes", "kiln.builder",
             "kiln.ir.verify", "kiln.ir.tensors", "kiln.tools", "kiln.zoo",
             # a CPU engine: nothing of the CUDA side
             "kiln.tactics.cuda", "kiln.kernels.cuda", "triton", "cudnn"]


def test_the_forbidden_modules_exist():
    """A misspelt name would make the lean check pass vacuously."""
    import importlib.util

    for name in FORBIDDEN:
        if name in ("onnxscript", "onnxruntime", "triton", "cudnn"):  # third-party, optional here
            continue
        assert importlib.util.find_spec(name) is not None, name


@pytest.fixture(scope="module")
def engine_file(tmp_path_factory) -> tuple[Path, dict]:
    rng = np.random.default_rng()
    weight = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["xw"], name="matmul"),
         helper.make_node("Relu", ["xw"], ["r"], name="relu"),
         helper.make_node("Add", ["r", "r"], ["y"], name="add")],
        "lean", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])], [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    folder = tmp_path_factory.mktemp("lean")
    onnx.save(model, folder / "lean.onnx")
    path = folder / "lean.kiln"
    engine = kiln.build(str(folder / "lean.onnx"))
    engine.save(path)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    np.save(folder / "x.npy", x)
    return path, {"x": folder / "x.npy", "y": engine.run({"x": x})["y"]}


def _run_fresh(body: str) -> dict:
    """Run `body` in a new interpreter; it fills `result`, calling `loaded()` to list forbidden modules."""
    script = textwrap.dedent(f"""
        import json, sys
        def loaded():
            forbidden = {FORBIDDEN!r}
            return sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in forbidden))
        result = {{}}
    """) + textwrap.dedent(body) + 'print("RESULT " + json.dumps(result))\n'
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_loading_and_running_an_engine_stays_lean(engine_file):
    """One fresh interpreter (imports are slow), checked after each way in: runtime, kiln.load, CLI."""
    path, data = engine_file
    result = _run_fresh(f"""
        import numpy as np
        import kiln.runtime
        engine = kiln.runtime.load({str(path)!r})
        result["numpy_y"] = engine.run({{"x": np.load({str(data["x"])!r})}})["y"].tolist()
        result["after_runtime"] = loaded()

        import torch
        import kiln
        context = kiln.load({str(path)!r}).create_execution_context()
        result["torch_y"] = context.run({{"x": torch.from_numpy(np.load({str(data["x"])!r}))}})["y"].tolist()
        result["after_kiln_load"] = loaded()

        from kiln.cli import main
        result["codes"] = [main(["run", {str(path)!r}, "--shapes", "x:2x4"]),
                           main(["inspect", {str(path)!r}]),
                           main(["bench", {str(path)!r}, "--iterations", "2", "--warmup", "0"])]
        result["after_cli"] = loaded()
    """)
    assert result["after_runtime"] == []
    assert result["after_kiln_load"] == []
    assert result["codes"] == [0, 0, 0]
    assert result["after_cli"] == []  # run, inspect and bench (without --against) are lean too
    for key in ("numpy_y", "torch_y"):
        np.testing.assert_array_equal(np.array(result[key], dtype=np.float32), data["y"])


@pytest.fixture(scope="module")
def conv_engine_file(tmp_path_factory) -> tuple[Path, dict]:
    """A CPU engine whose convolution names a oneDNN tactic (set here, whatever the timings say)."""
    rng = np.random.default_rng()
    weight = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["y"], name="relu")],
        "lean_conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    engine = kiln.build(model.SerializeToString())
    convs = [s for s in engine.plan.program.steps if s.op_type == "FusedConv"]
    assert len(convs) == 1
    convs[0].tactic, convs[0].tactic_config = "cpu.conv.onednn_direct", {"input_size": [1, 3, 8, 8], "residual": False}
    folder = tmp_path_factory.mktemp("lean_conv")
    path = folder / "conv.kiln"
    engine.save(path)
    x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
    np.save(folder / "x.npy", x)
    return path, {"x": folder / "x.npy", "y": kiln.load(path).run({"x": x})["y"]}


def test_a_cpu_engine_with_tactics_loads_the_cpu_tactics_alone(conv_engine_file):
    path, data = conv_engine_file
    result = _run_fresh(f"""
        import numpy as np
        import kiln
        engine = kiln.load({str(path)!r})
        result["y"] = engine.run({{"x": np.load({str(data["x"])!r})}})["y"].tolist()
        result["forbidden"] = loaded()
        result["cpu_tactics"] = "kiln.tactics.cpu.onednn" in sys.modules
    """)
    assert result["forbidden"] == []
    assert result["cpu_tactics"]  # the engine's tactic was found, in the CPU package
    np.testing.assert_allclose(np.array(result["y"], dtype=np.float32), data["y"], rtol=1e-5, atol=1e-5)
