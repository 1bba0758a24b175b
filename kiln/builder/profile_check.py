"""Every chosen tactic is checked at the ends of every optimization profile, not only where it was timed.

The autotuner (autotune.py) times and checks each layer at the profile's opt shape. A tactic valid
there may refuse another shape (a kernel for 2-D inputs only, a tile that needs a multiple of 8) or
be wrong at it. So at each profile's min and max shape:

    - each tuned layer's `check` is asked with its inputs at that shape (from a reference run, or,
      where that run would cost too much, from the graph's symbolic shapes);
    - where the reference run is affordable (always on CUDA; on the CPU when the point's inputs are
      at most NUMERIC_LIMIT times the opt shape's elements), each tuned layer also runs on the
      reference's inputs and must match the op's reference implementation within the dtype's tolerance.
      Each layer is checked as the reference reaches it, so one layer's inputs are held at a time (a
      BERT-base at 32 x 512 held every layer's and ran out of 24 GB).

A layer that fails goes back to its default implementation, and the header says which and why.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from kiln.builder.autotune import example_inputs
from kiln.builder.layer_records import Recorded, record_layers, reference_check
from kiln.builder.profiles import shapes_at
from kiln.ir import dtypes
from kiln.plan.spec import Binding, Profile, ProgramSpec
from kiln.runtime.program import Program
from kiln.tactics import registry
from kiln.tactics.tactic import InputMeta

NUMERIC_LIMIT = 16  # on the CPU, a point is run when its inputs have at most this many times opt's elements


def _elements(shapes: dict[str, list[int]]) -> int:
    return sum(math.prod(s) for s in shapes.values())


def _symbolic_metas(step, program: ProgramSpec, weights: dict[str, Any], value_shapes: dict[str, list],
                    opt_metas: list[InputMeta], symbols: dict[str, int]) -> list[InputMeta] | None:
    """The step's input metas at a point from the graph's symbolic shapes; None when a dim is unknown."""
    metas = []
    for name, opt in zip(step.inputs, opt_metas):
        if not name or opt.shape is None:
            metas.append(opt)
            continue
        if name in program.constants:
            metas.append(opt)
            continue
        shape = value_shapes.get(name)
        if shape is None:
            return None
        dims = []
        for d in shape:
            if isinstance(d, int):
                dims.append(d)
            elif isinstance(d, str) and d in symbols:
                dims.append(symbols[d])
            else:
                return None
        metas.append(InputMeta(tuple(dims), opt.dtype, opt.constant))
    return metas


def _symbols(inputs: list[Binding], shapes: dict[str, list[int]]) -> dict[str, int]:
    symbols = {}
    for b in inputs:
        for d, n in zip(b.shape or [], shapes.get(b.name, [])):
            if isinstance(d, str):
                symbols[d] = n
    return symbols


def check_at_profile_ends(program: ProgramSpec, weights: dict[str, Any], inputs: list[Binding],
                          profiles: list[Profile], device: torch.device, io_casts: dict[str, str],
                          value_shapes: dict[str, list], tuning_shapes: dict[str, list[int]]) -> dict[str, Any]:
    """Check the tuned layers of `program` at each profile's min and max; revert the ones that fail
    (in place). Returns the header record: what was checked where, and what was reverted."""
    tuned = [i for i, s in enumerate(program.steps) if s.tactic]
    if not tuned or not profiles:
        return {}
    reference_spec = dataclasses.replace(program, steps=[dataclasses.replace(s, tactic="", tactic_config={})
                                                         for s in program.steps])
    reference = Program(reference_spec, weights, device)
    casts = {k: dtypes.BY_NAME[v].torch for k, v in io_casts.items()}
    opt_elements = _elements(tuning_shapes) or 1
    opt_metas: dict[int, list[InputMeta]] = {}
    checked: list[str] = []
    reverted: dict[str, str] = {}
    opt_examples = [v.to(device) for v in example_inputs(inputs, tuning_shapes)]
    opt_examples = [v.to(casts[b.dtype]) if b.dtype in casts else v for v, b in zip(opt_examples, inputs)]
    records, _ = record_layers(reference, set(tuned), opt_examples)
    for i in tuned:
        if i in records:
            constants = [name in program.constants for name in program.steps[i].inputs]
            opt_metas[i] = [InputMeta.of(a, c) for a, c in zip(records[i].args, constants)]
    records.clear()

    for k, profile in enumerate(profiles):
        for point in ("min", "max"):
            shapes = shapes_at(profile, point)
            if shapes == {n: s for n, s in tuning_shapes.items() if n in shapes}:
                continue  # the shape tactics were timed and checked at
            label = f"profile {k} {point} " + ", ".join(f"{n}{s}" for n, s in shapes.items())
            numeric = device.type == "cuda" or _elements(shapes) <= NUMERIC_LIMIT * opt_elements
            problems: dict[int, str] = {}
            if numeric:
                examples = [v.to(device) for v in example_inputs(inputs, {**tuning_shapes, **shapes})]
                examples = [v.to(casts[b.dtype]) if b.dtype in casts else v for v, b in zip(examples, inputs)]
                try:
                    seen = _check_as_reference_runs(program, weights, reference, tuned, examples, device, problems)
                except Exception as e:  # noqa: BLE001  the reference itself cannot run there: say so
                    checked.append(f"{label}: the reference run failed ({type(e).__name__}: {str(e)[:120]})")
                    continue
            else:
                seen = set()
            symbols = _symbols(inputs, {**tuning_shapes, **shapes})
            for i in tuned:
                step = program.steps[i]
                if not step.tactic or i not in opt_metas:
                    continue
                problem = problems.get(i)
                if problem is None and i not in seen:  # not run there: supports() on the symbolic shapes
                    tactic = registry.get(step.tactic)
                    metas = _symbolic_metas(step, program, weights, value_shapes, opt_metas[i], symbols)
                    if metas is None:
                        continue
                    ok = tactic.check(step, metas) if tactic is not None else "unknown tactic"
                    problem = None if ok is True else f"unsupported: {ok}"
                if problem:
                    reverted[step.name] = f"{step.tactic} at {label}: {problem}"
                    step.tactic, step.tactic_config = "", {}
            checked.append(f"{label}: {'numerically' if numeric else 'supports() on symbolic shapes'}")
    return {"checked_at": checked, "reverted_layers": reverted}


def _check_as_reference_runs(program: ProgramSpec, weights: dict[str, Any], reference: Program, tuned: list[int],
                             examples: list[Any], device: torch.device, problems: dict[int, str]) -> set[int]:
    """Run the reference once; as it reaches each tuned layer, ask the layer's tactic whether it takes
    these inputs and run it on them against the reference's output (problems[i]: why not). Returns the
    layers reached."""
    seen: set[int] = set()
    wanted = set(tuned)

    def checking(i: int, fn):
        if i not in wanted:
            return fn

        def call(ctx, *args, **attrs):
            result = fn(ctx, *args, **attrs)
            seen.add(i)
            problems_at = _check_layer(program, weights, i, fn, ctx, list(args), attrs, result, device)
            if problems_at:
                problems[i] = problems_at
            return result
        return call

    with torch.inference_mode():
        reference.with_kernels(checking).run(examples)
    return seen


def _check_layer(program: ProgramSpec, weights: dict[str, Any], i: int, fn, ctx, args: list[Any],
                 attrs: dict[str, Any], result: Any, device: torch.device) -> str | None:
    step = program.steps[i]
    tactic = registry.get(step.tactic)
    if tactic is None:
        return "unsupported: unknown tactic"
    constants = [weights[program.constants[n]] if n in program.constants else None for n in step.inputs]
    metas = [InputMeta.of(a, c is not None) for a, c in zip(args, constants)]
    ok = tactic.check(step, metas)
    if ok is not True:
        return f"unsupported: {ok}"
    check = reference_check(fn, ctx, Recorded(args, result), attrs)
    if tactic.checker is not None:  # judged as the autotuner judged it (Tactic.checker)
        check = tactic.checker(fn, ctx, args, attrs) or check
    try:
        launch = tactic.prepare(step, constants, device)
        with torch.inference_mode():
            return check(launch(ctx, *[tactic.to_layout(a) for a in args], **attrs))
    except Exception as e:  # noqa: BLE001
        return f"failed: {type(e).__name__}: {str(e)[:200]}"
