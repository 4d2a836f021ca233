"""Initial state from a DataFrame (spark_glue.initial_frame), the subtask's side, on a real
backend without Spark: a subtask's payloads (the batch's and the initial rows', routed
apart) are split into the batch's rows (the initial columns and the mark gone) and the
initial rows; loading sets each column's value state per key (with the state's TTL), a null
leaves a state unset, typed states take typed values, and a key twice or a value the untyped
encoding lacks fails naming what is wrong."""

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
    """A subtask's routed table: the batch's payloads and the initial rows' payloads (routed
    apart), joined as read_payloads joins them (missing columns null)."""
    parts = []
    if batch_users:
        parts.append(pa.table({"user": batch_users, "amount": [1] * len(batch_users)}))
    if initial:
        parts.append(pa.table({
            "user": [u for u, _c, _s in initial],
            PREFIX + "count": pa.array([c for _u, c, _s in initial], pa.int64()),
            PREFIX + "since": pa.array([s for _u, _c, s in initial],
                                       pa.timestamp("us", tz="UTC")),
            FLAG: [True] * len(initial)}))
    return pa.concat_tables(parts, promote_options="permissive")


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
    # a subtask that got only initial rows
    rest, initial = split(routed([], [("q", 1, t0)]), COLS)
    assert rest is None and initial.num_rows == 1


def test_loaded_values_take_the_states_ttl():
    """A state the operator's state_ttl names is loaded with its TTL (stamped as any write),
    so the update function asking for it with the TTL finds it (not a TTL mismatch)."""
    clock = [1_700_000_000.0]
    b = d.ChangelogKeyedStateBackend(client("init", new_base()), "op", FULL, MAXP,
                                     materialization_interval=None, ttl_clock=lambda: clock[0])
    try:
        _rest, initial = split(routed([], [("a", 5, None)]), COLS)
        load(b, initial, "user", COLS[:1], {"count": d.StateTtlConfig.of(10)})
        assert b.value_state("count", 10).value("a") == 5
        clock[0] += 11
        assert b.value_state("count", 10).value("a") is None  # expired: it was stamped
    finally:
        b.close()


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
