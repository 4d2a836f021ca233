"""The operator's numbers where Spark users look: each micro-batch's
:data:`~spark_glue.stats.METRICS` as an observed metric of the query's progress, so they are
in ``query.lastProgress["observedMetrics"]["dstl-ray:<job>"]``, in ``recentProgress`` and in
what every ``StreamingQueryListener`` registered after ours gets.

Spark builds a micro-batch's progress after the ``foreachBatch`` function returned (its
observed metrics are those of ``Dataset.observe`` nodes in the streaming plan, which the
operator's work is not part of), and posts it to the session's streaming listeners, on the
listener bus thread, shortly after. :class:`ProgressMetrics` is such a listener: the operator
records each batch's metrics under the query's id and the batch id (Spark sets the query id
as a local property of the thread running the batch), and when the batch's progress event
arrives the listener adds them to that progress's observed metrics, the very object
``lastProgress`` and ``recentProgress`` return. So they show up once the event has been
delivered (milliseconds after the batch, as for any listener), and not in progress built
outside the JVM (Spark Connect has none to add to).

The listener takes the JVM's events as they are (:class:`RawProgressListener`): PySpark's own
bridge turns every event into Python objects before a listener sees it, walking each of the
progress's maps over py4j, where every iterator's end is a Java exception that PySpark
inspects with a dozen more round trips. That cost 0.13 s and about 80 round trips per
progress on a busy driver, for every query of the session once ours was registered (the
native aggregation's too), beside the next batch on two cores. Ours reads the query's id
and the batch id, and writes into the Java progress.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from pyspark.sql.streaming import StreamingQueryListener

QUERY_ID = "sql.streaming.queryId"  # StreamExecution.QUERY_ID_KEY
PENDING = 64  # batches recorded whose progress has not arrived yet, at most


def metric_name(job_id: str) -> str:
    """The observed metric's name for job ``job_id``."""
    return f"dstl-ray:{job_id}"


def row_schema(metrics: dict[str, int | float]) -> dict[str, Any]:
    """The Spark schema (as JSON) of a row of ``metrics``, in order: an int that fits in 32
    bits is an integer, a larger one a long, a float a double (the Java types py4j gives
    the values, which the row's JSON must agree with)."""
    def kind(v: int | float) -> str:
        if isinstance(v, float):
            return "double"
        return "integer" if -(1 << 31) <= v < (1 << 31) else "long"

    return {"type": "struct", "fields": [
        {"name": k, "type": kind(v), "nullable": False, "metadata": {}}
        for k, v in metrics.items()]}


def _plain(v: Any) -> int | float:
    """``v`` as a Python int or float (a bool or numpy number as py4j cannot send it in
    the row's type)."""
    return float(v) if isinstance(v, float) or type(v).__name__.startswith("float") \
        else int(v)


def _owner(query: str, spark: Any) -> Any:
    """The session among ``spark``, the thread's active one and the default one whose
    query manager runs ``query`` (None: none of them)."""
    from pyspark.sql import SparkSession

    for s in (spark, SparkSession.getActiveSession(), SparkSession._instantiatedSession):
        if s is not None and s._jsparkSession.streams().get(query) is not None:
            return s
    return None


class RawProgressListener:
    """The Python side of the JVM's ``PythonStreamingQueryListener`` (py4j calls it on the
    listener bus thread) for :class:`ProgressMetrics`: a progress event is handed over as
    the Java progress, without PySpark's conversion (see the module); the other events are
    not used."""

    def __init__(self, metrics: ProgressMetrics) -> None:
        self.metrics = metrics

    def onQueryStarted(self, jevent: Any) -> None:  # noqa: N802 - the Java interface's names
        pass

    def onQueryProgress(self, jevent: Any) -> None:  # noqa: N802
        jprogress = jevent.progress()
        self.metrics.progressed(jprogress.id().toString(), jprogress.batchId(), jprogress)

    def onQueryIdle(self, jevent: Any) -> None:  # noqa: N802
        pass

    def onQueryTerminated(self, jevent: Any) -> None:  # noqa: N802
        pass

    class Java:
        implements = ["org.apache.spark.sql.streaming.PythonStreamingQueryListener"]


