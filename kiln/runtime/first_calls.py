"""A CPU program's first call at a new input shape, run padded inside a shape it has already bound (issue 10).

A first call at a new input-shape signature computes that signature's shape values (kiln/runtime/shape_function.py)
and binds every native segment at the new sizes (kiln/runtime/native.py): on bert_tiny ~2.6 ms of a first call's
~2.9 ms extra (1 thread), where a repeat costs 0.07-4 ms. A shape already run keeps both (its shape plan and its
segment views), so a new shape may instead run padded inside it and be cropped back, where padding is exact
(kiln/runtime/buckets.py's rule, shared with CUDA's buckets: the batch; a sequence a padding mask covers; the dims
the build declares):

    host       a bound signature equal to the new one except along the padded dims, and >= it along each of them
    extra      t_host * (1 - work_new / work_host), work = the product of the padded dims: the padded run's extra time
               if a run's time were proportional to its work (an overestimate where a run has a fixed cost)
    choice     the host of least extra, when that extra is below the cost of binding (a first exact call's time less
               a repeat's at the same shape: median of the last BIND_SAMPLES; BIND_MS until one is measured) less a
               padded call's own cost (the host's search, the padding and the crops: median of the last
               BIND_SAMPLES padded calls; 0 until one is measured); where that difference is not positive no host
               is searched. On Zen 4 a bert_tiny shape binds for ~0.1-0.4 ms (the median measured) and a padded
               call's own work measured 0.2-0.36 ms (the search ~75 µs of it, on caches a run has cooled): by the
               extra alone the stream of 200 shapes ran 9-15% more thread CPU padded than binding every shape, 3-9%
               with the own cost counted (bench/results/stream-zen4-2026-12-07c.md)

ExecutionContext.warm_up binds the hosts ahead (host_sizes: at most 25% padding along each dim, bounded); a call of
numpy arrays at a bound shape, or padded in one, runs as one call of its segment's loop (kiln/runtime/direct_run.py).
A new shape is bound (run at its own size) once its padded runs have cost, by that estimate, what binding would: a
shape's call pads while its earlier padded calls' extra plus this one's stays below the budget (renting until the
rent paid would buy: within 2x of the best choice made knowing the future). A shape that repeats binds after
budget / extra calls (bert_tiny's 7 x 11 in 7 x 12, extra ~0.02 ms, budget ~0.8 ms: after ~35; at its second call
before, which cost a stream's small requests 2-4x onnxruntime's time at that call), one met once never binds.
Times are the calling thread's CPU time (time.thread_time) of the program's run: a loaded machine's preemption is
left out, which wall clock put into binding's measured cost (a difference of two calls) but not into a shape's time
(the least seen): 7-18 ms of binding measured at load 9, against ~2.5 ms of CPU. With OpenMP's spinning waits
(kiln's default) a caller waiting for its workers spends CPU time too.

Exactness (never a different result, only a different summation order in the GEMMs' and attention's tails: the
padded and unpadded runs agree to fp32 rounding, tests/unit/test_first_calls.py): rows of a batch never meet;
tokens a mask zeroes are never attended to, as long as each row keeps one real token. A row the mask empties
attends to every key alike (BERT's additive mask of the dtype's minimum), so the padded keys would change it: such
a run is not padded along the sequence.
"""

from __future__ import annotations

import bisect
import itertools
import operator
import threading
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kiln.ir import dtypes
from kiln.kernels.cpu import onednn_ahead
from kiln.plan.spec import Binding, Profile
from kiln.runtime import views_ahead
from kiln.runtime.buckets import MASK_NAMES, Buckets
from kiln.runtime.direct_run import DirectRuns
from kiln.runtime.native import Segment
from kiln.runtime.program import SHAPE_PLANS, Program, input_signature

BIND_MS = 1.0  # the cost of binding a new shape until one is measured (bert_tiny's ~2.6 ms, BERT-base's more)
BIND_SAMPLES = 9  # measured binding costs kept (their median is the budget)
SEEN_SHAPES = 4096  # unbound shapes whose padded runs' extra is counted (then the count starts over)
EVERY_SIZE_TO = 4  # host_sizes: every size up to this one, then quarter steps of each power of two
WARM_UP_HOSTS = SHAPE_PLANS * 3 // 4  # the most shapes a warm-up binds (the rest of the plans' room: the stream's)
WARM_UP_S = 2.0  # ... and the most seconds (wall clock) it binds them for


@dataclass
class BoundShape:
    """A signature run at its own size (so bound): its padded dims' sizes, their product, its times."""

    signature: tuple
    sizes: tuple[int, ...]  # the padded symbols' sizes, in FirstCalls.symbols' order
    work: int
    first_ms: float  # its first exact run (the binding included)
    ms: float  # its least run time since (the first's until it repeats)
    runs: int = 1


