"""kiln.static_heap (kiln/runtime/heap.py): the objects alive at entry are out of the collector's scans inside the
block and back after it; a freeze someone else holds, or a collector turned off, is left alone."""

from __future__ import annotations

import gc

import kiln


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_the_heap_is_frozen_inside_and_given_back_after():
    gc.collect()
    assert gc.get_freeze_count() == 0
    with kiln.static_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the interpreter's, kiln's and torch's objects
        made = _Node()
        del made
        assert gc.collect() >= 1, "a cycle made inside the block is still collected"
    assert gc.get_freeze_count() == 0


def test_a_freeze_held_by_the_caller_or_a_disabled_collector_is_left_alone():
    gc.freeze()
    try:
        held = gc.get_freeze_count()
        with kiln.static_heap():
            assert gc.get_freeze_count() == held
        assert gc.get_freeze_count() == held  # not unfrozen by the block
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        with kiln.static_heap():
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()
