"""A padding-free engine's two programs: packed and plain, on one set of weights.

`remove_padding` (kiln/passes/remove_padding.py) packs an encoder's real tokens so its GEMMs skip the padding.
Packing pays only where a run saves enough rows (kiln/runtime/buckets.py PACK_MIN_SAVING); elsewhere a run took
the identity packing (T' = B·S, every position a row). That is the plain computation but not the plain engine's
program: its GEMMs are 2-D [B·S, K] instead of [B, S, K] (cuBLAS picks other kernels for them), its layers were
tuned at other row counts, and views and copies stand between them. On the H200 it was 5-19% slower than the plain
engine wherever it did not pack (bench/results/remove-padding-2026-12-02.md).

So a padding-free engine carries the plain program too:

    optimize (no remove_padding)  ->  lower: the plain program          (the plain build's graph and program)
    remove_padding on that graph  ->  lower: the packed program         (an initializer of the same name and bytes
                                                                         is the plain program's weight: stored once)
    plain program + ZeroPadding per unpacked output                     (outputs are zero at padding either way)

The plain program's attentions read the padding mask as a [B, 1, 1, S] key mask (remove_padding.key_padding_mask)
rather than the exported model's [B, 1, S, S]: with outputs zero at padding, only values at padding can differ.
On CUDA they also read its per-sequence key lengths (kiln::KeyLengths, computed on the device): where a row's real
tokens are a prefix, the flash kernel visits its first n keys and reads no mask.

Each program is tuned for the runs it gets: the plain one as a plain build tunes it (the profile's opt shape), the
packed one at a representative token bucket (`tuning_tokens`), so its GEMMs are timed on the [T', K] rows they meet.
The runtime runs the plain program wherever packed_rows(...) is B·S (kiln/runtime/context.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import onnx_ir as ir
import torch

from kiln.builder.lower import Lowering, bindings, lower, value_dtype_name
from kiln.builder.precision import lower_precision
from kiln.errors import KilnError
from kiln.ir import dtypes
from kiln.passes import PassOptions, optimize
from kiln.passes.pipeline import pack_real_tokens
from kiln.passes.remove_padding import REMOVE_PADDING, key_padding_mask
from kiln.plan.spec import Binding, ProgramSpec, StepSpec
from kiln.runtime.buckets import PACK_MIN_SAVING, saving_needed, token_bucket


@dataclass
class Lowered:
    """An optimized, lowered model: the engine's program(s), weights and bindings."""

    program: ProgramSpec
    weights: dict[str, Any]
    inputs: list[Binding]  # the engine's (a padding-free program's token bucket is none: the runtime feeds it)
    outputs: list[Binding]
    plain: ProgramSpec | None = None  # a padding-free engine's plain program
    plain_keys: set[str] = field(default_factory=set)  # the weights the plain program reads
    # the plain graph's value shapes (symbols as names), for the profile check; the packed graph's differ
    plain_value_shapes: dict[str, list | None] = field(default_factory=dict)


def user_inputs(graph: ir.Model, inputs: list[Binding]) -> list[Binding]:
    """The engine's input bindings: the lowered graph's inputs less a padding-free engine's token bucket, which
    the runtime feeds (kiln/passes/remove_padding.py)."""
    removal = graph.meta.get(REMOVE_PADDING)
    return inputs if removal is None else [b for b in inputs if b.name != removal["bucket_input"]]


def value_shapes(graph: ir.Model) -> dict[str, list | None]:
    return {v.name: None if v.shape is None else [d if isinstance(d, int) else d.value for d in v.shape]
            for node in graph.graph for v in node.outputs}


def optimize_and_lower(model: ir.Model, options: PassOptions, copy_weights: bool = True) -> tuple[ir.Model, Lowered]:
    """The optimized graph and its lowering; with options.remove_padding, both programs (the module docstring)."""
    if not options.remove_padding or options.opt_level == 0:  # level 0 runs the model as it is (no rewrite either)
        graph = optimize(model, options)
        program, weights, inputs, outputs = lower(graph, copy_weights)
        return graph, Lowered(program, weights, user_inputs(graph, inputs), outputs)
    graph = optimize(model, replace(options, remove_padding=False))
    # on CUDA with the mask's lengths as well: Triton's flash kernel stops at each row's length, reading no mask
    key_padding_mask(graph, key_lengths=options.cuda_rules)
    lowering = Lowering(graph, copy_weights)
    plain = lowering.graph(graph.graph)
    plain_inputs, plain_outputs = bindings(graph, plain)
    plain_shapes = value_shapes(graph)
    plain_keys = set(lowering.weights)
    pack_real_tokens(graph, options)
    lowering.reuse_names = True
    program = lowering.graph(graph.graph)
    inputs, outputs = bindings(graph, program)
    inputs = user_inputs(graph, inputs)
    if [b.to_json() for b in inputs] != [b.to_json() for b in plain_inputs] or \
            [b.to_json() for b in outputs] != [b.to_json() for b in plain_outputs]:
        raise KilnError(f"remove_padding changed the engine's bindings ({[b.name for b in plain_inputs]} -> "
                        f"{[b.name for b in inputs]}, {[b.name for b in plain_outputs]} -> "
                        f"{[b.name for b in outputs]}): its plain and packed programs must take and give the same")
    _zero_padding_outputs(plain, graph)
    graph.meta[REMOVE_PADDING]["plain_program"] = len(plain.steps)  # the engine holds both (kiln inspect says so)
    return graph, Lowered(program, lowering.weights, inputs, outputs, plain, plain_keys, plain_shapes)


