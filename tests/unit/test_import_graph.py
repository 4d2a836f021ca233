"""The project's shape, checked: no import cycles among its modules (imports inside functions
count: hiding a cycle in a function is still one) and no class longer than 350 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dstl_ray", "topology", "spark_glue")
MAX_CLASS_LINES = 350


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module ``name`` is, or lives in (an imported attribute of a package)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    pkg = base[: len(base) - node.level + 1]
                    prefix = ".".join(pkg + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [f"{prefix}.{a.name}" for a in node.names]
            for t in targets:
                dep = _resolve(t, modules)
                if dep is not None and dep != mod and not mod.startswith(dep + "."):
                    graph[mod].add(dep)  # (a package's own __init__ is not a cycle)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_topology_depends_on_the_node_never_the_reverse():
    """The tree's shape (topology) is built on node actors; a node only follows what it is
    told (its parent, the order), and the runtime never depends on the Spark glue."""
    graph = import_graph()
    assert not [(m, d) for m, deps in graph.items() if m.startswith("dstl_ray.node")
                for d in deps if d.startswith(("topology", "spark_glue"))]
    assert not [(m, d) for m, deps in graph.items()
                if m.startswith("dstl_ray") and not m.startswith("dstl_ray.cli.main")
                for d in deps if d.startswith("spark_glue")]


def test_no_class_over_350_lines():
    big = []
    for mod, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_CLASS_LINES:
                    big.append(f"{mod}.{node.name}: {n} lines")
    assert big == []
