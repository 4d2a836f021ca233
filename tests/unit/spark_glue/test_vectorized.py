"""The vectorized update API (spark_glue.vectorized) on a real backend, without Spark: a
columnar update leaves exactly the state (and changelog) the per-key API leaves; set() aligns
Series on their index, clears on None/NaN, stores plain Python values; TTL holds by the
column as per key; outputs come back as one Arrow stream; bad returns are refused."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

import dstl_ray as d
from dstl_ray.errors import ConfigError, StateError
from dstl_ray.state.ttl import StateTtlConfig
from spark_glue.routing import group_by_key
from spark_glue.vectorized import (
    KeyedStates,
    apply_pandas,
    outputs_frame,
    outputs_table,
    outputs_to_ipc,
)
from spark_glue.worker import apply_rows

from ..ckpt_util import MAXP, client, new_base

FULL = d.KeyGroupRange(0, MAXP - 1)


def backend(clock=None) -> d.ChangelogKeyedStateBackend:
    extra = {"ttl_clock": clock} if clock else {}
    return d.ChangelogKeyedStateBackend(client("vec", new_base()), "op", FULL, MAXP,
                                        materialization_interval=None, **extra)


def per_key(key, rows, state):
    c, s = state.value("count"), state.value("sum")
    c.set(c.get(0) + len(rows))
    s.set(s.get(0) + sum(r["amount"] for r in rows))
    return [(key, c.get(), s.get())]


def vectorized(keys, rows, state):
    agg = rows.groupby("user", sort=False, dropna=False)["amount"].agg(["size", "sum"])
    count = state.value("count").get(0) + agg["size"].to_numpy()
    total = state.value("sum").get(0) + agg["sum"].to_numpy()
    state.value("count").set(count)
    state.value("sum").set(total)
    return pd.DataFrame({"user": keys, "count": count.to_numpy(), "sum": total.to_numpy()})


BATCHES = [pa.table({"user": ["a", "b", "a", "c"], "amount": [1, 2, 3, 4]}),
           pa.table({"user": ["c", "d", "a"], "amount": [10, 20, 30]})]


def test_a_columnar_update_leaves_the_state_and_changelog_of_the_per_key_api():
    rows_b, vec_b = backend(), backend()
    try:
        for t in BATCHES:
            out_rows = apply_rows(per_key, group_by_key(t, "user"), rows_b, {})
            out_vec = outputs_table([apply_pandas(vectorized, group_by_key(t, "user"), vec_b,
                                                  {})])
            assert sorted(out_rows) == sorted(zip(*(c.to_pylist() for c in out_vec.columns),
                                                  strict=True))
        assert vec_b.dump() == rows_b.dump() == {
            "count": {"a": 3, "b": 1, "c": 2, "d": 1}, "sum": {"a": 34, "b": 2, "c": 14,
                                                            "d": 20}}
        # stored as Python ints, not numpy scalars: the same records, byte for byte
        for b in (rows_b, vec_b):
            b.snapshot(checkpoint_id=1).result(timeout=30)
        assert type(vec_b.value_state("count").value("a")) is int
    finally:
        rows_b.close()
        vec_b.close()


def test_set_aligns_series_on_the_keys_clears_on_none_and_checks_lengths():
    b = backend()
    try:
        keys = pd.Index(["x", "y", "z"], dtype=object)
        st = KeyedStates(b, keys, {})
        st.value("v").set([1, 2, 3])
        assert st.value("v").get().tolist() == [1, 2, 3]
        st.value("v").set(pd.Series({"z": 30, "x": 10, "y": 20}))  # aligned on the keys
        assert st.value("v").get(-1).tolist() == [10, 20, 30]
        with pytest.raises(StateError, match="index is not the keys"):
            st.value("v").set(pd.Series([1, 2, 3], index=["a", "b", "c"]))
        with pytest.raises(StateError, match="2 values for 3 keys"):
            st.value("v").set(pd.Series({"z": 30, "x": 10}))
        st.value("v").set(np.array([1.5, np.nan, 2.5]))  # NaN is a float value
        assert b.value_state("v").value("y") != b.value_state("v").value("y")
        st.value("v").set(pd.array([1, pd.NA, 3], dtype="Int64"))  # NA clears
        assert [b.value_state("v").value(k) for k in "xyz"] == [1, None, 3]
        st.value("v").set([np.arange(2), [np.int64(4)], {"a": np.float32(0.5)}])
        assert [b.value_state("v").value(k) for k in "xyz"] == [[0, 1], [4], {"a": 0.5}]
        with pytest.raises(StateError, match="2 values for 3 keys"):
            st.value("v").set([1, 2])
        with pytest.raises(StateError, match="one value per key"):
            st.value("v").set(5)
        st.value("v").clear()
        assert b.dump().get("v", {}) == {}
        st.key(np.str_("x")).list("l").add("e")  # lists and maps per key
        assert b.list_state("l").get("x") == ["e"]
        with pytest.raises(ConfigError, match="operator's timers"):
            st.value("_timers")
    finally:
        b.close()


def test_int_and_null_keys_are_stored_as_the_map_side_hashed_them():
    """pandas would make [1, None] floats; the states keep the keys' Python values."""
    b = backend()
    try:
        t = pa.table({"user": pa.array([1, None, 1, 5], pa.int64()), "amount": [1, 2, 3, 4]})
        out = outputs_table([apply_pandas(vectorized, group_by_key(t, "user"), b, {})])
        assert b.dump()["count"] == {1: 2, None: 1, 5: 1}
        assert out.column("user").to_pylist() == [1, None, 5]
    finally:
        b.close()


