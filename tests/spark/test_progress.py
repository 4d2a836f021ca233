"""The operator's numbers where Spark users look (issue 30 item 6): each micro-batch's rows,
keys, state entries and bytes, timers registered and fired, checkpoint ms, files written and
restores are an observed metric of the query's progress, in ``query.lastProgress`` and
``recentProgress`` (spark_glue.progress), equal to what the operator recorded. The same
stream's timers have an output schema of their own (issue 30 item 8): their outputs go to a
file sink of their own, the update's to another."""

from __future__ import annotations

import json
import sys
import time

from pyspark import cloudpickle

from spark_glue import FileSink, KeyedStatefulOperator
from spark_glue.progress import metric_name

from .test_stateful_operator import SCHEMA, write_events

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def count_with_a_timer(key, rows, state):
    c = state.value("count")
    c.set(c.get(0) + len(rows))
    state.timers.register_processing_time(state.timers.now)  # due in this very batch
    return [(key, c.get())]


def fired_at(key, timer, state):
    return [(key, timer.time_ms, timer.domain)]


def test_metrics_in_the_query_s_progress_and_timers_outputs_to_a_sink_of_their_own(
        spark, tree_factory, namespace, tmp_path, monkeypatch):
    from pyspark.sql.streaming import listener

    converted = []  # PySpark's conversion of an event into Python objects: ours skips it
    real = listener.QueryProgressEvent.fromJObject
    monkeypatch.setattr(listener.QueryProgressEvent, "fromJObject",
                        staticmethod(lambda j: converted.append(j) or real(j)))
    tree_factory(persist_delay_s=0.02)
    src = tmp_path / "in"
    write_events(src, 2, 80, seed=12)
    out = tmp_path / "out"
    op = KeyedStatefulOperator("progress", key="user", update=count_with_a_timer,
                               on_timer=fired_at, namespace=namespace, parallelism=2,
                               max_parallelism=32, materialization_interval=0.0,
                               output_schema="user STRING, count LONG",
                               sink=FileSink(str(out / "counts")),
                               timer_output_schema="user STRING, at LONG, domain STRING",
                               timer_sink=FileSink(str(out / "timers")))
    q = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(str(src))
         .writeStream.foreachBatch(op).option("checkpointLocation", str(tmp_path / "chk"))
         .start())
    name = metric_name("progress")
    listeners = spark._jsparkSession.streams().listListeners
    registered = len(listeners())
    try:
        q.processAllAvailable()
        deadline = time.time() + 30  # the listener hears of a batch just after it
        while time.time() < deadline and not all(
                name in p.get("observedMetrics", {}) for p in q.recentProgress
                if p["numInputRows"] > 0):
            time.sleep(0.2)
        progress = {p["batchId"]: p for p in q.recentProgress if p["numInputRows"] > 0}
        last = q.lastProgress
        with_ours = len(listeners())
    finally:
        q.stop()
        op.close()
    assert with_ours == registered + 1 and len(listeners()) == registered  # removed again
    assert sorted(progress) == [0, 1], sorted(progress)
    assert converted == []  # the listener read the Java progress (spark_glue.progress)
    assert last["batchId"] == 1 and last["observedMetrics"][name] == op.history[-1].metrics()
    # (which file each batch read is Spark's choice: compared as multisets)
    users = [{json.loads(line)["user"] for line in f.read_text().splitlines()}
             for f in sorted(src.glob("f*.json"))]
    shown = [progress[s.batch_id].get("observedMetrics", {}).get(name) for s in op.history]
    assert shown == [s.metrics() for s in op.history], shown
    assert sorted(m["keys"] for m in shown) == sorted(len(u) for u in users)
    for m in shown:
        assert m["rows"] == 80
        # one timer per key, fired in the batch: the fired ones left state, the counts stay
        assert m["timers_registered"] == m["timers_fired"] == m["keys"]
        assert m["state_bytes"] > 0 and m["checkpoint_ms"] > 0
        assert m["files_written"] >= 1  # each checkpoint names a changelog file of its own
    assert [m["state_rows"] for m in shown] == sorted(m["state_rows"] for m in shown)
    assert shown[-1]["state_rows"] == len(set().union(*users))  # a count per user ever seen
    assert shown[1]["restores"] == 0  # the subtasks kept their state
    # the update's outputs and the timers' went to their own sinks, each in its own schema
    counts = spark.read.parquet(str(out / "counts"))
    timers = spark.read.parquet(str(out / "timers"))
    assert counts.columns == ["user", "count"] and timers.columns == ["user", "at", "domain"]
    fired = sum(s.metrics()["timers_fired"] for s in op.history)
    assert counts.count() == timers.count() == fired  # one output and one timer per key
    assert {r["domain"] for r in timers.collect()} == {"processing"}
