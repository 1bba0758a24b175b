"""The CLI on a CUDA engine: build --device cuda --fp16, run, bench with the H2D / compute / D2H split."""

from __future__ import annotations

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from kiln.cli import main

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _model(path):
    w = helper.make_tensor("w", TensorProto.FLOAT, [64, 64], [0.01 * (i % 7) for i in range(64 * 64)])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"), helper.make_node("Relu", ["h"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 64])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), path)


def test_build_run_bench_on_cuda(tmp_path, capsys):
    model, engine = tmp_path / "m.onnx", tmp_path / "m.kiln"
    _model(model)
    assert main(["build", str(model), "-o", str(engine), "--device", "cuda", "--fp16"]) == 0
    assert main(["run", str(engine)]) == 0
    capsys.readouterr()
    assert main(["bench", str(engine), "--iterations", "20", "--against", "onnxruntime", "--dump-profile"]) == 0
    out = capsys.readouterr().out
    assert "H2D" in out and "GPU compute" in out and "D2H" in out
    assert "per-layer profile" in out
