"""kiln.compile and torch.compile(backend="kiln"): a torch.nn.Module run by kiln engines.

    compiled = kiln.compile(model, (x,), precision="fp16", dynamic={"x": {0: (1, 8, 64)}})
    y = compiled(x)                  # same outputs, dtypes, devices and pytree as model(x)
    print(compiled.explain())        # the stages, what fell back to PyTorch and why, the time each takes
    compiled.save("model.kilnpt"); compiled = kiln.torch_backend.load("model.kilnpt")

    compiled = kiln.compile(model, (x,), refittable=True)
    compiled.load_state_dict(trained.state_dict())   # new weights into every stage, no rebuild

    import kiln.torch_backend        # registers the backend
    model = torch.compile(model, backend="kiln")

The module is captured with torch.export and split (kiln/frontend/torch.py): the ops kiln runs become
ONNX models built into engines (optimization profiles from the `dynamic` ranges), the rest stays in
PyTorch, said once in a FallbackWarning. Calls run the stages in order over named values; each stage's
time is measured (on CUDA only with `compiled.profile = True`, which synchronises around each stage).
A saved model is a folder: manifest.json, one .kiln engine per kiln stage and one torch.export archive
per PyTorch stage; it loads without the model's source (a custom op's library must be imported first).
Inference only: nothing here records gradients.

Refit (`compiled.refit(module_or_state_dict)`, `compiled.load_state_dict(sd)`) needs `refittable=True`
at compile, as Torch-TensorRT's refit needs `immutable_weights=False`: the kiln stages are then exported
without the ONNX exporter's optimizer (which folds BatchNorm into a convolution under the convolution's
weight's name and renames transposed weights), so each stage's initializers are the module's weights by
name, and built refittable (no weight stored once for equalling another). Each kiln stage's engine takes
its weights through kiln/builder/refit.py (re-derived as its builder derived them, or refused with the
reason); each PyTorch stage takes copies of its new weights (the module given is never written to).
"""

from __future__ import annotations

import copy
import json
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import sympy
import torch
import torch.utils._pytree as pytree

from kiln.builder.build import build as kiln_build
from kiln.builder.config import BuildConfig
from kiln.builder.profiles import DEFAULT_BATCH, DEFAULT_IMAGE, DEFAULT_SEQUENCE_MAX
from kiln.builder.refit import Derived, RefitError, RefitReport, derive_weights
from kiln.builder.refit import apply as apply_refit
from kiln.errors import EngineRebuildWarning, KilnError
from kiln.frontend import torch as torch_frontend
from kiln.frontend.torch import FallbackOp, Range, Stage
from kiln.runtime.engine import Engine
from kiln.runtime.engine import load as load_engine
from kiln.torch_refit import ModuleRefit, check_state_dict, replace_tensor, weight_specs, with_initializers
from kiln.version import __version__

SAVE_FORMAT = 1


class FallbackWarning(UserWarning):
    """Some of the model's ops run in PyTorch, not in a kiln engine (named in the message)."""


@dataclass
class _Runner:
    """One stage, ready to run: a kiln engine or a PyTorch callable, and what it reads and writes."""

    kind: str
    name: str
    inputs: list[str]
    outputs: list[str]
    ops: list[str]
    fallback: list[FallbackOp]
    engine: Engine | None = None
    function: Any = None  # torch stages: GraphModule or the loaded program's module
    archive: bytes | None = None  # torch stages: the torch.export archive (made on first save)
    source: Stage | None = None  # the frontend's stage, while the compiled object holds it
    weights: dict[str, str] = field(default_factory=dict)  # the stage's name of a module weight -> state_dict key
    onnx: bytes | None = None  # kiln stages of a refittable compile: the ONNX its engine derives weights through
    seconds: float = 0.0
    calls: int = 0

    def run(self, values: list[Any]) -> list[Any]:
        if self.engine is not None:
            results = self.engine.run(dict(zip(self.inputs, values)))
            return [results[name] for name in self.engine.output_names]
        return list(self.function(*values))


