"""The stateful foreachBatch operator on RayDP over several Ray nodes: its durable state equals
a plain batch recomputation of all input under task retries, a node-actor kill and an
executor kill (driver restarts between checkpoint completion and Spark's commit:
tests/spark/test_file_sink.py); and
every task's changes enter the tree at its own executor's node actor. A restart whose state is
gone fails until told to start over."""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import pytest
import ray
from pyspark import cloudpickle

from spark_glue import KeyedStatefulOperator
from spark_glue.session import kill_executor

# the update functions below are shipped by value: Spark's Python workers cannot import tests
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SCHEMA = "user STRING, amount LONG"


def write_events(folder: Path, n_files: int, per_file: int, seed: int, start: int = 0) -> None:
    """``n_files`` files of events, in name order also by modification time, which is the
    order Spark's file source takes them in (files written within one tick of the kernel's
    clock have equal times and come in directory order)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    for i in range(start, start + n_files):
        lines = [json.dumps({"user": f"u{rng.randint(0, 60)}", "amount": rng.randint(1, 100)})
                 for _ in range(per_file)]
        tmp = folder / f".f{i:04d}.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        t = t0 + 0.01 * (i - start)
        os.utime(tmp, (t, t))
        tmp.rename(folder / f"f{i:04d}.json")


def count_and_sum(key, rows, state):
    """Per-user count, sum, last-5 amounts (ListState) and a histogram (MapState)."""
    c, s = state.value("count"), state.value("sum")
    c.set(c.get(0) + len(rows))
    s.set(s.get(0) + sum(r["amount"] for r in rows))
    hist = state.map("hist")
    for r in rows:
        b = r["amount"] // 25
        hist.put(b, hist.get(b, 0) + 1)
    return [(key, c.get(), s.get())]


def flaky_count_and_sum(key, rows, state):
    """Fails the first attempt of the task holding u7, after other keys were applied."""
    from pyspark import TaskContext

    if key == "u7" and TaskContext.get().attemptNumber() == 0:
        raise RuntimeError("injected failure on the first attempt")
    return count_and_sum(key, rows, state)


def expected(spark, folder: Path) -> dict[str, dict]:
    rows = spark.read.schema(SCHEMA).json(str(folder)).collect()
    out: dict[str, dict] = {"count": {}, "sum": {}, "hist": {}}
    for r in rows:
        u = r["user"]
        out["count"][u] = out["count"].get(u, 0) + 1
        out["sum"][u] = out["sum"].get(u, 0) + r["amount"]
        h = out["hist"].setdefault(u, {})
        h[r["amount"] // 25] = h.get(r["amount"] // 25, 0) + 1
    return out


def run_stream(spark, op, src: Path, chk: Path, timeout: float = 240.0):
    q = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(str(src))
         .writeStream.foreachBatch(op).option("checkpointLocation", str(chk)).start())
    try:
        q.processAllAvailable()
    finally:
        q.stop()
    return q


def test_exactly_once_under_task_retries(spark, tree_factory, namespace, tmp_path):
    tree = tree_factory(persist_delay_s=0.02)
    src = tmp_path / "in"
    write_events(src, 2, 200, seed=1)
    sunk: dict[int, list] = {}
    op = KeyedStatefulOperator("retries", key="user", update=flaky_count_and_sum,
                               namespace=namespace, parallelism=4, max_parallelism=32,
                               materialization_interval=0.0,
                               sink=lambda b, out: sunk.__setitem__(b, out))
    run_stream(spark, op, src, tmp_path / "chk")
    assert op.state() == expected(spark, src)
    assert [s.batch_id for s in op.history] == [0, 1]
    assert all(s.retries >= 1 for s in op.history)  # every batch retried u7's task
    assert sorted(sunk) == [0, 1]
    last = {}
    for b in sorted(sunk):
        for user, c, _s in sunk[b]:
            last[user] = c
    assert last == expected(spark, src)["count"]
    # every task entered the tree at its own executor's node actor
    by_pid = {s["raylet_pid"]: s["name"] for s in tree.status()}
    for s in op.history:
        for i, node in s.nodes.items():
            assert s.chosen_by[i] == "RAY_RAYLET_PID"
            assert by_pid[s.raylet_pids[i]] == node
    assert len({n for s in op.history for n in s.nodes.values()}) >= 2
    op.close()


def test_a_restart_whose_state_is_gone_fails_until_told_to_start_over(spark, tree_factory,
                                                                      namespace, tmp_path):
    """Regression (issue 28 item 7): restarted with its old checkpointLocation (commits 0-3)
    and the job's changelog state gone, the query ran batch 4 on empty state, silently."""
    tree_factory(persist_delay_s=0.02)
    src, chk = tmp_path / "in", tmp_path / "chk"
    write_events(src, 4, 100, seed=5)

    def operator(**kw):
        return KeyedStatefulOperator("gone", key="user", update=count_and_sum,
                                     namespace=namespace, parallelism=2, max_parallelism=32,
                                     **kw)

    op1 = operator()
    run_stream(spark, op1, src, chk)
    assert [s.batch_id for s in op1.history] == [0, 1, 2, 3]
    op1.close()
    # the job's state is gone, as under a new, empty base path
    shutil.rmtree(op1.base_path.removeprefix("file://") + "/gone")
    write_events(src, 1, 100, seed=6, start=4)
    op2 = operator()
    with pytest.raises(Exception) as ei:
        run_stream(spark, op2, src, chk)
    msg = str(ei.value)
    assert "MissingStateError" in msg and "job 'gone': micro-batch 4 " in msg, msg[-3000:]
    assert "no complete checkpoint" in msg and op2.base_path in msg
    assert len(op2.history) == 0 and op2.coordinator.latest_checkpoint() is None
    op2.close()
    op3 = operator(on_missing_state="start_empty")  # starting over, by choice
    run_stream(spark, op3, src, chk)
    assert [s.batch_id for s in op3.history] == [4]
    write_events(tmp_path / "batch4", 1, 100, seed=6, start=4)  # batch 4's rows alone
    assert op3.state() == expected(spark, tmp_path / "batch4")
    op3.close()


