"""CompiledModule.refit / load_state_dict: a module compiled with refittable=True takes another module's
weights in every stage, kiln engines (BatchNorm folded, weights transposed and merged, re-derived by
kiln/builder/refit.py) and PyTorch stages alike, without re-export or rebuild. Then it computes what the
new module computes (fp32 tolerance) and what a fresh kiln.compile of it computes (bit for bit when both
run the same tactics: one timing cache)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kiln
import kiln.torch_backend
from tests.frontdoor.test_compile import Block
from kiln.builder.refit import RefitError

# float32: the same layers computed by kiln's kernels (BN folded into the conv, fused epilogues) and by
# torch's in another order; a few ulps over a handful of layers
RTOL, ATOL = 1e-5, 1e-5


@torch.library.custom_op("kilnrefittest::channel_gain", mutates_args=())
def channel_gain(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """An op kiln cannot know, reading a weight: its stage runs in PyTorch and must take the new gain."""
    return x * gain


@channel_gain.register_fake
def _(x, gain):
    return torch.empty_like(x)


class SmallCnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1, groups=2), nn.BatchNorm2d(16), nn.ReLU6(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(16, 10)

    def forward(self, images):
        return self.head(torch.flatten(self.features(images), 1))


class WithGain(nn.Module):
    """Linear -> channel_gain (PyTorch, reads self.gain) -> Linear: kiln, PyTorch, kiln stages."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.gain = nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, x):
        return self.b(torch.ops.kilnrefittest.channel_gain(self.a(x), self.gain))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 5))

    def forward(self, x):
        return self.body(x)


def _made(module_type, seed: int) -> nn.Module:
    """A module as training leaves it: every weight moved, so no LayerNorm weight is 1 nor any bias 0,
    and BatchNorm statistics that are not the identity."""
    torch.manual_seed(seed)
    model = module_type().eval()
    with torch.no_grad():
        for name, value in model.state_dict().items():
            if not value.is_floating_point():
                continue
            if name.endswith("running_var"):
                value.uniform_(0.5, 2.0)
            elif name.endswith("running_mean"):
                value.uniform_(-0.5, 0.5)
            else:
                value.add_(0.05 * torch.randn_like(value))
    return model


CASES = {
    "cnn": (SmallCnn, lambda b: torch.randn(b, 3, 16, 16), {"images": {0: (1, 2, 8)}}, (1, 2, 5)),
    "block": (Block, lambda b: torch.randn(b, 7, 32), {"x": {0: (1, 2, 4), 1: (2, 7, 16)}}, (1, 3)),
}


def _tactics(compiled) -> list:
    return [step.tactic for engine in compiled.engines for step in engine.plan.program.steps]


@pytest.mark.parametrize("case", ["cnn", "block"])
def test_refit_equals_the_new_module_and_a_fresh_compile(tmp_path, case):
    module_type, example, dynamic, batches = CASES[case]
    old, new = _made(module_type, 0), _made(module_type, 1)
    options = dict(dynamic=dynamic, refittable=True, timing_cache=str(tmp_path / "timing.json"))
    compiled = kiln.compile(old, (example(2),), **options)
    new_before = {k: v.clone() for k, v in new.state_dict().items()}
    if case == "cnn":
        report = compiled.refit(new)
    else:
        report = compiled.load_state_dict(new.state_dict())
    assert list(report.stages) == ["kiln_0"] and report.stages["kiln_0"].changed
    if case == "cnn":  # eval BatchNorm never reads its counter
        assert report.unused == ["features.1.num_batches_tracked", "features.5.num_batches_tracked"]
    assert all(torch.equal(v, new_before[k]) for k, v in new.state_dict().items())  # the module given: untouched
    fresh = kiln.compile(new, (example(2),), **options)
    same_tactics = _tactics(compiled) == _tactics(fresh)
    with torch.no_grad():
        for batch in batches:
            x = example(batch)
            got = compiled(x)
            torch.testing.assert_close(got, new(x), rtol=RTOL, atol=ATOL)
            if same_tactics:
                assert torch.equal(got, fresh(x))  # bit for bit: the same derived weights, the same kernels
            else:  # the accuracy check reverted a layer in one build: same maths, other kernels
                torch.testing.assert_close(got, fresh(x), rtol=RTOL, atol=ATOL)
            assert not torch.allclose(got, old(x), rtol=1e-3, atol=1e-3)


