"""CUDA engine tests: run on the H200 (`pytest tests/gpu`); skipped where there is no CUDA."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

import kiln
from kiln.plan import file as engine_file

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(16)
        self.c2 = torch.nn.Conv2d(16, 16, 3, padding=1)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x):
        y = torch.relu(self.bn(self.c1(x)))
        y = torch.relu(self.c2(y) + y)
        return self.fc(y.mean(dim=(2, 3)))


class SmallTransformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(100, 64)
        self.layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0)

    def forward(self, ids):
        return self.layer(self.emb(ids))


def _export(module, args, path):
    module.eval()
    torch.onnx.export(module, args, str(path), dynamo=True, input_names=["x"], output_names=["y"])
    return str(path)


CASES = {
    "cnn": (SmallCNN, lambda: (torch.randn(2, 3, 16, 16),)),
    "transformer": (SmallTransformer, lambda: (torch.randint(0, 100, (2, 12)),)),
}
# fp16 storage with fp32 accumulation: relative error of a few half ulps per layer.
TOLERANCE = {"fp32": (1e-4, 1e-4), "fp16": (2e-2, 2e-2)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.manual_seed(0)
    out = {}
    for name, (cls, make_args) in CASES.items():
        path = tmp_path_factory.mktemp(name) / f"{name}.onnx"
        out[name] = (_export(cls(), make_args(), path), make_args)
    return out


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_engine_matches_onnxruntime(models, name, precision):
    path, make_args = models[name]
    x = make_args()[0].numpy()
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    expected = sess.run(None, {"x": x})[0]
    engine = kiln.build(path, device="cuda", precision=precision)
    got = engine.run({"x": x})["y"]
    assert got.dtype == expected.dtype
    rtol, atol = TOLERANCE[precision]
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", list(CASES))
def test_cuda_graph_is_captured_and_replays_correctly(models, name):
    path, make_args = models[name]
    engine = kiln.build(path, device="cuda", precision="fp16")
    ctx = engine.create_execution_context()
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for _ in range(3):  # first run records and captures, later ones replay
        x = make_args()[0]
        got = ctx.run({"x": x.cuda()})["y"]
        assert got.device.type == "cuda"
        np.testing.assert_allclose(got.float().cpu().numpy(), sess.run(None, {"x": x.numpy()})[0], rtol=2e-2, atol=2e-2)
    entries = list(ctx.runner.entries.values())
    assert entries and all(e.graph is not None for e in entries), [e.reason for e in entries]


def test_contexts_share_weights(models):
    path, make_args = models["cnn"]
    engine = kiln.build(path, device="cuda", precision="fp16")
    a, b = engine.create_execution_context(), engine.create_execution_context()
    x = make_args()[0].cuda()
    np.testing.assert_array_equal(a.run({"x": x})["y"].cpu().numpy(), b.run({"x": x})["y"].cpu().numpy())


def test_engine_for_another_gpu_is_refused(models, tmp_path):
    path, _ = models["cnn"]
    engine = kiln.build(path, device="cuda", precision="fp16")
    plan = engine.plan
    plan.header = json.loads(json.dumps(plan.header))
    plan.header["device"]["name"] = "NVIDIA Imaginary GPU"
    target = tmp_path / "other.kiln"
    engine_file.save(plan, target)
    with pytest.raises(kiln.EngineFormatError, match="Imaginary"):
        kiln.load(target)


@pytest.mark.parametrize("name", list(CASES))
def test_execute_on_bound_tensors_is_one_graph(models, name):
    """set_tensor_address + execute(): the whole call (input cast, network, output copy) captured as one graph
    over the caller's tensors; in-place changes of a bound input are seen, a rebind recaptures."""
    path, make_args = models[name]
    engine = kiln.build(path, device="cuda", precision="fp16")
    ctx = engine.create_execution_context()
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    x = make_args()[0].cuda()
    y = torch.full(tuple(engine.outputs[0].shape), float("nan"), device="cuda")
    ctx.set_tensor_address("x", x)
    ctx.set_tensor_address("y", y)
    for _ in range(3):
        x.copy_(make_args()[0])
        assert ctx.execute()["y"] is y
        torch.cuda.synchronize()
        np.testing.assert_allclose(y.cpu().numpy(), sess.run(None, {"x": x.cpu().numpy()})[0], rtol=2e-2, atol=2e-2)
    assert ctx._io_graph is not None
    x2 = make_args()[0].cuda()
    ctx.set_tensor_address("x", x2)  # a new address: captured again
    assert ctx._io_graph is None
    got = ctx.execute()["y"]
    torch.cuda.synchronize()
    np.testing.assert_allclose(got.cpu().numpy(), sess.run(None, {"x": x2.cpu().numpy()})[0], rtol=2e-2, atol=2e-2)
    # and run() on the same context still answers right after the whole-call graph shared its pool
    x3 = make_args()[0]
    np.testing.assert_allclose(ctx.run({"x": x3.cuda()})["y"].float().cpu().numpy(),
                               sess.run(None, {"x": x3.numpy()})[0], rtol=2e-2, atol=2e-2)
    assert ctx.execute()["y"] is y
    torch.cuda.synchronize()
    np.testing.assert_allclose(y.cpu().numpy(), sess.run(None, {"x": x2.cpu().numpy()})[0], rtol=2e-2, atol=2e-2)