@dataclass
class Explanation:
    """What kiln.compile made of a module: `print(compiled.explain())`."""

    stages: list[dict[str, Any]]
    fallbacks: list[FallbackOp]
    timed: bool = field(default=False)

    def __str__(self) -> str:
        engines = sum(s["kind"] == "kiln" for s in self.stages)
        ops = sum(len(s["ops"]) for s in self.stages)
        in_torch = sum(len(s["ops"]) for s in self.stages if s["kind"] == "torch")
        lines = [(f"kiln.compile: {len(self.stages)} stage(s): {engines} kiln engine(s), "
                  f"{len(self.stages) - engines} in PyTorch; {ops - in_torch} of {ops} ops in kiln")]
        total = sum(s["seconds"] for s in self.stages)
        lines.append(f"  {'stage':<10} {'runs in':<8} {'ops':>4}  {'time share':>10}  ops")
        for s in self.stages:
            share = f"{100 * s['seconds'] / total:.1f}%" if total > 0 else "not run"
            names = sorted({o.rsplit('.', 1)[0] if o.endswith('.default') else o for o in s["ops"]})
            shown = ", ".join(names[:6]) + (f", ... ({len(names) - 6} more)" if len(names) > 6 else "")
            lines.append(f"  {s['name']:<10} {'kiln' if s['kind'] == 'kiln' else 'PyTorch':<8} {len(s['ops']):>4}  "
                         f"{share:>10}  {shown}")
        if total > 0 and not self.timed:
            lines.append("  (times on CUDA are launch times: set compiled.profile = True to synchronise around stages)")
        if self.fallbacks:
            lines.append(f"fell back to PyTorch ({len(self.fallbacks)} op(s)):")
            lines += [f"  {op.describe()}" for op in self.fallbacks]
        else:
            lines.append("nothing fell back to PyTorch")
        return "\n".join(lines)


