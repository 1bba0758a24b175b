"""A small convolution whose one-thread kernel wants its weight in another layout gets a serial form all the same,
on a copy of the weight packed so (kiln/kernels/cpu/onednn_primitives.py Conv2d, issue 11).

Before, such a layer had no serial form: a native segment's serial form ran its parallel kernel, a fork whose
partner thread sleeps there (ResNet-tiny at 2 threads on the Zen 3: its two accumulating 1x1 convolutions on
brgconv_1x1, 15-18 us each in the serial form against 3-4 us on one thread). Which layers differ depends on oneDNN's
kernels for the machine: the layer here is searched among ResNet-tiny's shapes and the test skips where none differs.
Checked: both forms (bound, as a segment runs them; per call, as the tuner times them) against torch in float64, with
the residual added in place and as a binary post-op; a chunked batch keeps to its parallel arguments.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.kernels.cpu import onednn, onednn_primitives
from kiln.kernels.cpu.form_choice import PARALLEL, SERIAL

pytestmark = [pytest.mark.skipif(not onednn.available(), reason=f"oneDNN: {onednn.reason()}")]

# float32 sums of at most 64·9 products against float64, unit-scale inputs, 0.2-scaled weights
RTOL, ATOL = 1e-4, 1e-5
# (in channels, out channels, map side, kernel): ResNet-tiny's accumulating convolutions and a 3x3 beside them
SHAPES = [(16, 64, 8, 1), (32, 128, 4, 1), (64, 256, 2, 1), (16, 64, 4, 3), (16, 32, 2, 1)]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _conv(c: int, o: int, side: int, k: int, residual: bool, in_place: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(o, c, k, k, generator=g) * 0.2
    b = torch.randn(o, generator=g)
    conv = onednn_primitives.Conv2d(w, b, [1, c, side, side], [1, 1], [k // 2] * 4, [1, 1], 1,
                                    onednn.eltwise_for("Relu", 0.0, 0.0), residual, False, residual_in_place=in_place)
    return conv, w, b


def _own_weight_case(residual: bool, in_place: bool):
    for c, o, side, k in SHAPES:
        conv, w, b = _conv(c, o, side, k, residual, in_place, seed=c * o + side)
        if conv._serial is not None and conv._serial_w_mem is not None:
            return conv, w, b, (c, o, side, k)
    pytest.skip("this machine's one-thread kernels take every such weight as laid out: no serial weight of its own")


def _want(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    y = F.conv2d(x.double(), w.double(), b.double(), padding=w.shape[-1] // 2)
    return (y if r is None else y + r.double()).relu()  # residual_after_activation False: relu(conv + b + r)


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max().item()
    error = (got.double() - want).abs().max().item()
    assert error <= ATOL + RTOL * scale, f"max abs error {error:.3g} at scale {scale:.3g}"


def _run(bound, calls, x, y, r=None) -> None:
    bound.rebind("src", x.data_ptr())
    bound.rebind("dst", y.data_ptr())
    if r is not None:
        bound.rebind("residual", r.data_ptr())
    lib = onednn.load()
    (_fn, primitive, nargs, args), = calls
    onednn._check(lib.lib.dnnl_primitive_execute(primitive, lib.stream, nargs, args), bound.what)


@pytest.mark.parametrize("residual, in_place", [(False, False), (True, False), (True, True)])
def test_both_forms_of_a_layer_whose_serial_kernel_wants_another_weight_layout_match_torch(two_threads, residual,
                                                                                           in_place):
    conv, w, b, (c, o, side, _) = _own_weight_case(residual, in_place)
    bound = conv.bind(0, 0, None if in_place or not residual else 0)
    assert bound.serial_primitive is not None and bound.serial_args_own
    assert bound.serial_calls()[0][3] != bound.calls()[0][3]  # its own arguments array
    g = torch.Generator().manual_seed(side + o)
    for form in (PARALLEL, SERIAL, PARALLEL, SERIAL):
        x = torch.randn(1, c, side, side, generator=g).contiguous(memory_format=torch.channels_last)
        r = torch.randn(1, o, side, side, generator=g).contiguous(memory_format=torch.channels_last) \
            if residual else None
        want = _want(x, w, b, r)
        calls = bound.serial_calls() if form == SERIAL else bound.calls()
        if in_place:  # the residual's memory is the output: written over it
            y = r.clone()
            _run(bound, calls, x, y)
        else:
            y = torch.empty(1, o, side, side).contiguous(memory_format=torch.channels_last)
            _run(bound, calls, x, y, r)
        _assert_close(y, want)
        # the per-call path (what the tuner times), its chooser held in the same form
        conv._forms.chooser.choose = lambda form=form: form
        got = conv.accumulate(x, r.clone()) if in_place else (conv(x, r) if residual else conv(x))
        _assert_close(got, want)


def test_a_batch_in_chunks_keeps_to_the_parallel_arguments(two_threads):
    """onednn_chunks runs a serial form only on the parallel one's arguments (its plan holds one args array): over a
    layer whose serial form has a weight of its own it offers none (it would read the parallel layout's weight)."""
    from kiln.kernels.cpu import onednn_chunks

    if not onednn_chunks.available():
        pytest.skip("the compiled segment loop is not available")
    conv, _, _, _ = _own_weight_case(False, False)
    bound = onednn_chunks.BatchChunks(conv, None, 3).bind(0, 0)
    assert bound.serial_calls() is None and bound.calls()