class Hosts:
    """The bound shapes of one group (equal but for the padded dims). A plain loop: after a run has streamed the
    caches full of activations, numpy's calls over these sizes took twice the loop's time (670 against 340 µs of
    a first call, bert_tiny, load 9). Its answer is remembered per (sizes, unpaddable dims) until a shape is added
    or removed. Host times measured in between refine the choice at the next add or removal.

    The loop walks the shapes by work, least first, and stops where no later one can do better: a host's extra is
    (t / its work) x (its work - work) >= floor x (its work - work), `floor` at most any bound shape's time per unit
    of work (FirstCalls.rate_floor, lowered as times are measured), and that bound only grows along the walk. Over a
    warm-up's ~190 hosts the whole loop took ~35-40 µs a call on a quiet machine and 75-130 µs in a loaded stream
    (bert_tiny's small padded calls take ~170-500), where most padded calls are at sizes not searched before; the walk
    stops after the few hosts just above the call's work."""

    def __init__(self) -> None:
        self.shapes: list[BoundShape] = []  # by work, least first (equal work: in the order added)
        self._works: list[int] = []  # each one's work, for bisect
        self._least: dict[tuple, BoundShape | None] = {}  # (sizes, fixed) -> the host of least extra, any budget

    def add(self, shape: BoundShape) -> None:
        i = bisect.bisect_right(self._works, shape.work)
        self.shapes.insert(i, shape)
        self._works.insert(i, shape.work)
        self._least.clear()

    def remove(self, shape: BoundShape) -> None:
        """Let `shape` go: found among the shapes of its work (bisect), not by a walk of them all (every bind of a
        stream past SHAPE_PLANS lets one go: the walk over ~256 shapes was ~15-40 µs of it)."""
        i = bisect.bisect_left(self._works, shape.work)
        while self.shapes[i] is not shape:
            i += 1
        del self.shapes[i], self._works[i]
        self._least.clear()

    def cheapest(self, sizes: tuple[int, ...], fixed: list[int], budget: float, plans: Any, floor: float = 0.0
                 ) -> tuple[BoundShape, float] | None:
        """The shape of least estimated extra (t * (1 - work / its work)) that holds `sizes` (>= along each padded
        dim, equal along the `fixed` ones, not equal along all), its shape plan kept, and that extra, when the extra
        is below `budget`; else None. `floor`: at most any shape's t / work (0: the loop walks every shape)."""
        key = (sizes, tuple(fixed))
        host = self._least.get(key, _UNKNOWN)
        if host is _UNKNOWN or (host is not None and plans is not None and host.signature not in plans):
            if len(self._least) >= SEEN_SHAPES:
                self._least.clear()
            host = self._least[key] = self._search(sizes, fixed, plans, floor)
        if host is None:
            return None
        extra = host.ms * (1.0 - _product(sizes) / host.work)
        return (host, extra) if extra < budget else None

    def _search(self, sizes: tuple[int, ...], fixed: list[int], plans: Any, floor: float = 0.0
                ) -> BoundShape | None:
        work = _product(sizes)
        best, best_extra = None, float("inf")
        shapes = self.shapes
        for k in range(bisect.bisect_left(self._works, work), len(shapes)):  # less work cannot hold `sizes`
            host = shapes[k]
            if floor * (host.work - work) >= best_extra:
                break  # this one's extra, and every later one's, is at least that bound
            held = host.sizes
            if held == sizes or not all(map(operator.ge, held, sizes)) \
                    or (fixed and any(held[j] != sizes[j] for j in fixed)):
                continue
            extra = host.ms * (1.0 - work / host.work)
            if extra < best_extra and (plans is None or host.signature in plans):
                best, best_extra = host, extra
        return best


_UNKNOWN = object()  # Hosts._least: not searched yet


