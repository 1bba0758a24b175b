"""A native segment at another batch of the images it was planned for, as runs of itself (kiln/runtime/native.py
picks when): N images are N // B runs of the planned segment (B: its planned batch), each on the next B images' span
of every entry and exit, and the N mod B left over run one by one on the segment's view at one image.

Why: a segment bound at a new batch cost ~8-10 ms of oneDNN primitives (ConvNeXt-tiny,
bench/results/first-call-2026-12-06.md), and one that reads NCHW images had no views at all, so every new batch of an
image model bound a whole segment, and a segment with a layer that cannot bind other sizes (Swin's shifted-window
Slices) ran layer by layer. Runs of the planned segment bind nothing: its primitives, arena and memory plan are the
planned ones, only the entry and exit addresses move. The one-image view is bound once per segment (its oneDNN image
layers run their one-image primitive through kiln/kernels/cpu/onednn_chunks.py, made ahead on a background thread).

When: the batch is every entry's first dim (or a multiple of it: a window mask [B·windows, ...] beside the images),
outermost in memory (NHWC, NCHW or row-major), and the members compute each image alone: at 2B every value a member
writes has twice its planned first dim and its other dims as planned (computes_each_image_alone). A layer that mixes
the images of a batch (a reduction or attention across the first dim, a transpose of it) changes some value's first dim
otherwise. And runs cost less than a view: an image segment (its pixels are its layers' rows: runs of B lose nothing
to one run of N), a run of BATCH_RUN_ROWS rows, or a member whose views bind it anew (Swin's window relayouts); a
transformer tuned at a few tokens would run its GEMMs on those few rows a run, and its views are traced
(native_views.py, tens of µs).

A batch met often is then bound exactly, off the calling thread (call_batch): after BIND_AFTER calls in runs, the
background thread (onednn_ahead.Ahead, nice 19) binds a Segment at that batch with primitives made for it
(onednn_chunks.exact_batches), as a new batch bound before runs existed (8-26 ms on the tiny zoo models, ~0.4 s on
MobileNetV2 at 224 px), and swaps it into the batch's plan when ready: no call waits for it. Each extra run repeats
every layer's fixed oneDNN and loop cost (a few µs; 10-50% of a 32-64 px model's 0.2-4 ms call), which the exact bind
pays once. Which is faster is measured, not assumed: after one untimed call of the bound batch, the next 2·TRIAL
calls alternate it and the runs, and the bound one is kept unless the runs' fastest call is clearly faster than its
fastest (KEEP_BOUND_AT; MobileNetV2 at 224 px, 8-32 images: runs of 2 keep each layer's activations in cache, one run
of 32 (~38 MB a layer) does not, so runs stay). The exact binds of one batch share one arena across the program's
segments (batch_arena), as an engine built at that batch plans its segments into one. Bound batches are kept per
segment up to BOUND_BATCHES and BOUND_BYTES of arena (least recently used out; an evicted batch binds again after twice
as many calls). A segment with no batch runs but views (a transformer's token segment) serves a new batch on its view
until then, and binds it exactly alike (a view plan).

Exact: each image goes through the planned segment's primitives (or their one-image forms), which compute it alone;
tests/unit/test_image_batches.py compares with onnxruntime at fresh batches.
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import math
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch

from kiln.kernels.cpu import native_loop, onednn, onednn_ahead, onednn_chunks
from kiln.runtime.native_arena import SharedArena
from kiln.runtime.native_members import _forms
from kiln.tactics.tactic import NativeStep, native_strides, row_major_strides

BATCH_RUN_ROWS = 256  # rows a run of a segment that is no image segment holds at least, to run other batches in runs
PLANS = 256  # batches whose BatchPlan a segment keeps (least recently called out, its exact bind with it)
_CL = torch.channels_last
BIND_AFTER = 3  # calls of a batch in runs before its exact bind is made (background thread)
TRIAL = 5  # calls of each, the bound batch and the runs, alternated before keeping the faster (after one untimed)
# the bound batch is kept where its fastest call takes at most this times the runs' fastest: a tie within a loaded
# machine's noise goes to the exact bind (what an engine built at that batch runs); the runs stay where clearly faster
# (MobileNetV2 at 224 px, 8-32 images: ~0.8x). At 1.0, swin_tiny kept runs 3-40% slower than the bind (alone in a
# loop) in 1-4 of its 11 segments per batch at loads 12-16
KEEP_BOUND_AT = 1.05
BOUND_BATCHES = 4  # exactly bound batches kept per segment (least recently used out)
BOUND_BYTES = 512 << 20  # ... and their arenas and staging buffers at most, per segment
BATCH_ARENA_SLACK = 1 << 20  # bytes a batch arena holds beyond the planned one scaled (each value's 64-byte line)
BINDS = onednn_ahead.Ahead(budget=1 << 62)  # the thread the exact binds are made on (stops when none is queued)
atexit.register(BINDS.stop)
_STATE = threading.Lock()  # a plan's state changes and a segment's bound batches
_TICKS = itertools.count()  # when a bound batch was last used (least recently used out)
_clock = None  # what the trial times a call with (None: _trial_clock's; tests set a fake one)


def binds_enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether batches met often are bound exactly (KILN_BIND_BATCHES=0: runs only)."""
    return (os.environ if environ is None else environ).get("KILN_BIND_BATCHES", "1") != "0"


