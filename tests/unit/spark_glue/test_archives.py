"""Spark's archives on a Python worker's path keep their index across PySpark's per-task
``importlib.invalidate_caches()`` (spark_glue.archives)."""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import zipfile
import zipimport
from pathlib import Path

import pytest

from spark_glue.archives import (
    FixedArchiveImporter,
    is_spark_archive,
    keep_spark_archive_indexes,
)


def _archive(path: Path, module: str) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{module}.py", "VALUE = 42\n")
        z.writestr("org/apache/Some.class", b"\xca\xfe\xba\xbe")
    return path


@pytest.fixture
def on_path(tmp_path, monkeypatch):
    """Two archives on sys.path, each with its importer cached as a worker's would be: a
    Spark jar and a user's --py-files zip."""
    jar = _archive(tmp_path / "spark-core_2.12-3.5.7.jar", "in_jar_mod")
    user = _archive(tmp_path / "deps.zip", "in_zip_mod")
    monkeypatch.setattr(sys, "path", [str(jar), str(user), *sys.path])
    cache = dict(sys.path_importer_cache)
    for entry in (str(jar), str(jar / "org"), str(user)):
        importlib.machinery.PathFinder.find_spec("no_such_module_here", [entry])
        assert type(sys.path_importer_cache[entry]) is zipimport.zipimporter
    yield jar, user
    for m in ("in_jar_mod", "in_zip_mod"):
        sys.modules.pop(m, None)
    sys.path_importer_cache.clear()
    sys.path_importer_cache.update(cache)


def test_spark_archives_by_name():
    assert is_spark_archive("/opt/spark/jars/spark-core_2.12-3.5.7.jar")
    assert is_spark_archive("/opt/spark/python/lib/pyspark.zip")
    assert is_spark_archive("/opt/spark/python/lib/py4j-0.10.9.7-src.zip")
    assert not is_spark_archive("/work/deps.zip")
    assert not is_spark_archive("/work/py4j-helpers.txt")


def test_the_jar_keeps_its_index_and_a_user_zip_does_not(on_path, monkeypatch):
    jar, user = on_path
    assert keep_spark_archive_indexes() == 2  # the jar, and its org/ package
    assert type(sys.path_importer_cache[str(jar)]) is FixedArchiveImporter
    assert type(sys.path_importer_cache[str(jar / "org")]) is FixedArchiveImporter
    assert type(sys.path_importer_cache[str(user)]) is zipimport.zipimporter
    assert keep_spark_archive_indexes() == 0  # once is enough

    reads: list[str] = []
    real = zipimport._read_directory

    def counted(archive):
        reads.append(archive)
        return real(archive)

    monkeypatch.setattr(zipimport, "_read_directory", counted)
    importlib.invalidate_caches()  # what PySpark's worker does before every task
    assert str(jar) not in reads
    if sys.version_info < (3, 12):  # (3.11's zipimporter re-reads at once; 3.12's lazily)
        assert str(user) in reads


def test_imports_from_a_kept_archive_still_work(on_path):
    keep_spark_archive_indexes()
    importlib.invalidate_caches()
    mod = importlib.import_module("in_jar_mod")
    assert mod.VALUE == 42
    assert isinstance(mod.__loader__, FixedArchiveImporter)


def test_an_archive_gone_since_is_left_as_it_was(on_path):
    jar, _ = on_path
    jar.unlink()
    zipimport._zip_directory_cache.pop(str(jar), None)
    assert keep_spark_archive_indexes() == 0
    assert type(sys.path_importer_cache[str(jar)]) is zipimport.zipimporter
