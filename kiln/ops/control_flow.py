"""Control flow: If, Loop, Scan.

Subgraphs arrive as `Program`s. The lowering appends every outer-scope value a subgraph
reads as an extra input of its node, after the node's own `ctx.num_inputs` inputs; they are
handed to the subgraph as `outer=ctx.outer(captured)`.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.ops._util import scalar
from kiln.ops.registry import register


def _split(ctx, inputs: tuple) -> tuple[tuple, dict[str, Any]]:
    """(the node's own inputs, the outer values its subgraphs read)."""
    return inputs[: ctx.num_inputs], ctx.outer(inputs[ctx.num_inputs :])


def _device(values) -> torch.device:
    for v in values:
        if isinstance(v, torch.Tensor):
            return v.device
    return torch.device("cpu")


def _empty_scan_output(ctx, index: int, device: torch.device) -> torch.Tensor:
    """A scan output of a loop that ran zero times: shape [0], the declared dtype."""
    declared = ctx.output_dtypes[index] if index < len(ctx.output_dtypes) else None
    dtype = declared.torch if declared is not None and declared.torch is not None else torch.float32
    return torch.empty((0,), dtype=dtype, device=device)


@register("If")
def if_(ctx, *inputs, then_branch, else_branch):
    (cond,), outer = _split(ctx, inputs)
    branch = then_branch if bool(scalar(cond)) else else_branch
    return tuple(branch.run([], outer=outer))


@register("Loop")
def loop(ctx, *inputs, body):
    """Loop(M, cond, v_initial...) -> (v_final..., scan_outputs...).

    body(iteration, cond, v...) -> (cond, v..., scan_element...). A missing M runs until cond
    turns false; a missing cond runs M times.
    """
    own, outer = _split(ctx, inputs)
    trip_count, cond, carried = own[0], own[1], list(own[2:])
    device = _device(own)
    max_trips = None if trip_count is None else int(scalar(trip_count))
    keep_going = True if cond is None else bool(scalar(cond))
    num_scan = ctx.num_outputs - len(carried)
    scans: list[list[Any]] = [[] for _ in range(num_scan)]
    iteration = 0
    while keep_going and (max_trips is None or iteration < max_trips):
        iter_value = torch.tensor(iteration, dtype=torch.int64, device=device)
        cond_value = torch.tensor(keep_going, dtype=torch.bool, device=device)
        outputs = body.run([iter_value, cond_value, *carried], outer=outer)
        keep_going = bool(scalar(outputs[0]))
        carried = list(outputs[1 : 1 + len(carried)])
        for k, element in enumerate(outputs[1 + len(carried) :]):
            scans[k].append(element)
        iteration += 1
    stacked = []
    for k, elements in enumerate(scans):
        if elements:
            stacked.append(torch.stack([torch.as_tensor(e) for e in elements]))
        else:
            stacked.append(_empty_scan_output(ctx, len(carried) + k, device))
    return tuple(carried + stacked)


@register("Scan", min_opset=8)
def scan(
    ctx,
    *inputs,
    body,
    num_scan_inputs,
    directions=None,
    scan_input_axes=None,
    scan_input_directions=None,
    scan_output_axes=None,
    scan_output_directions=None,
):
    """Scan: iterate body over slices of the scan inputs, carrying state.

    Opset 8 has a leading batch axis on every input/output and a sequence_lens input; 9+ has
    neither, and adds per-input/output axes.
    """
    own, outer = _split(ctx, inputs)
    if ctx.opset < 9:
        sequence_lens, own = own[0], own[1:]
        num_state = len(own) - num_scan_inputs
        batch = own[0].shape[0] if own else 0
        results = []
        for b in range(batch):
            state = [v[b] for v in own[:num_state]]
            scans_in = [v[b] for v in own[num_state:]]
            length = scans_in[0].shape[0] if scans_in else 0
            if sequence_lens is not None:
                length = int(sequence_lens.reshape(-1)[b])
                scans_in = [v[:length] for v in scans_in]
            results.append(
                _scan_core(ctx, body, outer, state, scans_in, [0] * len(scans_in),
                           directions or [0] * len(scans_in), None, None)
            )
        return tuple(torch.stack([r[i] for r in results]) for i in range(ctx.num_outputs))
    num_state = len(own) - num_scan_inputs
    return tuple(
        _scan_core(ctx, body, outer, list(own[:num_state]), list(own[num_state:]),
                   scan_input_axes, scan_input_directions, scan_output_axes,
                   scan_output_directions)
    )


def _scan_core(ctx, body, outer, state, scans_in, in_axes, in_dirs, out_axes, out_dirs):
    rank = [v.dim() for v in scans_in]
    in_axes = [a + r if a < 0 else a for a, r in zip(in_axes or [0] * len(scans_in), rank)]
    in_dirs = in_dirs or [0] * len(scans_in)
    length = scans_in[0].shape[in_axes[0]] if scans_in else 0
    num_scan_out = ctx.num_outputs - len(state)
    collected: list[list[torch.Tensor]] = [[] for _ in range(num_scan_out)]
    for t in range(length):
        slices = [
            v.select(axis, length - 1 - t if direction else t)
            for v, axis, direction in zip(scans_in, in_axes, in_dirs)
        ]
        outputs = body.run([*state, *slices], outer=outer)
        state = list(outputs[: len(state)])
        for k, element in enumerate(outputs[len(state) :]):
            collected[k].append(element)
    out_axes = out_axes or [0] * num_scan_out
    out_dirs = out_dirs or [0] * num_scan_out
    stacked = []
    for k, (elements, axis, direction) in enumerate(zip(collected, out_axes, out_dirs)):
        if not elements:  # zero iterations: the element shape is unknown, so [0]
            stacked.append(_empty_scan_output(ctx, len(state) + k, _device(scans_in)))
            continue
        if direction:
            elements = elements[::-1]
        axis = axis + elements[0].dim() + 1 if axis < 0 else axis
        stacked.append(torch.stack(elements, dim=axis))
    return state + stacked
