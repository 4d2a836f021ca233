"""The vectorized (pandas) update API on RayDP over several Ray nodes, micro-batch by
micro-batch: its state equals a batch recomputation, also after an empty micro-batch and a
task that fails half-way and is retried; the sink gets the outputs as a Spark DataFrame of
the given schema; and the per-key API, and the vectorized one with a map-side combiner or a
combiner run in Spark's JVM (a mapping of aggregates), on the same batches leave the same
state. A mapping combiner that is not one is refused, naming what is wrong."""

from __future__ import annotations

import sys

import pandas as pd
import pytest
from pyspark import cloudpickle
from pyspark.sql import functions as F

from dstl_ray.errors import ConfigError
from spark_glue import KeyedStatefulOperator
from spark_glue.combine import check_combine
from spark_glue.routing import route_values

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SCHEMA = "user STRING, amount LONG"
OUT = "user STRING, count LONG, sum LONG"


def vectorized(keys, rows, state):
    """Per-user count and sum; the first attempt of the task holding u7 fails after it wrote
    the counts (every batch)."""
    from pyspark import TaskContext

    agg = rows.groupby("user", sort=False)["amount"].agg(["size", "sum"])
    count = state.value("count").get(0) + agg["size"].to_numpy()
    state.value("count").set(count)
    if "u7" in keys and TaskContext.get().attemptNumber() == 0:
        raise RuntimeError("injected failure after a state write, on the first attempt")
    total = state.value("sum").get(0) + agg["sum"].to_numpy()
    state.value("sum").set(total)
    # u0's sum is output as null: a null in a LONG column reaches Spark as null (issue 30:
    # pandas made it NaN, and createDataFrame failed the batch)
    out_sum = pd.array(total.to_numpy(), dtype="Int64")
    out_sum[pd.Index(keys) == "u0"] = pd.NA
    return pd.DataFrame({"user": keys, "count": count.to_numpy(), "sum": out_sum})


def per_key(key, rows, state):
    c, s = state.value("count"), state.value("sum")
    c.set(c.get(0) + len(rows))
    s.set(s.get(0) + sum(r["amount"] for r in rows))


def partial(pdf):
    """The map-side combiner: per key of an input partition, its count and sum."""
    return pdf.groupby("user", as_index=False).agg(n=("amount", "size"),
                                                  total=("amount", "sum"))


def add_partials(keys, rows, state):
    agg = rows.groupby("user", sort=False)[["n", "total"]].sum()
    state.value("count").set(state.value("count").get(0) + agg["n"].to_numpy())
    state.value("sum").set(state.value("sum").get(0) + agg["total"].to_numpy())


def test_vectorized_api_state_outputs_retries_and_empty_batches(spark, tree_factory,
                                                                 namespace):
    tree_factory(persist_delay_s=0.02)
    # the route values computed in Python are the ones Spark's hash partitioning places
    for p in (1, 2, 3, 7):
        got = spark.createDataFrame([(v,) for v in route_values(p)], "v INT").selectExpr(
            f"pmod(hash(v), {p}) AS part").collect()
        assert [r.part for r in got] == list(range(p))
    batches = [[(f"u{(i * 7) % 40}", i % 13) for i in range(b * 300, b * 300 + 300)]
               for b in range(2)]
    batches.insert(1, [])  # an empty micro-batch: every subtask still checkpoints
    sunk: dict[int, list] = {}
    vec = KeyedStatefulOperator("vec", key="user", update=vectorized, api="pandas",
                                output_schema=OUT, namespace=namespace, parallelism=3,
                                max_parallelism=32, materialization_interval=0.0,
                                sink=lambda b, out: sunk.__setitem__(b, out.collect()))
    rows = KeyedStatefulOperator("vec-rows", key="user", update=per_key, namespace=namespace,
                                 parallelism=3, max_parallelism=32,
                                 materialization_interval=0.0)
    # a map-side combiner: the update gets per-partition partial counts and sums
    comb = KeyedStatefulOperator("vec-comb", key="user", update=add_partials, api="pandas",
                                 combine=partial, namespace=namespace, parallelism=3,
                                 max_parallelism=32, materialization_interval=0.0)
    # the same partial counts and sums as Spark aggregates: one row per key of the batch
    jvm = KeyedStatefulOperator("vec-jvm", key="user", update=add_partials, api="pandas",
                                combine={"n": F.count("*"), "total": F.sum("amount")},
                                namespace=namespace, parallelism=3, max_parallelism=32,
                                materialization_interval=0.0)
    want: dict[str, dict] = {"count": {}, "sum": {}}
    try:
        for b, data in enumerate(batches):
            df = spark.createDataFrame(data, SCHEMA)
            stats = vec.process_batch(df, b)
            rows.process_batch(df, b)
            combined = comb.process_batch(df, b)
            assert combined.rows <= min(len(data), 40 * df.rdd.getNumPartitions())
            assert jvm.process_batch(df, b).rows == len({u for u, _ in data})
            for u, a in data:
                want["count"][u] = want["count"].get(u, 0) + 1
                want["sum"][u] = want["sum"].get(u, 0) + a
            assert stats.rows == len(data)
            assert stats.retries == (1 if data else 0)  # u7's task, failed half-way once
        assert vec.state() == want == rows.state() == comb.state() == jvm.state()
        assert sorted(sunk) == [0, 1, 2] and sunk[1] == []
        last = {r["user"]: (r["count"], r["sum"]) for b in sorted(sunk) for r in sunk[b]}
        assert last == {u: (c, None if u == "u0" else want["sum"][u])
                        for u, c in want["count"].items()}
    finally:
        vec.close()
        rows.close()
        comb.close()
        jvm.close()


def test_a_combine_mapping_must_be_spark_aggregates_and_keep_event_time(spark):
    ok = {"n": F.count("*")}
    assert check_combine(ok, "user", None) == ok and check_combine(None, "user", None) is None
    assert check_combine(partial, "user", "ts") is partial  # a function: as before
    for bad, what in [({}, "at least one output column"),
                      ({"user": F.count("*")}, "names other than the key column 'user'"),
                      ({"n": "count(*)"}, r"combine\['n'\] must be a Spark aggregate"),
                      ([("n", F.count("*"))], "a function .* or a mapping")]:
        with pytest.raises(ConfigError, match=what):
            check_combine(bad, "user", None)
    with pytest.raises(ConfigError, match="with event_time='ts', combine must produce"):
        check_combine(ok, "user", "ts")
    assert list(check_combine({**ok, "ts": F.max("ts")}, "user", "ts")) == ["n", "ts"]