def test_ttl_by_the_column_never_returns_expired_values_and_writes_refresh():
    now = [1_700_000_000.0]
    b = backend(lambda: now[0])
    try:
        ttl = {"v": StateTtlConfig.of(10.0)}
        st = KeyedStates(b, pd.Index(["a", "b"]), ttl)
        st.value("v").set([1, 2])
        now[0] += 6
        st2 = KeyedStates(b, pd.Index(["a"]), ttl)
        st2.value("v").set([5])  # refreshes a only
        now[0] += 6  # b written 12 s ago: expired; a 6 s ago
        assert KeyedStates(b, pd.Index(["a", "b"]), ttl).value("v").get(0).tolist() == [5, 0]
    finally:
        b.close()


def test_outputs_of_every_shape_and_bad_returns():
    df = pd.DataFrame({"k": ["a"], "n": [1]})
    by_key = df.groupby("k").sum()  # the key is the index: it stays a column
    assert outputs_table([outputs_to_ipc(by_key)]).column("k").to_pylist() == ["a"]
    for out in (df, pa.Table.from_pandas(df, preserve_index=False), [df, df.iloc[:0]],
                iter([df])):
        t = outputs_table([outputs_to_ipc(out), None])
        assert t.column("k").to_pylist() == ["a"]
    assert outputs_to_ipc(None) is None and outputs_table([None]) is None
    with pytest.raises(ConfigError, match="returns a pandas DataFrame"):
        outputs_to_ipc(5)
    with pytest.raises(ConfigError, match="yielded tuple"):
        outputs_to_ipc([("a", 1)])


def test_outputs_reach_spark_with_their_nulls_in_the_output_schemas_types():
    """Regression (issue 30): a null in a LONG output column failed the batch: pandas made
    it NaN on the way to spark.createDataFrame ("LongType() can not accept object nan")."""
    df = pd.DataFrame({"k": ["a", "b", "c"], "n": pd.array([1, None, 3], dtype="Int64"),
                       "f": [1.0, None, 3.0], "s": ["x", None, "z"]})
    table = outputs_table([outputs_to_ipc(df)])
    frame = outputs_frame(table)
    assert frame["n"].tolist() == [1, None, 3] and frame["s"].tolist() == ["x", None, "z"]
    assert all(type(v) is int for v in frame["n"] if v is not None)
    # a float column (pandas' NaN for a missing int) cast to the schema's int64
    schema = pa.schema([("k", pa.string()), ("n", pa.int64()), ("f", pa.int64())])
    frame = outputs_frame(table, schema)
    assert frame["f"].tolist() == [1, None, 3] and frame["k"].tolist() == ["a", "b", "c"]
    assert frame.columns.tolist() == ["k", "n", "f"]  # the schema's, in its order
    no_nulls = outputs_frame(outputs_table([outputs_to_ipc(df.iloc[[0]])]), schema)
    assert no_nulls["n"].dtype == np.int64  # columns without nulls stay vectorized
    by_key = outputs_table([outputs_to_ipc(df.groupby("k")[["n"]].sum())])
    assert outputs_frame(by_key).columns.tolist() == ["n", "k"]  # the keys: a column
    assert outputs_frame(by_key, schema.remove(2)).columns.tolist() == ["k", "n"]
    with pytest.raises(ConfigError, match="output column 'f' holds double"):
        outputs_frame(outputs_table([outputs_to_ipc(df.assign(f=[1.5, 2.0, 3.0]))]), schema)


def test_a_series_on_a_default_index_is_in_keys_order_even_for_int_keys():
    b = backend()
    try:
        st = KeyedStates(b, pd.Index([2, 0, 1], dtype=object), {})
        st.value("v").set(pd.Series([20, 0, 10]))  # a RangeIndex is positional
        assert {k: b.value_state("v").value(k) for k in (0, 1, 2)} == {2: 20, 0: 0, 1: 10}
    finally:
        b.close()