class FirstCalls:
    """Runs a CPU Program, each call at a shape the program has not bound padded inside one it has, when that
    costs less than binding (the module's docstring). Shared by an engine's contexts."""

    def __init__(self, program: Program, buckets: Buckets, inputs: list[Binding]):
        self.program = program
        self.buckets = buckets
        self.symbols = list(buckets.symbols)
        # where each padded symbol is read: its first carrier (input, axis); the engine checked the others agree
        carriers = {symbol: (k, axis) for k, pads in reversed(list(enumerate(buckets.pads))) for axis, symbol in pads}
        self._carriers = [carriers[s] for s in self.symbols]
        self._padded_axes = [{axis for axis, _ in pads} for pads in buckets.pads]
        self._pads = [[(axis, self.symbols.index(symbol)) for axis, symbol in pads] for pads in buckets.pads]
        self._crops = [[(axis, self.symbols.index(symbol)) for axis, symbol in crops] for crops in buckets.crops]
        # the masks: a row they empty must not be padded along the sequence (the docstring's exactness)
        self._masks = [(k, self.symbols.index(symbol)) for k, (b, pads) in enumerate(zip(inputs, buckets.pads))
                       if any(m in b.name.lower() for m in MASK_NAMES) and len(b.shape or ()) == 2
                       for axis, symbol in pads if axis == 1]
        self.bound: OrderedDict[tuple, BoundShape] = OrderedDict()  # signature -> its bound shape, least recent first
        self._groups: dict[tuple, Hosts] = {}  # _group(signature) -> its bound shapes
        self._paid: dict[tuple, float] = {}  # unbound signature -> its padded runs' estimated extra ms so far
        self._group_of: dict[tuple, tuple] = {}  # signature -> _group's (asked at its search, bind and eviction)
        self.bind_ms: deque[float] = deque(maxlen=BIND_SAMPLES)
        self.pad_ms: deque[float] = deque(maxlen=BIND_SAMPLES)  # padded calls' own cost (pad_overhead_ms)
        self.padded_runs = 0
        self.rate_floor = float("inf")  # at most the ms / work of every bound shape (Hosts' bound)
        self._lock = threading.Lock()

    def run(self, args: list[Any], into: dict[int, Any] | None = None) -> list[Any]:
        """`into`: as Program.run's, for a run at the call's own sizes (a padded run's outputs are crops of its own)."""
        signature = input_signature(args)
        if signature is None:
            return self.program.run(args, into=into)
        known = self.bound.get(signature)
        if known is not None:
            return self._run_exact(args, signature, known, into)
        sizes = self._sizes(signature)
        t0 = time.thread_time_ns()
        host = self._host(args, signature, sizes)
        if host is not None:
            return self._run_padded(args, sizes, host, t0)
        self._paid.pop(signature, None)
        return self._run_exact(args, signature, None, into)

    def run_direct(self, arrays: list[np.ndarray], signature: tuple, direct: DirectRuns) -> list[np.ndarray] | None:
        """`run`'s choice for numpy inputs (C-contiguous, of `signature`) through `direct` (kiln/runtime/direct_run.py):
        a bound shape run at its size (its first repeat timed, as `run` times it, for what binding cost), a new one
        bound or padded in its host, each as one call of the loop; None where `run` would do something else (bind the
        shape by a run of the program) or the shape has no DirectRun (or its view went meanwhile): then the caller
        takes `run`. The first repeat went `run`'s way before, the general path (torch conversions, Program.run):
        bert_tiny's second call at a shape cost 120-220 µs more than its later ones on Zen 4 (onnxruntime's 20-70),
        14-19 µs this way (bench/results/stream-zen4-2026-12-07c.md)."""
        known = self.bound.get(signature)
        if known is not None:
            record = direct.find(signature)
            if record is None:
                return None
            if known.runs < 2:  # its first repeat, timed as `run` times it: what binding cost is measured
                t0 = time.thread_time_ns()
                results = record.run(arrays)
                if results is not None:
                    self._ran_exact(signature, known, (time.thread_time_ns() - t0) / 1e6)
                return results
            try:  # (one C call under the GIL: no lock, ~0.2 µs of a tiny model's ~5 µs call)
                self.bound.move_to_end(signature)
            except KeyError:  # let go by another thread meanwhile
                pass
            return record.run(arrays)
        sizes = self._sizes(signature)
        t0 = time.thread_time_ns()
        host = self._host(arrays, signature, sizes, paying=False)
        if host is None:  # bound: without a run of the program, then one call of its loop
            return self._bind_direct(arrays, signature, sizes, direct)
        record = direct.find(host.signature)
        if record is None:
            return None
        padded = [_padded_array(a, axes, host.sizes) for a, axes in zip(arrays, self._pads)]
        t1 = time.thread_time_ns()
        results = record.run(padded)
        t2 = time.thread_time_ns()
        if results is None:  # the host's view was let go since find()
            return None
        cropped = [_cropped_array(y, axes, sizes) for y, axes in zip(results, self._crops)]
        self._pay(signature, host)
        self._padded(host, t0, t1, t2)
        return cropped

    def _bind_direct(self, arrays: list[np.ndarray], signature: tuple, sizes: tuple[int, ...], direct: DirectRuns
                     ) -> list[np.ndarray] | None:
        """A new shape bound as `run` would bind it (its first exact run, recorded as _run_exact records one), but
        through `direct`: its shape values and view made without a run of the program (DirectRuns.bind), then one
        call of the loop. None where that cannot be (`run` then binds it by a run of the program)."""
        t0 = time.thread_time_ns()
        record = direct.bind(signature, arrays)
        results = record.run(arrays) if record is not None else None
        if results is None:
            return None
        ms = (time.thread_time_ns() - t0) / 1e6
        with self._lock:
            self._paid.pop(signature, None)
            if signature not in self.bound:  # else another context's run bound it meanwhile
                self._add(BoundShape(signature, sizes, 0, ms, ms))
        return results

    def _run_exact(self, args: list[Any], signature: tuple, known: BoundShape | None,
                   into: dict[int, Any] | None = None) -> list[Any]:
        """The program at the call's own size; its time recorded (a first run's: the shape's first_ms)."""
        t0 = time.thread_time_ns()
        results = self.program.run(args, into=into)
        self._ran_exact(signature, known, (time.thread_time_ns() - t0) / 1e6)
        return results

    def _ran_exact(self, signature: tuple, known: BoundShape | None, ms: float) -> None:
        """Record a run at the call's own size that took `ms`: a new shape bound (its first_ms), or a bound one's
        repeat (its first: what binding cost, the first run less this one)."""
        with self._lock:
            if known is None:
                self._add(BoundShape(signature, self._sizes(signature), 0, ms, ms))
            else:
                if signature in self.bound:  # (else let go by another context's run meanwhile)
                    self.bound.move_to_end(signature)
                if known.runs == 1:  # its first repeat: what binding it cost
                    self.bind_ms.append(max(known.first_ms - ms, 0.0))
                    known.ms = ms
                else:
                    known.ms = min(known.ms, ms)
                known.runs += 1
                self._lower_floor(known)

    def _run_padded(self, args: list[Any], sizes: tuple[int, ...], host: BoundShape, t0: int) -> list[Any]:
        """The program at `host`'s size, the inputs zero-padded along the padded dims, the outputs cropped back
        (each a contiguous copy, as a run at the call's own size returns it). `t0`: the thread CPU clock (ns) before
        the host was searched, for the padded path's own cost."""
        padded = [_padded(x, axes, host.sizes) for x, axes in zip(args, self._pads)]
        t1 = time.thread_time_ns()
        results = self.program.run(padded)
        t2 = time.thread_time_ns()
        cropped = [_cropped(y, axes, sizes) for y, axes in zip(results, self._crops)]
        self._padded(host, t0, t1, t2)
        return cropped

    def _padded(self, host: BoundShape, t0: int, t1: int, t2: int) -> None:
        """Record a padded run from the thread CPU clock (ns) read before the host's search (`t0`) and around the
        host's run (`t1`, `t2`): the host's run (a padded run takes no less than the host's own), and the rest of the
        call until now (the host's search, the padding and the crops: pad_overhead_ms' sample)."""
        ms, own_ms = (t2 - t1) / 1e6, (time.thread_time_ns() - t2 + t1 - t0) / 1e6
        with self._lock:
            self.padded_runs += 1
            self.pad_ms.append(own_ms)
            host.ms = min(host.ms, ms)
            self._lower_floor(host)
            if host.signature in self.bound:
                self.bound.move_to_end(host.signature)  # used: as the program's shape plans and views are

    def _host(self, args: list[Any], signature: tuple, sizes: tuple[int, ...], paying: bool = True
              ) -> BoundShape | None:
        """The bound shape to run this new one padded in (least extra, below binding's cost less the padded path's
        own cost and what the shape's padded runs have cost so far), or None, without a search where no extra can be
        below that. `paying`: its extra counted as paid (else the caller's _pay)."""
        budget = self.budget_ms() - self.pad_overhead_ms() - self._paid.get(signature, 0.0)
        if budget <= 0.0:
            return None  # binding costs no more than a padded call's own work would: bound, no host searched
        hosts = self._groups.get(self._group(signature))
        if hosts is None:
            return None
        fixed = self._unpaddable(args)
        with self._lock:  # another context's run may be adding or evicting a bound shape
            found = hosts.cheapest(sizes, fixed, budget, self.program.shape_plans, self.rate_floor)
            if found is None:
                return None
            if paying:
                self._paid_for(signature, found[1])
            return found[0]

    def _pay(self, signature: tuple, host: BoundShape) -> None:
        """Count a padded run of `signature` in `host` as paid (its estimated extra)."""
        with self._lock:
            self._paid_for(signature, host.ms * (1.0 - _product(self._sizes(signature)) / host.work))

    def _paid_for(self, signature: tuple, extra: float) -> None:
        if len(self._paid) >= SEEN_SHAPES and signature not in self._paid:
            self._paid.clear()
        self._paid[signature] = self._paid.get(signature, 0.0) + extra

    def budget_ms(self) -> float:
        """What binding a new shape costs: the median measured, BIND_MS until one is."""
        samples = list(self.bind_ms)  # one C call: no other thread's append in between
        return _median(samples) if samples else BIND_MS

    def pad_overhead_ms(self) -> float:
        """What a padded call costs besides its host's run (the host's search, the padding, the crops): the median
        measured, 0 until one is (so the first padded calls measure it)."""
        samples = list(self.pad_ms)
        return _median(samples) if samples else 0.0

    def _unpaddable(self, args: list[Any]) -> list[int]:
        """The padded symbols (by index) this call may not be padded along: the sequence of a mask with a row of
        no real token (it would attend to the pads)."""
        return [j for k, j in self._masks if not _every_row_kept(args[k])]

    def _lower_floor(self, shape: BoundShape) -> None:
        """Keep rate_floor at most `shape`'s time per unit of work, its time just measured (the caller holds the
        lock). It never rises: a shape let go leaves it lower than it need be, a bound that still holds."""
        rate = shape.ms / shape.work
        if rate < self.rate_floor:
            self.rate_floor = rate

    def _sizes(self, signature: tuple) -> tuple[int, ...]:
        return tuple(signature[k][0][axis] for k, axis in self._carriers)

    def _add(self, shape: BoundShape) -> None:
        """Record a bound shape (the caller holds the lock); the least recently used out past SHAPE_PLANS, as the
        program's shape plans and segment views go."""
        shape.work = _product(shape.sizes)
        self._lower_floor(shape)
        self.bound[shape.signature] = shape
        group = self._group(shape.signature)
        hosts = self._groups.get(group)
        if hosts is None:  # (not setdefault: its Hosts() would be made at every add)
            hosts = self._groups[group] = Hosts()
        hosts.add(shape)
        while len(self.bound) > SHAPE_PLANS:
            _, old = self.bound.popitem(last=False)
            self._groups[self._group(old.signature)].remove(old)

    def _group(self, signature: tuple) -> tuple:
        """_group(signature) (the shapes that may host it), remembered: a new shape asks it at its search and again
        at its bind, and an evicted one at its removal (~5 µs each on a first call's cold caches, bert_tiny)."""
        group = self._group_of.get(signature)
        if group is None:
            if len(self._group_of) >= SEEN_SHAPES:
                self._group_of.clear()
            group = self._group_of[signature] = _group(signature, self._padded_axes)
        return group


