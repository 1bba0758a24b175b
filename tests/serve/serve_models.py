"""Small ONNX models for the server tests, built with onnx.helper (no downloads), and a repository of them.

    mlp      x FP32 [batch, 8] -> y = Relu(x @ W) [batch, 4], z = 2x [batch, 8] (exact: shows which rows came back)
    half     h FP16 [batch, 4] -> h2 = 2h FP16; b BF16 [batch, 4] -> bf = float(b) + 1 FP32, bb = bf16(bf)
    fixed    a FP32 [2, 3] (no batch axis) -> a3 = 3a, i INT64 [2, 3] -> i1 = i + 1
    seq      x FP32 [batch, seq, 8] -> y = Relu(Softmax(x @ W)) [batch, seq, 8] through Shape/Reshape (padded first
             calls on the CPU: its own repository in test_warm_up.py, built with pad_dims batch, seq)
    slow     x FP32 [batch, 4] -> y: x + 0 * (a chain of 1024x1024 matmuls on a value x decides), ~tens of ms
    broken   a folder whose config names an input the engine does not have (fails to load; the others serve)

and `lines_until_ready`, the output of a `kiln serve` process read until it says it is ready.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import kiln

OPSET = [helper.make_opsetid("", 17)]
MLP_W = np.random.default_rng(14).standard_normal((8, 4)).astype(np.float32)


def _model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "serve_test", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=OPSET, ir_version=10)


def _value(name: str, dtype: int, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def mlp() -> onnx.ModelProto:
    return _model(
        [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Relu", ["xw"], ["y"]),
         helper.make_node("Mul", ["x", "two"], ["z"])],
        [_value("x", TensorProto.FLOAT, ["batch", 8])],
        [_value("y", TensorProto.FLOAT, ["batch", 4]), _value("z", TensorProto.FLOAT, ["batch", 8])],
        [numpy_helper.from_array(MLP_W, "W"), numpy_helper.from_array(np.array(2, np.float32), "two")])


def half() -> onnx.ModelProto:
    return _model(
        [helper.make_node("Mul", ["h", "two"], ["h2"]),
         helper.make_node("Cast", ["b"], ["bf32"], to=TensorProto.FLOAT),
         helper.make_node("Add", ["bf32", "one"], ["bf"]),
         helper.make_node("Cast", ["bf"], ["bb"], to=TensorProto.BFLOAT16)],
        [_value("h", TensorProto.FLOAT16, ["batch", 4]), _value("b", TensorProto.BFLOAT16, ["batch", 4])],
        [_value("h2", TensorProto.FLOAT16, ["batch", 4]), _value("bf", TensorProto.FLOAT, ["batch", 4]),
         _value("bb", TensorProto.BFLOAT16, ["batch", 4])],
        [numpy_helper.from_array(np.array(2, np.float16), "two"), numpy_helper.from_array(np.array(1, np.float32), "one")])


def fixed() -> onnx.ModelProto:
    return _model(
        [helper.make_node("Mul", ["a", "three"], ["a3"]), helper.make_node("Add", ["i", "one"], ["i1"])],
        [_value("a", TensorProto.FLOAT, [2, 3]), _value("i", TensorProto.INT64, [2, 3])],
        [_value("a3", TensorProto.FLOAT, [2, 3]), _value("i1", TensorProto.INT64, [2, 3])],
        [numpy_helper.from_array(np.array(3, np.float32), "three"), numpy_helper.from_array(np.array(1, np.int64), "one")])


SEQ_W = np.random.default_rng(15).standard_normal((8, 8)).astype(np.float32)


def seq() -> onnx.ModelProto:
    return _model(
        [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Softmax", ["xw"], ["p"], axis=-1),
         helper.make_node("Shape", ["x"], ["shape"]), helper.make_node("Reshape", ["p", "rows"], ["flat"]),
         helper.make_node("Relu", ["flat"], ["r"]), helper.make_node("Reshape", ["r", "shape"], ["y"])],
        [_value("x", TensorProto.FLOAT, ["batch", "seq", 8])], [_value("y", TensorProto.FLOAT, ["batch", "seq", 8])],
        [numpy_helper.from_array(SEQ_W, "W"), numpy_helper.from_array(np.array([-1, 8], np.int64), "rows")])


def slow(size: int = 1024, steps: int = 8) -> onnx.ModelProto:
    """y = x + 0 * sum(M^steps) where M is filled from x's sum: real work no folding can skip."""
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((size, size)) / size).astype(np.float32)
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Expand", ["s", "square"], ["m0"])]
    for k in range(steps):
        nodes.append(helper.make_node("MatMul", [f"m{k}", "W"], [f"m{k + 1}"]))
    nodes += [helper.make_node("ReduceSum", [f"m{steps}"], ["total"], keepdims=0),
              helper.make_node("Mul", ["total", "zero"], ["nothing"]),
              helper.make_node("Add", ["x", "nothing"], ["y"])]
    return _model(
        nodes, [_value("x", TensorProto.FLOAT, ["batch", 4])], [_value("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(np.array([size, size], np.int64), "square"),
         numpy_helper.from_array(np.array(0, np.float32), "zero")])


CONFIGS = {
    "mlp": """
max_batch_size: 16
input [{ name: "x" data_type: TYPE_FP32 dims: [8] }]
output [{ name: "y" data_type: TYPE_FP32 dims: [4] }, { name: "z" data_type: TYPE_FP32 dims: [8] }]
dynamic_batching { preferred_batch_size: [8, 16] max_queue_delay_microseconds: 2000 }
instance_group [{ count: 2 kind: KIND_CPU }]
""",
    "slow": """
max_batch_size: 4
instance_group [{ count: 1 }]
dynamic_batching { default_queue_policy { max_queue_size: 2 } }
""",
    "broken": """
max_batch_size: 4
input [{ name: "not_there" data_type: TYPE_FP32 dims: [8] }]
""",
}


def write_repository(root: Path, engines: Path) -> Path:
    """The test repository: engines built once per session (`engines` caches them), copied in."""
    builders = {"mlp": mlp, "half": half, "fixed": fixed, "slow": slow, "broken": mlp}
    for name, build in builders.items():
        version = root / name / "1"
        version.mkdir(parents=True, exist_ok=True)
        cached = engines / f"{name}.kiln"
        if not cached.exists():
            kiln.build(build().SerializeToString()).save(cached)
        shutil.copy(cached, version / "model.kiln")
        if name in CONFIGS:
            (root / name / "config.pbtxt").write_text(CONFIGS[name])
    # a second version of mlp, not served by the default policy (latest 1) until a reload says all
    (root / "mlp" / "2").mkdir(exist_ok=True)
    shutil.copy(engines / "mlp.kiln", root / "mlp" / "2" / "model.kiln")
    return root


READY = "kiln serve: ready"


def lines_until_ready(process: subprocess.Popen, seconds: float) -> list[str]:
    """The lines a `kiln serve` process (text stdout) printed up to and including READY, or up to its output's end
    or `seconds`, whichever comes first: the caller checks the last line."""
    lines = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.strip() == READY:
            break
    return lines
