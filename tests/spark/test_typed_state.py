"""Typed state with schema evolution through the Spark operator (issue 30 item 3), over three
runs of one job: run 1 keeps a struct state (timestamp, int, decimal) and an untyped count;
run 2 widens and adds a field and drops the count, and reads the old values in the new
shape; ``read_state`` gives the declared types; run 3 asks for an incompatible change and
fails at start, naming the state and both schemas, before any task runs."""

from __future__ import annotations

import datetime as dt
import decimal
import sys

import pytest
from pyspark import cloudpickle

from dstl_ray.errors import ConfigError, SchemaError
from spark_glue import KeyedStatefulOperator, read_state

cloudpickle.register_pickle_by_value(sys.modules[__name__])

V1 = "first timestamp, n int, total decimal(10,2)"
V2 = "first timestamp, n bigint, total decimal(10,2), last_amount bigint"


def track_v1(key, rows, state):
    s = state.value("summary")
    old = s.get() or {"first": rows[0]["at"], "n": 0, "total": decimal.Decimal(0)}
    s.set({"first": old["first"], "n": old["n"] + len(rows),
           "total": old["total"] + sum(decimal.Decimal(r["amount"]) / 100 for r in rows)})
    c = state.value("count")
    c.set(c.get(0) + len(rows))


def track_v2(key, rows, state):
    s = state.value("summary")
    old = s.get()  # a run-1 value comes with last_amount None
    s.set({"first": old["first"], "n": old["n"] + len(rows), "total": old["total"],
           "last_amount": rows[-1]["amount"]})


def batch(spark, rows):
    return spark.createDataFrame(rows, "user STRING, amount LONG, at TIMESTAMP")


def test_typed_state_evolves_across_runs_and_an_incompatible_change_fails_at_start(
        spark, tree_factory, namespace):
    tree_factory()
    t0 = dt.datetime(2026, 11, 26, 8, 0, tzinfo=dt.UTC)
    common = dict(key="user", namespace=namespace, parallelism=2, max_parallelism=16,
                  materialization_interval=None)
    op = KeyedStatefulOperator("typed-life", update=track_v1, state_schema={"summary": V1},
                               **common)
    op.process_batch(batch(spark, [("a", 150, t0), ("b", 5, t0), ("a", 1, t0)]), 0)
    op.close()

    op = KeyedStatefulOperator("typed-life", update=track_v2, state_schema={"summary": V2},
                               drop_state=["count"], **common)
    op.process_batch(batch(spark, [("a", 7, t0)]), 1)
    state = op.state()
    assert state["summary"] == {
        "a": {"first": t0, "n": 3, "total": decimal.Decimal("1.51"), "last_amount": 7},
        "b": {"first": t0, "n": 1, "total": decimal.Decimal("0.05"), "last_amount": None}}
    assert "count" not in state  # dropped
    frame = read_state(spark, op, "summary")
    value_type = frame.schema["value"].dataType.simpleString()
    assert value_type == "struct<first:timestamp,n:bigint,total:decimal(10,2)," \
                         "last_amount:bigint>"
    got = {r["key"]: r["value"].asDict() for r in frame.collect()}
    assert got["a"]["total"] == decimal.Decimal("1.51") and got["b"]["last_amount"] is None
    with pytest.raises(ConfigError, match="no state 'count'"):
        read_state(spark, op, "count")
    op.close()

    with pytest.raises(SchemaError) as e:  # n: bigint -> int narrows
        KeyedStatefulOperator("typed-life", update=track_v2, state_schema={"summary": V1},
                              **common)
    msg = str(e.value)
    assert "'summary'" in msg and "n narrows bigint to int" in msg
    assert "struct<first:timestamp,n:bigint,total:decimal(10,2),last_amount:bigint>" in msg
