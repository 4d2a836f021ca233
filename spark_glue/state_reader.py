"""The state of a retained checkpoint or savepoint as a Spark DataFrame (Spark's state data
source, Flink's State Processor API), read in parallel by key group: one Spark task per
key-group range restores that range of the operator's snapshots and yields its entries
(:mod:`dstl_ray.checkpoint.reader`); and the change feed between two checkpoints, from the
changelog (:mod:`dstl_ray.checkpoint.change_feed`). The job need not run; nothing is written.

State columns: ``key, value`` for a value state; ``key, value`` (an array) for a list state;
``key, user_key, value`` for a map state, one row per entry. Change feed columns: ``key, op,
user_key, value, log, order, sqn`` (a key's changes sort by ``order, sqn``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pyspark.sql.types import StringType, StructField, StructType, _parse_datatype_string

from dstl_ray.checkpoint.change_feed import check_window
from dstl_ray.checkpoint.change_feed import read_change_feed as _feed
from dstl_ray.checkpoint.reader import read_range, state_info, the_operator
from dstl_ray.checkpoint.recovery import load_checkpoint
from dstl_ray.errors import ConfigError, StateError
from dstl_ray.state.records import StateKind

from .sources import checkpoint_url

_FALLBACK_SCHEMA = {StateKind.VALUE: "key string, value string",
                    StateKind.LIST: "key string, value array<string>",
                    StateKind.MAP: "key string, user_key string, value string"}


def _rows(url: str, op: str, state: str, kind: StateKind, parts: int, index: int,
          now_ms: int | None) -> Iterator[tuple[Any, ...]]:
    for key, value in read_range(url, op, state, parts, index, now_ms):
        if kind is StateKind.MAP:
            for user_key, v in value.items():
                yield key, user_key, v
        else:
            yield key, value


def read_state(spark: Any, source: Any, state: str, *, operator_id: str | None = None,
               parallelism: int | None = None, schema: Any = None,
               namespace: str | None = None, now_ms: int | None = None) -> Any:
    """A DataFrame of ``state`` in the checkpoint or savepoint ``source`` (see
    :func:`spark_glue.sources.checkpoint_url`), read by ``parallelism`` Spark tasks
    (default Spark's default parallelism, at most the checkpoint's max parallelism), one
    key-group range each.

    ``schema``: the DataFrame's schema (a DDL string or StructType). Default: a typed
    state's ``value`` column has its declared type (from the checkpoint's metadata), other
    columns are inferred from the first rows (give a schema when values have mixed types);
    an empty untyped state gets strings.
    Expired entries of TTL states are left out (judged at ``now_ms``, default now)."""
    url, op_of_source = checkpoint_url(source, namespace)
    cc = load_checkpoint(url)
    op = the_operator(cc, operator_id or op_of_source)
    try:
        info = state_info(cc, op, state)
    except StateError as e:
        raise ConfigError(str(e)) from None
    kind = info.kind
    n = _tasks(spark, parallelism, cc.metadata.max_parallelism)

    def part(index: int) -> Iterator[tuple[Any, ...]]:
        return _rows(url, op, state, kind, n, index, now_ms)

    rdd = spark.sparkContext.parallelize(range(n), n).flatMap(part)
    cols = ["key", "user_key", "value"] if kind is StateKind.MAP else ["key", "value"]
    value = None
    if info.schema is not None:  # a typed state: its declared type, as the checkpoint says
        value = f"array<{info.schema}>" if kind is StateKind.LIST else info.schema
    return _frame(spark, rdd, cols, schema, _FALLBACK_SCHEMA[kind], value)


def _tasks(spark: Any, parallelism: int | None, max_parallelism: int) -> int:
    """How many Spark tasks read: ``parallelism`` (default Spark's default parallelism), at
    most one per key group."""
    n = parallelism or spark.sparkContext.defaultParallelism
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"parallelism must be an int >= 1, got {parallelism!r}")
    return min(n, max_parallelism)


def _frame(spark: Any, rdd: Any, cols: list[str], schema: Any, fallback: str,
           value: str | None = None) -> Any:
    """``rdd`` as a DataFrame: with ``schema``, or one inferred from its first rows (which
    computes the first non-empty partitions once more; a column None in all of them is a
    string column), or ``fallback`` when there are no rows. ``value``: the DDL type of the
    ``value`` column (a typed state's), which is then not inferred."""
    if schema is None:
        sample = rdd.take(50)
        if sample:
            schema = _infer(spark, sample, cols, value)
        elif value is not None:
            schema = StructType([StructField(c, _parse_datatype_string(value) if c == "value"
                                             else StringType(), True) for c in cols])
        else:
            schema = fallback
    return spark.createDataFrame(rdd, schema)


def _infer(spark: Any, sample: list[tuple[Any, ...]], cols: list[str],
           value: str | None = None) -> Any:
    fields = []
    for i, name in enumerate(cols):
        if name == "value" and value is not None:
            fields.append(StructField(name, _parse_datatype_string(value), True))
            continue
        seen = [r[i] for r in sample if r[i] is not None]
        dtype = (spark.createDataFrame([(v,) for v in seen], ["x"]).schema[0].dataType
                 if seen else StringType())
        fields.append(StructField(name, dtype, True))
    return StructType(fields)


def read_change_feed(spark: Any, start: Any, end: Any, state: str, *,
                     operator_id: str | None = None, parallelism: int | None = None,
                     schema: Any = None, namespace: str | None = None) -> Any:
    """A DataFrame of the changes of ``state`` after checkpoint ``start`` up to checkpoint
    ``end`` (each as :func:`spark_glue.sources.checkpoint_url` takes; an operator means
    its latest), read from the changelog by ``parallelism`` Spark tasks, one key-group
    range each; a window a materialization truncated is read as a diff of the two states
    (each key's net change: :mod:`dstl_ray.checkpoint.change_feed`)."""
    s_url, op_s = checkpoint_url(start, namespace)
    e_url, op_e = checkpoint_url(end, namespace)
    op = check_window(s_url, e_url, operator_id or op_e or op_s, state)  # on the driver
    n = _tasks(spark, parallelism, load_checkpoint(e_url).metadata.max_parallelism)

    def part(index: int) -> Iterator[tuple[Any, ...]]:
        for c in _feed(s_url, e_url, state, op, n, index):
            yield c.key, c.op, c.user_key, c.value, c.log, c.order, c.sqn

    rdd = spark.sparkContext.parallelize(range(n), n).flatMap(part)
    return _frame(spark, rdd, ["key", "op", "user_key", "value", "log", "order", "sqn"],
                  schema, "key string, op string, user_key string, value string, log string, "
                  "order int, sqn long")
