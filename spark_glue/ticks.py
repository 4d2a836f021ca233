"""Timers on an idle stream: ticks that give the query a micro-batch every trigger.

Structured Streaming runs ``foreachBatch`` only for a micro-batch with new data (its no-data
batches are for stateful operators it plans itself), so a processing-time timer of a
:class:`~spark_glue.KeyedStatefulOperator` would wait for the next data to fire. Spark's
Flink-like answer is a source that always has data: :func:`with_ticks` unions the stream
with the ``rate-micro-batch`` source (one row per micro-batch) marked by
:data:`TICK_COLUMN`. Every trigger then runs a micro-batch; the operator drops the tick rows
(:func:`drop_ticks`) before routing, and an empty micro-batch still runs every subtask, which
fires its due timers (``spark_glue.timers``). The ticks are part of the query like any
source: its checkpoint records their offsets, and a replayed batch replays its tick.

Use it with a trigger interval (``.trigger(processingTime="1 second")``): the interval is
then how late a timer on an idle stream may fire. With Spark's default trigger the query
would run micro-batch after micro-batch at once, and ``processAllAvailable`` never returns
(there is always a next tick).
"""

from __future__ import annotations

from typing import Any

TICK_COLUMN = "__dstl_tick"


def with_ticks(stream: Any) -> Any:
    """``stream`` (a streaming DataFrame) with one tick row in every micro-batch: its own
    columns null, :data:`TICK_COLUMN` true (false on ``stream``'s rows)."""
    from pyspark.sql import functions as F

    ticks = (stream.sparkSession.readStream.format("rate-micro-batch")
             .option("rowsPerBatch", 1).load().select(F.lit(True).alias(TICK_COLUMN)))
    return (stream.withColumn(TICK_COLUMN, F.lit(False))
            .unionByName(ticks, allowMissingColumns=True))


def drop_ticks(df: Any) -> Any:
    """``df`` without the tick rows and column (``df`` itself when it has none)."""
    if TICK_COLUMN not in df.columns:
        return df
    from pyspark.sql import functions as F

    return df.filter(~F.col(TICK_COLUMN)).drop(TICK_COLUMN)