class ProgressMetrics(StreamingQueryListener):
    """Adds one operator's batch metrics to its queries' progress (see the module)."""

    def __init__(self, job_id: str) -> None:
        self.name = metric_name(job_id)
        self._lock = threading.Lock()
        self._pending: OrderedDict[tuple[str, int], dict[str, int | float]] = OrderedDict()
        # query id -> the session whose query manager runs it (our listener is registered
        # with each such session once: a query of another session, or of a session made
        # after a restart of Spark, gets its metrics too; a query restarted from its
        # checkpoint keeps its id, so an owner of another Spark context is looked up again)
        self._owners: OrderedDict[str, Any] = OrderedDict()
        self._sessions: list[Any] = []
        # (the py4j gateway, the JVM's wrapper of our RawProgressListener) (_jlistener)
        self._raw_listener: tuple[Any, Any] | None = None

    def record(self, spark: Any, batch_id: int, metrics: dict[str, int | float]) -> bool:
        """Keep ``metrics`` for the progress of ``batch_id`` of the query running this
        thread's micro-batch (False: no query runs it, as for ``transform`` called outside
        ``foreachBatch``). On a query's first batch, registers the listener with the
        session that started it (once per session): a session's listeners hear only of its
        own queries, and the micro-batch's DataFrame belongs to a clone of it."""
        query = spark.sparkContext.getLocalProperty(QUERY_ID)
        if not query:
            return False
        metrics = {k: _plain(v) for k, v in metrics.items() if v is not None}
        with self._lock:
            known = self._owners.get(query)
            if known is None or known.sparkContext is not spark.sparkContext:
                owner = _owner(query, spark)
                if owner is None:
                    return False
                if not any(s is owner for s in self._sessions):
                    owner.streams.addListener(self)
                    self._sessions.append(owner)
                self._owners[query] = owner
                while len(self._owners) > PENDING:
                    self._owners.popitem(last=False)
            self._pending[(query, batch_id)] = metrics
            while len(self._pending) > PENDING:
                self._pending.popitem(last=False)
        return True

    def close(self) -> None:
        with self._lock:
            sessions, self._sessions = self._sessions, []
            self._owners.clear()
            self._pending.clear()
        for spark in sessions:
            try:
                spark.streams.removeListener(self)
            except Exception:  # noqa: BLE001 - a stopped session has no listeners left
                pass
        # the JVM's wrapper holds our py4j object, which holds this listener
        self._raw_listener = None

    @property
    def _jlistener(self) -> Any:
        """What ``streams.addListener`` and ``removeListener`` hand the JVM (PySpark's
        hook): the JVM's wrapper of a :class:`RawProgressListener`, one per py4j gateway
        (the same object for both calls)."""
        from pyspark import SparkContext

        gateway = SparkContext._gateway
        made = self._raw_listener
        if made is None or made[0] is not gateway:
            made = self._raw_listener = (
                gateway, SparkContext._jvm.PythonStreamingQueryListenerWrapper(
                    RawProgressListener(self)))
        return made[1]

    def progressed(self, query: str, batch_id: int, jprogress: Any) -> None:
        """Batch ``batch_id`` of query ``query`` made progress ``jprogress`` (Java): its
        recorded metrics are added to its observed metrics."""
        with self._lock:
            metrics = self._pending.pop((query, batch_id), None)
            spark = self._owners.get(query)
        if metrics is None or jprogress is None or spark is None:
            return
        jvm = spark.sparkContext._jvm
        schema = jvm.org.apache.spark.sql.types.DataType.fromJson(
            json.dumps(row_schema(metrics)))
        values = spark.sparkContext._gateway.new_array(jvm.java.lang.Object, len(metrics))
        for i, v in enumerate(metrics.values()):
            values[i] = v
        row = jvm.org.apache.spark.sql.catalyst.expressions.GenericRowWithSchema(values,
                                                                                  schema)
        jprogress.observedMetrics().put(self.name, row)

    # StreamingQueryListener: a converted event, should PySpark deliver one

    def onQueryProgress(self, event: Any) -> None:  # noqa: N802 - Spark's name
        progress = event.progress
        self.progressed(str(progress.id), progress.batchId,
                        getattr(progress, "_jprogress", None))

    def onQueryStarted(self, event: Any) -> None:  # noqa: N802
        pass

    def onQueryIdle(self, event: Any) -> None:  # noqa: N802
        pass

    def onQueryTerminated(self, event: Any) -> None:  # noqa: N802
        pass