def planned_batch(entry_sizes: list[tuple[int, ...]], entry_layouts: list[str], natives: list[NativeStep]
                  ) -> int | None:
    """The batch a segment of these entries runs other batches in runs of: the least first dim of its entries, each
    entry's first dim a multiple of it; None where it does not (an entry without dims, first dims that are not
    multiples) or runs would cost more than a view: no image entry, fewer than BATCH_RUN_ROWS rows in its largest,
    and every member's plan or arguments written by a rule (`natives`: its views are traced, native_views.py, tens of
    µs at a new size; a relayout's walk, Swin's window partition, is made anew per size, ~1-8 ms)."""
    firsts = [size[0] for size in entry_sizes if len(size) > 0]
    least = min(firsts, default=0)
    if least <= 0 or len(firsts) != len(entry_sizes) or any(f % least for f in firsts):
        return None
    images = any(len(size) == 4 and layout == "nhwc" for size, layout in zip(entry_sizes, entry_layouts))
    rows = max((math.prod(size[:-1]) for size in entry_sizes if len(size) > 1), default=0)
    untraced = any(native.plan_at is None and native.primitive_at is None and not native.alias for native in natives)
    return least if images or rows >= BATCH_RUN_ROWS or untraced else None


# ops that carry state or gather along their first dim while keeping its size: a recurrent layer's Y [S, D, N, H] is
# sequence-first (runs over the sequence would drop the state between them), a padding-free program packs the
# tokens of a whole batch into rows; their sizes scale with the first dim like an image's
ALONG_THE_FIRST_DIM = frozenset({"LSTM", "GRU", "RNN", "Scan", "CumSum", "PackTokens", "UnpackTokens", "TokenIndex",
                                 "PackedAttention"})
# ops over a sequence dim (attending across it, rotating by position in it): dim -2, dim 0 when they read rank 2
OVER_A_SEQUENCE = frozenset({"Attention", "MultiHeadAttention", "GroupQueryAttention", "Rotary", "RotaryEmbedding"})


