"""One live driver per job (the lease in the job directory and its epoch claims), the job's
incarnations, every destructive step checking the lease, and a subsumed watermark that never
passes a checkpoint the coordinator may still complete."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

import dstl_ray as d
from dstl_ray.checkpoint import coordinator as coordinator_mod
from dstl_ray.checkpoint.lease import JobLease
from dstl_ray.checkpoint.lease_record import View
from dstl_ray.errors import JobLeaseError
from dstl_ray.state.registry import SharedStateRegistry
from dstl_ray.storage.deleter import Deleter
from dstl_ray.storage.registry import get_storage

from ..ckpt_util import MAXP, client
from .lease_util import Hooked, World


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
    for url in (a.lease.url, a.lease.claims.url(a.incarnation.epoch)):  # as if on another
        rec = json.loads(get_storage(url).read_file(url))  # machine: watched, not judged
        get_storage(url).write_file(
            url, json.dumps({**rec, "host": "elsewhere", "machine": "elsewhere"}).encode())
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
    assert coord.registry.flush(30)  # (it stays below a subsumed one until it is deleted)
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
    b.view = lambda: View(None, None)  # b looked before a's claim and record landed
    with pytest.raises(JobLeaseError, match="taken by another driver.*claimed epoch 1"):
        b.acquire(renew=False)
    a.check()
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
    # a lease that vanished under its holder while no newer epoch is claimed (a late delete
    # of a driver taken over before it): written again; once a newer epoch is claimed (a
    # driver that watched it for a TTL took over): fenced, not rewritten
    get_storage(a.url).delete(a.url)
    now[0] += 1
    assert a.renew() and get_storage(a.url).exists(a.url)
    get_storage(a.url).delete(a.url)
    a.claims.claim(a.incarnation.epoch + 1, {"holder": "0therdriver"})
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
    st = Hooked(get_storage(url))
    a, b = JobLease(url, storage=st), JobLease(url)

    def meanwhile() -> None:  # a claimed its epoch and writes its record
        with pytest.raises(JobLeaseError, match="in this process"):
            b.acquire(renew=False)

    st.hook(a.url, meanwhile)
    a.acquire(renew=False)
    assert not st.hooks, "the other lease never tried"
    assert a.held and not b.held
    a.release()


@pytest.mark.parametrize("atomic", [True, False], ids=["create-if-absent", "write-read-back"])
def test_two_drivers_taking_a_released_job_at_once_never_both_hold_it(tmp_path, remote,
                                                                     atomic):
    world, url = World(), f"file://{tmp_path}/dfs/job"
    first = JobLease(url, ttl_s=30, clock=world.clock(), sleep=world.sleep)
    first.acquire(renew=False)
    first.release()  # a clean restart: the next driver may take the job at once
    st_a, st_b = Hooked(get_storage(url), atomic), Hooked(get_storage(url), atomic)
    a = JobLease(url, ttl_s=30, clock=world.clock(), sleep=world.sleep, storage=st_a)
    b = JobLease(url, ttl_s=30, clock=world.clock(), sleep=world.sleep, storage=st_b)
    # b decided to take the job; its first write is slow and a takes the job meanwhile
    st_b.hook("", lambda: a.acquire(renew=False))
    try:
        b.acquire(renew=False)
    except JobLeaseError as e:
        assert atomic and "claimed epoch 2" in str(e)
    assert a.held
    world.t += 1.0  # well within a quarter of the TTL: check() renews nothing
    passing = []
    for lease in (a, b):
        try:
            lease.check()
            passing.append(lease)
        except JobLeaseError:
            pass
    assert len(passing) == 1, "two drivers may delete and write metadata at once"
    holder = passing[0]
    assert holder.renew() and holder.fenced is None
    assert json.loads(get_storage(url).read_file(a.url))["holder"] == holder.holder


def _orphans(base: str, n: int) -> list[str]:
    out = [f"{base}/job/dstl/node-a/orphan-{i}.dstl" for i in range(n)]
    for url in out:
        get_storage(url).write_file(url, b"a file no checkpoint names")
    return out


def _take_over(coord: d.CheckpointCoordinator) -> None:
    """Another driver took the job (it claimed the next epoch and wrote its record): this
    one learns it at its next check."""
    epoch = coord.lease.incarnation.epoch + 1
    rec = {"holder": "0therdriver", "host": "elsewhere", "machine": "elsewhere", "pid": 1,
           "epoch": epoch, "ttl_s": 30.0}
    claim = f"{coord.base_path}/_epochs/{coord.job_id}/{epoch}.epoch"
    get_storage(claim).write_file(claim, json.dumps(rec).encode())
    get_storage(coord.lease.url).write_file(coord.lease.url, json.dumps(rec).encode())


class _TakeOverOnDelete:
    """The coordinator's storage: its first delete lets another driver take the job over."""

    def __init__(self, coord: d.CheckpointCoordinator) -> None:
        self.inner, self.coord, self.deleted = coord.storage, coord, []

    def delete(self, url: str) -> None:
        if not self.deleted:
            _take_over(self.coord)
        self.inner.delete(url)
        self.deleted.append(url)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_orphan_cleanup_checks_the_lease_before_every_delete(tmp_path):
    base = f"file://{tmp_path}/dfs"
    orphans = _orphans(base, 5)
    coord = _coord(base)
    coord.storage = st = _TakeOverOnDelete(coord)
    with pytest.raises(JobLeaseError, match="taken over"):
        coord.restore(client("job", base), "op", 1, materialization_interval=None)
    assert len(st.deleted) == 1, "a fenced driver went on deleting the job's files"
    assert sum(get_storage(u).exists(u) for u in orphans) == 4


