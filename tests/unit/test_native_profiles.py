"""Native segments at every shape of a profile: a CNN with a dynamic batch runs its bound oneDNN
primitives at other batch sizes too (runs of its planned segment, the images left over on its one-image view:
tests/unit/test_image_batches.py), and matches onnxruntime."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import kiln
from kiln import zoo
from kiln.kernels.cpu import onednn
from kiln.runtime import native

pytestmark = pytest.mark.skipif(not onednn.available(), reason="needs libdnnl (onednn-cpu-gomp)")


@pytest.fixture(scope="module")
def resnet():
    exported = zoo.export("resnet_tiny", dynamic=True)
    engine = kiln.build(str(exported.path), profiles=[{"pixel_values": "1x3x64x64,2x3x64x64,6x3x64x64"}])
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    return engine, session


def test_other_batch_sizes_run_bound_segments_and_match_onnxruntime(resnet):
    engine, session = resnet
    program = engine.program
    assert program.segments, "the tuned engine has no native segment to test"
    rng = np.random.default_rng()
    for batch in sorted({1, 6, 2, int(rng.integers(3, 6))}):
        x = rng.standard_normal((batch, 3, 64, 64), dtype=np.float32)
        got = next(iter(engine.run({"pixel_values": x}).values()))
        np.testing.assert_allclose(got, session.run(None, {"pixel_values": x})[0], rtol=1e-3, atol=1e-3,
                                   err_msg=f"batch {batch}")  # 1e-3: a conv stack's fp32 sums in another order
    bound = [size for s in program.segments for size, other in s.resized.items() if other is not None]
    assert any(size[0][0] in (1, 6) for size in bound), "no segment was bound at another batch size"
    assert not [size for s in program.segments for size, other in s.resized.items() if other is None]


def test_the_bound_sizes_are_bounded(resnet, monkeypatch):
    engine, _ = resnet
    monkeypatch.setattr(native, "RESIZED", 2)
    rng = np.random.default_rng()
    context = engine.create_execution_context(pad_first_calls=False)  # every new batch binds (none run padded)
    for batch in (1, 3, 4, 5, 6):
        context.run({"pixel_values": rng.standard_normal((batch, 3, 64, 64), dtype=np.float32)})
    assert all(len(s.resized) <= 2 for s in context.program.segments)  # its lane's (the engine's, when free)
