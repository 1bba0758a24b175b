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
end of the block. Ending a block leaves the collector due for a full pass soon (it counts as long-lived only what
its last pass, inside the block, kept), so a loop's setup belongs inside the block too (LLM.generate admits its
requests there).

A freeze someone else holds is left as it is, and it is told apart by its size, not by a nonzero count: CPython
3.12's collector moves the immortal objects it meets (the startup modules' 375 deep-frozen constant tuples) into
the frozen generation itself, so after any full collection the count is nonzero with nothing frozen. Taking that
for a caller's freeze made this block a no-op on 3.12 (the H200 machine's Python): a 128/128 generate at batch 512
ran one full pass of 286 ms over 468,000 objects in the middle of its decode steps, the GPU idle for it
(bench/results/llm-2026-12-04.md). The unfreeze at the end hands those immortal tuples back too; the next full
pass moves them again.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

# The most objects the interpreter keeps frozen by itself (375 on CPython 3.12, none on 3.11 and 3.13). A caller's
# freeze of a heap that imported torch holds 100,000+.
INTERPRETER_FROZEN = 10_000


@contextlib.contextmanager
def static_heap() -> Iterator[None]:
    """Leave the objects alive now (engines, torch's modules, the caller's) out of the collector's scans until
    the block ends. A freeze someone else holds, or a collector turned off, is left as it is."""
    if not gc.isenabled() or gc.get_freeze_count() > INTERPRETER_FROZEN:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
