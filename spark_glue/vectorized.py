"""The operator's vectorized update API: pandas in, pandas out, state by the column.

The model is Spark's ``applyInPandasWithState``: the update function sees rows as pandas
DataFrames and the keys' state, and yields output DataFrames. Where Spark calls the function
once per key (a DataFrame per key: about a hundred microseconds of pandas per call, which is
the whole budget at a million keys), this API calls it once per subtask and micro-batch with
every key the subtask got, so the work is pandas' own vectorized group-by:

>>> def count_and_sum(keys, rows, state):                             # doctest: +SKIP
...     agg = rows.groupby("user", sort=False, dropna=False)["amount"].agg(["size", "sum"])
...     count = state.value("count").get(0) + agg["size"].to_numpy()
...     total = state.value("sum").get(0) + agg["sum"].to_numpy()
...     state.value("count").set(count)
...     state.value("sum").set(total)
...     return pd.DataFrame({"user": keys, "count": count, "sum": total})

``keys`` is a pandas Index of the distinct keys, ``rows`` the DataFrame of their rows ordered
by key (so ``rows.groupby(key, sort=False, dropna=False)`` lists groups in ``keys``
order), and ``state`` a :class:`KeyedStates`: ``state.value(name).get(default)`` is a
Series of every key's value (index ``keys``) and ``.set(values)`` writes one value per key
(a Series indexed by the keys is aligned on its index, anything else is in ``keys`` order;
None clears a key's value). Lists and maps are per key:
``state.key(k).list(name)`` is the per-key API's view. TTL works as in the per-key API.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from dstl_ray.errors import ConfigError, StateError
from dstl_ray.state.ttl import StateTtlConfig

from .routing import Groups
from .timers import EVENT, PROCESSING, BatchTimes, TimerContext
from .views import KeyedState, check_state_name


class ColumnValue:
    """One ValueState over all keys of the call."""

    def __init__(self, state: Any, keys: Any, refs: list[tuple[int, bytes]]) -> None:
        self._s, self._keys, self._refs = state, keys, refs

    def get(self, default: Any = None) -> Any:
        """Every key's value as a Series indexed by the keys (``default`` where a key has none
        or it expired)."""
        import pandas as pd

        return pd.Series(self._s.values_at(self._refs, default), index=self._keys)

    def set(self, values: Any) -> None:
        """One value per key: a Series indexed by exactly the keys (any order) is aligned on
        its index; anything else (array, list, a Series on a default RangeIndex) is in
        ``keys`` order, and a Series on another index is refused. None, pandas' NA and NaT
        clear a key's value; NaN is a float."""
        import numpy as np

        if np.isscalar(values) or values is None:
            raise StateError("set() takes one value per key (a Series, array or list); use "
                             "[v] * len(keys) for the same value everywhere")
        self._s.update_at(self._refs, per_key(values, self._keys, "set()"))

    def clear(self) -> None:
        self._s.update_at(self._refs, [None] * len(self._refs))


def per_key(values: Any, keys: Any, what: str) -> list[Any]:
    """``values`` as one plain value per key, in ``keys`` order: a Series indexed by exactly
    the keys (any order) is aligned on its index; an array, a list or a Series on a default
    RangeIndex is taken in ``keys`` order; a Series on another index is refused."""
    import pandas as pd

    if len(values) != len(keys):
        raise StateError(f"{what} got {len(values)} values for {len(keys)} keys")
    if isinstance(values, pd.Series) and isinstance(values.index, pd.RangeIndex):
        values = values.to_numpy(dtype=object)  # a default index: in keys order
    if isinstance(values, pd.Series):
        if not values.index.equals(keys):
            if not (values.index.is_unique and set(values.index) == set(keys)):
                raise StateError(f"{what} got a Series whose index is not the keys; pass "
                                 f"its .to_numpy() for values in keys order")
            values = values.reindex(keys)
        values = values.to_numpy(dtype=object)
    py = values.tolist() if hasattr(values, "tolist") else list(values)
    return [plain(v) for v in py]