class CompiledModule:
    """A module compiled by kiln: call it as the module; explain(); save()."""

    def __init__(self, runners: list[_Runner], inputs: list[str], outputs: list[Any], in_spec: pytree.TreeSpec,
                 out_spec: pytree.TreeSpec, options: dict[str, Any],
                 weight_specs: dict[str, tuple[str, list[int]]] | None = None):
        self.runners = runners
        self.inputs = inputs
        self.outputs = outputs
        self.in_spec = in_spec
        self.out_spec = out_spec
        self.options = options
        self.weight_specs = weight_specs or {}  # the module's state_dict: key -> (dtype, shape)
        self.profile = False

    @property
    def engines(self) -> list[Engine]:
        return [r.engine for r in self.runners if r.engine is not None]

    @property
    def fallbacks(self) -> list[FallbackOp]:
        return [op for r in self.runners for op in r.fallback]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.in_spec:
            ordered = self.in_spec.children_specs[1].context
            flat, spec = pytree.tree_flatten((args, {k: kwargs[k] for k in ordered if k in kwargs}))
            if spec != self.in_spec:
                raise KilnError(f"the inputs are structured as {spec}, but the model was compiled for {self.in_spec}")
        env = dict(zip(self.inputs, flat))
        sync = self.profile and torch.cuda.is_available()
        with torch.inference_mode():
            for runner in self.runners:
                if sync:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                env.update(zip(runner.outputs, runner.run([env[name] for name in runner.inputs])))
                if sync:
                    torch.cuda.synchronize()
                runner.seconds += time.perf_counter() - start
                runner.calls += 1
        results = [env[o] if isinstance(o, str) else o for o in self.outputs]
        return pytree.tree_unflatten(results, self.out_spec)

    def explain(self) -> Explanation:
        stages = [{"name": r.name, "kind": r.kind, "ops": r.ops, "seconds": r.seconds, "calls": r.calls}
                  for r in self.runners]
        timed = self.profile or not any(e.device.type == "cuda" for e in self.engines)
        return Explanation(stages, self.fallbacks, timed)

    def refit(self, weights: torch.nn.Module | dict[str, torch.Tensor], strict: bool = False) -> ModuleRefit:
        """New module weights into every stage without re-export or rebuild: each kiln engine re-derives its
        own (BatchNorm folded, transposed, merged, half precision) as its build did, each PyTorch stage takes
        copies. `weights`: a module like the compiled one, or (part of) its state_dict. Every problem (a key
        the module lacks, a shape or dtype unlike its, with `strict` a key missing) is listed in one
        RefitError, and nothing changes unless every stage takes its weights."""
        state = weights.state_dict() if isinstance(weights, torch.nn.Module) else dict(weights)
        check_state_dict(self.weight_specs, state, strict)
        used = {key for r in self.runners for key in r.weights.values()}
        derived: list[tuple[_Runner, Derived, bytes]] = []
        for r in self.runners:  # derive every engine's weights first: a refusal leaves all stages as they were
            given = {name: state[key] for name, key in r.weights.items() if key in state}
            if r.engine is None or not given:
                continue
            if r.onnx is None:
                raise RefitError(f"stage {r.name} was not compiled refittable: the ONNX exporter's optimizer folded "
                                 "and renamed its weights (BatchNorm into the convolution, transposed Linear weights), "
                                 "so they cannot be mapped from the module's; compile with kiln.compile(..., "
                                 "refittable=True)")
            model = with_initializers(r.onnx, given, r.name)
            try:
                derived.append((r, derive_weights(r.engine, model), model))
            except RefitError as e:
                raise RefitError(f"stage {r.name}: {e}") from None
        reports: dict[str, RefitReport | list[str]] = {}
        for r, d, model in derived:
            apply_refit(r.engine, d)
            r.onnx = model
            reports[r.name] = d.report
        for r in self.runners:
            given = {name: state[key] for name, key in r.weights.items() if key in state}
            if r.engine is not None or not given:
                continue
            if r.source is not None:  # the stage's GraphModule runs: its tensors are replaced by copies
                for name, value in given.items():
                    replace_tensor(r.function, name, value)
                r.archive = None  # saved again from the GraphModule
            else:  # loaded: the archive is the stage
                r.archive = torch_frontend.refit_torch_stage(r.archive, given)
                r.function = torch_frontend.load_torch_stage(r.archive)
            reports[r.name] = sorted(r.weights[name] for name in given)
        return ModuleRefit(reports, sorted(k for k in state if k not in used))

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> ModuleRefit:
        """torch's name for refit: with `strict`, a key of the module missing from `state_dict` is refused too."""
        return self.refit(state_dict, strict=strict)

    def save(self, path: str | Path) -> None:
        """A folder: manifest.json, <stage>.kiln engines, <stage>.pt2 torch.export archives."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        stages = []
        for r in self.runners:
            entry = {"kind": r.kind, "name": r.name, "inputs": r.inputs, "outputs": r.outputs, "ops": r.ops,
                     "fallback": [asdict(op) for op in r.fallback], "weights": r.weights}
            if r.engine is not None:
                entry["file"] = f"{r.name}.kiln"
                r.engine.save(folder / entry["file"])
                if r.onnx is not None:  # what a refit derives the engine's weights through
                    entry["onnx"] = f"{r.name}.onnx"
                    (folder / entry["onnx"]).write_bytes(r.onnx)
            else:
                if r.archive is None:
                    r.archive = torch_frontend.save_torch_stage(r.source)
                entry["file"] = f"{r.name}.pt2"
                (folder / entry["file"]).write_bytes(r.archive)
            stages.append(entry)
        try:
            specs = {"in_spec": pytree.treespec_dumps(self.in_spec), "out_spec": pytree.treespec_dumps(self.out_spec)}
        except Exception as e:  # noqa: BLE001  a pytree node type without a serialized name
            raise KilnError(f"the model's inputs or outputs are of a pytree type torch cannot serialize ({e}); "
                            "return tensors, tuples, lists or dicts to save the compiled model") from None
        manifest = {"format": SAVE_FORMAT, "kiln_version": __version__, "torch_version": torch.__version__,
                    "inputs": self.inputs, "outputs": self.outputs, **specs, "stages": stages,
                    "options": self.options, "weights": self.weight_specs}
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str))

    @classmethod
    def load(cls, path: str | Path) -> CompiledModule:
        folder = Path(path)
        if not (folder / "manifest.json").is_file():
            raise KilnError(f"{folder}: not a saved kiln.compile model (no manifest.json)")
        manifest = json.loads((folder / "manifest.json").read_text())
        if manifest.get("format") != SAVE_FORMAT:
            raise KilnError(f"{folder}: saved in format {manifest.get('format')}, this kiln reads {SAVE_FORMAT}")
        runners = []
        for s in manifest["stages"]:
            runner = _Runner(s["kind"], s["name"], s["inputs"], s["outputs"], s["ops"],
                             [FallbackOp(**op) for op in s["fallback"]], weights=s.get("weights", {}))
            if s["kind"] == "kiln":
                runner.engine = load_engine(folder / s["file"])
                if s.get("onnx"):
                    runner.onnx = (folder / s["onnx"]).read_bytes()
            else:
                runner.archive = (folder / s["file"]).read_bytes()
                try:
                    runner.function = torch_frontend.load_torch_stage(runner.archive)
                except Exception as e:
                    ops = sorted({op.op for op in runner.fallback})
                    raise KilnError(f"{folder / s['file']}: the PyTorch stage {s['name']} ({', '.join(ops)}) does not "
                                    f"load ({type(e).__name__}: {str(e)[:300]}); import the library that registers "
                                    "its custom ops first") from e
            runners.append(runner)
        specs = {k: (v[0], list(v[1])) for k, v in manifest.get("weights", {}).items()}
        return cls(runners, manifest["inputs"], manifest["outputs"], pytree.treespec_loads(manifest["in_spec"]),
                   pytree.treespec_loads(manifest["out_spec"]), manifest.get("options", {}), specs)


def _device_of(example_inputs: Any) -> str:
    for leaf in pytree.tree_leaves(example_inputs):
        if isinstance(leaf, torch.Tensor):
            return leaf.device.type
    return "cpu"


def compile(module: torch.nn.Module, example_inputs: Any, *, precision: str = "fp32", dynamic: dict | None = None,
            device: str | None = None, example_kwargs: dict | None = None, progress=None,
            **build_options: Any) -> CompiledModule:
    """Compile `module` for inputs like `example_inputs` (a tuple of positional arguments, or one tensor).

    `dynamic`: {argument name: {axis: (min, opt, max) or (min, max)}}, nested as the argument is (a dict
    of tensors takes a dict); these ranges become the engines' optimization profiles. Other keyword
    options are kiln.build's (opt_level, timing_cache, tactics, ...).
    """
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    device = device or _device_of((args, example_kwargs))
    if isinstance(module, torch.nn.Module):
        module = module.eval()
    refittable = bool(build_options.get("refittable"))
    split = torch_frontend.partition(module, args, example_kwargs or {}, dynamic, progress, refittable=refittable)
    options = {"precision": precision, "device": device, **build_options}
    runners = []
    for stage in split.stages:
        runner = _Runner(stage.kind, stage.name, stage.inputs, stage.outputs, stage.ops, stage.fallback,
                         function=stage.module, source=stage, weights=stage.weights,
                         onnx=stage.onnx if refittable else None)
        if stage.kind == "kiln":
            try:
                config = BuildConfig.from_kwargs(**options, profiles=stage.profiles())
                runner.engine = kiln_build(stage.onnx, config, progress=progress)
            except KilnError as e:  # an engine kiln cannot build: PyTorch runs this stage, said so
                why = f"kiln could not build its stage: {str(e).splitlines()[0][:300]}"
                runner.kind = "torch"
                runner.fallback = [FallbackOp(stage.name, op, why, "the whole stage") for op in stage.ops]
        runners.append(runner)
    compiled = CompiledModule(runners, split.inputs, split.outputs, split.in_spec, split.out_spec, options,
                              weight_specs(module, split.stages))
    if compiled.fallbacks:
        ops = sorted({op.op for op in compiled.fallbacks})
        places = "; ".join(op.describe() for op in compiled.fallbacks[:5])
        more = f"; ... ({len(compiled.fallbacks) - 5} more)" if len(compiled.fallbacks) > 5 else ""
        warnings.warn(f"kiln.compile: {len(compiled.fallbacks)} op(s) run in PyTorch ({', '.join(ops)}), the rest in "
                      f"{len(compiled.engines)} kiln engine(s): {places}{more}. compiled.explain() shows the stages "
                      "and the time each takes", FallbackWarning, stacklevel=_caller_level())
    return compiled


def _caller_level() -> int:
    """warnings.warn's stacklevel naming the first frame outside kiln (the user's call)."""
    root = str(Path(__file__).resolve().parent)
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(root):
        frame, level = frame.f_back, level + 1
    return level


def load(path: str | Path) -> CompiledModule:
    """A compiled model saved with CompiledModule.save."""
    return CompiledModule.load(path)


# ---- torch.compile(backend="kiln") ------------------------------------------------------------------

class _Bound(torch.nn.Module):
    """A dynamo graph with its parameters, buffers and module attributes held as buffers, so kiln sees
    them as weights (folded, pre-packed) instead of inputs; called with the remaining tensor inputs.
    The size arguments dynamo passes for dynamic dims (`s0`) are read from the tensors they measure
    (`sizes`), so torch.export traces them as shape arithmetic rather than fixing them as constants;
    the Python numbers dynamo passes wrapped in tensors (a LayerNorm's eps under dynamic=True) are
    written into the graph (`scalars`): `.item()` of a tensor would be data-dependent to torch.export."""

    def __init__(self, graph_module: torch.fx.GraphModule, args: list[Any], constant: list[bool],
                 sizes: dict[int, tuple[int, int]] | None = None, scalars: dict[int, int | float] | None = None):
        super().__init__()
        self.graph_module = _with_scalars(graph_module, scalars) if scalars else graph_module
        self.constant = constant
        self.sizes = sizes or {}
        for k, (a, c) in enumerate(zip(args, constant)):
            if c:
                self.register_buffer(f"weight_{k}", a.detach())

    def forward(self, *inputs: Any) -> Any:
        given = iter(inputs)
        full = [getattr(self, f"weight_{k}") if c else None if k in self.sizes else next(given)
                for k, c in enumerate(self.constant)]
        for k, (tensor, axis) in self.sizes.items():
            full[k] = full[tensor].shape[axis]
        return self.graph_module(*full)


def _with_scalars(graph_module: torch.fx.GraphModule, scalars: dict[int, int | float]) -> torch.fx.GraphModule:
    """A copy of the graph where `placeholder_k.item()` reads the number scalars[k]."""
    graph = copy.deepcopy(graph_module.graph)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for k, number in scalars.items():
        for item in [u for u in placeholders[k].users if u.op == "call_method" and u.target == "item"]:
            for user in list(item.users):
                user.args = torch.fx.node.map_arg(user.args, lambda n, i=item, v=number: v if n is i else n)
                user.kwargs = torch.fx.node.map_arg(user.kwargs, lambda n, i=item, v=number: v if n is i else n)
            graph.erase_node(item)
    return torch.fx.GraphModule(graph_module, graph)


def _module_state(node: torch.fx.Node) -> bool:
    """A graph argument dynamo took from the module (a parameter, buffer or attribute), not from the
    call's arguments: kiln holds it as a weight."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    while getattr(source, "base", None) is not None:
        source = source.base
    local = getattr(source, "local_name", None)
    return source is not None and local in (None, "self")


class _DynamicDims:
    """What dynamo made dynamic in one graph: the symbolic axes of its tensor arguments and dynamo's
    range for each symbol; each SymInt argument equals an axis of a tensor argument (`sizes`)."""

    def __init__(self, axes: dict[int, dict[int, sympy.Symbol]], sizes: dict[int, tuple[int, int]],
                 bounds: dict[sympy.Symbol, tuple[int, int | None]], ranks: dict[int, int]):
        self.axes = axes  # tensor argument index -> axis -> symbol
        self.sizes = sizes  # SymInt argument index -> (tensor argument index, axis)
        self.bounds = bounds  # symbol -> dynamo's value range (None: unbounded above)
        self.ranks = ranks  # tensor argument index -> rank

    @classmethod
    def of(cls, graph_module: torch.fx.GraphModule) -> _DynamicDims | None:
        """None when the graph has no dynamic dim, or one kiln cannot follow (a dim that is an expression
        of symbols, a size argument measuring no input): such a graph is compiled once per shape."""
        values = [n.meta.get("example_value") for n in graph_module.graph.nodes if n.op == "placeholder"]
        axes: dict[int, dict[int, sympy.Symbol]] = {}
        bounds: dict[sympy.Symbol, tuple[int, int | None]] = {}
        for k, v in enumerate(values):
            if not isinstance(v, torch.Tensor) or isinstance(v, torch.nn.Parameter):
                continue
            for axis, d in enumerate(v.shape):
                if not isinstance(d, torch.SymInt):
                    continue
                expr = d.node.expr
                if expr.is_number:
                    continue  # dynamic=True makes every dim a SymInt; this one was specialised
                if not isinstance(expr, sympy.Symbol):
                    return None
                axes.setdefault(k, {})[axis] = expr
                found = d.node.shape_env.var_to_range.get(expr)
                lower = int(found.lower) if found is not None and found.lower > 0 else 1
                upper = None if found is None or found.upper > 2**62 else int(found.upper)  # int_oo: unbounded
                bounds[expr] = (lower, upper)
        if not axes:
            return None
        where = {s: (k, axis) for k, found in axes.items() for axis, s in found.items()}
        sizes = {}
        for k, v in enumerate(values):
            if isinstance(v, torch.SymInt):
                if v.node.expr not in where:
                    return None
                sizes[k] = where[v.node.expr]
            elif not isinstance(v, torch.Tensor):
                return None  # an argument of another kind (a float dynamo left symbolic): per shape
        return cls(axes, sizes, bounds, {k: values[k].dim() for k in axes})

    def values(self, args: tuple) -> dict[sympy.Symbol, int]:
        return {s: int(args[k].shape[axis]) for k, found in self.axes.items() for axis, s in found.items()}

    def ranges(self, values: dict[sympy.Symbol, int], held: dict[sympy.Symbol, Range] | None = None
               ) -> dict[sympy.Symbol, Range]:
        """Each symbol's profile range: dynamo's bounds, where dynamo has no upper bound kiln's default
        profile's (64 for a batch axis, 1024 for an image's H or W, 512 for others), tuned at the first
        call's value; widened to hold the ranges already `held` and `values`."""
        found = {}
        for symbol, (lower, upper) in self.bounds.items():
            if upper is None:
                k, axis = next((k, a) for k, axes in self.axes.items() for a, s in axes.items() if s == symbol)
                upper = DEFAULT_BATCH[2] if axis == 0 else \
                    DEFAULT_IMAGE[2] if self.ranks[k] == 4 and axis >= 2 else DEFAULT_SEQUENCE_MAX
            low, opt, high = lower, values[symbol], upper
            if held is not None and symbol in held:
                low, opt, high = min(low, held[symbol][0]), held[symbol][1], max(high, held[symbol][2])
            found[symbol] = (min(low, values[symbol]), opt, max(high, values[symbol]))
        return found

    def dynamic(self, constant: list[bool], ranges: dict[sympy.Symbol, Range]) -> dict:
        """kiln.compile's `dynamic` for _Bound (whose forward takes *inputs: the non-constant tensors)."""
        per_input = [{axis: ranges[s] for axis, s in self.axes.get(k, {}).items()} or None
                     for k, c in enumerate(constant) if not c and k not in self.sizes]
        return {"inputs": per_input}


class _DynamoGraph:
    """What the backend hands dynamo: compiles one graph with kiln at its first call. A graph with dims
    dynamo made dynamic becomes one engine whose optimization profile spans them (dynamo's ranges, and
    where it has none kiln's defaults), rebuilt wider once, with an EngineRebuildWarning, when a call
    falls outside; a static graph (or one kiln cannot follow) gets one engine per input signature."""

    def __init__(self, graph_module: torch.fx.GraphModule, options: dict[str, Any]):
        self.graph_module = graph_module
        self.options = options
        placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
        self.state = [_module_state(n) for n in placeholders]
        self.wrapped = [k for k, n in enumerate(placeholders)
                        if getattr(n.meta.get("grapharg"), "pass_arg_as_tensor", False)]
        self.dims = _DynamicDims.of(graph_module)
        self.compiled: dict[tuple, CompiledModule] = {}
        self.ranges: dict[sympy.Symbol, Range] | None = None  # the dynamic engine's, once built
        self.builds = 0

    def _constant(self, args: tuple) -> list[bool]:
        return [isinstance(a, torch.nn.Parameter) or held or k in self.wrapped
                for k, (a, held) in enumerate(zip(args, self.state))]

    def _inputs(self, args: tuple, dynamic: bool) -> list[Any]:
        """What the compiled module takes: the arguments less the weights (and, dynamic, less the sizes)."""
        skip = self.dims.sizes if dynamic else {}
        return [a for k, (a, c) in enumerate(zip(args, self._constant(args))) if not c and k not in skip]

    def _scalars(self, args: tuple) -> dict[int, int | float]:
        return {k: args[k].item() for k in self.wrapped}

    def _compile(self, args: tuple, dynamic: dict | None) -> CompiledModule:
        bound = _Bound(self.graph_module, list(args), self._constant(args), self.dims.sizes if dynamic else None,
                       self._scalars(args))
        self.builds += 1
        return compile(bound, tuple(self._inputs(args, dynamic is not None)), dynamic=dynamic, **self.options)

    def __call__(self, *args: Any) -> Any:
        scalars = tuple(self._scalars(args).values())  # dynamo guards module attributes; a user's number may vary
        if self.dims is not None and all(args[k].shape[a] >= 2 for k, axes in self.dims.axes.items() for a in axes):
            return self._call_dynamic(args, scalars)
        key = scalars + tuple((tuple(a.shape), a.dtype, a.device.type) if isinstance(a, torch.Tensor) else a
                              for a in args)
        if key not in self.compiled:
            self.compiled[key] = self._compile(args, None)
        return self.compiled[key](*self._inputs(args, False))

    def _call_dynamic(self, args: tuple, scalars: tuple) -> Any:
        values = self.dims.values(args)
        key = ("dynamic", *scalars)
        outside = self.ranges is not None and any(not lo <= values[s] <= hi for s, (lo, _, hi) in self.ranges.items())
        if key not in self.compiled or outside:
            if outside:
                warnings.warn(f"torch.compile(backend='kiln'): sizes {_named(values)} lie outside the engine's "
                              f"profile ({_named(self.ranges)}): rebuilding it with the profile widened to hold "
                              "them; mark the dims with their ranges (torch._dynamo.mark_dynamic(x, dim, min=, max=)) "
                              "to build once", EngineRebuildWarning, stacklevel=3)
            self.ranges = self.dims.ranges(values, self.ranges)
            self.compiled[key] = self._compile(args, self.dims.dynamic(self._constant(args), self.ranges))
        return self.compiled[key](*self._inputs(args, True))


def _named(ranges: dict[sympy.Symbol, Any]) -> str:
    return ", ".join(f"{s}={v if isinstance(v, int) else f'{v[0]}..{v[2]}'}" for s, v in ranges.items())


def kiln_backend(graph_module: torch.fx.GraphModule, example_inputs: list[Any], options: dict | None = None,
                 mode: str | None = None) -> Any:
    """torch.compile's backend: torch.compile(model, backend="kiln", options={"precision": "fp16"})."""
    return _DynamoGraph(graph_module, dict(options or {}))


def _register() -> None:
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if "kiln" not in _COMPILER_FNS:
        register_backend(kiln_backend, name="kiln")


_register()
