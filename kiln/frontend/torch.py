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

The result holds no kiln engine: the apps layer (kiln/torch_backend.py) builds and runs it.
torch.onnx's registry and decomposition table are private to torch (torch.onnx._internal.exporter,
stable from torch 2.6 to 2.13); they are read in `_onnx_registry` and `_decompose` only.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import logging
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import onnx
import sympy
import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export import Dim
from torch.onnx._internal.exporter import (  # private to torch: see the docstring
    _decomp,
    _registration,
)

from kiln.errors import KilnError
from kiln.ops.registry import lookup

Range = tuple[int, int, int]  # min, opt, max
MAX_SPLITS = 8  # rounds of "kiln cannot import this stage: move the ops to blame to PyTorch"
SHAPE_VALUES = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)
ASSERTIONS = {
    torch.ops.aten.sym_constrain_range_for_size.default, torch.ops.aten._assert_async.default,
    torch.ops.aten._assert_async.msg, torch.ops.aten._assert_scalar.default,
    torch.ops.aten._assert_tensor_metadata.default,
}


@dataclass
class FallbackOp:
    """One op PyTorch runs instead of kiln, and why."""

    node: str  # the node's name in the exported graph
    op: str  # "kilntest.myrelu.default"
    reason: str
    where: str  # module path and source line

    def describe(self) -> str:
        return f"{self.op} (node {self.node}, {self.where}): {self.reason}"


@dataclass
class Stage:
    """A piece of the graph run by one runtime: kiln (an ONNX model to build) or torch (a GraphModule)."""

    kind: str  # "kiln" | "torch"
    name: str
    inputs: list[str]  # value names read (the model's inputs, earlier stages' outputs)
    outputs: list[str]  # value names later stages or the model's outputs read
    ops: list[str]  # the ATen ops inside, one entry per node
    module: torch.fx.GraphModule  # flat tensors in -> tuple of tensors out
    example_inputs: list[Any] = field(default_factory=list)
    input_dynamic: list[dict[int, Range]] = field(default_factory=list)  # per input: dynamic axis -> range
    onnx: bytes | None = None  # kiln stages
    fallback: list[FallbackOp] = field(default_factory=list)  # torch stages
    # the module's weights the stage holds: its own name (the GraphModule's attribute, the ONNX initializer
    # of a refittable export) -> the module's state_dict key
    weights: dict[str, str] = field(default_factory=dict)

    def profiles(self) -> list[dict[str, list[list[int]]]]:
        """kiln.build's profiles for this stage: [] when every input is static."""
        spec: dict[str, list[list[int]]] = {}
        for name, value, dynamic in zip(self.inputs, self.example_inputs, self.input_dynamic):
            if not dynamic or not isinstance(value, torch.Tensor):
                continue
            shape = list(value.shape)
            spec[name] = [[dynamic[a][k] if a in dynamic else d for a, d in enumerate(shape)] for k in range(3)]
        return [spec] if spec else []


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


# ---- capture ------------------------------------------------------------------------------------

def _is_range(spec: Any) -> bool:
    return isinstance(spec, dict) and bool(spec) and all(isinstance(k, int) for k in spec)


def _range(value: Any, where: str, example: int) -> Range:
    parts = [int(v) for v in value]
    if len(parts) == 2:
        parts = [parts[0], min(max(example, parts[0]), parts[1]), parts[1]]
    if len(parts) != 3 or not parts[0] <= parts[1] <= parts[2]:
        raise KilnError(f"dynamic {where}: give (min, max) or (min, opt, max) with min <= opt <= max, given {value!r}")
    return parts[0], parts[1], parts[2]