class ColumnTimers(BatchTimes):
    """Every key's timers in one vectorized call (``state.timers``): ``register_*(times)``
    and ``delete_*(times)`` take one time per key (as :meth:`ColumnValue.set` takes values;
    None or NaT skips a key) or one time for every key; times in ms since the epoch or
    datetimes. ``watermark`` and ``now`` are the batch's, as in the per-key API."""

    def __init__(self, ctx: TimerContext, keys: Any, raw_keys: list[Any]) -> None:
        super().__init__(ctx)
        self._keys, self._raw = keys, raw_keys

    def register_event_time(self, times: Any) -> None:
        self._each(times, "register_event_time", EVENT, self._ctx.service.register)

    def register_processing_time(self, times: Any) -> None:
        self._each(times, "register_processing_time", PROCESSING, self._ctx.service.register)

    def delete_event_time(self, times: Any) -> None:
        self._each(times, "delete_event_time", EVENT, self._ctx.service.delete)

    def delete_processing_time(self, times: Any) -> None:
        self._each(times, "delete_processing_time", PROCESSING, self._ctx.service.delete)

    def _each(self, times: Any, what: str, domain: str, change: Any) -> None:
        import numpy as np

        if np.isscalar(times) or not hasattr(times, "__len__"):  # one time for every key
            each = [plain(times)] * len(self._raw)
        else:
            each = per_key(times, self._keys, f"timers.{what}()")
        for key, t in zip(self._raw, each, strict=True):
            if t is not None:
                change(key, domain, t)


def plain(v: Any) -> Any:
    """``v`` as the state serializer takes it: numpy scalars and arrays become Python values
    (inside lists and dicts too); pandas' NA and NaT become None."""
    import pandas as pd

    if v is None or v is pd.NA or v is pd.NaT:
        return None
    if type(v) in (str, bytes, bool, int, float):
        return v
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {plain(k): plain(x) for k, x in v.items()}
    if hasattr(v, "tolist"):  # numpy scalars (np.float64 and np.str_ too) and arrays
        return plain(v.tolist())
    return v


class KeyedStates:
    """The states of every key of one vectorized call. ``keys`` is the pandas Index the
    function sees; the states use the keys as the map side hashed them (``raw_keys``: the
    Python values, so an int key stays an int even when pandas would make it a float)."""

    def __init__(self, backend: Any, keys: Any, ttl: Mapping[str, StateTtlConfig],
                 timers: TimerContext | None = None, raw_keys: list[Any] | None = None
                 ) -> None:
        self.keys = keys
        self._raw = raw_keys if raw_keys is not None else keys.tolist()
        self._b, self._ttl, self._timers = backend, ttl, timers
        self._refs: list[tuple[int, bytes]] | None = None
        self._values: dict[str, ColumnValue] = {}

    def value(self, name: str) -> ColumnValue:
        v = self._values.get(name)
        if v is None:
            check_state_name(name)
            state = self._b.value_state(name, self._ttl.get(name))
            if self._refs is None:
                self._refs = state.refs(self._raw)
            v = self._values[name] = ColumnValue(state, self.keys, self._refs)
        return v

    def key(self, key: Any) -> KeyedState:
        """The per-key API's view of one key's states (lists, maps, timers)."""
        return KeyedState(self._b, plain(key), self._ttl, self._timers)

    @property
    def timers(self) -> ColumnTimers:
        """Every key's timers (the operator needs ``on_timer``)."""
        if self._timers is None:
            raise StateError("timers need the operator's on_timer (none was given)")
        return ColumnTimers(self._timers, self.keys, self._raw)


