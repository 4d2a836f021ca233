"""Rows routed in Spark's JVM (spark_glue.jvm_route): Spark's xxhash64 is the key group
Python computes for string, int, bigint and binary keys; every row, combined or not, lands in
its subtask's partition, and an empty batch still has one per subtask; a new job is hashed by
Spark, its checkpoints say so, and it keeps that hash when restarted with another option; a
job of blake2b (every job before) stays blake2b; a key column that changed type is refused
before any task."""

from __future__ import annotations

import logging
import sys

import pytest
from pyspark import cloudpickle
from pyspark.sql import functions as F

from dstl_ray.errors import ConfigError
from dstl_ray.key_hashes import SparkXxHash64
from spark_glue import KeyedStatefulOperator
from spark_glue.jvm_route import JvmRoutePlan, planned, routed, salted_exchange

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_spark_computes_the_key_groups_python_does(spark):
    values = {"string": ["", "a", "abcde", "ü€", "x" * 33, "u17"],
              "int": [0, 1, -1, 2 ** 31 - 1, -2 ** 31, 12345],
              "bigint": [0, -1, 2 ** 63 - 1, -2 ** 63, 2 ** 40 + 7],
              "binary": [bytearray(b""), bytearray(b"\x00\x01ab")]}
    for kind, keys in values.items():
        df = spark.createDataFrame([(k,) for k in keys], f"k {kind}")
        got = [r.g for r in df.select(F.pmod(F.xxhash64("k"), F.lit(100)).alias("g")).collect()]
        want = [SparkXxHash64(kind).key_group(bytes(k) if kind == "binary" else k, 100)
                for k in keys]
        assert got == want, kind


@pytest.mark.parametrize("parallelism", [1, 3, 7])
def test_every_row_lands_in_its_subtasks_partition(spark, parallelism):
    maxp = 32
    kind = SparkXxHash64("string")
    df = spark.createDataFrame([(f"u{i % 300}", i) for i in range(2000)],
                               "user STRING, amount LONG")
    before = spark.conf.get("spark.sql.shuffle.partitions")
    # the salt's arithmetic wraps at 32 bits as Murmur3's does, also where ANSI refuses
    # an overflow (the routing is built under the session's mode)
    ansi = spark.conf.get("spark.sql.ansi.enabled")
    for combine in (None, {"n": F.count("*"), "total": F.sum("amount")}):
        spark.conf.set("spark.sql.ansi.enabled", str(parallelism == 7).lower())
        try:
            with planned(spark, parallelism):
                out = routed(df, "user", maxp, parallelism, combine).withColumn(
                    "part", F.spark_partition_id())
                rows = out.collect()
                assert out.rdd.getNumPartitions() == parallelism
                plan = out._jdf.queryExecution().executedPlan().toString()
                assert salted_exchange(plan, parallelism) == (combine is not None), plan
                if combine is not None:  # one partition suits any grouping: no such exchange
                    one = routed(df.coalesce(1), "user", maxp, parallelism, combine)
                    assert not salted_exchange(
                        one._jdf.queryExecution().executedPlan().toString(), parallelism)
                    # a batch of one partition, declared so, aggregated whole in its
                    # task, then routed: the same rows in the same partitions, through
                    # one exchange
                    jvm = JvmRoutePlan()
                    one = jvm.one_partition(spark.createDataFrame(
                        df.rdd.coalesce(1), df.schema))
                    whole = jvm.routed(one, "user", maxp, parallelism, combine, single=True)
                    got = whole.withColumn("part", F.spark_partition_id()).collect()
                    assert sorted(got) == sorted(rows)
                    plan = whole._jdf.queryExecution().executedPlan().toString()
                    assert plan.count("Exchange ") == 1 and "_dstl_salt" not in plan, plan
        finally:
            spark.conf.set("spark.sql.ansi.enabled", ansi)
        assert spark.conf.get("spark.sql.shuffle.partitions") == before
        assert len(rows) == (2000 if combine is None else 300)
        for r in rows:  # Flink's operator index of the key's group
            assert r.part == kind.key_group(r.user, maxp) * parallelism // maxp, r
        if combine is not None:
            assert sum(r.n for r in rows) == 2000
            assert {tuple(c for c in r.asDict() if c != "part") for r in rows} == {
                ("user", "n", "total")}
    with planned(spark, parallelism):  # an empty batch: still a partition per subtask
        empty = routed(df.where(F.col("amount") < 0), "user", maxp, parallelism,
                       {"n": F.count("*")})
        assert empty.rdd.getNumPartitions() == parallelism