def test_the_pytorch_stages_take_their_weights_too_also_after_save_and_load(tmp_path):
    old, new = _made(WithGain, 0), _made(WithGain, 1)
    with pytest.warns(kiln.torch_backend.FallbackWarning, match="kilnrefittest.channel_gain"):
        compiled = kiln.compile(old, (torch.randn(3, 8),), dynamic={"x": {0: (1, 3, 16)}}, refittable=True)
    assert [r.kind for r in compiled.runners] == ["kiln", "torch", "kiln"]
    compiled.save(tmp_path / "old")
    report = compiled.refit(new)
    assert report.stages["torch_1"] == ["gain"]
    assert set(report.stages) == {"kiln_0", "torch_1", "kiln_2"}
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), new(x), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(old(x), kiln.torch_backend.load(tmp_path / "old")(x), rtol=RTOL, atol=ATOL)
    # saved after the refit: the PyTorch stage's archive holds the new gain
    compiled.save(tmp_path / "refit")
    with torch.no_grad():
        torch.testing.assert_close(kiln.torch_backend.load(tmp_path / "refit")(x), new(x), rtol=RTOL, atol=ATOL)
    # a loaded compiled module refits as well (its stages' ONNX models and archives are in the folder)
    loaded = kiln.torch_backend.load(tmp_path / "old")
    loaded.load_state_dict(new.state_dict())
    loaded.save(tmp_path / "again")
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), new(x), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(kiln.torch_backend.load(tmp_path / "again")(x), new(x), rtol=RTOL, atol=ATOL)


def test_part_of_a_state_dict_refits_those_weights(tmp_path):
    old, new = _made(Mlp, 0), _made(Mlp, 1)
    compiled = kiln.compile(old, (torch.randn(4, 12),), refittable=True)
    compiled.refit({"body.2.weight": new.body[2].weight, "body.2.bias": new.body[2].bias})
    compiled.refit({"body.0.weight": new.body[0].weight})  # the earlier refit's weights stay
    mixed = _made(Mlp, 0)
    mixed.load_state_dict({**new.state_dict(), "body.0.bias": old.body[0].bias})
    x = torch.randn(4, 12)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), mixed(x), rtol=RTOL, atol=ATOL)


def test_mismatched_keys_shapes_and_dtypes_are_all_listed(tmp_path):
    old = _made(Block, 0)
    compiled = kiln.compile(old, (torch.randn(2, 7, 32),), refittable=True)
    x = torch.randn(2, 7, 32)
    before = compiled(x)
    state = _made(Block, 1).state_dict()
    state["mlp.0.weight"] = state["mlp.0.weight"].t()  # [32, 128]: transposed
    state["ln1.bias"] = state["ln1.bias"].double()
    state["mlp.9.weight"] = torch.zeros(3)  # no such layer
    del state["ln2.weight"]
    with pytest.raises(RefitError) as refused:
        compiled.load_state_dict(state)
    message = str(refused.value)
    assert "unexpected key(s) ['mlp.9.weight']" in message
    assert "missing key(s) ['ln2.weight']" in message
    assert "'mlp.0.weight': the module holds torch.float32 [128, 32], given torch.float32 [32, 128]" in message
    assert "'ln1.bias': the module holds torch.float32 [32], given torch.float64 [32]" in message
    assert torch.equal(compiled(x), before)  # nothing changed


def test_a_compile_without_refittable_is_refused_with_the_reason():
    compiled = kiln.compile(_made(SmallCnn, 0), (torch.randn(2, 3, 16, 16),))
    with pytest.raises(RefitError, match=r"not compiled refittable.*refittable=True"):
        compiled.refit(_made(SmallCnn, 1))


def test_fp16_stages_refit_as_a_fresh_compile(tmp_path):
    old, new = _made(Mlp, 0), _made(Mlp, 1)
    options = dict(precision="fp16", refittable=True, timing_cache=str(tmp_path / "timing.json"))
    compiled = kiln.compile(old, (torch.randn(4, 12),), **options)
    compiled.refit(new)
    fresh = kiln.compile(new, (torch.randn(4, 12),), **options)
    x = torch.randn(4, 12)
    with torch.no_grad():
        if _tactics(compiled) == _tactics(fresh):
            assert torch.equal(compiled(x), fresh(x))
        torch.testing.assert_close(compiled(x), new(x), rtol=2e-2, atol=2e-2)  # half storage of the weights


def test_an_int8_compiled_module_keeps_its_calibrated_ranges(tmp_path):
    """kiln.compile(precision="int8"): its engines re-derive their int8 weights, scales and int32 biases
    from the new weights with the ranges calibrated at compile, as a fresh compile reading them from the
    calibration cache does (kiln/builder/refit.py)."""
    old, new = _made(Mlp, 0), _made(Mlp, 1)
    options = dict(precision="int8", calibrator="minmax", refittable=True, timing_cache=str(tmp_path / "timing.json"),
                   calibration_cache=str(tmp_path / "ranges.json"))
    calibration = [{"x": torch.randn(4, 12).numpy()} for _ in range(3)]
    compiled = kiln.compile(old, (torch.randn(4, 12),), calibration=calibration, **options)
    report = compiled.refit(new)
    assert report.stages["kiln_0"].activation_scales.startswith("kept: the 2 activation range(s)")
    fresh = kiln.compile(new, (torch.randn(4, 12),), **options)  # the ranges from the cache
    x = torch.randn(4, 12)
    with torch.no_grad():
        if _tactics(compiled) == _tactics(fresh):
            assert torch.equal(compiled(x), fresh(x))
        else:  # the accuracy check reverted a layer to its float tactic in one build: one quantization step
            torch.testing.assert_close(compiled(x), fresh(x), rtol=0, atol=0.05 * fresh(x).abs().max().item())
