"""What README.md and docs/*.md name exists as written: a dotted name (`dstl_ray.errors`,
`spark_glue.read_state`) imports, a path (`dstl_ray/node/`) is there, a class the README
names (`FileMergingOptions`) imports from the package users import (dstl_ray, spark_glue or
topology), a class docs/ names is defined in the code, and every import of a Python block
works. Every fenced block says its language, so the README's Python blocks (run by
tests/integration/test_readme.py and tests/spark/test_readme.py) are all the Python there
is."""

from __future__ import annotations

import ast
import builtins
import importlib
import re
from functools import cache
from pathlib import Path

import pytest

from .docs_util import DOCS, LANGUAGES, README, ROOT, blocks, inline_code, python_blocks

PACKAGES = ("dstl_ray", "spark_glue", "topology")
_DOTTED = re.compile(r"^((?:dstl_ray|spark_glue|topology)(?:\.\w+)+)(\(.*\))?$")
_PATH = re.compile(r"^(?:dstl_ray|spark_glue|topology|tests|experiments|docs)/[\w./-]*$")
# a class-like name: capitalized, not part of a dotted or hyphenated word
_CLASS = re.compile(r"(?<![\w.-])([A-Z][A-Za-z0-9_]*[a-z][A-Za-z0-9_]*)(?![\w-])")
# names of other projects the docs compare with or use, each with its home
FOREIGN = {
    "AbstractCheckpointStats": "Flink",
    "CheckpointsCleaner": "Flink (dstl_ray.checkpoint.cleaner is named after it)",
    "DataGeneratorSource": "Flink",
    "Decimal": "Python's decimal module",
    "KeyGroupPartitionedPriorityQueue": "Flink",
    "PeriodicMaterializationManager": "Flink",
    "LocalDataOutputStream": "Flink",
    "RateLimiterStrategy": "Flink",
    "RecoverableWriter": "Flink",
    "StateChangeFsUploader": "Flink",
    "NodeAffinitySchedulingStrategy": "Ray",
    "InvalidAuthToken": "Ray (its error for a node without the token)",
    "RAY_health_check_period_ms": "Ray (its GCS's health check of nodes)",
    "RAY_health_check_timeout_ms": "Ray (its GCS's health check of nodes)",
    "RAY_health_check_failure_threshold": "Ray (its GCS's health check of nodes)",
    "Row": "pyspark.sql",
    "StructType": "pyspark.sql.types",
    "FileStreamSink": "Spark (Structured Streaming's file sink)",
    "LogicalRDD": "Spark (the plan node of a foreachBatch micro-batch)",
    "SinglePartition": "Spark (the partitioning of a plan whose rows are in one partition)",
    "DataFrame": "Spark (a query's rows, as PySpark and Spark name them)",
    "Dataset": "Spark (the JVM's typed query object a DataFrame wraps)",
    "Multiply": "Spark (Catalyst's multiplication, which the JVM route builds in LEGACY mode)",
    "PythonStreamingQueryListener": "Spark (the JVM interface a Python listener implements)",
}
FOREIGN_PATHS = {"tests/abstract"}  # fsspec's conformance tests


def _resolve(dotted: str) -> object:
    """Import the longest module prefix of ``dotted``, then look the rest up on it."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:n]))
        except ModuleNotFoundError as e:
            if e.name is not None and not ".".join(parts[:n]).startswith(e.name):
                raise  # the module exists but imports something missing
            continue
        for attr in parts[n:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


@cache
def _defined_in_code() -> frozenset[str]:
    """Every class and function defined at the top level of a module of ours."""
    names: set[str] = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(node.name)
    return frozenset(names)


def _exported(name: str) -> bool:
    return any(hasattr(importlib.import_module(pkg), name) for pkg in PACKAGES)


def _class_names(path: Path) -> set[str]:
    """The class-like names of ``path``'s inline code, but Python's own and FOREIGN."""
    names = {m.group(1) for span in inline_code(path) for m in _CLASS.finditer(span)}
    return {n for n in names - set(FOREIGN) if not hasattr(builtins, n)}


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_code_block_says_its_language(path: Path):
    untagged = [f"{b.where} ({b.lang or 'no language'})" for b in blocks(path)
                if b.lang not in LANGUAGES]
    assert not untagged, f"fences must say one of {sorted(LANGUAGES)}: {untagged}"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_dotted_names_import(path: Path):
    names = {m.group(1) for span in inline_code(path) if (m := _DOTTED.match(span))}
    failed = {}
    for name in sorted(names):
        try:
            _resolve(name)
        except (ImportError, AttributeError) as e:
            failed[name] = repr(e)
    assert not failed, failed


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_paths_exist(path: Path):
    paths = {span for span in inline_code(path) if _PATH.match(span)} - FOREIGN_PATHS
    assert paths, "no path found: the pattern no longer matches the docs"
    assert not sorted(p for p in paths if not (ROOT / p).exists())


def test_classes_the_readme_names_import_from_a_package():
    names = _class_names(README)
    assert "FileMergingOptions" in names
    assert not sorted(n for n in names if not _exported(n)), \
        f"not exported by any of {PACKAGES}"


@pytest.mark.parametrize("path", [p for p in DOCS if p != README], ids=lambda p: p.name)
def test_classes_the_docs_name_are_in_the_code(path: Path):
    names = _class_names(path)
    assert not sorted(n for n in names if not (_exported(n) or n in _defined_in_code()))


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_imports_of_python_blocks_work(path: Path):
    for b in python_blocks(path):
        tree = ast.parse(b.source, filename=b.where)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                try:
                    exec(compile(ast.Module([node], []), b.where, "exec"), {})
                except ImportError as e:
                    raise AssertionError(f"{b.where}: {ast.unparse(node)}: {e}") from e
