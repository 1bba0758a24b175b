"""A front end's staging arena (`kiln serve --frontends N`): large input tensors reach the engine through
shared memory, not through the engine's Unix socket.

A front end sending a 301 KB image over the socket pays a kernel copy and the partial writes of a full
socket buffer (its loop woken for each); the engine, which every front end shares, pays a kernel copy, the
joining of the frame's chunks and a wake-up per chunk. Through the arena the front end copies the tensor
once into its own shared-memory object and sends (offset, dtype, shape); the engine reads it where it lies,
a read-only view of its mapping, and the batcher's merge (or an instance, for a call of its own) makes the
one copy an engine call needs, on the instance's thread.

    front end: StagingArena.put(array) -> Staged(offset, ...)   ──InferCall──▶   engine: StagingView.take(...)
               StagingArena.release(call)  ◀──InferAnswer / Reply──  (the engine is done with the slot by then)

A slot is the call's until its answer arrives, so the engine answers a call only once nothing of it reads the
slot any more: a request taken into a batch is answered when the batch returns, even where its timeout passed
meanwhile (ServerCore.infer_soon; Triton's timeouts are the queue's too). Copying each tensor out as the frame
was decoded cost the engine's event loop, which every front end shares, 29-69% of its CPU time per request
(a 301 KB copy and an allocation; 1 to 16 calls a read: bench/serve_engine_loop.py --model image); on the H200 the
loop went from 73-83% of a core to 40% at 26-31% more requests/s (bench/results/serve-2026-12-03b.md).

The arena is a ring: slots are taken at the head and come back in any order; the tail moves past the
oldest slots once they are back. A tensor that does not fit (the ring full of requests in flight, or a
tensor larger than a quarter of the ring) goes over the socket as before.
"""

from __future__ import annotations

import math
import mmap
import os
import secrets
from collections import deque
from dataclasses import dataclass

import numpy as np

from kiln.serve.shared_memory import SHM_FOLDER

STAGE_MIN_BYTES = 64 << 10  # smaller tensors cost less over the socket than a slot's bookkeeping
ARENA_BYTES = 64 << 20  # per front end: ~200 MobileNet-sized requests in flight
_MIN_ARENA_BYTES = 1 << 20
_ALIGN = 64


@dataclass(frozen=True)
class Staged:
    """An input tensor in the sending front end's arena."""

    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]


def arena_bytes(wanted: int, frontends: int) -> int:
    """The arena each of `frontends` front ends gets: `wanted`, or less where /dev/shm has less than half its free
    space for them all (a container's /dev/shm is often 64 MB); 0 (no staging) where that is below 1 MiB each."""
    try:
        stats = os.statvfs(SHM_FOLDER)
    except OSError:
        return 0
    room = stats.f_bavail * stats.f_frsize // 2 // max(1, frontends) // _ALIGN * _ALIGN
    if wanted <= room:
        return wanted
    return room if room >= _MIN_ARENA_BYTES else 0


class StagingArena:
    """A front end's side: its shared-memory object, slots taken per infer call and given back per answer."""

    def __init__(self, byte_size: int = ARENA_BYTES):
        self.key = f"kiln-staging-{os.getpid()}-{secrets.token_hex(4)}"
        self.byte_size = byte_size
        fd = os.open(os.path.join(SHM_FOLDER, self.key), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # every page taken now: a full /dev/shm is an OSError here, not a SIGBUS at the first write past it
            os.posix_fallocate(fd, 0, byte_size)
            self._memory = mmap.mmap(fd, byte_size)
        except OSError:
            os.close(fd)
            self.unlink()
            raise
        os.close(fd)
        self._bytes = np.frombuffer(self._memory, np.uint8)
        self._head = 0  # the next free byte
        self._slots: deque[list] = deque()  # [start, end, call id, given back], oldest first
        self._by_call: dict[int, list[list]] = {}

    def unlink(self) -> None:
        """The object's name removed (once the engine mapped it: the mappings keep the memory)."""
        try:
            os.unlink(os.path.join(SHM_FOLDER, self.key))
        except FileNotFoundError:
            pass

    def put(self, call_id: int, array: np.ndarray) -> Staged | None:
        """The array copied into a slot of call `call_id`; None where it does not fit (send its bytes instead)."""
        size = array.nbytes
        start = self._take(max(_ALIGN, -(-size // _ALIGN) * _ALIGN))
        if start is None:
            return None
        slot = [start, start + size, call_id, False]
        self._slots.append(slot)
        self._by_call.setdefault(call_id, []).append(slot)
        self._bytes[start:start + size].view(array.dtype).reshape(array.shape)[...] = array
        return Staged(start, array.dtype, tuple(array.shape))

    def release(self, call_id: int) -> None:
        """Call `call_id` answered: its slots come back (the engine answers once nothing of the call reads them)."""
        for slot in self._by_call.pop(call_id, ()):
            slot[3] = True
        while self._slots and self._slots[0][3]:
            self._slots.popleft()
        if not self._slots:
            self._head = 0

    @property
    def in_use(self) -> int:
        return len(self._slots)

    def _take(self, size: int) -> int | None:
        """A free run of `size` bytes at the head of the ring (wrapping to 0 past the end), or None."""
        if size > self.byte_size // 4:
            return None
        if not self._slots:
            self._head = size
            return 0
        tail = self._slots[0][0]
        head = self._head
        if head > tail:  # used: [tail, head); free: [head, end) and [0, tail)
            if head + size <= self.byte_size:
                self._head = head + size
                return head
            if size < tail:  # wrap; strictly below tail so that head == tail means "full", never "empty"
                self._head = size
                return 0
            return None
        if head + size < tail:  # wrapped already: used [tail, end) and [0, head); free [head, tail)
            self._head = head + size
            return head
        return None


class StagingView:
    """The engine's side: one front end's arena mapped; tensors read in place as frames name them."""

    def __init__(self, key: str, byte_size: int):
        if "/" in key or not key.startswith("kiln-staging-"):
            raise ValueError(f"a front end named staging object {key!r}, not one of kiln serve's")
        fd = os.open(os.path.join(SHM_FOLDER, key), os.O_RDWR)
        try:
            if os.fstat(fd).st_size < byte_size:
                raise ValueError(f"staging object {key!r} holds {os.fstat(fd).st_size} bytes, not {byte_size}")
            self._memory = mmap.mmap(fd, byte_size)
        finally:
            os.close(fd)
        self._bytes = np.frombuffer(self._memory, np.uint8)
        self.byte_size = byte_size
        self.taken = 0  # tensors taken so far

    def take(self, offset: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor at `offset`: a read-only view of the arena, valid until its call is answered."""
        dtype = np.dtype(dtype)
        size = dtype.itemsize * math.prod(shape)  # Python ints: no overflow (np.prod: ~5 us of the loop's time)
        if offset < 0 or offset + size > self.byte_size:
            raise ValueError(f"a staged tensor at {offset} + {size} bytes runs past the {self.byte_size}-byte arena")
        self.taken += 1
        tensor = self._bytes[offset:offset + size].view(dtype).reshape(shape)
        tensor.flags.writeable = False  # an engine that writes its inputs gets a copy (the batcher's rule)
        return tensor
