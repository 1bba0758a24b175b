"""Small oneDNN layers and squeeze-excitation blocks on one thread where the machine is saturated (issue 11).

On a saturated machine (small_layers_serial: KILN_SERIAL_SMALL_LAYERS, else a 1-min load average of one
per CPU as the kernels load) a convolution or pooling whose activations hold fewer than SERIAL_ELEMENTS
floats and whose work is under SERIAL_MACS is created with OpenMP's count at 1 (onednn.creating_with_threads),
so oneDNN runs it in the calling thread with no parallel region to wait on; the SE kernel takes the same
decision. These tests force the decision either way and check: the rule, that the count is restored (and
is the calling thread's only), the serial primitives against torch on fresh inputs, and EfficientNet
against onnxruntime built that way. Speed: bench/results/efficientnet-cpu-2026-12-02.md, never asserted.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln import zoo
from kiln.builder import autotune
from kiln.kernels.cpu import onednn, onednn_primitives, se
from tests.models.test_zoo import assert_fp32_close, onnxruntime_session

pytestmark = pytest.mark.skipif(not onednn.available(), reason=f"oneDNN: {onednn.reason()}")

RTOL, ATOL = 1e-4, 1e-4  # fp32: oneDNN's depthwise/1x1 kernels sum in another order than torch's


@pytest.fixture
def busy(monkeypatch):
    monkeypatch.setattr(onednn_primitives, "_busy", lambda: True)


def test_only_small_layers_go_serial_and_only_when_busy(monkeypatch):
    threads_for = onednn_primitives.threads_for
    small, large = onednn_primitives.SERIAL_ELEMENTS - 1, onednn_primitives.SERIAL_ELEMENTS
    light, heavy = onednn_primitives.SERIAL_MACS - 1, onednn_primitives.SERIAL_MACS
    monkeypatch.setattr(onednn_primitives, "_busy", lambda: True)
    assert threads_for(small, light) == 1 and threads_for(large, light) is None and threads_for(small, heavy) is None
    monkeypatch.setattr(onednn_primitives, "_busy", lambda: False)
    assert threads_for(small, light) is None


def test_saturated_is_one_load_per_cpu_and_the_user_decides():
    serial = onednn_primitives.small_layers_serial
    assert serial({}, load=1.4, cpus=2) is False  # cores free at the moment often enough: OpenMP's count
    assert serial({}, load=2.0, cpus=2) is True
    assert serial({"KILN_SERIAL_SMALL_LAYERS": "1"}, load=0.0, cpus=2) is True
    assert serial({"KILN_SERIAL_SMALL_LAYERS": "0"}, load=9.0, cpus=2) is False


def test_the_count_is_restored_and_other_threads_keep_theirs():
    get_max, _ = onednn._openmp_threads(onednn.load().lib)
    before, seen = get_max(), {}
    if before < 2:
        pytest.skip("one OpenMP thread: nothing to lower")
    with onednn.creating_with_threads(1):
        seen["inside"] = get_max()
        other = threading.Thread(target=lambda: seen.setdefault("other", get_max()))
        other.start(), other.join()
    assert seen["inside"] == 1 and get_max() == before == torch.get_num_threads()
    assert seen["other"] > 1  # the count is the calling thread's own


@pytest.mark.parametrize("channels, size, kernel, groups, activation", [
    (1152, 7, 5, 1152, "SiLU"),  # EfficientNet-B0's last depthwise layers
    (480, 14, 3, 480, "SiLU"),
    (672, 14, 1, 1, ""),  # a projection
    (37, 9, 3, 1, "Relu"),  # odd channels, a dense 3x3
])
def test_serial_convolutions_match_torch(busy, channels, size, kernel, groups, activation):
    g = torch.Generator().manual_seed(channels)
    out = channels if groups > 1 else 24
    x = torch.randn(1, channels, size, size, generator=g).contiguous(memory_format=torch.channels_last)
    w = torch.randn(out, channels // groups, kernel, kernel, generator=g) * 0.2
    b = torch.randn(out, generator=g)
    conv = onednn_primitives.Conv2d(w, b, list(x.shape), [1, 1], [kernel // 2] * 4, [1, 1], groups,
                                    onednn.eltwise_for(activation, 0.0, 0.0), False, False)
    assert conv.threads == 1
    want = F.conv2d(x, w, b, padding=kernel // 2, groups=groups)
    want = {"SiLU": F.silu, "Relu": F.relu}.get(activation, lambda t: t)(want)
    np.testing.assert_allclose(conv(x).numpy(), want.numpy(), rtol=RTOL, atol=ATOL)


def test_a_large_convolution_keeps_openmps_threads(busy):
    x = torch.randn(1, 96, 112, 112).contiguous(memory_format=torch.channels_last)  # 1.2M floats (B0's expand)
    w = torch.randn(96, 1, 3, 3)
    conv = onednn_primitives.Conv2d(w, None, list(x.shape), [1, 1], [1] * 4, [1, 1], 96, None, False, False)
    assert conv.threads is None
    np.testing.assert_allclose(conv(x).numpy(), F.conv2d(x, w, padding=1, groups=96).numpy(), rtol=RTOL, atol=ATOL)


def test_a_heavy_convolution_keeps_openmps_threads(busy):
    x = torch.randn(1, 512, 7, 7).contiguous(memory_format=torch.channels_last)  # ResNet-50's last 3x3: 116M MACs
    w = torch.randn(512, 512, 3, 3) * 0.05
    conv = onednn_primitives.Conv2d(w, None, list(x.shape), [1, 1], [1] * 4, [1, 1], 1, None, False, False)
    assert conv.threads is None
    np.testing.assert_allclose(conv(x).numpy(), F.conv2d(x, w, padding=1).numpy(), rtol=RTOL, atol=ATOL)


def test_serial_global_pool_matches_torch(busy):
    x = torch.randn(2, 1280, 7, 7).contiguous(memory_format=torch.channels_last)
    pool = onednn_primitives.Pool2d(list(x.shape), "avg_exclude_padding", [7, 7], [1, 1], [0] * 4, [1, 1])
    assert pool.threads == 1
    np.testing.assert_allclose(pool(x).numpy(), x.mean(dim=(2, 3), keepdim=True).numpy(), rtol=1e-5, atol=1e-6)


def _efficientnet_matches_onnxruntime(name: str) -> None:
    exported = zoo.export(name)
    engine = kiln.build(str(exported.path))
    session = onnxruntime_session(exported.path)
    names = [o.name for o in session.get_outputs()]
    for seed in (3, 4):
        feeds = zoo.random_inputs(name, exported, seed=seed)
        got = engine.run(feeds)
        for n, want in zip(names, session.run(None, feeds)):
            assert_fp32_close(got[n], want, f"{name} {n} (seed {seed})")


@pytest.mark.skipif(not se.available(), reason=f"kiln's SE kernel is not built: {se.reason()}")
def test_efficientnet_tiny_built_busy_matches_onnxruntime(busy, monkeypatch):
    monkeypatch.setattr(autotune, "NATIVE_CREDIT_MS", 1e3)  # the native tactics (where the rule applies) win
    _efficientnet_matches_onnxruntime("efficientnet_tiny")


@pytest.mark.slow  # a B0 build with the search: ~40 s on 2 shared cores
@pytest.mark.skipif(not se.available(), reason=f"kiln's SE kernel is not built: {se.reason()}")
def test_efficientnet_b0_built_busy_matches_onnxruntime(busy, monkeypatch):
    monkeypatch.setattr(autotune, "NATIVE_CREDIT_MS", 1e3)
    _efficientnet_matches_onnxruntime("efficientnet_b0")
