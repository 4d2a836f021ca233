"""Where a :class:`~spark_glue.operator.KeyedStatefulOperator`'s outputs go once a batch's
checkpoint is complete (docs/architecture.md "Spark glue: outputs").

* :class:`BatchOutputs` shapes the subtasks' outputs for the sink: the per-key API's as one
  list, the vectorized API's as one pandas DataFrame, or, with an ``output_schema`` (either
  API), a Spark DataFrame of that schema.
* :class:`FileSink` writes them exactly once with Spark's own file sink: Structured
  Streaming's ``FileStreamSink``, the same class ``writeStream.format("parquet")`` uses.
  Each batch's files, then the batch's entry of the ``_spark_metadata`` log (compacted every
  ``spark.sql.streaming.fileSink.log.compactInterval`` batches, as Spark does), written
  before the operator returns to Spark and Spark writes its commit. A batch the log already
  has is skipped: a batch Spark replays after a driver restart (its checkpoint is
  recomputed, its outputs are the same) is not written twice. Files of a batch that failed
  before its log entry are in no entry. ``spark.read.parquet(path)`` reads the files the log
  names, so it shows every batch exactly once after task retries, executor kills, replays
  and driver restarts, with no user code idempotent by batch id.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from dstl_ray.errors import ConfigError

Sink = Callable[[int, Any], None]
FORMATS = ("parquet", "json", "csv", "orc")
APIS = ("rows", "pandas")


class FileSink:
    """Spark's file sink at ``path`` in ``format`` (parquet, json, csv or orc), with the
    writer's ``options`` (``compression``, csv's ``header``...) and ``partition_by``
    columns: pass it as an operator's ``sink`` (with ``output_schema``)."""

    def __init__(self, path: str, format: str = "parquet", *,
                 options: Mapping[str, str] | None = None,
                 partition_by: Iterable[str] = ()) -> None:
        if not isinstance(path, str) or not path:
            raise ConfigError(f"FileSink path must be a directory path or URL, got {path!r}")
        if format not in FORMATS:
            raise ConfigError(f"FileSink format must be one of {', '.join(FORMATS)}, got "
                              f"{format!r}")
        self.path, self.format = path, format
        self.options = {str(k): str(v) for k, v in (options or {}).items()}
        self.partition_by = tuple(partition_by)
        self._sinks: dict[int, Any] = {}  # per JVM session (its identity): FileStreamSink

    def __call__(self, batch_id: int, outputs: Any) -> None:
        """Write batch ``batch_id``'s outputs (a Spark DataFrame), unless the log has it."""
        if not hasattr(outputs, "_jdf"):
            raise ConfigError(f"FileSink writes Spark DataFrames, got "
                              f"{type(outputs).__name__}: give the operator an output_schema")
        self._sink(outputs.sparkSession).addBatch(batch_id, outputs._jdf)

    def committed(self, spark: Any) -> int | None:
        """The latest batch id in the ``_spark_metadata`` log (None: none yet), read as
        Spark's file source reads it."""
        jvm = spark._jvm
        streaming = jvm.org.apache.spark.sql.execution.streaming
        log = streaming.FileStreamSinkLog(
            streaming.FileStreamSinkLog.VERSION(), spark._jsparkSession,
            self.path.rstrip("/") + "/_spark_metadata", jvm.scala.Option.empty())
        latest = log.getLatestBatchId()
        return int(latest.get()) if latest.isDefined() else None

    def _sink(self, spark: Any) -> Any:
        jsession = spark._jsparkSession
        # one per JVM session (foreachBatch hands every batch a new Python wrapper of it)
        key = spark._jvm.java.lang.System.identityHashCode(jsession)
        sink = self._sinks.get(key)
        if sink is None:
            jvm = spark._jvm
            file_format = self._file_format(spark, jsession.sessionState().conf())
            utils = jvm.org.apache.spark.api.python.PythonUtils
            sink = jvm.org.apache.spark.sql.execution.streaming.FileStreamSink(
                jsession, self.path, file_format, utils.toSeq(list(self.partition_by)),
                utils.toScalaMap(self.options))
            self._sinks[key] = sink
        return sink

    def _file_format(self, spark: Any, conf: Any) -> Any:
        """The format's ``FileFormat``, as ``writeStream.format(...)`` finds it: the class
        registered for the name, or, for a file source of Spark's V2 API (parquet, json,
        csv), its fallback ``FileFormat`` (Spark's ``DataSource.providingClass``)."""
        from py4j.protocol import Py4JError

        jvm, gateway = spark._jvm, spark.sparkContext._gateway
        no_types = gateway.new_array(jvm.java.lang.Class, 0)
        no_args = gateway.new_array(jvm.java.lang.Object, 0)
        cls = jvm.org.apache.spark.sql.execution.datasources.DataSource.lookupDataSource(
            self.format, conf)
        instance = cls.getDeclaredConstructor(no_types).newInstance(no_args)
        try:
            fallback = instance.fallbackFileFormat()  # a FileDataSourceV2
        except Py4JError:
            return instance
        return fallback.getDeclaredConstructor(no_types).newInstance(no_args)

    def __repr__(self) -> str:
        return f"FileSink({self.path!r}, {self.format!r})"


