"""Initial state from a DataFrame (Spark's ``initialState``; Flink's State Processor API
bootstrap): the operator's ``initial_state`` may be a DataFrame of the key column and one
column per ValueState (its name), loaded in the job's first micro-batch.

Loading is part of that batch, by key group in parallel: the operator routes the DataFrame's
rows, marked and with their columns renamed out of the input's way, along with micro-batch
0's rows (spark_glue.routing ``extra``), so each key's initial row goes to the subtask owning
its key group;
the subtask sets the states of those rows first (vectorized, a null leaves a state unset),
then applies the batch's own rows. So the initial state is in checkpoint 0 with the batch's
changes, and a replay of batch 0 (no checkpoint yet) loads it again. Once the job has a
complete checkpoint the DataFrame is never read again. A key twice in the DataFrame is an
error (which row would win depends on the shuffle).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dstl_ray.errors import ConfigError, InvalidValueError, StateError

from .routing import quoted
from .timers import TIMERS_STATE

FLAG = "__dstl_initial"
PREFIX = "__dstl_init__"


def is_frame(source: Any) -> bool:
    """Whether an ``initial_state`` is a Spark DataFrame (not a checkpoint source)."""
    return hasattr(source, "sparkSession") and hasattr(source, "mapInArrow")


@dataclass(frozen=True)
class InitialFrame:
    """The renamed, marked DataFrame and its states: (state name, column in the union)."""

    df: Any
    states: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, source: Any, key: str) -> InitialFrame:
        cols = list(source.columns)
        if key not in cols:
            raise ConfigError(f"initial_state DataFrame has no key column {key!r} (columns: "
                              f"{cols})")
        names = [c for c in cols if c != key]
        if not names:
            raise ConfigError(f"initial_state DataFrame has only the key column {key!r}: add "
                              f"one column per state to load")
        for n in names:
            if n == TIMERS_STATE or n.startswith("__dstl") or len(n) > 200:
                raise ConfigError(f"initial_state DataFrame column {n!r} cannot be a state "
                                  f"name")
        from pyspark.sql import functions as F

        df = source.select(F.col(quoted(key)),
                           *(F.col(quoted(n)).alias(PREFIX + n) for n in names),
                           F.lit(True).alias(FLAG))
        return cls(df, tuple((n, PREFIX + n) for n in names))


def split(table: Any, columns: Sequence[tuple[str, str]]) -> tuple[Any, Any]:
    """A subtask's routed rows as (the batch's rows without the initial columns, the initial
    rows), either None when empty."""
    import pyarrow.compute as pc

    if table is None or FLAG not in table.column_names:
        return table, None
    mark = pc.fill_null(table.column(FLAG), False)
    extra = [FLAG, *(c for _n, c in columns if c in table.column_names)]
    rest = table.filter(pc.invert(mark)).drop_columns(extra)
    initial = table.filter(mark)
    return (rest if rest.num_rows else None), (initial if initial.num_rows else None)


def load(backend: Any, table: Any, key: str, columns: Sequence[tuple[str, str]],
         ttl: Mapping[str, Any] | None = None) -> int:
    """Set the value states of ``table``'s initial rows (vectorized: key groups and keys
    computed once, one lock hold per state), each with its TTL in ``ttl`` (the operator's
    ``state_ttl``: loaded values are stamped as any write is); returns how many keys."""
    import pyarrow.compute as pc

    keys = table.column(key)
    if pc.count_distinct(keys).as_py() != table.num_rows or keys.null_count:
        counts = pc.value_counts(keys).to_pylist()
        dup = next((c["values"] for c in counts if c["counts"] > 1), None)
        raise StateError(f"initial_state: key {dup!r} is in the DataFrame more than once "
                         f"(or a key is null)")
    refs = None
    for name, col in columns:
        if col not in table.column_names:
            continue
        values = table.column(col)
        state = backend.value_state(name, (ttl or {}).get(name))
        if refs is None:
            refs = state.refs(keys.to_pylist())
        if values.null_count:
            present = pc.is_valid(values).to_pylist()
            these = [r for r, p in zip(refs, present, strict=True) if p]
            vals = [v for v in values.to_pylist() if v is not None]
        else:
            these, vals = refs, values.to_pylist()
        try:
            state.update_at(these, vals)
        except (StateError, InvalidValueError) as e:
            raise StateError(f"initial_state column {name!r}: {e} (declare the state's type "
                             f"with state_schema for timestamps, dates and decimals)") from e
    return table.num_rows