def host_sizes(low: int, high: int) -> list[int]:
    """The sizes a warm-up binds along a padded dim inside [low, high], hosts of the sizes between: every size up
    to EVERY_SIZE_TO, then steps of a quarter of each power of two (4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, ...), and
    `high`: a new size pads by at most 25% along each dim (at most 1.56x the work of a batch x sequence). CUDA's
    buckets (kiln/runtime/buckets.py: powers of two, a sequence from 16) bound the graphs captured; on the CPU a
    bound shape costs a view and a shape plan, and bert_tiny's small requests padded 2x-8x (6 x 2 run at 8 x 16)
    took 3-5x onnxruntime's time."""
    sizes, size = [], 1
    while size < high:
        if size >= low:
            sizes.append(size)
        size = size + 1 if size < EVERY_SIZE_TO else size + (1 << (size.bit_length() - 1)) // 4
    return sizes + [high]


def primitives_ahead(program: Program, profiles: list[Profile], input_dtypes: list[torch.dtype] | None = None
                     ) -> int:
    """Start making, on a background thread, what a first call at a new row count would otherwise wait for
    (kiln/kernels/cpu/onednn_ahead.py: oneDNN inner products, the runtime-M matmul's first run): each linear
    layer's row counts up to the profiles' largest shape, taken as its tuned row count x (the largest shape's
    elements / the opt shape's): exact for a transformer's token-wise layers, an upper bound for the others. And,
    first, each segment's plan rewrite where a profile reaches other shapes (_rewrite_job), then its views readied
    (_trace_job for a program of one segment; with the inputs' dtypes, views_ahead.segments_job for one of several).
    Returns how many were queued."""
    if not onednn_ahead.enabled() or not profiles:
        return 0
    jobs = ahead_jobs(program, profiles, input_dtypes)
    return onednn_ahead.AHEAD.schedule(jobs, torch.get_num_threads()) if jobs else 0


