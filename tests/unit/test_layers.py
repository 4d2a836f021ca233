"""The package layers (docs/architecture.md "Package layers"), checked: a package imports only
packages of lower layers (imports inside functions and under TYPE_CHECKING count, as in
test_import_graph), and no runtime module imports the test support ``dstl_ray.testing``.

LAYERS below is the one list of the layers; the doc draws it, and a test checks that it draws
this very order.
"""

from __future__ import annotations

import re
import subprocess
import sys

from .test_import_graph import ROOT, _modules, import_graph

# lowest first; packages of one layer never import each other. A package is a subpackage or a
# top-level module of dstl_ray ("dstl_ray" itself is the facade, dstl_ray/__init__.py), or one
# of the top-level packages topology and spark_glue.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("keygroups", "process_identity", "plotting"),
    ("key_hashes",),
    ("observability",),
    ("config",),
    ("storage",),
    ("format",),
    ("upload", "merging"),
    ("transport",),
    ("node",),
    ("topology",),
    ("log",),
    ("state",),
    ("checkpoint",),
    ("deploy", "local"),
    ("dstl_ray",),
    ("spark_glue",),
    ("cli",),
    ("testing",),
)
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def package(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "dstl_ray":
        return parts[0]
    return parts[1] if len(parts) > 1 else "dstl_ray"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a package of the same or a higher layer (its own package excepted)."""
    out = []
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            a, b = package(mod), package(dep)
            if a != b and RANK[b] >= RANK[a]:
                where = "the same" if RANK[b] == RANK[a] else "a higher"
                out.append(f"{mod} ({a}) imports {dep} ({b}, {where} layer)")
    return out


def test_every_package_has_a_layer():
    packages = {package(m) for m in _modules()}
    assert packages == set(RANK), (f"not in LAYERS: {sorted(packages - set(RANK))}; "
                                   f"in LAYERS but gone: {sorted(set(RANK) - packages)}")


def test_no_package_imports_a_higher_layer():
    assert upward_imports(import_graph()) == []


def test_the_check_sees_imports_in_functions_and_under_type_checking():
    """The scan counts what a lazy import hides (the graph is built from every import node)."""
    graph = import_graph()
    assert "dstl_ray.transport.discovery" in graph["dstl_ray.transport.node_lookup"]  # (lazy)
    fake = {"dstl_ray.state.x": {"dstl_ray.checkpoint.y"}, "dstl_ray.checkpoint.y": set()}
    assert upward_imports(fake) == [
        "dstl_ray.state.x (state) imports dstl_ray.checkpoint.y (checkpoint, a higher layer)"]


def test_no_runtime_module_imports_the_test_support():
    graph = import_graph()
    assert not [(m, d) for m, deps in graph.items() if package(m) != "testing"
                for d in deps if package(d) == "testing"]


def test_importing_every_runtime_module_leaves_the_test_support_unloaded():
    """At run time too: no module loads dstl_ray.testing by a name held in a string."""
    runtime = sorted(m for m in _modules() if package(m) not in ("testing", "spark_glue"))
    code = ("import importlib, sys\n"
            f"for m in {runtime!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m.startswith('dstl_ray.testing')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.strip()
    assert out == "[]"


def test_the_architecture_doc_draws_these_layers():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc.split("## Package layers", 1)[1].split("\n## ", 1)[0]
    drawn = re.findall(r"^\s*\d+\.\s+(.+?):", section, re.M)
    assert [tuple(re.findall(r"`([\w.]+)`", line)) for line in drawn] == list(LAYERS)
