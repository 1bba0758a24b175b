"""The tactic interface: one way to run one kind of layer on one device.

A tactic is (op pattern, device, dtypes, layout, config) plus these callables:

    supports(step, inputs) -> True | reason     may this tactic run this layer at these shapes?
    configure(step, inputs) -> config            JSON-able parameters fixed at build (step.tactic_config),
                                                 e.g. the input size oneDNN packs a weight for
    prepare(step, constants, device) -> launch   pre-pack weights once; return the kernel
    launch(ctx, *inputs, **attributes)           the op's own signature (kiln/ops/registry.py)

`prepare` runs when an engine is loaded (and at build, to time the candidate): results that
cannot be serialized, such as oneDNN's blocked weight layouts or MKL's packed GEMM matrices,
are produced there, once, and live in the launch closure. The default tactic of every op is
its registered implementation in kiln/ops — the reference every other tactic is checked
against before it may be timed (kiln/builder/autotune.py).

A launch may carry `launch.native` (a NativeStep: it runs inside native segments) and
`launch.timed(*inputs) -> callable`: the layer bound to those inputs once, each call running it as
a segment does (no Python path per call); the autotuner times that instead of the launch.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.plan.spec import StepSpec

DEFAULT = "default"  # the name the autotuner and `inspect` give the op's registered implementation

Launch = Callable[..., Any]


def attribute(step: StepSpec, name: str, default: Any) -> Any:
    """The step's attribute, or `default` where it is absent or None (an ONNX attribute not given)."""
    value = step.attributes.get(name, default)
    return default if value is None else value


@dataclass(frozen=True)
class InputMeta:
    """What a tactic may check about one input of a layer at build time."""

    shape: tuple[int, ...] | None  # None: not a tensor (sequence, optional, missing)
    dtype: torch.dtype | None
    constant: bool  # a weight of the engine, known at build and load

    @classmethod
    def of(cls, value: Any, constant: bool) -> InputMeta:
        if isinstance(value, torch.Tensor):
            return cls(tuple(value.shape), value.dtype, constant)
        return cls(None, None, constant)


def tensor_input(inputs: list[InputMeta], i: int) -> InputMeta | None:
    """Input i when it is a tensor, else None (a missing optional input)."""
    return inputs[i] if i < len(inputs) and inputs[i].shape is not None else None


def gemm_operands_refusal(x: InputMeta, w: InputMeta | None, b: InputMeta | None) -> str | None:
    """Why a GEMM's weight [N, K] and bias [N] are not the engine's float32 constants matching `x`'s rows [..., K]
    (None: they are) — the CPU GEMM tactics' shared check."""
    if w is None or not w.constant or w.shape is None or len(w.shape) != 2 or w.dtype != torch.float32:
        return "the weight is not a constant float32 matrix of the engine"
    if w.shape[1] != x.shape[-1]:
        return f"input {list(x.shape)} does not match the weight [N, K] {list(w.shape)}"
    if b is not None and b.shape is not None and (not b.constant or list(b.shape) != [w.shape[0]]
                                                  or b.dtype != torch.float32):
        return "the bias is not a float32 constant [N] of the engine"
    return None


def conv_geometry(step: StepSpec, w_shape: tuple[int, ...]) -> tuple[list[int], list[int], list[int]] | str:
    """(pads [top, left, bottom, right], strides, dilations) of a 2-D convolution of weight [O, C/group, kH, kW],
    or why not: pads that depend on the input size, a kernel_shape other than the weight's."""
    auto_pad = attribute(step, "auto_pad", "NOTSET")
    if auto_pad not in ("NOTSET", "", "VALID"):
        return f"auto_pad={auto_pad} (pads depend on the input size)"
    pads = [0, 0, 0, 0] if auto_pad == "VALID" else [int(p) for p in attribute(step, "pads", [0, 0, 0, 0])]
    kernel = list(attribute(step, "kernel_shape", list(w_shape[2:])))
    if kernel != list(w_shape[2:]):
        return f"kernel_shape {kernel} differs from the weight's {list(w_shape[2:])}"
    strides = [int(s) for s in attribute(step, "strides", [1, 1])]
    dilations = [int(d) for d in attribute(step, "dilations", [1, 1])]
    return pads, strides, dilations