def test_node_actor_and_executor_loss_mid_stream(spark, tree_factory, namespace, tmp_path):
    """With the RocksDB table (the heap table meets the same kills in the chaos and the
    demo runs, tests/runs/test_chaos_spark.py and test_demo.py)."""
    state_backend = "rocksdb"
    tree = tree_factory(persist_delay_s=0.02)
    src, chk = tmp_path / "in", tmp_path / "chk"
    write_events(src, 3, 150, seed=3)
    op = KeyedStatefulOperator("loss", key="user", update=count_and_sum,
                               namespace=namespace, parallelism=4, max_parallelism=32,
                               materialization_interval=1.0, state_backend=state_backend,
                               local_dir=str(tmp_path / "local"))
    q = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(str(src))
         .writeStream.foreachBatch(op).option("checkpointLocation", str(chk)).start())
    try:
        q.processAllAvailable()
        used = sorted({n for s in op.history for n in s.nodes.values()})
        ray.kill(ray.get_actor(used[0], namespace=namespace), no_restart=False)
        assert kill_executor(), "no RayDP executor actor found"
        write_events(src, 3, 150, seed=4, start=3)
        deadline = time.time() + 240
        while len(op.history) < 6 and time.time() < deadline:
            if q.exception() is not None:
                raise q.exception()
            time.sleep(0.5)
        q.processAllAvailable()
    finally:
        q.stop()
    assert [s.batch_id for s in op.history] == list(range(6))
    # 4 subtasks on 3 one-core executors: a Python worker runs two subtasks per batch, and
    # keeps both cached; nothing restores after the first batch until the kills
    for s in op.history[1:3]:
        assert len(set(s.executors.values())) < 4
        assert s.restores == 0, (s.batch_id, s.executors, s.nodes)
    assert op.state() == expected(spark, src)
    assert sum(s.restores for s in op.history[3:]) >= 1
    assert tree.status()
    # the subtasks materialized incrementally, from RocksDB
    comps = [type(c).__name__ for snap in
             op.coordinator.latest_checkpoint().metadata.snapshots for c in snap.components]
    assert "RocksDBHandle" in comps and "MaterializedHandle" not in comps, comps
    op.close()