def test_dropping_broken_checkpoints_checks_the_lease_before_every_delete(tmp_path,
                                                                        monkeypatch):
    base = f"file://{tmp_path}/dfs"
    first = _coord(base, retained=3)
    b = first.restore(client("job", base), "op", 1, materialization_interval=None)[0]
    done = []
    for i in range(3):
        b.value_state("v").update("k", i)
        done.append(first.trigger_checkpoint().result(timeout=30))
    first.shutdown()
    coord = _coord(base, retained=3)
    deleted: list[str] = []

    def delete_metadata(url: str) -> None:
        if not deleted:
            _take_over(coord)
        deleted.append(url)

    monkeypatch.setattr(coordinator_mod, "delete_metadata", delete_metadata)
    with pytest.raises(JobLeaseError, match="taken over"):  # back to the oldest: the two
        coord.restore(client("job", base), "op", 1, checkpoint=done[0].metadata_url,
                      materialization_interval=None)  # newer ones are dropped
    assert len(deleted) == 1


def test_a_fenced_coordinator_tells_its_backends_no_subsumed_watermark(tmp_path):
    base = f"file://{tmp_path}/dfs"
    coord = _coord(base, retained=1)
    b = coord.restore(client("job", base), "op", 1, materialization_interval=None)[0]
    b.value_state("v").update("k", 1)
    coord.trigger_checkpoint().result(timeout=30)
    told_while_fenced: list[int] = []

    def notify(watermark: int) -> None:  # the merged-file pool deletes by it
        if coord.lease.fenced:
            told_while_fenced.append(watermark)

    b.notify_checkpoint_subsumed = notify
    _take_over(coord)
    with pytest.raises(JobLeaseError, match="taken over"):
        coord.lease.check(force=True)
    with pytest.raises(d.CheckpointDeclinedError, match="fenced"):
        coord.trigger_checkpoint().result(timeout=30)
    deadline = time.monotonic() + 10
    while coord._pending and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the declined checkpoint's done-callback (_forget) has run
    assert told_while_fenced == []
    coord.abandon()


def test_deletes_skipped_for_fencing_are_not_counted_as_deleted(tmp_path):
    url = f"file://{tmp_path}/dfs/job/dstl/f.dstl"
    get_storage(url).write_file(url, b"x")
    fenced: list[str] = []

    def guard() -> None:  # the lease's check: passes until the driver is fenced
        if fenced:
            raise JobLeaseError(fenced[0])

    gate = threading.Event()
    deleter = Deleter(workers=1)
    deleter.submit(lambda: gate.wait(30), "the test's gate")  # deletes queue up behind it
    reg = SharedStateRegistry(deleter=deleter)
    reg.guard = guard
    reg.checkpoint_started(1)
    reg.register(1, {"f": url})
    reg.checkpoint_finished(1)
    reg.release(1)  # decided under the lease, queued
    fenced.append("taken over")  # before the delete runs
    gate.set()
    assert deleter.flush(30) and deleter.stats.fenced == 1
    assert get_storage(url).exists(url)
    assert reg.deleted_count == 0 and list(reg.deleted) == []
