"""Spark's own archives on a Spark Python worker's import path, indexed once per worker.

Spark puts its archives on every Python worker's ``PYTHONPATH``: the ``spark-core`` jar (its
``PythonUtils.sparkPythonPath`` adds the jar it was loaded from) and, in a Spark
distribution, ``pyspark.zip`` and ``py4j-*.zip``. Python imports from such a path entry
through a ``zipimport.zipimporter``, which indexes the archive's central directory.

Before every task, PySpark's worker calls ``importlib.invalidate_caches()``. On Python 3.11 a
``zipimporter`` answers that by reading its archive's whole directory again (3.12 made it
lazy), and Spark's jar of 5,000+ entries is on the path three times (the jar and the
``org/`` and ``google/`` packages in it): 0.06 s each with the machine to itself, 0.15-0.55
s per task measured on a loaded 2-core machine, in EVERY Python task, map side and reduce
side alike, before the task's first line runs. These archives do not change while a worker
lives, so :func:`keep_spark_archive_indexes` swaps their importers for ones that keep the
index; imports from them work as before. It is called where the operator's code starts on
an executor (the map side's splitter, the reduce side's ``run_partition``): from a worker's
second task on, PySpark's per-task invalidation costs microseconds. (A user archive
shipped with ``--py-files`` is left alone: those may be replaced between jobs.)
"""

from __future__ import annotations

import os
import sys
import zipimport


class FixedArchiveImporter(zipimport.zipimporter):
    """A ``zipimporter`` of an archive that does not change while the process lives: a cache
    invalidation keeps the archive's index instead of reading it again."""

    def invalidate_caches(self) -> None:
        return None


def is_spark_archive(archive: str) -> bool:
    """Whether ``archive`` is one Spark itself puts on a Python worker's path: a jar, or a
    Spark distribution's ``pyspark.zip`` / ``py4j-*.zip``."""
    name = os.path.basename(archive)
    return (name.endswith(".jar") or name == "pyspark.zip"
            or (name.startswith("py4j-") and name.endswith(".zip")))


def keep_spark_archive_indexes() -> int:
    """Swap the cached importers of Spark's archives (:func:`is_spark_archive`) in
    ``sys.path_importer_cache`` for :class:`FixedArchiveImporter` s of the same path;
    returns how many were swapped (0 once done: safe to call before every task)."""
    swapped = 0
    for path, finder in list(sys.path_importer_cache.items()):
        if (type(finder) is zipimport.zipimporter  # (not a subclass: ours, or someone's)
                and is_spark_archive(finder.archive)):
            try:
                sys.path_importer_cache[path] = FixedArchiveImporter(path)
            except zipimport.ZipImportError:  # gone or unreadable: leave it as it was
                continue
            swapped += 1
    return swapped
