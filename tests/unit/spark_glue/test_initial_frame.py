"""Initial state from a DataFrame (spark_glue.initial_frame), the subtask's side, on a real
backend without Spark: a routed table is split into the batch's rows (the initial columns
and the mark gone) and the initial rows; loading sets each column's value state per key, a
null leaves a state unset, typed states take typed values, and a key twice or a value the
untyped encoding lacks fails naming what is wrong."""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pytest

import dstl_ray as d
from dstl_ray.errors import StateError
from spark_glue.initial_frame import FLAG, PREFIX, load, split

from ..ckpt_util import MAXP, client, new_base

FULL = d.KeyGroupRange(0, MAXP - 1)
COLS = (("count", PREFIX + "count"), ("since", PREFIX + "since"))


def routed(batch_users, initial):
    """A subtask's routed table: the batch's rows and the initial rows, as unionByName
    makes them (missing columns null)."""
    n, m = len(batch_users), len(initial)
    return pa.table({
        "user": batch_users + [u for u, _c, _s in initial],
        "amount": [1] * n + [None] * m,
        PREFIX + "count": [None] * n + [c for _u, c, _s in initial],
        PREFIX + "since": pa.array([None] * n + [s for _u, _c, s in initial],
                                   pa.timestamp("us", tz="UTC")),
        FLAG: [None] * n + [True] * m,
    })


def backend():
    return d.ChangelogKeyedStateBackend(client("init", new_base()), "op", FULL, MAXP,
                                        materialization_interval=None)


def test_split_and_load_set_each_keys_states_before_the_batch():
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    table = routed(["a", "c"], [("a", 10, t0), ("b", None, t0), ("z", 3, None)])
    rest, initial = split(table, COLS)
    assert rest.column_names == ["user", "amount"] and rest.column("user").to_pylist() == \
        ["a", "c"]
    assert initial.num_rows == 3
    b = backend()
    try:
        b.schemas.declare({"since": "timestamp"})
        assert load(b, initial, "user", COLS) == 3
        dump = b.dump()
        assert dump["count"] == {"a": 10, "z": 3}  # b's null count leaves it unset
        assert dump["since"] == {"a": t0, "b": t0}
    finally:
        b.close()
    # a batch without initial rows (after batch 0) passes through untouched
    plain = pa.table({"user": ["a"], "amount": [1]})
    assert split(plain, COLS) == (plain, None)
    assert split(None, COLS) == (None, None)


def test_a_duplicate_key_or_an_unencodable_value_fails_naming_it():
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    b = backend()
    try:
        _rest, initial = split(routed([], [("a", 1, t0), ("a", 2, t0)]), COLS)
        with pytest.raises(StateError, match="key 'a' is in the DataFrame more than once"):
            load(b, initial, "user", COLS)
        _rest, initial = split(routed([], [("a", 1, t0)]), COLS)
        with pytest.raises(StateError, match="column 'since'.*state_schema"):
            load(b, initial, "user", COLS)  # an untyped state has no datetime encoding
    finally:
        b.close()
