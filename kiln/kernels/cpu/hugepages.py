"""Long-lived CPU buffers (packed weights, a segment's activation buffers) on 2 MiB pages.

A network at batch 1 streams its weights once per run: ResNet-50 reads ~100 MB, which on 4 KiB
pages is ~25,000 TLB entries a run, each miss a page walk in the middle of a convolution's
inner loop. On transparent huge pages the same bytes take ~50 entries. Measured on this 2-core
Xeon (interleaved runs of two engines of one process, oneDNN kernels): ResNet-50 38.0 -> 33.8 ms,
MobileNetV2 5.0 -> 4.7 ms.

Buffers are carved from anonymous mappings advised MADV_HUGEPAGE and aligned to 2 MiB (the kernel
backs an aligned 2 MiB range with one page when the range lies in the mapping). Each buffer starts
on a 64-byte line, as oneDNN wants. A chunk is unmapped when the last tensor carved from it dies.
Where huge pages cannot be asked for (not Linux, or KILN_HUGE_PAGES=0) this is torch.empty.
"""

from __future__ import annotations

import mmap
import os
import threading

import torch

HUGE = 2 << 20
CHUNK = 64 << 20  # one mapping serves many weights; a larger request gets its own
ALIGN = 64
MIN_OWN_BYTES = 1 << 20  # a buffer with a mapping of its own: smaller ones are plain allocations


def enabled() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("KILN_HUGE_PAGES") != "0"


class _Chunk:
    def __init__(self, nbytes: int, own: bool):
        size = nbytes + HUGE
        self.map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)  # holds the mapping while any view lives
        self.used = (-self.bytes.data_ptr()) % HUGE  # start on a 2 MiB boundary
        self.size = size
        # A buffer of its own: huge pages for its whole 2 MiB ranges only. Its tail on one would bring in
        # a whole page past its end (a 2.25 MiB weight 4 MiB resident) wherever the mapping holds that page.
        self.map.madvise(mmap.MADV_HUGEPAGE, *((self.used, nbytes // HUGE * HUGE) if own else (0, size)))


_lock = threading.Lock()
_current: _Chunk | None = None


def empty(numel: int, dtype: torch.dtype = torch.float32, own: bool = False) -> torch.Tensor:
    """A 1-D tensor of `numel` elements (uninitialised, or zero when freshly mapped).

    Buffers share mappings, packed one after another (weights: all of a network's in few huge
    pages). `own`: a mapping of its own, so that the tensor's storage is its alone (the CPU
    output pool, kiln/kernels/cpu/onednn_primitives.py, counts a storage's users to know it is free);
    buffers of 2 MiB or more always get one."""
    global _current
    nbytes = numel * dtype.itemsize
    # A buffer of a huge page or more fills huge pages on its own: its own mapping, unmapped when it dies.
    # Carved from a shared chunk it would keep the chunk's pages resident until every neighbour died too
    # (the bump allocator never reuses a freed range): a build that packs and drops every candidate's
    # weights (the tactic search) grew by ~180 MiB that way on ALBERT-base.
    own = own or nbytes >= HUGE
    if not enabled() or nbytes == 0 or (own and nbytes < MIN_OWN_BYTES):
        return torch.empty(numel, dtype=dtype)
    with _lock:
        chunk = None if own else _current
        start = None if chunk is None else -(-chunk.used // ALIGN) * ALIGN
        if chunk is None or start + nbytes > chunk.size:
            try:
                chunk = _Chunk(nbytes if own else max(CHUNK, nbytes), own)
            except (OSError, ValueError):
                return torch.empty(numel, dtype=dtype)
            if not own and nbytes < CHUNK:
                _current = chunk  # the rest serves later requests
            start = chunk.used
        chunk.used = start + nbytes
        return chunk.bytes[start:start + nbytes].view(dtype)


def new_chunk() -> None:
    """Buffers from now on are carved from a chunk not yet mapped. The bump allocator never reuses a freed range, and
    the current chunk is held until a request does not fit it: a phase that packs buffers and drops them (the tactic
    search: every candidate of a layer, layer after layer) calls this once they are gone, so their chunk goes with
    them instead of staying resident as the current one (ResNet-50's search: 20-32 MiB of dead candidates' ranges)."""
    global _current
    with _lock:
        _current = None