def _zero_padding_outputs(plain: ProgramSpec, packed: ir.Model) -> None:
    """Each output the packed program scatters back (zeros at padding) ends the plain program in a ZeroPadding step
    (kiln/ops/tokens.py): one masked fill, so the engine's outputs do not depend on which program ran."""
    removal = packed.meta[REMOVE_PADDING]
    dtype_of = {name: dtype for step in plain.steps for name, dtype in zip(step.outputs, step.output_dtypes)}
    for k, value in enumerate(packed.graph.outputs):
        producer = value.producer()
        if producer is None or (producer.domain, producer.op_type) != ("kiln", "UnpackTokens") \
                or producer.attributes.get("zero_padding", ir.AttrInt64("zero_padding", 1)).value == 0:
            continue
        name = plain.outputs[k]
        zeroed = f"{name}__zero_padding"
        plain.steps.append(StepSpec("ZeroPadding", f"{name}_zero_padding", [name, removal["mask"]], [zeroed],
                                    domain="kiln", output_dtypes=[dtype_of.get(name) or value_dtype_name(value)]))
        plain.outputs[k] = zeroed


def weights_of(lowered: Lowered, plain: bool) -> dict[str, Any]:
    """The weights one program reads (the packed program: those the plain one does not read as well)."""
    return {k: v for k, v in lowered.weights.items() if (k in lowered.plain_keys) == plain}


def tuning_tokens(positions: int) -> int:
    """The packed rows a build tunes the packed program's layers at, for a mask of `positions` = B·S at the
    profile's opt shape: the largest token bucket a run there packs to (one that saves just PACK_MIN_SAVING's
    fraction for these positions; below its smallest positions, the smallest's): the most rows a packed run near
    the opt shape computes, where its GEMMs cost most."""
    need = saving_needed(positions)
    need = PACK_MIN_SAVING[-1][1] if need is None else need
    most = int(positions * (1 - need))
    rows = bucket = token_bucket(1, positions)
    while bucket <= most:  # up the token buckets (kiln/runtime/buckets.py) while one still saves enough
        rows = bucket
        if bucket >= positions:
            break
        bucket = token_bucket(bucket + 1, positions)
    return max(1, min(rows, most))


def tuning_mask(batch: int, seq: int, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """A [batch, seq] padding mask of `tokens` real tokens, as evenly spread over the rows as they go, each row's
    at its start (right padding), every row at least one."""
    counts = [tokens // batch + (1 if b < tokens % batch else 0) for b in range(batch)]
    mask = torch.zeros(batch, seq, dtype=dtype)
    for b, n in enumerate(counts):
        mask[b, :max(1, min(n, seq))] = 1
    return mask


def packed_examples(examples: list[Any], inputs: list[Binding], mask_name: str) -> tuple[list[Any], int]:
    """The packed program's inputs at the tuning point: the plain examples with the mask's real tokens cut to
    `tuning_tokens` and the token bucket of that many rows appended; and the rows."""
    k = next(i for i, b in enumerate(inputs) if b.name == mask_name)
    batch, seq = examples[k].shape
    tokens = tuning_tokens(batch * seq)
    mask = tuning_mask(batch, seq, tokens, examples[k].dtype)
    tokens = int(torch.count_nonzero(mask))
    fed = list(examples)
    fed[k] = mask
    return [*fed, torch.empty(tokens, dtype=dtypes.BY_NAME["uint8"].torch)], tokens


def lower_precision_of(lowered: Lowered, storage: str, pinned: set[str]) -> dict[str, str]:
    """Half-precision storage for the program(s): each weight as the program that reads it would have it (the
    plain program's as a plain build's; the packed program's own constants by its layers), its boundary casts."""
    if lowered.plain is None:
        return lower_precision(lowered.program, lowered.weights, storage, pinned)
    plain, packed = weights_of(lowered, plain=True), weights_of(lowered, plain=False)
    io_casts = lower_precision(lowered.plain, plain, storage, pinned)
    lower_precision(lowered.program, packed, storage, pinned)
    lowered.weights.update(plain)
    lowered.weights.update(packed)
    return io_casts