def apply_pandas(update: Any, groups: Groups, backend: Any,
                 ttl: Mapping[str, StateTtlConfig], timers: TimerContext | None = None
                 ) -> bytes | None:
    """Call the vectorized ``update`` on one subtask's rows; its outputs as one Arrow IPC
    stream (None: no output)."""
    import pandas as pd

    if groups.rows == 0:
        return None
    keys = pd.Index(groups.keys, dtype=object, tupleize_cols=False)
    rows = groups.table.to_pandas()
    out = update(keys, rows, KeyedStates(backend, keys, ttl, timers, groups.keys))
    return outputs_to_ipc(out)


def outputs_to_ipc(out: Any) -> bytes | None:
    """A vectorized call's result (a DataFrame, an Arrow table, an iterable of them, or None)
    as one Arrow IPC stream."""
    import pandas as pd
    import pyarrow as pa

    if out is None:
        return None
    parts = [out] if isinstance(out, (pd.DataFrame, pa.Table)) else list(_frames(out))
    # an index other than a RangeIndex (a groupby's keys) stays a column
    tables = [p if isinstance(p, pa.Table) else pa.Table.from_pandas(p) for p in parts]
    tables = [t for t in tables if t.num_rows]
    if not tables:
        return None
    table = pa.concat_tables(tables, promote_options="permissive")
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def _frames(out: Any) -> Iterable[Any]:
    import pandas as pd
    import pyarrow as pa

    if not isinstance(out, Iterable):
        raise ConfigError(f"a vectorized update returns a pandas DataFrame, an Arrow table, an "
                          f"iterable of them, or None; got {type(out).__name__}")
    for p in out:
        if not isinstance(p, (pd.DataFrame, pa.Table)):
            raise ConfigError(f"a vectorized update yielded {type(p).__name__}; it yields "
                              f"pandas DataFrames or Arrow tables")
        yield p


def outputs_frame(table: Any, schema: Any = None) -> Any:
    """``table`` as a pandas DataFrame that ``spark.createDataFrame(frame, output_schema)``
    takes with its nulls. Each column named in ``schema`` (a ``pyarrow.Schema``: the output
    schema's) is cast to its type first (an int64 a NaN made float64 back to int64; a value
    the type cannot hold is a :class:`ConfigError` naming the column). pandas turns a null of
    an integer, boolean or date column into NaN or NaT, which Spark refuses for a LONG ("can
    not accept object nan") or reads as a NaN DOUBLE: a column with nulls is handed over as
    Python objects, None for null; the others keep numpy types (a pandas extension type the
    update used is not restored). When every column of ``schema`` is there, the frame has
    exactly those, in its order (a groupby's keys come last from Arrow)."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.compute as pc

    for field in schema or ():
        i = table.schema.get_field_index(field.name)
        if i < 0 or table.schema.field(i).type == field.type or (
                pa.types.is_timestamp(field.type)
                and pa.types.is_timestamp(table.schema.field(i).type)):
            continue  # (a naive timestamp is in the session's time zone: Spark converts it)
        try:
            column = pc.cast(table.column(i), field.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise ConfigError(f"output column {field.name!r} holds "
                              f"{table.schema.field(i).type}, which the output schema's "
                              f"{field.type} cannot hold: {e}") from e
        table = table.set_column(i, field.name, column)
    frame = table.to_pandas(ignore_metadata=True)  # a groupby's keys stay a column
    for name, column in zip(table.column_names, table.columns, strict=True):
        if column.null_count:
            frame[name] = pd.Series(column.to_pylist(), dtype=object, index=frame.index)
    if schema is not None and set(schema.names) <= set(frame.columns):
        frame = frame[schema.names]  # Spark takes a frame's columns by position
    return frame


def outputs_table(payloads: Iterable[bytes | None]) -> Any:
    """The subtasks' output streams as one Arrow table (None: no subtask had output)."""
    import pyarrow as pa

    tables = [pa.ipc.open_stream(p).read_all() for p in payloads if p]
    if not tables:
        return None
    return pa.concat_tables(tables, promote_options="permissive")
