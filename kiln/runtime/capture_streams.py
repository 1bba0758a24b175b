"""The streams CUDA graphs are captured on: one per live GraphRunner (kiln/runtime/cuda_graphs.py), never another
live runner's.

Why a stream of its own: torch caches a cuBLAS / cuBLASLt workspace per (cuBLAS handle, stream), the handle being
the calling thread's, and a captured GEMM keeps the address of the workspace its capture used. Graphs captured by
one thread on one stream therefore hold one workspace between them, whatever their private memory pools; and
torch.cuda.graph's default capture stream is one per process. Two such graphs replayed at once on two streams
write that workspace at once (split-K and stream-K GEMMs keep partial sums and tile flags there), and each may
read the other's. kiln serve's instances are such contexts: all of a model's instances warm up (capture) on the
thread that loads it, then replay each on its own stream, side by side (issue 14: BERT-base fp16, two instances,
8 front ends, gRPC: 11 answers of ~15k wrong by up to 2.2 under `--cuda-sync blocking`; 0 of ~14.5k under `spin` in
the same run, whose synchronous copies to pageable memory plausibly leave the two replays less overlap, but which
replays them at once all the same: the same hazard, a narrower window).

A runner's graphs never replay at once (a context runs one call at a time), so a stream per runner is enough: the
runner warms each signature up on it (the thread's workspace for it is allocated then, outside every graph's
private pool, so evicting a graph frees none of it) and captures on it. torch.cuda.Stream() hands out a pool of 32
streams per priority, round robin, so two runners may draw the same one; CaptureStreams hands a runner a pooled
stream no live runner holds, and takes it back when the runner is gone (with its graphs: none of them replays any
more; the next holder's captures begin with torch's device synchronize). Once every priority-0 stream is
held it draws from the next priorities' pools (a graph's kernels then run at the priority of the stream it was
captured on: recent torch instantiates graphs with per-node priorities); past those, runners share the least-held
stream, logged (their graphs must not run at the same time).

What this cannot rule out: a thread that captured a runner's graphs running other cuBLAS work of its own on that
runner's capture stream, where the pool gave the same stream to that other work (kiln draws it only here).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("kiln.runtime")

POOL_SIZE = 32  # torch's streams per priority per device (c10/cuda/CUDAStream.cpp kStreamsPerPool)
PRIORITIES = (0, -1, -2, -3)  # torch's stream priorities, lowest first (the default, 0, is everyone's)


def _draw(device: torch.device, priority: int) -> Any:
    return torch.cuda.Stream(device=device, priority=priority)


def _device(device: torch.device | str | int) -> torch.device:
    """`device` with its index ("cuda" is the current device): one device, one key."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class CaptureStreams:
    """Hands out capture streams: each stream to one holder at a time while the pools last."""

    def __init__(self, draw: Callable[[torch.device, int], Any] = _draw, pool_size: int = POOL_SIZE,
                 priorities: tuple[int, ...] = PRIORITIES):
        """`draw(device, priority)`: a stream from torch's pool (tests stand one in); it must have `cuda_stream`, the
        stream's handle, which tells two draws of one stream apart from two streams."""
        self._draw = draw
        self._pool_size = pool_size
        self._priorities = priorities
        self._lock = threading.Lock()
        self._held: dict[tuple[str, int], list] = {}  # (device, handle) -> [stream, holders]

    def take(self, device: torch.device) -> Any:
        """A stream of `device` no live holder has, where torch's pools have one; else the least-held one (logged)."""
        device = _device(device)
        with self._lock:
            for priority in self._priorities:
                for _ in range(self._pool_size):  # a full turn of the pool's round robin
                    stream = self._draw(device, priority)
                    key = (str(device), int(stream.cuda_stream))
                    if key not in self._held:
                        self._held[key] = [stream, 1]
                        return stream
            key, held = min(((k, h) for k, h in self._held.items() if k[0] == str(device)), key=lambda kh: kh[1][1])
            held[1] += 1
            log.warning("CUDA graph runners hold every stream of torch's pools on %s (%d): one more captures on a "
                        "stream %d other(s) captured on; their graphs share cuBLAS workspaces and must not run at the "
                        "same time", device, len(self._held), held[1] - 1)
            return held[0]

    def give_back(self, device: torch.device, handle: int) -> None:
        with self._lock:
            key = (str(_device(device)), handle)
            held = self._held.get(key)
            if held is None:
                return
            held[1] -= 1
            if not held[1]:
                del self._held[key]

    def holders(self) -> int:
        """Streams held now (tests)."""
        with self._lock:
            return len(self._held)

    def take_for(self, owner: object, device: torch.device) -> Any:
        """take(), given back once `owner` is garbage."""
        device = _device(device)
        stream = self.take(device)
        weakref.finalize(owner, self.give_back, device, int(stream.cuda_stream))
        return stream


CAPTURE_STREAMS = CaptureStreams()  # one per process: what it keeps apart is torch's per-process workspace cache
