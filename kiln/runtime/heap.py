"""The process's long-lived objects out of the garbage collector's full passes while a serving loop runs.

CPython's full collection scans every tracked object of the process and runs once the objects that survived
into the oldest generation since the last one exceed a quarter of those it kept then. Importing torch alone
leaves ~166,000 tracked objects (77 ms per full pass, thread CPU, on the 2-vCPU VM; ~110 ms with a BERT-base
engine loaded), and a loop that keeps a few hundred objects per step triggers one every few dozen steps: a
CPU engine binding new input shapes keeps ~720 per shape (BERT-base: its segment view, kiln/runtime/native.py,
~345, and the layers' kernels at the new sizes; 2 full passes of 134 ms in 120 new shapes,
bench/results/first-calls-2026-12-03b.md); an LLM engine's steps allocate
per request (~0.3 s a pass in a 1024-request generate). gc.freeze moves everything alive now to a generation
the collector never scans: only what the loop itself made is scanned (vLLM freezes its startup heap the same
way). Nothing is kept for good: unfreeze at the end puts the objects back. A frozen object is still freed by
its reference count; only a reference cycle made before the freeze and dropped inside the block waits for the
end of the block.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def static_heap() -> Iterator[None]:
    """Leave the objects alive now (engines, torch's modules, the caller's) out of the collector's scans until
    the block ends. A freeze someone else holds, or a collector turned off, is left as it is."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
