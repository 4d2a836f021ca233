"""The Spark worker's backend cache (spark_glue.worker.backend_for): which cached backends a
task reuses and which entries of other subtasks it closes as dead. Pure cache logic, so the
backends run on the in-process DirectTransport over memory:// (no Ray, no Spark)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from dstl_ray import DirectTransport, StateChangelogClient
from spark_glue import worker
from spark_glue.routing import subtask_of
from spark_glue.worker import TaskSpec, backend_for, release

JOB = "cache-job"


@pytest.fixture
def client() -> Iterator[StateChangelogClient]:
    c = StateChangelogClient(JOB, transport=DirectTransport(JOB, f"memory://wc-{uuid.uuid4().hex}"))
    yield c
    c.close()


@pytest.fixture(autouse=True)
def fresh_cache(monkeypatch: pytest.MonkeyPatch) -> Iterator[worker._Cache]:
    cache = worker._Cache()
    monkeypatch.setattr(worker, "_CACHE", cache)
    yield cache
    for e in cache.entries.values():
        e.backend.close()


def spec(batch_id: int, restore_id: int, epoch: str = "e1", parallelism: int = 2) -> TaskSpec:
    return TaskSpec(JOB, "op", "ns", "", parallelism, 8, None, lambda k, rows, s: None,
                    batch_id, epoch, restore_id, None)


def closed(e: worker._Entry) -> bool:
    return e.backend._closed


def key_of(index: int, s: TaskSpec) -> str:
    """A key that subtask ``index`` owns."""
    return next(k for k in (f"k{i}" for i in range(1000))
                if subtask_of(k, s.max_parallelism, s.parallelism) == index)


def run(s: TaskSpec, index: int, client: StateChangelogClient, *, retry: bool = False,
        fail: bool = False) -> tuple[worker._Entry, float]:
    """One task of subtask ``index``: take its backend, change state, finish (or fail)."""
    e, restore_s = backend_for(s, index, retry, client)
    e.backend.value_state("count").update(key_of(index, s), s.batch_id)
    release(e, None if fail else s.batch_id)
    return e, restore_s


def test_one_worker_running_two_subtasks_keeps_both_cached(client):
    """Regression: running subtask 1 closed subtask 0's entry, which already held this
    batch, so subtask 0 restored from storage in every batch."""
    a0, r = run(spec(0, -1), 0, client)
    b0, _ = run(spec(0, -1), 1, client)
    assert not closed(a0) and not closed(b0)
    for batch in (1, 2, 3):
        a, ra = run(spec(batch, batch - 1), 0, client)
        b, rb = run(spec(batch, batch - 1), 1, client)
        assert a.backend is a0.backend and b.backend is b0.backend
        assert (ra, rb) == (0.0, 0.0)  # no restore after the first batch
        assert not closed(a) and not closed(b)


def test_entry_holding_the_restore_checkpoint_stays_for_its_subtask(client):
    """Subtask 1 runs here before subtask 0 in a batch: 0's entry (holding the restore
    checkpoint) is still the one subtask 0 must reuse."""
    a0, _ = run(spec(0, -1), 0, client)
    run(spec(0, -1), 1, client)
    run(spec(1, 0), 1, client)  # subtask 1 first this time
    a1, r = run(spec(1, 0), 0, client)
    assert a1.backend is a0.backend and r == 0.0


def test_dead_entries_are_closed(client, fresh_cache):
    """Entries no later task of the epoch can use are closed (their writers would hold back
    the node actor's flush): older state, a failed task's half-applied rows, another epoch."""
    old, _ = run(spec(0, -1), 0, client)  # subtask 0 then runs elsewhere: holds 0 forever
    failed, _ = run(spec(0, -1), 1, client, fail=True)  # dirty, not in use
    run(spec(1, 0, parallelism=3), 2, client)
    # holds 0 == restore 0 of batch 1: subtask 0 could still come; the dirty one cannot
    assert not closed(old) and closed(failed)
    run(spec(2, 1, parallelism=3), 2, client)
    assert closed(old)  # holds 0 < restore 1: dead
    kept, _ = run(spec(3, 2, parallelism=3), 1, client)
    run(spec(3, 2, epoch="e2", parallelism=3), 0, client)  # a failed batch: a new epoch
    assert closed(kept)
    assert list(fresh_cache.entries) == [("ns", f"{JOB}/op", 3, 0)]


def test_busy_entry_of_a_concurrent_task_is_not_closed(client):
    """A task running in another thread of the worker keeps its (dirty) backend, even when
    a task of a new epoch arrives; it is closed once it finished and another task runs."""
    busy, _ = backend_for(spec(0, -1), 0, False, client)  # running, not finished
    run(spec(0, -1), 1, client)
    run(spec(0, -1, epoch="e2"), 1, client)
    assert not closed(busy)
    busy.backend.value_state("count").update(key_of(0, spec(0, -1)), 1)  # still usable by its task
    release(busy, None)  # it failed
    run(spec(1, 0, epoch="e2"), 1, client)
    assert closed(busy)


def test_retry_and_stale_own_entry_restore(client, fresh_cache):
    """A retried task never trusts its cache; an own entry of another state is replaced."""
    a0, _ = run(spec(0, -1), 0, client)
    a1, r = run(spec(1, 0), 0, client, retry=True)
    assert a1.backend is not a0.backend and closed(a0) and r > 0
    a2, r = run(spec(2, 0, epoch="e2"), 0, client)  # a replay in a new epoch
    assert a2.backend is not a1.backend and closed(a1) and r > 0
    assert len(fresh_cache.entries) == 1


def test_a_backend_left_by_another_attempt_of_the_batch_is_not_trusted(client):
    """Two attempts of subtask 0 ran batch 1 (a duplicate task); the checkpoint took the
    other one's snapshot, so this process's backend may differ: restore."""
    s1 = spec(1, 0)
    e, _ = backend_for(s1, 0, False, client)
    release(e, 1, "attempt-here")
    s2 = TaskSpec(JOB, "op", "ns", "", 2, 8, None, lambda k, rows, s: None, 2, "e1", 1, None,
                  attempts=("attempt-elsewhere", "x"))
    again, _ = backend_for(s2, 0, False, client)
    assert again is not e and closed(e)
    release(again, None)
    e3, _ = backend_for(spec(1, 0), 1, False, client)
    release(e3, 1, "mine")
    s3 = TaskSpec(JOB, "op", "ns", "", 2, 8, None, lambda k, rows, s: None, 2, "e1", 1, None,
                  attempts=("x", "mine"))
    same, _ = backend_for(s3, 1, False, client)
    assert same is e3
