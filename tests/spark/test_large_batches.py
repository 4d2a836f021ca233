"""A micro-batch of many distinct keys: every subtask's persist request is far above Ray's
inline limit (100 KiB), so node actors fetch it from the Spark Python worker that sent it.

The Python workers here have a Ray token at hand (``RAY_AUTH_TOKEN_PATH``, as
``~/.ray/auth_token`` on any machine where ``ray.init()`` once started a local cluster) while
the cluster runs without token authentication. Workers that turned token mode on because of
the token could not be called back by the other Ray nodes, and every subtask whose node actor
was not on the worker's own Ray node failed with ``OwnerDiedError`` (dstl_ray.transport.auth)."""

from __future__ import annotations

import secrets
import sys

from pyspark import cloudpickle

from spark_glue import KeyedStatefulOperator

cloudpickle.register_pickle_by_value(sys.modules[__name__])

KEYS = 30_000  # ~10,000 per subtask: ~300 KB requests, three times the inline limit


def count_and_sum(key, rows, state):
    c, s = state.value("count"), state.value("sum")
    c.set(c.get(0) + len(rows))
    s.set(s.get(0) + sum(r["amount"] for r in rows))


def test_a_micro_batch_of_many_keys_with_a_token_at_hand(spark, tree_factory, namespace,
                                                         tmp_path):
    tree = tree_factory(base=f"file://{tmp_path}/dfs", persist_delay_s=0.05)
    token = tmp_path / "auth_token"
    token.write_text(secrets.token_hex(32))
    sc = spark.sparkContext
    # Python workers get this environment; a new one means new worker processes, which join
    # Ray afresh with the token at hand
    sc.environment["RAY_AUTH_TOKEN_PATH"] = str(token)
    op = KeyedStatefulOperator("many-keys", key="user", update=count_and_sum,
                               namespace=namespace, parallelism=3, max_parallelism=48,
                               materialization_interval=None)
    try:
        rows = [(f"user-{i:06d}", i % 97) for i in range(KEYS)]
        rows += [(f"user-{i:06d}", 1) for i in range(0, KEYS, 7)]
        df = spark.createDataFrame(rows, "user STRING, amount LONG").repartition(3)
        stats = op.process_batch(df, 0)
        assert stats.keys == KEYS and stats.rows == len(rows)
        # some subtask's node actor is on another Ray node than the head, where every Python
        # worker's Ray connection is: its request had to be fetched across nodes
        assert any(node != tree.root for node in stats.nodes.values())
        state = op.state()
        want_count = {f"user-{i:06d}": 1 + (i % 7 == 0) for i in range(KEYS)}
        want_sum = {f"user-{i:06d}": i % 97 + (i % 7 == 0) for i in range(KEYS)}
        assert state["count"] == want_count and state["sum"] == want_sum
        flushed = sum(s["bytes_flushed"] for s in tree.status())
        assert flushed > 3 * 4 * 100 * 1024  # a few times the inline limit per subtask
    finally:
        del sc.environment["RAY_AUTH_TOKEN_PATH"]
        op.close()
