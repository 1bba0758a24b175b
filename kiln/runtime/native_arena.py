"""One arena for every native segment of a program (kiln/runtime/native.py).

A program runs its segments one after another, and nothing a segment leaves in its arena is read after its run:
its exits are fresh tensors, its entries the caller's, its arena holds only the values that live and die inside
it. So the segments of one program can plan their values into the same memory, which is then as large as the
largest segment's plan instead of the sum of them all. YOLOS-Ti at full size (24 segments, one per encoder block
and its neighbours, of 0.8-1.6 MiB each): 20.6 MiB of arenas, 1.6 MiB resident shared.

The arena is a range of address space as large as the largest segment could need (every value its members
write, SharedArena.bound); only the pages a segment's plan reaches are ever touched, so what is resident is the
largest plan. The price is one lock for them all: two runs of one program take turns in its segments. So each
execution context of an engine runs a program of its own (Program.with_own_arena, kiln/runtime/engine.py CpuLane):
the same layers and weights, its segments planned the same into an arena of its own (`sibling`), so two contexts
on two threads compute at once (issue 14), each at OpenMP's thread count of its own thread.
"""

from __future__ import annotations

import math
import threading
import weakref
from fractions import Fraction

import torch

from kiln.kernels.cpu import hugepages


class SharedArena:
    """`nbytes` of float32 memory shared by a program's segments, each planned from its start (take), one lock
    for their runs."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.planned = nbytes  # what it was made for (nbytes drops to 0 where no address space was had)
        self.lock = threading.Lock()
        self._buffer: torch.Tensor | None = None  # mapped at the first take: untouched pages hold no memory
        self._scratch: torch.Tensor | None = None  # the members' temporaries (scratch)
        self._scratch_lock = threading.Lock()  # two segments' views may be bound at once (each under its own lock)
        # batch / planned batch -> the arena the exact binds of that batch share (native_batches.batch_arena), while
        # a bound segment holds it
        self.batch_arenas: weakref.WeakValueDictionary[Fraction, SharedArena] = weakref.WeakValueDictionary()

    @staticmethod
    def bound(runs: list[list[tuple[tuple[int, ...], torch.dtype]]]) -> int:
        """The most any one run of values (size, dtype) could plan: each value on a 64-byte line, none reused."""
        return max((sum(-(-math.prod(size) * dtype.itemsize // 64) * 64 for size, dtype in run) for run in runs),
                   default=0)

    def sibling(self, grown: int = 0) -> SharedArena:
        """An arena as large as this one was made, of its own, with a lock of its own: another execution context's
        (Program.with_own_arena), whose segments plan into it at the same offsets as this one's. `grown`: the largest
        grown view template of those segments (Segment._grown, planned from the start as they are), which the twins
        adopt over this arena too (Segment._adopt) where it holds them: address space for it, pages only where runs
        reach. A context's views and its segments at their planned sizes then share their memory, as a program's
        segments do (BERT-base's: 38 MiB grown and 18.5 planned, ~57 MiB resident once both ran, ~38 shared)."""
        arena = SharedArena(max(self.planned, grown))
        arena.planned = self.planned  # (what its segments' plans take: native_batches scales it)
        return arena

    def take(self, nbytes: int) -> torch.Tensor | None:
        """The arena's first `nbytes` (a multiple of 4) as a float32 tensor; None when it is smaller than that."""
        if nbytes > self.nbytes:
            return None
        if self._buffer is None:
            try:
                self._buffer = hugepages.empty(-(-self.nbytes // 4))
            except (RuntimeError, MemoryError):  # no address space that large (strict overcommit, a ulimit -v): the
                self.nbytes = 0  # segments plan into arenas of their own, as large as each one's plan
                return None
        return self._buffer[:nbytes // 4]

    def scratch(self, nbytes: int) -> torch.Tensor:
        """At least `nbytes` (a multiple of 4) of float32 memory for a member's temporaries within its own calls
        (a Winograd layer's transformed tiles, kiln/kernels/cpu/winograd.py), the same memory for every member bound
        over this arena: they run one at a time under its lock, and none reads another's temporaries. One of its
        own per binding, ResNet-50's 8 Winograd layers held 26 MiB of them where the largest is 6.4 MiB (in each
        program the build binds, and in the engine: bench/results/mem9-2026-12-06.md). A request larger than the
        current buffer gets a new one, which later requests share; the members bound before keep theirs (they hold
        it), so bound largest first it is one buffer."""
        with self._scratch_lock:
            if self._scratch is None or self._scratch.numel() * 4 < nbytes:
                self._scratch = hugepages.empty(-(-nbytes // 4))
            return self._scratch[:-(-nbytes // 4)]
