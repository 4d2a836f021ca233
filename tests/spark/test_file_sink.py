"""Exactly-once file output, Spark's way (issue 30 item 1): the operator's outputs through
Spark's own file sink (``spark_glue.FileSink``: files, then the batch's ``_spark_metadata``
entry, before Spark's commit) read back with ``spark.read`` equal the offline outputs, every
batch once, through a driver that dies after the sink wrote a batch, one that dies after the
checkpoint but before the sink, and an executor killed mid-stream; with no sink code
idempotent by batch id. The driver restarts between checkpoint completion and Spark's
commit also show the state exactly once: the replayed batch is recomputed from the
checkpoint before it. Also ``op.transform`` for a foreachBatch of one's own."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
from pyspark import cloudpickle

from spark_glue import FileSink, KeyedStatefulOperator
from spark_glue.session import kill_executor

from .test_stateful_operator import (
    SCHEMA,
    count_and_sum,
    expected,
    run_stream,
    write_events,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])

OUT = "user STRING, count LONG, sum LONG"


class _DriverDies(Exception):
    pass


def offline_outputs(src: Path) -> Counter:
    """Every batch's outputs, recomputed: one file per batch, in order; per user in it, the
    user's count and sum after the batch."""
    count: Counter = Counter()
    total: Counter = Counter()
    want: Counter = Counter()
    for f in sorted(src.glob("f*.json")):
        rows = [json.loads(line) for line in f.read_text().splitlines() if line]
        for r in rows:
            count[r["user"]] += 1
            total[r["user"]] += r["amount"]
        want.update((u, count[u], total[u]) for u in {r["user"] for r in rows})
    return want


def test_file_sink_output_is_exactly_once_through_driver_restarts_and_an_executor_kill(
        spark, tree_factory, namespace, tmp_path):
    tree_factory(persist_delay_s=0.02)
    src, chk, out = tmp_path / "in", tmp_path / "chk", tmp_path / "out"
    write_events(src, 5, 120, seed=8)
    died: set[str] = set()

    def operator(die: str | None):
        parquet, as_json = FileSink(str(out / "parquet")), FileSink(str(out / "json"), "json")

        def sink(batch_id, df):
            if die == "before" and batch_id == 3 and die not in died:
                died.add(die)  # the checkpoint is complete, the sink never ran
                raise _DriverDies("driver dies before the sink")
            parquet(batch_id, df)
            as_json(batch_id, df)
            if die == "after" and batch_id == 1 and die not in died:
                died.add(die)  # the sink wrote the batch; Spark will not commit it
                raise _DriverDies("driver dies after the sink")

        return KeyedStatefulOperator("files", key="user", update=count_and_sum,
                                     namespace=namespace, parallelism=3, max_parallelism=32,
                                     materialization_interval=0.0, output_schema=OUT,
                                     sink=sink)

    for die in ("after", "before"):
        op = operator(die)
        with pytest.raises(Exception, match="driver dies"):
            run_stream(spark, op, src, chk)
        op.coordinator.shutdown()  # the driver is gone
    assert died == {"after", "before"}
    op = operator(None)
    assert kill_executor(), "no RayDP executor actor found"
    run_stream(spark, op, src, chk)
    assert op.history[0].batch_id == 3 and op.history[0].replayed
    assert op.history[0].restores == 3  # a new driver's epoch: every subtask restored
    assert [s.batch_id for s in op.history] == [3, 4]
    assert op.state() == expected(spark, src)
    want = offline_outputs(src)
    for fmt in ("parquet", "json"):
        got = Counter(tuple(r) for r in getattr(spark.read, fmt)(str(out / fmt))
                      .select("user", "count", "sum").collect())
        assert got == want, (fmt, got - want, want - got)
    logged = sorted(p.name for p in (out / "parquet" / "_spark_metadata").iterdir()
                    if not p.name.startswith("."))
    assert logged == [str(b) for b in range(5)], logged
    # the replayed batch 1 wrote no second set of files: one file set per batch in the log
    assert FileSink(str(out / "parquet")).committed(spark) == 4
    op.close()


def test_transform_returns_the_outputs_as_a_dataframe(spark, tree_factory, namespace):
    tree_factory(persist_delay_s=0.02)
    op = KeyedStatefulOperator("chain", key="user", update=count_and_sum, namespace=namespace,
                               parallelism=2, max_parallelism=32, output_schema=OUT)
    df = spark.createDataFrame([("a", 1), ("b", 2), ("a", 3)], SCHEMA)
    got = op.transform(df, 0)
    assert sorted(tuple(r) for r in got.collect()) == [("a", 2, 4), ("b", 1, 2)]
    assert got.schema.simpleString() == "struct<user:string,count:bigint,sum:bigint>"
    op.close()
