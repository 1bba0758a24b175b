"""kiln's imports point down the layering of docs/architecture.md, and no module imports itself
back through others. Every import counts: module level, inside functions, under TYPE_CHECKING.

    apps (the `kiln` facade, cli, tools, zoo, demo, backend, compat, torch_backend)
      -> builder -> {frontend, passes, runtime} -> tactics -> kernels -> ops -> plan -> ir -> base (errors, version, openmp)

Packages of one level (frontend, passes and runtime; errors, version and openmp) may not import one another.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kiln

ROOT = Path(kiln.__file__).resolve().parent

# Lowest first. A module may import its own package and the packages of lower layers, nothing else.
LAYERS: list[tuple[str, set[str]]] = [
    ("base", {"kiln.errors", "kiln.version", "kiln.openmp"}),  # openmp: a leaf read before torch loads
    ("ir", {"kiln.ir"}),
    ("plan", {"kiln.plan"}),
    ("ops", {"kiln.ops"}),
    ("kernels", {"kiln.kernels"}),
    ("tactics", {"kiln.tactics"}),
    ("stages", {"kiln.runtime", "kiln.frontend", "kiln.passes", "kiln.quant"}),  # side by side: none imports another
    ("builder", {"kiln.builder"}),
    ("apps", {"kiln", "kiln.tools", "kiln.zoo", "kiln.cli", "kiln.demo", "kiln.backend", "kiln.__main__",
              "kiln.data", "kiln.serve", "kiln.compat", "kiln.torch_backend", "kiln.llm"}),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str, path: Path) -> set[str]:
    """kiln modules `name` imports, anywhere in its source (`from a import b`: a.b when b is a module)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            subs = {f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in MODULES}
            found |= subs or {module}
            if len(subs) < len(node.names):
                found.add(module)
    return {m for m in found if m == "kiln" or m.startswith("kiln.")}


def _layer(module: str) -> tuple[int, str]:
    best = None
    for level, (layer, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[2])):
                best = (level, layer, prefix)
    if best is None:
        raise AssertionError(f"{module} belongs to no layer of this test: place it")
    return best[0], best[1]


def _owner(module: str) -> str:
    """The module's package: its layer's prefix it falls under (kiln.ops for kiln.ops.nn)."""
    level, _ = _layer(module)
    return max((p for p in LAYERS[level][1] if module == p or module.startswith(p + ".")), key=len)


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_every_module_has_a_layer():
    for name in MODULES:
        _layer(name)


def test_imports_point_down():
    wrong = []
    for name, targets in sorted(GRAPH.items()):
        level, layer = _layer(name)
        for target in sorted(targets):
            t_level, t_layer = _layer(target)
            if _owner(target) == _owner(name) or layer == "apps" and t_layer == "apps":
                continue  # inside a package; the apps use one another (cli -> tools) and the facade
            if t_level >= level:
                wrong.append(f"{name} ({layer}) imports {target} ({t_layer})")
    assert not wrong, "imports that point up or sideways:\n  " + "\n  ".join(wrong)


def _cycle_from(start: str) -> list[str] | None:
    path: list[str] = []
    on_path: set[str] = set()
    done: set[str] = set()

    def visit(m: str) -> list[str] | None:
        if m in on_path:
            return path[path.index(m):] + [m]
        if m in done or m not in GRAPH:
            return None
        path.append(m)
        on_path.add(m)
        for t in sorted(GRAPH[m]):
            # a package's __init__ importing its own submodules is how a package is assembled; the
            # submodule importing its package back is then the cycle, and is found from it
            found = visit(t)
            if found:
                return found
        path.pop()
        on_path.discard(m)
        done.add(m)
        return None

    return visit(start)


def test_no_import_cycles():
    cycles = set()
    for name in sorted(GRAPH):
        found = _cycle_from(name)
        if found:
            cycles.add(" -> ".join(found))
    assert not cycles, "import cycles:\n  " + "\n  ".join(sorted(cycles))


@pytest.mark.parametrize("upward", [
    ("kiln.tactics.registry", "kiln.runtime.program"),
    ("kiln.passes.fold", "kiln.builder.lower"),
])
def test_the_checker_sees_an_upward_edge(monkeypatch, upward):
    """The check itself can fail: an edge added to the graph is reported."""
    source, target = upward
    monkeypatch.setitem(GRAPH, source, GRAPH[source] | {target})
    with pytest.raises(AssertionError, match=f"{source} .* imports {target}"):
        test_imports_point_down()


def test_the_checker_sees_a_cycle(monkeypatch):
    """kiln.plan.file imports kiln.plan.spec; the edge back closes a cycle inside one package."""
    assert "kiln.plan.spec" in GRAPH["kiln.plan.file"]
    monkeypatch.setitem(GRAPH, "kiln.plan.spec", GRAPH["kiln.plan.spec"] | {"kiln.plan.file"})
    with pytest.raises(AssertionError, match="kiln.plan.file -> kiln.plan.spec -> kiln.plan.file"):
        test_no_import_cycles()
