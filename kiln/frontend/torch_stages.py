"""The exported graph cut into stages kiln runs and stages PyTorch runs (kiln/frontend/torch.py, steps 2-3):
each op classified (kiln's when the ONNX exporter translates it, else PyTorch's with the reason and the model's
source line), ops scheduled into stages of one kind, each stage a GraphModule over the values it reads (shape
arithmetic copied into every stage that needs it), with its dynamic axes' ranges.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx

from kiln.errors import KilnError
from kiln.frontend.torch_capture import Range, _onnx_registry

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
