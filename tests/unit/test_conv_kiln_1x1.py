"""cpu.conv.kiln_1x1: a 1x1 kiln::FusedConv as kiln's packed GEMM on its NHWC rows (kiln/tactics/cpu/gemm_packed.py)
(issue 11: ResNeXt-50's 1x1 layers on an AVX2 CPU).

The tactic is offered on AVX2 builds only, so on an AVX-512 machine these tests run in a process under
KILN_CPU_ISA=avx2 (test_the_1x1_tests_pass_under_the_avx2_cap); elsewhere the others skip, and that one runs them.

- The layer's own launch (outside a segment) against torch's conv2d in float64 on fresh random inputs: bias or none,
  ReLU / Clip / none, a residual added before or after the activation, 1 and 2 threads, a batch of 2.
- In an engine: ResNeXt bottlenecks whose 1x1 layers (two with the residual fused) run on it inside one native
  segment equal onnxruntime at the built batch and at others.
- What it refuses, in words.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import kiln
from kiln.builder import autotune
from kiln.kernels.cpu import cpu_features, gemm_native, native_loop, onednn
from kiln.plan.spec import StepSpec
from kiln.runtime.native import Segment
from kiln.tactics.registry import get
from kiln.tactics.tactic import InputMeta
from tests.unit.test_grouped_native import resnext_blocks
from tests.unit.test_squeeze_excite import onnxruntime_run

NAME = "cpu.conv.kiln_1x1"
# float32 sums of at most 160 products (plus bias and residual) against float64, unit-scale operands: ~1e-6 of
# the sum of |terms|
RTOL = 1e-5


def _offered() -> bool:
    return gemm_native.available() and gemm_native.linear_kernel().name.startswith("avx2")


needs_tactic = pytest.mark.skipif(not _offered(), reason="kiln's GEMM does not run its AVX2 kernel in this process "
                                  "(test_the_1x1_tests_pass_under_the_avx2_cap runs these where it can)")


def _seed(*case) -> int:
    return zlib.crc32(repr(case).encode())


def _step(activation: str = "", residual: bool = False, after: int = 0, size=(1, 16, 5, 5), **attributes) -> StepSpec:
    attributes = {"activation": activation, "residual_after_activation": after, **attributes}
    if activation == "Clip":
        attributes.update(alpha=0.0, beta=6.0)
    return StepSpec(name="node_pointwise", op_type="FusedConv", domain="kiln", inputs=[], outputs=["y"],
                    attributes=attributes, tactic=NAME,
                    tactic_config={"input_size": list(size), "residual": residual})


@needs_tactic
@pytest.mark.parametrize("activation", ["", "Relu", "Clip"])
@pytest.mark.parametrize("residual, after", [(False, 0), (True, 0), (True, 1)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("size, out", [((1, 40, 7, 9), 24), ((2, 64, 14, 14), 160)])
def test_launch_matches_float64_conv2d(activation, residual, after, threads, size, out):
    rng = np.random.default_rng(_seed(activation, residual, after, threads, size))
    n, c, h, wd = size
    w = torch.from_numpy(rng.standard_normal((out, c, 1, 1)).astype(np.float32))
    b = torch.from_numpy(rng.standard_normal(out).astype(np.float32)) if activation != "Relu" else None
    step = _step(activation, residual, after, size)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        launch = get(NAME).prepare(step, [None, w, b], torch.device("cpu"))
        for _ in range(2):  # fresh inputs each call
            x = torch.from_numpy(rng.standard_normal(size).astype(np.float32) * 3)
            r = torch.from_numpy(rng.standard_normal((n, out, h, wd)).astype(np.float32)) if residual else None
            got = launch(None, x.contiguous(memory_format=torch.channels_last), w, b,
                         r.contiguous(memory_format=torch.channels_last) if residual else None)
            y = torch.nn.functional.conv2d(x.double(), w.double(), None if b is None else b.double())
            if residual and not after:
                y = y + r.double()
            y = y.relu() if activation == "Relu" else y.clamp(0.0, 6.0) if activation == "Clip" else y
            if residual and after:
                y = y + r.double()
            assert tuple(got.shape) == (n, out, h, wd) and got.is_contiguous(memory_format=torch.channels_last)
            scale = torch.nn.functional.conv2d(x.double().abs(), w.double().abs()) + 1.0 + (r.abs() if residual else 0)
            err = ((got.double() - y).abs() / scale).max().item()
            assert err < RTOL, f"{err:.2e} relative to the sum of |terms|"
    finally:
        torch.set_num_threads(saved)


@pytest.fixture
def pointwise_wins(monkeypatch):
    """Every 1x1 layer on cpu.conv.kiln_1x1 whatever the timings (this test is about the layer in a segment, not the
    tuner's choice): its measured time halved against the best."""
    measure = autotune.measure

    def favour(fns, device, *args, **kwargs):
        times = measure(fns, device, *args, **kwargs)
        if NAME in times:
            times[NAME] = min(times.values()) / 2
        return times

    monkeypatch.setattr(autotune, "measure", favour)


@needs_tactic
@pytest.mark.skipif(not onednn.available(), reason="oneDNN is unavailable (the 3x3 convolutions)")
def test_engine_blocks_in_one_segment_match_onnxruntime(pointwise_wins):
    proto = resnext_blocks(groups=16, batch="N")
    shape = [2, 64, 14, 14]
    engine = kiln.build(proto.SerializeToString(), tactics=[NAME, "cpu.conv.onednn_direct"], shapes={"x": shape})
    steps = engine.plan.program.steps
    pointwise = [s for s in steps if s.tactic == NAME]
    # per block an expanding and a projecting 1x1 (the stride-2 shortcut is not stride 1), the projection's residual
    assert len(pointwise) == 4 and sum(bool(s.tactic_config.get("residual")) for s in pointwise) == 2
    segments = engine.program.segments
    assert len(segments) == 1 and len(segments[0].members) == len(steps)
    assert isinstance(engine.program.run_steps[0].fn, Segment)
    for batch in (2, 3, 1):  # the built batch, then others
        x = np.random.default_rng(_seed("engine", batch)).standard_normal((batch, *shape[1:])).astype(np.float32)
        want = onnxruntime_run(resnext_blocks(groups=16, batch=batch), {"x": x})
        np.testing.assert_allclose(engine.run({"x": x})["y"], want, rtol=1e-4, atol=1e-4)


X = InputMeta((1, 16, 5, 5), torch.float32, False)
W = InputMeta((8, 16, 1, 1), torch.float32, True)
B = InputMeta((8,), torch.float32, True)


@needs_tactic
@pytest.mark.parametrize("attributes, inputs, why", [
    ({}, [X, W, B], True),
    ({"strides": [2, 2]}, [X, W, B],
     "not a 1x1 convolution of one group at stride 1 without padding (kernel [1, 1], 1 groups, strides [2, 2], "
     "pads [0, 0, 0, 0])"),
    ({}, [X, InputMeta((8, 16, 3, 3), torch.float32, True), B],
     "not a 1x1 convolution of one group at stride 1 without padding (kernel [3, 3], 1 groups, strides [1, 1], "
     "pads [0, 0, 0, 0])"),
    ({"activation": "SwiGLU"}, [X, W, B], "activation 'SwiGLU' is not one kiln's GEMM applies to a convolution"),
    ({"final_activation": "Relu"}, [X, W, B], "a final activation: kiln's GEMM applies one activation"),
    ({}, [X, W, B, InputMeta((1, 8, 5, 1), torch.float32, False)],
     "residual [1, 8, 5, 1] is not a float32 [1, 8, 5, 5] like the output"),
    ({}, [X, InputMeta((8, 16, 1, 1), torch.float32, False), B],
     "the weight is not a constant float32 4-D tensor of the engine"),
])
def test_tactic_refuses_in_words(attributes, inputs, why):
    step = StepSpec(name="node_pointwise", op_type="FusedConv", domain="kiln", inputs=[], outputs=["y"],
                    attributes=attributes)
    assert get(NAME).supports(step, inputs) == why


def test_the_tactic_is_refused_where_the_gemm_runs_another_kernel():
    """An AVX-512 build keeps oneDNN's 1x1 convolutions (kiln's GEMM was measured against them under AVX2 only)."""
    if _offered() or not gemm_native.available():
        pytest.skip("kiln's GEMM runs its AVX2 kernel here, or is not built")
    why = get(NAME).supports(StepSpec(name="n", op_type="FusedConv", domain="kiln", inputs=[], outputs=["y"]),
                             [X, W, B])
    assert isinstance(why, str) and "AVX2 only" in why


def test_the_1x1_tests_pass_under_the_avx2_cap():
    """This file's tests again in a process under KILN_CPU_ISA=avx2 (kiln's GEMM on its AVX2 6x16 tile). The process
    is told apart by the cap itself, so it does not start another."""
    if cpu_features.isa_cap() == "avx2":
        pytest.skip("already under the cap (this is the capped run)")
    if cpu_features.isa() not in ("avx2", "avx512") or native_loop.find_compiler() is None:
        pytest.skip("needs an x86 CPU with AVX2 and a C compiler")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "KILN_CPU_ISA": "avx2", "PYTHONPATH": str(root)}
    for name in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider",
                           str(Path(__file__)), "-k", "not avx2_cap and not another_kernel"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout and " skipped" not in done.stdout, \
        done.stdout[-2000:]