class BatchOutputs:
    """The outputs of one operator's batches, shaped for its ``sink`` and handed to it:
    those of the update function and of ``on_timer`` together (``of="all"``), or, when
    timers have an output schema of their own, the update's (``"update"``) and the timers'
    (``"timers"``) apart, each with its own schema and sink (:class:`Outputs`)."""

    def __init__(self, api: str, output_schema: Any, sink: Sink | None,
                 of: str = "all") -> None:
        # where a subtask's result (spark_glue.worker) has these outputs
        self._rows, self._ipc = (("timer_outputs", "timer_ipc") if of == "timers"
                                 else ("outputs", "output_ipc"))
        if api not in APIS:
            raise ConfigError(f"api must be one of {', '.join(APIS)}, got {api!r}")
        if sink is not None and not callable(sink):
            raise ConfigError(f"sink must be callable as sink(batch_id, outputs), got {sink!r}")
        if isinstance(sink, FileSink) and output_schema is None:
            raise ConfigError(f"{sink!r} writes Spark DataFrames: give the operator an "
                              f"output_schema (a DDL string such as 'user STRING, n LONG' or "
                              f"a StructType)")
        self.api, self.schema, self.sink = api, output_schema, sink

    def deliver(self, batch_id: int, outputs: Any) -> Any:
        """Hand the batch's (shaped) outputs to the sink, if any; returns them."""
        if self.sink is not None:
            self.sink(batch_id, outputs)
        return outputs

    def delivered(self, spark: Any, batch_id: int) -> bool:
        """Whether the sink already holds batch ``batch_id`` for good (a :class:`FileSink`
        whose log has it): a replay of it need not be recomputed, and must not be (its
        recomputation could differ from the outputs on file: state TTL runs on the wall
        clock)."""
        committed = getattr(self.sink, "committed", None)
        if committed is None:
            return False
        done = committed(spark)
        return done is not None and done >= batch_id

    def shape(self, results: list[dict[str, Any]], spark: Any) -> Any:
        """The per-key API's outputs as one list, the vectorized API's as one pandas
        DataFrame (None: no output); with ``output_schema``, a Spark DataFrame of it."""
        if self.api == "rows":
            rows = [o for r in results for o in r[self._rows]]
            return rows if self.schema is None else spark.createDataFrame(rows, self.schema)
        from .vectorized import outputs_frame, outputs_table

        table = outputs_table(p for r in results for p in r[self._ipc])
        if self.schema is None:
            return None if table is None else table.to_pandas()
        empty = spark.createDataFrame([], self.schema)  # the schema, parsed
        if table is None:
            return empty
        from pyspark.sql.pandas.types import to_arrow_schema

        frame = outputs_frame(table, to_arrow_schema(empty.schema))
        return spark.createDataFrame(frame, empty.schema)


class Outputs:
    """An operator's outputs: the update function's and ``on_timer``'s together, shaped by
    ``output_schema`` for ``sink``; or, with a ``timer_output_schema``, the timers' apart,
    shaped by it for ``timer_sink`` (None: kept in ``last_timers`` only). Either sink may be
    a :class:`FileSink`; a replayed batch counts as delivered only when every sink holds
    it."""

    def __init__(self, api: str, output_schema: Any, sink: Sink | None,
                 timer_output_schema: Any = None, timer_sink: Sink | None = None,
                 has_timers: bool = False) -> None:
        if timer_sink is not None and timer_output_schema is None:
            raise ConfigError("timer_sink needs a timer_output_schema (without one, the "
                              "timers' outputs go to sink with the update's)")
        if timer_output_schema is not None and not has_timers:
            raise ConfigError("timer_output_schema needs on_timer (the operator has no "
                              "timers' outputs to shape)")
        if isinstance(sink, FileSink) and isinstance(timer_sink, FileSink) and \
                sink.path.rstrip("/") == timer_sink.path.rstrip("/"):
            raise ConfigError(f"sink and timer_sink write to one directory ({sink.path}): "
                              f"its _spark_metadata log holds one entry per batch, so the "
                              f"timers' files would be skipped as already written")
        apart = timer_output_schema is not None
        self.update = BatchOutputs(api, output_schema, sink, "update" if apart else "all")
        self.timers = BatchOutputs(api, timer_output_schema, timer_sink, "timers") \
            if apart else None
        self.last: Any = None  # the last batch's, as the sinks got them
        self.last_timers: Any = None

    @property
    def apart(self) -> bool:
        """Whether the timers' outputs go apart from the update's."""
        return self.timers is not None

    def shape(self, results: list[dict[str, Any]], spark: Any) -> tuple[Any, Any]:
        """(the update's outputs, the timers' or None), each shaped for its sink."""
        return (self.update.shape(results, spark),
                self.timers.shape(results, spark) if self.timers else None)

    def deliver(self, batch_id: int, shaped: tuple[Any, Any]) -> Any:
        """Hand a batch's shaped outputs to the sinks, the update's first; returns the
        update's."""
        self.last = self.update.deliver(batch_id, shaped[0])
        if self.timers is not None:
            self.last_timers = self.timers.deliver(batch_id, shaped[1])
        return self.last

    def delivered(self, spark: Any, batch_id: int) -> bool:
        """Whether every sink holds batch ``batch_id`` for good (see
        :meth:`BatchOutputs.delivered`; timers' outputs with no sink of their own are held
        nowhere, so they do not ask for a recomputation)."""
        return self.update.delivered(spark, batch_id) and (
            self.timers is None or self.timers.sink is None
            or self.timers.delivered(spark, batch_id))