def computes_each_image_alone(segment: Any) -> bool:
    """Whether `segment` at batch 2B (B: its planned batch) is two runs of it at B on consecutive halves of every
    entry and exit: no member is an op along the first dim (ALONG_THE_FIRST_DIM, an `axis`/`axes` attribute that
    names it: a Concat of two batches stacks them, a Softmax over it mixes them; an attention or rotary layer reading
    rank 2, whose sequence is dim 0), each member's NativeStep at 2B
    (`at`) writes every value at twice its planned first dim and its other dims as planned, and every exit keeps its
    first dim outermost in memory. A layer that cannot bind 2B refuses (the segment then binds views, or runs layer
    by layer, as before)."""
    batch = segment._planned_batch
    planned = _forms(segment.members, segment._natives)
    ranks = {slot: len(size) for slot, (size, _strides, _dtype) in planned.items()}
    ranks.update((slot, len(size)) for slot, size in zip(segment.entries, segment.entry_sizes))
    for m in segment.members:
        rank = ranks.get(m.inputs[0], 0)
        if m.ctx.op_type in ALONG_THE_FIRST_DIM or _names_the_first_dim(m, rank) \
                or (m.ctx.op_type in OVER_A_SEQUENCE and rank < 3):
            return False
    try:
        at = segment._natives_at(tuple((2 * size[0], *size[1:]) for size in segment._planned_key))
    except Exception:  # noqa: BLE001  a layer without a primitive at 2B: views or layer by layer, as before
        return False
    for slot, (size, _strides, _dtype) in planned.items():
        doubled = at.forms.get(slot)
        if doubled is None or len(size) == 0 or tuple(doubled[0]) != (2 * size[0], *size[1:]):
            return False
    # entries are laid out NHWC or row-major (entry_layouts), NCHW where staged: the first dim outermost in each
    return all(len(size) > 0 and size[0] % batch == 0 and strides[0] == math.prod(size[1:])
               for size, strides, _dtype in segment.exit_shapes)


def _names_the_first_dim(member: Any, rank: int) -> bool:
    """Whether a member's `axis` or `axes` attribute (ONNX's: negative from the end of its input's `rank` dims)
    names dim 0."""
    axes = member.attributes.get("axes", member.attributes.get("axis"))
    values = axes.tolist() if hasattr(axes, "tolist") else axes  # a tensor or array of them
    values = values if isinstance(values, (list, tuple)) else [values]
    try:
        found = [int(a) for a in values if a is not None]
    except (TypeError, ValueError):  # an attribute of another meaning (a string)
        return False
    return any((a % rank if rank else a) == 0 for a in found)


@dataclass
class BatchPlan:
    """How a segment runs one batch of its images, worked out at the batch's first call: `runs` runs of the planned
    segment, then `left` images on `one` (its view at one image; None: layer by layer). Spans in bytes."""

    runs: int
    left: int
    exit_shapes: list[tuple]  # (size, strides, dtype) of each exit at this batch
    entry_spans: list[int]  # bytes of one run's span of each entry (its planned first dim)
    exit_spans: list[int]
    entry_images: list[int]  # ... and of one image's
    exit_images: list[int]
    one: tuple | None  # the key of the segment's view at one image (in its `resized`; None: no images left)
    # a segment without batch runs (planned_batch None): the key its view at this batch is bound at (in `resized`),
    # which serves the batch until it is bound exactly, as the runs do elsewhere
    view: tuple | None = None
    # the exact bind (call_batch): "runs" (counting calls), "binding" (queued on BINDS), "trial" (bound, timed against
    # the runs), "bound" (kept), "runs kept" (the runs were faster), "failed" (a layer cannot bind the batch),
    # "evicted" (let go by the segment's bound batches: counting again)
    state: str = "runs"
    calls: int = 0
    evictions: int = 0
    bound: Any = None  # the Segment bound at this batch with its own primitives (state "trial" or "bound")
    bound_bytes: int = 0
    used: int = 0  # _TICKS at its last call on `bound`
    trial: int = 0  # calls of the trial so far (even: the bound batch, odd: the runs)
    trial_bound: list[float] = field(default_factory=list)  # seconds per call
    trial_runs: list[float] = field(default_factory=list)


