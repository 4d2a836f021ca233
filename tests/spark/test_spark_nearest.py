"""Spark tasks on RayDP reach the node actor of their own executor's Ray node."""

from __future__ import annotations

import ray

from dstl_ray import StateChangelogHandle
from spark_glue import gcs_address


def test_spark_tasks_write_through_their_own_node_actor(spark, tree_factory, namespace):
    tree = tree_factory(persist_delay_s=0.05)
    by_pid = {s["raylet_pid"]: s["name"] for s in tree.status()}
    gcs = gcs_address()
    ns = namespace

    def task(index, rows):
        import os

        from dstl_ray import KeyGroupRange, StateChangelogClient
        from spark_glue import connect

        connect(gcs, ns)
        client = StateChangelogClient(f"spark-{index}", namespace=ns)
        w = client.create_writer("op", KeyGroupRange(0, 3))
        values = [f"p{index}-{r}".encode() for r in rows]
        for v in values:
            w.append(len(v) % 4, v)
        handle = w.persist_durably(0).result(timeout=60)
        transport = client.transport
        out = (index, os.environ.get("RAY_RAYLET_PID"), transport.node_name,
               transport.chosen_by, handle.to_json(), [v.decode() for v in values])
        client.close()
        yield out

    results = spark.sparkContext.parallelize(range(40), 6).mapPartitionsWithIndex(task).collect()
    assert len(results) == 6
    used_nodes = set()
    for _index, pid, node_name, how, handle_json, values in results:
        assert how == "RAY_RAYLET_PID"
        assert node_name == by_pid[pid]  # the node actor of the executor's own Ray node
        used_nodes.add(node_name)
        restored = StateChangelogHandle.from_json(handle_json).read_all()
        assert sorted(v.decode() for vs in restored.values() for v in vs) == sorted(values)
    st = {s["name"]: s for s in tree.status()}
    for name in used_nodes:  # the changes entered the tree there
        assert st[name]["requests"] >= 1
    assert sum(s["requests"] for s in st.values()) >= 6
    assert len(used_nodes) >= 1
    assert ray.is_initialized()
