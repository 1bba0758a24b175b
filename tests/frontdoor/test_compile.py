"""kiln.compile and torch.compile(backend="kiln") against the modules' own outputs: an MLP, a small
CNN, a transformer block, pytrees in and out, shapes inside the dynamic ranges, a torch.library custom
op that must fall back to PyTorch (and still match), save/load in a fresh process, fp16."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import kiln
import kiln.torch_backend
from tests.frontdoor import custom_ops  # noqa: F401  registers kilntest::scaled_relu
from kiln.frontend import torch as torch_frontend

# float32: the same layers computed by kiln's kernels (BN folded into the conv, fused epilogues) and
# by torch's in another order; a few ulps over a handful of layers
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-2, 2e-2)}


def _same(got, want, dtype=torch.float32):
    got_leaves, got_spec = torch.utils._pytree.tree_flatten(got)
    want_leaves, want_spec = torch.utils._pytree.tree_flatten(want)
    assert got_spec == want_spec
    rtol, atol = TOLERANCE[dtype]
    for g, w in zip(got_leaves, want_leaves):
        assert g.dtype == w.dtype and g.device == w.device and g.shape == w.shape
        torch.testing.assert_close(g, w.detach(), rtol=rtol, atol=atol)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))

    def forward(self, x):
        return self.body(x)


class SmallCnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1, groups=2), nn.BatchNorm2d(16), nn.ReLU6(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(16, 10)
        for bn in (self.features[1], self.features[5]):  # statistics that are not the identity
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)

    def forward(self, images):
        return self.head(torch.flatten(self.features(images), 1))


class Block(nn.Module):
    """A pre-norm transformer block: LayerNorm, multi-head attention, GELU MLP, residuals."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class Pytrees(nn.Module):
    """A dict in, a (tensor, dict) out, an integer output dtype."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, batch, scale):
        y = self.proj(batch["x"]) * scale + batch["bias"]
        return y.sum(-1), {"y": y, "top": y.argmax(-1)}


class WithCustomOp(nn.Module):
    """Linear -> BN -> custom op (PyTorch only) -> Linear, and a view of the custom op's result."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.bn = nn.BatchNorm1d(16)
        self.bn.running_mean.uniform_(-1, 1)

    def forward(self, x):
        h = torch.ops.kilntest.scaled_relu(self.bn(self.a(x)), 1.5)
        return self.b(h), h.view(h.shape[0], 4, 4)


def _seeded(module_type):
    torch.manual_seed(0)
    return module_type().eval()


def test_mlp_static():
    model = _seeded(Mlp)
    x = torch.randn(4, 12)
    compiled = kiln.compile(model, (x,))
    for _ in range(2):
        x = torch.randn(4, 12)
        _same(compiled(x), model(x))
    assert len(compiled.engines) == 1 and not compiled.fallbacks
    assert compiled.engines[0].profiles == []  # no dynamic dims: one static engine
    with pytest.raises(kiln.BindingError, match="expected shape"):
        compiled(torch.randn(5, 12))


def test_small_cnn_dynamic_batch():
    model = _seeded(SmallCnn)
    compiled = kiln.compile(model, (torch.randn(2, 3, 16, 16),), dynamic={"images": {0: (1, 2, 8)}})
    assert [p.describe() for p in compiled.engines[0].profiles] == ["images [1..8, 3, 16, 16]"]
    for batch in (1, 3, 8):
        x = torch.randn(batch, 3, 16, 16)
        _same(compiled(x), model(x))


def test_transformer_block_dynamic_batch_and_sequence():
    model = _seeded(Block)
    compiled = kiln.compile(model, (torch.randn(2, 10, 32),), dynamic={"x": {0: (1, 2, 4), 1: (1, 16, 48)}})
    assert [p.describe() for p in compiled.engines[0].profiles] == ["x [1..4, 1..48, 32]"]
    for batch, seq in [(1, 1), (2, 10), (4, 48), (3, 17)]:
        x = torch.randn(batch, seq, 32)
        _same(compiled(x), model(x))


