"""One live driver per job (the lease in the job directory), the job's incarnations, and a
subsumed watermark that never passes a checkpoint the coordinator may still complete."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import dstl_ray as d
from dstl_ray.checkpoint.lease import JobLease
from dstl_ray.errors import JobLeaseError
from dstl_ray.storage.registry import get_storage

from ..ckpt_util import MAXP, client


def _coord(base: str, job: str = "job", **kw) -> d.CheckpointCoordinator:
    return d.CheckpointCoordinator(job, base, max_parallelism=MAXP, **kw)


def _inflight(base: str, job: str = "job") -> str:
    """A changelog file the running driver has just written and no checkpoint names yet."""
    url = f"{base}/{job}/dstl/node-a/inflight.dstl"
    get_storage(url).write_file(url, b"bytes of a pending checkpoint")
    return url


def test_a_second_live_driver_is_refused_and_deletes_nothing(tmp_path):
    base = f"file://{tmp_path}/dfs"
    first = _coord(base)
    bs = first.restore(client("job", base), "op", 1, materialization_interval=None)
    bs[0].value_state("v").update("k", 1)
    first.trigger_checkpoint().result(timeout=30)
    pending = _inflight(base)
    second = _coord(base)
    with pytest.raises(JobLeaseError, match="held by another live driver") as ei:
        second.restore(client("job", base), "op", 1, materialization_interval=None)
    assert first.lease.holder in str(ei.value) and str(os.getpid()) in str(ei.value)
    assert get_storage(pending).exists(pending), "the second driver's cleanup deleted it"
    with pytest.raises(JobLeaseError):
        second.trigger_checkpoint()
    first.trigger_checkpoint().result(timeout=30)  # the first driver is unaffected
    first.shutdown()
    # a clean shutdown gives the job up: the next driver starts at once
    third = _coord(base)
    bs = third.restore(client("job", base), "op", 1, materialization_interval=None)
    assert bs[0].dump() == {"v": {"k": 1}}
    third.shutdown()


def test_a_dead_drivers_lease_is_taken_over(tmp_path):
    base = f"file://{tmp_path}/dfs"
    crashed = _coord(base)
    crashed.restore(client("job", base), "op", 1)
    crashed.abandon()  # dies in this process: pid alive, holder gone
    after_crash = _coord(base)
    after_crash.restore(client("job", base), "op", 1)
    assert after_crash.incarnation.epoch > crashed.lease.incarnation.epoch
    after_crash.shutdown()
    # a driver process on this host, renewing: refused; killed (its pid is gone): taken at
    # once, without waiting for its TTL
    code = ("import sys, time; from dstl_ray.checkpoint.lease import JobLease; "
            "JobLease(sys.argv[1], ttl_s=2).acquire(); print('held', flush=True); "
            "time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, f"{base}/job"], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        alive = _coord(base)
        with pytest.raises(JobLeaseError, match=f"pid {p.pid}"):
            alive.restore(client("job", base), "op", 1)
    finally:
        p.kill()
        p.wait()
    taker = _coord(base, lease_ttl_s=60)
    t0 = time.monotonic()
    taker.restore(client("job", base), "op", 1)
    assert time.monotonic() - t0 < 10
    taker.shutdown()


def test_a_fenced_coordinator_declines_and_deletes_nothing(tmp_path):
    base = f"file://{tmp_path}/dfs"
    a = _coord(base, retained=1, lease_ttl_s=2)
    bs = a.restore(client("job", base), "op", 1, materialization_interval=None)
    bs[0].value_state("v").update("k", 1)
    first = a.trigger_checkpoint().result(timeout=30)
    a.lease._stop.set()  # a is paused: no renewals
    rec = json.loads(get_storage(a.lease.url).read_file(a.lease.url))
    get_storage(a.lease.url).write_file(  # as seen from another machine
        a.lease.url, json.dumps({**rec, "host": "elsewhere", "machine": "elsewhere"}).encode())
    b = _coord(base, retained=1)
    t0 = time.monotonic()
    b.restore(client("job", base), "op", 1, materialization_interval=None)
    assert time.monotonic() - t0 >= 2  # b watched a's lease unchanged for its full TTL
    bs[0].value_state("v").update("k", 2)
    with pytest.raises(d.CheckpointDeclinedError, match="fenced"):
        a.trigger_checkpoint().result(timeout=30)
    assert get_storage(first.metadata_url).exists(first.metadata_url)
    assert all(get_storage(u).exists(u) for u in first.files.values())
    b.shutdown()


def test_incarnations_grow_after_the_job_directory_was_deleted(tmp_path):
    url = f"file://{tmp_path}/dfs/job"
    a = JobLease(url)
    inc = a.acquire(renew=False)
    a.abandon()
    get_storage(url).delete(a.url)  # DELETE_ON_CANCELLATION and a wiped directory
    b = JobLease(url)
    assert b.acquire(renew=False).epoch > inc.epoch
    b.release()


def test_watermark_never_passes_a_checkpoint_that_may_still_complete(tmp_path):
    base = f"file://{tmp_path}/dfs"
    coord = _coord(base, retained=2)
    b = coord.restore(client("job", base), "op", 1, materialization_interval=None)[0]
    # a fresh coordinator may complete batch 0 (a Spark query's first micro-batch)
    assert coord.subsumed_watermark() < 0
    for batch in range(4):
        b.value_state("v").update("k", batch)
        coord.complete_checkpoint(batch, [b.snapshot(batch).result(timeout=30)])
        assert coord.subsumed_watermark() < min(
            c.checkpoint_id for c in coord.completed_checkpoints())
    assert coord.subsumed_watermark() == 1
    # batch 3 is replayed: checkpoint 3 completes again, so the watermark stays below it
    coord.drop_checkpoints_from(3)
    assert coord.subsumed_watermark() < 3
    coord.drop_checkpoints_from(2)
    assert coord.subsumed_watermark() < 2
    coord.shutdown()


def test_two_drivers_starting_at_once_on_a_fresh_directory_one_wins(tmp_path):
    url = f"file://{tmp_path}/dfs/job"
    a, b = JobLease(url), JobLease(url)
    a.acquire(renew=False)
    b.read = lambda: None  # b looked before a's file landed
    with pytest.raises(JobLeaseError, match="taken by another driver"):
        b.acquire(renew=False)
    a.release()


def test_a_lease_that_cannot_be_read_is_neither_taken_nor_renewed(tmp_path):
    now = [1000.0]
    url = f"file://{tmp_path}/dfs/job"
    a = JobLease(url, ttl_s=10, clock=lambda: now[0])
    a.acquire(renew=False)
    get_storage(a.url).write_file(a.url, b"{torn")
    with pytest.raises(JobLeaseError, match="cannot read the job lease"):
        JobLease(url, clock=lambda: now[0]).acquire(renew=False)
    with pytest.raises(JobLeaseError):
        a.renew()  # on doubt nothing is written over the file
    assert get_storage(a.url).read_file(a.url) == b"{torn"
    # a lease that vanished under its holder (another driver may create it at once): fenced,
    # not rewritten
    get_storage(a.url).delete(a.url)
    now[0] += 1
    assert not a.renew() and a.fenced and not get_storage(a.url).exists(a.url)


def test_a_failed_restore_keeps_a_lease_it_already_held(tmp_path):
    base = f"file://{tmp_path}/dfs"
    coord = _coord(base)
    coord.restore(client("job", base), "op", 1)
    inc = coord.incarnation
    with pytest.raises(d.RestoreError):
        coord.restore(client("job", base), "op", 1, checkpoint=f"{base}/nope/chk-1/_metadata")
    assert coord.lease.held and coord.incarnation == inc
    with pytest.raises(JobLeaseError):
        _coord(base).restore(client("job", base), "op", 1)
    coord.shutdown()


def test_a_driver_taking_the_job_is_alive_to_the_others_of_its_process(tmp_path):
    url = f"file://{tmp_path}/dfs/job"
    crashed = JobLease(url)
    crashed.acquire(renew=False)
    crashed.abandon()  # its record stays: the next driver writes over it
    b = JobLease(url)

    def settle(s: float) -> None:  # a wrote its record and waits to read it back
        with pytest.raises(JobLeaseError, match="in this process"):
            b.acquire(renew=False)
        time.sleep(s)

    a = JobLease(url, sleep=settle)
    a.acquire(renew=False)
    assert a.held and not b.held
    a.release()
