"""Small oneDNN layers and squeeze-excitation blocks bound on one thread as well as on OpenMP's count (issue 11).

A convolution or pooling whose activations hold fewer than SERIAL_ELEMENTS floats and whose work is under
SERIAL_MACS is "small" (onednn_primitives.thread_forms): it is created twice, on OpenMP's count and on one
thread (onednn.creating_with_threads), so oneDNN runs the second in the calling thread with no parallel region
to wait on; a native segment runs whichever form its recent run times favour (kiln/kernels/cpu/form_choice.py,
tests/unit/test_form_choice.py). KILN_SERIAL_SMALL_LAYERS=1 / 0 builds only the serial / parallel form. These
tests check: the rule, that the count is restored (and is the calling thread's only), both forms of the
primitives against torch on fresh inputs, and EfficientNet against onnxruntime with every segment held in
either form. Speed: bench/results/cpu-load-2026-12-03.md, never asserted.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln import zoo
from kiln.kernels.cpu import onednn, onednn_primitives, se
from kiln.kernels.cpu.form_choice import FormChooser
from tests.models.test_zoo import assert_fp32_close, onnxruntime_session

pytestmark = pytest.mark.skipif(not onednn.available(), reason=f"oneDNN: {onednn.reason()}")

RTOL, ATOL = 1e-4, 1e-4  # fp32: oneDNN's depthwise/1x1 kernels sum in another order than torch's


@pytest.fixture
def forced_serial(monkeypatch):
    monkeypatch.setenv("KILN_SERIAL_SMALL_LAYERS", "1")


@pytest.fixture
def measured(monkeypatch):
    monkeypatch.delenv("KILN_SERIAL_SMALL_LAYERS", raising=False)
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: a serial form would be the parallel one")


def test_only_small_layers_get_a_serial_form(monkeypatch):
    forms = onednn_primitives.thread_forms
    small, large = onednn_primitives.SERIAL_ELEMENTS - 1, onednn_primitives.SERIAL_ELEMENTS
    light, heavy = onednn_primitives.SERIAL_MACS - 1, onednn_primitives.SERIAL_MACS
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert forms(small, light, "measured") == (None, 1)  # per call on OpenMP's count; a serial form besides
    assert forms(large, light, "measured") == (None,) and forms(small, heavy, "measured") == (None,)
    assert forms(small, light, "serial") == (1,) and forms(large, light, "serial") == (None,)
    assert forms(small, light, "parallel") == (None,)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert forms(small, light, "measured") == (None,)  # one thread: the two forms would be one


def test_the_user_decides_else_it_is_measured():
    mode = onednn_primitives.small_layers_mode
    assert mode({}) == "measured"
    assert mode({"KILN_SERIAL_SMALL_LAYERS": "1"}) == "serial"
    assert mode({"KILN_SERIAL_SMALL_LAYERS": "0"}) == "parallel"


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


def _run_bound(bound, x: torch.Tensor, out_size: tuple[int, ...], serial: bool) -> torch.Tensor:
    """One execution of a Bound (its serial form or its own) on x, into a fresh channels-last tensor."""
    y = torch.empty(out_size).contiguous(memory_format=torch.channels_last)
    bound.rebind("src", x.data_ptr())
    bound.rebind("dst", y.data_ptr())
    lib = onednn.load()
    (_fn, primitive, nargs, args), = bound.serial_calls() if serial else bound.calls()
    onednn._check(lib.lib.dnnl_primitive_execute(primitive, lib.stream, nargs, args), bound.what)
    return y


CASES = [
    (1152, 7, 5, 1152, "SiLU"),  # EfficientNet-B0's last depthwise layers
    (480, 14, 3, 480, "SiLU"),
    (672, 14, 1, 1, ""),  # a projection
    (37, 9, 3, 1, "Relu"),  # odd channels, a dense 3x3
]


def _convolution(channels, size, kernel, groups, activation):
    g = torch.Generator().manual_seed(channels)
    out = channels if groups > 1 else 24
    x = torch.randn(1, channels, size, size, generator=g).contiguous(memory_format=torch.channels_last)
    w = torch.randn(out, channels // groups, kernel, kernel, generator=g) * 0.2
    b = torch.randn(out, generator=g)
    conv = onednn_primitives.Conv2d(w, b, list(x.shape), [1, 1], [kernel // 2] * 4, [1, 1], groups,
                                    onednn.eltwise_for(activation, 0.0, 0.0), False, False)
    want = F.conv2d(x, w, b, padding=kernel // 2, groups=groups)
    want = {"SiLU": F.silu, "Relu": F.relu}.get(activation, lambda t: t)(want)
    return conv, x, want


@pytest.mark.parametrize("channels, size, kernel, groups, activation", CASES)
def test_forced_serial_convolutions_match_torch(forced_serial, channels, size, kernel, groups, activation):
    conv, x, want = _convolution(channels, size, kernel, groups, activation)
    bound = conv.bind(0, 0)
    assert conv.threads == 1 and bound.serial_primitive is None  # one form: the serial one
    np.testing.assert_allclose(conv(x).numpy(), want.numpy(), rtol=RTOL, atol=ATOL)
    # what a segment runs: the bound handle, made at the count of its descriptor (1) while OpenMP's is 2 (it was made
    # at OpenMP's count and MobileNetV2's build crashed in it)
    got = _run_bound(bound, x, tuple(want.shape), serial=False)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("channels, size, kernel, groups, activation", CASES)
def test_both_forms_of_a_small_convolution_match_torch(measured, channels, size, kernel, groups, activation):
    conv, x, want = _convolution(channels, size, kernel, groups, activation)
    bound = conv.bind(0, 0)
    assert conv.threads is None and bound.serial_primitive is not None
    for serial in (False, True):
        got = _run_bound(bound, x, tuple(want.shape), serial)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=RTOL, atol=ATOL, err_msg=f"serial={serial}")
    for _ in range(6):  # the per-call path: its own chooser measures both forms in the first four calls
        np.testing.assert_allclose(conv(x).numpy(), want.numpy(), rtol=RTOL, atol=ATOL)
    assert min(conv._forms.chooser.runs.values()) >= 2


def test_a_large_convolution_has_one_form(measured):
    x = torch.randn(1, 192, 112, 112).contiguous(memory_format=torch.channels_last)  # 2.4M floats: past the bound
    w = torch.randn(192, 1, 3, 3)
    conv = onednn_primitives.Conv2d(w, None, list(x.shape), [1, 1], [1] * 4, [1, 1], 192, None, False, False)
    assert conv.threads is None and conv.bind(0, 0).serial_primitive is None
    np.testing.assert_allclose(conv(x).numpy(), F.conv2d(x, w, padding=1, groups=192).numpy(), rtol=RTOL, atol=ATOL)


def test_efficientnet_b0s_largest_layers_are_small(measured):
    """B0's depthwise layer at 112x112 (96 channels, 1.2M floats a side) has a serial form since 2026-12-04d: the
    serial form of a B0 segment then forks no OpenMP thread at all."""
    x = torch.randn(1, 96, 112, 112).contiguous(memory_format=torch.channels_last)
    w = torch.randn(96, 1, 3, 3)
    conv = onednn_primitives.Conv2d(w, None, list(x.shape), [2, 2], [0, 0, 1, 1], [1, 1], 96, None, False, False)
    bound = conv.bind(0, 0)
    assert conv.threads is None and bound.serial_primitive is not None
    want = F.conv2d(F.pad(x, (0, 1, 0, 1)), w, stride=2, groups=96)
    for serial in (False, True):
        got = _run_bound(bound, x, tuple(want.shape), serial)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=RTOL, atol=ATOL, err_msg=f"serial={serial}")


def test_one_openmp_thread_lowers_the_count_and_restores_it():
    get_max, _ = onednn._openmp_threads(onednn.load().lib)
    before, seen = get_max(), {}
    if before < 2:
        pytest.skip("one OpenMP thread: nothing to lower")
    with onednn.one_openmp_thread():
        seen["inside"] = get_max()
        with onednn.one_openmp_thread():  # nested: restores what it found
            pass
        seen["after nested"] = get_max()
        other = threading.Thread(target=lambda: seen.setdefault("other", get_max()))
        other.start(), other.join()
    assert seen["inside"] == seen["after nested"] == 1 and get_max() == before
    assert seen["other"] > 1  # the calling thread's count only


def test_a_heavy_convolution_has_one_form(measured):
    x = torch.randn(1, 512, 7, 7).contiguous(memory_format=torch.channels_last)  # ResNet-50's last 3x3: 116M MACs
    w = torch.randn(512, 512, 3, 3) * 0.05
    conv = onednn_primitives.Conv2d(w, None, list(x.shape), [1, 1], [1] * 4, [1, 1], 1, None, False, False)
    assert conv.threads is None and conv.bind(0, 0).serial_primitive is None
    np.testing.assert_allclose(conv(x).numpy(), F.conv2d(x, w, padding=1).numpy(), rtol=RTOL, atol=ATOL)


def test_both_forms_of_a_global_pool_match_torch(measured):
    x = torch.randn(2, 1280, 7, 7).contiguous(memory_format=torch.channels_last)
    pool = onednn_primitives.Pool2d(list(x.shape), "avg_exclude_padding", [7, 7], [1, 1], [0] * 4, [1, 1])
    want = x.mean(dim=(2, 3), keepdim=True)
    for serial in (False, True):
        got = _run_bound(pool.bind(0, 0), x, tuple(want.shape), serial)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"serial={serial}")


def test_forced_serial_global_pool_matches_torch(forced_serial):
    x = torch.randn(2, 1280, 7, 7).contiguous(memory_format=torch.channels_last)
    pool = onednn_primitives.Pool2d(list(x.shape), "avg_exclude_padding", [7, 7], [1, 1], [0] * 4, [1, 1])
    assert pool.threads == 1
    want = x.mean(dim=(2, 3), keepdim=True)
    np.testing.assert_allclose(pool(x).numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    got = _run_bound(pool.bind(0, 0), x, tuple(want.shape), serial=False)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


class _Held:
    """A chooser that always answers one form (and counts what it is told)."""

    def __init__(self, form: str):
        self.form, self.recorded = form, []

    def choose(self) -> str:
        return self.form

    def record(self, form: str, seconds: float) -> None:
        self.recorded.append(form)


def _efficientnet_matches_onnxruntime(name: str, forms: tuple[str, ...]) -> None:
    """The engine against onnxruntime with every segment held in each of `forms` (None: left to its chooser)."""
    exported = zoo.export(name)
    engine = kiln.build(str(exported.path))
    session = onnxruntime_session(exported.path)
    names = [o.name for o in session.get_outputs()]
    segments = engine.program.segments
    chosen = [s for s in segments if s.chooser is not None]
    assert chosen, "no segment has a serial form"
    for form in forms:
        held = {id(s): _Held(form) for s in chosen}
        for s in chosen:
            s.chooser = held[id(s)]
        for seed in (3, 4):
            feeds = zoo.random_inputs(name, exported, seed=seed)
            got = engine.run(feeds)
            for n, want in zip(names, session.run(None, feeds)):
                assert_fp32_close(got[n], want, f"{name} {n} (seed {seed}, {form} form)")
        assert all(h.recorded and set(h.recorded) == {form} for h in held.values())  # each ran, in that form
    for s in chosen:  # and left to the measured choice: each form measured in the first runs
        s.chooser = FormChooser()
    feeds = zoo.random_inputs(name, exported, seed=5)
    want = session.run(None, feeds)
    for _ in range(6):
        got = engine.run(feeds)
        for n, w in zip(names, want):
            assert_fp32_close(got[n], w, f"{name} {n} (measured choice)")
    assert all(min(s.chooser.runs.values()) >= 2 for s in chosen)


@pytest.mark.skipif(not se.available(), reason=f"kiln's SE kernel is not built: {se.reason()}")
@pytest.mark.usefixtures("native_tactics_win")  # the native tactics (where the forms apply) win
def test_efficientnet_tiny_in_both_forms_matches_onnxruntime(measured):
    _efficientnet_matches_onnxruntime("efficientnet_tiny", ("parallel", "serial"))


@pytest.mark.slow  # a B0 build with the search: ~40 s on 2 shared cores
@pytest.mark.skipif(not se.available(), reason=f"kiln's SE kernel is not built: {se.reason()}")
@pytest.mark.usefixtures("native_tactics_win")
def test_efficientnet_b0_in_both_forms_matches_onnxruntime(measured):
    _efficientnet_matches_onnxruntime("efficientnet_b0", ("parallel", "serial"))


def test_a_network_built_forced_serial_matches_onnxruntime(forced_serial, tmp_path):
    """Every small layer made on one thread (KILN_SERIAL_SMALL_LAYERS=1) while OpenMP's count is 2: the segment's
    handles are made at their descriptors' count. Made at OpenMP's, ResNet-tiny's, EfficientNet-tiny's and
    MobileNetV2's builds crashed in dnnl_primitive_create (the build's judge binding a segment)."""
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: the forced count is OpenMP's own")
    exported = zoo.export("resnet_tiny")
    engine = kiln.build(str(exported.path), timing_cache=str(tmp_path / "timing.json"))
    session = onnxruntime_session(exported.path)
    names = [o.name for o in session.get_outputs()]
    for seed in (1, 2):
        feeds = zoo.random_inputs("resnet_tiny", exported, seed=seed)
        got = engine.run(feeds)
        for n, want in zip(names, session.run(None, feeds)):
            assert_fp32_close(got[n], want, f"resnet_tiny {n} (seed {seed}, forced serial)")