def ahead_jobs(program: Program, profiles: list[Profile], input_dtypes: list[torch.dtype] | None = None
               ) -> list[onednn_ahead.Job]:
    """What primitives_ahead queues for `program` under `profiles`."""
    scale = 1.0
    for profile in profiles:
        for shapes in profile.inputs.values():
            opt = _product(tuple(shapes.opt))
            scale = max(scale, _product(tuple(shapes.max)) / opt)
    jobs = [job for step in program.steps if hasattr(step.fn, "ahead") for job in step.fn.ahead(scale)]
    if any(tuple(shapes.min) != tuple(shapes.max) for profile in profiles for shapes in profile.inputs.values()):
        trace = _trace_job(program, profiles)
        if trace is None and len(program.lean_steps) > 1 and input_dtypes is not None:
            trace = _segments_job(program, profiles, input_dtypes)
        jobs = [_rewrite_job(segment) for segment in program.segments if segment._views] + \
            ([trace] if trace is not None else []) + jobs
    return jobs


TRACE_SMALL = 8  # each dim's values traced ahead: the first this many of its range, then powers of two, and its max
TRACE_SHAPES = 256  # input shapes traced ahead at most (the smallest: a walk's paths differ at small sizes)


def _dim_bounds(program: Program, profile: Profile) -> tuple[list[Any], list[int], list[int]] | None:
    """The profile's range of each program input (in the program's order) and each dim position's lowest min and
    highest max over them (the inputs at one position share a dim, as a BERT's ids and mask share batch and
    sequence); None where the profile does not name every input."""
    names = list(program.spec.inputs)
    if any(n not in profile.inputs for n in names):
        return None
    ranges = [profile.inputs[n] for n in names]
    rank = max(len(r.min) for r in ranges)
    lows = [min((r.min[j] for r in ranges if j < len(r.min)), default=1) for j in range(rank)]
    highs = [max((r.max[j] for r in ranges if j < len(r.max)), default=1) for j in range(rank)]
    return ranges, lows, highs


