"""Numpy feeds and outputs of a CUDA execution context through pinned host memory the context owns (issue 14).

Without it (mode "off", the default until session 34), a CUDA context fed numpy arrays copies each input to the GPU from the
caller's pageable array (`tensor.to(device, non_blocking=True)`, kiln/runtime/bindings.py _to_runtime) and each
output back with `tensor.cpu()` (kiln/ir/dtypes.py torch_to_numpy): a copy into freshly allocated pageable memory,
which the CUDA driver stages through a pinned buffer of its own, chunk by chunk, with the calling thread's CPU
copying each chunk out, and which returns only once the stream's work before it and the copy are done. On the H100
(bench/results/serve-overlap-2026-12-07.md) that made BERT-base's [64, 128, 768] fp32 output cost 23.7 ms a call
(the replay: 3.0 ms), and two contexts on two threads and streams ran no faster together than one alone.

With it, a numpy call of the context:
- copies each numpy input into a pinned buffer of this context (one per input binding, grown on demand, never
  shrunk) and from there to the GPU with one asynchronous copy (no driver staging);
- enqueues one asynchronous copy of each output from the GPU into a pinned buffer of this context, records one event
  after them on the current stream and waits for it (torch's Event.synchronize: the GIL released while it waits);
- hands the outputs back as numpy arrays: in mode "copy", fresh arrays copied out of the pinned buffers (the caller
  owns them, as before: bitwise the same values, C-contiguous, of the binding's dtype); in mode "pinned", arrays over
  pinned blocks of torch's caching host allocator, one per output per call and no host copy: a block goes back to
  torch's cache when its array (and every view of it) is gone, so a caller that keeps many outputs alive keeps that
  much page-locked memory (use "copy" there).
A context runs one call at a time, so its buffers are never in use by two calls; an input buffer is rewritten only
after the copy that read it is known done (the previous call's wait; a call that raised before its wait leaves the
event of its input copies, waited for first).

Torch tensor feeds are untouched (torch in, torch out on the GPU, as before), and so are values torch cannot hold
(strings, sub-byte types) and sequence outputs: they take the old path.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kiln.ir import dtypes

MODES = ("off", "copy", "pinned")
MIN_BUFFER = 4096  # bytes: a buffer grows to the next power of two of what a call needs, from here


def staging_mode(mode: str | bool | None) -> str:
    """A context's host staging mode: `mode` ("off" | "copy" | "pinned"; True: "copy", False: "off"), None: the
    environment's KILN_HOST_STAGING, default "pinned": on the H100 (bench/gpu_s34a.sh, BERT-base fp16 at 1-64 x 128,
    bench/results/host-staging-2026-12-07d.md) a numpy call took 0.60-3.76 ms pinned against 0.62-21.4 ms off (the
    pageable copies) and 0.65-7.06 ms copy (the host copy out of the buffers costs more than it saves below ~48 rows);
    a caller that keeps many outputs alive keeps that much page-locked memory and sets "copy" or "off"."""
    if mode is None:
        mode = os.environ.get("KILN_HOST_STAGING", "pinned").strip().lower() or "off"
        mode = {"1": "copy", "0": "off", "true": "copy", "false": "off"}.get(mode, mode)
    elif mode is True or mode is False:
        mode = "copy" if mode else "off"
    if mode not in MODES:
        raise ValueError(f"host staging {mode!r}: expected one of {MODES}")
    return mode


def _pinned_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class HostStaging:
    """One CUDA context's pinned buffers for its numpy inputs and outputs, and the event its numpy calls wait on."""

    def __init__(self, device: torch.device, mode: str = "copy",
                 allocate: Callable[[int], torch.Tensor] | None = None, event: Callable[[], Any] | None = None):
        """`allocate(nbytes)`: a uint8 host tensor of that many bytes (default: pinned, from torch's caching host
        allocator; tests stand plain memory in); `event()`: a CUDA event (default torch.cuda.Event, looked up at the
        first wait; tests stand one in). Nothing is allocated before a call needs it."""
        if mode not in ("copy", "pinned"):
            raise ValueError(f"HostStaging mode {mode!r}: expected 'copy' or 'pinned'")
        self.device = device
        self.mode = mode
        self._allocate = allocate or _pinned_bytes
        self._new_event = event
        self._event: Any = None
        self._inputs_pending = False  # input copies enqueued and not yet known done (a call that raised)
        self.buffers: dict[tuple[str, str], torch.Tensor] = {}  # ("input" | "output", binding name) -> bytes

    @property
    def bytes(self) -> int:
        """Pinned host memory this context holds for staging."""
        return sum(b.numel() for b in self.buffers.values())

    def _buffer(self, key: tuple[str, str], nbytes: int) -> torch.Tensor:
        """The first `nbytes` bytes of the buffer `key`, grown to the next power of two where it is smaller."""
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < nbytes:
            size = MIN_BUFFER
            while size < nbytes:
                size *= 2
            buffer = self.buffers[key] = self._allocate(size)
        return buffer[:nbytes]

    def reserve(self, kind: str, name: str, nbytes: int) -> None:
        """Grow buffer (`kind` "input" | "output", binding `name`) to hold `nbytes` now (warm-up: the largest shapes),
        so no serving call allocates page-locked memory (cudaHostAlloc: milliseconds for tens of MB)."""
        self._buffer((kind, name), nbytes)

    def _wait(self) -> None:
        """Wait for everything enqueued so far on the current stream; the GIL is released while waiting."""
        if self._event is None:
            self._event = self._new_event() if self._new_event is not None else torch.cuda.Event()
        self._event.record()
        self._event.synchronize()

    def feeds(self, feeds: dict[str, Any]) -> dict[str, Any]:
        """`feeds` with each numpy array torch can hold replaced by its copy on the device, made from this context's
        pinned buffer of that input; other values as given."""
        staged = None
        for name, value in feeds.items():
            if type(value) is not np.ndarray:
                continue
            dt = dtypes.BY_NUMPY.get(value.dtype)
            if dt is None or dt.torch is None:
                continue  # strings, sub-byte types, another byte order: the old path
            if staged is None:
                if self._inputs_pending:  # the last call raised before its wait: its input copies may still read
                    self._wait()
                staged = dict(feeds)
            raw = self._buffer(("input", name), value.nbytes)
            host = raw.view(dt.torch).view(value.shape)
            if value.dtype.type.__module__ == "numpy":  # one pass from any layout, a read-only array too (no copy first)
                np.copyto(raw.numpy().view(value.dtype).reshape(value.shape), value, casting="no")
            else:  # ml_dtypes' (bfloat16, float8): their bytes, as numpy_to_torch reads them
                host.copy_(dtypes.numpy_to_torch(value))
            self._inputs_pending = True
            staged[name] = host.to(self.device, non_blocking=True)
        return feeds if staged is None else staged

    def outputs(self, names: list[str], results: list[Any], to_user: Callable[[Any], Any]) -> dict[str, Any]:
        """The run's `results` (in the order of the output bindings `names`) as numpy arrays: each CUDA tensor copied to
        the host asynchronously, one wait for them all; other values through `to_user` (the old path)."""
        hosts: list[torch.Tensor | None] = []
        for name, value in zip(names, results):
            if type(value) is not torch.Tensor or value.device.type != self.device.type:
                hosts.append(None)  # a list (a sequence output), None, a value left on the host
                continue
            if self.mode == "pinned":
                host = self._allocate_output(value)
            else:
                nbytes = value.numel() * value.element_size()
                host = self._buffer(("output", name), nbytes).view(value.dtype).view(value.shape)
            host.copy_(value, non_blocking=True)
            hosts.append(host)
        self._wait()  # the outputs' copies, and everything before them on the stream (the input copies too)
        self._inputs_pending = False
        outputs = {}
        for name, value, host in zip(names, results, hosts):
            if host is None:
                outputs[name] = to_user(value)
            elif self.mode == "pinned":
                outputs[name] = dtypes.torch_to_numpy(host)  # a view of the block; it holds the block while it lives
            else:
                outputs[name] = dtypes.torch_to_numpy(host).copy()  # the caller's own array: the buffer is reused
        return outputs

    def _allocate_output(self, value: torch.Tensor) -> torch.Tensor:
        """Mode "pinned": a fresh host tensor for one output (a block of torch's caching host allocator)."""
        nbytes = value.numel() * value.element_size()
        return self._allocate(nbytes).view(value.dtype).view(value.shape)
