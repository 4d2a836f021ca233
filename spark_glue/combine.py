"""The operator's combiner: a micro-batch's rows folded per key before they reach the state.

Two kinds, as :class:`~spark_glue.operator.KeyedStatefulOperator`'s ``combine`` takes them:

- a **function** (pandas in, pandas out, the key column kept), run on each input partition's
  rows in a Spark Python worker before the shuffle (:func:`spark_glue.routing.combined`);
- a **mapping** of output column to Spark aggregate expression, e.g. ``{"n": F.count("*"),
  "total": F.sum("amount")}``: the batch becomes ``df.groupBy(key).agg(...)`` in Spark's JVM
  (partial aggregation, its shuffle, the final aggregation: what the native
  ``groupBy().agg()`` does with the same rows), so only one row per key and batch crosses
  into Python. At 1M events over 1k keys the function's way moves the million rows through
  Arrow into a Python worker first; the mapping's way hands Python 1k rows.

Either way the update function sees the combiner's rows instead of the input's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from dstl_ray.errors import ConfigError

Combine = Callable[[Any], Any] | Mapping[str, Any]


def check_combine(combine: Any, key: str, event_time: str | None) -> Combine | None:
    """``combine`` as the operator keeps it (a mapping copied, in its order), or a
    :class:`ConfigError` naming what is wrong: a mapping needs at least one output column,
    each a non-empty name other than the key, given a Spark ``Column``; with event time, the
    mapping must produce the event-time column (e.g. ``F.max(ts)``), which the watermark
    reads from the rows the update gets."""
    if combine is None or callable(combine) and not isinstance(combine, Mapping):
        return combine
    if not isinstance(combine, Mapping):
        raise ConfigError(f"combine must be a function (pandas in and out) or a mapping of "
                          f"output column to Spark aggregate expression, got {combine!r}")
    from pyspark.sql import Column

    if not combine:
        raise ConfigError("combine as a mapping needs at least one output column")
    for name, expr in combine.items():
        if not isinstance(name, str) or not name or name == key:
            raise ConfigError(f"combine's output columns must be names other than the key "
                              f"column {key!r}, got {name!r}")
        if not isinstance(expr, Column):
            raise ConfigError(f"combine[{name!r}] must be a Spark aggregate expression "
                              f"(pyspark.sql.Column, e.g. F.sum(...)), got {expr!r}")
    if event_time is not None and event_time not in combine:
        raise ConfigError(f"with event_time={event_time!r}, combine must produce that "
                          f"column (e.g. {{{event_time!r}: F.max({event_time!r})}}): the "
                          f"watermark is read from the rows the update gets")
    return dict(combine)