def another_batch(planned: tuple, key: tuple) -> bool:
    """Whether entries of sizes `key` are another batch of the `planned` ones: each entry's first dim scaled by one
    factor (a window mask [B·windows, ...] beside the images scales with them), its other dims as planned. An entry
    of no dims (a scalar: a token segment's step or length) scales with nothing: never another batch."""
    if len(key) != len(planned) or key == planned or not key or not all(key) or not all(planned):
        return False
    n, b = key[0][0], planned[0][0]
    return all(len(k) == len(p) and k[0] * b == p[0] * n and k[1:] == p[1:] for k, p in zip(key, planned)) and n > 0


def batch_plan(segment: Any, key: tuple) -> BatchPlan | None:
    """`segment`'s BatchPlan for entries of sizes `key`, or None: not another batch of its images, or its members
    mix the images of a batch (computes_each_image_alone, asked once). A segment that runs no batches in runs
    (planned_batch None: a transformer's token segment, tuned at a few rows) but has views gets a plan that runs
    its view at that batch until the batch is bound exactly (swin_tiny's last stage: 128 rows at its tuned batch).
    The caller holds the segment's resize lock."""
    batch = segment._planned_batch
    planned = segment._planned_key
    if batch is None:
        if not segment._views or not another_batch(planned, key):
            return None
        return BatchPlan(0, 0, [], [], [], [], [], None, view=key)
    if batch is None or not key or not key[0] or key[0][0] * batch % planned[0][0]:
        return None
    n = key[0][0] * batch // planned[0][0]  # images: each entry's first dim is theirs x its multiple
    if n <= 0 or any(len(k) != len(p) or k[0] * batch != n * p[0] or k[1:] != p[1:] for k, p in zip(key, planned)):
        return None
    if segment._per_image is None:
        segment._per_image = computes_each_image_alone(segment)
    if not segment._per_image:
        return None
    runs, left = divmod(n, batch)
    exit_shapes = []
    for size, strides, dtype in segment.exit_shapes:
        nhwc = len(size) == 4 and tuple(strides) != row_major_strides(tuple(size))
        size = (size[0] // batch * n, *size[1:])
        exit_shapes.append((size, native_strides(size) if nhwc else row_major_strides(size), dtype))
    entry_spans = [dtype.itemsize * math.prod(p) for p, dtype in zip(planned, segment.entry_dtypes)]
    exit_spans = [dtype.itemsize * math.prod(size) for size, _strides, dtype in segment.exit_shapes]
    one = one_image_key(segment) if left else None
    if one is not None:
        segment._bind_sizes(one)  # bound now, at the batch's first call (held by key: no cycle through the view)
    return BatchPlan(runs, left, exit_shapes, entry_spans, exit_spans, [s // batch for s in entry_spans],
                     [s // batch for s in exit_spans], one)


def one_image_key(segment: Any) -> tuple:
    """The entry sizes of `segment`'s view at one image (its planned entries' first dims over its planned batch): the
    images left past a batch's runs run on it."""
    batch = segment._planned_batch
    return tuple((p[0] // batch, *p[1:]) for p in segment._planned_key)


def exit_sizes_in_runs(segment: Any, key: tuple) -> list[tuple[int, ...]] | None:
    """The exits' sizes of `segment` at entries of sizes `key` where that batch runs in runs of it (each exit's first
    dim scaled as the entries'), without binding anything; None where it would not (not another batch of its images,
    or its members are not known to compute each image alone: runs_ahead asks)."""
    batch, planned = segment._planned_batch, segment._planned_key
    if batch is None or not segment._per_image or not another_batch(planned, key) \
            or key[0][0] * batch % planned[0][0]:
        return None
    n = key[0][0] * batch // planned[0][0]
    return [(size[0] // batch * n, *size[1:]) for size, _strides, _dtype in segment.exit_shapes]


def runs_ahead(segment: Any, left: bool) -> bool:
    """Make now what a segment's first call at another batch makes otherwise (batch_plan): whether its members compute
    each image alone (~2 ms of Python a segment on swin_tiny), and, where a batch leaves images past its runs (`left`),
    its view at one image bound and its NCHW entries' one-image reorders: ~50 ms at swin_tiny's first odd batch over
    its 10 image segments (bench/results/first-shape-2026-12-06.md). For the background thread at load
    (kiln/runtime/views_ahead.py): the resize lock is held while the answer is set and the view bound, as batch_plan
    holds it (the members' NativeStep.at are cached in their launches: made one thread at a time). True where
    something was made."""
    if segment._planned_batch is None:
        return False
    made = False
    if segment._per_image is None:
        with segment._resize_lock:  # its members' NativeStep.at (cached in their launches) one thread at a time
            if segment._per_image is None:
                segment._per_image, made = computes_each_image_alone(segment), True
    if not segment._per_image or not left or segment._planned_batch == 1:
        return made
    one = one_image_key(segment)
    if one not in segment.resized:
        with segment._resize_lock:
            if one not in segment.resized:
                segment._bind_sizes(one)
                made = True
    for k, _bound, _buffer in segment._staged:
        if k not in segment._left_reorders:
            _one_image_reorder(segment, k)
            made = True
    return made


def plans_ahead(segment: Any, images: int) -> bool:
    """The BatchPlans of 1 .. `images` images (at most PLANS // 2) made now, as a first call at each batch makes its
    own (_batch_runs: ~30 µs of Python a segment, ~0.35 ms a new batch over swin_tiny's 10 image segments): a
    background job at load, after runs_ahead (its per-image check and one-image view are then found made). True where
    a plan was made."""
    batch, planned = segment._planned_batch, segment._planned_key
    if batch is None or not segment._per_image:
        return False
    made = False
    for n in range(1, min(images, PLANS // 2) + 1):
        key = tuple((p[0] // batch * n, *p[1:]) for p in planned)
        if key != planned and key not in segment._batch_plans:
            made = segment._batch_runs(key) is not None or made
    return made


def call_batch(segment: Any, key: tuple, values: tuple, plan: BatchPlan) -> Any:
    """One call of `segment` at the batch of `plan`: on the batch bound exactly where one is kept, else in runs
    (run_batches); counts the calls that lead to the exact bind and times the trial that decides whether it stays."""
    bound, state = plan.bound, plan.state
    if bound is not None and state == "bound":
        plan.used = next(_TICKS)
        return bound._run_bound(values)
    if bound is not None and state == "trial":
        plan.used = next(_TICKS)
        turn = plan.trial
        plan.trial = turn + 1
        if turn == 0:  # untimed: the first touch of its arena's pages and its fresh primitives' code
            return bound._run_bound(values)
        on_bound = turn % 2 == 1
        clock = _clock or _trial_clock()
        start = clock()
        out = bound._run_bound(values) if on_bound else run_batches(segment, values, plan)
        (plan.trial_bound if on_bound else plan.trial_runs).append(clock() - start)
        if len(plan.trial_bound) >= TRIAL and len(plan.trial_runs) >= TRIAL:
            _settle(segment, key, plan)
        return out
    out = run_batches(segment, values, plan)
    if state in ("runs", "evicted"):
        plan.calls += 1
        if plan.calls >= BIND_AFTER << plan.evictions and binds_enabled():
            _schedule_bind(segment, key, plan)
    return out


PENDING = object()  # direct_view: the batch's calls still decide something (call_batch's to make)
ON_VIEW = object()  # direct_view: the segment's view at the batch


def direct_view(plan: BatchPlan) -> Any:
    """What a direct run of a one-segment program (kiln/runtime/direct_run.py) runs a batch of `plan` on, once
    call_batch has nothing left to count, bind or time there: the exact bind its trial kept (state "bound": that
    Segment), or, for a view plan whose runs were kept (its bind failed or lost the trial, or binds are off),
    ON_VIEW: the segment's view at the batch, which call_batch would run. None where call_batch runs the planned
    segment several times (no one segment to call); PENDING while the plan's calls still count towards the bind or
    its trial times them: asked again later."""
    state, bound = plan.state, plan.bound
    if state == "bound" and bound is not None:
        return bound
    if plan.view is None:
        return None
    if state in ("runs kept", "failed") or (state in ("runs", "evicted") and not binds_enabled()):
        return ON_VIEW
    return PENDING


def still_bound(segment: Any, key: tuple, bound: Any) -> bool:
    """Whether `bound` is still the kept exact bind of the segment's batch `key` (state "bound"); if so it is marked
    used, as call_batch marks it (the segment's bound batches let the least recently used go)."""
    plan = segment._batch_plans.get(key)
    if plan is None or plan.bound is not bound or plan.state != "bound":
        return False
    plan.used = next(_TICKS)
    return True


def _trial_clock() -> Any:
    """The calling thread's CPU time where the run is on it alone (OpenMP's count 1: a loaded machine's preemption
    left out, which swings wall-clock times 2-10x on 2 shared cores), else the wall clock (the layers' other
    threads' work counts)."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def _schedule_bind(segment: Any, key: tuple, plan: BatchPlan) -> None:
    """Queue the exact bind of `key` on BINDS (once per state "runs" or "evicted"). The job holds the segment weakly:
    an engine let go before its turn is not bound."""
    with _STATE:
        if plan.state not in ("runs", "evicted"):
            return
        plan.state = "binding"
    ref = weakref.ref(segment)

    def make() -> bool:
        seg = ref()
        if seg is None or plan.state != "binding":
            return False
        try:
            bound = exact_bind(seg, key)
        except Exception:  # noqa: BLE001  a layer without a primitive at this batch: the runs stay
            plan.state = "failed"
            return False
        _swap_in(seg, key, plan, bound)
        return True
    BINDS.schedule([onednn_ahead.Job(("exact batch", next(_TICKS)), 0, make)], torch.get_num_threads())


def exact_bind(segment: Any, key: tuple) -> Any:
    """A Segment of `segment`'s members bound at entries of sizes `key`, each oneDNN image layer with a primitive
    made for that batch (onednn_chunks.exact_batches), over an arena of its own (its runs do not wait on the
    planned segment's lock). ValueError where its entries or exits would differ."""
    with onednn_chunks.exact_batches():
        at = segment._natives_at(key)
        bound = type(segment)(segment.members, segment.read_after, segment.constants, at.natives,
                              arena=batch_arena(segment, key))
    if bound.entries != segment.entries or bound.exits != segment.exits or bound._planned_key != key:
        raise ValueError("the segment bound at this batch has other entries, exits or sizes")
    return bound


def batch_arena(segment: Any, key: tuple) -> SharedArena | None:
    """The arena the exact binds of one batch share across the segments of `segment`'s program (None: the segment
    plans into an arena of its own). Why: a program's segments run one after another, each over the memory the one
    before it left warm in cache; exact binds each over an arena of their own (as before) read every segment's
    activations from memory not touched since the last call (swin_tiny's whole call at batches 1-8, one process:
    1.05-1.11x the engine built at that batch with an arena per bound segment, 1.02-1.08x with one per batch; loads
    4-13, bench/results/image-batches-2026-12-06.md, session 23).

    One per program arena (an execution context's lane) and batch (as a scale of the planned one: a program's
    segments may plan their first dims as B images or B·windows), held by the segments bound over it (a weak map: it
    goes with the last of them). As large as the planned arena scaled to the batch plus BATCH_ARENA_SLACK: an image
    segment's values scale with the images (computes_each_image_alone); a segment whose plan needs more than that
    (a value not proportional to the batch) plans into an arena of its own, as before (SharedArena.take answers
    None). Address space only: what is resident is the largest plan that ran in it."""
    shared = segment.arena
    if shared is None or not another_batch(segment._planned_key, key):
        return None
    scale = Fraction(key[0][0], segment._planned_key[0][0])  # the batch over the planned one, alike in each segment
    with _STATE:
        arenas = shared.batch_arenas
        found = arenas.get(scale)
        if found is None:
            found = SharedArena(math.ceil(shared.planned * scale) + BATCH_ARENA_SLACK)
            arenas[scale] = found
    return found


def _swap_in(segment: Any, key: tuple, plan: BatchPlan, bound: Any) -> None:
    """Put `bound` into the plan (state "trial": the next calls time it against the runs) and into the segment's
    bound batches, letting the least recently used go past BOUND_BATCHES or BOUND_BYTES."""
    size = bound.planned_bytes + sum(buffer.numel() * buffer.element_size() for _k, _b, buffer in bound._staged)
    with _STATE:
        if plan.state != "binding":
            return
        kept = segment._bound_batches
        plan.bound_bytes, plan.used, plan.trial = size, next(_TICKS), 0
        plan.trial_bound, plan.trial_runs = [], []
        plan.state = "trial"  # before `bound`: a call that finds the bound segment finds its state with it
        plan.bound = bound
        kept[key] = plan
        while len(kept) > BOUND_BATCHES or sum(p.bound_bytes for p in kept.values()) > BOUND_BYTES:
            oldest = min(kept, key=lambda k: kept[k].used)
            _let_go(kept.pop(oldest), "evicted")


def _let_go(plan: BatchPlan, state: str) -> None:
    """Drop a plan's bound batch (a call running on it keeps its own reference until it returns). Under _STATE."""
    plan.state = state
    plan.bound = None
    plan.bound_bytes = 0
    if state == "evicted":
        plan.calls = 0
        plan.evictions += 1


def _settle(segment: Any, key: tuple, plan: BatchPlan) -> None:
    """End a plan's trial: keep the bound batch where its fastest call is within KEEP_BOUND_AT of the runs'."""
    with _STATE:
        if plan.state != "trial":
            return
        if min(plan.trial_bound) <= KEEP_BOUND_AT * min(plan.trial_runs):
            plan.state = "bound"
        else:
            segment._bound_batches.pop(key, None)
            _let_go(plan, "runs kept")


def forget(segment: Any, key: tuple, plan: BatchPlan) -> None:
    """A plan let go by the segment's plans: its bound batch goes with it, and a bind of it still queued or in hand
    is not swapped in (state "runs": _schedule_bind's job and _swap_in act only on "binding"), else the segment's bound
    batches would keep a batch that no plan serves."""
    with _STATE:
        if segment._bound_batches.get(key) is plan:
            del segment._bound_batches[key]
        if plan.bound is not None:
            _let_go(plan, "runs")
        elif plan.state == "binding":
            plan.state = "runs"


def run_batches(segment: Any, values: tuple, plan: BatchPlan) -> Any:
    """Entries of plan.runs planned batches and plan.left more images: fresh exits at their sizes, the runs of the
    planned segment (under its lock), then the images left on its one-image view. A view plan: the segment's view
    at the batch."""
    if plan.view is not None:
        return segment.run_resized(plan.view, values)
    exits = [torch.empty_strided(size, strides, dtype=dtype) for size, strides, dtype in plan.exit_shapes]
    staged = bool(segment._staged) and all(not segment._laid_out(k, values[k]) and values[k].is_contiguous()
                                           for k, _, _ in segment._staged)
    layouts = segment.entry_layouts
    entries = [v if (staged and layouts[k] == "nhwc") or segment._laid_out(k, v)
               else (v.contiguous(memory_format=_CL) if layouts[k] == "nhwc" else v.contiguous())
               for k, v in enumerate(values)]
    entry_at, exit_at = [e.data_ptr() for e in entries], [x.data_ptr() for x in exits]
    if plan.runs:
        with segment._lock:
            for i in range(plan.runs):
                segment._run([a + i * d for a, d in zip(entry_at, plan.entry_spans)],
                             [a + i * d for a, d in zip(exit_at, plan.exit_spans)], staged)
    if plan.left:
        entry_at = [a + plan.runs * d for a, d in zip(entry_at, plan.entry_spans)]
        exit_at = [a + plan.runs * d for a, d in zip(exit_at, plan.exit_spans)]
        one = segment.resized.get(plan.one)
        if one is None and plan.one not in segment.resized:  # let go by the segment's LRU since: bound again
            with segment._resize_lock:
                one = segment._bind_sizes(plan.one)
        if one is None:
            _left_layer_by_layer(segment, entries, exits, plan)
        else:
            keep = _laid_out_left(segment, entries, entry_at, plan) if staged else None
            for j in range(plan.left):
                one.run_at([a + j * d for a, d in zip(entry_at, plan.entry_images)],
                           [a + j * d for a, d in zip(exit_at, plan.exit_images)])
            del keep
    return tuple(exits) if len(exits) != 1 else exits[0]


def _left_layer_by_layer(segment: Any, entries: list[torch.Tensor], exits: list[torch.Tensor], plan: BatchPlan
                         ) -> None:
    """The images left, where the segment has no view at one image: its layers one by one on them."""
    rest = [e[plan.runs * p[0]:] for e, p in zip(entries, segment._planned_key)]
    for x, o, (size, _s, _d) in zip(exits, segment.fallback(rest), segment.exit_shapes):
        x[plan.runs * size[0]:].copy_(o)


def _laid_out_left(segment: Any, entries: list[torch.Tensor], entry_at: list[int], plan: BatchPlan
                   ) -> list[torch.Tensor]:
    """The left images of a staged segment's NCHW entries laid out NHWC, as its view reads them (it has no staging
    reorder), by oneDNN's one-image reorder run over them (onednn_chunks.BatchChunks: one native call, not torch's
    copy): `entry_at` pointed at the copies, which the caller keeps until the view ran."""
    keep = []
    for k, _bound, _buffer in segment._staged:
        size = tuple(entries[k].shape[1:])
        out = torch.empty((plan.left, size[1], size[2], size[0]), dtype=entries[k].dtype)  # NHWC
        bound, chunks_plan = _one_image_reorder(segment, k)
        lib = onednn.load()
        with segment._lock:  # the reorder's memory objects and plan are the segment's
            chunks_plan.count = plan.left
            lib.lib.dnnl_memory_set_data_handle(bound.memory("src"), entry_at[k])
            lib.lib.dnnl_memory_set_data_handle(bound.memory("dst"), out.data_ptr())
            status = native_loop.load().kiln_batch_chunks(ctypes.c_void_p(ctypes.addressof(chunks_plan)), lib.stream,
                                                          0, None)
        onednn._check(status, f"reorder of input {k}'s images left past the runs")
        entry_at[k] = out.data_ptr()
        keep.append(out)
    return keep


def _one_image_reorder(segment: Any, k: int) -> tuple[Any, Any]:
    """Entry k's one-image NCHW -> NHWC reorder in runs (ChunksBound, its plan), made at first use, per segment,
    without a lock: two threads may both make it, and setdefault keeps the first."""
    found = segment._left_reorders.get(k)
    if found is None:
        size = (1, *segment.entry_sizes[k][1:])
        reorder = onednn.Reorder(size, onednn.TAG_ABCD, onednn.TAG_ACDB, dtype=segment.entry_dtypes[k])
        bound = onednn_chunks.BatchChunks(reorder, None, 1).bind(0, 0)
        found = segment._left_reorders.setdefault(k, (bound, bound.plan))
    return found