def conv_operands_refusal(step: StepSpec, x: InputMeta, w: InputMeta) -> str | None:
    """Why a 2-D convolution's attributes do not fit x [N, C, H, W] and its weight w [O, C/group, kH, kW] (None:
    they do) — the CPU convolution tactics' shared check, float (onednn.py) and 8-bit (quantized.py); the weight's
    dtype is each tactic's own."""
    geometry = conv_geometry(step, w.shape)
    if isinstance(geometry, str):
        return geometry
    groups = int(attribute(step, "group", 1))
    if x.shape[1] != w.shape[1] * groups or w.shape[0] % groups:
        return f"channels {x.shape[1]} do not match the weight {list(w.shape)} in {groups} groups"
    return None


def built_at(cache: dict, key: Any, build: Callable[[Any], Any], keep: Callable[[Any], bool], kept: int) -> Any:
    """cache[key], made by build(key) on first sight; past `kept` entries the oldest whose key is not kept (keep(key):
    the tuned size's, made at load) goes. A layer's kernels or primitives per input shape (onednn.py, quantized.py,
    native_member.py)."""
    found = cache.get(key)
    if found is None:
        if len(cache) > kept:
            cache.pop(next(k for k in cache if not keep(k)))
        found = cache[key] = build(key)
    return found


def _why_unavailable(available: Callable[[], bool]) -> str | None:
    """What the library behind an `available` check says of itself: kiln's C kernel libraries and oneDNN keep a
    `reason()` beside `available()` (a bound KernelLibrary method, or a module function)."""
    owner = getattr(available, "__self__", None) or sys.modules.get(getattr(available, "__module__", ""))
    reason = getattr(owner, "reason", None)
    try:
        return reason() if callable(reason) else None
    except Exception:  # noqa: BLE001 - a diagnostic must not fail the check it explains
        return None


@dataclass(frozen=True)
class Tactic:
    """One candidate implementation of `domain::op_type` on `device`.

    `layout` names the activation layout the tactic works in ("channels_last", or "" for
    whatever it is given): the autotuner times it on inputs in that layout, the layout its
    neighbours in a conv stack hand it, so a stack pays the conversion once at its boundary.
    `level` is the builder opt_level from which the tactic is tried (2: default builds).
    """

    name: str  # unique, stored in the engine: "cpu.conv.onednn"
    op_type: str
    domain: str
    device: str  # "cpu" | "cuda"
    dtypes: tuple[torch.dtype, ...]  # dtypes of the first input it accepts
    supports: Callable[[StepSpec, list[InputMeta]], bool | str]
    prepare: Callable[[StepSpec, list[Any], torch.device], Launch]
    configure: Callable[[StepSpec, list[InputMeta]], dict[str, Any]] = field(default=lambda step, inputs: {})
    layout: str = ""
    level: int = 2
    native: bool = False  # its launch offers a NativeStep: it can run inside a native segment (runtime/native.py)
    available: Callable[[], bool] = field(default=lambda: True)  # the library is present in this torch
    description: str = ""
    # it honours a GEMM's `output_float32` (kiln/builder/precision.py: the layer writing a half-precision engine's
    # fp32 output stores fp32 itself, so the boundary has no cast pass); the others are refused such a layer
    float32_output: bool = False
    # how the autotuner judges its output where its arithmetic is not the op's (cuda.attention.triton_fp8 rounds q,
    # k and v to E4M3): (the op's launch, ctx, the recorded inputs, the attributes) -> a function of the tactic's
    # output giving None when it passes, else what differs; or None for a layer it judges as every tactic is (the
    # QConv tactics judge only a fused residual layer their way). None: the builder's check against the op
    checker: Callable[[Launch, Any, list[Any], dict[str, Any]], Callable[[Any], str | None] | None] | None = None
    # what the autotuner divides its measured time by before comparing it (1: as measured): above 1 for the form kept
    # where its rivals time within noise of it, so that the pick does not change from build to build by that noise
    # (cpu.lstm.fused beside kiln's other LSTM loops)
    preference: float = 1.0

    def check(self, step: StepSpec, inputs: list[InputMeta]) -> bool | str:
        """True when this tactic may run `step` with these inputs, else the reason it may not."""
        if not self.available():
            why = _why_unavailable(self.available)
            return f"{self.name} is not available here" + (f": {why}" if why else " (not in this torch build)")
        if step.attributes.get("output_float32") and not self.float32_output:
            return (f"{self.name} stores its output in its inputs' dtype; this layer writes the engine's fp32 "
                    "output itself (output_float32)")
        first = inputs[0] if inputs else None
        if first is None or first.dtype not in self.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            given = "no tensor" if first is None or first.dtype is None else str(first.dtype).removeprefix("torch.")
            return f"{self.name} takes {names} inputs, given {given}"
        return self.supports(step, inputs)

    def to_layout(self, value: Any) -> Any:
        """An input as this tactic prefers it (timing only; launch accepts any layout)."""
        if self.layout == "channels_last" and isinstance(value, torch.Tensor) and value.dim() == 4:
            return value.contiguous(memory_format=torch.channels_last)
        return value