def _clipped(point: Any, ranges: list[Any]) -> tuple[tuple[int, ...], ...]:
    """Each input's shape at a point of dim values: the point clipped to the input's own range."""
    return tuple(tuple(min(max(point[j], r.min[j]), r.max[j]) for j in range(len(r.min))) for r in ranges)


def trace_shapes(program: Program, profiles: list[Profile]) -> list[list[tuple[int, ...]]]:
    """The input shapes whose views' walks _trace_job traces at load, smallest first: per profile, every
    combination of each dim's values (TRACE_SMALL from its min, the powers of two past them, its max; the dims
    at one position share them, as a BERT's ids and mask share batch and sequence). A rule's path changes with
    its sizes' small values and thresholds (`M == 1`, a GEMM's row blocks): BERT-base's 9 walk paths over batch
    1-8 x sequence 1-256 are all met by batch 1-8 x sequence 1-8 (bench/results/first-shape-2026-12-06.md).
    Empty where a profile does not name every input; the TRACE_SHAPES smallest where there are more (several
    dims with long ranges: ~1 ms of background CPU each)."""
    shapes: dict[tuple, None] = {}
    for profile in profiles:
        if (bounds := _dim_bounds(program, profile)) is None:
            return []
        ranges, lows, highs = bounds
        values = []
        for low, high in zip(lows, highs):
            axis = set(range(low, min(low + TRACE_SMALL, high + 1)))
            power = 1
            while power < high:
                power *= 2
                if low <= power <= high:
                    axis.add(power)
            values.append(sorted(axis | {high}))
        for point in itertools.product(*values):
            shapes[_clipped(point, ranges)] = None
    ordered = sorted(shapes, key=lambda shape: (sum(map(_product, shape)), shape))
    return [list(shape) for shape in ordered[:TRACE_SHAPES]]


MEMO_AHEAD = 256  # values of each dim whose shape-function memos the view job fills at load (the smallest)


def memo_shapes(program: Program | None, profiles: list[Profile]) -> list[list[tuple[int, ...]]]:
    """The input shapes at which _trace_job runs the program's shape function after its traces, to fill its memos
    (kiln/runtime/shape_function.py _Memo: the values that follow one dim, an encoder's position embeddings and
    mask-grid parts per sequence length, its aranges per batch) at every value of each dim the profiles allow (the
    MEMO_AHEAD smallest), the other dims at their min: a later first call at a new batch x sequence then finds both
    dims' values kept and computes only what needs both (BERT-base: the sequence's four narrowed views and the
    batch's one, ~40-60 µs of a first call right after a run, bench/results/first-shape-2026-12-06.md). The memos'
    own bounds (MEMO_ENTRIES, MEMO_BYTES) still hold; a narrowed value is a view of its group's kept base and holds
    no bytes of its own. Empty where trace_shapes is (a profile that does not name every input)."""
    if program is None or program.shape_function is None or not program.shape_function.memos:
        return []
    shapes: dict[tuple, None] = {}
    for profile in profiles:
        if (bounds := _dim_bounds(program, profile)) is None:
            return []
        ranges, lows, highs = bounds
        for j in range(len(lows)):
            for value in range(lows[j], min(highs[j], lows[j] + MEMO_AHEAD - 1) + 1):
                point = [*lows[:j], value, *lows[j + 1:]]
                shapes[_clipped(point, ranges)] = None
    return [list(shape) for shape in shapes]


