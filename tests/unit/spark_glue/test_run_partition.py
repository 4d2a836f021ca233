"""One subtask's task (spark_glue.worker.run_partition) in this process, without Spark or Ray:
the map side's payloads in, the snapshot, outputs and attempt out; the snapshot carries the
largest event time and the batch's processing time; timers fire after the rows; the next
batch reuses the cached backend only when it names this attempt."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator

import pandas as pd
import pyarrow as pa
import pytest

from dstl_ray import (
    ChangelogKeyedStateBackend,
    CheckpointCoordinator,
    DirectTransport,
    KeyGroupRange,
    StateChangelogClient,
)
from dstl_ray.errors import StateError
from dstl_ray.state.snapshot import KeyedStateSnapshot
from spark_glue import worker
from spark_glue.routing import splitter
from spark_glue.vectorized import outputs_table
from spark_glue.worker import TaskSpec, run_partition

JOB, MAXP = "run-partition", 8


@pytest.fixture(autouse=True)
def in_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    base = f"memory://rp-{uuid.uuid4().hex}"
    client = StateChangelogClient(JOB, transport=DirectTransport(JOB, base))
    cache = worker._Cache()
    monkeypatch.setattr(worker, "_CACHE", cache)
    monkeypatch.setattr(worker, "_client", lambda spec: client)
    yield
    for e in cache.entries.values():
        e.backend.close()
    client.close()


def payloads(rows: list[tuple[str, int]]) -> list[tuple]:
    batch = pa.RecordBatch.from_pydict({"user": [u for u, _ in rows], "ts": [t for _, t in rows]})
    out = []
    for rb in splitter("user", MAXP, 1, [0])([batch]):
        out += list(zip(*(c.to_pylist() for c in rb.columns), strict=True))
    return out


def count(key, rows, state):
    c = state.value("n")
    c.set(c.get(0) + len(rows))
    state.timers.register_event_time(max(r["ts"] for r in rows) + 10)
    return [(key, c.get())]


def closed(key, timer, state):
    return [(key, "closed", timer.time_ms)]


def spec(batch: int, restore: int, attempts=(), api="rows", update=count) -> TaskSpec:
    return TaskSpec(JOB, "op", "ns", "", 1, MAXP, None, update, batch, "e1", restore, None,
                    key="user", api=api, on_timer=closed, event_time="ts", allowed_delay_ms=5,
                    now_ms=1234, attempts=attempts)


def test_a_task_applies_rows_fires_timers_and_reports_its_attempt():
    (r0,) = run_partition(spec(0, -1), 0, iter(payloads([("a", 100), ("b", 100)])))
    assert sorted(r0["outputs"]) == [("a", 1), ("b", 1)]  # timers at 110, watermark 95
    snap = json.loads(r0["snapshot"])
    assert snap["event_time_ms"] == 100 and snap["processing_time_ms"] == 1234
    assert r0["rows"] == 2 and r0["keys"] == 2 and r0["attempt_id"]
    # batch 1 names batch 0's attempt: the cached backend goes on; the watermark (125)
    # passes both timers at 110, which fire after the rows, in registration order
    (r1,) = run_partition(spec(1, 0, (r0["attempt_id"],)), 0, iter(payloads([("b", 130)])))
    assert r1["restore_s"] == 0.0
    assert r1["outputs"] == [("b", 2), ("a", "closed", 110), ("b", "closed", 110)]
    # batch 2 names another attempt of batch 1: this backend is not trusted but restored
    # (from nothing here: the spec has no checkpoint URL)
    (r2,) = run_partition(spec(2, 1, ("someone-else",)), 0, iter(payloads([("b", 150)])))
    assert r2["restore_s"] > 0 and r2["outputs"] == [("b", 1)]


def vec(keys, rows, state):
    n = state.value("n").get(0) + rows.groupby("user", sort=False).size().to_numpy()
    state.value("n").set(n)
    return pd.DataFrame({"user": keys, "n": n})


def test_the_pandas_api_returns_its_outputs_as_arrow():
    (r,) = run_partition(spec(0, -1, api="pandas", update=vec), 0,
                         iter(payloads([("a", 1), ("a", 2), ("b", 3)])))
    from spark_glue.vectorized import outputs_table

    t = outputs_table(r["output_ipc"])
    assert dict(zip(t.column("user").to_pylist(), t.column("n").to_pylist(), strict=True)) == \
        {"a": 2, "b": 1}


def test_a_first_batch_from_another_jobs_checkpoint_names_none_of_its_files():
    """initial_state (issue 30 item 2): the task restores its key groups of the other job's
    checkpoint and materializes them into this job's files before its snapshot; restored
    only, the snapshot named the other job's changelog files (deleted with it later)."""
    base = worker._client(None).transport.base_path
    other = StateChangelogClient("other", transport=DirectTransport("other", base))
    coord = CheckpointCoordinator("other", base, max_parallelism=MAXP)
    b = ChangelogKeyedStateBackend(other, "op", KeyGroupRange(0, MAXP - 1), MAXP,
                                   materialization_interval=None)
    coord.register_backend(b)
    for user in ("a", "b", "zz"):
        b.value_state("n").update(user, 40)
    source = coord.trigger_checkpoint().result(timeout=30)
    first = dataclasses.replace(spec(0, -1), restore_url=source.metadata_url, initial=True)
    (r0,) = run_partition(first, 0, iter(payloads([("a", 100)])))
    assert r0["outputs"] == [("a", 41)]  # the other job's count, and this batch's row
    snap = KeyedStateSnapshot.from_dict(json.loads(r0["snapshot"]), base)
    named = snap.files(base, f"{base}/{JOB}/chk-0").values()
    assert named and not any("/other/" in u for u in named), named
    coord.shutdown()
    other.close()


def remind(keys, rows, state):
    """Timers of every key in one call: a processing-time one for all (due at once), and
    event-time ones per key, aligned on the Series' index."""
    state.timers.register_processing_time(state.timers.now)
    state.timers.register_event_time(pd.Series([101, 150], index=["b", "a"]))
    with pytest.raises(StateError, match="got 1 values for 2 keys"):
        state.timers.register_event_time([5])


def fired(key, timer, state):
    """The pandas API's on_timer: one key's view; returns a DataFrame (or None)."""
    return pd.DataFrame({"user": [key], "domain": [timer.domain], "t": [timer.time_ms]})


def test_the_pandas_api_registers_every_keys_timers_in_one_call():
    first = dataclasses.replace(spec(0, -1, api="pandas", update=remind), on_timer=fired)
    (r0,) = run_partition(first, 0, iter(payloads([("a", 100), ("b", 100)])))
    got = outputs_table(r0["output_ipc"]).to_pylist()
    assert sorted((o["user"], o["domain"], o["t"]) for o in got) == [
        ("a", "processing", 1234), ("b", "processing", 1234)]  # the watermark is 95
    second = dataclasses.replace(spec(1, 0, (r0["attempt_id"],), api="pandas",
                                      update=lambda keys, rows, state: None), on_timer=fired)
    (r1,) = run_partition(second, 0, iter(payloads([("c", 200)])))  # watermark 195
    assert [(o["user"], o["t"]) for o in outputs_table(r1["output_ipc"]).to_pylist()] == [
        ("b", 101), ("a", 150)]