def test_a_logical_rdd_of_one_partition_is_declared_so(spark):
    sc = spark.sparkContext
    rows = [("a", 1), ("b", 2), ("a", 3)]
    jvm = JvmRoutePlan()
    one = jvm.one_partition(spark.createDataFrame(sc.parallelize(rows, 1), "user STRING, n INT"))
    assert one is not None and sorted(one.collect()) == sorted(rows)
    leaf = one._jdf.queryExecution().analyzed()
    assert leaf.nodeName() == "LogicalRDD" and leaf.outputPartitioning().toString() == \
        "SinglePartition"
    two = spark.createDataFrame(sc.parallelize(rows, 2), "user STRING, n INT")
    local = spark.createDataFrame(rows, "user STRING, n INT")  # a local relation
    assert jvm.one_partition(two) is None and jvm.one_partition(local) is None
    assert jvm.one_partition(local.coalesce(1)) is None
    kept = spark.createDataFrame(sc.parallelize(rows, 1), "user STRING, n INT").persist()
    try:  # a persisted batch stays as it is: the copy would not read the cache
        assert jvm.one_partition(kept) is None
    finally:
        kept.unpersist()
    # aggregated whole, then routed: a null key and an empty batch of one partition too
    combine = {"n": F.count("*"), "total": F.sum("n")}
    with planned(spark, 3):
        for data in ([*rows, (None, 4), (None, 5)], []):
            one = jvm.one_partition(spark.createDataFrame(sc.parallelize(data, 1),
                                                          "user STRING, n INT"))
            out = jvm.routed(one, "user", 32, 3, combine, single=True)
            got = out.withColumn("part", F.spark_partition_id()).collect()
            assert out.rdd.getNumPartitions() == 3
            assert sorted((r.user or "", r.n, r.total) for r in got) == (
                [("", 2, 9), ("a", 2, 4), ("b", 1, 2)] if data else [])
            for r in got:
                assert r.part == SparkXxHash64("string").key_group(r.user, 32) * 3 // 32, r


def add(keys, rows, state):
    agg = rows.groupby("user", sort=False, dropna=False)[["n", "total"]].sum()
    state.value("count").set(state.value("count").get(0) + agg["n"].to_numpy())
    state.value("sum").set(state.value("sum").get(0) + agg["total"].to_numpy())


def test_a_new_job_is_hashed_by_spark_for_good(spark, tree_factory, namespace):
    tree_factory(persist_delay_s=0.02)
    combine = {"n": F.count("*"), "total": F.sum("amount")}

    def op(job, **kw):
        return KeyedStatefulOperator(job, key="user", update=add, api="pandas",
                                     combine=combine, namespace=namespace, parallelism=3,
                                     max_parallelism=32, materialization_interval=0.0, **kw)

    batches = [[(f"u{(i * 7) % 50}", i % 11) for i in range(b * 400, b * 400 + 400)]
               for b in range(3)]
    batches.insert(1, [])  # an empty batch Spark knows is empty: no partitions planned
    batches[2].append((None, 5))  # a null key: Spark's hash of null is its seed
    want: dict[str, dict] = {"count": {}, "sum": {}}
    jobs = {"spark": op("hash-spark"), "blake": op("hash-blake", key_hash="blake2b")}
    try:
        for b, data in enumerate(batches):
            if b == 3:  # a restart told blake2b keeps the job's own hash
                jobs["spark"].close()
                jobs["spark"] = op("hash-spark", key_hash="blake2b")
            df = spark.createDataFrame(data, "user STRING, amount LONG")
            # partitioned as the grouping wants already (no exchange by key and salt unless
            # asked for), and one partition (suits any grouping: routed in Python)
            df = df.limit(0) if not data else df.repartition(3, "user") if b == 2 \
                else df.coalesce(1) if b == 3 else df
            for o in jobs.values():
                o.process_batch(df, b)
            for u, a in data:
                want["count"][u] = want["count"].get(u, 0) + 1
                want["sum"][u] = want["sum"].get(u, 0) + a
        for name, o in jobs.items():
            assert o.state() == want, name
            meta = o.coordinator.latest_checkpoint().metadata
            assert meta.key_hash == ("spark-xxhash64:string" if name == "spark"
                                     else "blake2b"), name
        ints = spark.createDataFrame([(1, 2)], "user INT, amount LONG")
        with pytest.raises(ConfigError, match="spark-xxhash64:string.*'user' is int"):
            jobs["spark"].process_batch(ints, 4)
    finally:
        for o in jobs.values():
            o.close()


