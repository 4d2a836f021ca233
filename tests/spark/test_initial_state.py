"""Initial state (issue 30 item 2) on RayDP: a job started from another job's checkpoint, at
another parallelism, holds that job's state plus its own batches, and the other job's files
are untouched."""

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