def _trace_job(program: Program, profiles: list[Profile]) -> onednn_ahead.Job | None:
    """A job tracing, at load, the view's walk of a one-segment program (Segment.trace_ahead) at trace_shapes's
    shapes: the rules' and the walk's paths a first call at a new shape traced otherwise (a saved BERT-base's first
    new shape: ~4 ms of its ~5, and again at the first shape of another class, bench/results/
    first-shape-2026-12-06.md). None where the program is not one segment with views whose entry sizes its shape
    function finds. Holds the program and segment weakly; lets a calling thread have the GIL between shapes."""
    if len(program.lean_steps) != 1:
        return None
    step = program.lean_steps[0]
    if not isinstance(step.fn, Segment) or not step.fn._views or step.fn._planned_batch is not None:
        return None  # (a segment of images: another batch runs in runs of its planned one, not on a view)
    entry_slots, shapes = tuple(step.inputs), trace_shapes(program, profiles)
    if not shapes:
        return None
    program_ref, segment_ref = weakref.ref(program), weakref.ref(step.fn)
    largest = [[tuple(p.inputs[n].max) for n in program.spec.inputs] for p in profiles]

    def make() -> bool:
        made = _grow_to_largest(program_ref(), segment_ref(), entry_slots, largest)
        for inputs in shapes:
            program, segment = program_ref(), segment_ref()
            if program is None or segment is None:
                break
            key = entry_key(program, entry_slots, inputs)
            made = (key is not None and segment.trace_ahead(key)) or made
            del program, segment
            time.sleep(0)  # the GIL to a calling thread, if one waits
        for k, inputs in enumerate(memo_shapes(program_ref(), profiles)):
            program = program_ref()
            if program is None:
                break
            entry_key(program, entry_slots, inputs)  # its shape function's memos filled at each dim's value
            del program
            if k % 8 == 7:
                time.sleep(0)
        return made
    return onednn_ahead.Job(("view traces", next(_REWRITE_JOBS)), 0, make, counted=False)


def _segments_job(program: Program, profiles: list[Profile], input_dtypes: list[torch.dtype]
                  ) -> onednn_ahead.Job | None:
    """_trace_job's work for a program of several native segments, or one with layers of its own around its segment
    (kiln/runtime/views_ahead.py: each segment's entry sizes found through the layers between them, on the host)."""
    largest = [[tuple(p.inputs[n].max) for n in program.spec.inputs] for p in profiles
               if all(n in p.inputs for n in program.spec.inputs)]
    return views_ahead.segments_job(program, trace_shapes(program, profiles), largest, input_dtypes,
                                    plan_shapes(program, profiles))


PLANS_AHEAD = 128  # input shapes whose shape plans a program of several segments computes at load (the smallest)


def plan_shapes(program: Program, profiles: list[Profile]) -> list[list[tuple[int, ...]]]:
    """The input shapes whose shape plans _segments_job computes at load (views_ahead.plans_ahead_at), smallest
    first: every combination of each dim's values the profiles allow (the dims at one position shared, as for
    trace_shapes), the PLANS_AHEAD smallest. Empty where the program computes its shape values only by running
    (plans_ahead False) or a profile does not name every input."""
    if not program.plans_ahead:
        return []
    shapes: dict[tuple, None] = {}
    for profile in profiles:
        if (bounds := _dim_bounds(program, profile)) is None:
            return []
        ranges, lows, highs = bounds
        # each dim's PLANS_AHEAD smallest values hold the PLANS_AHEAD smallest combinations
        values = [range(low, min(high, low + PLANS_AHEAD - 1) + 1) for low, high in zip(lows, highs)]
        if _product(tuple(map(len, values))) > 64 * PLANS_AHEAD:  # many long dims: their smallest values only
            values = [v[:max(1, int(round(PLANS_AHEAD ** (1 / len(values)))))] for v in values]
        for point in itertools.product(*values):
            shapes[_clipped(point, ranges)] = None
    ordered = sorted(shapes, key=lambda shape: (sum(map(_product, shape)), shape))
    return [list(shape) for shape in ordered[:PLANS_AHEAD]]


def _grow_to_largest(program: Program | None, segment: Segment | None, entry_slots: tuple[int, ...],
                     largest: list[list[tuple[int, ...]]]) -> bool:
    """The segment's view template grown to the profiles' largest entry sizes (Segment.grow_ahead: each entry dim
    the largest of any profile's largest shape, as _view grows it), before the traces: a first call past the
    build's arena (BERT-base's opt 8 x 128 at 3 x 250) would grow it and its next new shapes trace again."""
    if program is None or segment is None:
        return False
    keys = [key for key in (entry_key(program, entry_slots, shapes) for shapes in largest) if key is not None]
    return bool(keys) and views_ahead.grow(segment, keys)


_REWRITE_JOBS = itertools.count()


def entry_key(program: Program, entry_slots: tuple[int, ...], shapes: list[tuple[int, ...]]) -> tuple | None:
    """The entry sizes a one-segment program's segment (its entries `entry_slots`) is called at for inputs of
    `shapes`, found by its shape function alone (as DirectRuns.bind's first call finds them), remembering nothing:
    None where its shape values need more than the inputs' sizes (a shape function that reads their data, or steps
    the loop runs), or the shape function refuses these shapes. The inputs are zero-strided arrays (their values
    are never read)."""
    function = program.shape_function
    if function is not None and (not program.plans_ahead or not function.shapes_only):
        return None
    env = list(program.template)
    for s, shape in zip(program.input_slots, shapes):
        env[s] = np.broadcast_to(np.zeros((), np.int64), shape)
    try:
        if function is not None:
            function(env)
    except Exception:  # noqa: BLE001  shapes its layers refuse: a call says why, this only traces
        return None
    key = []
    for s in entry_slots:
        shape = getattr(env[s], "shape", None)
        if shape is None:
            return None
        key.append(tuple(shape))
    return tuple(key)


