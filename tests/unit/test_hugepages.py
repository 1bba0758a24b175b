"""kiln/kernels/cpu/hugepages.py: long-lived CPU buffers carved from 2 MiB-aligned mappings."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from kiln.kernels.cpu import hugepages

needs = pytest.mark.skipif(not hugepages.enabled(), reason="no MADV_HUGEPAGE on this platform")


@needs
def test_buffers_are_aligned_packed_and_hold_their_data():
    a = hugepages.empty(1000)
    b = hugepages.empty(3, dtype=torch.int64)
    c = hugepages.empty(70000)
    for t, n, dtype in ((a, 1000, torch.float32), (b, 3, torch.int64), (c, 70000, torch.float32)):
        assert t.shape == (n,) and t.dtype == dtype and t.data_ptr() % hugepages.ALIGN == 0
    # packed one after another into one mapping
    assert a.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()
    assert a.data_ptr() < b.data_ptr() < c.data_ptr()
    a.copy_(torch.arange(1000.0))
    c.fill_(7.0)
    assert torch.equal(a, torch.arange(1000.0)) and bool((c == 7).all())


@needs
def test_own_buffers_start_on_a_huge_page_and_share_their_storage_with_nothing():
    shared = hugepages.empty(10)
    own = hugepages.empty(1 << 20, own=True)
    assert own.data_ptr() % hugepages.HUGE == 0
    assert own.untyped_storage().data_ptr() != shared.untyped_storage().data_ptr()
    users = torch._C._storage_Use_Count(own.untyped_storage()._cdata)
    other = torch.empty(4)
    plain = torch._C._storage_Use_Count(other.untyped_storage()._cdata)
    assert users == plain  # the tensor (and the temporary storage object) alone: no chunk or neighbour holds it


def test_switched_off_or_small_own_buffers_are_plain_allocations(monkeypatch):
    small = hugepages.empty(16, own=True)
    assert small.untyped_storage().nbytes() == 64
    monkeypatch.setenv("KILN_HUGE_PAGES", "0")
    assert not hugepages.enabled()
    plain = hugepages.empty(1 << 20)
    assert plain.untyped_storage().nbytes() == 4 << 20



def _resident(address: int, length: int) -> bool:
    """Whether any page of [address, address + length) is resident (mincore; address page-aligned)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pages = -(-length // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(length), vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return any(v & 1 for v in vector)


@needs
def test_an_own_buffer_past_a_huge_page_keeps_no_untouched_memory_resident():
    # A buffer of 3.75 MiB: its last 1.75 MiB on a huge page would bring in 2 MiB, the quarter MiB past its
    # end resident though never touched (DeiT-small's 2.25 MiB MLP weights: 4 MiB resident for 2.25 when
    # the page fell that way). Four buffers: their mappings' start is where the kernel put them.
    nbytes = hugepages.HUGE + hugepages.HUGE * 7 // 8
    buffers = [hugepages.empty(nbytes // 4, own=True) for _ in range(4)]
    for buffer in buffers:
        buffer.fill_(1.0)
        end = buffer.data_ptr() + nbytes  # page-aligned: the buffer starts on a huge page
        assert not _resident(end, mmap.PAGESIZE), "the page after an own buffer is resident"