@dataclass
class NativeStep:
    """What a tactic offers a segment for one layer: its primitive(s) at the tuned input size.

    A tactic sets it as `launch.native`; the runtime binds it inside a native segment
    (kiln/runtime/native.py). `primitive(accumulate)` returns an object with
    `bind(src, dst, residual) -> Bound` (kiln/kernels/cpu/onednn.py); accumulate=True asks for the
    variant that adds the residual into dst's memory (only offered when `accumulate` is True: the
    residual dies at this step).
    An `alias` step (a Reshape that moves no byte) has no primitive: its output is its input's
    memory under another shape.

    A layer of kiln's own C kernels (kiln/kernels/cpu/transformer.py) may read several step inputs
    in any dtype, row-major: `reads` = {step input index: (size, dtype)}; then `primitive(False)` has
    `bind_reads(dst, {index: address})`, `at` takes {index: size} (every read's size), and its
    output (of `output_dtype`) is row-major whatever its rank (4-D NHWC with `channels_last`).
    """

    input_size: tuple[int, ...]  # of the activation input (step input 0); 4-D: NHWC in memory
    output_size: tuple[int, ...]
    primitive: Callable[[bool], Any] | None
    residual_input: int | None = None  # the step input that is the residual, same size as the output
    accumulate: bool = False
    alias: bool = False
    # the same layer's NativeStep for another activation input size (its primitives built on first
    # use): lets the runtime bind a segment for every input size a profile allows, not only the tuned one
    at: Callable[[tuple[int, ...]], NativeStep] | None = None
    reads: dict[int, tuple[tuple[int, ...], torch.dtype]] | None = None
    output_dtype: torch.dtype = torch.float32
    # oneDNN's layers' form (reads None) only: the dtype its src and residual are read in (a quantized layer's
    # 8-bit src); a segment's entry of another dtype runs the segment layer by layer (Segment.__call__)
    input_dtype: torch.dtype = torch.float32
    residual_dtype: torch.dtype = torch.float32
    # kiln's own kernels only: the step's outputs past the first, (size, dtype) each, row-major; bound as
    # roles "dst1", "dst2"... (a pre-LN LayerNorm's sum x + residual)
    more_outputs: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()
    # kiln's own kernels only: its 4-D reads and output are NHWC in memory, as oneDNN's layers lay them out
    # (a channel Concat between convolutions), not row-major
    channels_last: bool = False
    # oneDNN's layers' form (reads None) only: its 4-D src is read row-major, as kiln's own kernels write 4-D values
    # (a relayout after a recurrent layer's Y [S, D, N, H]), not NHWC
    rows_input: bool = False
    # the same layer reading its 4-D src row-major (a NativeStep with rows_input), where that differs from this one:
    # a segment takes it for a member whose src another member wrote row-major (kiln/runtime/native_runs.py segments)
    reading_rows: Callable[[], NativeStep] | None = None
    # the same layer as an alias of its src's memory (an `alias` NativeStep), where that moves no byte: a relayout whose
    # output, as a segment lays it out, is its input's memory as laid out (ConvNeXt's NCHW <-> [N, H·W, C] permutes
    # of NHWC memory); a segment takes it where the src is a value of the run that dies at this layer
    # (kiln/runtime/native_runs.py segments), else runs the copy
    aliasing: Callable[[], NativeStep] | None = None
    # kiln's own kernels only: the layer's plan at other input sizes (the argument `at` takes) as the fields that
    # follow the sizes, without a kernel object: a native segment's view writes them into a copy of its
    # template's plan (kiln/runtime/native_views.py _PlanRewrite)
    plan_at: PlanRule | None = None
    # oneDNN's inner products only: the layer's primitive at other input sizes (the argument `at` takes) with no
    # NativeStep or primitive object of its own: a segment's view writes its arguments into a copy of its template
    # call's (kiln/runtime/native.py _PlanRewrite); the rule gives None where `at` would put those sizes on another
    # kernel or weight layout (then `at` binds them)
    primitive_at: PrimitiveRule | None = None
    # bytes of temporaries the primitive's binding takes from its segment's arena where it binds over one (a
    # Winograd layer's V and M: `bind(..., arena=)`, SharedArena.scratch): the segment asks for its members' largest
    # before binding them, so they share one buffer whatever their order
    scratch_bytes: int = 0

    @property
    def output_strides(self) -> tuple[int, ...]:
        return _output_strides(tuple(self.output_size), self.reads is None or self.channels_last)