def _rewrite_job(segment: Any) -> onednn_ahead.Job:
    """A job (first in the queue: order 0) making `segment`'s plan rewrite (Segment.rewrite_ahead), which the first
    call at a new shape waits for otherwise: a saved BERT-base's first new shape spent ~5-6 ms of its ~15 there. The
    job holds the segment weakly: an engine let go before its turn is not kept alive for it."""
    ref = weakref.ref(segment)

    def make() -> bool:
        seg = ref()
        return seg is not None and seg.rewrite_ahead()
    # a key of its own (ids are reused); outside the budget of primitives (a process's 100th engine still gets it)
    return onednn_ahead.Job(("plan rewrite", next(_REWRITE_JOBS)), 0, make, counted=False)


def primitives_made(timeout: float | None = None) -> bool:
    """Whether everything primitives_ahead queued is made (waiting up to `timeout` seconds)."""
    return onednn_ahead.AHEAD.wait(timeout)


def _padded(x: torch.Tensor, axes: list[tuple[int, int]], sizes: tuple[int, ...]) -> torch.Tensor:
    """x zero-padded at the end of each (axis, symbol index) to `sizes`: through numpy where the dtype has one
    (a third of torch's indexing time for a BERT's ids), else torch."""
    shape = list(x.shape)
    for axis, j in axes:
        shape[axis] = sizes[j]
    if shape == list(x.shape):
        return x
    if x.dtype in dtypes.NUMPY_REAL and not x.requires_grad:
        out = np.zeros(shape, x.numpy().dtype)
        out[tuple(slice(0, d) for d in x.shape)] = x.numpy()
        return torch.from_numpy(out)
    out = x.new_zeros(shape)
    out[tuple(slice(0, d) for d in x.shape)] = x
    return out


def _padded_array(x: np.ndarray, axes: list[tuple[int, int]], sizes: tuple[int, ...]) -> np.ndarray:
    """_padded for a numpy array."""
    shape = list(x.shape)
    for axis, j in axes:
        shape[axis] = sizes[j]
    if shape == list(x.shape):
        return x
    out = np.zeros(shape, x.dtype)
    out[tuple(slice(0, d) for d in x.shape)] = x
    return out


def _cropped_array(y: np.ndarray, axes: list[tuple[int, int]], sizes: tuple[int, ...]) -> np.ndarray:
    """_cropped for a numpy array: a C-contiguous copy where it is cut."""
    if not axes:
        return y
    index = [slice(None)] * y.ndim
    for axis, j in axes:
        index[axis] = slice(0, sizes[j])
    cut = y[tuple(index)]
    return cut if cut.shape == y.shape else np.ascontiguousarray(cut)


def _cropped(y: Any, axes: list[tuple[int, int]], sizes: tuple[int, ...]) -> Any:
    """y cut back to `sizes` along each (axis, symbol index): a contiguous copy, as a run at those sizes gives."""
    if not axes or not isinstance(y, torch.Tensor):
        return y
    for axis, j in axes:
        if y.shape[axis] != sizes[j]:
            y = y.narrow(axis, 0, sizes[j])
    return y.contiguous()


def _every_row_kept(mask: torch.Tensor | np.ndarray) -> bool:
    """Whether each row of a [batch, seq] mask (int or bool, buckets.py's rule) keeps a token; through numpy, in
    half torch's time. A mask whose first or last column is all real tokens (padding on one side: the common case)
    answers from that column by one C call (`in`: numpy's any/all go through Python wrappers, ~25 µs of a first
    call on cold caches, bert_tiny); else every row is reduced."""
    mask = mask.numpy() if isinstance(mask, torch.Tensor) else mask
    if mask.shape[1] and (0 not in mask[:, 0] or 0 not in mask[:, -1]):
        return True
    return bool(mask.any(axis=1).all())


def _group(signature: tuple, padded_axes: list[set[int]]) -> tuple:
    """The signature with its padded dims left out: the shapes that may host one another."""
    return tuple((tuple(None if axis in axes else d for axis, d in enumerate(shape)), dtype)
                 for (shape, dtype), axes in zip(signature, padded_axes))


def _median(samples: list[float]) -> float:
    """The median of a few samples (at most BIND_SAMPLES): statistics.median's answer without its module's checks
    (each new shape asks two: ~5 µs of a first call on a stream's cold caches, bert_tiny)."""
    ordered = sorted(samples)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def _product(sizes: tuple[int, ...]) -> int:
    n = 1
    for d in sizes:
        n *= d
    return max(n, 1)
