"""A view's plan buffer written by one struct pack (kiln/runtime/native_views.py's _PlanRewrite._assembled).

A first call at a new shape assembles each segment's view right after a run has cooled the caches: the template's
plans copied, the rules' values stored over their fields by an int32 gather and scatter, the calls' plan addresses
added (image.copy, np.array, two fancy indexings, np.add): ~8 numpy calls, each several times its warm cost there
(llama_tiny's 5 views: ~0.3-0.6 ms of a first call, bench/results/first-shape-2026-12-06.md, s27 h-views6). Here the
whole buffer is one `struct.Struct.pack_into`: the template's bytes between fields as constant chunks (`Ns`), each
field (`q` or `i`) and each call's plan address (`Q`); the arguments in buffer order are picked from (chunks...,
values...) by one `operator.itemgetter`; the buffer is a ctypes array (`buffer_type`: numpy's empty array and its
__array_interface__ cost ~8 µs a view more on a first call's cold caches). Byte for byte what the stores write
(tests/unit/test_view_pack.py), except a 32-bit field whose value does not fit int32 (an int64 -> int32 cast wraps
it; struct refuses): `into` then returns False and the caller writes the buffer the numpy way.
"""

from __future__ import annotations

import ctypes
import operator
import struct

import numpy as np


class PackedPlans:
    """The pack of one _PlanRewrite's plan-and-calls buffer (its _image_calls): `of` makes it, `into` writes one."""

    def __init__(self, packer: struct.Struct, pick: operator.itemgetter, chunks: tuple[bytes, ...],
                 plan_offsets: tuple[int, ...], words: int):
        self._packer, self._pick, self._chunks = packer, pick, chunks
        self._plan_offsets = plan_offsets  # each call's plan, bytes from the buffer's start
        self.words = words  # the buffer's int64 words (plans, then a word per call)
        # a view's buffer: int64 words; `nbytes` as a numpy array's (what a view holds: Segment.view_ahead)
        self.buffer_type = type("PlanBuffer", (ctypes.c_int64 * words,), {"nbytes": 8 * words})

    @classmethod
    def of(cls, image: bytes, fields: list[tuple[int, int, int]], plan_offsets: list[int]) -> PackedPlans | None:
        """The pack of a buffer of the template's plans `image` (a multiple of 8 bytes) with `fields` (byte offset,
        width 4 or 8, index into a view's values) written over, then a word per call: its plan's offset plus the
        buffer's address. None where two fields overlap or one lies outside the image (no buffer order) or
        there is nothing to pick."""
        if len(image) % 8:
            return None
        parts, chunks, picks = ["="], [], []
        at = 0
        for offset, width, value in sorted(fields):
            if offset < at or offset % width or offset + width > len(image) or width not in (4, 8):
                return None
            if offset > at:
                parts.append(f"{offset - at}s")
                picks.append(("chunk", len(chunks)))
                chunks.append(image[at:offset])
            parts.append("q" if width == 8 else "i")
            picks.append(("value", value))
            at = offset + width
        if at < len(image):
            parts.append(f"{len(image) - at}s")
            picks.append(("chunk", len(chunks)))
            chunks.append(image[at:])
        parts.append(f"{len(plan_offsets)}Q")
        indices = [i if kind == "chunk" else len(chunks) + i for kind, i in picks]
        if len(indices) < 2:  # (itemgetter of one index gives the item, not a tuple)
            return None
        packer = struct.Struct("".join(parts))
        if packer.size != len(image) + 8 * len(plan_offsets):
            return None
        return cls(packer, operator.itemgetter(*indices), tuple(chunks), tuple(plan_offsets),
                   packer.size // 8)

    def into(self, buffer: ctypes.Array | np.ndarray, base: int, values: list[int] | tuple[int, ...]) -> bool:
        """Write the buffer (`words` int64 words at address `base`: a buffer_type, or any writable buffer) for a
        view's `values`: False where a value does not fit its field (nothing the caller may rely on is then
        written)."""
        try:
            self._packer.pack_into(buffer, 0, *self._pick(self._chunks + tuple(values)),
                                   *[base + offset for offset in self._plan_offsets])
        except (struct.error, IndexError):
            return False
        return True
