"""Initial state (issue 30 item 2) on RayDP: a job started from another job's checkpoint, at
another parallelism, holds that job's state plus its own batches, and the other job's files
are untouched; a job started from another job's savepoint (``op.savepoint()``) holds the state
the savepoint was taken with; a job started from a DataFrame loads it in batch 0, once."""

from __future__ import annotations

import sys
from pathlib import Path

from pyspark import cloudpickle

from spark_glue import KeyedStatefulOperator

from .test_stateful_operator import count_and_sum, expected, run_stream, write_events

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_a_job_starts_from_another_jobs_checkpoint(spark, tree_factory, namespace, tmp_path):
    tree_factory(persist_delay_s=0.02)
    src = tmp_path / "in"
    write_events(src, 2, 150, seed=11)
    first = KeyedStatefulOperator("bootstrap-from", key="user", update=count_and_sum,
                                  namespace=namespace, parallelism=3, max_parallelism=32,
                                  materialization_interval=0.0)
    run_stream(spark, first, src, tmp_path / "chk1")
    savepoint = first.savepoint()  # the state of its latest batch, in a directory of its own
    assert "/bootstrap-from/savepoint-" in savepoint
    first_state = first.state()
    assert first.state(savepoint) == first_state
    first.close()
    job_dir = first.base_path.removeprefix("file://") + "/bootstrap-from"
    before = {p: p.stat().st_mtime_ns for p in Path(job_dir).rglob("*")
              if p.is_file() and p.name != "_lease"}
    more = tmp_path / "more"
    write_events(more, 1, 150, seed=12)
    op = KeyedStatefulOperator("bootstrap-to", key="user", update=count_and_sum,
                               namespace=namespace, parallelism=2, max_parallelism=32,
                               materialization_interval=0.0, initial_state="bootstrap-from")
    pinned = op.coordinator.restore_point.current().metadata_url
    assert pinned.endswith("/bootstrap-from/chk-1/_metadata"), pinned
    run_stream(spark, op, more, tmp_path / "chk2")
    want = expected(spark, src)
    add = expected(spark, more)
    for name in ("count", "sum"):
        for user, v in add[name].items():
            want[name][user] = want[name].get(user, 0) + v
    for user, hist in add["hist"].items():
        h = want["hist"].setdefault(user, {})
        for b, n in hist.items():
            h[b] = h.get(b, 0) + n
    assert op.state() == want
    op.close()
    after = {p: p.stat().st_mtime_ns for p in Path(job_dir).rglob("*")
             if p.is_file() and p.name != "_lease"}
    assert {p: t for p, t in after.items() if p in before} == before  # none touched
    assert set(before) <= set(after)
    # a third job starts from the savepoint, at parallelism 1
    sp = KeyedStatefulOperator("bootstrap-sp", key="user", update=count_and_sum,
                               namespace=namespace, parallelism=1, max_parallelism=32,
                               materialization_interval=0.0, initial_state=savepoint)
    sp.process_batch(spark.createDataFrame([("new-user", 4)], "user STRING, amount LONG"), 0)
    got = sp.state()
    sp.close()
    assert got["count"].pop("new-user") == 1 and got["sum"].pop("new-user") == 4
    got["hist"].pop("new-user")
    assert got == first_state


def test_a_job_starts_from_a_dataframe_loaded_in_batch_zero(spark, tree_factory, namespace):
    """A DataFrame of key and state columns is loaded in batch 0 by the subtasks owning the
    keys, before the batch's rows (its counts go on from the loaded ones); a null leaves a
    state unset; later batches and a restarted job never read it again."""
    tree_factory(persist_delay_s=0.02)
    initial = spark.createDataFrame(
        [(f"u{i}", 100 + i, None if i % 2 else 5 * i) for i in range(40)] +
        [("only-initial", 7, 7)], "user STRING, count LONG, sum LONG")
    batches = [[(f"u{(i * 7) % 50}", i % 9 + 1) for i in range(b * 120, b * 120 + 120)]
               for b in range(3)]
    common = dict(key="user", update=count_and_sum, namespace=namespace, parallelism=2,
                  max_parallelism=32, materialization_interval=0.0, initial_state=initial)
    op = KeyedStatefulOperator("from-frame", **common)
    for b in (0, 1):
        op.process_batch(spark.createDataFrame(batches[b], "user STRING, amount LONG"), b)
    got = op.state()
    op.close()
    seen: dict[str, list[int]] = {}
    for u, a in batches[0] + batches[1]:
        seen.setdefault(u, []).append(a)
    for i in range(40):
        u = f"u{i}"
        assert got["count"][u] == 100 + i + len(seen.get(u, []))
        if i % 2:  # no initial sum: it started from nothing
            assert got["sum"].get(u) == (sum(seen[u]) if u in seen else None)
        else:
            assert got["sum"][u] == 5 * i + sum(seen.get(u, []))
    assert got["count"]["only-initial"] == 7 and got["sum"]["only-initial"] == 7
    # a restart with the DataFrame given again loads nothing: the job has its checkpoints
    again = KeyedStatefulOperator("from-frame", **common)
    again.process_batch(spark.createDataFrame(batches[2], "user STRING, amount LONG"), 2)
    later = again.state()
    again.close()
    for u, _a in batches[2]:
        got["count"][u] = got["count"].get(u, 0) + 1
    assert later["count"] == got["count"]