@dataclass(slots=True)
class SizedPlan:
    """A layer's plan at other input sizes, as NativeStep.plan_at gives it: the sizes of its outputs (the
    first, then each of `more_outputs`), and the plan fields those sizes change (ints, or tuples of ints for
    an array field), by the names of its ctypes plan's fields; every other field is the template's."""

    output_sizes: tuple[tuple[int, ...], ...]
    fields: dict[str, int | tuple[int, ...]]

    def flat_values(self) -> list:
        """The fields' values in their order, an array field's elements in place: what a view writes."""
        flat: list = []
        for value in self.fields.values():
            if type(value) is tuple:
                flat.extend(value)
            else:
                flat.append(value)
        return flat


@dataclass(slots=True)
class SizedPrimitive:
    """A oneDNN layer at other input sizes, as NativeStep.primitive_at gives it: its output's size and its
    primitive's arguments there (a RoleArguments, kiln/kernels/cpu/onednn.py)."""

    output_size: tuple[int, ...]
    arguments: Any


class PlanRule:
    """NativeStep.plan_at: `rule(sizes) -> SizedPlan` (ValueError where `at` would refuse the sizes); or
    NativeStep.primitive_at: `rule(size) -> SizedPrimitive | None`. Rules of equal `key` give equal answers at equal
    sizes (the layers of one shape: BERT-base's 25 LayerNorms are 1 key, its 36 kiln GEMMs 3, its 24 oneDNN inner
    products 2), so a view at new sizes works each out once. `traceable`: the rule is arithmetic and comparisons on
    its sizes with no side effect (no cache it fills, no kernel it makes): a view may then answer it from closed forms
    traced from it (kiln/tactics/traced_rules.py), which run it with symbols for sizes."""

    __slots__ = ("_rule", "key", "traceable")

    def __init__(self, rule: Callable[[Any], SizedPlan], key: tuple, traceable: bool = False):
        self._rule, self.key, self.traceable = rule, key, traceable

    def __call__(self, sizes: Any) -> SizedPlan:
        return self._rule(sizes)


class PrimitiveRule(PlanRule):
    """NativeStep.primitive_at: a PlanRule whose answers (SizedPrimitive), shared by the layers of its key, leave out
    each layer's own execution arguments: `fixed`, (execution argument, memory object) each (its weight and bias)."""

    __slots__ = ("fixed",)

    def __init__(self, rule: Callable[[Any], SizedPrimitive | None], key: tuple, fixed: tuple[tuple[int, int], ...]):
        super().__init__(rule, key)
        self.fixed = fixed


class same_primitive:
    """A NativeStep's `primitive` for a layer without an accumulating variant: `primitive` whatever
    `accumulate`. One slotted object where a closure (`lambda _accumulate: x`) was three the garbage
    collector tracks (function, cell, closure tuple); a segment binding a new input size keeps one per
    member, and the full passes' frequency follows what new shapes keep (bench/results/first-calls-2026-12-03b.md)."""

    __slots__ = ("_primitive",)

    def __init__(self, primitive: Any):
        self._primitive = primitive

    def __call__(self, _accumulate: bool) -> Any:
        return self._primitive


class resizable:
    """Decorates a tactic's `native_at(size) -> NativeStep`: the step it returns gets `at` = this object,
    so the function need not name itself. A closure that passes itself as `at` is a reference cycle
    (its cell holds it): the layer's prepared kernels, packed weights included, then lived until the
    garbage collector ran — an ALBERT-base build's tactic search peaked ~80 MiB higher for it."""

    __slots__ = ("_native_at",)

    def __init__(self, native_at: Callable[[Any], NativeStep]):
        self._native_at = native_at

    def __call__(self, size: Any) -> NativeStep:
        step = self._native_at(size)
        step.at = self
        return step


@functools.lru_cache(maxsize=1024)
def _output_strides(size: tuple[int, ...], nhwc: bool) -> tuple[int, ...]:
    """A NativeStep's output strides, by size: a segment binding a new input size asks for every member's, and
    its members' outputs share a few sizes (a transformer's: [batch, sequence, hidden] and a handful more)."""
    return native_strides(size) if nhwc else row_major_strides(size)


def native_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    """Channels-last for 4-D (NHWC in memory, NCHW in shape), row-major otherwise."""
    if len(size) == 4:
        n, c, h, w = size
        return (c * h * w, 1, w * c, c)
    return row_major_strides(size)


def row_major_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(size):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))