def test_pytree_inputs_and_outputs():
    model = _seeded(Pytrees)
    batch = {"x": torch.randn(3, 8), "bias": torch.randn(8)}
    compiled = kiln.compile(model, (batch, torch.tensor(2.0)), dynamic={"batch": {"x": {0: (1, 3, 16)}}})
    for rows in (1, 3, 16):
        batch = {"x": torch.randn(rows, 8), "bias": torch.randn(8)}
        got, want = compiled(batch, torch.tensor(0.5)), model(batch, torch.tensor(0.5))
        _same(got, want)
        assert got[1]["top"].dtype == torch.int64


def test_custom_op_falls_back_to_pytorch_and_matches():
    model = _seeded(WithCustomOp)
    with pytest.warns(kiln.torch_backend.FallbackWarning) as caught:
        compiled = kiln.compile(model, (torch.randn(3, 8),), dynamic={"x": {0: (1, 3, 32)}})
    assert len(caught) == 1  # once, at compile time
    message = str(caught[0].message)
    assert "kilntest.scaled_relu.default" in message and "the ONNX exporter has no translation" in message
    assert "test_compile.py" in message  # where: the model's source line
    assert [r.kind for r in compiled.runners] == ["kiln", "torch", "kiln"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # calls do not warn again
        for batch in (1, 3, 32):
            x = torch.randn(batch, 8)
            _same(compiled(x), model(x))
    text = str(compiled.explain())
    assert "2 kiln engine(s), 1 in PyTorch" in text and "fell back to PyTorch (1 op(s))" in text
    assert "torch_1" in text and "%" in text  # each stage's share of the time


def test_an_onnx_op_kiln_lacks_moves_to_pytorch(monkeypatch):
    """The exporter translates torch.sin to ONNX Sin; were kiln without Sin, the op it came from
    would run in PyTorch and the split be made again (simulated: kiln's op table hides Sin)."""
    real = torch_frontend.lookup
    monkeypatch.setattr(torch_frontend, "lookup", lambda op, domain="": None if op == "Sin" else real(op, domain))

    class SinInside(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

        def forward(self, x):
            return self.b(torch.sin(self.a(x)))

    model = _seeded(SinInside)
    with pytest.warns(kiln.torch_backend.FallbackWarning, match=r"aten\.sin\.default .*ONNX ai\.onnx::Sin"):
        compiled = kiln.compile(model, (torch.randn(2, 6),))
    assert [r.kind for r in compiled.runners] == ["kiln", "torch", "kiln"]
    x = torch.randn(2, 6)
    _same(compiled(x), model(x))


def test_save_and_load_without_the_module_source(tmp_path):
    model = _seeded(WithCustomOp)
    with pytest.warns(kiln.torch_backend.FallbackWarning):
        compiled = kiln.compile(model, (torch.randn(3, 8),), dynamic={"x": {0: (1, 3, 32)}})
    compiled.save(tmp_path / "compiled")
    x = torch.randn(5, 8)
    torch.save({"x": x, "want": model(x)}, tmp_path / "io.pt")
    assert sorted(p.name for p in (tmp_path / "compiled").iterdir()) == [
        "kiln_0.kiln", "kiln_2.kiln", "manifest.json", "torch_1.pt2"]
    # a fresh process: kiln and the custom op's library, not this file (WithCustomOp is unknown there)
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import custom_ops
        import kiln.torch_backend
        compiled = kiln.torch_backend.load({str(tmp_path / "compiled")!r})
        data = torch.load({str(tmp_path / "io.pt")!r})
        got = compiled(data["x"])
        for g, w in zip(got, data["want"]):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        print(compiled.explain())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kilntest.scaled_relu" in done.stdout
    # without the custom op's library, the PyTorch stage cannot load: said so
    script = f"import kiln.torch_backend; kiln.torch_backend.load({str(tmp_path / 'compiled')!r})"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode != 0 and "import the library that registers its custom ops first" in done.stderr


def test_fp16_engine_keeps_float32_outputs():
    model = _seeded(Mlp)
    compiled = kiln.compile(model, (torch.randn(4, 12),), precision="fp16")
    assert compiled.engines[0].plan.header["build_config"]["precision"] == "fp16"
    x = torch.randn(4, 12)
    _same(compiled(x), model(x), torch.float16)  # half storage, float32 bindings: dtype as the module's


def test_torch_compile_backend_kiln():
    captured = []
    real = kiln.torch_backend.kiln_backend

    def spy(graph_module, example_inputs, **kwargs):
        captured.append(compiled := real(graph_module, example_inputs, **kwargs))
        return compiled

    torch._dynamo.reset()
    for module_type in (Mlp, Block):
        model = _seeded(module_type)
        fast = torch.compile(model, backend="kiln")
        x = torch.randn(2, 7, 12) if module_type is Mlp else torch.randn(2, 7, 32)
        _same(fast(x), model(x))
    # parameters reach kiln as weights (folded, pre-packed), not as inputs of every call
    model = _seeded(Mlp)
    fast = torch.compile(model, backend=spy)
    x = torch.randn(3, 12)
    _same(fast(x), model(x))
    compiled_module, = captured[0].compiled.values()
    engine_inputs = compiled_module.engines[0].inputs  # x alone: no weight among them
    assert len(engine_inputs) == 1 and engine_inputs[0].shape[1:] == [12]  # dynamo may have made rows dynamic
    # the custom op: dynamo hands the backend the graph with it, and kiln falls back around it
    model = _seeded(WithCustomOp)
    fast = torch.compile(model, backend="kiln")
    with pytest.warns(kiln.torch_backend.FallbackWarning):
        got = fast(x := torch.randn(3, 8))
    _same(got, model(x))


def _count_builds(monkeypatch) -> list:
    builds = []
    real = kiln.torch_backend.kiln_build
    monkeypatch.setattr(kiln.torch_backend, "kiln_build", lambda *a, **k: builds.append(a) or real(*a, **k))
    return builds


def test_torch_compile_dynamic_dims_build_one_engine(monkeypatch):
    """Dims dynamo made dynamic become one engine with an optimization profile over them (dynamo's
    range, kiln's default maximum where dynamo has none), not one engine per shape."""
    builds = _count_builds(monkeypatch)
    backends = []
    real = kiln.torch_backend.kiln_backend
    torch._dynamo.reset()
    model = _seeded(Block)
    fast = torch.compile(model, backend=lambda g, e: backends.append(real(g, e)) or backends[-1], dynamic=True)
    for batch, seq in [(2, 7), (3, 9), (4, 16), (2, 30), (3, 5)]:
        x = torch.randn(batch, seq, 32)
        _same(fast(x), model(x))
    assert len(builds) == 1 and len(backends) == 1
    engine, = backends[0].compiled[("dynamic", 1e-5, 0.0, 1e-5)].engines  # eps, dropout: written into the graph
    assert [p.describe() for p in engine.profiles] == ["inputs_0 [2..64, 2..512, 32]"]


def test_torch_compile_automatic_dynamic_and_a_rebuild_past_the_profile(monkeypatch):
    """Without dynamic=True dynamo compiles the first shape statically and marks the dims that changed
    dynamic at the second: two builds for a stream of shapes. A size past kiln's default maximum (no
    bound from dynamo) rebuilds that engine once, wider, with a warning."""
    builds = _count_builds(monkeypatch)
    torch._dynamo.reset()
    model = _seeded(Mlp)
    fast = torch.compile(model, backend="kiln")
    for batch in (3, 5, 9, 2, 17, 64):
        x = torch.randn(batch, 12)
        _same(fast(x), model(x))
    assert len(builds) == 2
    with pytest.warns(kiln.EngineRebuildWarning, match=r"outside the engine's profile \(s\w+=2\.\.64\)"):
        _same(fast(x := torch.randn(100, 12)), model(x))
    _same(fast(x := torch.randn(80, 12)), model(x))
    assert len(builds) == 3