def test_a_column_named_like_the_routes_own_stays_the_users(spark, tree_factory, namespace):
    """A batch column named like a column the JVM route adds (in any case: Spark matches
    names so) would be replaced by the route's before the combiner reads it, and a combiner
    output named so dropped after: such a batch is routed in Python (which names clash:
    tests/unit/spark_glue/test_jvm_route.py)."""
    tree_factory(persist_delay_s=0.02)

    def total(keys, rows, state):
        agg = rows.groupby("user", sort=False, dropna=False)[["_dstl_salt"]].sum()
        state.value("sum").set(state.value("sum").get(0) + agg["_dstl_salt"].to_numpy())

    combine = {"_dstl_salt": F.sum("_DSTL_SALT_MIX")}  # (both)
    o = KeyedStatefulOperator("named-like-route", key="user", update=total, api="pandas",
                              combine=combine, namespace=namespace, parallelism=3,
                              max_parallelism=32, materialization_interval=0.0)
    try:
        data = [(f"u{i % 20}", i) for i in range(200)]
        df = spark.createDataFrame(data, "user STRING, _DSTL_SALT_MIX LONG")
        o.process_batch(df, 0)
        want: dict[str, int] = {}
        for u, a in data:
            want[u] = want.get(u, 0) + a
        assert o.state() == {"sum": want}
        assert o.coordinator.latest_checkpoint().metadata.key_hash == "spark-xxhash64:string"
    finally:
        o.close()


def add_rows(keys, rows, state):
    agg = rows.groupby("user", sort=False, dropna=False)["amount"].agg(["size", "sum"])
    state.value("count").set(state.value("count").get(0) + agg["size"].to_numpy())
    state.value("sum").set(state.value("sum").get(0) + agg["sum"].to_numpy())


@pytest.mark.parametrize("combined", [False, True])
def test_a_streams_later_batches_are_planned_from_its_first(spark, tree_factory, namespace,
                                                            tmp_path, combined, caplog):
    """foreachBatch hands every batch over as a LogicalRDD of the query's output: from the
    second batch on, the route's analysed plan is the first batch's on the batch's own leaf
    (spark_glue.batch_plans), and every row still reaches its key group's subtask (a row
    in another subtask fails at its state access)."""
    tree_factory(persist_delay_s=0.02)
    src = tmp_path / "in"
    src.mkdir()
    want: dict[str, dict] = {"count": {}, "sum": {}}
    for b in range(4):
        rows = [(f"u{(i * 7) % 40}", i % 11) for i in range(b * 300, b * 300 + 300)]
        (src / f"b{b}.json").write_text("".join(f'{{"user": "{u}", "amount": {a}}}\n'
                                                for u, a in rows))
        for u, a in rows:
            want["count"][u] = want["count"].get(u, 0) + 1
            want["sum"][u] = want["sum"].get(u, 0) + a
    combine = {"n": F.count("*"), "total": F.sum("amount")} if combined else None
    o = KeyedStatefulOperator(f"planned-once-{combined}", key="user",
                              update=add if combined else add_rows, api="pandas",
                              combine=combine, namespace=namespace, parallelism=3,
                              max_parallelism=32, materialization_interval=0.0)
    try:
        q = (spark.readStream.schema("user STRING, amount LONG")
             .option("maxFilesPerTrigger", 1).json(str(src))
             .writeStream.foreachBatch(o).option("checkpointLocation", str(tmp_path / "chk"))
             .start())
        try:
            with caplog.at_level(logging.INFO, logger="spark_glue"):
                q.processAllAvailable()
        finally:
            q.stop()
        assert [s.batch_id for s in o.history] == [0, 1, 2, 3]
        assert "routed in Python" not in caplog.text  # each batch went the JVM way
        assert o.state() == want
        assert o._path._runner._plans.reused == 3  # every batch but the first
        # a file a batch: one partition, aggregated whole in its task before the shuffle
        assert o._path.aggregated_whole == (4 if combined else 0)
    finally:
        o.close()
