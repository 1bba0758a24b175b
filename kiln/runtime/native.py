"""Native segments: runs of consecutive CPU layers executed as bound oneDNN primitives.

Inside a network, a layer's Python path costs far more than it does in a hot loop: each
convolution streams megabytes through the caches and evicts the interpreter's and torch's
dispatch code and data, so the next step's few microseconds of Python become tens
(measured on MobileNetV2, 2 threads: 6.0 ms a run, of which 4.0 ms inside oneDNN). onnxruntime's
C++ executor pays little of this. A segment removes it: each layer's primitive is bound once, at
load, to the buffer the segment's memory plan gives its output (buffers reused by liveness, the
one freed most recently first: still in cache), so a run is one `execute` call per layer.

A tactic offers a step to a segment by setting `launch.native` (NativeStep). Program groups
every run of two or more such steps whose shapes chain (kiln/runtime/program.py) into one
step: its inputs are the values the run reads from outside, its outputs the values read after
it. Those are bound per call (an entry's address; an exit gets a fresh tensor), so nothing a
caller holds is ever overwritten by a later run. A residual whose value dies at a convolution
and lives in a segment buffer is accumulated in place (the primitive's sum post-op).

Inputs of another size than the one the segment was planned for (dynamic shapes) run through the
layers' own launch functions, as they would without segments.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

_CL = torch.channels_last


@dataclass
class NativeStep:
    """What a tactic offers a segment for one layer: its primitive(s) at the tuned input size.

    `primitive(accumulate)` returns an object with `bind(src, dst, residual) -> Bound`
    (kiln/kernels/cpu/onednn.py); accumulate=True asks for the variant that adds the residual
    into dst's memory (only offered when `accumulate` is True: the residual dies at this step).
    """

    input_size: tuple[int, ...]  # [N, C, H, W] of the activation input (step input 0), NHWC in memory
    output_size: tuple[int, ...]
    primitive: Callable[[bool], Any]
    residual_input: int | None = None  # the step input that is the residual, same size as the output
    accumulate: bool = False

    @property
    def output_strides(self) -> tuple[int, ...]:
        n, c, h, w = self.output_size
        return (c * h * w, 1, w * c, c)  # channels-last


Step = tuple  # (fn, ctx, in_slots, out_slots, attrs, free): kiln/runtime/program.py


def _numel(size: tuple[int, ...]) -> int:
    n = 1
    for d in size:
        n *= d
    return n


class Segment:
    """Layers [first, last] of a program run as bound primitives; called as one step."""

    def __init__(self, members: list[Step], read_after: set[int]):
        self.members = members
        natives: list[NativeStep] = [m[0].native for m in members]
        produced: dict[int, int] = {}  # slot -> member that writes it
        for k, m in enumerate(members):
            produced[m[3][0]] = k
        consumers: dict[int, list[tuple[int, str]]] = {}  # slot -> [(member, role)]
        for k, (m, native) in enumerate(zip(members, natives)):
            consumers.setdefault(m[2][0], []).append((k, "src"))
            if native.residual_input is not None:
                consumers.setdefault(m[2][native.residual_input], []).append((k, "residual"))

        self.entries = [s for s in consumers if s not in produced]  # read here, written before the segment
        self.exits = [s for s in produced if s in read_after]  # written here, read after it
        exits = set(self.exits)
        last_read = {s: max(k for k, _ in uses) for s, uses in consumers.items()}

        # The memory plan: internal values (written and last read here) share a few buffers, each
        # as large as the largest of them, the most recently freed handed out first.
        internal = [s for s in produced if s not in exits]
        largest = max((_numel(natives[produced[s]].output_size) for s in internal), default=0)
        self.buffers: list[torch.Tensor] = []
        free: list[torch.Tensor] = []
        holding: dict[int, torch.Tensor] = {}  # slot -> its buffer while the value is live
        address: dict[int, int] = {}  # slot -> where it is written (entries and exits: per call)
        accumulate: list[bool] = []
        for k, (m, native) in enumerate(zip(members, natives)):
            x, out = m[2][0], m[3][0]
            residual = m[2][native.residual_input] if native.residual_input is not None else None
            over = (native.accumulate and residual in holding and last_read[residual] == k and residual != x
                    and out not in exits)
            accumulate.append(over)
            if over:
                holding[out] = holding.pop(residual)  # the result takes the residual's buffer
            elif out not in exits:
                if not free:
                    free.append(torch.empty(largest, dtype=torch.float32))
                    self.buffers.append(free[-1])
                holding[out] = free.pop()
            if out in holding:
                address[out] = holding[out].data_ptr()
            for v in (x, residual):
                if v in holding and last_read[v] == k and v != out:
                    free.append(holding.pop(v))

        # Bind every layer to its buffers; entries and exits are pointed at per call.
        self.bound = []
        self.per_call: dict[int, list[tuple[Any, str]]] = {}  # slot -> [(Bound, role)] to point at it
        for k, (m, native) in enumerate(zip(members, natives)):
            x, out = m[2][0], m[3][0]
            residual = m[2][native.residual_input] if native.residual_input is not None else None
            prim = native.primitive(accumulate[k])
            if accumulate[k]:
                b = prim.bind(address.get(x, 0), address[out])
                roles = [(x, "src")]
            else:
                b = prim.bind(address.get(x, 0), address.get(out, 0),
                              address.get(residual, 0) if residual is not None else None)
                roles = [(x, "src"), (out, "dst")] + ([(residual, "residual")] if residual is not None else [])
            for s, role in roles:
                if s in self.entries or s in exits:
                    self.per_call.setdefault(s, []).append((b, role))
            self.bound.append(b)
        self.exit_shapes = [(natives[produced[s]].output_size, natives[produced[s]].output_strides)
                            for s in self.exits]
        self.entry_sizes = []
        for s in self.entries:
            k, role = consumers[s][0]
            native = natives[k]
            self.entry_sizes.append(native.input_size if role == "src" else native.output_size)
        from kiln.kernels.cpu import onednn

        lib = onednn.load()
        self._execute, self._stream = lib.lib.dnnl_primitive_execute, lib.stream
        self._check = onednn._check
        self._calls = [(b.primitive, b.nargs, b.args) for b in self.bound]
        self._lock = threading.Lock()
        self.accumulated = sum(accumulate)

    @property
    def planned_bytes(self) -> int:
        return sum(b.numel() * 4 for b in self.buffers)

    def fallback(self, values: list[Any]) -> list[Any]:
        """The layers' own launch functions, for inputs of other sizes than planned."""
        from kiln.runtime.program import call_step

        env = dict(zip(self.entries, values))
        for fn, ctx, in_slots, out_slots, attrs, _free in self.members:
            env[out_slots[0]] = call_step(fn, ctx, [env.get(s) if s >= 0 else None for s in in_slots], attrs)
        return [env[s] for s in self.exits]

    def __call__(self, ctx, *values):
        fits = all(isinstance(v, torch.Tensor) and v.dtype == torch.float32 and tuple(v.shape) == size
                   for v, size in zip(values, self.entry_sizes))
        if not fits:
            out = self.fallback(list(values))
            return tuple(out) if len(out) != 1 else out[0]
        entries = [v.contiguous(memory_format=_CL) for v in values]  # free when already channels-last
        exits = [torch.empty_strided(size, strides, dtype=torch.float32) for size, strides in self.exit_shapes]
        execute, stream = self._execute, self._stream
        with self._lock:
            for s, v in zip(self.entries, entries):
                for b, role in self.per_call[s]:
                    b.rebind(role, v.data_ptr())
            for s, v in zip(self.exits, exits):
                for b, role in self.per_call[s]:
                    b.rebind(role, v.data_ptr())
            for prim, nargs, args in self._calls:
                status = execute(prim, stream, nargs, args)
                if status:
                    self._check(status, "a layer of a native segment")
        return tuple(exits) if len(exits) != 1 else exits[0]


