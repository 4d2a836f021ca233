"""The state reader (``spark_glue.read_state``): the state of a retained checkpoint as a
DataFrame, read by key-group ranges in parallel Spark tasks, equals ``op.state()`` and a batch
recomputation of the input; maps are one row per entry; an operator, a job id, a job directory
and a checkpoint all name state; a state that does not exist is a clear error. The change feed
(``spark_glue.read_change_feed``) between two checkpoints holds exactly the keys of the batches
in between, each ending at its final value, also across a materialization (the job
materializes every batch: the window is read as a diff of the two checkpoints)."""

from __future__ import annotations

import json

import pytest

from dstl_ray.checkpoint.change_feed import CHANGELOG, DIFF, window_mode
from dstl_ray.errors import ConfigError
from spark_glue import KeyedStatefulOperator, read_change_feed, read_state

from .test_stateful_operator import count_and_sum, expected, run_stream, write_events


def test_read_state_equals_the_operators_state_and_a_recomputation(spark, tree_factory,
                                                                   namespace, tmp_path):
    tree_factory()
    src = tmp_path / "in"
    write_events(src, 2, 300, seed=7)
    op = KeyedStatefulOperator("reader", key="user", update=count_and_sum,
                               namespace=namespace, parallelism=3, max_parallelism=32,
                               materialization_interval=0.0, state_backend="rocksdb")
    run_stream(spark, op, src, tmp_path / "chk")
    start = op.coordinator.latest_checkpoint().metadata_url
    write_events(src, 1, 300, seed=8, start=2)  # one more batch
    run_stream(spark, op, src, tmp_path / "chk")
    want = expected(spark, src)
    assert op.state() == want

    counts = read_state(spark, op, "count", parallelism=4)
    assert counts.columns == ["key", "value"]
    assert counts.rdd.getNumPartitions() == 4
    assert {r["key"]: r["value"] for r in counts.collect()} == want["count"]

    hist = read_state(spark, op, "hist").collect()
    assert {tuple(r) for r in hist} == {(u, b, n) for u, h in want["hist"].items()
                                        for b, n in h.items()}

    # a job id (the tree's directory), a job directory, a checkpoint: the same state
    job_dir = f"{op.base_path}/reader"
    latest = op.coordinator.latest_checkpoint().metadata_url
    for source in ("reader", job_dir, latest, latest.rsplit("/", 1)[0]):
        df = read_state(spark, source, "sum", namespace=namespace, parallelism=2)
        assert {r["key"]: r["value"] for r in df.collect()} == want["sum"], source

    with pytest.raises(ConfigError, match=r"no state 'nope'.*'count'"):
        read_state(spark, op, "nope")

    feed = read_change_feed(spark, start, op, "count", parallelism=3)
    assert feed.columns == ["key", "op", "user_key", "value", "log", "order", "sqn"]
    rows = sorted(feed.collect(), key=lambda r: (r["order"], r["sqn"]))
    new_keys = {json.loads(line)["user"]
                for line in (src / "f0002.json").read_text().splitlines()}
    assert {r["key"] for r in rows} == new_keys
    assert {r["op"] for r in rows} == {"value_set"}
    last = {r["key"]: r["value"] for r in rows}
    assert last == {k: want["count"][k] for k in new_keys}
    # from batch 0's checkpoint: batch 1's materialization truncated the log in between
    first = f"{job_dir}/chk-0/_metadata"
    assert window_mode(first, latest, "count") == DIFF
    assert window_mode(start, latest, "count") == CHANGELOG
    diff = read_change_feed(spark, first, op, "count", parallelism=2).collect()
    keys_1_2 = {json.loads(line)["user"] for f in ("f0001.json", "f0002.json")
                for line in (src / f).read_text().splitlines()}
    assert {r["key"]: r["value"] for r in diff} == {k: want["count"][k] for k in keys_1_2}
    assert {(r["op"], r["log"], r["order"], r["sqn"]) for r in diff} == {("value_set", "", 0, 0)}
    op.close()
