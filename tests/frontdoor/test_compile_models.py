"""kiln.compile on the zoo's real architectures against the modules' own outputs, at several shapes inside
the `dynamic` ranges: GPT-2, BERT and ResNet tiny, and full size (ResNet-50, BERT-base, GPT-2 small; slow:
minutes each on a 2-core CPU). The CUDA fp16 cases are in test_cuda.py."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

import kiln
import kiln.torch_backend
from kiln import zoo

TEXT = {"input_ids": {0: (1, 2, 4), 1: (2, 16, 64)}}
MASKED = {**TEXT, "attention_mask": TEXT["input_ids"]}
TEXT_SHAPES = [(2, 16), (1, 5), (4, 64), (3, 37)]
IMAGE = {"pixel_values": {0: (1, 2, 4)}}
IMAGE_SHAPES = [(2, 0), (1, 0), (4, 0), (3, 0)]

# name, dynamic ranges, (batch, seq) shapes inside them, tolerance (rtol, atol) in float32.
# Tiny: a few fp32 layers summed in another order than torch's. Full size (12-50 layers; BN folded into
# ResNet-50's convolutions, fused epilogues) measured here: max errors 4e-6 on BERT-base's hidden states
# (up to 5), 5e-6 on GPT-2's logits (up to 3), 1.4e-4 on ResNet-50's logits (up to 86).
CASES = [
    ("gpt2_tiny", TEXT, TEXT_SHAPES[:3], (1e-4, 1e-4)),
    ("bert_tiny", MASKED, TEXT_SHAPES[:3], (1e-4, 1e-4)),
    ("resnet_tiny", IMAGE, IMAGE_SHAPES[:3], (1e-4, 1e-4)),
]
FULL = [
    ("resnet50", IMAGE, IMAGE_SHAPES, (1e-4, 1e-3)),  # logits up to ~90: 1e-3 is ~1e-5 of their scale
    ("bert_base", MASKED, TEXT_SHAPES, (1e-4, 1e-4)),
    ("gpt2", TEXT, TEXT_SHAPES, (1e-4, 1e-4)),
]


def _inputs(spec, batch: int, seq: int, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v).to(device) for k, v in zoo.make_inputs(spec, batch=batch, seq=seq, seed=seed).items()}


def compile_and_compare(name: str, dynamic: dict, shapes: list[tuple[int, int]], check, device: str = "cpu",
                        **options) -> kiln.torch_backend.CompiledModule:
    """kiln.compile of the zoo model on an example inside the ranges, then every shape against the module
    (`check(got, want)`); the outputs must also differ between shapes (a test that cannot fail is none)."""
    model = zoo.torch_model(name).to(device)
    spec = zoo.get(name)
    example = _inputs(spec, batch=2, seq=16, seed=0, device=device)
    started = time.perf_counter()
    compiled = kiln.compile(model, (), example_kwargs=example, dynamic=dynamic, **options)
    print(f"{name}: compiled in {time.perf_counter() - started:.1f} s")
    assert not compiled.fallbacks, compiled.explain()
    outputs = []
    for batch, seq in shapes:
        x = _inputs(spec, batch, seq, seed=batch * 100 + seq, device=device)
        with torch.no_grad():
            want = model(**x)
        got = compiled(**x)
        assert got.dtype == want.dtype and got.device == want.device and got.shape == want.shape
        check(got, want)
        outputs.append(got)
    assert not torch.equal(outputs[0][:1, :1], outputs[1][:1, :1])
    return compiled


@pytest.mark.slow
@pytest.mark.parametrize("name,dynamic,shapes,tolerance", CASES, ids=[c[0] for c in CASES])
def test_zoo_tiny(name, dynamic, shapes, tolerance):
    rtol, atol = tolerance
    compile_and_compare(name, dynamic, shapes, lambda g, w: torch.testing.assert_close(g, w, rtol=rtol, atol=atol))


@pytest.mark.slow
@pytest.mark.parametrize("name,dynamic,shapes,tolerance", FULL, ids=[c[0] for c in FULL])
def test_zoo_full_size(name, dynamic, shapes, tolerance):
    rtol, atol = tolerance

    def check(got, want):
        print(f"  {list(want.shape)}: max |error| {(got - want).abs().max().item():.2e}, max |output| "
              f"{want.abs().max().item():.2e}")
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)

    torch.set_num_threads(2)
    compiled = compile_and_compare(name, dynamic, shapes, check, tuning_runs=3)
    engine = compiled.engines[0]
    profile = engine.profiles[0].describe()
    assert ("1..4" in profile) and (name == "resnet50" or "2..64" in profile), profile


@pytest.mark.parametrize("name,dynamic,shapes,tolerance", CASES, ids=[c[0] for c in CASES])
def test_torch_compile_backend_on_zoo_models(name, dynamic, shapes, tolerance):
    """torch.compile(module, backend="kiln", dynamic=True) on the zoo's GPT-2, BERT (with its mask) and ResNet
    architectures: the module's own outputs at several shapes, one kiln engine for all of them, none of
    them falling back to PyTorch."""
    rtol, atol = tolerance
    model = zoo.torch_model(name)
    spec = zoo.get(name)
    builds = []
    real = kiln.torch_backend.kiln_build

    def counting(*args, **kwargs):
        builds.append(args)
        return real(*args, **kwargs)

    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("error", kiln.torch_backend.FallbackWarning)  # a fallback would fail the test
        patch.setattr(kiln.torch_backend, "kiln_build", counting)
        fast = torch.compile(model, backend="kiln", dynamic=True)
        outputs = []
        for batch, seq in shapes:
            x = _inputs(spec, batch, seq, seed=batch * 100 + seq)
            with torch.no_grad():
                want = model(**x)
                got = fast(**x)
            want = want if isinstance(want, torch.Tensor) else want[0]
            got = got if isinstance(got, torch.Tensor) else got[0]
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
            outputs.append(got)
    assert builds, "kiln built nothing: the backend was not used"
    assert len(builds) <= 2, f"{len(builds)} builds for {len(shapes)} shapes"
    assert not torch.equal(outputs[0][:1, :1], outputs[1][:1, :1])