def _chains(prev: Step, step: Step) -> bool:
    """step's activation input is prev's output, of the size step was built for (or step reads
    an entry: then its size is checked per call)."""
    native, before = step[0].native, prev[0].native
    if step[2][0] == prev[3][0] and tuple(before.output_size) != tuple(native.input_size):
        return False
    return True


def segments(steps: list[Step], output_slots: list[int]) -> tuple[list[Step], list[Segment]]:
    """steps with each run of >= 2 native steps replaced by one Segment step."""
    last_read: dict[int, int] = {}
    for i, (_fn, _ctx, in_slots, _outs, _attrs, _free) in enumerate(steps):
        for s in in_slots:
            if s >= 0:
                last_read[s] = i
    runs: list[list[int]] = []
    for i, step in enumerate(steps):
        native = getattr(step[0], "native", None)
        ok = isinstance(native, NativeStep) and len(step[3]) == 1 and step[3][0] >= 0
        if ok and runs and runs[-1][-1] == i - 1 and _chains(steps[i - 1], step):
            runs[-1].append(i)
        elif ok:
            runs.append([i])
    start = {r[0]: r for r in runs if len(r) >= 2}
    if not start:
        return steps, []  # the same list: callers that patch a step in place (autotune's recording) see it run
    result: list[Step] = []
    made: list[Segment] = []
    i = 0
    outputs = set(output_slots)
    while i < len(steps):
        run = start.get(i)
        if run is None:
            result.append(steps[i])
            i += 1
            continue
        members = [steps[k] for k in run]
        end = run[-1]
        read_after = {s for s, last in last_read.items() if last > end} | outputs
        try:
            segment = Segment(members, read_after)
        except Exception:  # noqa: BLE001  a run that cannot be planned runs layer by layer, as before
            result.extend(members)
            i = end + 1
            continue
        first_ctx = members[0][1]
        ctx = replace(first_ctx, name=f"{first_ctx.name} .. {members[-1][1].name} (native segment of {len(run)})",
                      num_inputs=len(segment.entries), num_outputs=len(segment.exits))
        free = sorted({s for m in members for s in m[5]})
        result.append((segment, ctx, list(segment.entries), list(segment.exits), {}, free))
        made.append(segment)
        i = end + 1
    return (result, made) if made else (steps, [])
