"""The search's example run: each tunable layer's real inputs and reference output, and how a candidate's output is
judged against them (autotune.py: step 1 and the check of step 2)."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch

from kiln.builder.accuracy import TOLERANCE, float8_allowance, full_float32, half_dtype, integer_steps, mismatch, upcast
from kiln.runtime.program import Program
from kiln.tactics.tactic import Launch


@dataclasses.dataclass
class Recorded:
    args: list[Any]
    output: Any




def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def record_layers(program: Program, indices: set[int], inputs: list[Any],
            on_record: Callable[[int, Recorded], None] | None = None) -> tuple[dict[int, Recorded], list[Any]]:
    """Run the program once; keep the inputs and output of the steps in `indices`. A layer's weights are
    kept by reference, not copied: they never change, and a weight every layer shares (ALBERT's) would
    otherwise be copied once per layer. With `on_record`, each record is handed to it as soon as its
    layer has run (and kept by no one else): the search tunes a layer while the run goes on, so at most
    one layer's record is alive at a time, not every layer's activations at once."""
    records: dict[int, Recorded] = {}
    weights = {id(v) for v in program.template if isinstance(v, torch.Tensor)}
    # One copy per activation: a layer's output is the next layer's input (and Q, K and V read one
    # tensor). The copy is made when the tensor is first seen, right after the layer that made it, and
    # found again by identity while the tensor lives (a weak reference: a freed tensor's id may be reused).
    copies: dict[int, tuple[weakref.ref, Any]] = {}

    def copy(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return _clone(value)
        found = copies.get(id(value))
        if found is not None and found[0]() is value:
            return found[1]
        made = value.clone()
        copies[id(value)] = (weakref.ref(value), made)
        return made

    def recording(i: int, fn: Launch) -> Launch:
        if i not in indices:
            return fn

        def call(ctx, *args, **attrs):
            result = fn(ctx, *args, **attrs)
            if on_record is not None:  # copies of its own: nothing here outlives the handler
                on_record(i, Recorded([a if id(a) in weights else _clone(a) for a in args], _clone(result)))
                return result
            records[i] = Recorded([a if id(a) in weights else copy(a) for a in args],
                                   tuple(copy(r) for r in result) if isinstance(result, tuple) else copy(result))
            return result
        return call

    with torch.inference_mode():
        outputs = program.with_kernels(recording).run(inputs)
    copies.clear()
    return records, [_clone(o) for o in outputs]


def reference_check(fn: Launch, ctx, record: Recorded, attrs: dict) -> Callable[[Any], str | None]:
    """How a candidate's output is judged: None when it passes, else what differs.

    A half-precision layer is checked against its default implementation run in float32 on
    float32 copies of the same inputs (the fp32 reference), within the half dtype's tolerance:
    a tactic must be as close to the exact result as fp16/bf16 storage allows, not merely close
    to another fp16 kernel. Where the default cannot run in float32, against its recorded output.
    """
    half = half_dtype(record.output)
    if half is None and attrs.get("output_float32"):  # a half layer storing the engine's fp32 output (precision.py):
        half = half_dtype(record.args[0])  # judged as the half layer it is
    # an FP8 output may be off near zero by more than its steps where a tactic's values go through half precision
    # (a half input; cuda.qgemm.scaled_mm_half's cuBLASLt FP8 GEMM writing fp16 inside): accuracy.FLOAT8_HALF_SLACK;
    # a quantized attention's by a probability's near-tie: accuracy.QUANTIZED_ATTENTION_FLOAT8_SLACK
    slack, share = float8_allowance(ctx)
    if half is None:
        steps = integer_steps(ctx)  # a quantized layer's output may be one step off (kiln/ops/quantized.py)
        return lambda result: mismatch(result, record.output, integer_steps=steps, float8_slack=slack,
                                       float8_slack_share=share)
    try:
        with torch.inference_mode(), full_float32():
            # upcast again: an op whose output dtype is an attribute (a quantized layer's float output_dtype, made
            # half by precision.py) still writes half from float32 inputs, and the candidate's result is upcast
            reference = upcast(fn(ctx, *[upcast(a) for a in record.args], **attrs))
    except Exception:  # noqa: BLE001  an op with a half-only path: compare with its half output
        return lambda result: mismatch(result, record.output)
    tolerance = {**TOLERANCE, torch.float32: TOLERANCE[half]}
    steps = integer_steps(ctx)  # a LayerNormQuantize's 8-bit output beside its fp16 y
    return lambda result: mismatch(upcast(result), reference, tolerance, integer_steps=steps,
                                   float8_slack=slack, float8_slack_share=share)
