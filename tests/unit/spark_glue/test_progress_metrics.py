"""A batch's metrics (spark_glue.stats) and the progress listener's bookkeeping
(spark_glue.progress) without Spark; tests/spark/test_progress.py sees them in
``query.lastProgress``."""

from __future__ import annotations

from types import SimpleNamespace

from spark_glue.progress import (
    PENDING,
    ProgressMetrics,
    RawProgressListener,
    metric_name,
    row_schema,
)
from spark_glue.stats import METRICS, BatchStats


def _result(index: int, rows: int, **metrics: int) -> dict:
    return {"index": index, "rows": rows, "keys": rows // 2, "snapshot_s": 0.01 * (index + 1),
            "restore_s": 0.5 if index == 0 else 0.0, "apply_s": 0.1, "attempt": 0,
            "stage_attempt": 0, "node": "n", "chosen_by": "", "raylet_pid": "1",
            "executor": "1", "metrics": metrics}


def test_a_batch_s_metrics_sum_its_subtasks_and_name_every_metric():
    results = [_result(0, 10, state_rows=7, state_bytes=100, timers_registered=3,
                       timers_fired=2, ttl_evicted=1),
               _result(1, 6, state_rows=5, state_bytes=50, timers_registered=0,
                       timers_fired=1, ttl_evicted=0)]
    stats = BatchStats.of(4, results, False, (0.0, 1.0, 1.25, 1.5), files_written=3)
    m = stats.metrics()
    assert tuple(m) == METRICS
    assert m == {"rows": 16, "keys": 8, "state_rows": 12, "state_bytes": 150,
                 "timers_registered": 3, "timers_fired": 3, "ttl_evicted": 1,
                 "checkpoint_ms": 270.0, "files_written": 3, "restores": 1}
    assert stats.batch_s == 1.5 and stats.commit_s == 0.25
    assert BatchStats.done(5).metrics()["rows"] == 0  # a batch that did not run


def test_the_row_schema_gives_each_value_the_java_type_py4j_sends():
    schema = row_schema({"small": 5, "big": 1 << 40, "negative": -(1 << 31), "ms": 2.5})
    assert [(f["name"], f["type"]) for f in schema["fields"]] == [
        ("small", "integer"), ("big", "long"), ("negative", "integer"), ("ms", "double")]


class _Session:
    """What record() touches of a session: the thread's query id, the query manager."""

    def __init__(self, query: str | None) -> None:
        self.sparkContext = SimpleNamespace(getLocalProperty=lambda key: query)
        self.listeners: list = []
        self.streams = SimpleNamespace(addListener=self.listeners.append,
                                       removeListener=self.listeners.remove)
        self._jsparkSession = SimpleNamespace(streams=lambda: SimpleNamespace(
            get=lambda q: object() if q == query else None))


def test_batches_are_kept_for_their_query_s_progress_and_the_listener_registers_once():
    spark = _Session("q-1")
    pm = ProgressMetrics("job")
    assert pm.name == metric_name("job") == "dstl-ray:job"
    for b in range(PENDING + 5):
        assert pm.record(spark, b, {"rows": b})
    # values as py4j sends them in the row's types: a bool or numpy number made plain
    import numpy as np
    assert pm.record(spark, 0, {"ok": True, "n": np.int64(3), "ms": np.float32(1.5),
                                "none": None})
    assert pm._pending[("q-1", 0)] == {"ok": 1, "n": 3, "ms": 1.5}
    assert [type(v) for v in pm._pending[("q-1", 0)].values()] == [int, int, float]
    assert spark.listeners == [pm]  # once, with the session that runs the query
    assert len(pm._pending) == PENDING and ("q-1", 4) not in pm._pending
    assert ("q-1", 0) in pm._pending  # recorded again last
    pm.close()
    assert spark.listeners == [] and not pm._pending


def test_a_batch_outside_a_streaming_query_is_not_recorded():
    spark = _Session(None)  # transform() called on a batch DataFrame of one's own
    pm = ProgressMetrics("job")
    assert not pm.record(spark, 0, {"rows": 1}) and spark.listeners == []


def test_a_query_of_another_session_gets_the_listener_too():
    """One operator fed by queries of two sessions (or of a session made after Spark was
    restarted): each session gets the listener once, and each query's progress is
    answered through its own session."""
    first, second = _Session("q-1"), _Session("q-2")
    pm = ProgressMetrics("job")
    assert pm.record(first, 0, {"rows": 1}) and pm.record(first, 1, {"rows": 2})
    assert pm.record(second, 0, {"rows": 3})
    assert first.listeners == [pm] and second.listeners == [pm]
    assert pm._owners == {"q-1": first, "q-2": second}
    pm.close()
    assert first.listeners == [] == second.listeners


def test_the_raw_listener_hands_over_the_java_progress_and_ignores_the_other_events():
    """The JVM's events reach the metrics as the Java progress, its query id as a string
    (PySpark's conversion of the whole event is skipped)."""
    seen = []
    raw = RawProgressListener(SimpleNamespace(progressed=lambda *a: seen.append(a)))
    jprogress = SimpleNamespace(id=lambda: SimpleNamespace(toString=lambda: "q-1"),
                                batchId=lambda: 7)
    raw.onQueryProgress(SimpleNamespace(progress=lambda: jprogress))
    assert seen == [("q-1", 7, jprogress)]
    for other in (raw.onQueryStarted, raw.onQueryIdle, raw.onQueryTerminated):
        other(object())  # no conversion, nothing read
    assert len(seen) == 1
    assert RawProgressListener.Java.implements == [
        "org.apache.spark.sql.streaming.PythonStreamingQueryListener"]


def test_a_progress_without_recorded_metrics_is_left_alone():
    pm = ProgressMetrics("job")
    pm.progressed("q-1", 0, object())  # no batch recorded: nothing is written, no JVM
    spark = _Session("q-1")
    assert pm.record(spark, 3, {"rows": 1})
    pm.progressed("q-1", 2, object())  # another batch's progress: this one's stays
    assert ("q-1", 3) in pm._pending


def test_a_query_restarted_on_a_new_spark_context_is_looked_up_again():
    """A query restarted from its checkpoint keeps its id: after Spark was restarted, the
    stopped session is not its owner any more, and the new one gets the listener."""
    before, after = _Session("q-1"), _Session("q-1")  # each a Spark context of its own
    pm = ProgressMetrics("job")
    assert pm.record(before, 0, {"rows": 1})
    assert pm.record(after, 1, {"rows": 2})
    assert before.listeners == [pm] and after.listeners == [pm]
    assert pm._owners == {"q-1": after}
    assert pm.record(after, 2, {"rows": 3}) and after.listeners == [pm]  # once
    pm.close()


def test_the_jvm_gets_one_wrapper_per_gateway_and_close_lets_it_go(monkeypatch):
    from pyspark import SparkContext

    made = []
    jvm = SimpleNamespace(PythonStreamingQueryListenerWrapper=lambda raw: made.append(raw)
                          or SimpleNamespace(raw=raw))
    monkeypatch.setattr(SparkContext, "_jvm", jvm)
    monkeypatch.setattr(SparkContext, "_gateway", object())
    pm = ProgressMetrics("job")
    first = pm._jlistener
    assert pm._jlistener is first  # what addListener and removeListener both hand over
    assert isinstance(first.raw, RawProgressListener) and first.raw.metrics is pm
    monkeypatch.setattr(SparkContext, "_gateway", object())  # another JVM's gateway
    assert pm._jlistener is not first and len(made) == 2
    pm.close()
    assert pm._raw_listener is None
