"""kiln/kernels/cpu/openmp_threads.py: one_thread() sets the calling thread's OpenMP count to 1 and restores
it (also when the body raises); convolutions of few multiply-adds are created under it and still match
torch's convolution when run with two threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.kernels.cpu import onednn, onednn_primitives
from kiln.kernels.cpu.openmp_threads import one_thread, openmp

pytestmark = pytest.mark.skipif(openmp() is None, reason="no libgomp.so.1 loaded")


def test_one_thread_sets_and_restores():
    omp = openmp()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with one_thread():
            assert omp.omp_get_max_threads() == 1
        assert omp.omp_get_max_threads() == 2
        with pytest.raises(ValueError), one_thread():
            raise ValueError("inside")
        assert omp.omp_get_max_threads() == 2
        with one_thread(enabled=False):
            assert omp.omp_get_max_threads() == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not onednn.available(), reason="oneDNN is not loaded")
@pytest.mark.parametrize("channels, size", [(8, 8), (64, 56)])  # 0.04 M multiply-adds (one thread); 116 M (all)
def test_small_and_large_convolutions_match_torch_on_two_threads(channels, size):
    threads = torch.get_num_threads()
    generator = torch.Generator().manual_seed(channels)
    x = torch.randn(1, channels, size, size, generator=generator)
    w = torch.randn(channels, channels, 3, 3, generator=generator) * 0.1
    b = torch.randn(channels, generator=generator)
    try:
        torch.set_num_threads(2)
        conv = onednn_primitives.Conv2d(w, b, [1, channels, size, size], [1, 1], [1, 1, 1, 1], [1, 1], 1, None,
                                        False, True)
        assert (conv.macs <= onednn_primitives.SINGLE_THREAD_MACS) == (channels == 8)
        got = conv(x.contiguous(memory_format=torch.channels_last))
    finally:
        torch.set_num_threads(threads)
    # fp32, 9·C products a sum in another order than torch's: ~1e-6 relative
    torch.testing.assert_close(got, F.conv2d(x, w, b, padding=1), rtol=1e-5, atol=1e-5)