def _export_dynamic(dynamic: dict, signature: inspect.BoundArguments) -> tuple[dict, dict[int, dict[int, Range]]]:
    """kiln's `dynamic` ({arg: {axis: (min, opt, max)}}, nested like the argument) -> torch.export's
    dynamic_shapes (Dim.DYNAMIC per axis) and, per example tensor (by id), its axes' ranges."""
    unknown = sorted(set(dynamic) - set(signature.arguments))
    if unknown:
        raise KilnError(f"dynamic names {unknown}, but forward() takes {list(signature.arguments)}")
    ranges: dict[int, dict[int, Range]] = {}

    def walk(spec: Any, value: Any, where: str) -> Any:
        if spec is None:
            return None
        if isinstance(value, torch.Tensor):
            if not _is_range(spec):
                raise KilnError(f"dynamic {where}: a tensor's entry maps axes to ranges, e.g. {{0: (1, 8, 64)}}")
            checked = {}
            for axis, r in spec.items():
                if not -value.dim() <= axis < value.dim():
                    raise KilnError(f"dynamic {where}: axis {axis} of a {value.dim()}-d tensor")
                axis %= value.dim()
                checked[axis] = _range(r, f"{where} axis {axis}", value.shape[axis])
                if value.shape[axis] < 2:
                    raise KilnError(f"dynamic {where} axis {axis}: the example's size there is {value.shape[axis]}; "
                                    "torch.export fixes dims of size 0 and 1, give an example of size 2 or more")
            ranges[id(value)] = checked
            return {axis: Dim.DYNAMIC for axis in checked}
        if isinstance(value, dict):
            return {k: walk(spec.get(k) if isinstance(spec, dict) else None, v, f"{where}[{k!r}]")
                    for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            specs = list(spec) if isinstance(spec, (list, tuple)) else [None] * len(value)
            return type(value)(walk(s, v, f"{where}[{i}]") for i, (s, v) in enumerate(zip(specs, value)))
        return None

    shapes = {name: walk(dynamic.get(name), value, name) for name, value in signature.arguments.items()}
    return shapes, ranges


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """torch's export and ONNX exporter talk about themselves ("torchvision is not installed. Skipping
    torchvision::nms", pytree deprecations): nothing there is the user's to act on."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


@functools.lru_cache(maxsize=1)
def _onnx_registry():
    with _quiet_exporter():
        return _registration.ONNXRegistry.from_torchlib()


def _decompose(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Decompose as torch.onnx.export does: ops the exporter translates stay whole."""
    registered = set(_decomp.get_onnx_implemented_overloads(_onnx_registry()))
    return program.run_decompositions(_decomp.create_onnx_friendly_decomposition_table(registered))


def capture(module: torch.nn.Module, args: tuple, kwargs: dict, dynamic: dict | None
            ) -> tuple[torch.export.ExportedProgram, dict[int, dict[int, Range]]]:
    """torch.export of the module, decomposed for ONNX; and the dynamic ranges per example tensor id."""
    forward = module.forward if isinstance(module, torch.nn.Module) else module
    try:
        signature = inspect.signature(forward).bind(*args, **kwargs)
    except TypeError as e:
        raise KilnError(f"the example inputs do not fit forward(): {e}") from None
    shapes, ranges = _export_dynamic(dynamic or {}, signature)
    try:
        with _quiet_exporter():
            program = torch.export.export(module, args, kwargs, dynamic_shapes=shapes if dynamic else None,
                                          strict=False)
    except Exception as e:
        raise KilnError(f"torch.export could not capture the module ({type(e).__name__}): {str(e)[:2000]}") from e
    with _quiet_exporter():
        return _decompose(program), ranges


# ---- classification -----------------------------------------------------------------------------

def _is_shape_node(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.meta.get("val"), SHAPE_VALUES)


def _where(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    module = ""
    if stack:
        path, kind = list(stack.values())[-1]
        module = f"in {path or 'the model'} ({str(kind).rsplit('.', 1)[-1].rstrip(chr(39) + '>')})"
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', node.meta.get("stack_trace") or "")
    line = ""
    if frames:
        # the last frame outside torch's own sources is the model's line
        mine = [f for f in frames if "/torch/" not in f[0]] or frames
        path, number, function = mine[-1]
        line = f"{path.rsplit('/', 1)[-1]}:{number} in {function}"
    return ", ".join(p for p in (module, line) if p) or "unknown place"


def _op_name(node: torch.fx.Node) -> str:
    return str(node.target) if not callable(node.target) or hasattr(node.target, "_schema") else \
        getattr(node.target, "__name__", str(node.target))


def _reasons(graph: torch.fx.Graph, rejected: dict[str, str]) -> dict[torch.fx.Node, str]:
    """The call nodes PyTorch must run, with the reason; every other call node is kiln's."""
    registry = _onnx_registry()
    reasons = {}
    for node in graph.nodes:
        if node.op != "call_function" or _is_shape_node(node) or node.target in ASSERTIONS:
            continue
        name = _op_name(node)
        if name == "getitem":
            continue
        if name in rejected:
            reasons[node] = rejected[name]
        elif not registry.is_registered(node.target):
            reasons[node] = "the ONNX exporter has no translation for this op"
    return reasons


# ---- scheduling ---------------------------------------------------------------------------------

def _units(graph: torch.fx.Graph) -> tuple[list[torch.fx.Node], dict[torch.fx.Node, torch.fx.Node]]:
    """The scheduled nodes (ops, not shape math or getitem), and each getitem's op."""
    units: list[torch.fx.Node] = []
    owner: dict[torch.fx.Node, torch.fx.Node] = {}
    seen: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function" or _is_shape_node(node) or node.target in ASSERTIONS:
            continue
        source = node.args[0] if _op_name(node) == "getitem" else None
        if isinstance(source, torch.fx.Node) and (source in owner or source in seen):
            owner[node] = owner.get(source, source)
        else:
            units.append(node)
            seen.add(node)
    return units, owner


def _unit_inputs(node: torch.fx.Node, owner: dict, units: set) -> set[torch.fx.Node]:
    """The units `node` reads, looking through shape math and getitems."""
    found: set[torch.fx.Node] = set()
    stack = list(node.all_input_nodes)
    seen: set[torch.fx.Node] = set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in owner:
            found.add(owner[n])
        elif n in units:
            found.add(n)
        elif n.op == "call_function":  # shape math: what it reads
            stack.extend(n.all_input_nodes)
    return found


def _schedule(graph: torch.fx.Graph, torch_nodes: set[torch.fx.Node]) -> list[tuple[str, list[torch.fx.Node]]]:
    """Units grouped into stages of one kind, in an order every stage's inputs come before it."""
    units, owner = _units(graph)
    unit_set = set(units)
    deps = {u: _unit_inputs(u, owner, unit_set) - {u} for u in units}
    users: dict[torch.fx.Node, list[torch.fx.Node]] = {u: [] for u in units}
    for u, ds in deps.items():
        for d in ds:
            users[d].append(u)
    waiting = {u: len(ds) for u, ds in deps.items()}
    position = {n: i for i, n in enumerate(graph.nodes)}
    ready: dict[str, list[torch.fx.Node]] = {"kiln": [], "torch": []}
    for u in units:
        if not waiting[u]:
            ready["torch" if u in torch_nodes else "kiln"].append(u)
    stages: list[tuple[str, list[torch.fx.Node]]] = []
    kind = "kiln"
    while ready["kiln"] or ready["torch"]:
        if not ready[kind]:
            kind = "torch" if kind == "kiln" else "kiln"
        taken = []
        while ready[kind]:
            u = ready[kind].pop(0)
            taken.append(u)
            for v in users[u]:
                waiting[v] -= 1
                if not waiting[v]:
                    ready["torch" if v in torch_nodes else "kiln"].append(v)
        chosen = set(taken)
        members = taken + [g for g, o in owner.items() if o in chosen]
        stages.append((kind, sorted(members, key=position.__getitem__)))
        kind = "torch" if kind == "kiln" else "kiln"
    return stages


# ---- stages -------------------------------------------------------------------------------------

@dataclass
class _Graph:
    """The exported program read once: its graph, constants and user inputs/outputs."""

    program: torch.export.ExportedProgram
    constants: dict[str, torch.Tensor]  # placeholder name -> parameter, buffer or lifted constant
    inputs: list[torch.fx.Node]  # user input placeholders, flat
    outputs: list[Any]  # user outputs: nodes or literals
    state_keys: dict[str, str] = field(default_factory=dict)  # placeholder name -> the module's parameter/buffer key

    @classmethod
    def of(cls, program: torch.export.ExportedProgram) -> _Graph:
        sig = program.graph_signature
        state = {**program.state_dict, **program.constants}
        targets = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
        placeholders = [n for n in program.graph.nodes if n.op == "placeholder"]
        constants = {n.name: state[targets[n.name]] for n in placeholders if n.name in targets}
        user = {spec.arg.name for spec in sig.input_specs if spec.kind.name == "USER_INPUT"}  # constants too
        output_node = next(n for n in program.graph.nodes if n.op == "output")
        kinds = [spec.kind.name for spec in sig.output_specs]
        outputs = [v for v, k in zip(output_node.args[0], kinds) if k == "USER_OUTPUT"]
        state_keys = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
        return cls(program, constants, [n for n in placeholders if n.name in user], outputs, state_keys)


def _reads(members: list[torch.fx.Node], graph: _Graph) -> list[torch.fx.Node]:
    """The outside values a stage reads (tensors of the model's inputs or of earlier stages), in
    first-use order; shape math is looked through (each stage computes its own)."""
    inside = set(members)
    found: list[torch.fx.Node] = []
    seen: set[torch.fx.Node] = set()

    def visit(n: torch.fx.Node) -> None:
        if n in seen or n in inside:
            return
        seen.add(n)
        if n.op == "placeholder" and n.name in graph.constants:
            return
        if _is_shape_node(n):
            for m in n.all_input_nodes:
                visit(m)
            return
        found.append(n)

    for node in members:
        for n in node.all_input_nodes:
            visit(n)
    return found


def stage_weight_name(placeholder: str) -> str:
    """The name a stage gives a module weight (its placeholder in the exported program, e.g. p_fc_weight):
    the GraphModule's attribute, and the ONNX initializer of its refittable export."""
    return re.sub(r"\W", "_", placeholder)


def _stage_module(members: list[torch.fx.Node], reads: list[torch.fx.Node], outputs: list[torch.fx.Node],
                  graph: _Graph) -> torch.fx.GraphModule:
    """The members as a GraphModule: reads in as placeholders, constants as buffers, shape math copied."""
    g = torch.fx.Graph()
    root = torch.nn.Module()
    env: dict[torch.fx.Node, torch.fx.Node] = {n: g.placeholder(n.name) for n in reads}
    for n in reads:
        env[n].meta = dict(n.meta)

    def value(n: torch.fx.Node) -> torch.fx.Node:
        if n not in env:
            if n.op == "placeholder" and n.name in graph.constants:
                attr = stage_weight_name(n.name)
                root.register_buffer(attr, graph.constants[n.name])
                env[n] = g.get_attr(attr)
            elif _is_shape_node(n):
                env[n] = g.node_copy(n, value)
            else:
                raise KilnError(f"internal: stage value {n.name} is neither read, computed nor a constant")
        return env[n]

    for node in members:
        env[node] = g.node_copy(node, value)
    g.output(tuple(env[n] for n in outputs))
    return torch.fx.GraphModule(root, g)


def _dynamic_axes(node: torch.fx.Node, symbols: dict[sympy.Symbol, Range]) -> dict[int, Range]:
    """The axes of a value whose size is symbolic, each with its range from the model's input ranges."""
    val = node.meta.get("val")
    axes: dict[int, Range] = {}
    if not isinstance(val, torch.Tensor):
        return axes
    for axis, d in enumerate(val.shape):
        if not isinstance(d, torch.SymInt):
            continue
        expr = d.node.expr
        free = expr.free_symbols
        if not free or not free <= set(symbols):
            continue  # a symbol no user range covers (data-dependent): kiln's default profile decides
        points = [int(expr.subs({s: symbols[s][k] for s in free})) for k in range(3)]
        axes[axis] = (min(points), points[1], max(points))
    return axes


def _symbol_ranges(graph: _Graph, ranges: dict[int, dict[int, Range]], flat: list[Any]) -> dict[sympy.Symbol, Range]:
    """symbol -> range, from the dynamic axes the user gave for the flat example inputs."""
    symbols: dict[sympy.Symbol, Range] = {}
    for node, example in zip(graph.inputs, flat):
        given = ranges.get(id(example), {})
        val = node.meta.get("val")
        for axis, r in given.items():
            d = val.shape[axis] if isinstance(val, torch.Tensor) else None
            if isinstance(d, torch.SymInt) and isinstance(d.node.expr, sympy.Symbol):
                seen = symbols.get(d.node.expr)
                # two axes tied to one symbol (torch.export found them equal): the ranges' intersection
                symbols[d.node.expr] = r if seen is None else (max(seen[0], r[0]), seen[1], min(seen[2], r[2]))
    return symbols


def _stages(graph: _Graph, torch_nodes: dict[torch.fx.Node, str]) -> list[Stage]:
    scheduled = _schedule(graph.program.graph, set(torch_nodes))
    reads = [_reads(members, graph) for _, members in scheduled]
    needed: set[torch.fx.Node] = {n for r in reads for n in r} | {o for o in graph.outputs if isinstance(o, torch.fx.Node)}
    stages = []
    for k, ((kind, members), read) in enumerate(zip(scheduled, reads)):
        outputs = [n for n in members if n in needed]
        fallback = [FallbackOp(n.name, _op_name(n), torch_nodes[n], _where(n)) for n in members if n in torch_nodes]
        module = _stage_module(members, read, outputs, graph)
        held = {n.target for n in module.graph.nodes if n.op == "get_attr"}
        weights = {stage_weight_name(p): key for p, key in graph.state_keys.items() if stage_weight_name(p) in held}
        stages.append(Stage(kind=kind, name=f"{kind}_{k}", inputs=[n.name for n in read], outputs=[n.name for n in outputs],
                            ops=[_op_name(n) for n in members if _op_name(n) != "getitem"],
                            module=module, fallback=fallback, weights=weights))
    return stages


def _run_examples(stages: list[Stage], env: dict[str, Any]) -> None:
    """Run the stages eagerly on the example inputs; each keeps the inputs it was given."""
    with torch.no_grad():
        for stage in stages:
            stage.example_inputs = [env[name] for name in stage.inputs]
            env.update(zip(stage.outputs, stage.module(*stage.example_inputs)))


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

