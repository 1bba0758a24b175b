"""Refit on a CUDA device (skipped without CUDA): an int8 engine of kiln's calibration quantized in
`emulate` mode stores its weights in fp16 there (dequantized int8 values, re-derived through the same
half-precision lowering), one in `auto` mode quantized nothing (no int8 kernel on CUDA yet) and refits as
a float engine; a refittable kiln.compile of CUDA modules takes new weights in its kiln and PyTorch stages."""

from __future__ import annotations

import pytest
import torch

import kiln
import kiln.torch_backend
from tests.frontdoor.test_compile_refit import CASES, WithGain, _made, _tactics
from tests.frontdoor.test_cuda import exact_float32  # noqa: F401  autouse: no TF32 in torch's float32 reference
from tests.frontdoor.test_refit_int8 import NETS, _batches, _save

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("quantization", ["emulate", "auto"])
@pytest.mark.parametrize("net", ["conv", "block"])
def test_int8_refit_on_cuda_equals_a_fresh_build(tmp_path, net, quantization):
    paths = _save(tmp_path, net)
    cache = str(tmp_path / "ranges.json")
    options = dict(device="cuda", precision="int8", quantization=quantization, calibrator="minmax",
                   timing_cache=str(tmp_path / "timing.json"), profiles=[{"x": NETS[net][3]}],
                   calibration_cache=cache)
    engine = kiln.build(paths[0], calibration=_batches(net, 0, 3), **options)
    fresh = kiln.build(paths[1], **({} if quantization == "emulate" else {"calibration": _batches(net, 0, 3)}),
                       **options)
    report = engine.refit(paths[1])
    if quantization == "emulate":
        assert report.activation_scales.startswith("kept:")
    else:
        assert "no int8 kernel on cuda" in report.activation_scales and report.requantized == []
    for batch in _batches(net, 7, 2):
        x = torch.from_numpy(batch["x"]).cuda()
        got, want = engine.run({"x": x})["y"], fresh.run({"x": x})["y"]
        if [s.tactic for s in engine.plan.program.steps] == [s.tactic for s in fresh.plan.program.steps]:
            assert torch.equal(got, want)
        else:  # the accuracy check reverted a layer in one build only: same maths, other kernels
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_compile_refit_on_cuda(tmp_path):
    module_type, example, dynamic, batches = CASES["cnn"]
    old, new = _made(module_type, 0).cuda(), _made(module_type, 1).cuda()
    options = dict(dynamic=dynamic, refittable=True, timing_cache=str(tmp_path / "timing.json"))
    compiled = kiln.compile(old, (example(2).cuda(),), **options)
    compiled.refit(new.state_dict())
    fresh = kiln.compile(new, (example(2).cuda(),), **options)
    with torch.no_grad():
        for batch in batches:
            x = example(batch).cuda()
            got = compiled(x)
            assert got.is_cuda
            torch.testing.assert_close(got, new(x), rtol=1e-4, atol=1e-4)
            if _tactics(compiled) == _tactics(fresh):
                assert torch.equal(got, fresh(x))
    # a PyTorch stage on the device takes its weight too
    old, new = _made(WithGain, 0).cuda(), _made(WithGain, 1).cuda()
    with pytest.warns(kiln.torch_backend.FallbackWarning):
        compiled = kiln.compile(old, (torch.randn(3, 8, device="cuda"),), dynamic={"x": {0: (1, 3, 16)}},
                                refittable=True)
    compiled.load_state_dict(new.state_dict())
    x = torch.randn(5, 8, device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), new(x), rtol=1e-4, atol=1e-4)
