"""A view's plans-and-calls buffer written by one struct pack (kiln/runtime/view_pack.py) against the numpy stores it
replaces in _PlanRewrite._assembled (the template's image copied, _int32_stores' gather and scatter, the calls' plan
addresses added): byte for byte on fresh random layouts, and its refusals. llama_tiny's views at shapes past the
planned ones, packed and stored, are compared in tests/unit/test_llama_first_shapes.py (and its outputs with
onnxruntime's)."""

from __future__ import annotations

import ctypes
import zlib

import numpy as np
import pytest

from kiln.runtime.native_views import _int32_stores
from kiln.runtime.view_pack import PackedPlans


def _layout(rng: np.random.Generator):
    """A template image (int64 words), its fields (64-bit words, 32-bit words: disjoint), value indices and a remap,
    the calls' plan offsets (bytes), as _PlanRewrite.__init__ has them."""
    image = rng.integers(-2**62, 2**62, int(rng.integers(4, 60)))
    where64 = rng.choice(len(image), int(rng.integers(1, len(image) // 2)), replace=False)
    taken = set((2 * where64).tolist()) | set((2 * where64 + 1).tolist())
    free = np.array([w for w in range(2 * len(image)) if w not in taken])
    where32 = rng.choice(free, int(rng.integers(0, min(8, len(free)))), replace=False)
    count = int(rng.integers(1, 20))
    remap = rng.permutation(count + 3)[:count]
    value64, value32 = rng.integers(0, count, len(where64)), rng.integers(0, count, len(where32))
    offsets = np.sort(rng.choice(len(image), int(rng.integers(1, min(10, len(image)))), replace=False)) * 8
    return image, where64, value64, where32, value32, remap, offsets


def _stored(image, where64, value64, where32, value32, remap, offsets, values, base):
    """The buffer as _assembled's numpy path writes it."""
    buffer = np.concatenate([image, np.zeros(len(offsets), np.int64)])
    where, halves = _int32_stores(where64, value64, where32, value32, remap)
    buffer.view(np.int32)[where] = np.array(values, np.int64).view(np.int32)[halves]
    np.add(offsets.astype(np.int64), base, out=buffer[len(image):])
    return buffer


def _packed(image, where64, value64, where32, value32, remap, offsets) -> PackedPlans | None:
    fields = [(8 * int(w), 8, int(remap[v])) for w, v in zip(where64, value64)] + \
        [(4 * int(w), 4, int(remap[v])) for w, v in zip(where32, value32)]
    return PackedPlans.of(image.tobytes(), fields, offsets.tolist())


@pytest.mark.parametrize("case", range(6))
def test_the_pack_writes_the_buffer_the_numpy_stores_write(case):
    """Fresh random layouts (64-bit fields with values over all of int64, 32-bit fields with values within int32,
    shared values, a remap): the packed buffer equals the stored one byte for byte, its call words the plans'
    addresses. Fails if a chunk, a field's width or a value's index is off."""
    rng = np.random.default_rng(zlib.crc32(f"view pack {case}".encode()))
    for _ in range(30):
        layout = _layout(rng)
        image, where64, value64, where32, value32, remap, offsets = layout
        count = len(remap) + 3
        values = [int(v) for v in rng.integers(-2**63, 2**63 - 1, count, dtype=np.int64)]
        for i in set(remap[value32].tolist()):  # a 32-bit field's value fits (else the pack refuses: below)
            values[i] = int(rng.integers(-2**31, 2**31))
        packed = _packed(*layout)
        assert packed is not None and packed.words == len(image) + len(offsets)
        got = packed.buffer_type()  # the view's buffer: a ctypes array, `nbytes` as numpy's
        base = ctypes.addressof(got)
        assert packed.into(got, base, tuple(values))
        expected = _stored(*layout, values, base)
        assert bytes(got) == expected.tobytes() and got.nbytes == expected.nbytes


def test_the_pack_refuses_a_32_bit_value_past_int32_and_overlapping_fields():
    """A 32-bit field's value outside int32 (a cast would wrap it, struct refuses): into is False, and _assembled
    stores the numpy way. Overlapping or misaligned fields, or a field past the image: no pack."""
    image = np.arange(4, dtype=np.int64)
    packed = PackedPlans.of(image.tobytes(), [(0, 8, 0), (12, 4, 1)], [0, 8])
    assert packed is not None
    buffer = np.empty(packed.words, np.int64)
    base = buffer.__array_interface__["data"][0]
    assert packed.into(buffer, base, (5, -7))
    expected = np.concatenate([image, [base, base + 8]])
    expected[0] = 5
    expected.view(np.int32)[3] = -7  # bytes 12..15
    assert buffer.tobytes() == expected.tobytes()
    assert not packed.into(buffer, base, (5, 2**31))
    assert not packed.into(buffer, base, (5,))  # fewer values than the fields read
    assert PackedPlans.of(image.tobytes(), [(0, 8, 0), (4, 4, 1)], [0]) is None  # overlapping
    assert PackedPlans.of(image.tobytes(), [(2, 4, 0)], [0]) is None  # misaligned
    assert PackedPlans.of(image.tobytes(), [(32, 8, 0)], [0]) is None  # past the image
