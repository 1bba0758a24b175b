"""torch.export -> stages kiln runs and stages PyTorch runs.

    split = partition(module, args, kwargs, dynamic={"x": {0: (1, 8, 64)}})
    split.stages      # in order: Stage(kind="kiln", onnx=..., profiles=...) / Stage(kind="torch", ...)

1. `torch.export` captures the module as an ATen graph (parameters lifted, pytrees flattened), with a
   symbol for every dim the user declared dynamic; the graph is decomposed as the ONNX exporter
   decomposes it, so every op left is one the exporter translates or one it never will.
2. Each op is kiln's when the exporter translates it (torch.onnx's registry) and kiln runs every ONNX
   op that translation makes; otherwise (a custom op registered with torch.library, an op kiln lacks)
   it stays in PyTorch, with the reason and the place in the model's source.
3. Ops are grouped into stages by a topological sort with one ready list per kind, draining one kind
   before switching: every stage reads only the model's inputs and earlier stages, and few stages
   alternate. Shape arithmetic (sym_size, SymInt math) is copied into every stage that needs it
   instead of crossing a boundary, so stages exchange tensors only.
4. A kiln stage becomes an ONNX model (torch.export of the stage, then torch.onnx.export, dynamo);
   when kiln cannot import it, the ops to blame move to PyTorch and the split is made again.
   `refittable`: exported without the exporter's optimizer, which folds BatchNorm into a convolution
   under the convolution's weight's name and stores transposed weights under new names (`val_N`), so
   every initializer is a module weight as is, named as the stage holds it (Stage.weights maps those
   names to the module's state_dict keys, for CompiledModule.refit).
   Its optimization profile follows the dynamic ranges through each boundary tensor's symbolic
   shape (a dim `2*s0` of a stage input ranges over 2*min .. 2*max).

Step 1 is torch_capture.py's, steps 2-3 torch_stages.py's; this module exports kiln stages to ONNX, runs the
rounds of the split (`partition`) and saves PyTorch stages. The result holds no kiln engine: the apps layer
(kiln/torch_backend.py) builds and runs it.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import onnx
import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export import Dim

from kiln.errors import KilnError
from kiln.frontend.torch_capture import Range, _quiet_exporter, capture
from kiln.frontend.torch_stages import (FallbackOp, Stage, _dynamic_axes, _Graph, _is_shape_node, _reasons,
                                        _run_examples, _stages, _symbol_ranges)
from kiln.ops.registry import lookup

MAX_SPLITS = 8  # rounds of "kiln cannot import this stage: move the ops to blame to PyTorch"


@dataclass
class Partition:
    """The model as stages over named values, with the pytree specs of its inputs and outputs."""

    inputs: list[str]  # flat user inputs, in the in_spec's order
    outputs: list[str | Any]  # flat user outputs: a value name, or a literal (None, an int) as the model returns it
    stages: list[Stage]
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    input_dynamic: dict[str, dict[int, Range]]  # flat user input -> dynamic axis -> range

    @property
    def fallbacks(self) -> list[FallbackOp]:
        return [op for s in self.stages for op in s.fallback]


# ---- kiln stages as ONNX --------------------------------------------------------------------------

def stage_to_onnx(stage: Stage, optimize: bool = True) -> onnx.ModelProto:
    """torch.export of the stage (its dynamic axes as Dim.DYNAMIC), then the dynamo ONNX exporter; without
    its optimizer (`optimize=False`) every module weight is an initializer as is, by its stage name."""
    examples = tuple(v.clone() if isinstance(v, torch.Tensor) else v for v in stage.example_inputs)
    shapes = tuple({a: Dim.DYNAMIC for a in d} or None for d in stage.input_dynamic)
    with _quiet_exporter():
        program = torch.export.export(stage.module, examples, dynamic_shapes=shapes if any(shapes) else None,
                                      strict=False)
        exported = torch.onnx.export(program, dynamo=True, verbose=False, report=False, optimize=optimize)
    return exported.model_proto


def _fx_op(node: onnx.NodeProto) -> str | None:
    """The ATen op an exported ONNX node came from (the exporter records the FX node)."""
    meta = {p.key: p.value for p in node.metadata_props}
    found = re.search(r"target=(?:torch\.ops\.)?([\w.]+)", meta.get("pkg.torch.onnx.fx_node", ""))
    return found.group(1) if found else None


def kiln_cannot_run(model: onnx.ModelProto) -> dict[str, str]:
    """ATen op -> why, for every ONNX node of the model kiln has no implementation for ("*" when a
    node cannot be traced back to its op)."""
    opsets = {o.domain or "": o.version for o in model.opset_import}
    found: dict[str, str] = {}

    def visit(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            for a in node.attribute:
                for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    visit(sub)
            domain = "" if node.domain in ("", "ai.onnx") else node.domain
            spec = lookup(node.op_type, domain)
            opset = opsets.get(domain, opsets.get("", 0))
            reason = "kiln has no implementation of this op" if spec is None else spec.check(
                opset, [a.name for a in node.attribute])
            if reason:
                found[_fx_op(node) or "*"] = f"it becomes ONNX {domain or 'ai.onnx'}::{node.op_type}: {reason}"

    visit(model.graph)
    return found


# ---- the whole split ----------------------------------------------------------------------------

def partition(module: torch.nn.Module, args: tuple, kwargs: dict | None = None, dynamic: dict | None = None,
              progress: Callable[[str], None] | None = None, refittable: bool = False) -> Partition:
    """Capture the module and split it into kiln and PyTorch stages, each kiln stage as ONNX (refittable:
    exported without the exporter's optimizer, its initializers the module's weights as they are)."""
    say = progress or (lambda _msg: None)
    kwargs = kwargs or {}
    say("capturing with torch.export")
    program, ranges = capture(module, args, kwargs, dynamic)
    graph = _Graph.of(program)
    flat, spec = pytree.tree_flatten((args, kwargs))
    if spec != program.call_spec.in_spec:
        ordered = program.call_spec.in_spec.children_specs[1].context  # kwargs in the program's order
        flat = pytree.tree_leaves((args, {k: kwargs[k] for k in ordered}))
    symbols = _symbol_ranges(graph, ranges, flat)
    input_dynamic = {n.name: _dynamic_axes(n, symbols) for n in graph.inputs}
    rejected: dict[str, str] = {}
    whole_stage: dict[str, str] = {}  # a stage the exporter failed on: its nodes go to PyTorch
    for _ in range(MAX_SPLITS):
        reasons = _reasons(program.graph, rejected)
        reasons.update({n: whole_stage[n.name] for n in program.graph.nodes if n.name in whole_stage})
        stages = _stages(graph, reasons)
        env = {n.name: v for n, v in zip(graph.inputs, flat)}
        _run_examples(stages, env)
        nodes = {n.name: n for n in program.graph.nodes}
        changed = False
        for stage in stages:
            stage.input_dynamic = [_dynamic_axes(nodes[name], symbols) for name in stage.inputs]
            if stage.kind != "kiln":
                continue
            say(f"exporting {stage.name} ({len(stage.ops)} ops) to ONNX")
            try:
                model = stage_to_onnx(stage, optimize=not refittable)
            except Exception as e:  # noqa: BLE001  the exporter failed on this piece: PyTorch runs it
                why = f"the ONNX exporter failed on its stage ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
                whole_stage.update({n.name: why for n in stage.module.graph.nodes
                                    if n.op == "call_function" and n.name in nodes})
                changed = True
                break  # split again before exporting the rest: the stages change
            missing = kiln_cannot_run(model)
            if missing:
                if "*" in missing:
                    why = missing.pop("*")
                    whole_stage.update({n.name: why for n in stage.module.graph.nodes
                                        if n.op == "call_function" and n.name in nodes})
                rejected.update(missing)
                changed = True
                break
            stage.onnx = model.SerializeToString()
        if not changed:
            break
    else:
        raise KilnError(f"the split did not settle in {MAX_SPLITS} rounds (ops moved to PyTorch: {sorted(rejected)})")
    outputs = [o.name if isinstance(o, torch.fx.Node) else o for o in graph.outputs]
    for o in graph.outputs:
        if isinstance(o, torch.fx.Node) and (_is_shape_node(o) or o.name in graph.constants):
            raise KilnError(f"the module returns {o.name!r}, a shape value or a parameter: kiln.compile returns "
                            "tensors computed from the inputs")
    return Partition(inputs=[n.name for n in graph.inputs], outputs=outputs, stages=stages,
                     in_spec=program.call_spec.in_spec, out_spec=program.call_spec.out_spec,
                     input_dynamic=input_dynamic)


def save_torch_stage(stage: Stage) -> bytes:
    """A PyTorch stage as a torch.export archive: it loads without the model's source (custom ops
    must be registered again, by importing the library that defines them)."""
    examples = tuple(v.clone() if isinstance(v, torch.Tensor) else v for v in stage.example_inputs)
    shapes = tuple({a: Dim.DYNAMIC for a in d} or None for d in stage.input_dynamic)
    with _quiet_exporter():
        program = torch.export.export(stage.module, examples, dynamic_shapes=shapes if any(shapes) else None,
                                      strict=False)
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


def load_torch_stage(data: bytes) -> Callable[..., Any]:
    return torch.export.load(io.BytesIO(data)).module()


def refit_torch_stage(data: bytes, weights: dict[str, torch.Tensor]) -> bytes:
    """A saved PyTorch stage (save_torch_stage's archive) with some of its weights, by stage name, replaced."""
    program = torch.export.load(io.BytesIO(data))
    for name, value in weights.items():
        held = program.state_dict if name in program.state_dict else program.constants
        if name not in held:
            raise KilnError(f"internal: the saved PyTorch stage holds no weight {name!r}")
        old = held[name]
        value = value.detach().to(old.device).clone()
        held[name] = torch.nn.Parameter(value, requires_grad=False) if isinstance(old, torch.nn.Parameter) else value
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()

