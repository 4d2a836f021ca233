"""On a RayDP executor, Spark's jar is on the Python worker's import path, and the operator's
code keeps its index across PySpark's per-task cache invalidation (spark_glue.archives)."""

from __future__ import annotations


def test_spark_jar_on_a_worker_path_keeps_its_index(spark):
    def task(index, rows):
        import sys
        import zipimport

        from spark_glue.archives import FixedArchiveImporter, keep_spark_archive_indexes

        keep_spark_archive_indexes()
        jars = {p: type(f).__name__ for p, f in sys.path_importer_cache.items()
                if isinstance(f, zipimport.zipimporter) and f.archive.endswith(".jar")}
        yield (jars, FixedArchiveImporter.__name__)

    results = spark.sparkContext.parallelize(range(3), 3).mapPartitionsWithIndex(task).collect()
    assert len(results) == 3
    for jars, fixed in results:
        assert jars, "Spark's jar is not on the worker's import path: nothing to keep"
        assert set(jars.values()) == {fixed}, jars
